package pool

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/memory"
)

// auditWorld is a healthy store: three hosts allocating in two pools, one
// released reservation (a hold), and host-c orphaned and reclaimed while one
// of its owners had a reservation (a hold in a tombstoned range).
func auditWorld(t *testing.T) (*memory.Store, map[string]*Allocator, *clock) {
	t.Helper()
	ctx := context.Background()
	st := memory.New()
	clk := &clock{now: time.Unix(1_800_000_000, 0)}
	defs := []Def{v4Def("p4", "198.18.0.0/24"), {Name: "p6", Ranges: []Range{{Subnet: mustPrefix("2001:db8:1::/64")}}}}
	hosts := map[string]*Allocator{}
	for _, h := range []string{"host-a", "host-b", "host-c"} {
		a, err := New(st, h, WithClock(clk.Now))
		if err != nil {
			t.Fatal(err)
		}
		hosts[h] = a
		for i := range 3 {
			req := Request{Owner: hostOwner(h, i), Wants: []Want{{Pool: "p4", Role: RoleIP}, {Pool: "p6", Role: RoleIP}}, Defs: defs}
			if i == 0 {
				req.Reservation = "ns/" + h
			}
			if _, err := a.Allocate(ctx, req); err != nil {
				t.Fatal(err)
			}
		}
	}
	if _, _, err := hosts["host-a"].Release(ctx, hostOwner("host-a", 0)); err != nil {
		t.Fatal(err)
	}
	clk.advance(DefaultOrphanAfter / 2)
	for _, h := range []string{"host-a", "host-b"} {
		if _, err := hosts[h].Heartbeat(ctx, "", nil); err != nil {
			t.Fatal(err)
		}
	}
	clk.advance(DefaultOrphanAfter/2 + time.Minute)
	reps, err := hosts["host-a"].Sweep(ctx, DefaultOrphanAfter)
	if err != nil || len(reps) != 1 || reps[0].Host != "host-c" || reps[0].Released != 3 {
		t.Fatalf("sweep: %+v %v", reps, err)
	}
	return st, hosts, clk
}

func TestAuditHealthyStore(t *testing.T) {
	_, hosts, _ := auditWorld(t)
	v, err := hosts["host-a"].Audit(context.Background())
	if err != nil || len(v) != 0 {
		t.Fatalf("Audit of a healthy store: %v %v", v, err)
	}
}

