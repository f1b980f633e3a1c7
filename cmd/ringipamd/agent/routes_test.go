package agent

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/portalloc"
	"github.com/ringipam/ringipam/pkg/routes"
	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/memory"
	"github.com/ringipam/ringipam/pkg/storeconfig"
	"github.com/ringipam/ringipam/pkg/watchcache"
)

// fakeRouter records what the agent installs.
type fakeRouter struct {
	mu      sync.Mutex
	onLink  []netip.Prefix
	last    []routes.Route
	applies int
	cleared bool
	closed  bool
	subnets []netip.Prefix
}

func (f *fakeRouter) OnLink() ([]netip.Prefix, error) { return f.onLink, nil }

func (f *fakeRouter) Apply(rs []routes.Route) (routes.Change, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.last, f.applies = slices.Clone(rs), f.applies+1
	return routes.Change{Added: len(rs)}, nil
}

func (f *fakeRouter) ProxyARP(subnets []netip.Prefix) ([]string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.subnets = slices.Clone(subnets)
	return []string{"br0"}, nil
}

func (f *fakeRouter) Clear() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.cleared, f.last = true, nil
	return nil
}

func (f *fakeRouter) Close() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.closed = true
}

func (f *fakeRouter) routes() []routes.Route {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.last)
}

// newRoutesAgent is host-a's agent with --routes on st, through a fake
// router, its loops every 20 ms but its heartbeat an hour away (it beats
// once, at start).
func newRoutesAgent(t *testing.T, st store.Store) (*Agent, *fakeRouter) {
	t.Helper()
	rt := &fakeRouter{onLink: []netip.Prefix{netip.MustParsePrefix("198.18.0.9/24")}}
	cfg := DefaultConfig()
	cfg.Host, cfg.Addr = "host-a", "198.18.0.9"
	cfg.SyncInterval, cfg.SweepInterval, cfg.StatusRefresh = 20*1e6, 20*1e6, 20*1e6
	cfg.Heartbeat = storeconfig.Duration(time.Hour)
	cfg.Ingress, cfg.PortmapTable, cfg.Listen = false, "off", "off"
	cfg.Routes = true
	a, err := New(cfg, slog.New(slog.NewTextHandler(io.Discard, nil)), withStore(st), withRouter(rt))
	if err != nil {
		t.Fatal(err)
	}
	return a, rt
}

// runAgent runs a until the returned stop (idempotent), which fails t if
// Run returned an error.
func runAgent(t *testing.T, a *Agent) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	var once sync.Once
	return func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				t.Error(err)
			}
		})
	}
}

