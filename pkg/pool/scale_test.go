package pool

import (
	"context"
	"fmt"
	"sync"
	"testing"

	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/memory"
)

// byteCounter is a store that counts what its callers send it (the bytes
// of keys, values and conditions: a revision counts 8) and what it answers
// (keys and values), and its round trips: what travels between a host and
// etcd, without etcd's framing.
type byteCounter struct {
	*memory.Store
	mu             sync.Mutex
	sent, received int
	trips          int
	keys           int // keys answered by reads
}

func (c *byteCounter) take() (sent, received, trips int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	sent, received, trips = c.sent, c.received, c.trips
	c.sent, c.received, c.trips, c.keys = 0, 0, 0, 0
	return sent, received, trips
}

// keysRead returns the keys answered since the last take, and starts
// counting again.
func (c *byteCounter) keysRead() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	k := c.keys
	c.sent, c.received, c.trips, c.keys = 0, 0, 0, 0
	return k
}

func (c *byteCounter) count(conds []store.Cond, same []store.KV, ops []store.Op, keys []string, answered []store.KV) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.trips++
	for _, x := range conds {
		c.sent += len(x.Key) + len(x.End) + 8
	}
	for _, kv := range same {
		c.sent += len(kv.Key) + len(kv.Value)
	}
	for _, o := range ops {
		c.sent += len(o.Key) + len(o.Value)
	}
	for _, k := range keys {
		c.sent += len(k)
	}
	for _, kv := range answered {
		c.received += len(kv.Key) + len(kv.Value)
	}
	c.keys += len(answered)
}

func (c *byteCounter) Get(ctx context.Context, keys ...string) ([]store.KV, error) {
	kvs, err := c.Store.Get(ctx, keys...)
	c.count(nil, nil, nil, keys, kvs)
	return kvs, err
}

func (c *byteCounter) Scan(ctx context.Context, from, to string, limit int) ([]store.KV, error) {
	kvs, err := c.Store.Scan(ctx, from, to, limit)
	c.count(nil, nil, nil, []string{from, to}, kvs)
	return kvs, err
}

func (c *byteCounter) Commit(ctx context.Context, conds []store.Cond, ops []store.Op) error {
	err := c.Store.Commit(ctx, conds, ops)
	c.count(conds, nil, ops, nil, nil)
	return err
}

func (c *byteCounter) CommitOrGet(ctx context.Context, conds []store.Cond, same []store.KV, ops []store.Op, read []string) (int64, []store.KV, error) {
	rev, kvs, err := c.Store.CommitOrGet(ctx, conds, same, ops, read)
	c.count(conds, same, ops, read, kvs)
	return rev, kvs, err
}

// verbBytes is what one steady-state verb of one host cost the store.
type verbBytes struct{ sent, received, trips int }

func (v verbBytes) total() int { return v.sent + v.received }

// spreadRing gives pool def's space to n hosts, host0000 to host%04d,
// as their first claims would: the ring split into n equal ranges in host
// order (built by ring.assign and encoded as claims do), and each other
// host's state with one address used. host0000's own state is left as
// its allocations wrote it.
func spreadRing(t testing.TB, st store.Store, def Def, n int) {
	t.Helper()
	ctx := context.Background()
	def, err := def.Normalize()
	if err != nil {
		t.Fatal(err)
	}
	r := newRing(def)
	step := r.space.size()
	step.lo /= uint64(n) // a /16's size fits in lo
	lo := r.space.lo
	for i := range n {
		hi := lo.add(step).dec()
		if i == n-1 {
			hi = r.space.hi
		}
		r = r.assign(lo, hi, fmt.Sprintf("host%04d", i))
		lo = hi.inc()
	}
	if err := r.check(); err != nil {
		t.Fatal(err)
	}
	used := map[string]uint64{}
	for i := 1; i < n; i++ {
		used[fmt.Sprintf("host%04d", i)] = 1
	}
	putRing(t, st, def, r, used)
	_ = ctx
}

