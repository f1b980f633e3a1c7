package containernet

import (
	"context"
	"errors"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/store/memory"
)

func newTestManager(t *testing.T, defs ...pool.Def) *Manager {
	t.Helper()
	a, err := pool.New(memory.New(), "h1")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := a.Define(ctx, defs...); err != nil {
		t.Fatal(err)
	}
	return NewManager(a)
}

func TestSharedSpecialSubnet(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	m := newTestManager(t, pool.Def{Name: "net", Ranges: []pool.Range{{Subnet: pfx("198.18.0.0/24")}}})
	owner := func(c string) pool.Owner {
		return pool.Owner{Kind: pool.KindCNI, Network: "net", ContainerID: c, IfName: "eth0"}
	}
	special := pfx("198.19.7.0/24")
	gws := map[netip.Addr]bool{}
	// three containers share the subnet with distinct ips and distinct gateways
	for i, c := range []string{"a", "b", "c"} {
		want := ip("198.19.7.10")
		for range i {
			want = want.Next()
		}
		n, err := m.CreateInSubnet(ctx, owner(c), "net", special, want)
		if err != nil {
			t.Fatal(err)
		}
		if n.IP() != want || n.Subnet() != special || !pfx("198.18.0.0/24").Contains(n.Gateway()) || gws[n.Gateway()] {
			t.Fatalf("%s got %s", c, n)
		}
		gws[n.Gateway()] = true
		again, err := m.CreateInSubnet(ctx, owner(c), "net", special, want)
		if err != nil || again != n {
			t.Fatalf("repeated create: %v, %v; want %v", again, err, n)
		}
		if got, ok, err := m.Lookup(ctx, owner(c), "net"); err != nil || !ok || got != n {
			t.Fatalf("Lookup: %v, %v, %v", got, ok, err)
		}
	}
	// a fourth asking for a taken ip is rejected, naming the holder
	_, err := m.CreateInSubnet(ctx, owner("d"), "net", special, ip("198.19.7.11"))
	var inUse *pool.InUseError
	if !errors.Is(err, pool.ErrAlreadyInUse) || !errors.As(err, &inUse) || !strings.Contains(err.Error(), "ip 198.19.7.11 is taken in special subnet 198.19.7.0/24") || inUse.Holder != owner("b").String() {
		t.Fatalf("fourth container: %v", err)
	}
	if _, ok, _ := m.Lookup(ctx, owner("d"), "net"); ok {
		t.Fatal("the rejected container holds something")
	}
	// the same owner asking for another mode is told to destroy first
	if _, err := m.CreateFromPool(ctx, owner("a"), "net"); !errors.Is(err, pool.ErrAlreadyExists) {
		t.Fatalf("mode change: %v", err)
	}
	if err := m.Check(ctx, "net"); err != nil {
		t.Fatal(err)
	}
	for _, c := range []string{"a", "b", "c", "c"} {
		if _, _, err := m.Destroy(ctx, owner(c)); err != nil {
			t.Fatal(err)
		}
	}
	if s, err := m.State(ctx, "net"); err != nil || len(s.Containers) != 0 || len(s.Alloc) != 0 {
		t.Fatalf("after destroying: %+v, %v", s, err)
	}
}

func TestDualStackPerContainer(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	m := newTestManager(t,
		pool.Def{Name: "v4", Ranges: []pool.Range{{Subnet: pfx("198.18.0.0/24")}}},
		pool.Def{Name: "v6", Ranges: []pool.Range{{Subnet: pfx("fd00:1::/64")}}})
	o := pool.Owner{Kind: pool.KindCNI, Network: "net", ContainerID: "a", IfName: "eth0"}
	nets, err := m.Create(ctx, Request{Owner: o, Specs: []Spec{
		{Pool: "v4"},
		{Pool: "v6", Subnet: pfx("fd00:9::/64"), IP: ip("fd00:9::5")},
	}})
	if err != nil {
		t.Fatal(err)
	}
	v4, v6 := nets[0], nets[1]
	if !v4.Pooled() || v4.Prefix().Bits() != 32 || !pfx("198.18.0.0/24").Contains(v4.Gateway()) {
		t.Fatalf("v4: %s", v4)
	}
	if v6.IP() != ip("fd00:9::5") || v6.Subnet() != pfx("fd00:9::/64") || !pfx("fd00:1::/64").Contains(v6.Gateway()) {
		t.Fatalf("v6: %s", v6)
	}
	for _, p := range []string{"v4", "v6"} {
		if err := m.Check(ctx, p); err != nil {
			t.Fatal(err)
		}
	}
	if _, ok, err := m.Destroy(ctx, o); err != nil || !ok {
		t.Fatalf("destroy: %v, %v", ok, err)
	}
	if _, ok, err := m.Destroy(ctx, o); err != nil || ok {
		t.Fatalf("destroying again: %v, %v", ok, err)
	}
}