// TestAgentRoutes runs the agent with --routes on the memory store: it
// routes host-b's ranges to host-b's address, refuses host-c's (no
// address), follows host-b's claim of more space, shows the routes in its
// snapshot and metric, publishes their summary in its host record, and
// takes them all out on stop.
func TestAgentRoutes(t *testing.T) {
	st := memory.New()
	alloc(t, st, "host-b", "p", "b-1")
	b, _ := pool.New(st, "host-b")
	if _, err := b.Heartbeat(context.Background(), "198.18.0.2", nil); err != nil {
		t.Fatal(err)
	}
	alloc(t, st, "host-c", "p", "c-1") // host-c has no agent: no address
	// The heartbeat an hour away: it runs once, at start, before any
	// claim below; only the routes loop's write on change can put the
	// summary of the claimed space into the host record.
	a, rt := newRoutesAgent(t, st)
	stop := runAgent(t, a)
	defer stop()

	// covers says whether the routes send every address host owns in
	// pool p through via, and nothing else.
	covers := func(host, via string) bool {
		ring, err := a.alloc.RingOf(context.Background(), "p")
		if err != nil {
			t.Fatal(err)
		}
		got := rt.routes()
		n := 0
		for _, r := range ring.Ranges {
			if r.Host != host || r.Tombstone {
				continue
			}
			for _, x := range []netip.Addr{r.Start, r.End} {
				n++
				if !slices.ContainsFunc(got, func(rr routes.Route) bool { return rr.Dst.Contains(x) && rr.Via.String() == via && rr.Host == host }) {
					return false
				}
			}
		}
		for _, rr := range got {
			if rr.Host != host || rr.Via.String() != via {
				return false
			}
		}
		return n > 0
	}
	waitFor(t, "routes to host-b's ranges", func() bool { return covers("host-b", "198.18.0.2") })
	waitFor(t, "the routes metric", func() bool {
		return routesGauge(t, a, "installed") == float64(len(rt.routes())) && routesGauge(t, a, "refused") == 1 &&
			routesGauge(t, a, "failed") == 0
	})
	// host-b fills its range and claims more: the new space is routed.
	ringBefore, _ := a.alloc.RingOf(context.Background(), "p")
	for i := 0; ; i++ {
		alloc(t, st, "host-b", "p", "b-more-"+string(rune('a'+i%26))+string(rune('a'+i/26)))
		ring, _ := a.alloc.RingOf(context.Background(), "p")
		if !slices.Equal(ring.Ranges, ringBefore.Ranges) {
			break
		}
		if i > 300 {
			t.Fatal("host-b never claimed more space")
		}
	}
	waitFor(t, "routes to host-b's claimed space", func() bool { return covers("host-b", "198.18.0.2") })
	waitFor(t, "the snapshot's routes", func() bool {
		a.refreshSnapshot(context.Background())
		s := a.snapshot.Load()
		return s != nil && s.Routes != nil && len(s.Routes.Routes) > 0 && s.Routes.Table == routes.DefaultTable &&
			len(s.Routes.Refused) == 1 && strings.Contains(s.Routes.Refused[0], "host host-c") &&
			slices.Equal(s.Routes.ProxyARP, []string{"br0"}) &&
			strings.Contains(s.Routes.Refused[0], "without --addr")
	})
	// The status page's HTML lists them.
	page, err := renderPage(*a.snapshot.Load(), time.Now())
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`<table id="routes">`, `<tr data-host="host-b"><td>` + rt.routes()[0].Dst.String() + `</td><td>198.18.0.2</td>`,
		`<ul id="routes-refused"><li>pool p: range`, "proxy ARP on br0", "all installed, as planned"} {
		if !strings.Contains(string(page), want) {
			t.Errorf("status page lacks %q:\n%s", want, page)
		}
	}
	// The summary in host-a's record (what ringctl status reads) is the
	// routes installed, once the claim is applied: written on change, not
	// at the next heartbeat (an hour away).
	waitFor(t, "the routes summary in the host record, written on change", func() bool {
		hs, err := a.alloc.Hosts(context.Background(), 0)
		if err != nil {
			t.Fatal(err)
		}
		got := rt.routes()
		for _, h := range hs {
			if h.Name == "host-a" {
				r := h.Routes
				return r != nil && r.Held == len(got) && r.Refused == 1 && r.Failed == 0 &&
					r.Digest == routes.Digest(got) && slices.Equal(r.OnLink, rt.onLink)
			}
		}
		return false
	})
	stop()
	rt.mu.Lock()
	defer rt.mu.Unlock()
	if len(rt.subnets) != 1 || rt.subnets[0].String() != "198.18.8.0/24" {
		t.Errorf("proxy ARP asked for %v, want the pool's subnet", rt.subnets)
	}
	if !rt.cleared || !rt.closed || len(rt.last) != 0 {
		t.Fatalf("on stop: cleared %v, closed %v, left %v", rt.cleared, rt.closed, rt.last)
	}
}

// routesGauge reads ringipam_routes{state} from the agent's registry.
func routesGauge(t *testing.T, a *Agent, state string) float64 {
	t.Helper()
	fams, err := a.metrics.registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		if f.GetName() != "ringipam_routes" {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "state" && l.GetValue() == state {
					return m.GetGauge().GetValue()
				}
			}
		}
	}
	return -1
}

func TestRoutesConfig(t *testing.T) {
	none := func(string) string { return "" }
	cfg, err := LoadConfig([]string{"--host", "n1"}, none, io.Discard)
	if err != nil || cfg.Routes {
		t.Fatalf("default: routes %v, %v", cfg.Routes, err)
	}
	cfg, err = LoadConfig([]string{"--host", "n1", "--routes", "--routes-table", "100", "--routes-protocol", "99"}, none, io.Discard)
	if err != nil || !cfg.Routes || cfg.routesTable() != (routes.TableConfig{Table: 100, Protocol: 99}) {
		t.Fatalf("%+v, %v", cfg, err)
	}
	for _, bad := range [][]string{{"--routes", "--routes-table", "254"}, {"--routes", "--routes-protocol", "3"}, {"--routes", "--routes-rule-priority", "40000"}} {
		if _, err := LoadConfig(append([]string{"--host", "n1"}, bad...), none, io.Discard); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

// summaryCounter counts the commits that write key (a host's status
// record).
type summaryCounter struct {
	store.Store
	key    string
	mu     sync.Mutex
	writes []time.Time
}

func (c *summaryCounter) Commit(ctx context.Context, conds []store.Cond, ops []store.Op) error {
	err := c.Store.Commit(ctx, conds, ops)
	for _, o := range ops {
		if o.Key == c.key && err == nil {
			c.mu.Lock()
			c.writes = append(c.writes, time.Now())
			c.mu.Unlock()
		}
	}
	return err
}

func (c *summaryCounter) count() []time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.writes)
}

