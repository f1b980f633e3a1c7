package pool

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/memory"
)

func mustPrefix(s string) netip.Prefix { return netip.MustParsePrefix(s) }
func mustAddr(s string) netip.Addr     { return netip.MustParseAddr(s) }

func newHosts(t *testing.T, def Def, hosts ...string) []*Allocator {
	t.Helper()
	return hostsOn(t, memory.New(), def, hosts...)
}

// hostsOn is one Allocator per host on st, each having defined def.
func hostsOn(t *testing.T, st store.Store, def Def, hosts ...string) []*Allocator {
	t.Helper()
	var out []*Allocator
	for _, h := range hosts {
		a, err := New(st, h)
		if err != nil {
			t.Fatal(err)
		}
		if err := a.Define(context.Background(), def); err != nil {
			t.Fatal(err)
		}
		out = append(out, a)
	}
	return out
}

func v4Def(name, cidr string) Def {
	return Def{Name: name, Ranges: []Range{{Subnet: mustPrefix(cidr)}}}
}

func ipWant(pool string) []Want { return []Want{{Pool: pool, Role: RoleIP}} }

func own(id string) Owner {
	return Owner{Kind: KindCNI, Network: "net", ContainerID: id, IfName: "eth0"}
}

func TestAllocateIdempotentAndRelease(t *testing.T) {
	ctx := context.Background()
	a := newHosts(t, v4Def("p", "198.18.0.0/29"), "h1")[0]
	first, err := a.Allocate(ctx, Request{Owner: own("c1"), Wants: ipWant("p")})
	if err != nil {
		t.Fatal(err)
	}
	again, err := a.Allocate(ctx, Request{Owner: own("c1"), Wants: ipWant("p")})
	if err != nil {
		t.Fatal(err)
	}
	if first.Addrs[0].Addr != again.Addrs[0].Addr {
		t.Fatalf("re-allocate gave %v, first gave %v", again.Addrs, first.Addrs)
	}
	if got := first.Addrs[0].Addr; got != mustAddr("198.18.0.1") {
		t.Fatalf("first address = %s, want 198.18.0.1", got)
	}
	rel, ok, err := a.Release(ctx, own("c1"))
	if err != nil || !ok || rel.Addrs[0].Addr != first.Addrs[0].Addr {
		t.Fatalf("release = %v %v %v", rel, ok, err)
	}
	if _, ok, err := a.Release(ctx, own("c1")); err != nil || ok {
		t.Fatalf("second release = %v %v, want false nil", ok, err)
	}
}

func TestErrors(t *testing.T) {
	ctx := context.Background()
	a := newHosts(t, v4Def("p", "198.18.0.0/30"), "h1")[0] // two usable addresses
	if _, err := a.Allocate(ctx, Request{Owner: own("c1"), Wants: []Want{{Pool: "p", Role: RoleIP, Addr: mustAddr("198.18.0.2")}}}); err != nil {
		t.Fatal(err)
	}
	_, err := a.Allocate(ctx, Request{Owner: own("c2"), Wants: []Want{{Pool: "p", Role: RoleIP, Addr: mustAddr("198.18.0.2")}}})
	var inUse *InUseError
	if !errors.As(err, &inUse) || inUse.Holder != own("c1").String() || !errors.Is(err, ErrAlreadyInUse) {
		t.Fatalf("static on held address: %v", err)
	}
	_, err = a.Allocate(ctx, Request{Owner: own("c1"), Wants: []Want{{Pool: "p", Role: RoleIP, Addr: mustAddr("198.18.0.1")}}})
	if !errors.Is(err, ErrAlreadyExists) {
		t.Fatalf("different static for same owner: %v", err)
	}
	if _, err := a.Allocate(ctx, Request{Owner: own("c2"), Wants: ipWant("p")}); err != nil {
		t.Fatal(err)
	}
	_, err = a.Allocate(ctx, Request{Owner: own("c3"), Wants: ipWant("p")})
	var full *CapacityError
	if !errors.As(err, &full) || full.Used != 2 || full.Capacity != "2" {
		t.Fatalf("full pool: %v", err)
	}
	_, err = a.Allocate(ctx, Request{Owner: own("c3"), Wants: []Want{{Pool: "p", Role: RoleIP, Addr: mustAddr("198.18.0.3")}}})
	if !errors.Is(err, ErrInvalid) {
		t.Fatalf("broadcast address: %v", err)
	}
	if _, err := a.Allocate(ctx, Request{Owner: own("c3"), Wants: ipWant("nope")}); !errors.Is(err, ErrUnknownPool) {
		t.Fatalf("unknown pool: %v", err)
	}
}

