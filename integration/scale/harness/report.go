package harness

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
)

// Figure is one per-host figure the report and the picture show.
type Figure struct {
	Key, Name string
	Of        func(Result) float64
}

// Figures are the figures compared between sizes.
var Figures = []Figure{
	{"idle_requests", "idle: requests per host per minute (keep-alives aside)", func(r Result) float64 {
		return r.IdlePerHostMinute(Cost.RequestsTotal)
	}},
	{"idle_keepalives", "idle: lease keep-alives per host per minute", func(r Result) float64 {
		return r.IdlePerHostMinute(func(c Cost) float64 { return c.KeepAlives })
	}},
	{"idle_bytes_sent", "idle: etcd bytes sent per host per minute", func(r Result) float64 {
		return r.IdlePerHostMinute(func(c Cost) float64 { return c.BytesSent })
	}},
	{"idle_watch_msgs", "idle: watch messages per host per minute", func(r Result) float64 {
		return r.IdlePerHostMinute(func(c Cost) float64 { return c.WatchMsgs })
	}},
	{"idle_cpu_ms", "idle: agent CPU ms per host per minute", func(r Result) float64 {
		return r.IdlePerHostMinute(func(c Cost) float64 { return c.CPU * 1000 })
	}},
	{"add_bytes", "etcd bytes per steady-state ADD (probe host)", func(r Result) float64 { return r.AddBytes }},
	{"ring_watch_msgs", "ring change: watch messages per host", func(r Result) float64 {
		p := r.Phase("ring")
		return p.PerHost(p.Cost.WatchMsgs)
	}},
	{"ring_requests", "ring change: requests per host", func(r Result) float64 {
		p := r.Phase("ring")
		return p.PerHost(p.Cost.RequestsTotal())
	}},
	{"publish_watch_msgs", "port publish: watch messages per host", func(r Result) float64 {
		p := r.Phase("publish")
		return p.PerHost(p.Cost.WatchMsgs)
	}},
	{"join_watch_msgs", "host joins: watch messages per host", func(r Result) float64 {
		p := r.Phase("join")
		return p.PerHost(p.Cost.WatchMsgs)
	}},
	{"start_last_s", "simultaneous start: seconds until the last first ADD succeeded", func(r Result) float64 { return r.StartLast }},
	{"heap_per_host_kb", "heap per simulated host, KB", func(r Result) float64 { return r.HeapPerHost / 1024 }},
}

// PrintTable prints one size's per-host figures, phase by phase.
func PrintTable(w io.Writer, r Result) {
	fmt.Fprintf(w, "\n== %s: N = %d hosts, %d etcd member(s), %d allocations per host ==\n", r.Label, r.N, r.Members, r.PerHost)
	if r.Full > 0 {
		fmt.Fprintf(w, "   %d hosts with the whole agent, %d hollow (no --routes, no --ingress: no copies of the rings, hosts and ports)\n", r.Full, r.N-r.Full)
	}
	if r.WidePool {
		fmt.Fprintf(w, "   pool %s and %s: 1 536 blocks of 64 (SCALE_POOL)\n", Subnet, WideSubnet)
	} else {
		fmt.Fprintf(w, "   pool %s: 1 024 blocks of 64 (SCALE_POOL)\n", Subnet)
	}
	fmt.Fprintf(w, "%-9s %6s %7s %10s %9s %10s %12s %12s %9s %9s %8s  %s\n", "phase", "hosts", "secs",
		"req/host", "ka/host", "watch/host", "sent B/host", "recv B/host", "events", "proposals", "cpu/host", "requests by method (cluster)")
	for _, p := range r.Phases {
		var ms []string
		for _, m := range p.Cost.Methods() {
			ms = append(ms, fmt.Sprintf("%s=%.0f", m, p.Cost.Requests[m]))
		}
		fmt.Fprintf(w, "%-9s %6d %7.1f %10.1f %9.1f %10.1f %12.0f %12.0f %9.0f %9.0f %7.1fms  %s\n", p.Name, p.Hosts, p.Cost.Seconds,
			p.PerHost(p.Cost.RequestsTotal()), p.PerHost(p.Cost.KeepAlives), p.PerHost(p.Cost.WatchMsgs),
			p.PerHost(p.Cost.BytesSent), p.PerHost(p.Cost.BytesRecv), p.Cost.MVCCEvents, p.Cost.Proposals,
			p.PerHost(p.Cost.CPU*1000), strings.Join(ms, " "))
	}
	for _, p := range r.Phases {
		if p.Note != "" {
			fmt.Fprintf(w, "  %s: %s\n", p.Name, p.Note)
		}
	}
	fmt.Fprintf(w, "  per host per minute idle: %.1f requests (keep-alives aside), %.1f keep-alives, %.0f bytes sent, %.1f watch messages, %.1f ms CPU\n",
		Figures[0].Of(r), Figures[1].Of(r), Figures[2].Of(r), Figures[3].Of(r), Figures[4].Of(r))
	fmt.Fprintf(w, "  ADD: p50 %.1f ms p99 %.1f ms (fill), churn p50 %.1f ms p99 %.1f ms; %.0f etcd bytes per steady-state ADD (probe host), %.0f per fill ADD (etcd, background included)\n",
		r.FillP50, r.FillP99, r.ChurnP50, r.ChurnP99, r.AddBytes, r.AddEtcdBytes)
	fmt.Fprintf(w, "  heap %.0f KB and %.1f goroutines per host; db size %.1f MB; agents' warnings: %d\n",
		r.HeapPerHost/1024, r.GoroutinesPerHost, dbSize(r)/1e6, r.Warnings)
	for _, warning := range r.FirstWarnings {
		fmt.Fprintf(w, "  agents' warning: %s\n", warning)
	}
	fmt.Fprintf(w, "  check: %s\n", r.Findings)
}

