//go:build integration

package ringctl

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/ringipam/ringipam/integration/cnitest"
	"github.com/ringipam/ringipam/pkg/pool"
)

// TestLeave (issue 33, seed 002's `weave reset`): three hosts allocate
// through the real plugin on a real etcd; `ringctl leave node-b` releases
// node-b's owners, and each of node-b's ranges goes whole to the owner of
// the nearest range before it (node-b held nothing else there); node-b owns
// nothing afterwards and is not marked orphaned; the other hosts keep
// their owners.
func TestLeave(t *testing.T) {
	c := newCluster(t)
	held := map[string][]string{}
	for _, h := range []string{"node-a", "node-b", "node-c"} {
		for i := range 2 {
			ctr := fmt.Sprintf("%s-%d", h, i)
			held[ctr] = c.add(t, h, ctr, "", nil)
		}
	}
	a, err := pool.New(cnitest.OpenStore(t, c.store()), "inspector")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pools := []string{network + "-0", network + "-1"}
	before := map[string]pool.Ring{}
	heirs := 0
	for _, p := range pools {
		r, err := a.RingOf(ctx, p)
		if err != nil {
			t.Fatal(err)
		}
		before[p] = r
		for i, x := range r.Ranges {
			if x.Host == "node-b" && nearestBefore(r, i) != "" {
				heirs++
			}
		}
	}
	if heirs == 0 {
		t.Fatalf("no range of node-b follows another host's range: %+v", before)
	}
	// node-b is decommissioned: its agent stops, then the operator runs
	// leave.
	c.agent(t, "node-b").Stop(t)
	out := c.ok(t, "leave", "node-b")
	t.Logf("ringctl leave node-b:\n%s", out)
	for _, p := range pools {
		r, err := a.RingOf(ctx, p)
		if err != nil {
			t.Fatal(err)
		}
		for i, x := range before[p].Ranges {
			if x.Host != "node-b" {
				continue
			}
			want := nearestBefore(before[p], i)
			for _, addr := range []netip.Addr{x.Start, x.End} {
				got, _ := r.Owner(addr)
				if want != "" && (got.Host != want || got.Tombstone) {
					t.Fatalf("pool %s: %s of node-b's range %s-%s is now %+v, want it %s's (the nearest range before it)", p, addr, x.Start, x.End, got, want)
				}
				if want == "" && (got.Host != "node-b" || !got.Tombstone) {
					t.Fatalf("pool %s: %s of node-b's range %s-%s is now %+v, want it tombstoned (no owner before it)", p, addr, x.Start, x.End, got)
				}
			}
		}
		for _, x := range r.Ranges {
			if x.Host == "node-b" && !x.Tombstone {
				t.Fatalf("pool %s: node-b still owns %s-%s", p, x.Start, x.End)
			}
		}
	}
	for ctr := range held {
		_, ok, err := a.Lookup(ctx, pool.Owner{Kind: pool.KindCNI, Network: network, ContainerID: ctr, IfName: "eth0"})
		if err != nil {
			t.Fatal(err)
		}
		if left := strings.HasPrefix(ctr, "node-b"); ok == left {
			t.Fatalf("after node-b left, owner %s held = %v", ctr, ok)
		}
	}
	hosts, err := a.Hosts(ctx, 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, h := range hosts {
		if h.Name == "node-b" && (!h.OrphanedAt.IsZero() || h.Ranges != 0 || h.Used != 0) {
			t.Fatalf("node-b after leaving: %+v, want no live range, nothing used, not orphaned", h)
		}
	}
	if r := c.ringctl(t, "check"); r.code != 0 {
		t.Fatalf("check after leave: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
}

// nearestBefore is the host of the nearest owned range before range i of
// r, "" when that one is tombstoned or there is none (layout 4: claims
// take blocks, so unowned space may lie between two hosts' ranges; a
// leaving host's space goes to the nearest owner before it).
func nearestBefore(r pool.Ring, i int) string {
	for j := i - 1; j >= 0; j-- {
		if x := r.Ranges[j]; x.Host != "" {
			if x.Tombstone {
				return ""
			}
			return x.Host
		}
	}
	return ""
}