func TestDefinitionMismatch(t *testing.T) {
	ctx := context.Background()
	a := newHosts(t, v4Def("p", "198.18.0.0/24"), "h1")[0]
	err := a.Define(ctx, v4Def("p", "198.18.1.0/24"))
	if !errors.Is(err, ErrDefinitionMismatch) {
		t.Fatalf("got %v", err)
	}
	same := v4Def("p", "198.18.0.9/24") // same subnet once masked
	if err := a.Define(ctx, same); err != nil {
		t.Fatalf("equivalent definition refused: %v", err)
	}
}

func TestRoundRobin(t *testing.T) {
	ctx := context.Background()
	a := newHosts(t, v4Def("p", "198.18.0.0/29"), "h1")[0] // .1-.6
	var got []netip.Addr
	for i := range 3 {
		al, err := a.Allocate(ctx, Request{Owner: own(fmt.Sprint("c", i)), Wants: ipWant("p")})
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, al.Addrs[0].Addr)
	}
	if _, _, err := a.Release(ctx, own("c0")); err != nil { // frees .1
		t.Fatal(err)
	}
	for i := 3; i < 6; i++ {
		al, err := a.Allocate(ctx, Request{Owner: own(fmt.Sprint("c", i)), Wants: ipWant("p")})
		if err != nil {
			t.Fatal(err)
		}
		if al.Addrs[0].Addr == got[0] {
			t.Fatalf("released %s handed out again at allocation %d before other free addresses", got[0], i)
		}
	}
	al, err := a.Allocate(ctx, Request{Owner: own("c9"), Wants: ipWant("p")})
	if err != nil {
		t.Fatal(err)
	}
	if al.Addrs[0].Addr != got[0] {
		t.Fatalf("after the others, got %s, want the released %s", al.Addrs[0].Addr, got[0])
	}
}

func TestHostsSplitTheRing(t *testing.T) {
	ctx := context.Background()
	hosts := newHosts(t, v4Def("p", "198.18.0.0/24"), "h1", "h2", "h3")
	seen := map[netip.Addr]string{}
	for i := range 60 {
		h := hosts[i%3]
		al, err := h.Allocate(ctx, Request{Owner: own(fmt.Sprint("c", i)), Wants: ipWant("p")})
		if err != nil {
			t.Fatal(err)
		}
		addr := al.Addrs[0].Addr
		if prev, dup := seen[addr]; dup {
			t.Fatalf("%s handed out twice (%s and c%d)", addr, prev, i)
		}
		seen[addr] = fmt.Sprint("c", i)
		r, err := h.RingOf(ctx, "p")
		if err != nil {
			t.Fatal(err)
		}
		if o, _ := r.Owner(addr); o.Host != h.Host() {
			t.Fatalf("%s allocated by %s in a range owned by %q", addr, h.Host(), o.Host)
		}
	}
	r, _ := hosts[0].RingOf(ctx, "p")
	owners := map[string]bool{}
	for _, x := range r.Ranges {
		if x.Host != "" { // layout 4: claims take blocks, space stays unowned
			owners[x.Host] = true
		}
	}
	if len(owners) != 3 {
		t.Fatalf("ring %+v: want 3 owners", r)
	}
}

func TestStaticInOtherHostsRangeMovesOneAddress(t *testing.T) {
	ctx := context.Background()
	hosts := newHosts(t, v4Def("p", "198.18.0.0/24"), "h1", "h2")
	if _, err := hosts[0].Allocate(ctx, Request{Owner: own("a"), Wants: ipWant("p")}); err != nil {
		t.Fatal(err) // h1 now owns everything
	}
	al, err := hosts[1].Allocate(ctx, Request{Owner: own("b"), Wants: []Want{{Pool: "p", Role: RoleIP, Addr: mustAddr("198.18.0.9")}}})
	if err != nil {
		t.Fatal(err)
	}
	r, _ := hosts[0].RingOf(ctx, "p")
	if o, _ := r.Owner(al.Addrs[0].Addr); o.Host != "h2" || o.Start != o.End {
		t.Fatalf("owner range of static address = %+v, want a one-address range of h2", o)
	}
	if o, _ := r.Owner(mustAddr("198.18.0.10")); o.Host != "h1" {
		t.Fatalf("address after the moved one belongs to %q, want h1", o.Host)
	}
}