// Verdict is one target's outcome.
type Verdict struct {
	Target string  `json:"target"`
	Figure float64 `json:"figure"`
	Limit  float64 `json:"limit"`
	Met    bool    `json:"met"`
	Detail string  `json:"detail"`
}

func (v Verdict) String() string {
	m := "MISSED"
	if v.Met {
		m = "met"
	}
	return fmt.Sprintf("%-6s %s: %s", m, v.Target, v.Detail)
}

// byN returns the result of size n (ok false if not run).
func byN(rs []Result, n int) (Result, bool) {
	for _, r := range rs {
		if r.N == n {
			return r, true
		}
	}
	return Result{}, false
}

// Verdicts judges every target of issue 41 items 2 and 3 and issue 42
// items 1 and 3 on the results of one label.
func Verdicts(rs []Result) []Verdict {
	var out []Verdict
	le := func(target string, fig, limit float64, unit string) {
		out = append(out, Verdict{target, fig, limit, fig <= limit, fmt.Sprintf("%.1f %s (limit %.0f)", fig, unit, limit)})
	}
	growth := func(target string, f Figure, a, b int, limit float64, watches bool) {
		ra, oka := byN(rs, a)
		rb, okb := byN(rs, b)
		if !oka || !okb {
			out = append(out, Verdict{Target: target, Limit: limit, Detail: fmt.Sprintf("not measured (N=%d and N=%d both needed)", a, b)})
			return
		}
		fa, fb := f.Of(ra), f.Of(rb)
		per := ""
		// Hollow agents watch nothing, so an event's watch messages all
		// go to the whole agents: between runs with other shares of
		// whole agents, the figures compared are per whole agent (the
		// figure per host divided by the share).
		if watches && fullShare(ra) != fullShare(rb) {
			fa, fb = fa/fullShare(ra), fb/fullShare(rb)
			per = fmt.Sprintf(" per whole agent: %s at N=%d, %s at N=%d", fullOf(ra), a, fullOf(rb), b)
		}
		g := fb / max(fa, 1e-9)
		out = append(out, Verdict{target, g, limit, g <= limit, fmt.Sprintf("x%.2f (%.1f at N=%d, %.1f at N=%d%s; limit x%.1f)", g, fa, a, fb, b, per, limit)})
	}
	for _, r := range rs {
		le(fmt.Sprintf("41.2 idle requests per host per minute, N=%d", r.N), Figures[0].Of(r), 6, "requests")
		le(fmt.Sprintf("41.2 idle bytes sent per host per minute, N=%d", r.N), Figures[2].Of(r), 20000, "bytes")
		le(fmt.Sprintf("41.2 idle watch messages per host per minute, N=%d", r.N), Figures[3].Of(r), 4, "messages")
	}
	for _, i := range []int{0, 2, 3} {
		growth("41.2 growth 100->1000: "+Figures[i].Name, Figures[i], 100, 1000, 1.2, false)
	}
	if ns := sizes(rs); len(ns) >= 2 {
		a, b := ns[0], ns[len(ns)-1]
		for _, k := range []string{"ring_watch_msgs", "ring_requests", "publish_watch_msgs", "join_watch_msgs"} {
			i := slices.IndexFunc(Figures, func(f Figure) bool { return f.Key == k })
			growth(fmt.Sprintf("41.3 events O(N): %s, N=%d->%d", Figures[i].Name, a, b), Figures[i], a, b, 1.5, strings.Contains(k, "watch"))
		}
	}
	i := slices.IndexFunc(Figures, func(f Figure) bool { return f.Key == "add_bytes" })
	growth("42.1 etcd bytes per ADD, N=10->1000", Figures[i], 10, 1000, 1.2, false)
	for _, r := range rs {
		if r.StartStaggered > 0 {
			out = append(out, Verdict{Target: fmt.Sprintf("42.3 simultaneous start, N=%d", r.N),
				Detail: fmt.Sprintf("not measured: the first ADDs were made at most %d at a time (SCALE_START)", r.StartStaggered)})
			continue
		}
		out = append(out, Verdict{Target: fmt.Sprintf("42.3 simultaneous start, N=%d", r.N), Figure: float64(r.StartFailed),
			Met:    r.StartFailed == 0 && r.StartDupes == 0,
			Detail: fmt.Sprintf("%d of %d first ADDs failed, %d duplicates, last success after %.2fs; %s", r.StartFailed, r.N, r.StartDupes, r.StartLast, fullOf(r))})
	}
	for _, r := range rs {
		out = append(out, Verdict{Target: fmt.Sprintf("no duplicate, nothing leaked, N=%d", r.N), Met: r.Findings.OK() && r.Findings.Allocated > 0,
			Detail: r.Findings.String()})
	}
	return out
}

