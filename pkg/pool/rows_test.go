package pool

import (
	"context"
	"errors"
	"net/netip"
	"path/filepath"
	"testing"
	"time"

	"github.com/ringipam/ringipam/pkg/store/local"
)

// Issue 33's open rows of seeds 001 and 002, on the local (bbolt) store.

func localHosts(t *testing.T, def Def, hosts ...string) []*Allocator {
	t.Helper()
	st, err := local.New(local.Config{Path: filepath.Join(t.TempDir(), "store.db"), OpenTimeout: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	return hostsOn(t, st, def, hosts...)
}

// TestStaticOnlyRange: dynamic requests never get an address of a
// "static" range, not even with the dynamic part exhausted (they get the
// capacity error, counting the dynamic part only); a static request in
// that range succeeds, on a host that owns no range at all.
func TestStaticOnlyRange(t *testing.T) {
	ctx := context.Background()
	def := Def{Name: "p", Ranges: []Range{
		{Subnet: mustPrefix("198.18.0.0/24"), Start: mustAddr("198.18.0.10"), End: mustAddr("198.18.0.13")},
		{Subnet: mustPrefix("198.18.0.0/24"), Start: mustAddr("198.18.0.20"), End: mustAddr("198.18.0.29"), Static: true},
	}}
	hs := localHosts(t, def, "h1", "h2")
	got := map[netip.Addr]bool{}
	for i := 0; i < 4; i++ {
		a := hs[i%2]
		al, err := a.Allocate(ctx, Request{Owner: own("d" + string(rune('0'+i))), Wants: ipWant("p")})
		if err != nil {
			t.Fatalf("dynamic allocation %d: %v", i, err)
		}
		got[al.Addrs[0].Addr] = true
	}
	for x := range got {
		if x.Compare(mustAddr("198.18.0.13")) > 0 {
			t.Fatalf("dynamic allocation got %s, an address of the static range", x)
		}
	}
	for i, a := range hs {
		_, err := a.Allocate(ctx, Request{Owner: own("over" + string(rune('0'+i))), Wants: ipWant("p")})
		var capErr *CapacityError
		if !errors.As(err, &capErr) || capErr.Capacity != "4" {
			t.Fatalf("host %d: dynamic allocation with the dynamic part full: %v, want a capacity error of 4 addresses", i, err)
		}
	}
	st, err := hs[1].Allocate(ctx, Request{Owner: own("s1"), Wants: []Want{{Pool: "p", Role: RoleIP, Addr: mustAddr("198.18.0.25")}}})
	if err != nil || st.Addrs[0].Addr != mustAddr("198.18.0.25") {
		t.Fatalf("static allocation in the static range = %v, %v", st, err)
	}
	// Recorded and read back with the field; an equal definition without
	// it is a different pool.
	rec, err := hs[0].Definition(ctx, "p")
	if err != nil || !rec.Ranges[1].Static {
		t.Fatalf("recorded definition %+v, %v: the static range lost its mark", rec, err)
	}
	plain := def
	plain.Ranges = []Range{def.Ranges[0], {Subnet: def.Ranges[1].Subnet, Start: def.Ranges[1].Start, End: def.Ranges[1].End}}
	if err := hs[0].Define(ctx, plain); !errors.Is(err, ErrDefinitionMismatch) {
		t.Fatalf("defining the pool without the static mark: %v, want a definition mismatch", err)
	}
}

// TestEmptyRangeOfALiveDonorIsGivenWhole (seed 002): a live donor's range
// that holds no address changes owner whole, not only its upper half.
func TestEmptyRangeOfALiveDonorIsGivenWhole(t *testing.T) {
	ctx := context.Background()
	hs := localHosts(t, v4Def("p", "198.18.0.0/27"), "h1", "h2", "h3") // .1-.30
	if _, err := hs[0].Allocate(ctx, Request{Owner: own("a"), Wants: ipWant("p")}); err != nil {
		t.Fatal(err) // h1 takes the unowned ring whole
	}
	if _, err := hs[1].Allocate(ctx, Request{Owner: own("b"), Wants: ipWant("p")}); err != nil {
		t.Fatal(err) // h2 takes the upper half of h1's free hole
	}
	if _, _, err := hs[0].Release(ctx, own("a")); err != nil {
		t.Fatal(err) // h1's range is empty now; h1 stays the donor with the most free space
	}
	before, err := hs[0].RingOf(ctx, "p")
	if err != nil {
		t.Fatal(err)
	}
	var h1 []OwnedRange
	for _, r := range before.Ranges {
		if r.Host == "h1" {
			h1 = append(h1, r)
		}
	}
	if len(h1) != 1 {
		t.Fatalf("ring before the claim %+v: want one range of h1", before.Ranges)
	}
	got, err := hs[2].Allocate(ctx, Request{Owner: own("c"), Wants: ipWant("p")})
	if err != nil {
		t.Fatal(err)
	}
	after, err := hs[0].RingOf(ctx, "p")
	if err != nil {
		t.Fatal(err)
	}
	whole, ok := after.Owner(h1[0].Start)
	if !ok || whole.Host != "h3" || whole.Start != h1[0].Start || whole.End != h1[0].End {
		t.Fatalf("after h3's claim the ring is %+v; want h1's empty range %s-%s given whole to h3 (h3 got %s)",
			after.Ranges, h1[0].Start, h1[0].End, got.Addrs[0].Addr)
	}
}
