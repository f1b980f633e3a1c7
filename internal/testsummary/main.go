// Command testsummary reads `go test -json` on stdin, prints what a plain
// `go test` prints (each package's result line, the output of failed tests,
// the reason of skipped ones), and ends with one line per package: how
// many tests passed, failed and were skipped. It exits non-zero when a test
// failed, a package failed to build or run, or a package under the
// integration/ tree ran no test at all (every one skipped): a real-parts
// suite must never pass by skipping.
//
// Used by `make integration`; not part of the product.
package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
)

type event struct {
	Action  string
	Package string
	Test    string
	Output  string
}

type tally struct {
	pass, fail, skip int
	failed           bool // the package itself failed (build error, panic, exit)
	noTests          bool // "no test files"
}

func main() {
	code, err := summarize(os.Stdin, os.Stdout, "/integration/")
	if err != nil {
		fmt.Fprintln(os.Stderr, "testsummary:", err)
		os.Exit(2)
	}
	os.Exit(code)
}

// summarize does the work of main; suites marks the packages that must run
// at least one test.
func summarize(in io.Reader, out io.Writer, suites string) (int, error) {
	pkgs := map[string]*tally{}
	get := func(p string) *tally {
		t, ok := pkgs[p]
		if !ok {
			t = &tally{}
			pkgs[p] = t
		}
		return t
	}
	buffered := map[string]*strings.Builder{} // output of running tests
	sc := bufio.NewScanner(in)
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	for sc.Scan() {
		line := sc.Bytes()
		var e event
		if err := json.Unmarshal(line, &e); err != nil || e.Action == "" {
			fmt.Fprintf(out, "%s\n", line) // build errors come as plain text
			continue
		}
		t := get(e.Package)
		if e.Test == "" {
			if strings.Contains(e.Output, "[no test files]") {
				t.noTests = true
			}
			if e.Output != "" && !strings.HasPrefix(e.Output, "=== ") && !strings.HasPrefix(e.Output, "--- PASS") {
				fmt.Fprint(out, e.Output)
			}
			if e.Action == "fail" {
				t.failed = true
			}
			continue
		}
		key := e.Package + " " + e.Test
		b := buffered[key]
		if b == nil {
			b = &strings.Builder{}
			buffered[key] = b
		}
		b.WriteString(e.Output)
		switch e.Action {
		case "pass", "fail", "skip":
			switch {
			case e.Action == "fail":
				fmt.Fprint(out, b.String())
			case e.Action == "skip" && !strings.Contains(e.Test, "/"):
				for _, l := range strings.SplitAfter(b.String(), "\n") {
					if strings.Contains(l, "SKIP") || strings.Contains(l, ": ") && !strings.HasPrefix(l, "=== ") {
						fmt.Fprint(out, l)
					}
				}
			}
			delete(buffered, key)
			if strings.Contains(e.Test, "/") {
				continue
			}
			switch e.Action {
			case "pass":
				t.pass++
			case "fail":
				t.fail++
			case "skip":
				t.skip++
			}
		}
	}
	if err := sc.Err(); err != nil {
		return 2, err
	}
	names := make([]string, 0, len(pkgs))
	for p := range pkgs {
		if pkgs[p].noTests || p == "" {
			continue
		}
		names = append(names, p)
	}
	slices.Sort(names)
	code := 0
	fmt.Fprintln(out, "\ntest summary (top-level tests):")
	for _, p := range names {
		t := pkgs[p]
		note := ""
		switch {
		case t.fail > 0 || t.failed:
			note = "  FAILED"
			code = 1
		case strings.Contains(p, suites) && t.pass == 0:
			note = "  FAILED: a real-parts suite that ran no test (all skipped)"
			code = 1
		}
		fmt.Fprintf(out, "  %-60s %4d passed %3d failed %3d skipped%s\n", p, t.pass, t.fail, t.skip, note)
	}
	return code, nil
}
