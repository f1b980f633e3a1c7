// Command scalesvg draws docs/scale.svg (per-host cost against N, before
// and after) from the JSON reports of the scale harness (make scale).
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
