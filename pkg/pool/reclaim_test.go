package pool

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/memory"
)

// clock is a clock a test moves by hand.
type clock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *clock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.now }
func (c *clock) advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

func markLive(t testing.TB, st store.Store, host string) {
	t.Helper()
	if err := st.Commit(context.Background(), nil, []store.Op{store.Put(LivenessKey(host), []byte("lease"))}); err != nil {
		t.Fatal(err)
	}
}

func markDead(t testing.TB, st store.Store, host string) {
	t.Helper()
	if err := st.Commit(context.Background(), nil, []store.Op{store.Delete(LivenessKey(host))}); err != nil {
		t.Fatal(err)
	}
}

// hostOwner is an owner of a test host.
func hostOwner(host string, i int) Owner {
	return Owner{Kind: KindCNI, Network: "net", ContainerID: fmt.Sprintf("%s-%d", host, i), IfName: "eth0"}
}

// TestOrphanedHostIsReclaimed runs the orphaning story on st: host B
// stopped and aged past orphanAfter has everything reclaimed; host A with
// equally old allocations but a live liveness record loses nothing; B
// restarted cannot write from its stale view, learns it was orphaned, and
// its new containers get addresses A does not hold.
func runOrphanedHostIsReclaimed(t *testing.T, st store.Store) {
	ctx := context.Background()
	clk := &clock{now: time.Unix(1_800_000_000, 0)}
	def := v4Def("p", "198.18.0.0/26") // .1-.62
	a, _ := New(st, "host-a", WithClock(clk.Now))
	b, _ := New(st, "host-b", WithClock(clk.Now))
	for i := range 10 {
		for _, x := range []*Allocator{a, b} {
			if _, err := x.Allocate(ctx, Request{Owner: hostOwner(x.Host(), i), Reservation: fmt.Sprintf("ns/%s-%d", x.Host(), i), Wants: ipWant("p"), Defs: []Def{def}}); err != nil {
				t.Fatal(err)
			}
		}
	}
	if _, err := a.Heartbeat(ctx, "198.18.255.1", nil); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Heartbeat(ctx, "198.18.255.2", nil); err != nil {
		t.Fatal(err)
	}
	markLive(t, st, "host-a") // A's agent holds its lease; B's agent is gone
	// B's in-flight allocation read its view before it was orphaned.
	staleReq := Request{Owner: hostOwner("host-b", 99), Wants: ipWant("p")}
	stale, err := b.read(ctx, staleReq, nil)
	if err != nil {
		t.Fatal(err)
	}
	clk.advance(DefaultOrphanAfter - time.Minute)
	if reps, err := a.Sweep(ctx, DefaultOrphanAfter); err != nil || len(reps) != 0 {
		t.Fatalf("sweep before orphanAfter: %+v %v", reps, err)
	}
	clk.advance(2 * time.Minute)
	hosts, err := a.Hosts(ctx, DefaultOrphanAfter)
	if err != nil {
		t.Fatal(err)
	}
	states := map[string]HostState{}
	for _, h := range hosts {
		states[h.Name] = h.State
	}
	if states["host-a"] != HostUp || states["host-b"] != HostOrphaned {
		t.Fatalf("host states %v", states)
	}
	reps, err := a.Sweep(ctx, DefaultOrphanAfter)
	if err != nil || len(reps) != 1 || reps[0].Host != "host-b" || reps[0].Released != 10 {
		t.Fatalf("sweep: %+v %v", reps, err)
	}
	for i := range 10 {
		if _, ok, _ := a.Lookup(ctx, hostOwner("host-a", i)); !ok {
			t.Fatalf("live host-a lost %s", hostOwner("host-a", i))
		}
		if _, ok, _ := b.Lookup(ctx, hostOwner("host-b", i)); ok {
			t.Fatalf("orphaned host-b still holds %s", hostOwner("host-b", i))
		}
	}
	// B's stale view cannot commit.
	p, err := b.plan(ctx, stale, staleReq, true)
	if err == nil {
		_, err = b.commit(ctx, p)
	}
	if !errors.Is(err, store.ErrConflict) {
		t.Fatalf("allocation from the stale view: %v, want a conflict", err)
	}
	// B returns: it learns it was orphaned; new containers work from fresh
	// ranges and never get an address A holds.
	info, err := b.Heartbeat(ctx, "198.18.255.2", nil)
	if err != nil || info.OrphanedAt.IsZero() || info.Reclaimed != 10 {
		t.Fatalf("returning host's heartbeat: %+v %v", info, err)
	}
	if at, err := b.Orphaned(ctx); err != nil || at.IsZero() {
		t.Fatalf("Orphaned: %v %v", at, err)
	}
	heldByA := map[netip.Addr]bool{}
	all, _ := a.List(ctx, Filter{Host: "host-a"})
	for _, al := range all {
		heldByA[al.Addrs[0].Addr] = true
	}
	for i := range 20 {
		al, err := b.Allocate(ctx, Request{Owner: hostOwner("host-b", 100+i), Wants: ipWant("p")})
		if err != nil {
			t.Fatal(err)
		}
		if heldByA[al.Addrs[0].Addr] {
			t.Fatalf("returning host-b got %s, which host-a holds", al.Addrs[0].Addr)
		}
	}
	if bad, err := a.Check(ctx, "p"); err != nil || len(bad) != 0 {
		t.Fatalf("Check: %v %v", bad, err)
	}
	// A second sweep takes nothing of B's new view.
	clk.advance(time.Minute)
	if reps, err := a.Sweep(ctx, DefaultOrphanAfter); err != nil || len(reps) != 0 {
		t.Fatalf("second sweep: %+v %v", reps, err)
	}
	if got, _ := b.List(ctx, Filter{Host: "host-b"}); len(got) != 20 {
		t.Fatalf("host-b holds %d after the second sweep, want 20", len(got))
	}
	if at, err := b.AckOrphaned(ctx); err != nil || at.IsZero() {
		t.Fatalf("AckOrphaned: %v %v", at, err)
	}
	if at, _ := b.Orphaned(ctx); !at.IsZero() {
		t.Fatalf("still orphaned after the ack: %v", at)
	}
}

