package harness

import (
	"fmt"
	"io"
	"math"
	"slices"
	"strings"
	"text/template"
)

// The picture: per-host cost against N (log-log), one panel per figure,
// before (dashed) and after (solid), with the target where there is one.

// panels are the figures drawn, with their targets (0: none); perWhole:
// drawn per whole agent (the figure per host divided by the run's share of
// whole agents, as Verdicts compares watch messages: hollow agents watch
// nothing).
var panels = []struct {
	key      string
	title    string
	target   float64
	perWhole bool
}{
	{"idle_requests", "idle: etcd requests / host / min (keep-alives aside)", 6, false},
	{"idle_bytes_sent", "idle: etcd bytes sent / host / min", 20000, false},
	{"idle_watch_msgs", "idle: watch messages / host / min", 4, false},
	{"add_bytes", "etcd bytes per steady-state ADD", 0, false},
	{"ring_watch_msgs", "ring change: watch messages / whole agent", 0, true},
	{"start_last_s", "simultaneous start: s until the last first ADD", 0, false},
}

// svgLine is one report's line style.
type svgLine struct{ Dash, Color string }

// SVG draws the reports (before may be nil) to w.
func SVG(w io.Writer, before, after *Report) error {
	const pw, ph, margin, cols = 300.0, 170.0, 60.0, 3
	var reports []*Report
	var styles []svgLine
	if before != nil {
		reports = append(reports, before)
		styles = append(styles, svgLine{Dash: "6,4", Color: "#c0392b"})
	}
	if after != nil {
		reports = append(reports, after)
		styles = append(styles, svgLine{Color: "#1f5fa8"})
	}
	var ns []int
	for _, r := range reports {
		for _, x := range r.Results {
			if !slices.Contains(ns, x.N) {
				ns = append(ns, x.N)
			}
		}
	}
	slices.Sort(ns)
	if len(ns) == 0 {
		return fmt.Errorf("no results to draw")
	}
	lx0, lx1 := math.Log10(float64(ns[0]))-0.15, math.Log10(float64(ns[len(ns)-1]))+0.15
	rows := (len(panels) + cols - 1) / cols
	var b strings.Builder
	W, H := margin+cols*(pw+margin), 60+float64(rows)*(ph+70)+20
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%.0f" height="%.0f" viewBox="0 0 %.0f %.0f" font-family="sans-serif" font-size="11">`+"\n", W, H, W, H)
	fmt.Fprintf(&b, `<rect width="100%%" height="100%%" fill="white"/>`+"\n")
	fmt.Fprintf(&b, `<text x="10" y="20" font-size="14" font-weight="bold">What a host costs etcd, per host, against the number of hosts N (both axes logarithmic)</text>`+"\n")
	lx := 10.0
	for i, r := range reports {
		label := r.Label
		if len(r.Results) > 0 && r.Results[0].Commit != "" {
			label += " (" + r.Results[0].Commit + ")"
		}
		fmt.Fprintf(&b, `<line x1="%.0f" y1="38" x2="%.0f" y2="38" stroke="%s" stroke-width="2" stroke-dasharray="%s"/><text x="%.0f" y="42">%s</text>`+"\n",
			lx, lx+30, styles[i].Color, styles[i].Dash, lx+35, template.HTMLEscapeString(label))
		lx += 220
	}
	fmt.Fprintf(&b, `<line x1="%.0f" y1="38" x2="%.0f" y2="38" stroke="#2e8b57" stroke-width="1" stroke-dasharray="2,3"/><text x="%.0f" y="42">target</text>`+"\n", lx, lx+30, lx+35)
	for pi, p := range panels {
		fi := slices.IndexFunc(Figures, func(f Figure) bool { return f.Key == p.key })
		if fi < 0 {
			continue
		}
		f := Figures[fi]
		if p.perWhole {
			of := f.Of
			f.Of = func(r Result) float64 { return of(r) / fullShare(r) }
		}
		ox, oy := margin+float64(pi%cols)*(pw+margin), 80+float64(pi/cols)*(ph+70)
		// y range over every value and the target.
		lo, hi := math.Inf(1), math.Inf(-1)
		for _, r := range reports {
			for _, x := range r.Results {
				if v := f.Of(x); v > 0 {
					lo, hi = math.Min(lo, v), math.Max(hi, v)
				}
			}
		}
		if p.target > 0 {
			lo, hi = math.Min(lo, p.target), math.Max(hi, p.target)
		}
		if math.IsInf(lo, 0) {
			lo, hi = 1, 10
		}
		ly0, ly1 := math.Floor(math.Log10(lo)), math.Ceil(math.Log10(hi))
		if ly1 == ly0 {
			ly1++
		}
		px := func(n float64) float64 { return (math.Log10(n) - lx0) / (lx1 - lx0) * pw }
		py := func(v float64) float64 { return ph - (math.Log10(v)-ly0)/(ly1-ly0)*ph }
		fmt.Fprintf(&b, `<g transform="translate(%.0f,%.0f)">`+"\n", ox, oy)
		fmt.Fprintf(&b, `<rect width="%.0f" height="%.0f" fill="none" stroke="#999"/><text y="-8" font-weight="bold">%s</text>`+"\n", pw, ph, template.HTMLEscapeString(p.title))
		for _, n := range ns {
			x := px(float64(n))
			fmt.Fprintf(&b, `<line x1="%.1f" y1="0" x2="%.1f" y2="%.0f" stroke="#eee"/><text x="%.1f" y="%.0f" text-anchor="middle">%d</text>`+"\n", x, x, ph, x, ph+14, n)
		}
		for e := ly0; e <= ly1; e++ {
			y := py(math.Pow(10, e))
			fmt.Fprintf(&b, `<line x1="0" y1="%.1f" x2="%.0f" y2="%.1f" stroke="#eee"/><text x="-4" y="%.1f" text-anchor="end">%s</text>`+"\n", y, pw, y, y+4, tick(math.Pow(10, e)))
		}
		fmt.Fprintf(&b, `<text x="%.0f" y="%.0f" text-anchor="middle">N (hosts)</text>`+"\n", pw/2, ph+28)
		if p.target > 0 {
			y := py(p.target)
			fmt.Fprintf(&b, `<line x1="0" y1="%.1f" x2="%.0f" y2="%.1f" stroke="#2e8b57" stroke-dasharray="2,3"/>`+"\n", y, pw, y)
		}
		for i, r := range reports {
			var pts []string
			xs := slices.Clone(r.Results)
			slices.SortFunc(xs, func(a, b Result) int { return a.N - b.N })
			for _, x := range xs {
				v := f.Of(x)
				if v <= 0 {
					continue
				}
				pts = append(pts, fmt.Sprintf("%.1f,%.1f", px(float64(x.N)), py(v)))
				fmt.Fprintf(&b, `<circle cx="%.1f" cy="%.1f" r="3" fill="%s"><title>%s N=%d: %s</title></circle>`+"\n",
					px(float64(x.N)), py(v), styles[i].Color, template.HTMLEscapeString(r.Label), x.N, tick(v))
			}
			if len(pts) > 1 {
				fmt.Fprintf(&b, `<polyline points="%s" fill="none" stroke="%s" stroke-width="2" stroke-dasharray="%s"/>`+"\n",
					strings.Join(pts, " "), styles[i].Color, styles[i].Dash)
			}
		}
		b.WriteString("</g>\n")
	}
	b.WriteString("</svg>\n")
	_, err := io.WriteString(w, b.String())
	return err
}

// tick prints an axis value shortly (1, 10, 1k, 10k, 1M).
func tick(v float64) string {
	switch {
	case v >= 1e6:
		return fmt.Sprintf("%gM", math.Round(v/1e5)/10)
	case v >= 1e3:
		return fmt.Sprintf("%gk", math.Round(v/1e2)/10)
	case v >= 1:
		return fmt.Sprintf("%g", math.Round(v*10)/10)
	}
	return fmt.Sprintf("%.2g", v)
}
