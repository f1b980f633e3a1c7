package driver

import (
	"context"
	"encoding/json"
	"errors"
	"net/netip"
	"testing"

	"github.com/docker/go-plugins-helpers/ipam"

	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/memory"
)

// auxSurvivesReclaim is seed 004 with Docker: two hosts' networks reserve
// the same --aux-address; the host that reserved it first is reclaimed
// (Sweep, as an agent does); the address stays reserved for the other
// host's network, the store stays consistent (Audit), and the other host's
// release frees it. st is empty.
func auxSurvivesReclaim(t *testing.T, st store.Store) {
	ctx := context.Background()
	a, b := newDriver(t, st, "hostA"), newDriver(t, st, "hostB")
	req := &ipam.RequestPoolRequest{Pool: "198.18.31.0/24", SubPool: "198.18.31.0/25"}
	pa, _ := network(t, a, req, "")
	pb, _ := network(t, b, req, "")
	const aux = "198.18.31.7"
	for _, x := range []struct {
		d   *Driver
		pid string
	}{{a, pa}, {b, pb}} {
		if _, err := x.d.RequestAddress(ctx, &ipam.RequestAddressRequest{PoolID: x.pid, Address: aux}); err != nil {
			t.Fatalf("%s: aux: %v", x.d.Host(), err)
		}
	}
	// hostA is gone: a third host's agent sweeps it.
	sweeper, err := pool.New(st, "hostC")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sweeper.Reclaim(ctx, "hostA", pool.ReclaimOptions{}); err != nil {
		t.Fatalf("reclaim hostA: %v", err)
	}
	holder, held, err := sweeper.HolderOf(ctx, PoolName(netip.MustParsePrefix(req.Pool)), netip.MustParseAddr(aux))
	if err != nil || !held {
		t.Fatalf("after reclaiming hostA the aux address %s is free (held %v, %v), although hostB's network reserves it", aux, held, err)
	}
	if holder.Host != "hostB" || holder.HeldBy("hostA") {
		t.Fatalf("after reclaiming hostA the aux address is held by %+v, want hostB alone", holder)
	}
	if _, err := addr(t, b, pb, mac(9), aux); !errors.Is(err, pool.ErrAlreadyInUse) {
		t.Fatalf("aux address handed to a container after hostA's reclaim: %v", err)
	}
	if v, err := sweeper.Audit(ctx); err != nil || len(v) > 0 {
		t.Fatalf("audit after the reclaim: %v %v", v, err)
	}
	// hostB's network goes: the last claim frees it.
	if err := b.ReleaseAddress(ctx, &ipam.ReleaseAddressRequest{PoolID: pb, Address: aux}); err != nil {
		t.Fatal(err)
	}
	if got, err := addr(t, b, pb, mac(9), aux); err != nil || got != aux+"/24" {
		t.Fatalf("aux address not freed by the last network's release: %s, %v", got, err)
	}
	if v, err := sweeper.Audit(ctx); err != nil || len(v) > 0 {
		t.Fatalf("audit at the end: %v %v", v, err)
	}
}

func TestAuxSurvivesReclaimOfFirstHost(t *testing.T) { auxSurvivesReclaim(t, memory.New()) }

// TestAuxReleaseByCountingHostKeepsOthers: the host that counts a shared
// aux address releases its network first; the address moves to the other
// host, consistent, and is freed by it.
func TestAuxReleaseByCountingHostKeepsOthers(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	a, b := newDriver(t, st, "hostA"), newDriver(t, st, "hostB")
	req := &ipam.RequestPoolRequest{Pool: "198.18.32.0/24"}
	pa, _ := network(t, a, req, "")
	pb, _ := network(t, b, req, "")
	for _, x := range []struct {
		d   *Driver
		pid string
	}{{a, pa}, {b, pb}, {b, pb}} { // hostB's second request is dockerd's replay
		if _, err := x.d.RequestAddress(ctx, &ipam.RequestAddressRequest{PoolID: x.pid, Address: "198.18.32.9"}); err != nil {
			t.Fatal(err)
		}
	}
	if err := a.ReleaseAddress(ctx, &ipam.ReleaseAddressRequest{PoolID: pa, Address: "198.18.32.9"}); err != nil {
		t.Fatal(err)
	}
	al, held, err := b.alloc.HolderOf(ctx, PoolName(netip.MustParsePrefix(req.Pool)), netip.MustParseAddr("198.18.32.9"))
	if err != nil || !held || al.Host != "hostB" || al.HeldBy("hostA") {
		t.Fatalf("after hostA's release: %+v held %v %v", al, held, err)
	}
	if v, err := b.alloc.Audit(ctx); err != nil || len(v) > 0 {
		t.Fatalf("audit: %v %v", v, err)
	}
	if err := b.ReleaseAddress(ctx, &ipam.ReleaseAddressRequest{PoolID: pb, Address: "198.18.32.9"}); err != nil {
		t.Fatal(err)
	}
	if _, held, err := b.alloc.HolderOf(ctx, PoolName(netip.MustParsePrefix(req.Pool)), netip.MustParseAddr("198.18.32.9")); err != nil || held {
		t.Fatalf("not freed by the last release: %v %v", held, err)
	}
}

// TestAuxLegacyMarkersAdopted: a store written by a driver before shared
// owners (the record held by hostA alone, hostB's claim only a marker)
// reads on: hostB's replayed request adopts the markers, and a reclaim of
// hostA leaves the address to hostB.
func TestAuxLegacyMarkersAdopted(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	a, b := newDriver(t, st, "hostA"), newDriver(t, st, "hostB")
	req := &ipam.RequestPoolRequest{Pool: "198.18.33.0/24"}
	pa, _ := network(t, a, req, "")
	pb, _ := network(t, b, req, "")
	name := PoolName(netip.MustParsePrefix(req.Pool))
	ip := netip.MustParseAddr("198.18.33.9")
	// What the old driver left: hostA's plain allocation, both markers.
	if _, err := a.alloc.Allocate(ctx, pool.Request{Owner: auxOwner(name, ip), Wants: []pool.Want{{Pool: name, Role: pool.RoleIP, Addr: ip}}}); err != nil {
		t.Fatal(err)
	}
	for _, h := range []string{"hostA", "hostB"} {
		if err := st.Commit(ctx, nil, []store.Op{store.Put(auxKey(name, ip, h), []byte(h))}); err != nil {
			t.Fatal(err)
		}
	}
	_ = pa
	if _, err := b.RequestAddress(ctx, &ipam.RequestAddressRequest{PoolID: pb, Address: ip.String()}); err != nil {
		t.Fatal(err)
	}
	al, _, err := b.alloc.Lookup(ctx, auxOwner(name, ip))
	if err != nil || !al.HeldBy("hostA") || !al.HeldBy("hostB") {
		b, _ := json.Marshal(al)
		t.Fatalf("legacy markers not adopted: %s %v", b, err)
	}
	if left, err := st.Scan(ctx, "docker/aux/", store.PrefixEnd("docker/aux/"), 0); err != nil || len(left) != 0 {
		t.Fatalf("adopted markers left: %v %v", left, err)
	}
	sweeper, _ := pool.New(st, "hostC")
	if _, err := sweeper.Reclaim(ctx, "hostA", pool.ReclaimOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, held, err := sweeper.HolderOf(ctx, name, ip); err != nil || !held {
		t.Fatalf("freed by hostA's reclaim: %v %v", held, err)
	}
}