// TestAuditFindsEachInvariant corrupts a healthy store in one way per case
// and expects Audit to name exactly that invariant.
func TestAuditFindsEachInvariant(t *testing.T) {
	ctx := context.Background()
	put := func(t *testing.T, st store.Store, key string, v []byte) {
		t.Helper()
		if err := st.Commit(ctx, nil, []store.Op{store.Put(key, v)}); err != nil {
			t.Fatal(err)
		}
	}
	get := func(t *testing.T, st store.Store, key string) []byte {
		t.Helper()
		kvs, err := st.Get(ctx, key)
		if err != nil || !kvs[0].Exists() {
			t.Fatalf("get %s: %v", key, err)
		}
		return kvs[0].Value
	}
	addrOf := func(t *testing.T, a *Allocator, o Owner, pool string) netip.Addr {
		t.Helper()
		rec, ok, err := a.Lookup(ctx, o)
		if err != nil || !ok {
			t.Fatalf("lookup %s: %v", o, err)
		}
		x, _ := rec.Addr(pool, RoleIP)
		return x
	}
	cases := []struct {
		name    string
		want    string
		corrupt func(t *testing.T, st *memory.Store, hosts map[string]*Allocator)
	}{
		{"two owner records list one address", InvTwoOwners, func(t *testing.T, st *memory.Store, hosts map[string]*Allocator) {
			x := addrOf(t, hosts["host-a"], hostOwner("host-a", 1), "p4")
			var rec Allocation
			json.Unmarshal(get(t, st, ownerKey(hostOwner("host-b", 1))), &rec)
			rec.Addrs[0].Addr = x
			b, _ := json.Marshal(rec)
			put(t, st, ownerKey(hostOwner("host-b", 1)), b)
		}},
		{"ring out of order", InvRingCover, func(t *testing.T, st *memory.Store, hosts map[string]*Allocator) {
			// A range of host-b overlapping host-a's.
			s := span{toU128(mustAddr("198.18.0.1")), toU128(mustAddr("198.18.0.1"))}
			put(t, st, rangeKey("p4", s.hi, true), rangeKV{span: s, host: "host-b"}.encode(true))
		}},
		{"address the pool never hands out", InvNotInPool, func(t *testing.T, st *memory.Store, hosts map[string]*Allocator) {
			// The broadcast address: inside the ring's span, not allocatable.
			put(t, st, addrKey("p4", toU128(mustAddr("198.18.0.255")), true), ownerHolder("host-b", hostOwner("host-b", 1)).encode())
		}},
		{"allocation in another host's range", InvOutsideRange, func(t *testing.T, st *memory.Store, hosts map[string]*Allocator) {
			x := addrOf(t, hosts["host-a"], hostOwner("host-a", 1), "p4")
			put(t, st, addrKey("p4", toU128(x), true), ownerHolder("host-b", hostOwner("host-a", 1)).encode())
		}},
		{"live owner left in a tombstoned range", InvTombstoned, func(t *testing.T, st *memory.Store, hosts map[string]*Allocator) {
			r, err := hosts["host-a"].RingOf(ctx, "p6")
			if err != nil {
				t.Fatal(err)
			}
			var tomb OwnedRange
			for _, x := range r.Ranges {
				if x.Tombstone {
					tomb = x
				}
			}
			if !tomb.Start.IsValid() {
				t.Fatalf("no tombstoned range in %+v", r)
			}
			// A stray owner of host-c that reclaiming never saw.
			o := hostOwner("host-c", 7)
			addr := tomb.End
			rec := Allocation{Owner: o, Host: "host-c", Addrs: []Assigned{{Pool: "p6", Role: RoleIP, Addr: addr}}}
			b, _ := json.Marshal(rec)
			put(t, st, ownerKey(o), b)
			put(t, st, addrKey("p6", toU128(addr), false), ownerHolder("host-c", o).encode())
		}},
		{"address key without owner record", InvRecords, func(t *testing.T, st *memory.Store, hosts map[string]*Allocator) {
			if err := st.Commit(ctx, nil, []store.Op{store.Delete(ownerKey(hostOwner("host-b", 2)))}); err != nil {
				t.Fatal(err)
			}
			// keep the host count right, so only the records disagree
		}},
		{"overlapping pools", InvOverlap, func(t *testing.T, st *memory.Store, hosts map[string]*Allocator) {
			d, _ := v4Def("other", "198.18.0.128/25").Normalize()
			b, _ := json.Marshal(d)
			put(t, st, defKey("other"), b)
		}},
		{"host count off", InvHostCount, func(t *testing.T, st *memory.Store, hosts map[string]*Allocator) {
			var hs hostState
			json.Unmarshal(get(t, st, hostKey("p4", "host-b")), &hs)
			hs.Used += 5
			b, _ := json.Marshal(hs)
			put(t, st, hostKey("p4", "host-b"), b)
		}},
		{"owner record missing from its host's index", InvHostIndex, func(t *testing.T, st *memory.Store, hosts map[string]*Allocator) {
			if err := st.Commit(ctx, nil, []store.Op{store.Delete(hostOwnerKey("host-b", hostOwner("host-b", 2)))}); err != nil {
				t.Fatal(err)
			}
		}},
		{"index key of an owner another host holds", InvHostIndex, func(t *testing.T, st *memory.Store, hosts map[string]*Allocator) {
			put(t, st, hostOwnerKey("host-a", hostOwner("host-b", 2)), []byte{})
		}},
		{"corrupt owner record", InvCorrupt, func(t *testing.T, st *memory.Store, hosts map[string]*Allocator) {
			put(t, st, ownerKey(hostOwner("host-b", 9)), []byte("{not json"))
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			st, hosts, _ := auditWorld(t)
			c.corrupt(t, st, hosts)
			v, err := hosts["host-a"].Audit(ctx)
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, x := range v {
				got = append(got, x.Invariant)
			}
			if !slices.Contains(got, c.want) {
				t.Fatalf("Audit found %v, want %s among them", v, c.want)
			}
			for _, x := range v {
				if s := x.String(); !strings.HasPrefix(s, x.Invariant+": ") || len(s) < 20 {
					t.Errorf("violation line %q does not explain itself", s)
				}
			}
		})
	}
}

