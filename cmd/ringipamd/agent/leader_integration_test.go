//go:build integration

package agent

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ringipam/ringipam/internal/testenv"
	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/store/etcd"
	"github.com/ringipam/ringipam/pkg/storeconfig"
)

// Tests of the liveness, the leader and the retention on a real etcd
// (internal/testenv): what the agent writes, and who sweeps.

// etcdEnv is one real etcd under a prefix of the test's own.
type etcdEnv struct {
	srv    *testenv.Etcd
	prefix string
	cli    *clientv3.Client
}

func newEtcdEnv(t *testing.T) *etcdEnv {
	t.Helper()
	srv := testenv.StartEtcd(t)
	cli, err := clientv3.New(clientv3.Config{Endpoints: srv.Endpoints(), DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	return &etcdEnv{srv: srv, prefix: "/lv-" + strings.ToLower(strings.ReplaceAll(t.Name(), "/", "-")) + "/", cli: cli}
}

// config is an agent's configuration for host on the test's etcd, with
// short intervals, its own plugins' socket and no packet filter.
func (e *etcdEnv) config(t *testing.T, host string) Config {
	t.Helper()
	dir, err := os.MkdirTemp("", "lv")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	cfg := DefaultConfig()
	cfg.Host, cfg.Addr = host, "198.18.0.9"
	cfg.Store = storeconfig.Config{Type: storeconfig.TypeEtcd, Endpoints: e.srv.Endpoints(), Prefix: e.prefix,
		AgentSocket: filepath.Join(dir, "store.sock"), DelQueue: filepath.Join(dir, "del-queue")}
	cfg.LeaseTTL = storeconfig.Duration(2 * time.Second)
	cfg.Heartbeat = storeconfig.Duration(100 * time.Millisecond)
	cfg.SweepInterval = storeconfig.Duration(50 * time.Millisecond)
	cfg.StatusRefresh = storeconfig.Duration(100 * time.Millisecond)
	cfg.Timeout = storeconfig.Duration(5 * time.Second)
	cfg.Ingress = false
	cfg.PortmapTable = "off"
	cfg.Listen = "off"
	return cfg
}

// running is an agent running until stop (or the test's end).
type running struct {
	*Agent
	stop func()
}

func (e *etcdEnv) start(t *testing.T, cfg Config, opts ...Option) *running {
	t.Helper()
	a, err := New(cfg, slog.New(slog.NewTextHandler(io.Discard, nil)), opts...)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("agent %s: %v", cfg.Host, err)
			}
		})
	}
	t.Cleanup(stop)
	waitCond(t, cfg.Host+"'s liveness key held", func() bool { return a.held != nil && a.held() })
	return &running{Agent: a, stop: stop}
}