// fullShare is the share of r's hosts that ran the whole agent.
func fullShare(r Result) float64 {
	if r.Full == 0 {
		return 1
	}
	return float64(r.Full) / float64(r.N)
}

// fullOf says how many of r's hosts ran the whole agent.
func fullOf(r Result) string {
	if r.Full == 0 {
		return "every agent whole"
	}
	return fmt.Sprintf("%d of %d agents whole, the others hollow", r.Full, r.N)
}

func sizes(rs []Result) []int {
	var ns []int
	for _, r := range rs {
		ns = append(ns, r.N)
	}
	slices.Sort(ns)
	return ns
}

// PrintSummary prints the growth of every figure between sizes and the
// verdicts.
func PrintSummary(w io.Writer, rs []Result) {
	ns := sizes(rs)
	fmt.Fprintf(w, "\n== growth per host between sizes ==\n%-62s", "figure")
	for _, n := range ns {
		fmt.Fprintf(w, " %12s", fmt.Sprintf("N=%d", n))
	}
	fmt.Fprintln(w)
	for _, f := range Figures {
		fmt.Fprintf(w, "%-62s", f.Name)
		var prev float64
		for k, n := range ns {
			r, _ := byN(rs, n)
			v := f.Of(r)
			cell := fmt.Sprintf("%.1f", v)
			if k > 0 && prev > 0 {
				cell += fmt.Sprintf(" x%.2f", v/prev)
			}
			fmt.Fprintf(w, " %12s", cell)
			prev = v
		}
		fmt.Fprintln(w)
	}
	fmt.Fprintf(w, "\n== verdicts ==\n")
	for _, v := range Verdicts(rs) {
		fmt.Fprintln(w, v)
	}
}

// Report is the JSON file of one run.
type Report struct {
	Label    string    `json:"label"`
	Results  []Result  `json:"results"`
	Verdicts []Verdict `json:"verdicts"`
}

// WriteJSON writes the results and verdicts to path.
func WriteJSON(path string, label string, rs []Result) error {
	b, err := json.MarshalIndent(Report{Label: label, Results: rs, Verdicts: Verdicts(rs)}, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(b, '\n'), 0o644)
}

// ReadJSON reads a report WriteJSON wrote.
func ReadJSON(path string) (Report, error) {
	var r Report
	b, err := os.ReadFile(path)
	if err != nil {
		return r, err
	}
	return r, json.Unmarshal(b, &r)
}

// dbSize is the largest db size a phase ended with.
func dbSize(r Result) float64 {
	var m float64
	for _, p := range r.Phases {
		m = max(m, p.Cost.DBSize)
	}
	return m
}
