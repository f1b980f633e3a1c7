package pool

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/memory"
)

// putRing makes r pool def's ring in st, as claims would have left it:
// every range key of the pool replaced by r's owned and tombstoned
// ranges, and each host's state listing its live ranges (a state is
// created for a host that has none, with states' Used when given).
func putRing(t testing.TB, st store.Store, def Def, r ring, used map[string]uint64) {
	t.Helper()
	ctx := context.Background()
	is4 := def.is4()
	old, err := st.Scan(ctx, rangePrefix(def.Name), store.PrefixEnd(rangePrefix(def.Name)), 0)
	if err != nil {
		t.Fatal(err)
	}
	var ops []store.Op
	flush := func(force bool) {
		if len(ops) >= store.MaxOps-2 || force && len(ops) > 0 {
			if err := st.Commit(ctx, nil, ops); err != nil {
				t.Fatal(err)
			}
			ops = nil
		}
	}
	for _, kv := range old {
		ops = append(ops, store.Delete(kv.Key), store.Delete(tombKeyOf(kv.Key)))
		flush(false)
	}
	own := map[string][]span{}
	for i, tok := range r.tokens {
		if tok.Host == "" {
			continue
		}
		s := r.spanOf(i)
		ops = append(ops, store.Put(rangeKey(def.Name, s.hi, is4), rangeKV{span: s, host: tok.Host, tomb: tok.Tomb}.encode(is4)))
		if tok.Tomb {
			ops = append(ops, store.Put(tombKeyOf(rangeKey(def.Name, s.hi, is4)), []byte{}))
		}
		flush(false)
		if !tok.Tomb {
			own[tok.Host] = append(own[tok.Host], s)
		}
	}
	states, err := st.Scan(ctx, hostPrefix(def.Name), store.PrefixEnd(hostPrefix(def.Name)), 0)
	if err != nil {
		t.Fatal(err)
	}
	have := map[string]hostState{}
	for _, kv := range states {
		var hs hostState
		if err := decodeHostState(kv.Value, &hs); err != nil {
			t.Fatal(err)
		}
		have[strings.TrimPrefix(kv.Key, hostPrefix(def.Name))] = hs
	}
	hosts := map[string]bool{}
	for h := range have {
		hosts[h] = true
	}
	for h := range own {
		hosts[h] = true
	}
	for h := range hosts {
		hs, ok := have[h]
		if !ok {
			hs.Used = used[h]
		}
		hs.setSpans(own[h], is4)
		hs.Layout = stateLayout
		hs.Free = freeUnknown // the index key is set as it should be
		ops = append(ops, putHostState(def.Name, h, &hs)...)
		flush(false)
	}
	flush(true)
}

// readTestRing reads pool's ring from st.
func readTestRing(t testing.TB, st store.Store, pool string) (Def, ring) {
	t.Helper()
	a, err := New(st, "reader")
	if err != nil {
		t.Fatal(err)
	}
	def, r, _, err := a.readRing(context.Background(), pool)
	if err != nil {
		t.Fatal(err)
	}
	return def, r
}

// A layout-3 process decodes the marker its ring key holds after the
// migration as a corrupt ring whose error names the cause, so it never
// plans on an empty ring (which it would then write).
func TestLayout3CodeCannotReadTheMarker(t *testing.T) {
	var tokens []token // layout 3's ring type, unchanged
	err := decodeTokens(movedMarker("p"), &tokens)
	if err == nil || !strings.Contains(err.Error(), "upgrade ringipam") || !strings.Contains(err.Error(), "layout 4") {
		t.Fatalf("layout 3 decodes the marker: %v (tokens %v); want an error naming the upgrade", err, tokens)
	}
}

// asLayout3 turns a store this code wrote into what layout 3 would have
// written: every pool's ring in one key g/<pool>, the range keys gone, the
// host states without their ranges, version "3".
func asLayout3(t *testing.T, st store.Store, pools ...string) {
	t.Helper()
	ctx := context.Background()
	var ops []store.Op
	for _, p := range pools {
		_, r := readTestRing(t, st, p)
		ops = append(ops, store.Put(oldRingKey(p), encodeTokens(r.tokens)))
		keys, _ := st.Scan(ctx, rangePrefix(p), store.PrefixEnd(rangePrefix(p)), 0)
		for _, kv := range keys {
			ops = append(ops, store.Delete(kv.Key))
		}
		states, _ := st.Scan(ctx, hostPrefix(p), store.PrefixEnd(hostPrefix(p)), 0)
		for _, kv := range states {
			var hs hostState
			if err := decodeHostState(kv.Value, &hs); err != nil {
				t.Fatal(err)
			}
			hs.Ranges, hs.Layout = nil, 0
			ops = append(ops, store.Put(kv.Key, encodeHostState(hs)))
		}
	}
	ops = append(ops, store.Put(layoutKey, []byte("3")))
	if err := st.Commit(ctx, nil, ops); err != nil {
		t.Fatal(err)
	}
}