// allocator is a pool allocator of host on the test's etcd, with a clock.
func (e *etcdEnv) allocator(t *testing.T, host string, now func() time.Time) *pool.Allocator {
	t.Helper()
	st, err := etcd.New(etcd.Config{Endpoints: e.srv.Endpoints(), Prefix: e.prefix, DialTimeout: 5 * time.Second, RequestTimeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	opts := []pool.Option{pool.WithTimeout(10 * time.Second)}
	if now != nil {
		opts = append(opts, pool.WithClock(now))
	}
	a, err := pool.New(st, host, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

func (e *etcdEnv) exists(t *testing.T, key string) bool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	r, err := e.cli.Get(ctx, e.prefix+key)
	if err != nil {
		t.Fatal(err)
	}
	return len(r.Kvs) > 0
}

// counter reads one of the agent's counters (-1: absent).
func counter(t *testing.T, a *Agent, name string) float64 {
	t.Helper()
	fams, err := a.metrics.registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		if f.GetName() == name && len(f.GetMetric()) == 1 {
			m := f.GetMetric()[0]
			if c := m.GetCounter(); c != nil {
				return c.GetValue()
			}
			return m.GetGauge().GetValue()
		}
	}
	return -1
}

// TestIdleAgentWritesNothingWatched: an idle agent's heartbeat never
// writes the host record (n/, which every routing agent watches), while
// its status record (s/, watched by nobody) gets its last-seen refresh
// when SeenEvery is tiny. Events are counted by a watch on each prefix
// over many heartbeats.
func TestIdleAgentWritesNothingWatched(t *testing.T) {
	e := newEtcdEnv(t)
	a := e.start(t, e.config(t, "idle"), withSeenEvery(time.Nanosecond))
	waitCond(t, "the host record written at start", func() bool { return e.exists(t, "n/idle") })
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var nEvents, sEvents atomic.Int64
	watch := func(prefix string, n *atomic.Int64) {
		started := make(chan struct{})
		go func() {
			wch := e.cli.Watch(clientv3.WithRequireLeader(ctx), e.prefix+prefix, clientv3.WithPrefix(), clientv3.WithCreatedNotify())
			close(started)
			for r := range wch {
				n.Add(int64(len(r.Events)))
			}
		}()
		<-started
	}
	watch("n/", &nEvents)
	watch("s/", &sEvents)
	beats := 0
	last := a.lastBeat.Load()
	deadline := time.Now().Add(60 * time.Second)
	for beats < 30 || sEvents.Load() < 2 {
		if time.Now().After(deadline) {
			t.Fatalf("after %d heartbeats: %d status record writes", beats, sEvents.Load())
		}
		time.Sleep(10 * time.Millisecond)
		if b := a.lastBeat.Load(); b != last {
			beats, last = beats+1, b
		}
	}
	if n := nEvents.Load(); n != 0 {
		t.Fatalf("%d writes of the watched host record over %d idle heartbeats, want none", n, beats)
	}
	t.Logf("%d heartbeats: %d status record writes, no host record write", beats, sEvents.Load())
}

// TestOneLeaderSweepsAndCompacts: of three agents exactly one leads and
// it alone sweeps, compacts the history and reports the pool-wide
// figures (the others' counters stay at zero); when it stops, another one
// leads and sweeps.
func TestOneLeaderSweepsAndCompacts(t *testing.T) {
	e := newEtcdEnv(t)
	var agents []*running
	for _, h := range []string{"h1", "h2", "h3"} {
		agents = append(agents, e.start(t, e.config(t, h), withCompactEvery(100*time.Millisecond)))
	}
	leaderOf := func(as []*running) (*running, int) {
		var l *running
		n := 0
		for _, a := range as {
			if a.Leading() {
				l, n = a, n+1
			}
		}
		return l, n
	}
	var leader *running
	waitCond(t, "one leader that swept and compacted", func() bool {
		l, n := leaderOf(agents)
		if n != 1 {
			return false
		}
		leader = l
		return counter(t, l.Agent, "ringipam_sweeps_total") >= 3 && counter(t, l.Agent, "ringipam_history_compactions_total") >= 2 &&
			l.figures.Load() != nil
	})
	var others []*running
	for _, a := range agents {
		if a == leader {
			continue
		}
		others = append(others, a)
		if a.Leading() || counter(t, a.Agent, "ringipam_sweeps_total") != 0 || counter(t, a.Agent, "ringipam_history_compactions_total") != 0 ||
			a.figures.Load() != nil || counter(t, a.Agent, "ringipam_leader") != 0 {
			t.Fatalf("%s, not the leader, swept %v times and compacted %v times (figures %v)", a.cfg.Host,
				counter(t, a.Agent, "ringipam_sweeps_total"), counter(t, a.Agent, "ringipam_history_compactions_total"), a.figures.Load() != nil)
		}
	}
	if counter(t, leader.Agent, "ringipam_leader") != 1 {
		t.Fatalf("the leader's ringipam_leader is %v", counter(t, leader.Agent, "ringipam_leader"))
	}
	t.Logf("%s leads", leader.cfg.Host)
	leader.stop()
	var next *running
	waitCond(t, "another agent leading and sweeping", func() bool {
		l, n := leaderOf(others)
		if n != 1 {
			return false
		}
		next = l
		return counter(t, l.Agent, "ringipam_sweeps_total") >= 3
	})
	for _, a := range others {
		if a != next && counter(t, a.Agent, "ringipam_sweeps_total") != 0 {
			t.Fatalf("%s swept while %s led", a.cfg.Host, next.cfg.Host)
		}
	}
	t.Logf("%s leads after %s stopped", next.cfg.Host, leader.cfg.Host)
}

// TestLeaderFiguresOnDemand: the leader reads the pool-wide figures when
// scraped, at most once per StatusRefresh, and not at all while nobody
// scrapes it (it read them every StatusRefresh before, 4 reads an idle
// host a minute in a 10-host cluster).
func TestLeaderFiguresOnDemand(t *testing.T) {
	e := newEtcdEnv(t)
	cfg := e.config(t, "lead")
	cfg.StatusRefresh = storeconfig.Duration(50 * time.Millisecond)
	a := e.start(t, cfg)
	waitCond(t, "leading", a.Leading)
	time.Sleep(10 * time.Duration(cfg.StatusRefresh))
	if f := a.figures.Load(); f != nil {
		t.Fatalf("pool-wide figures read at %v with nobody scraping", f.taken)
	}
	// A scrape reads them: the hosts' gauge counts this one, up.
	fams, err := a.metrics.registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	up := -1.0
	for _, f := range fams {
		if f.GetName() != "ringipam_hosts" {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "state" && l.GetValue() == "up" {
					up = m.GetGauge().GetValue()
				}
			}
		}
	}
	if up != 1 {
		t.Fatalf("ringipam_hosts{state=up} after a scrape of the leader: %v, want 1", up)
	}
	first := a.figures.Load()
	if first == nil {
		t.Fatal("no figures kept after a scrape")
	}
	// A second scrape within StatusRefresh reuses them; one after it reads anew.
	if f := a.leaderFigures(); f != first && a.now().Sub(first.taken) < time.Duration(cfg.StatusRefresh) {
		t.Errorf("figures read again within StatusRefresh")
	}
	time.Sleep(2 * time.Duration(cfg.StatusRefresh))
	if f := a.leaderFigures(); f == first || f == nil {
		t.Errorf("figures not read again after StatusRefresh: %v", f)
	}
}

// TestReclaimedHostRecordsGoAfterRetention: the leader reclaims two
// orphaned hosts; one of them comes back; after the retention the records
// of the one still gone are removed, while those of the host that came
// back, and of a live host last seen as long ago, stay.
func TestReclaimedHostRecordsGoAfterRetention(t *testing.T) {
	e := newEtcdEnv(t)
	ctx := context.Background()
	clk := &movingClock{now: time.Now()}
	for _, h := range []string{"gone", "back", "live"} {
		a := e.allocator(t, h, clk.Now)
		if _, err := a.Allocate(ctx, pool.Request{Owner: pool.Owner{Kind: pool.KindCNI, Network: "net", ContainerID: h + "-1", IfName: "eth0"},
			Wants: []pool.Want{{Pool: "p", Role: pool.RoleIP}}, Defs: []pool.Def{lvDef(t)}}); err != nil {
			t.Fatal(err)
		}
		if _, err := a.Heartbeat(ctx, "198.18.0.1", nil); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := e.cli.Put(ctx, e.prefix+pool.LivenessKey("live"), "{}"); err != nil {
		t.Fatal(err)
	}
	const orphanAfter = time.Hour
	clk.advance(2 * orphanAfter)
	cfg := e.config(t, "leader")
	cfg.OrphanAfter = storeconfig.Duration(orphanAfter)
	leader := e.start(t, cfg, WithClock(clk.Now))
	judge := e.allocator(t, "judge", clk.Now)
	state := func(h string) pool.HostInfo {
		hosts, err := judge.Hosts(ctx, orphanAfter)
		if err != nil {
			t.Fatal(err)
		}
		for _, x := range hosts {
			if x.Name == h {
				return x
			}
		}
		return pool.HostInfo{}
	}
	waitCond(t, "gone and back reclaimed", func() bool {
		return !state("gone").OrphanedAt.IsZero() && !state("back").OrphanedAt.IsZero()
	})
	if h := state("live"); h.State != pool.HostUp || !h.OrphanedAt.IsZero() {
		t.Fatalf("the live host: %+v", h)
	}
	// back comes back; then the retention passes.
	if _, err := e.cli.Put(ctx, e.prefix+pool.LivenessKey("back"), "{}"); err != nil {
		t.Fatal(err)
	}
	sweeps := counter(t, leader.Agent, "ringipam_sweeps_total")
	waitCond(t, "three sweeps with back up", func() bool { return counter(t, leader.Agent, "ringipam_sweeps_total") >= sweeps+3 })
	if !e.exists(t, "n/gone") || !e.exists(t, "s/gone") {
		t.Fatal("gone's records removed before the retention ended")
	}
	clk.advance(Retention(orphanAfter) + time.Minute)
	waitCond(t, "gone's records removed", func() bool { return !e.exists(t, "n/gone") && !e.exists(t, "s/gone") })
	sweeps = counter(t, leader.Agent, "ringipam_sweeps_total")
	waitCond(t, "two more sweeps", func() bool { return counter(t, leader.Agent, "ringipam_sweeps_total") >= sweeps+2 })
	for _, k := range []string{"n/back", "s/back", "n/live", "s/live"} {
		if !e.exists(t, k) {
			t.Errorf("%s removed: a host that is up (or came back) lost its record", k)
		}
	}
	if n := counter(t, leader.Agent, "ringipam_removed_hosts_total"); n != 1 {
		t.Errorf("ringipam_removed_hosts_total %v, want 1", n)
	}
	if h := state("back"); h.OrphanedAt.IsZero() || h.State != pool.HostUp {
		t.Errorf("back, which came back, is %+v: it must still read its orphaned mark", h)
	}
}

func lvDef(t *testing.T) pool.Def {
	t.Helper()
	return pool.Def{Name: "p", Ranges: []pool.Range{{Subnet: netip.MustParsePrefix("198.18.60.0/24")}}}
}

// failingListener's Accept fails once fail is closed (a socket that stops
// serving).
type failingListener struct {
	net.Listener
	fail chan struct{}
}

func (l *failingListener) Accept() (net.Conn, error) {
	type res struct {
		c   net.Conn
		err error
	}
	ch := make(chan res, 1)
	go func() { c, err := l.Listener.Accept(); ch <- res{c, err} }()
	select {
	case r := <-ch:
		return r.c, r.err
	case <-l.fail:
		return nil, errors.New("the test broke the socket")
	}
}

// TestLivezFailsWhenTheSocketStops: /livez (and /readyz) turn 503 when the
// plugins' socket stops serving, through the agent's own server loop.
func TestLivezFailsWhenTheSocketStops(t *testing.T) {
	e := newEtcdEnv(t)
	fail := make(chan struct{})
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	a := e.start(t, e.config(t, "sock"), WithListener(l), withAPIListener(func(l net.Listener) net.Listener {
		return &failingListener{Listener: l, fail: fail}
	}))
	base := "http://" + l.Addr().String()
	waitCond(t, "/livez and /readyz 200", func() bool {
		_, lc := get(base + "/livez")
		_, rc := get(base + "/readyz")
		return lc == 200 && rc == 200
	})
	close(fail)
	waitCond(t, "/livez 503 once the socket stopped serving", func() bool {
		body, lc := get(base + "/livez")
		_, rc := get(base + "/readyz")
		return lc == 503 && rc == 503 && strings.Contains(body, "socket")
	})
	_ = a
}

// TestAgentStopsDuringAnEtcdOutage: an agent (the leader) asked to stop
// while its etcd is down stops within a bounded time: no loop, the
// election's included, waits for the store without a deadline.
func TestAgentStopsDuringAnEtcdOutage(t *testing.T) {
	e := newEtcdEnv(t)
	cfg := e.config(t, "stopper")
	a, err := New(cfg, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	waitCond(t, "the agent leading", func() bool { return a.Leading() })
	e.srv.Stop()
	waitCond(t, "the liveness lease lost", func() bool { return !a.held() })
	cancel()
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		t.Fatal("the agent did not stop within 60s of being asked, with etcd down")
	}
	if a.Leading() {
		t.Fatal("still leading after it stopped")
	}
}

// waitLong waits for ok with a deadline generous for a loaded machine
// and a real etcd.
func waitCond(t *testing.T, what string, ok func() bool) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for !ok() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestLeaderCampaignsAgainAfterAnOutage: a leader whose session ends with
// an etcd outage stops leading, and leads (and sweeps) again once etcd is
// back.
func TestLeaderCampaignsAgainAfterAnOutage(t *testing.T) {
	e := newEtcdEnv(t)
	a := e.start(t, e.config(t, "phoenix"))
	waitCond(t, "the agent leading", func() bool { return a.Leading() })
	e.srv.Stop()
	waitCond(t, "the lead lost with the session", func() bool { return !a.Leading() })
	sweeps := counter(t, a.Agent, "ringipam_sweeps_total")
	e.srv.Start()
	waitCond(t, "the agent leading and sweeping again", func() bool {
		return a.Leading() && counter(t, a.Agent, "ringipam_sweeps_total") >= sweeps+2
	})
}
