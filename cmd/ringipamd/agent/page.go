package agent

import (
	"bytes"
	"fmt"
	"html/template"
	"maps"
	"math"
	"slices"
	"time"

	"github.com/ringipam/ringipam/pkg/pool"
)

// The status page: one HTML document, no script, readable by curl and by a
// browser. Each pool is an SVG ring: one arc per range, coloured by the
// owning host (grey and hatched when tombstoned, pale when unowned), with
// an inner arc whose length is the range's fill level; beside it one band
// per host (its colour, ranges, addresses held).

// palette holds colours far enough apart to tell hosts from each other;
// beyond its length colours repeat with a different lightness.
var palette = []string{"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
	"#e377c2", "#17becf", "#bcbd22", "#7f7f7f", "#393b79", "#ad494a"}

// hostColors gives every host of the snapshot its own colour, by the order
// of their names, so one host has one colour in every ring and the table.
func hostColors(s Snapshot) map[string]string {
	names := map[string]bool{}
	for _, h := range s.Hosts {
		names[h.Name] = true
	}
	for _, p := range s.Pools {
		for _, r := range p.Ring.Ranges {
			if r.Host != "" {
				names[r.Host] = true
			}
		}
	}
	sorted := slices.Sorted(maps.Keys(names))
	out := make(map[string]string, len(sorted))
	for i, n := range sorted {
		out[n] = palette[i%len(palette)]
	}
	return out
}

const (
	ringCX, ringCY     = 120.0, 120.0
	ringOuter, ringMid = 110.0, 86.0 // the range band
	fillOuter, fillIn  = 82.0, 66.0  // the fill band
)

func polar(r, a float64) (float64, float64) {
	return ringCX + r*math.Sin(a), ringCY - r*math.Cos(a)
}

// sector is the SVG path of the annulus sector between radii rin and rout
// from angle a0 to a1 (radians, clockwise from the top).
func sector(rin, rout, a0, a1 float64) string {
	if a1-a0 >= 2*math.Pi-1e-6 {
		// A whole ring: two half sectors.
		return sector(rin, rout, a0, a0+math.Pi) + " " + sector(rin, rout, a0+math.Pi, a0+2*math.Pi)
	}
	large := 0
	if a1-a0 > math.Pi {
		large = 1
	}
	x0, y0 := polar(rout, a0)
	x1, y1 := polar(rout, a1)
	x2, y2 := polar(rin, a1)
	x3, y3 := polar(rin, a0)
	return fmt.Sprintf("M%.2f %.2fA%.0f %.0f 0 %d 1 %.2f %.2fL%.2f %.2fA%.0f %.0f 0 %d 0 %.2f %.2fZ",
		x0, y0, rout, rout, large, x1, y1, x2, y2, rin, rin, large, x3, y3)
}

type arcView struct {
	Path, FillPath   string
	Class, Color     string
	Host, Start, End string
	Used             uint64
	Size             float64
	Title            string
}

type bandView struct {
	Host, Color string
	Ranges      int
	Used        uint64
	State       string
	Y           int
}

type poolPage struct {
	Name, Capacity  string
	Used, Available uint64
	Arcs            []arcView
	Bands           []bandView
	Tombstones      int
	Height          int
	TombY           int
}