// A layout-3 store migrates on first use: the same ring from range keys,
// each host's ranges in its state, the marker in the old key, the
// version 4; the audit is clean and allocations go on in each host's
// ranges. Running the migration again changes nothing.
func TestLayout3RingMigrates(t *testing.T) {
	ctx := context.Background()
	def := v4Def("p", "198.18.0.0/24")
	hosts := newHosts(t, def, "h1", "h2", "h3")
	st := hosts[0].Store()
	for i := range 70 { // h1's block fills: a second claim
		if _, err := hosts[i%3].Allocate(ctx, Request{Owner: own(fmt.Sprint("c", i)), Wants: ipWant("p")}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := hosts[2].Reclaim(ctx, "h2", ReclaimOptions{Force: true}); err != nil {
		t.Fatal(err) // tombstoned ranges migrate too
	}
	before, err := hosts[0].RingOf(ctx, "p")
	if err != nil {
		t.Fatal(err)
	}
	asLayout3(t, st, "p")
	if keys, _ := st.Scan(ctx, rangePrefix("p"), store.PrefixEnd(rangePrefix("p")), 0); len(keys) != 0 {
		t.Fatalf("layout 3 store has range keys %v", keys)
	}
	a, _ := New(st, "h1")
	after, err := a.RingOf(ctx, "p") // the first read migrates
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(before) != fmt.Sprint(after) {
		t.Fatalf("ring after migration %v, before %v", after, before)
	}
	if v, _ := st.Get(ctx, layoutKey, oldRingKey("p")); string(v[0].Value) != layoutVersion || string(v[1].Value) != string(movedMarker("p")) {
		t.Fatalf("after migration: version %q, old ring key %q", v[0].Value, v[1].Value)
	}
	if bad, err := a.Check(ctx, "p"); err != nil || len(bad) != 0 {
		t.Fatalf("check after migration: %v %v", bad, err)
	}
	if vs, err := a.Audit(ctx); err != nil || len(vs) != 0 {
		t.Fatalf("audit after migration: %v %v", vs, err)
	}
	for _, h := range []string{"h1", "h3"} {
		kvs, _ := st.Get(ctx, hostKey("p", h))
		var hs hostState
		if err := decodeHostState(kvs[0].Value, &hs); err != nil || hs.Layout != stateLayout || len(hs.Ranges) == 0 {
			t.Fatalf("%s's state after migration: %s (%v)", h, kvs[0].Value, err)
		}
	}
	snapshot := func() map[string]string {
		out := map[string]string{}
		kvs, _ := st.Scan(ctx, "", "\xff", 0)
		for _, kv := range kvs {
			out[kv.Key] = string(kv.Value)
		}
		return out
	}
	was := snapshot()
	if err := a.migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(was, snapshot()); diff != "" {
		t.Fatalf("a second migration changed the store (-before +after):\n%s", diff)
	}
	for i, h := range []*Allocator{a, hosts[2]} {
		if _, err := h.Allocate(ctx, Request{Owner: own(fmt.Sprint("after", i)), Wants: ipWant("p")}); err != nil {
			t.Fatal(err)
		}
	}
	if bad, err := a.Check(ctx, "p"); err != nil || len(bad) != 0 {
		t.Fatalf("check after allocations on the migrated store: %v %v", bad, err)
	}
}

// A host state that a layout-3 process rewrote during the rollout (its
// ranges dropped) is repaired from the range keys by the host's next
// allocation, which stays in its own ranges.
func TestLayout3RewriteOfAHostStateIsRepaired(t *testing.T) {
	ctx := context.Background()
	hosts := newHosts(t, v4Def("p", "198.18.0.0/24"), "h1", "h2")
	st := hosts[0].Store()
	for i := range 4 {
		if _, err := hosts[i%2].Allocate(ctx, Request{Owner: own(fmt.Sprint("c", i)), Wants: ipWant("p")}); err != nil {
			t.Fatal(err)
		}
	}
	kvs, _ := st.Get(ctx, hostKey("p", "h2"))
	var hs hostState
	_ = decodeHostState(kvs[0].Value, &hs)
	want := hs.Ranges
	hs.Ranges, hs.Layout = nil, 0
	if err := st.Commit(ctx, nil, []store.Op{store.Put(kvs[0].Key, encodeHostState(hs))}); err != nil {
		t.Fatal(err)
	}
	got, err := hosts[1].Allocate(ctx, Request{Owner: own("next"), Wants: ipWant("p")})
	if err != nil {
		t.Fatal(err)
	}
	r, _ := hosts[1].RingOf(ctx, "p")
	if o, _ := r.Owner(got.Addrs[0].Addr); o.Host != "h2" {
		t.Fatalf("h2 got %s in a range of %q", got.Addrs[0].Addr, o.Host)
	}
	kvs, _ = st.Get(ctx, hostKey("p", "h2"))
	hs = hostState{}
	_ = decodeHostState(kvs[0].Value, &hs)
	if hs.Layout != stateLayout || !slices.Equal(hs.Ranges, want) {
		t.Fatalf("h2's state after its allocation: %s, want its ranges %v", kvs[0].Value, want)
	}
	if bad, err := hosts[0].Check(ctx, "p"); err != nil || len(bad) != 0 {
		t.Fatalf("check: %v %v", bad, err)
	}
}

// beforeCommit runs hook once, before the first Commit through it.
type beforeCommit struct {
	store.Store
	hook func()
	done bool
}

func (s *beforeCommit) Commit(ctx context.Context, conds []store.Cond, ops []store.Op) error {
	if !s.done && s.hook != nil {
		s.done = true
		s.hook()
	}
	return s.Store.Commit(ctx, conds, ops)
}

// Claims of different blocks do not conflict: h2 plans its first claim,
// h3 claims another block and h1 allocates in its own range meanwhile,
// and h2's commit goes through on its first attempt. A claim of a block
// another host took between the read and the commit fails that commit
// (and the retry takes another block).
func TestClaimsOfDifferentBlocksDoNotConflict(t *testing.T) {
	ctx := context.Background()
	mem := memory.New()
	def := v4Def("p", "198.18.0.0/16")
	h1, _ := New(mem, "h1")
	if _, err := h1.Allocate(ctx, Request{Owner: own("a"), Wants: ipWant("p"), Defs: []Def{def}}); err != nil {
		t.Fatal(err)
	}
	h3, _ := New(mem, "h3")
	hooked := &beforeCommit{Store: mem, hook: func() {
		for _, x := range []struct {
			a  *Allocator
			id string
		}{{h3, "c"}, {h1, "b"}} {
			if _, err := x.a.Allocate(ctx, Request{Owner: own(x.id), Wants: ipWant("p")}); err != nil {
				t.Fatal(err)
			}
		}
	}}
	h2, _ := New(hooked, "h2")
	if _, err := h2.Allocate(ctx, Request{Owner: own("d"), Wants: ipWant("p")}); err != nil {
		t.Fatal(err)
	}
	if s := h2.Stats(); s.Conflicts != 0 {
		t.Fatalf("h2's claim met %d conflicts; claims of different blocks must not conflict", s.Conflicts)
	}
	if bad, err := h1.Check(ctx, "p"); err != nil || len(bad) != 0 {
		t.Fatalf("check: %v %v", bad, err)
	}

	// The same block: h5 takes, between h4's read and commit, the block
	// h4 planned on (h4's own first choice, since h4 is hooked).
	var blockOfH4 netip.Addr
	{
		probe := memory.New()
		p1, _ := New(probe, "h1")
		if _, err := p1.Allocate(ctx, Request{Owner: own("a"), Wants: ipWant("p"), Defs: []Def{def}}); err != nil {
			t.Fatal(err)
		}
		p4, _ := New(probe, "h4")
		got, err := p4.Allocate(ctx, Request{Owner: own("x"), Wants: ipWant("p")})
		if err != nil {
			t.Fatal(err)
		}
		blockOfH4 = got.Addrs[0].Addr
	}
	h5, _ := New(mem, "h5")
	hooked = &beforeCommit{Store: mem, hook: func() {
		if _, err := h5.Allocate(ctx, Request{Owner: own("y"), Wants: []Want{{Pool: "p", Role: RoleIP, Addr: blockOfH4.Next()}}}); err != nil {
			t.Fatal(err)
		}
	}}
	h4, _ := New(hooked, "h4")
	got, err := h4.Allocate(ctx, Request{Owner: own("x"), Wants: ipWant("p")})
	if err != nil {
		t.Fatal(err)
	}
	if s := h4.Stats(); s.Conflicts == 0 {
		t.Fatalf("h4 claimed the block holding %s that h5 took meanwhile without a conflict (got %s)", blockOfH4.Next(), got.Addrs[0].Addr)
	}
	if bad, err := h1.Check(ctx, "p"); err != nil || len(bad) != 0 {
		t.Fatalf("check: %v %v", bad, err)
	}
}

// A returning host readopts more owners than one commit moves
// (maxReadoptMoves): every address comes back to it, in several commits,
// and the pool's invariants hold.
func TestReadoptInBatches(t *testing.T) {
	ctx := context.Background()
	hosts := newHosts(t, v4Def("p", "198.18.0.0/24"), "h1", "h2")
	st := hosts[0].Store()
	const n = 3*maxReadoptMoves + 1
	for i := range n {
		if _, err := hosts[0].Allocate(ctx, Request{Owner: own(fmt.Sprint("c", i)), Wants: ipWant("p")}); err != nil {
			t.Fatal(err)
		}
	}
	// A reclaim cut short after its fence: h1's ranges tombstoned and its
	// state dropped, its owners not yet released.
	def, r := readTestRing(t, st, "p")
	putRing(t, st, def, r.tombstone("h1"), nil)
	if err := st.Commit(ctx, nil, []store.Op{store.Delete(hostKey("p", "h1"))}); err != nil {
		t.Fatal(err)
	}
	markLive(t, st, "h1")
	counted := &commitCounter{Store: st}
	h1, _ := New(counted, "h1")
	pools, err := h1.Readopt(ctx)
	if err != nil || !slices.Equal(pools, []string{"p"}) {
		t.Fatalf("Readopt: %v %v", pools, err)
	}
	if counted.commits < 4 {
		t.Fatalf("Readopt of %d addresses took %d commits, want at least 4 (at most %d addresses each)", n, counted.commits, maxReadoptMoves)
	}
	if vs, err := hosts[1].Audit(ctx); err != nil || len(vs) != 0 {
		t.Fatalf("audit after the readoption: %v %v", vs, err)
	}
	for i := range n {
		al, ok, err := hosts[1].Lookup(ctx, own(fmt.Sprint("c", i)))
		if err != nil || !ok {
			t.Fatalf("c%d: %v %v", i, ok, err)
		}
		if rg, _ := hosts[1].RingOf(ctx, "p"); true {
			if o, _ := rg.Owner(al.Addrs[0].Addr); o.Host != "h1" || o.Tombstone {
				t.Fatalf("c%d's %s lies in %+v after the readoption", i, al.Addrs[0].Addr, o)
			}
		}
	}
}

// commitCounter counts commits.
type commitCounter struct {
	store.Store
	commits int
}

func (c *commitCounter) Commit(ctx context.Context, conds []store.Cond, ops []store.Op) error {
	c.commits++
	return c.Store.Commit(ctx, conds, ops)
}

// rangeScans counts the scans of every range key of a pool (limit 0).
type rangeScans struct {
	store.Store
	full int
}

func (s *rangeScans) Scan(ctx context.Context, from, to string, limit int) ([]store.KV, error) {
	if limit <= 0 && strings.HasPrefix(from, prefixRing) {
		s.full++
	}
	return s.Store.Scan(ctx, from, to, limit)
}

// A host's later claims try fresh block positions: twenty claims in a
// large pool never fall back to reading every range key.
func TestLaterClaimsTryFreshBlocks(t *testing.T) {
	ctx := context.Background()
	st := &rangeScans{Store: memory.New()}
	def := Def{Name: "p", Ranges: []Range{{Subnet: mustPrefix("2001:db8:3::/64")}}}
	a, _ := New(st, "h1")
	for i := range 20*maxBlock + 1 {
		if _, err := a.Allocate(ctx, Request{Owner: own(fmt.Sprint("c", i)), Wants: ipWant("p"), Defs: []Def{def}}); err != nil {
			t.Fatal(err)
		}
	}
	if c := a.Stats().Claims; c != 21 {
		t.Fatalf("%d claims, want 21", c)
	}
	if st.full != 0 {
		t.Fatalf("21 claims read every range key %d times; want none (a fresh block each time)", st.full)
	}
}