// TestPlansMatchWhatTheRunDoes: the plans of a sweep, a release, a hold drop
// and of ended holds name exactly what the real operations then do.
func TestPlansMatchWhatTheRunDoes(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	clk := &clock{now: time.Unix(1_800_000_000, 0)}
	def := v4Def("p", "198.18.0.0/26")
	a, _ := New(st, "host-a", WithClock(clk.Now))
	b, _ := New(st, "host-b", WithClock(clk.Now))
	for i := range 4 {
		for _, x := range []*Allocator{a, b} {
			req := Request{Owner: hostOwner(x.Host(), i), Wants: ipWant("p"), Defs: []Def{def}}
			if i%2 == 0 {
				req.Reservation = fmt.Sprintf("ns/%s-%d", x.Host(), i)
			}
			if _, err := x.Allocate(ctx, req); err != nil {
				t.Fatal(err)
			}
		}
	}
	markLive(t, st, "host-a")

	// Release: a reservation holder's addresses become a hold.
	plan, ok, err := a.PlanRelease(ctx, hostOwner("host-a", 0))
	if err != nil || !ok || !plan.Hold {
		t.Fatalf("PlanRelease: %+v %v %v", plan, ok, err)
	}
	got, ok, err := a.Release(ctx, hostOwner("host-a", 0))
	if err != nil || !ok {
		t.Fatal(err)
	}
	if diff := cmp.Diff(plan.Allocation, got, addrCmp); diff != "" {
		t.Fatalf("release did other than planned:\n%s", diff)
	}
	if h, ok, _ := a.HolderOf(ctx, "p", got.Addrs[0].Addr); !ok || h.Reservation != "ns/host-a-0" {
		t.Fatalf("after release %s is held by %+v, want the hold", got.Addrs[0].Addr, h)
	}
	if _, ok, err := a.PlanRelease(ctx, hostOwner("host-a", 0)); err != nil || ok {
		t.Fatalf("PlanRelease of an owner holding nothing: %v %v", ok, err)
	}

	// Hold drop.
	holds, forget, err := a.PlanDropHold(ctx, KindCNI, "net", "ns/host-a-0")
	if err != nil || len(holds) != 1 || !forget {
		t.Fatalf("PlanDropHold: %+v %v %v", holds, forget, err)
	}
	dropped, err := a.DropHold(ctx, KindCNI, "net", "ns/host-a-0")
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(holds, dropped, addrCmp); diff != "" {
		t.Fatalf("DropHold did other than planned:\n%s", diff)
	}

	// Ended holds: release host-b's reserved owner, let the hold end.
	if _, _, err := b.Release(ctx, hostOwner("host-b", 2)); err != nil {
		t.Fatal(err)
	}
	if e, _ := a.EndedHolds(ctx); len(e) != 0 {
		t.Fatalf("ended holds before the hold ended: %+v", e)
	}
	clk.advance(DefaultReservationHold + time.Second)
	ended, err := a.EndedHolds(ctx)
	if err != nil || len(ended) != 1 || ended[0].Reservation != "ns/host-b-2" {
		t.Fatalf("EndedHolds: %+v %v", ended, err)
	}
	if ok, err := a.DropEndedHold(ctx, ended[0]); err != nil || !ok {
		t.Fatalf("DropEndedHold: %v %v", ok, err)
	}
	if ok, err := a.DropEndedHold(ctx, ended[0]); err != nil || ok {
		t.Fatalf("second DropEndedHold: %v %v, want nothing dropped", ok, err)
	}

	// Sweep: host-b is orphaned; host-a is live and never planned.
	clk.advance(DefaultOrphanAfter)
	if _, err := a.Heartbeat(ctx, "", nil); err != nil {
		t.Fatal(err)
	}
	plans, err := a.PlanSweep(ctx, DefaultOrphanAfter)
	if err != nil || len(plans) != 1 || plans[0].Host.Name != "host-b" {
		t.Fatalf("PlanSweep: %+v %v", plans, err)
	}
	if _, err := a.PlanReclaim(ctx, "host-a", false); err == nil {
		t.Fatal("PlanReclaim of a live host succeeded")
	}
	reps, err := a.Sweep(ctx, DefaultOrphanAfter)
	if err != nil || len(reps) != 1 {
		t.Fatalf("Sweep: %+v %v", reps, err)
	}
	if diff := cmp.Diff(plans[0].Pools, reps[0].TombstonedPools, addrCmp); diff != "" {
		t.Errorf("tombstoned pools differ from the plan:\n%s", diff)
	}
	if diff := cmp.Diff(plans[0].Owners, reps[0].ReleasedOwners, addrCmp); diff != "" {
		t.Errorf("released owners differ from the plan:\n%s", diff)
	}
	if len(reps[0].ReleasedOwners) != 3 {
		t.Errorf("released %d owners of host-b, want its 3 remaining", len(reps[0].ReleasedOwners))
	}
	if again, err := a.PlanSweep(ctx, DefaultOrphanAfter); err != nil || len(again) != 0 {
		t.Fatalf("PlanSweep after the sweep: %+v %v", again, err)
	}
	if v, err := a.Audit(ctx); err != nil || len(v) != 0 {
		t.Fatalf("Audit after it all: %v %v", v, err)
	}
}