func TestDualStackAndIPv6(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	a, _ := New(st, "h1")
	v6 := Def{Name: "p6", Ranges: []Range{{Subnet: mustPrefix("2001:db8::/48")}}}
	if err := a.Define(ctx, v4Def("p4", "198.18.0.0/24"), v6); err != nil {
		t.Fatal(err)
	}
	al, err := a.Allocate(ctx, Request{Owner: own("c"), Wants: []Want{{Pool: "p4", Role: RoleIP}, {Pool: "p6", Role: RoleIP}}})
	if err != nil {
		t.Fatal(err)
	}
	if len(al.Addrs) != 2 || !al.Addrs[1].Addr.Is6() || al.Addrs[1].Addr != mustAddr("2001:db8::1") {
		t.Fatalf("got %+v", al.Addrs)
	}
}

func TestReservationGivesAddressBack(t *testing.T) {
	ctx := context.Background()
	a := newHosts(t, v4Def("p", "198.18.0.0/24"), "h1")[0]
	first, err := a.Allocate(ctx, Request{Owner: own("pod-a-1"), Reservation: "ns/pod-a", Wants: ipWant("p")})
	if err != nil {
		t.Fatal(err)
	}
	_, err = a.Allocate(ctx, Request{Owner: own("pod-a-2"), Reservation: "ns/pod-a", Wants: ipWant("p")})
	if !errors.Is(err, ErrAlreadyInUse) {
		t.Fatalf("reservation held by a live owner: %v", err)
	}
	if _, _, err := a.Release(ctx, own("pod-a-1")); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Allocate(ctx, Request{Owner: own("other"), Wants: ipWant("p")}); err != nil {
		t.Fatal(err)
	}
	again, err := a.Allocate(ctx, Request{Owner: own("pod-a-2"), Reservation: "ns/pod-a", Wants: ipWant("p")})
	if err != nil {
		t.Fatal(err)
	}
	if again.Addrs[0].Addr != first.Addrs[0].Addr {
		t.Fatalf("recreated owner got %s, want %s back", again.Addrs[0].Addr, first.Addrs[0].Addr)
	}
}

