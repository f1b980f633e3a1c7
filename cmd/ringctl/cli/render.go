package cli

import (
	"fmt"
	"io"
	"net/netip"
	"regexp"
	"strings"
	"time"

	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/routes"
)

// MaxColumns bounds every line of human output.
const MaxColumns = 100

// clip shortens s to n columns, marking the cut with '~'.
func clip(s string, n int) string {
	r := []rune(s)
	if len(r) <= n {
		return s
	}
	if n <= 1 {
		return string(r[:n])
	}
	return string(r[:n-1]) + "~"
}

// printer writes lines clipped to MaxColumns.
type printer struct{ w io.Writer }

func (p printer) line(format string, a ...any) {
	for _, l := range strings.Split(fmt.Sprintf(format, a...), "\n") {
		fmt.Fprintln(p.w, clip(strings.TrimRight(l, " "), MaxColumns))
	}
}

// table is rows of cells printed in columns, each column at most its
// limit wide (cells beyond it are clipped), two spaces apart.
type table struct {
	head   []string
	limits []int
	rows   [][]string
}

func (t *table) add(cells ...string) { t.rows = append(t.rows, cells) }

func (t *table) print(p printer) {
	widths := make([]int, len(t.head))
	all := append([][]string{t.head}, t.rows...)
	for _, r := range all {
		for i, c := range r {
			widths[i] = max(widths[i], min(len([]rune(c)), t.limits[i]))
		}
	}
	for _, r := range all {
		var b strings.Builder
		for i, c := range r {
			c = clip(c, t.limits[i])
			b.WriteString(c)
			if i < len(r)-1 {
				b.WriteString(strings.Repeat(" ", widths[i]-len([]rune(c))+2))
			}
		}
		p.line("%s", b.String())
	}
}

// shortID shortens a container ID as docker and crictl do.
func shortID(id string) string {
	if len(id) > 12 && isHex(id) {
		return id[:12]
	}
	return id
}

func isHex(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return false
		}
	}
	return true
}

func ownerShort(o pool.Owner) string {
	s := o.Network + "/" + shortID(o.ContainerID)
	if o.IfName != "" {
		s += "/" + o.IfName
	}
	return s
}

// ownerStringShort shortens the container ID inside kind/net/ctr/if.
func ownerStringShort(s string) string {
	if o, ok := ownerOfString(s); ok {
		return string(o.Kind) + "/" + ownerShort(o)
	}
	return s
}

// RenderStatus prints the status: pools, hosts, then each pool's ring bar.
func RenderStatus(w io.Writer, s Status) {
	p := printer{w}
	p.line("store %s, %s", s.Store, stamp(s.Time))
	p.line("")
	pt := table{head: []string{"POOL", "FAMILY", "SIZE", "USED", "HELD", "FREE", "RANGES"}, limits: []int{24, 6, 25, 10, 8, 25, 6}}
	for _, x := range s.Pools {
		name := x.Name
		if x.Isolated {
			name += " (isolated)"
		}
		pt.add(name, x.Family, x.Size, fmt.Sprint(x.Used), fmt.Sprint(x.Held), x.Free, fmt.Sprint(len(x.Ranges)))
	}
	if len(s.Pools) == 0 {
		p.line("no pool is recorded yet")
	} else {
		pt.print(p)
	}
	p.line("")
	letters := hostLetters(s)
	ht := table{head: []string{"", "HOST", "STATE", "LAST SEEN", "RANGES", "USED", "POOLS"}, limits: []int{1, 20, 8, 30, 6, 8, 20}}
	for _, h := range s.Hosts {
		seen := ago(s.Time, h.LastSeen)
		if !h.LastSeen.IsZero() {
			seen = h.LastSeen.UTC().Format("2006-01-02 15:04") + " (" + seen + ")"
		}
		state := h.State
		if !h.OrphanedAt.IsZero() {
			state += "*"
		}
		ht.add(string(letters[h.Name]), h.Name, state, seen, fmt.Sprint(h.Ranges), fmt.Sprint(h.Used), strings.Join(h.Pools, ","))
	}
	if len(s.Hosts) == 0 {
		p.line("no host is known yet")
	} else {
		ht.print(p)
		if hasOrphanMark(s.Hosts) {
			p.line("* reclaimed while orphaned; cleared by `ringctl host ack HOST` (or its agent)")
		}
		renderRoutes(p, s)
	}
	const barWidth = MaxColumns - 2
	for _, x := range s.Pools {
		p.line("")
		p.line("ring %s: %s - %s, %d ranges", x.Name, x.Ranges[0].Start, x.Ranges[len(x.Ranges)-1].End, len(x.Ranges))
		p.line("[%s]", ringBar(x.Ranges, func(h string) byte { return letters[h] }, barWidth))
	}
	if len(s.Pools) > 0 {
		p.line("")
		p.line("ring: one letter per host as listed above, lower case: its tombstoned ranges, '.': unowned")
	}
}