var addrCmp = cmpopts.EquateComparable(netip.Addr{})

func TestInventory(t *testing.T) {
	ctx := context.Background()
	st, hosts, clk := auditWorld(t)
	_ = st
	a := hosts["host-a"]
	defs, err := a.Pools(ctx)
	if err != nil || len(defs) != 2 || defs[0].Name != "p4" || defs[1].Name != "p6" {
		t.Fatalf("Pools: %+v %v", defs, err)
	}
	in, err := a.PoolsContaining(ctx, mustAddr("2001:db8:1::5"))
	if err != nil || len(in) != 1 || in[0].Name != "p6" {
		t.Fatalf("PoolsContaining: %+v %v", in, err)
	}
	held, err := a.Held(ctx, "p4")
	if err != nil {
		t.Fatal(err)
	}
	owners, holds := 0, 0
	for _, h := range held {
		if h.Hold != nil {
			holds++
		} else {
			owners++
		}
	}
	// host-a: 2 owners + its released reservation's hold; host-b: 3
	// owners; host-c: reclaimed, its reservation owner's address held.
	if owners != 5 || holds != 2 {
		t.Fatalf("Held(p4): %d owners, %d holds (%+v); want 5 and 2", owners, holds, held)
	}
	at, err := a.AllocatedAt(ctx, "p4")
	if err != nil {
		t.Fatal(err)
	}
	rec, _, _ := a.Lookup(ctx, hostOwner("host-b", 1))
	x, _ := rec.Addr("p4", RoleIP)
	if ev, ok := at[x]; !ok || ev.Owner != hostOwner("host-b", 1).String() || !ev.Time.Equal(time.Unix(1_800_000_000, 0)) {
		t.Fatalf("AllocatedAt[%s] = %+v (clock now %s)", x, ev, clk.Now())
	}
}