func TestOrphanedHostIsReclaimed(t *testing.T) { runOrphanedHostIsReclaimed(t, memory.New()) }

// runConcurrentSweeps: two agents sweeping at the same moment reclaim each
// orphaned allocation exactly once.
func runConcurrentSweeps(t *testing.T, st store.Store) {
	ctx := context.Background()
	clk := &clock{now: time.Unix(1_800_000_000, 0)}
	def := v4Def("p", "198.18.1.0/24")
	gone, _ := New(st, "gone", WithClock(clk.Now))
	const n = 40
	for i := range n {
		if _, err := gone.Allocate(ctx, Request{Owner: hostOwner("gone", i), Wants: ipWant("p"), Defs: []Def{def}}); err != nil {
			t.Fatal(err)
		}
	}
	clk.advance(DefaultOrphanAfter + time.Hour)
	var wg sync.WaitGroup
	reps := make([][]ReclaimReport, 2)
	errs := make([]error, 2)
	for i := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			a, _ := New(st, fmt.Sprintf("sweeper-%d", i), WithClock(clk.Now))
			reps[i], errs[i] = a.Sweep(ctx, DefaultOrphanAfter)
		}()
	}
	wg.Wait()
	total := 0
	for i := range 2 {
		if errs[i] != nil {
			t.Fatal(errs[i])
		}
		for _, r := range reps[i] {
			total += r.Released
		}
	}
	if total != n {
		t.Fatalf("the two sweeps released %d owners in all (%+v), want each of %d exactly once", total, reps, n)
	}
	if left, _ := gone.List(ctx, Filter{}); len(left) != 0 {
		t.Fatalf("%d owners left", len(left))
	}
}

func TestConcurrentSweepsReleaseOnce(t *testing.T) { runConcurrentSweeps(t, memory.New()) }

func TestReclaimRefusesALiveHost(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	a, _ := New(st, "a")
	b, _ := New(st, "b")
	if _, err := b.Allocate(ctx, Request{Owner: hostOwner("b", 0), Wants: ipWant("p"), Defs: []Def{v4Def("p", "198.18.2.0/24")}}); err != nil {
		t.Fatal(err)
	}
	markLive(t, st, "b")
	if _, err := a.Reclaim(ctx, "b", ReclaimOptions{}); !errors.Is(err, ErrHostLive) {
		t.Fatalf("reclaim of a live host: %v", err)
	}
	if _, ok, _ := b.Lookup(ctx, hostOwner("b", 0)); !ok {
		t.Fatal("refused reclaim released something")
	}
	if _, err := a.Reclaim(ctx, "a", ReclaimOptions{}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("reclaim of oneself: %v", err)
	}
	rep, err := a.Reclaim(ctx, "b", ReclaimOptions{Force: true})
	if err != nil || rep.Released != 1 {
		t.Fatalf("forced reclaim: %+v %v", rep, err)
	}
	markDead(t, st, "b")
}

