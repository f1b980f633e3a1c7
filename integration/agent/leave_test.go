//go:build integration

package agent_test

import (
	"context"
	"net/netip"
	"syscall"
	"testing"
	"time"

	"github.com/ringipam/ringipam/integration/cnitest"
	"github.com/ringipam/ringipam/pkg/pool"
)

// TestLeaveOnStop (issue 33, seed 002's `weave reset` for a host being
// decommissioned): ringipamd --leave-on-stop, stopped with SIGTERM, exits 0
// having released its host's owners and handed its range whole to the
// owner of the range before it; the host is not marked orphaned.
func TestLeaveOnStop(t *testing.T) {
	c := newCluster(t)
	const subnet = "198.18.41.0/24"
	// The plugins' calls go through an agent of their own (the test's
	// hosts are names in the store).
	plugins := startBinary(t, nil, "--host", "plugins-host", "--store", "etcd", "--etcd-endpoints", c.etcd.Endpoints()[0],
		"--store-prefix", c.prefix, "--listen", "off", "--ingress=false", "--sweep=false")
	waitSocket(t, plugins.socket)
	for _, h := range []string{"stay-host", "leave-host"} {
		if _, err := cnitest.ExecIPAM("ADD", ipamConf(t, "ag-leave", h, subnet, plugins.store(c.storeObj("")), nil), h+"-ctr", ""); err != nil {
			t.Fatal(err)
		}
	}
	inspect := c.allocator(t, "inspector", nil)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	p := poolName(t, inspect, subnet)
	before, err := inspect.RingOf(ctx, p)
	if err != nil {
		t.Fatal(err)
	}
	var leaving pool.OwnedRange
	for i, r := range before.Ranges {
		if r.Host == "leave-host" {
			// Layout 4: claims take blocks, so unowned space may lie
			// between them; the nearest owned range before must be
			// stay-host's.
			prev := ""
			for _, q := range before.Ranges[:i] {
				if q.Host != "" {
					prev = q.Host
				}
			}
			if prev != "stay-host" {
				t.Fatalf("ring %+v: want leave-host's range after stay-host's", before.Ranges)
			}
			leaving = r
		}
	}
	b := startBinary(t, nil, "--host", "leave-host", "--store", "etcd", "--etcd-endpoints", c.etcd.Endpoints()[0],
		"--store-prefix", c.prefix, "--lease-ttl", "5s", "--listen", "off", "--ingress=false", "--leave-on-stop")
	waitFor(t, 20*time.Second, "leave-host up", func() (bool, string) {
		h, _ := stateOf(t, inspect, "leave-host", 0)
		return h.State == pool.HostUp, string(h.State)
	})
	if err := b.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case <-b.done:
	case <-time.After(60 * time.Second):
		t.Fatalf("ringipamd --leave-on-stop still runs 60s after SIGTERM:\n%s", b.log.String())
	}
	if code := b.cmd.ProcessState.ExitCode(); code != 0 {
		t.Fatalf("ringipamd --leave-on-stop exited %d:\n%s", code, b.log.String())
	}
	after, err := inspect.RingOf(ctx, p)
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range []netip.Addr{leaving.Start, leaving.End} {
		if got, _ := after.Owner(a); got.Host != "stay-host" || got.Tombstone {
			t.Fatalf("after leaving, %s of leave-host's range %s-%s is %+v; want stay-host's (the nearest range before it). Ring %+v",
				a, leaving.Start, leaving.End, got, after.Ranges)
		}
	}
	for h, want := range map[string]bool{"stay-host": true, "leave-host": false} {
		_, ok, err := inspect.Lookup(ctx, pool.Owner{Kind: pool.KindCNI, Network: "ag-leave", ContainerID: h + "-ctr", IfName: "eth0"})
		if err != nil || ok != want {
			t.Fatalf("owner of %s held = %v (%v), want %v", h, ok, err, want)
		}
	}
	if h, _ := stateOf(t, inspect, "leave-host", 0); !h.OrphanedAt.IsZero() || h.Ranges != 0 {
		t.Fatalf("leave-host after leaving: %+v, want no live range and not orphaned", h)
	}
}