// ringPage lays one pool out (pure).
func ringPage(v PoolView, states map[string]pool.HostState, colors map[string]string) poolPage {
	p := poolPage{Name: v.Name, Capacity: v.Usage.Capacity, Used: v.Usage.Used, Available: v.Usage.Available}
	var total float64
	for _, s := range v.Size {
		total += s
	}
	bands := map[string]*bandView{}
	var order []string
	a := 0.0
	for i, r := range v.Ring.Ranges {
		frac := 0.0
		if total > 0 {
			frac = v.Size[i] / total
		}
		a0, a1 := a, a+frac*2*math.Pi
		a = a1
		gap := math.Min(0.01, (a1-a0)/4)
		arc := arcView{Host: r.Host, Start: r.Start.String(), End: r.End.String(), Used: v.Used[i], Size: v.Size[i]}
		switch {
		case r.Tombstone:
			arc.Class, arc.Color = "range tomb", "url(#hatch)"
			p.Tombstones++
		case r.Host == "":
			arc.Class, arc.Color = "range free", "#e4e4e4"
		default:
			arc.Class, arc.Color = "range", colors[r.Host]
			b, ok := bands[r.Host]
			if !ok {
				b = &bandView{Host: r.Host, Color: arc.Color, State: string(states[r.Host])}
				bands[r.Host] = b
				order = append(order, r.Host)
			}
			b.Ranges++
			b.Used += v.Used[i]
		}
		arc.Path = sector(ringMid, ringOuter, a0+gap, a1-gap)
		if v.Used[i] > 0 && v.Size[i] > 0 {
			f := math.Min(1, float64(v.Used[i])/v.Size[i])
			arc.FillPath = sector(fillIn, fillOuter, a0+gap, a0+gap+f*(a1-a0-2*gap))
		}
		who := r.Host
		if who == "" {
			who = "nobody"
		}
		if r.Tombstone {
			who += " (tombstoned)"
		}
		arc.Title = fmt.Sprintf("%s – %s: %s, %d of %.0f held", r.Start, r.End, who, v.Used[i], v.Size[i])
		p.Arcs = append(p.Arcs, arc)
	}
	for i, h := range order {
		b := bands[h]
		b.Y = 24 + 26*i
		p.Bands = append(p.Bands, *b)
	}
	p.TombY = 24 + 26*len(order)
	p.Height = max(250, p.TombY+30)
	return p
}

type pageView struct {
	S        Snapshot
	Age      string
	Pools    []poolPage
	Hosts    []hostRow
	Orphaned bool
}

type hostRow struct {
	pool.HostInfo
	Color, Seen string
	Me          bool
}