// steadyVerbs measures the steady-state verbs of host0000 in one /16 pool
// whose space n hosts share (spreadRing), host0000 keeping notes as
// ipam-ring does: an ADD after one that made its note true again, a CHECK
// (Lookup) after one that refreshed its last-seen time, and a DEL
// (ReleaseWith, hinted as ipam-ring hints it).
func steadyVerbs(t *testing.T, n int) (add, check, del verbBytes, ringBytes int) {
	t.Helper()
	ctx := context.Background()
	st := &byteCounter{Store: memory.New()}
	def := v4Def("p", "198.18.0.0/16")
	mine, err := New(st, "host0000", WithNotes(&memNotes{}), WithLastSeen())
	if err != nil {
		t.Fatal(err)
	}
	alloc := func(id string) {
		t.Helper()
		if _, err := mine.Allocate(ctx, Request{Owner: own(id), Wants: ipWant("p"), Defs: []Def{def}}); err != nil {
			t.Fatal(err)
		}
	}
	alloc("first")
	spreadRing(t, st, def, n)
	kvs, err := st.Scan(ctx, rangePrefix("p"), store.PrefixEnd(rangePrefix("p")), 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, kv := range kvs {
		ringBytes += len(kv.Key) + len(kv.Value)
	}
	// The ring changed since host0000's note: its next allocation finds
	// that out (the rare path), the one after is the steady state.
	alloc("warm")
	st.take()
	alloc("steady")
	add.sent, add.received, add.trips = st.take()
	for range 2 {
		st.take()
		if _, ok, err := mine.Lookup(ctx, own("steady")); err != nil || !ok {
			t.Fatalf("lookup: %v %v", ok, err)
		}
	}
	check.sent, check.received, check.trips = st.take()
	if _, ok, err := mine.ReleaseWith(ctx, own("steady"), ReleaseHint{Pools: []string{"p"}}); err != nil || !ok {
		t.Fatalf("release: %v %v", ok, err)
	}
	del.sent, del.received, del.trips = st.take()
	return add, check, del, ringBytes
}

// An ADD, a CHECK and a DEL on one host cost the store the same whatever
// the number of hosts sharing the pool (DESIGN, "Scale"): at 1 000 hosts at
// most 1.2 times what they cost at 10, in one round trip for the ADD and
// the CHECK and two for the DEL.
func TestSteadyVerbsDoNotGrowWithHosts(t *testing.T) {
	type row struct {
		add, check, del verbBytes
		ring            int
	}
	rows := map[int]row{}
	for _, n := range []int{10, 1000} {
		var r row
		r.add, r.check, r.del, r.ring = steadyVerbs(t, n)
		rows[n] = r
		t.Logf("%4d hosts (ring %6d bytes): ADD %5d bytes sent, %5d received, %d round trips; CHECK %4d/%4d, %d; DEL %4d/%4d, %d",
			n, r.ring, r.add.sent, r.add.received, r.add.trips, r.check.sent, r.check.received, r.check.trips, r.del.sent, r.del.received, r.del.trips)
	}
	small, large := rows[10], rows[1000]
	if large.ring < 20*small.ring {
		t.Fatalf("the ring at 1000 hosts (%d bytes) is not much larger than at 10 (%d): the setup did not spread the pool", large.ring, small.ring)
	}
	for _, v := range []struct {
		verb         string
		small, large verbBytes
		trips        int
	}{{"ADD", small.add, large.add, 1}, {"CHECK", small.check, large.check, 1}, {"DEL", small.del, large.del, 2}} {
		if float64(v.large.total()) > 1.2*float64(v.small.total()) {
			t.Errorf("a steady-state %s costs %d bytes at 1000 hosts, %d at 10 (x%.2f, at most x1.2)", v.verb, v.large.total(), v.small.total(), float64(v.large.total())/float64(v.small.total()))
		}
		if v.small.trips > v.trips || v.large.trips > v.trips {
			t.Errorf("a steady-state %s takes %d round trips at 10 hosts, %d at 1000; at most %d", v.verb, v.small.trips, v.large.trips, v.trips)
		}
	}
}

// BenchmarkSteadyAdd is a steady-state ADD on notes (as in
// TestSteadyVerbsDoNotGrowWithHosts) on a memory store, by the number of
// hosts sharing the pool: the CPU an ADD costs its host, which plans on
// the note's ranges of this host and so does not grow with the others'.
func BenchmarkSteadyAdd(b *testing.B) {
	for _, n := range []int{10, 1000, 5000} {
		b.Run(fmt.Sprintf("hosts=%d", n), func(b *testing.B) {
			ctx := context.Background()
			st := memory.New()
			def := v4Def("p", "198.18.0.0/16")
			a, err := New(st, "host0000", WithNotes(&memNotes{}))
			if err != nil {
				b.Fatal(err)
			}
			alloc := func(o Owner) {
				if _, err := a.Allocate(ctx, Request{Owner: o, Wants: ipWant("p"), Defs: []Def{def}}); err != nil {
					b.Fatal(err)
				}
			}
			alloc(own("first"))
			spreadRing(b, st, def, n)
			alloc(own("warm"))
			wrong := a.Stats().NotesWrong
			b.ResetTimer()
			for i := range b.N {
				o := own(fmt.Sprint("c", i))
				alloc(o)
				b.StopTimer()
				if _, _, err := a.ReleaseWith(ctx, o, ReleaseHint{Pools: []string{"p"}}); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
			}
			if w := a.Stats().NotesWrong - wrong; w != 0 {
				b.Fatalf("%d steady-state ADDs found their note wrong", w)
			}
		})
	}
}

// spreadBlocks gives hosts host0001 to host%04d (n-1 of them) one claimed
// block each of pool def, in the blocks right after host0000's first, as
// their first claims would leave the ring (the order aside), each with one
// address used.
func spreadBlocks(t testing.TB, st store.Store, def Def, n int) {
	t.Helper()
	def, err := def.Normalize()
	if err != nil {
		t.Fatal(err)
	}
	_, r := readTestRing(t, st, def.Name)
	b := blockSize(def)
	lo := r.space.lo.add(u128{lo: b})
	used := map[string]uint64{}
	for i := 1; i < n; i++ {
		h := fmt.Sprintf("host%04d", i)
		r = r.assign(lo, lo.add(u128{lo: b - 1}), h)
		used[h] = 1
		lo = lo.add(u128{lo: b})
	}
	putRing(t, st, def, r, used)
}

// firstVerbs measures, in a pool whose ring n hosts share (spreadBlocks),
// a new host's first ADD (it claims a block) and, once that block is
// full, the ADD that claims its second: what a host joining a cluster of
// n hosts costs the store.
func firstVerbs(t *testing.T, n int) (first, claim verbBytes) {
	t.Helper()
	ctx := context.Background()
	st := &byteCounter{Store: memory.New()}
	def := Def{Name: "p", Ranges: []Range{{Subnet: mustPrefix("2001:db8:1::/64")}}}
	h0, _ := New(st, "host0000")
	if _, err := h0.Allocate(ctx, Request{Owner: own("h0"), Wants: ipWant("p"), Defs: []Def{def}}); err != nil {
		t.Fatal(err)
	}
	spreadBlocks(t, st, def, n)
	mine, _ := New(st, "joiner", WithNotes(&memNotes{}), WithLastSeen())
	alloc := func(id string) {
		t.Helper()
		if _, err := mine.Allocate(ctx, Request{Owner: own(id), Wants: ipWant("p"), Defs: []Def{def}}); err != nil {
			t.Fatal(err)
		}
	}
	st.take()
	alloc("c0")
	first.sent, first.received, first.trips = st.take()
	for i := 1; i < maxBlock; i++ {
		alloc(fmt.Sprint("c", i))
	}
	claims := mine.Stats().Claims
	st.take()
	alloc("claims")
	claim.sent, claim.received, claim.trips = st.take()
	if got := mine.Stats().Claims; got != claims+1 {
		t.Fatalf("the %dth ADD made %d claims, want 1 (its block of %d is full)", maxBlock+1, got-claims, maxBlock)
	}
	return first, claim
}

// A host's first ADD (which claims a block) and a later claim cost the
// store the same whatever the number of hosts that share the pool: at
// 1 000 hosts at most 1.2 times what they cost at 10 (issue 42, item 1
// and 2). In layout 3 both read (and the claim rewrote) the whole ring.
func TestFirstADDAndClaimDoNotGrowWithHosts(t *testing.T) {
	rows := map[int][2]verbBytes{}
	for _, n := range []int{10, 1000} {
		f, c := firstVerbs(t, n)
		rows[n] = [2]verbBytes{f, c}
		t.Logf("%4d hosts: first ADD %5d bytes sent, %5d received, %d round trips; a claim %5d/%5d, %d", n, f.sent, f.received, f.trips, c.sent, c.received, c.trips)
	}
	for i, verb := range []string{"first ADD", "claim"} {
		small, large := rows[10][i], rows[1000][i]
		if float64(large.total()) > 1.2*float64(small.total()) {
			t.Errorf("a %s costs %d bytes at 1000 hosts, %d at 10 (x%.2f, at most x1.2)", verb, large.total(), small.total(), float64(large.total())/float64(small.total()))
		}
	}
}

// No key of the layout grows with the number of hosts: 5 000 hosts each
// claim through the product, one of them is reclaimed and one leaves,
// and no value is larger than 64 KB (issue 42, item 2).
func TestNoKeyGrowsWithHosts(t *testing.T) {
	if testing.Short() {
		t.Skip("5 000 allocations")
	}
	ctx := context.Background()
	st := memory.New()
	def := Def{Name: "p", Ranges: []Range{{Subnet: mustPrefix("2001:db8:2::/64")}}}
	const n = 5000
	var hosts []*Allocator
	for i := range n {
		a, _ := New(st, fmt.Sprintf("host%04d", i))
		if _, err := a.Allocate(ctx, Request{Owner: own(fmt.Sprint("c", i)), Wants: ipWant("p"), Defs: []Def{def}}); err != nil {
			t.Fatal(err)
		}
		hosts = append(hosts, a)
	}
	if _, err := hosts[0].Reclaim(ctx, "host0001", ReclaimOptions{Force: true, ToCaller: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := hosts[2].Reclaim(ctx, "host0002", ReclaimOptions{Leave: true}); err != nil {
		t.Fatal(err)
	}
	kvs, err := st.Scan(ctx, "", "\xff", 0)
	if err != nil {
		t.Fatal(err)
	}
	largest := store.KV{}
	for _, kv := range kvs {
		if len(kv.Value) > len(largest.Value) {
			largest = kv
		}
	}
	t.Logf("%d keys for %d hosts; the largest, %s, holds %d bytes", len(kvs), n, largest.Key, len(largest.Value))
	if len(largest.Value) > 64<<10 {
		t.Fatalf("%s holds %d bytes at %d hosts, more than 64 KB", largest.Key, len(largest.Value), n)
	}
	if bad, err := hosts[0].Check(ctx, "p"); err != nil || len(bad) != 0 {
		t.Fatalf("check: %d violations (%v), first %v", len(bad), err, bad[:min(3, len(bad))])
	}
}

// sharedPool is a /16 pool "p" whose whole space n hosts share
// (spreadRing), host0000 among them with one address, on a counting store.
func sharedPool(t *testing.T, n int) (*byteCounter, Def, *Allocator) {
	t.Helper()
	st := &byteCounter{Store: memory.New()}
	def := v4Def("p", "198.18.0.0/16")
	h0, _ := New(st, "host0000")
	if _, err := h0.Allocate(context.Background(), Request{Owner: own("h0"), Wants: ipWant("p"), Defs: []Def{def}}); err != nil {
		t.Fatal(err)
	}
	spreadRing(t, st, def, n)
	return st, def, h0
}

// donationKeys measures the keys a new host's first ADD reads in a /16
// pool whose whole space n hosts share (spreadRing: no unowned space, each
// host with free addresses): its claim misses the random blocks and the
// bounded gap search, and takes space from a donor the free-space index
// names.
func donationKeys(t *testing.T, n int) int {
	t.Helper()
	ctx := context.Background()
	st, def, _ := sharedPool(t, n)
	joiner, _ := New(st, "joiner")
	st.keysRead()
	got, err := joiner.Allocate(ctx, Request{Owner: own("j"), Wants: ipWant("p"), Defs: []Def{def}})
	if err != nil {
		t.Fatal(err)
	}
	keys := st.keysRead()
	if s := joiner.Stats(); s.Claims != 1 || s.LastResort != 0 {
		t.Fatalf("the joiner made %d claims, %d of them by the last resort; want 1 and 0", s.Claims, s.LastResort)
	}
	if len(got.Addrs) != 1 {
		t.Fatalf("the joiner got %v", got.Addrs)
	}
	return keys
}

// A claim in a pool with no unowned space left, served by a donation,
// reads as many keys with 5 000 hosts as with 100 (issue 42, item 2:
// "finding free space reads at most what a claim needs"). Before the
// free-space indexes it read every range key and every host state.
func TestDonationReadsDoNotGrowWithHosts(t *testing.T) {
	small, large := donationKeys(t, 100), donationKeys(t, 5000)
	t.Logf("a donation's claim reads %d keys at 100 hosts, %d at 5000", small, large)
	if float64(large) > 1.2*float64(small) {
		t.Fatalf("a donation reads %d keys at 5000 hosts, %d at 100: it grows with the hosts", large, small)
	}
}

// statusKeys is what STATUS's pool check (HasRoom) reads on host0000,
// which has free addresses in its own ranges, with n hosts in the pool.
func statusKeys(t *testing.T, n int) int {
	t.Helper()
	ctx := context.Background()
	st, _, h0 := sharedPool(t, n)
	st.keysRead()
	ok, _, err := h0.HasRoom(ctx, "p", 2)
	if err != nil || !ok {
		t.Fatalf("HasRoom: %v %v", ok, err)
	}
	return st.keysRead()
}

// STATUS of a host with room in its own ranges reads the same keys with
// 1 000 hosts as with 10: its own state and the definition.
func TestStatusReadsDoNotGrowWithHosts(t *testing.T) {
	small, large := statusKeys(t, 10), statusKeys(t, 1000)
	t.Logf("STATUS reads %d keys at 10 hosts, %d at 1000", small, large)
	if large != small {
		t.Fatalf("STATUS reads %d keys at 1000 hosts, %d at 10", large, small)
	}
}
