//go:build integration

package agent

import (
	"bufio"
	"context"
	"fmt"
	"net/http"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ringipam/ringipam/internal/testenv"
	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/storeconfig"
)

// etcdRequests reads etcd's count of finished unary requests by method
// (grpc_server_handled_total, every code) from its /metrics.
func etcdRequests(t *testing.T, srv *testenv.Etcd) map[string]float64 {
	t.Helper()
	c := http.Client{Timeout: 10 * time.Second}
	r, err := c.Get(srv.Endpoints()[0] + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer r.Body.Close()
	out := map[string]float64{}
	sc := bufio.NewScanner(r.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "grpc_server_handled_total{") || !strings.Contains(line, `grpc_type="unary"`) {
			continue
		}
		_, rest, _ := strings.Cut(line, `grpc_method="`)
		method, _, _ := strings.Cut(rest, `"`)
		f := strings.Fields(line)
		v, err := strconv.ParseFloat(f[len(f)-1], 64)
		if err != nil {
			t.Fatalf("%s: %v", line, err)
		}
		out[method] += v
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// phaseCost is what one change cost etcd, in requests by method, from the
// change's write until every agent applied it.
type phaseCost map[string]float64

// measureAgents runs n agents (each its own etcd client, fake router and
// forwarder, no HTTP, every poll an hour away) holding a range each, then
// makes a host record change (host h-0's address) and a ring change (h-0
// takes the first range of a new pool), and returns what each cost etcd.
func measureAgents(t *testing.T, srv *testenv.Etcd, n int) (recordCost, ringCost phaseCost) {
	e := newEtcdSetup(t, srv)
	addr := func(i int) string { return fmt.Sprintf("198.18.1.%d", i+1) }
	host := func(i int) string { return fmt.Sprintf("h-%d", i) }
	for i := range n {
		allocOn(t, e.st, host(i), "c-"+host(i))
	}
	rts := make([]*fakeRouter, n)
	for i := range n {
		rts[i] = &fakeRouter{onLink: []netip.Prefix{netip.MustParsePrefix(addr(i) + "/16")}}
		cfg := e.config(t, host(i), addr(i))
		cfg.Routes, cfg.Ingress = true, true
		startAgent(t, cfg, withRouter(rts[i]), withForwarder(&fakeForwarder{}))
	}
	// every says whether, on every agent but h-0's, h-0's routes of pool
	// pl go through via.
	every := func(pl, via string) (bool, string) {
		for i := 1; i < n; i++ {
			ok := false
			for _, r := range rts[i].routes() {
				if r.Host == host(0) && r.Pool == pl {
					ok = r.Via.String() == via
					if !ok {
						break
					}
				}
			}
			if !ok {
				return false, fmt.Sprintf("%s: %v", host(i), rts[i].routes())
			}
		}
		return true, ""
	}
	waitLong(t, "every agent routing to every other host", func() (bool, string) {
		for i := range n {
			for j := range n {
				if i != j && !slices.Equal(viaOf(rts[i], host(j)), []string{addr(j)}) {
					return false, fmt.Sprintf("%s to %s: %v", host(i), host(j), rts[i].routes())
				}
			}
		}
		return true, ""
	})

	diff := func(before, after map[string]float64) phaseCost {
		out := phaseCost{}
		for m, v := range after {
			if d := v - before[m]; d != 0 {
				out[m] = d
			}
		}
		return out
	}
	before := etcdRequests(t, srv)
	record(t, e.st, host(0), "198.18.2.1")
	waitLong(t, "h-0's new address on every agent", func() (bool, string) { return every("p", "198.18.2.1") })
	record1 := diff(before, etcdRequests(t, srv))

	before = etcdRequests(t, srv)
	a, err := pool.New(e.st, host(0))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.Allocate(context.Background(), pool.Request{
		Owner: pool.Owner{Kind: pool.KindCNI, Network: "net", ContainerID: "q-1", IfName: "eth0"},
		Defs:  []pool.Def{v4Def("q", "198.18.9.0/24")},
		Wants: []pool.Want{{Pool: "q", Role: pool.RoleIP}},
	}); err != nil {
		t.Fatal(err)
	}
	waitLong(t, "h-0's range of the new pool on every agent", func() (bool, string) { return every("q", "198.18.2.1") })
	ring1 := diff(before, etcdRequests(t, srv))
	return record1, ring1
}

// One host record change and one ring change cost each of N agents O(1)
// etcd requests, whatever N: measured at N = 5 and N = 25 agents on a real
// etcd (each agent its own client), from etcd's own count of requests by
// method, the extra cost of 20 more agents divided by 20 is what one more
// agent costs. An agent that re-reads the rings, definitions or host
// records on an event (a Range each) fails it, at any N.
func TestEventsCostEachAgentConstantRequests(t *testing.T) {
	srv := testenv.StartEtcd(t)
	type cost struct{ record, ring phaseCost }
	costs := map[int]cost{}
	for _, n := range []int{5, 25} {
		t.Run(fmt.Sprintf("agents=%d", n), func(t *testing.T) {
			r, g := measureAgents(t, srv, n)
			costs[n] = cost{r, g}
			t.Logf("%d agents: host record change %v, ring change %v", n, r, g)
		})
	}
	if t.Failed() || len(costs) != 2 {
		return
	}
	for _, ph := range []struct {
		name       string
		small, big phaseCost
	}{{"host record change", costs[5].record, costs[25].record}, {"ring change", costs[5].ring, costs[25].ring}} {
		for method, limit := range map[string]float64{
			// Reads of what the watches carry: none.
			"Range": 0.5,
			// An agent whose routes changed writes its routes
			// summary (one read-and-write of its own record, two
			// Txns); nothing else.
			"Txn": 3,
		} {
			per := (ph.big[method] - ph.small[method]) / 20
			t.Logf("%s: %s requests per additional agent: %.2f (5 agents: %v, 25 agents: %v)", ph.name, method, per, ph.small[method], ph.big[method])
			if per > limit {
				t.Errorf("%s: each additional agent costs %.2f %s requests (at most %v): the agents read the store to learn what their watches carried", ph.name, per, method, limit)
			}
		}
	}
}

// The resync re-applies the routing table and the ingress forwards from the
// agent's copies, with no request to etcd: with the resync short and every
// poll an hour away, the fake router and forwarder are applied again and
// again while etcd counts no Range and no Txn.
func TestResyncReappliesFromTheCopies(t *testing.T) {
	srv := testenv.StartEtcd(t)
	e := newEtcdSetup(t, srv)
	allocOn(t, e.st, "host-b", "b-1")
	record(t, e.st, "host-b", "198.18.0.2")
	rt := &fakeRouter{onLink: []netip.Prefix{netip.MustParsePrefix("198.18.0.9/16")}}
	fwd := &fakeForwarder{}
	cfg := e.config(t, "host-a", "198.18.0.9")
	cfg.Routes, cfg.Ingress = true, true
	cfg.Resync = storeconfig.Duration(100 * time.Millisecond)
	startAgent(t, cfg, withRouter(rt), withForwarder(fwd))
	waitLong(t, "routes to host-b", func() (bool, string) {
		return slices.Equal(viaOf(rt, "host-b"), []string{"198.18.0.2"}), fmt.Sprint(rt.routes())
	})
	applies := func() (int, int) {
		rt.mu.Lock()
		defer rt.mu.Unlock()
		fwd.mu.Lock()
		defer fwd.mu.Unlock()
		return rt.applies, fwd.syncs
	}
	// Whatever the start wrote (the routes summary) is done once the
	// first resync applied the table again.
	a0, _ := applies()
	waitLong(t, "a first resync", func() (bool, string) { a, _ := applies(); return a > a0+1, "" })
	before := etcdRequests(t, srv)
	a1, s1 := applies()
	waitLong(t, "three more resyncs of the routes and of the forwards", func() (bool, string) {
		a, s := applies()
		return a >= a1+3 && s >= s1+3, fmt.Sprintf("applies %d, syncs %d", a-a1, s-s1)
	})
	after := etcdRequests(t, srv)
	for _, m := range []string{"Range", "Txn"} {
		if d := after[m] - before[m]; d != 0 {
			t.Errorf("%v %s requests during resyncs: a resync reads or writes the store", d, m)
		}
	}
}