var pageTmpl = template.Must(template.New("page").Parse(`<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta http-equiv="refresh" content="10">
<title>ringipam · {{.S.Host}}</title>
<style>
body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse}td,th{padding:2px 10px;text-align:left;border-bottom:1px solid #ddd}
.orphaned{background:#b00020;color:#fff;padding:.6em 1em;font-weight:bold}
.state-up{color:#1b7f3b}.state-down{color:#b26a00}.state-orphaned{color:#b00020;font-weight:bold}
section.pool{margin:1.2em 0}svg text{font:12px system-ui,sans-serif}
</style></head><body>
<h1>ringipam on {{.S.Host}}</h1>
{{if .Orphaned}}<p class="orphaned" id="orphaned">This host was orphaned at {{.S.Orphaned.UTC.Format "2006-01-02 15:04:05 MST"}}: its old containers lost their addresses. New containers get fresh ones. Acknowledge with: ringctl host ack {{.S.Host}}</p>{{end}}
<p>Snapshot {{.Age}} old · liveness record {{if .S.Liveness}}held{{else}}<b>not held</b>{{end}}{{if .S.Leader}} · <span id="leader">leader</span> (sweeps, compacts the history, reports the pool-wide figures){{end}}{{with .S.Addr}} · --addr {{.}}{{end}}</p>
<h2>Hosts</h2>
<table id="hosts"><tr><th>host</th><th>state</th><th>last seen</th><th>address</th><th>ranges</th><th>addresses held</th></tr>
{{range .Hosts}}<tr data-host="{{.Name}}"><td><span style="color:{{.Color}}">■</span> {{.Name}}{{if .Me}} (this host){{end}}</td><td class="state-{{.State}}">{{.State}}</td><td>{{.Seen}}</td><td>{{.Addr}}</td><td>{{.Ranges}}</td><td>{{.Used}}</td></tr>
{{end}}</table>
<h2>Pools</h2>
{{range .Pools}}<section class="pool" data-pool="{{.Name}}">
<h3>{{.Name}}: {{.Used}} held of {{.Capacity}}</h3>
<svg class="ring" data-pool="{{.Name}}" xmlns="http://www.w3.org/2000/svg" width="560" height="{{.Height}}" viewBox="0 0 560 {{.Height}}" role="img" aria-label="ring of pool {{.Name}}">
<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)"><rect width="6" height="6" fill="#bbb"/><line x1="0" y1="0" x2="0" y2="6" stroke="#777" stroke-width="3"/></pattern></defs>
<g class="arcs">{{range .Arcs}}<path class="{{.Class}}" data-host="{{.Host}}" data-start="{{.Start}}" data-end="{{.End}}" data-used="{{.Used}}" d="{{.Path}}" fill="{{.Color}}"><title>{{.Title}}</title></path>{{if .FillPath}}<path class="fill" data-host="{{.Host}}" d="{{.FillPath}}" fill="{{.Color}}" fill-opacity=".45"/>{{end}}{{end}}</g>
<text x="120" y="116" text-anchor="middle">{{.Used}} held</text><text x="120" y="132" text-anchor="middle">of {{.Capacity}}</text>
<g class="bands">{{range .Bands}}<g class="band" data-host="{{.Host}}" transform="translate(260,{{.Y}})"><rect width="22" height="18" fill="{{.Color}}"/><text x="30" y="14">{{.Host}} · {{.State}} · {{.Ranges}} range{{if ne .Ranges 1}}s{{end}} · {{.Used}} held</text></g>
{{end}}{{if .Tombstones}}<g class="tomb-legend" transform="translate(260,{{.TombY}})"><rect width="22" height="18" fill="url(#hatch)"/><text x="30" y="14">tombstoned · {{.Tombstones}} range{{if ne .Tombstones 1}}s{{end}}</text></g>{{end}}</g>
</svg></section>
{{else}}<p>No pool is defined yet.</p>{{end}}
<h2>Ingress forwards</h2>
<table id="forwards"><tr><th>port</th><th>to</th><th>holder</th></tr>
{{range .S.Forwards}}<tr><td>{{.Protocol}}/{{.Port}}</td><td>{{.To}} ({{.Host}})</td><td>{{.Endpoint}}</td></tr>
{{end}}</table>
{{with .S.Routes}}<h2>Routes to other hosts' ranges</h2>
<p id="routes-state">table {{.Table}} · {{len .Routes}} planned from the ring · {{if .Failed}}<b>not all installed: {{.Failed}}</b>{{else if .Synced.IsZero}}not installed yet{{else}}all installed, as planned (checked {{.Synced.UTC.Format "15:04:05 MST"}}){{end}}{{with .ProxyARP}} · proxy ARP on {{range $i, $l := .}}{{if $i}}, {{end}}{{$l}}{{end}}{{end}}</p>
<table id="routes"><tr><th>destination</th><th>via</th><th>host</th><th>pool</th></tr>
{{range .Routes}}<tr data-host="{{.Host}}"><td>{{.Dst}}</td><td>{{.Via}}</td><td>{{.Host}}</td><td>{{.Pool}}</td></tr>
{{end}}</table>
{{with .Refused}}<ul id="routes-refused">{{range .}}<li>{{.}}</li>{{end}}</ul>{{end}}{{end}}
{{with .S.Problems}}<h2>Problems</h2><ul id="problems">{{range .}}<li>{{.}}</li>{{end}}</ul>{{end}}
</body></html>
`))

// renderPage renders the status page of s at now (pure).
func renderPage(s Snapshot, now time.Time) ([]byte, error) {
	v := pageView{S: s, Age: now.Sub(s.Taken).Round(time.Second).String(), Orphaned: !s.Orphaned.IsZero()}
	states := map[string]pool.HostState{}
	colors := hostColors(s)
	for _, h := range s.Hosts {
		states[h.Name] = h.State
		seen := "never"
		if !h.LastSeen.IsZero() {
			seen = now.Sub(h.LastSeen).Round(time.Second).String() + " ago"
		}
		v.Hosts = append(v.Hosts, hostRow{HostInfo: h, Color: colors[h.Name], Seen: seen, Me: h.Name == s.Host})
	}
	for _, p := range s.Pools {
		v.Pools = append(v.Pools, ringPage(p, states, colors))
	}
	var b bytes.Buffer
	if err := pageTmpl.Execute(&b, v); err != nil {
		return nil, err
	}
	return b.Bytes(), nil
}
