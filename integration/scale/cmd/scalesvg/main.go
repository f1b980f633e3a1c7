// Command scalesvg draws docs/scale.svg (per-host cost against N, before
// and after) from the JSON reports of the scale harness (make scale).
// With -summary it prints the after report's growth table and verdicts,
// judged anew by this checkout's harness, instead.
package main

import (
	"bytes"
	"flag"
	"fmt"
	"os"

	"github.com/ringipam/ringipam/integration/scale/harness"
)

func main() {
	before := flag.String("before", "", "JSON report of the commit before (optional)")
	after := flag.String("after", "", "JSON report of this checkout (optional)")
	out := flag.String("out", "docs/scale.svg", "the picture")
	summary := flag.Bool("summary", false, "print the after report's growth table and verdicts (judged anew), draw nothing")
	flag.Parse()
	var b, a *harness.Report
	for _, x := range []struct {
		path string
		to   **harness.Report
	}{{*before, &b}, {*after, &a}} {
		if x.path == "" {
			continue
		}
		r, err := harness.ReadJSON(x.path)
		if err != nil {
			fmt.Fprintln(os.Stderr, "scalesvg:", err)
			os.Exit(1)
		}
		*x.to = &r
	}
	if *summary {
		if a == nil {
			fmt.Fprintln(os.Stderr, "scalesvg: -summary needs -after")
			os.Exit(2)
		}
		harness.PrintSummary(os.Stdout, a.Results)
		return
	}
	var buf bytes.Buffer
	if err := harness.SVG(&buf, b, a); err != nil {
		fmt.Fprintln(os.Stderr, "scalesvg:", err)
		os.Exit(1)
	}
	if err := os.WriteFile(*out, buf.Bytes(), 0o644); err != nil {
		fmt.Fprintln(os.Stderr, "scalesvg:", err)
		os.Exit(1)
	}
}