// renderRoutes prints, per host whose agent reported routes (--routes),
// what it holds and whether it matches the plan the ring makes for it, then
// that plan: one line per pool and next hop, its prefixes merged into
// address spans (`status --json` lists every prefix).
func renderRoutes(p printer, s Status) {
	first := true
	for _, h := range s.Hosts {
		r := h.Routes
		if r == nil {
			continue
		}
		if first {
			p.line("")
			p.line("ROUTES to other hosts' ranges (agents with --routes), compared with the ring")
			first = false
		}
		held := fmt.Sprintf("%d held", r.Held)
		if r.Failed > 0 {
			held += fmt.Sprintf(", %d failed", r.Failed)
		}
		if r.Refused > 0 {
			held += fmt.Sprintf(", %d ranges refused", r.Refused)
		}
		// The host and where other hosts route its ranges: its --addr,
		// one address per family on a dual-stack host.
		name := h.Name
		if as := pool.SplitAddrs(h.Addr); len(as) > 0 {
			name += " (" + strings.Join(as, ", ") + ")"
		}
		switch {
		case h.State != string(pool.HostUp):
			p.line("  %s: %s when last reported (%s); the host is %s", name, held, ago(s.Time, r.Reported), h.State)
		case r.Matches:
			p.line("  %s: %s, matches the ring", name, held)
		default:
			p.line("  %s: %s, DIFFERS from the ring (wants %d; reported %s)", name, held, len(r.Ring), ago(s.Time, r.Reported))
		}
		verb := ""
		if !r.Matches {
			verb = "wanted: "
		}
		for _, g := range routeGroups(r.Ring) {
			p.line("    %s%s", verb, g)
		}
	}
}

// routeGroups sums routes up per pool, host and next hop, in order of
// first appearance: "pool p: host via addr: lo-hi, lo-hi (n prefixes)".
func routeGroups(rs []routes.Route) []string {
	type span struct{ lo, hi netip.Addr }
	type group struct {
		head  string
		spans []span
		n     int
	}
	var order []*group
	by := map[string]*group{}
	for _, r := range rs {
		head := fmt.Sprintf("pool %s: %s via %s", r.Pool, r.Host, r.Via)
		g := by[head]
		if g == nil {
			g = &group{head: head}
			by[head] = g
			order = append(order, g)
		}
		g.n++
		lo, hi := r.Dst.Addr(), pool.LastAddr(r.Dst)
		if k := len(g.spans); k > 0 && g.spans[k-1].hi.Next() == lo {
			g.spans[k-1].hi = hi
			continue
		}
		g.spans = append(g.spans, span{lo, hi})
	}
	out := make([]string, 0, len(order))
	for _, g := range order {
		parts := make([]string, len(g.spans))
		for i, sp := range g.spans {
			parts[i] = sp.lo.String() + "-" + sp.hi.String()
		}
		out = append(out, fmt.Sprintf("%s: %s (%d prefixes)", g.head, strings.Join(parts, ", "), g.n))
	}
	return out
}

func hasOrphanMark(hs []HostStatus) bool {
	for _, h := range hs {
		if !h.OrphanedAt.IsZero() {
			return true
		}
	}
	return false
}

// RenderLs prints held addresses.
func RenderLs(w io.Writer, rows []AddrRow, now time.Time) {
	p := printer{w}
	t := table{head: []string{"ADDRESS", "POOL", "KIND", "OWNER", "RESERVATION", "HOST", "AGE"}, limits: []int{26, 14, 7, 30, 16, 12, 10}}
	for _, r := range rows {
		owner, age := "", ago(now, r.Since)
		if r.Since.IsZero() {
			age = "-"
		}
		switch {
		case r.Owner != nil:
			owner = ownerShort(*r.Owner)
			if r.Role == pool.RoleGateway {
				owner += " (gw)"
			}
		default:
			owner = "(held until " + r.HeldUntil.UTC().Format("15:04:05") + ")"
			if !now.Before(r.HeldUntil) {
				owner = "(hold ended)"
			}
		}
		t.add(r.Addr.String(), r.Pool, string(r.Kind), owner, r.Reservation, r.Host, age)
	}
	t.print(p)
	p.line("%d addresses", len(rows))
}

// RenderPorts prints published ports.
func RenderPorts(w io.Writer, rows []PortRow) {
	p := printer{w}
	t := table{head: []string{"MODE", "PORT", "HOST", "HOST IP", "OWNER"}, limits: []int{7, 11, 20, 26, 40}}
	for _, r := range rows {
		ip := "*"
		if r.HostIP.IsValid() {
			ip = r.HostIP.String()
		}
		if r.Mode == "ingress" {
			ip = "(every host)"
		}
		t.add(r.Mode, fmt.Sprintf("%s/%d", r.Protocol, r.Port), r.Host, ip, ownerStringShort(r.Owner))
	}
	t.print(p)
	p.line("%d published ports", len(rows))
}