// runRmpeerHandsFreeSpace: rmpeer of a dead host gives its free space to the
// caller at once, including space in ranges that still have held addresses
// (holds of its pods' reservations stay where they are).
func runRmpeerHandsFreeSpace(t *testing.T, st store.Store) {
	ctx := context.Background()
	def := v4Def("p", "198.18.3.0/28") // .1-.14
	a, _ := New(st, "caller")
	dead, _ := New(st, "dead")
	// The dead host takes the whole pool first; two of its pods carry
	// reservations, whose addresses stay held after the release.
	var heldAddrs []netip.Addr
	for i := range 4 {
		resv := ""
		if i < 2 {
			resv = fmt.Sprintf("ns/pod-%d", i)
		}
		al, err := dead.Allocate(ctx, Request{Owner: hostOwner("dead", i), Reservation: resv, Wants: ipWant("p"), Defs: []Def{def}})
		if err != nil {
			t.Fatal(err)
		}
		if resv != "" {
			heldAddrs = append(heldAddrs, al.Addrs[0].Addr)
		}
	}
	rep, err := a.Reclaim(ctx, "dead", ReclaimOptions{ToCaller: true})
	if err != nil || rep.Released != 4 || rep.Handed == 0 {
		t.Fatalf("rmpeer: %+v %v", rep, err)
	}
	r, _ := a.RingOf(ctx, "p")
	for _, h := range heldAddrs {
		if o, _ := r.Owner(h); o.Host != "dead" || !o.Tombstone {
			t.Fatalf("held %s is in %+v, want still the dead host's tombstone", h, o)
		}
	}
	// Every free address is the caller's now: it allocates 12 at once
	// with no claim needed.
	before := a.Stats().Claims
	for i := range 12 {
		if _, err := a.Allocate(ctx, Request{Owner: hostOwner("caller", i), Wants: ipWant("p")}); err != nil {
			t.Fatalf("caller allocation %d: %v", i, err)
		}
	}
	if a.Stats().Claims != before {
		t.Fatalf("the caller had to claim space (%d claims)", a.Stats().Claims-before)
	}
	// A pod of the dead host rescheduled on the caller gets its address back.
	back, err := a.Allocate(ctx, Request{Owner: hostOwner("caller", 50), Reservation: "ns/pod-0", Wants: ipWant("p")})
	if err != nil || back.Addrs[0].Addr != heldAddrs[0] {
		t.Fatalf("rescheduled pod got %v (%v), want %s", back.Addrs, err, heldAddrs[0])
	}
	if bad, err := a.Check(ctx, "p"); err != nil || len(bad) != 0 {
		t.Fatalf("Check: %v %v", bad, err)
	}
}

func TestRmpeerHandsFreeSpaceToTheCaller(t *testing.T) { runRmpeerHandsFreeSpace(t, memory.New()) }

// A host without an agent whose containers are only checked (no ADD or DEL
// for days) is not taken for gone: CHECK refreshes its last-seen time, at
// most once a minute (LastSeenEvery).
func TestCheckKeepsAnAgentlessHostSeen(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	clk := &clock{now: time.Date(2026, 11, 1, 0, 0, 0, 0, time.UTC)}
	a, _ := New(st, "quiet", WithClock(clk.Now))
	owner := hostOwner("quiet", 1)
	if _, err := a.Allocate(ctx, Request{Owner: owner, Wants: ipWant("p"), Defs: []Def{v4Def("p", "198.18.5.0/28")}}); err != nil {
		t.Fatal(err)
	}
	judge, _ := New(st, "judge", WithClock(clk.Now))
	for day := range 4 {
		clk.advance(24 * time.Hour)
		if _, ok, err := a.Lookup(ctx, owner); err != nil || !ok {
			t.Fatal(ok, err)
		}
		if _, err := judge.Sweep(ctx, 48*time.Hour); err != nil {
			t.Fatal(err)
		}
		if _, ok, _ := judge.Lookup(ctx, owner); !ok {
			t.Fatalf("day %d: the checked host's owner was reclaimed", day+1)
		}
	}
	hosts, _ := judge.Hosts(ctx, 48*time.Hour)
	for _, h := range hosts {
		if h.Name == "quiet" && (h.State != HostDown || h.Agent || !h.LastSeen.Equal(clk.Now().Truncate(time.Second))) {
			t.Fatalf("quiet host: %+v", h)
		}
	}
	// Without the checks it would have gone: three more silent days.
	clk.advance(72 * time.Hour)
	if reps, err := judge.Sweep(ctx, 48*time.Hour); err != nil || len(reps) != 1 || reps[0].Released != 1 {
		t.Fatalf("sweep after 3 silent days: %+v %v", reps, err)
	}
}

