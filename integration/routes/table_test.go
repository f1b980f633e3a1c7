//go:build integration

// Package routes_test checks routes.Table against a real kernel, in a
// network namespace of its own.
package routes_test

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/ringipam/ringipam/integration/netns"
	"github.com/ringipam/ringipam/pkg/routes"
)

func installed(t *testing.T, n *netns.NS, tb *routes.Table) []routes.Installed {
	t.Helper()
	var got []routes.Installed
	if err := n.Do(func() (err error) { got, err = tb.Installed(); return err }); err != nil {
		t.Fatalf("Installed: %v", err)
	}
	return got
}

func r(dst, via string) routes.Route {
	return routes.Route{Dst: netip.MustParsePrefix(dst), Via: netip.MustParseAddr(via), Host: "h", Pool: "p"}
}

func same(t *testing.T, what string, got []routes.Installed, want []routes.Route) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: table holds %v, want %v", what, got, want)
	}
	for i := range want {
		if got[i].Dst != want[i].Dst || got[i].Via != want[i].Via {
			t.Fatalf("%s: route %d is %s via %s, want %s via %s (all: %v)", what, i, got[i].Dst, got[i].Via, want[i].Dst, want[i].Via, got)
		}
	}
}

// A plan is applied, changed and cleared in a namespace that also holds
// routes ringipam did not make (in main, in another table, and in its own
// table with another protocol): those survive every step, and after Clear
// the namespace's routing state is what it was before the first Apply.
func TestTableApplyChangeClear(t *testing.T) {
	netns.RequireRoot(t)
	n := netns.New(t, "rt")
	n.MustRun(t, "ip", "link", "add", "lan0", "type", "veth", "peer", "name", "lan1")
	n.MustRun(t, "ip", "link", "set", "lan1", "up")
	n.MustRun(t, "ip", "addr", "add", "192.168.77.10/24", "dev", "lan0")
	n.MustRun(t, "ip", "-6", "addr", "add", "fd77::10/64", "dev", "lan0", "nodad")
	n.MustRun(t, "ip", "link", "set", "lan0", "up")
	// Routes of others.
	n.MustRun(t, "ip", "route", "add", "10.9.0.0/16", "via", "192.168.77.1")
	n.MustRun(t, "ip", "route", "add", "10.8.0.0/16", "via", "192.168.77.2", "table", "100")
	n.MustRun(t, "ip", "route", "add", "10.7.0.0/16", "via", "192.168.77.3", "table", "4212", "proto", "static")
	n.MustRun(t, "ip", "-6", "route", "add", "fd09::/64", "via", "fd77::1")
	before := n.RoutingState(t)

	var tb *routes.Table
	if err := n.Do(func() (err error) { tb, err = routes.OpenTable(routes.TableConfig{}); return err }); err != nil {
		t.Fatalf("OpenTable: %v", err)
	}
	defer tb.Close()

	var onLink []netip.Prefix
	if err := n.Do(func() (err error) { onLink, err = tb.OnLink(); return err }); err != nil {
		t.Fatalf("OnLink: %v", err)
	}
	for _, want := range []string{"192.168.77.10/24", "fd77::10/64"} {
		found := false
		for _, p := range onLink {
			found = found || p.String() == want
		}
		if !found {
			t.Fatalf("OnLink = %v, want it to hold %s", onLink, want)
		}
	}

	plan1 := []routes.Route{
		r("10.0.0.64/26", "192.168.77.11"),
		r("10.0.0.128/26", "192.168.77.12"),
		r("fd00:1::80/121", "fd77::11"),
	}
	ch, err := tb.Apply(plan1)
	if err != nil {
		t.Fatalf("Apply 1: %v", err)
	}
	if ch != (routes.Change{Added: 3}) {
		t.Fatalf("Apply 1 did %+v, want 3 added", ch)
	}
	same(t, "after apply 1", installed(t, n, tb), plan1)
	for _, argv := range [][]string{{"ip", "-4", "rule"}, {"ip", "-6", "rule"}} {
		if out := n.MustRun(t, argv...); !strings.Contains(out, "32000:\tfrom all lookup 4212") {
			t.Fatalf("%s shows no rule to table 4212 at 32000:\n%s", strings.Join(argv, " "), out)
		}
	}
	// The kernel routes by it: 10.0.0.70 goes to host .11.
	if out := n.MustRun(t, "ip", "route", "get", "10.0.0.70"); !strings.Contains(out, "via 192.168.77.11") || !strings.Contains(out, "table 4212") {
		t.Fatalf("ip route get 10.0.0.70: %s", out)
	}

	// A donation moves .128/26 to host .13, a reclaim drops the IPv6 range,
	// a claim adds .192/27.
	plan2 := []routes.Route{
		r("10.0.0.64/26", "192.168.77.11"),
		r("10.0.0.128/26", "192.168.77.13"),
		r("10.0.0.192/27", "192.168.77.11"),
	}
	ch, err = tb.Apply(plan2)
	if err != nil {
		t.Fatalf("Apply 2: %v", err)
	}
	if ch != (routes.Change{Added: 1, Replaced: 1, Deleted: 1, Kept: 1}) {
		t.Fatalf("Apply 2 did %+v", ch)
	}
	same(t, "after apply 2", installed(t, n, tb), plan2)

	// A next hop the kernel cannot reach directly is refused whole; the
	// rest of the plan still holds.
	plan3 := append(plan2[:3:3], r("10.0.0.224/28", "172.31.0.1"))
	if _, err := tb.Apply(plan3); err == nil || !strings.Contains(err.Error(), "10.0.0.224/28 via 172.31.0.1") {
		t.Fatalf("Apply with an off-link next hop: err = %v, want the route's error", err)
	}
	same(t, "after the off-link apply", installed(t, n, tb), plan2)

	// Others' routes are still there while ours are.
	mid := n.MustRun(t, "ip", "route", "show", "table", "4212")
	if !strings.Contains(mid, "10.7.0.0/16 via 192.168.77.3 dev lan0 proto static") {
		t.Fatalf("the static route in table 4212 is gone:\n%s", mid)
	}

	if err := tb.Clear(); err != nil {
		t.Fatalf("Clear: %v", err)
	}
	if got := installed(t, n, tb); len(got) != 0 {
		t.Fatalf("after Clear the table holds %v", got)
	}
	if after := n.RoutingState(t); after != before {
		t.Fatalf("routing state after Clear differs from before Apply:\n--- before\n%s--- after\n%s", before, after)
	}
	if err := tb.Clear(); err != nil {
		t.Fatalf("second Clear: %v", err)
	}
}
