package cli

import (
	"bytes"
	"context"
	"net/netip"
	"strconv"
	"strings"
	"testing"

	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/routes"
	"github.com/ringipam/ringipam/pkg/store"
)

// TestStatusRoutes: ringctl status shows, per host whose agent reported
// routes, what it holds and whether that matches the plan ringctl makes
// from the ring with the same planner: node-a reports the plan the ring
// makes (matches, its routes listed), node-b a stale one (differs, the
// wanted routes listed), node-c nothing; a host that went down shows its
// last report without a verdict.
func TestStatusRoutes(t *testing.T) {
	ctx := context.Background()
	w := newWorld(t)
	onLink := []netip.Prefix{netip.MustParsePrefix("198.18.1.0/24")}
	// node-a is dual-stack (one address per family).
	addrs := map[string]string{"node-a": "198.18.1.1,fd00:1::1", "node-b": "198.18.1.2", "node-c": "198.18.1.3"}
	for h, addr := range addrs {
		if _, err := w.hosts[h].Heartbeat(ctx, addr, nil); err != nil {
			t.Fatal(err)
		}
		if err := w.ctl.Store.Commit(ctx, nil, []store.Op{store.Put(pool.LivenessKey(h), []byte("lease"))}); err != nil {
			t.Fatal(err)
		}
	}
	// What an agent plans (as cmd/ringipamd does), from the store.
	plan := func(self string) routes.Result {
		defs, err := w.ctl.Pool.Pools(ctx)
		if err != nil {
			t.Fatal(err)
		}
		in := routes.Input{Self: self, OnLink: onLink}
		for _, d := range defs {
			ring, err := w.ctl.Pool.RingOf(ctx, d.Name)
			if err != nil {
				t.Fatal(err)
			}
			in.Pools = append(in.Pools, routes.Pool{Def: d, Ring: ring})
		}
		hosts, err := w.ctl.Pool.Hosts(ctx, 0)
		if err != nil {
			t.Fatal(err)
		}
		in.Hosts = routes.HostsFrom(hosts)
		return routes.Plan(in)
	}
	pa, pb := plan("node-a"), plan("node-b")
	// The IPv6 pool's ranges are refused (no host has an IPv6 address).
	if len(pa.Routes) < 2 || len(pa.Refused) != 2 || len(pb.Routes) < 2 {
		t.Fatalf("plans: %+v / %+v", pa, pb)
	}
	report := func(h string, rs []routes.Route, refused int) {
		t.Helper()
		sum := &pool.RoutesSummary{Held: len(rs), Refused: refused, Digest: routes.Digest(rs), OnLink: onLink, At: w.clk.Now().Unix()}
		if _, err := w.hosts[h].Heartbeat(ctx, addrs[h], sum); err != nil {
			t.Fatal(err)
		}
	}
	report("node-a", pa.Routes, len(pa.Refused))
	report("node-b", pb.Routes[1:], len(pb.Refused)) // one route short: stale

	s, err := w.ctl.Status(ctx, "net-0") // routes are planned over every pool anyway
	if err != nil {
		t.Fatal(err)
	}
	byName := map[string]HostStatus{}
	for _, h := range s.Hosts {
		byName[h.Name] = h
	}
	if r := byName["node-a"].Routes; r == nil || !r.Matches || r.Held != len(pa.Routes) || r.Refused != 2 || len(r.Ring) != len(pa.Routes) {
		t.Fatalf("node-a's routes: %+v", r)
	}
	if r := byName["node-b"].Routes; r == nil || r.Matches || r.Held != len(pb.Routes)-1 || len(r.Ring) != len(pb.Routes) {
		t.Fatalf("node-b's routes: %+v", r)
	}
	if r := byName["node-c"].Routes; r != nil {
		t.Fatalf("node-c reported no routes, status says %+v", r)
	}
	var out bytes.Buffer
	RenderStatus(&out, s)
	text := out.String()
	checkWidth(t, text)
	// Each host's range of net-0, from the ring: one span per next hop.
	ring, err := w.ctl.Pool.RingOf(ctx, "net-0")
	if err != nil {
		t.Fatal(err)
	}
	span := map[string]string{}
	for _, r := range ring.Ranges {
		span[r.Host] = r.Start.String() + "-" + r.End.String()
	}
	want := []string{
		"  node-a (198.18.1.1, fd00:1::1): " + strconv.Itoa(len(pa.Routes)) + " held, 2 ranges refused, matches the ring\n",
		"    pool net-0: node-b via 198.18.1.2: " + span["node-b"] + " (",
		"    pool net-0: node-c via 198.18.1.3: " + span["node-c"] + " (",
		"  node-b (198.18.1.2): " + strconv.Itoa(len(pb.Routes)-1) + " held, 2 ranges refused, DIFFERS from the ring (wants " + strconv.Itoa(len(pb.Routes)) + "; reported now)\n" +
			"    wanted: pool net-0: node-a via 198.18.1.1: " + span["node-a"] + " (",
		"    wanted: pool net-0: node-c via 198.18.1.3: " + span["node-c"] + " (",
	}
	for _, x := range want {
		if !strings.Contains(text, x) {
			t.Errorf("status text lacks %q:\n%s", x, text)
		}
	}
	if strings.Contains(text, "  node-c (") {
		t.Errorf("status shows routes of node-c, which reported none:\n%s", text)
	}

	// node-b goes down: its last report, no verdict.
	if err := w.ctl.Store.Commit(ctx, nil, []store.Op{store.Delete(pool.LivenessKey("node-b"))}); err != nil {
		t.Fatal(err)
	}
	s, _ = w.ctl.Status(ctx, "")
	out.Reset()
	RenderStatus(&out, s)
	if x := "node-b (198.18.1.2): " + strconv.Itoa(len(pb.Routes)-1) + " held, 2 ranges refused when last reported (now); the host is down"; !strings.Contains(out.String(), x) {
		t.Errorf("status text lacks %q:\n%s", x, out.String())
	}
}