// diesAfterStore is a store whose process dies after its first n commits:
// every later commit fails with errCrashed (and changes nothing).
type diesAfterStore struct {
	store.Store
	n int
}

func (c *diesAfterStore) Commit(ctx context.Context, conds []store.Cond, ops []store.Op) error {
	if c.n == 0 {
		return errCrashed
	}
	c.n--
	return c.Store.Commit(ctx, conds, ops)
}

// TestSweepFinishesAReclaimCutShort: h1 is orphaned and reclaimed; its
// plugin (its agent gone) still allocates d, claiming tombstoned space, so
// h1 owns a live range again; orphaned once more, a sweep tombstones that
// range (dropping h1's state and count) and dies before releasing d. h1
// now shows an orphaned mark, no live range and no used count; the next
// sweep must still release d (it finds it through h1's index), and so
// must ringctl gc's plan.
func TestSweepFinishesAReclaimCutShort(t *testing.T) {
	ctx := context.Background()
	st, clk, h1, h2 := twoHostsHoldingAAndC(t)
	const after = time.Hour
	clk.advance(2 * after)
	if reps, err := h2.Sweep(ctx, after); err != nil || len(reps) != 1 || reps[0].Released != 1 {
		t.Fatalf("first sweep: %+v %v", reps, err)
	}
	if _, err := h1.Allocate(ctx, Request{Owner: own("d"), Wants: ipWant("p")}); err != nil {
		t.Fatal(err)
	}
	clk.advance(2 * after)
	h3, _ := New(&diesAfterStore{Store: st, n: 1}, "h3", WithClock(clk.Now))
	if _, err := h3.Sweep(ctx, after); !errors.Is(err, errCrashed) {
		t.Fatalf("the sweep that dies after its first commit: %v", err)
	}
	if _, ok, _ := h2.Lookup(ctx, own("d")); !ok {
		t.Fatal("the crashed sweep released d")
	}
	plans, err := h2.PlanSweep(ctx, after)
	if err != nil || len(plans) != 1 || len(plans[0].Owners) != 1 || plans[0].Owners[0].Owner != own("d") {
		t.Fatalf("PlanSweep after the crash: %+v %v, want h1 with d to release", plans, err)
	}
	reps, err := h2.Sweep(ctx, after)
	if err != nil || len(reps) != 1 || reps[0].Released != 1 {
		t.Fatalf("sweep after the crash: %+v %v, want d released", reps, err)
	}
	if _, ok, _ := h2.Lookup(ctx, own("d")); ok {
		t.Fatal("d is still held after the sweep")
	}
	if vs, err := h2.Audit(ctx); err != nil || len(vs) != 0 {
		t.Fatalf("Audit: %v %v", vs, err)
	}
	// Nothing is left: later sweeps report nothing.
	if reps, err := h2.Sweep(ctx, after); err != nil || len(reps) != 0 {
		t.Fatalf("a later sweep: %+v %v", reps, err)
	}
}