// ActionLine is the one-line form of an action (the same for a dry run
// and the real run).
func ActionLine(a Action) string {
	var b strings.Builder
	b.WriteString(a.Do + " " + ownerStringShort(a.Target))
	if a.Host != "" && a.Do != "hand-over" {
		b.WriteString(" (host " + a.Host + ")")
	}
	if len(a.Addrs) > 0 {
		s := make([]string, len(a.Addrs))
		for i, x := range a.Addrs {
			s[i] = x.String()
		}
		b.WriteString(": " + strings.Join(s, ", "))
	}
	if len(a.Pools) > 0 {
		b.WriteString(" [" + strings.Join(a.Pools, ", ") + "]")
	}
	if a.Detail != "" {
		b.WriteString("; " + a.Detail)
	}
	return b.String()
}

// RenderActions prints what a repair did, or in a dry run would do.
func RenderActions(w io.Writer, a Actions) {
	p := printer{w}
	for _, x := range a.Actions {
		// An action is read whole: wrapped, never cut.
		for _, l := range wrap(ActionLine(x), MaxColumns, "    ") {
			p.line("%s", l)
		}
	}
	for _, n := range a.Notes {
		p.line("# %s", n)
	}
	if a.DryRun {
		p.line("# dry run: nothing was changed")
	}
}

// RenderCheck prints one line per violation, or that all invariants hold.
func RenderCheck(w io.Writer, v []pool.Violation) {
	p := printer{w}
	for _, x := range v {
		// One entry per violation, starting with its invariant at column
		// 0; a long one continues on indented lines rather than being
		// cut. Container IDs are shortened as in ls; --json has them whole.
		line := longHex.ReplaceAllStringFunc(x.String(), func(h string) string { return h[:12] })
		for _, l := range wrap(line, MaxColumns, "    ") {
			p.line("%s", l)
		}
	}
	if len(v) == 0 {
		p.line("ok: every invariant holds")
	}
}

// RenderImport prints one line per adopted, unchanged or refused owner.
func RenderImport(w io.Writer, r ImportReport) {
	p := printer{w}
	counts := map[string]int{}
	for _, o := range r.Owners {
		counts[o.Result]++
		s := make([]string, len(o.Addrs))
		for i, x := range o.Addrs {
			s[i] = x.String()
		}
		line := fmt.Sprintf("%-9s %s: %s", o.Result, ownerShort(o.Owner), strings.Join(s, ", "))
		if o.Detail != "" {
			line += "; " + o.Detail
		}
		for _, l := range wrap(line, MaxColumns, "    ") {
			p.line("%s", l)
		}
	}
	for _, i := range r.Ignored {
		p.line("# ignored %s", i)
	}
	p.line("# network %s on host %s, pools %s: %d adopted, %d unchanged, %d refused", r.Network, r.Host,
		strings.Join(r.Pools, ", "), counts[ImportAdopted], counts[ImportUnchanged], counts[ImportRefused])
	if r.DryRun {
		p.line("# dry run: nothing was changed")
	}
}

// RenderHistory prints an address's events, oldest first.
func RenderHistory(w io.Writer, rows []HistoryRow) {
	p := printer{w}
	t := table{head: []string{"TIME", "EVENT", "OWNER", "HOST", "RESERVATION"}, limits: []int{20, 7, 44, 12, 12}}
	for _, r := range rows {
		t.add(r.Time.UTC().Format(time.RFC3339), r.What, ownerStringShort(r.Owner), r.Host, r.Reservation)
	}
	t.print(p)
	if len(rows) == 0 {
		p.line("no recorded event")
	}
}

// RenderExplain prints each finding and the verdict.
func RenderExplain(w io.Writer, e Explanation) {
	p := printer{w}
	for _, f := range e.Findings {
		what := f.Check
		if f.Pool != "" {
			what += " " + f.Pool
		}
		code := ""
		if f.CNICode != 0 && f.Verdict != VerdictOK {
			code = fmt.Sprintf(" (CNI code %d)", f.CNICode)
		}
		// Findings are sentences: wrap them rather than cut them.
		for _, l := range wrap(fmt.Sprintf("%-4s %s%s: %s", f.Verdict, what, code, f.Detail), MaxColumns, "     ") {
			p.line("%s", l)
		}
	}
	if e.WouldSucceed {
		p.line("an ADD on host %s would succeed now", e.Host)
	} else {
		p.line("an ADD on host %s would fail now", e.Host)
	}
}

// wrap breaks s at spaces into lines of at most n columns, continuation
// lines starting with indent.
func wrap(s string, n int, indent string) []string {
	if len([]rune(s)) <= n {
		return []string{s} // fits: spacing kept as it is
	}
	var out []string
	line := ""
	for _, word := range strings.Fields(s) {
		switch {
		case line == "":
			line = word
		case len([]rune(line))+1+len([]rune(word)) <= n:
			line += " " + word
		default:
			out = append(out, line)
			line = indent + word
		}
	}
	if line != "" {
		out = append(out, line)
	}
	return out
}

// longHex finds full container IDs (64 hex digits).
var longHex = regexp.MustCompile(`\b[0-9a-f]{64}\b`)