func TestGCReleasesOnlyThisHostsStaleOwners(t *testing.T) {
	ctx := context.Background()
	hosts := newHosts(t, v4Def("p", "198.18.0.0/24"), "h1", "h2")
	for i, id := range []string{"keep", "stale1", "stale2"} {
		_ = i
		if _, err := hosts[0].Allocate(ctx, Request{Owner: own(id), Wants: ipWant("p")}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := hosts[1].Allocate(ctx, Request{Owner: own("other-host"), Wants: ipWant("p")}); err != nil {
		t.Fatal(err)
	}
	rel, err := hosts[0].GC(ctx, KindCNI, "net", []Owner{own("keep")})
	if err != nil {
		t.Fatal(err)
	}
	if len(rel) != 2 {
		t.Fatalf("released %d, want 2: %+v", len(rel), rel)
	}
	left, _ := hosts[0].List(ctx, Filter{Network: "net"})
	if len(left) != 2 {
		t.Fatalf("left %+v, want keep and other-host", left)
	}
}

func TestHolderOf(t *testing.T) {
	ctx := context.Background()
	a := newHosts(t, v4Def("p", "198.18.0.0/24"), "h1")[0]
	al, err := a.Allocate(ctx, Request{Owner: own("c1"), Wants: ipWant("p")})
	if err != nil {
		t.Fatal(err)
	}
	got, ok, err := a.HolderOf(ctx, "p", al.Addrs[0].Addr)
	if err != nil || !ok || got.Owner != own("c1") || got.Host != "h1" {
		t.Fatalf("HolderOf = %+v %v %v", got, ok, err)
	}
	if _, ok, err := a.HolderOf(ctx, "p", mustAddr("198.18.0.200")); err != nil || ok {
		t.Fatalf("free address: %v %v", ok, err)
	}
}

func TestRequestDefsRecordAndVerifyInTheAllocation(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	a, _ := New(st, "h1")
	def := v4Def("p", "198.18.0.0/24")
	al, err := a.Allocate(ctx, Request{Owner: own("c1"), Wants: ipWant("p"), Defs: []Def{def}})
	if err != nil {
		t.Fatalf("first allocation must record the definition: %v", err)
	}
	if got, err := a.Definition(ctx, "p"); err != nil || got.Ranges[0].Subnet != mustPrefix("198.18.0.0/24") {
		t.Fatalf("recorded definition = %+v, %v", got, err)
	}
	other := v4Def("p", "198.18.1.0/24")
	if _, err := a.Allocate(ctx, Request{Owner: own("c2"), Wants: ipWant("p"), Defs: []Def{other}}); !errors.Is(err, ErrDefinitionMismatch) {
		t.Fatalf("different definition: %v", err)
	}
	if _, err := a.Allocate(ctx, Request{Owner: own("c1"), Wants: ipWant("p"), Defs: []Def{other}}); !errors.Is(err, ErrDefinitionMismatch) {
		t.Fatalf("idempotent re-allocation with a different definition: %v", err)
	}
	again, err := a.Allocate(ctx, Request{Owner: own("c1"), Wants: ipWant("p"), Defs: []Def{def}})
	if err != nil || again.Addrs[0].Addr != al.Addrs[0].Addr {
		t.Fatalf("re-allocation: %+v %v", again, err)
	}
	if _, err := a.Allocate(ctx, Request{Owner: own("c3"), Wants: ipWant("p"), Defs: []Def{def, v4Def("q", "198.18.2.0/24")}}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("definition of a pool not wanted: %v", err)
	}
}

func TestUsageShowsHostsAndLastSeen(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	at := time.Unix(1_900_000_000, 0)
	a, _ := New(st, "h1", WithClock(func() time.Time { return at }))
	if err := a.Define(ctx, v4Def("p", "198.18.0.0/24")); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"c1", "c2"} {
		if _, err := a.Allocate(ctx, Request{Owner: own(id), Wants: ipWant("p")}); err != nil {
			t.Fatal(err)
		}
	}
	u, err := a.Usage(ctx, "p")
	if err != nil {
		t.Fatal(err)
	}
	if u.Used != 2 || len(u.Hosts) != 1 || u.Hosts[0].Host != "h1" || !u.Hosts[0].LastSeen.Equal(at) || !u.Free {
		t.Fatalf("usage = %+v", u)
	}
}

// A host that left has its ranges tombstoned; another host takes the free
// holes of such a range at once, and the rest of it once it is empty.
func TestTombstonedRangeIsClaimedOnceEmpty(t *testing.T) {
	ctx := context.Background()
	hosts := newHosts(t, v4Def("p", "198.18.0.0/29"), "gone", "h2") // .1-.6
	if _, err := hosts[0].Allocate(ctx, Request{Owner: own("old"), Wants: ipWant("p")}); err != nil {
		t.Fatal(err) // "gone" owns the whole pool and holds .1
	}
	tombstone(t, hosts[0].Store(), "p", "gone")
	if _, _, err := hosts[0].Release(ctx, own("old")); err != nil {
		t.Fatal(err)
	}
	al, err := hosts[1].Allocate(ctx, Request{Owner: own("new"), Wants: ipWant("p")})
	if err != nil {
		t.Fatalf("allocation once the tombstoned range is empty: %v", err)
	}
	r, _ := hosts[1].RingOf(ctx, "p")
	if len(r.Ranges) != 1 || r.Ranges[0].Host != "h2" || r.Ranges[0].Tombstone {
		t.Fatalf("ring = %+v, want the whole empty tombstoned range h2's", r.Ranges)
	}
	if o, _ := r.Owner(al.Addrs[0].Addr); o.Host != "h2" || o.Tombstone {
		t.Fatalf("range of %s = %+v, want h2's", al.Addrs[0].Addr, o)
	}
}

// tombstone marks host's ranges of pool tombstoned, as rmpeer will (its
// state keeps its count, but no longer lists them).
func tombstone(t *testing.T, st store.Store, pool, host string) {
	t.Helper()
	def, r := readTestRing(t, st, pool)
	putRing(t, st, def, r.tombstone(host), nil)
}