// TestReturningHostReadoptsWhatItsReclaimLeft: a sweep tombstones h1's
// ranges (dropping its state and count) and dies before releasing a; h1's
// agent comes back. No reclaim may release a any more (h1 is live), so
// h1 itself, once its liveness key exists, gives a's address back to its
// own ranges and counts it: Audit is clean, a is still held by h1, and
// h1 allocates and releases on from there with exact counts.
func TestReturningHostReadoptsWhatItsReclaimLeft(t *testing.T) {
	ctx := context.Background()
	st, clk, h1, h2 := twoHostsHoldingAAndC(t)
	const after = time.Hour
	if _, err := h1.Readopt(ctx); !errors.Is(err, ErrNotLive) {
		t.Fatalf("Readopt of a host whose liveness key is absent: %v, want ErrNotLive", err)
	}
	clk.advance(2 * after)
	crashing, _ := New(&diesAfterStore{Store: st, n: 1}, "h2", WithClock(clk.Now))
	if _, err := crashing.Sweep(ctx, after); !errors.Is(err, errCrashed) {
		t.Fatalf("the sweep that dies after its first commit: %v", err)
	}
	markLive(t, st, "h1") // h1's agent is back
	if vs, _ := h2.Audit(ctx); len(vs) == 0 {
		t.Fatal("Audit is clean before h1 readopts: the crash left nothing behind?")
	}
	if reps, err := h2.Sweep(ctx, after); err != nil || len(reps) != 0 {
		t.Fatalf("a sweep with h1 back: %+v %v, want nothing reclaimed", reps, err)
	}
	pools, err := h1.Readopt(ctx)
	if err != nil || !slices.Equal(pools, []string{"p"}) {
		t.Fatalf("Readopt: %v %v, want pool p changed", pools, err)
	}
	if vs, err := h2.Audit(ctx); err != nil || len(vs) != 0 {
		t.Fatalf("Audit after h1 readopted: %v %v", vs, err)
	}
	if al, ok, _ := h2.Lookup(ctx, own("a")); !ok || al.Host != "h1" {
		t.Fatalf("a after h1 readopted: %+v %v, want held by h1", al, ok)
	}
	if pools, err := h1.Readopt(ctx); err != nil || len(pools) != 0 {
		t.Fatalf("a second Readopt: %v %v, want nothing to do", pools, err)
	}
	if _, err := h1.Allocate(ctx, Request{Owner: own("e"), Wants: ipWant("p")}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := h1.Release(ctx, own("a")); err != nil {
		t.Fatal(err)
	}
	if vs, err := h2.Audit(ctx); err != nil || len(vs) != 0 {
		t.Fatalf("Audit after h1 allocated e and released a: %v %v", vs, err)
	}
}

// twoHostsHoldingAAndC is a memory store on a settable clock where h1 holds
// owner a and h2 (live) holds owner c in pool p (198.18.0.0/29).
func twoHostsHoldingAAndC(t *testing.T) (*memory.Store, *clock, *Allocator, *Allocator) {
	t.Helper()
	st := memory.New()
	clk := &clock{now: time.Unix(1_800_000_000, 0)}
	h1, _ := New(st, "h1", WithClock(clk.Now))
	h2, _ := New(st, "h2", WithClock(clk.Now))
	for _, x := range []struct {
		a  *Allocator
		id string
	}{{h1, "a"}, {h2, "c"}} {
		if _, err := x.a.Allocate(context.Background(), Request{Owner: own(x.id), Wants: ipWant("p"), Defs: []Def{v4Def("p", "198.18.0.0/29")}}); err != nil {
			t.Fatal(err)
		}
	}
	markLive(t, st, "h2")
	return st, clk, h1, h2
}

// afterScanStore runs hook once, right after the first Scan of prefix
// returns: a write of another process landing between two reads.
type afterScanStore struct {
	store.Store
	prefix string
	hook   func()
	done   bool
}

func (s *afterScanStore) Scan(ctx context.Context, from, to string, limit int) ([]store.KV, error) {
	kvs, err := s.Store.Scan(ctx, from, to, limit)
	if !s.done && from == s.prefix {
		s.done = true
		s.hook()
	}
	return kvs, err
}

// An allocation of the host that commits while Readopt runs (right after
// it read the host's owners) must not leave the host's count at what those
// owners held: the agent runs Readopt when it takes its lease, while its
// plugins may be allocating.
func TestReadoptRacingAnAllocationKeepsTheCount(t *testing.T) {
	ctx := context.Background()
	st, clk, h1, _ := twoHostsHoldingAAndC(t)
	markLive(t, st, "h1")
	racing := &afterScanStore{Store: st, prefix: hostOwnersPrefix("h1", "", ""), hook: func() {
		if _, err := h1.Allocate(ctx, Request{Owner: own("e"), Wants: ipWant("p")}); err != nil {
			t.Errorf("the racing allocation: %v", err)
		}
	}}
	readopting, _ := New(racing, "h1", WithClock(clk.Now))
	if _, err := readopting.Readopt(ctx); err != nil {
		t.Fatal(err)
	}
	if !racing.done {
		t.Fatal("Readopt never scanned the host's owners: the race was not run")
	}
	if vs, err := h1.Audit(ctx); err != nil || len(vs) != 0 {
		t.Fatalf("Audit after Readopt raced an allocation: %v %v", vs, err)
	}
}