// TestRoutesSummaryWritesAreSpaced: a burst of ring changes (another host
// claiming range after range, as when a cluster starts) is routed change
// by change, but the routes summary in this host's status record is
// written at most once per 5 s (summaryEvery), the last state included:
// with a write per change every agent of a starting cluster wrote once
// for every other host's claim.
func TestRoutesSummaryWritesAreSpaced(t *testing.T) {
	st := &summaryCounter{Store: memory.New(), key: "s/host-a"}
	alloc(t, st, "host-b", "p", "b-0")
	b, _ := pool.New(st, "host-b")
	if _, err := b.Heartbeat(context.Background(), "198.18.0.2", nil); err != nil {
		t.Fatal(err)
	}
	a, rt := newRoutesAgent(t, st) // after its first beat, only the routes loop writes the summary
	defer runAgent(t, a)()
	ctx := context.Background()
	// routedB says whether every range host-b owns is routed to it.
	routedB := func() bool {
		ring, err := a.alloc.RingOf(ctx, "p")
		if err != nil {
			t.Fatal(err)
		}
		got := rt.routes()
		for _, r := range ring.Ranges {
			if r.Host != "host-b" {
				continue
			}
			for _, x := range []netip.Addr{r.Start, r.End} {
				if !slices.ContainsFunc(got, func(rr routes.Route) bool { return rr.Dst.Contains(x) && rr.Host == "host-b" }) {
					return false
				}
			}
		}
		return len(got) > 0
	}
	summary := func() *pool.RoutesSummary {
		hs, err := a.alloc.Hosts(ctx, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, h := range hs {
			if h.Name == "host-a" {
				return h.Routes
			}
		}
		return nil
	}
	waitFor(t, "routes to host-b", routedB)
	waitFor(t, "the first summary", func() bool { s := summary(); return s != nil && s.Held > 0 })
	// The heartbeat at start wrote the status record too: the writes
	// looked at start with the last one before the burst.
	before := len(st.count()) - 1
	// host-b fills its space again and again, each fill claiming more;
	// each claim is routed before the next: one routes change each.
	start := time.Now()
	claims := 0
	ringBefore, _ := a.alloc.RingOf(ctx, "p")
	for i := 0; claims < 3 && i < 400; i++ {
		alloc(t, st, "host-b", "p", fmt.Sprintf("b-%d", i+1))
		ring, _ := a.alloc.RingOf(ctx, "p")
		if !slices.Equal(ring.Ranges, ringBefore.Ranges) {
			claims++
			ringBefore = ring
			waitFor(t, "routes to host-b's new range", routedB)
		}
	}
	if claims < 3 {
		t.Fatalf("host-b claimed %d times, want 3", claims)
	}
	elapsed := time.Since(start)
	// The last summary is written within summaryEvery, whatever the
	// heartbeat (an hour away) does.
	waitFor(t, "the summary of the last claim", func() bool {
		s := summary()
		return s != nil && s.Digest == routes.Digest(rt.routes()) && s.Held == len(rt.routes())
	})
	writes := st.count()[before:]
	for i := 1; i < len(writes); i++ {
		if gap := writes[i].Sub(writes[i-1]); gap < 5*time.Second {
			t.Errorf("summary writes %d and %d %v apart, want at least 5s", i-1, i, gap)
		}
	}
	t.Logf("%d claims routed over %v, then %d summary writes", claims, elapsed, len(writes)-1)
}

// knownHosts follows its copies: a host record added, an address changed,
// a liveness key gone, a host seen only in a ring (extra); its answer is
// kept only while neither copy changes (the routes loop plans on every
// ring change).
func TestKnownHostsFollowsItsCopies(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Host = "host-a"
	a := &Agent{cfg: cfg, log: slog.New(slog.NewTextHandler(io.Discard, nil)), rt: &fakeRouter{}}
	a.caches = a.newCaches()
	rec := func(addr string) []byte { return []byte(`{"addr":"` + addr + `"}`) }
	hosts := func(kvs ...watchcache.RawKV) { a.caches.hosts.Replace(kvs, 0) }
	live := func(kvs ...watchcache.RawKV) { a.caches.live.Replace(kvs, 0) }
	got := func(extra ...string) string {
		var b strings.Builder
		for _, h := range a.knownHosts(extra) {
			fmt.Fprintf(&b, "%s:%s:%s ", h.Name, h.Addr, h.State)
		}
		return strings.TrimSpace(b.String())
	}
	check := func(want string, extra ...string) {
		t.Helper()
		if g := got(extra...); g != want {
			t.Fatalf("knownHosts(%v) = %q, want %q", extra, g, want)
		}
	}
	hosts(watchcache.RawKV{Key: pool.HostRecordKeyPrefix + "host-b", Value: rec("198.18.0.2")})
	live(watchcache.RawKV{Key: pool.LivenessKey("host-b"), Value: []byte("{}")})
	check("host-b:198.18.0.2:" + string(pool.HostUp))
	check("host-b:198.18.0.2:"+string(pool.HostUp)+" host-c::"+string(pool.HostDown), "host-c", "host-b")
	hosts(watchcache.RawKV{Key: pool.HostRecordKeyPrefix + "host-b", Value: rec("198.18.0.3")},
		watchcache.RawKV{Key: pool.HostRecordKeyPrefix + "host-d", Value: rec("198.18.0.4")})
	check("host-b:198.18.0.3:" + string(pool.HostUp) + " host-d:198.18.0.4:" + string(pool.HostDown))
	live()
	check("host-b:198.18.0.3:" + string(pool.HostDown) + " host-d:198.18.0.4:" + string(pool.HostDown))
}

// The ingress loop's pass looks up the hosts that hold ingress ports, not
// every host: with a thousand host records it builds no list of them
// (knownHosts's memo stays empty), and its forwards and problems are
// those of the holders alone.
func TestIngressLooksUpOnlyTheHolders(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	for host, port := range map[string]uint16{"host-b": 8443, "host-gone": 9443} {
		ports, err := portalloc.New(st, host)
		if err != nil {
			t.Fatal(err)
		}
		ep := portalloc.EndpointID{Network: "net", ContainerID: host + "-web", IfName: "eth0"}
		if _, err := ports.Allocate(ctx, ep, []portalloc.Port{{Mode: portalloc.Ingress, Protocol: "tcp", Number: port, Name: "80"}}); err != nil {
			t.Fatal(err)
		}
	}
	kvs, err := st.Scan(ctx, portalloc.PublishedKeyPrefix, store.PrefixEnd(portalloc.PublishedKeyPrefix), 0)
	if err != nil {
		t.Fatal(err)
	}
	cfg := DefaultConfig()
	cfg.Host, cfg.Ingress = "host-a", true
	a := &Agent{cfg: cfg, log: slog.New(slog.NewTextHandler(io.Discard, nil)), metrics: newMetrics(nil)}
	a.caches = a.newCaches()
	var raw []watchcache.RawKV
	for _, kv := range kvs {
		raw = append(raw, watchcache.RawKV{Key: kv.Key, Value: kv.Value, ModRevision: kv.Revision})
	}
	a.caches.ports.Replace(raw, 0)
	recs := []watchcache.RawKV{{Key: pool.HostRecordKeyPrefix + "host-b", Value: []byte(`{"addr":"198.18.0.2"}`)}}
	for i := range 1000 {
		recs = append(recs, watchcache.RawKV{Key: fmt.Sprintf("%shost-%04d", pool.HostRecordKeyPrefix, i), Value: []byte(`{"addr":"198.19.0.1"}`)})
	}
	a.caches.hosts.Replace(recs, 0)
	a.caches.live.Replace([]watchcache.RawKV{{Key: pool.LivenessKey("host-b"), Value: []byte("{}")}}, 0)

	fs := a.desired()
	if len(fs) != 1 || fs[0].Port != 8443 || fs[0].To != netip.MustParseAddr("198.18.0.2") || fs[0].Host != "host-b" {
		t.Errorf("forwards = %v, want tcp/8443 to host-b at 198.18.0.2", fs)
	}
	a.mu.Lock()
	problems := a.problems
	a.mu.Unlock()
	if len(problems) != 1 || !strings.Contains(problems[0], "unknown host host-gone") {
		t.Errorf("problems = %q, want host-gone's port held on an unknown host", problems)
	}
	if a.hostsMemo.ok {
		t.Error("the ingress pass listed every host of the copies (knownHosts), not the holders")
	}
}

// A change is planned routesSettle after it arrives, and never sooner
// than routesMinInterval after the last plan.
func TestPlanDelay(t *testing.T) {
	now := time.Date(2026, 12, 2, 0, 0, 0, 0, time.UTC)
	for _, c := range []struct {
		since time.Duration // since the last plan
		want  time.Duration
	}{
		{time.Hour, routesSettle},
		{routesMinInterval, routesSettle},
		{routesMinInterval - routesSettle, routesSettle},
		{routesMinInterval / 4, routesMinInterval - routesMinInterval/4},
		{0, routesMinInterval},
	} {
		if got := planDelay(now, now.Add(-c.since)); got != c.want {
			t.Errorf("planDelay %s after the last plan = %s, want %s", c.since, got, c.want)
		}
	}
	if routesMinInterval <= routesSettle {
		t.Errorf("routesMinInterval %s is no longer than routesSettle %s: a stream of changes is planned once per settle", routesMinInterval, routesSettle)
	}
}
