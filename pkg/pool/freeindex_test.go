package pool

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/memory"
)

// The free-space index follows the host state in the same commits, Audit
// reports an entry that disagrees with it, and a store without the index
// (a layout-4 store written before it) still donates and still answers a
// full pool with a *CapacityError: the index is a hint.
func TestFreeIndex(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	def := v4Def("p", "198.18.0.0/29") // 8 addresses, one block
	h1, _ := New(st, "h1")
	h2, _ := New(st, "h2")
	if _, err := h1.Allocate(ctx, Request{Owner: own("a"), Wants: ipWant("p"), Defs: []Def{def}}); err != nil {
		t.Fatal(err)
	}
	has := func(key string) bool {
		t.Helper()
		kvs, err := st.Get(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		return kvs[0].Exists()
	}
	if !has(freeKey("p", "h1")) {
		t.Fatal("h1 claimed the pool and has free addresses, but the free-space index does not list it")
	}
	audit := func() []Violation {
		t.Helper()
		v, err := h1.Audit(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	if v := audit(); len(v) != 0 {
		t.Fatalf("audit: %v", v)
	}
	// A missing entry is a finding.
	if err := st.Commit(ctx, nil, []store.Op{store.Delete(freeKey("p", "h1"))}); err != nil {
		t.Fatal(err)
	}
	if v := audit(); len(v) != 1 || v[0].Invariant != InvFreeIndex {
		t.Fatalf("audit with h1's index key deleted: %v", v)
	}
	// A stale tombstone entry is a finding.
	if err := st.Commit(ctx, []store.Cond{}, []store.Op{store.Put(freeKey("p", "h1"), []byte{}), store.Put(tombPrefix("p")+"c6120007", []byte{})}); err != nil {
		t.Fatal(err)
	}
	if v := audit(); len(v) != 1 || v[0].Invariant != InvFreeIndex || !strings.Contains(v[0].Detail, "tombstone index") {
		t.Fatalf("audit with a stale tombstone entry: %v", v)
	}
	if err := st.Commit(ctx, nil, []store.Op{store.Delete(tombPrefix("p") + "c6120007")}); err != nil {
		t.Fatal(err)
	}
	// A store without the index: h1's state as a ringipam before it wrote it.
	kvs, _ := st.Get(ctx, hostKey("p", "h1"))
	var hs hostState
	if err := decodeHostState(kvs[0].Value, &hs); err != nil {
		t.Fatal(err)
	}
	hs.Free = freeUnknown
	if err := st.Commit(ctx, nil, []store.Op{store.Put(hostKey("p", "h1"), encodeHostState(hs)), store.Delete(freeKey("p", "h1"))}); err != nil {
		t.Fatal(err)
	}
	if v := audit(); len(v) != 0 {
		t.Fatalf("audit of a state from before the index: %v", v)
	}
	// h2 finds h1 by its last resort.
	if _, err := h2.Allocate(ctx, Request{Owner: own("b"), Wants: ipWant("p"), Defs: []Def{def}}); err != nil {
		t.Fatal(err)
	}
	if s := h2.Stats(); s.LastResort != 1 {
		t.Fatalf("h2's claim of a store without the index: %d last resorts, want 1", s.LastResort)
	}
	// The donation rewrote h1's state: its index key is back.
	if !has(freeKey("p", "h1")) || !has(freeKey("p", "h2")) {
		t.Fatalf("after the donation the index lists h1 %v, h2 %v; want both", has(freeKey("p", "h1")), has(freeKey("p", "h2")))
	}
	// Fill the pool: the hosts that fill up leave the index, and a full
	// pool answers a *CapacityError.
	var ce *CapacityError
	for i := 0; ; i++ {
		_, err := h2.Allocate(ctx, Request{Owner: own("f" + string(rune('a'+i))), Wants: ipWant("p"), Defs: []Def{def}})
		if errors.As(err, &ce) {
			break
		}
		if err != nil || i > 16 {
			t.Fatalf("filling the pool, allocation %d: %v", i, err)
		}
	}
	if has(freeKey("p", "h1")) || has(freeKey("p", "h2")) {
		t.Fatalf("a full pool's index lists h1 %v, h2 %v", has(freeKey("p", "h1")), has(freeKey("p", "h2")))
	}
	if v := audit(); len(v) != 0 {
		t.Fatalf("audit of the full pool: %v", v)
	}
	// A release puts the host back in the index.
	if _, _, err := h1.Release(ctx, own("a")); err != nil {
		t.Fatal(err)
	}
	if !has(freeKey("p", "h1")) {
		t.Fatal("h1 released an address of its full ranges, but the index does not list it")
	}
	if v := audit(); len(v) != 0 {
		t.Fatalf("audit after the release: %v", v)
	}
}

var _ = memory.New

// A claim whose random blocks miss finds a gap near its pseudo-random
// position by a paged read of the range keys, not by reading them all,
// and claims it rather than asking a donor.
func TestClaimFindsNearGap(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	def := v4Def("p", "198.18.0.0/16")
	h0, _ := New(st, "host0000")
	if _, err := h0.Allocate(ctx, Request{Owner: own("h0"), Wants: ipWant("p"), Defs: []Def{def}}); err != nil {
		t.Fatal(err)
	}
	spreadRing(t, st, def, 1000)
	nd, _ := def.Normalize()
	segs := dynamicSegmentsOf(nd)
	// Unown the range 10 ranges (about 650 addresses) after the joiner's
	// start: its key goes, leaving a gap.
	v := blockAddr(segs, "joiner", "p", -1).add(u128{lo: 650})
	kvs, err := st.Scan(ctx, rangeKey("p", v, true), store.PrefixEnd(rangePrefix("p")), 1)
	if err != nil || len(kvs) != 1 {
		t.Fatalf("no range after %s: %v", v.addr(true), err)
	}
	gap, err := decodeRangeKV(kvs[0], true)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Commit(ctx, nil, []store.Op{store.Delete(kvs[0].Key)}); err != nil {
		t.Fatal(err)
	}
	joiner, _ := New(st, "joiner")
	got, err := joiner.Allocate(ctx, Request{Owner: own("j"), Wants: ipWant("p"), Defs: []Def{def}})
	if err != nil {
		t.Fatal(err)
	}
	if a := toU128(got.Addrs[0].Addr); !gap.contains(a) {
		t.Fatalf("the joiner got %s, outside the only gap %s-%s", got.Addrs[0].Addr, gap.lo.addr(true), gap.hi.addr(true))
	}
	if s := joiner.Stats(); s.LastResort != 0 {
		t.Fatalf("the joiner's claim took %d last resorts", s.LastResort)
	}
}
