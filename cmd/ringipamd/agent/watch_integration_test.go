//go:build integration

package agent

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ringipam/ringipam/internal/testenv"
	"github.com/ringipam/ringipam/pkg/cni/portmap"
	"github.com/ringipam/ringipam/pkg/hostlock"
	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/portalloc"
	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/etcd"
	"github.com/ringipam/ringipam/pkg/storeconfig"
)

// far is a period no test waits for: a change that arrives did so through
// a watch, not through a poll or a resync.
const far = storeconfig.Duration(time.Hour)

var prefixSeq atomic.Int64

// etcdSetup is a key prefix of its own on a real etcd, with a store to
// write as other hosts do.
type etcdSetup struct {
	srv    *testenv.Etcd
	prefix string
	st     store.Store
}

func newEtcdSetup(t *testing.T, srv *testenv.Etcd) *etcdSetup {
	t.Helper()
	prefix := fmt.Sprintf("/agw%d-%d/", os.Getpid(), prefixSeq.Add(1))
	st, err := etcd.New(etcd.Config{Endpoints: srv.Endpoints(), Prefix: prefix, DialTimeout: 5 * time.Second, RequestTimeout: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	return &etcdSetup{srv: srv, prefix: prefix, st: st}
}

// config is an agent's configuration on the setup's etcd with every poll,
// resync, heartbeat, sweep and status refresh an hour away, no HTTP, and
// an agent socket of its own.
func (e *etcdSetup) config(t *testing.T, host, addr string) Config {
	t.Helper()
	cfg := DefaultConfig()
	cfg.Host, cfg.Addr = host, addr
	dir, err := os.MkdirTemp("", "aw")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	cfg.Store = storeconfig.Config{Type: storeconfig.TypeEtcd, Endpoints: e.srv.Endpoints(), Prefix: e.prefix,
		AgentSocket: filepath.Join(dir, "s.sock"), DelQueue: filepath.Join(dir, "q")}
	cfg.SyncInterval, cfg.Resync, cfg.Heartbeat, cfg.SweepInterval, cfg.StatusRefresh = far, far, far, far, far
	cfg.Sweep = false
	cfg.LeaseTTL = storeconfig.Duration(30 * time.Second)
	cfg.Timeout = storeconfig.Duration(20 * time.Second)
	cfg.Listen, cfg.PortmapTable = "off", "off"
	return cfg
}

// start runs an agent until the test ends.
func startAgent(t *testing.T, cfg Config, opts ...Option) *Agent {
	t.Helper()
	a, err := New(cfg, slog.New(slog.NewTextHandler(io.Discard, nil)), opts...)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("agent %s: %v", cfg.Host, err)
			}
		case <-time.After(30 * time.Second):
			t.Errorf("agent %s did not stop within 30s", cfg.Host)
		}
	})
	return a
}

// allocOn allocates one address of pool p for ctr on host.
func allocOn(t *testing.T, st store.Store, host, ctr string) {
	t.Helper()
	a, err := pool.New(st, host)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.Allocate(context.Background(), pool.Request{
		Owner: pool.Owner{Kind: pool.KindCNI, Network: "net", ContainerID: ctr, IfName: "eth0"},
		Defs:  []pool.Def{v4Def("p", "198.18.8.0/24")},
		Wants: []pool.Want{{Pool: "p", Role: pool.RoleIP}},
	}); err != nil {
		t.Fatal(err)
	}
}

// record writes host's record with addr, as its agent would.
func record(t *testing.T, st store.Store, host, addr string) {
	t.Helper()
	a, err := pool.New(st, host)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.Heartbeat(context.Background(), addr, nil); err != nil {
		t.Fatal(err)
	}
}

// waitLong waits up to 30s for ok (a loaded machine; the poll is an hour
// away, so only a watch can make it true).
func waitLong(t *testing.T, what string, ok func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(90 * time.Second)
	for {
		done, state := ok()
		if done {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s; last: %s", what, state)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// viaOf is the set of next hops the router holds for host.
func viaOf(rt *fakeRouter, host string) []string {
	var out []string
	for _, r := range rt.routes() {
		if r.Host == host && !slices.Contains(out, r.Via.String()) {
			out = append(out, r.Via.String())
		}
	}
	slices.Sort(out)
	return out
}

func (f *fakeForwarder) forwards() []Forward {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.last)
}

// forwardTo says whether fwd forwards port to to.
func forwardTo(fwd *fakeForwarder, port uint16, to string) bool {
	return slices.ContainsFunc(fwd.forwards(), func(f Forward) bool { return f.Port == port && f.To.String() == to })
}

// Every watch the agent keeps, on a real etcd with every poll and resync an
// hour away: a ring change (another host claims space), a host record
// change (its address), a liveness key appearing and vanishing (an
// orphaned host coming back and going again), and an ingress port
// published and released on another host each reach the agent's routes or
// forwards through the watch alone.
func TestWatchesReachTheAgent(t *testing.T) {
	e := newEtcdSetup(t, testenv.StartEtcd(t))
	ctx := context.Background()
	// Before the agent starts: host-b and host-c have records, host-b a
	// range, host-d a range, an ingress port and an orphaned mark.
	allocOn(t, e.st, "host-b", "b-1")
	record(t, e.st, "host-b", "198.18.0.2")
	record(t, e.st, "host-c", "198.18.0.3")
	allocOn(t, e.st, "host-d", "d-1")
	record(t, e.st, "host-d", "198.18.0.4")
	dports, err := portalloc.New(e.st, "host-d")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := dports.Allocate(ctx, portalloc.EndpointID{Network: "net", ContainerID: "d-web", IfName: "eth0"},
		[]portalloc.Port{{Mode: portalloc.Ingress, Protocol: "tcp", Number: 8444, Name: "80"}}); err != nil {
		t.Fatal(err)
	}
	sweeper, err := pool.New(e.st, "host-b")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sweeper.Reclaim(ctx, "host-d", pool.ReclaimOptions{}); err != nil {
		t.Fatal(err)
	}

	// host-a's own endpoints, with forwards in portmap-ingress's table.
	aports, err := portalloc.New(e.st, "host-a")
	if err != nil {
		t.Fatal(err)
	}
	own := func(c string) portalloc.EndpointID {
		return portalloc.EndpointID{Network: "net", ContainerID: c, IfName: "eth0"}
	}
	fp := &fakePortmap{marks: map[string][]portmap.Rule{}}
	for i, c := range []string{"a-kept", "a-later"} {
		if _, err := aports.Allocate(ctx, own(c), []portalloc.Port{{Mode: portalloc.Host, Protocol: "tcp", Number: uint16(7000 + i)}}); err != nil {
			t.Fatal(err)
		}
		fp.marks[portmap.Mark(own(c))] = nil
	}

	rt := &fakeRouter{onLink: []netip.Prefix{netip.MustParsePrefix("198.18.0.9/16")}}
	fwd := &fakeForwarder{}
	cfg := e.config(t, "host-a", "198.18.0.9")
	cfg.Routes, cfg.Ingress = true, true
	startAgent(t, cfg, withRouter(rt), withForwarder(fwd), withPortmap(fp, hostlock.Dir(t.TempDir())))
	waitLong(t, "routes to host-b", func() (bool, string) {
		v := viaOf(rt, "host-b")
		return slices.Equal(v, []string{"198.18.0.2"}) && len(viaOf(rt, "host-d")) == 0, fmt.Sprint(rt.routes())
	})
	waitLong(t, "no forward to orphaned host-d", func() (bool, string) {
		fwd.mu.Lock()
		defer fwd.mu.Unlock()
		return fwd.syncs > 0 && len(fwd.last) == 0, fmt.Sprint(fwd.last)
	})

	// A ring change: host-c claims space (its record was there before).
	allocOn(t, e.st, "host-c", "c-1")
	waitLong(t, "routes to host-c's new range (the ring watch)", func() (bool, string) {
		return slices.Equal(viaOf(rt, "host-c"), []string{"198.18.0.3"}), fmt.Sprint(rt.routes())
	})

	// A host record change: host-b's address.
	record(t, e.st, "host-b", "198.18.0.22")
	waitLong(t, "routes to host-b through its new address (the host record watch)", func() (bool, string) {
		return slices.Equal(viaOf(rt, "host-b"), []string{"198.18.0.22"}), fmt.Sprint(rt.routes())
	})

	// A liveness key appears: orphaned host-d is up again, its ingress
	// port forwarded; the key vanishes: orphaned again, no forward.
	if err := e.st.Commit(ctx, nil, []store.Op{store.Put(pool.LivenessKey("host-d"), []byte(`{"pid":1}`))}); err != nil {
		t.Fatal(err)
	}
	waitLong(t, "the forward to host-d once its liveness key exists (the liveness watch)", func() (bool, string) {
		return forwardTo(fwd, 8444, "198.18.0.4"), fmt.Sprint(fwd.forwards())
	})
	if err := e.st.Commit(ctx, nil, []store.Op{store.Delete(pool.LivenessKey("host-d"))}); err != nil {
		t.Fatal(err)
	}
	waitLong(t, "no forward to host-d once its liveness key is gone (the liveness watch)", func() (bool, string) {
		return !forwardTo(fwd, 8444, "198.18.0.4"), fmt.Sprint(fwd.forwards())
	})

	// An ingress port published on host-c, then released.
	cports, err := portalloc.New(e.st, "host-c")
	if err != nil {
		t.Fatal(err)
	}
	ep := portalloc.EndpointID{Network: "net", ContainerID: "c-web", IfName: "eth0"}
	if _, err := cports.Allocate(ctx, ep, []portalloc.Port{{Mode: portalloc.Ingress, Protocol: "tcp", Number: 8443, Name: "80"}}); err != nil {
		t.Fatal(err)
	}
	waitLong(t, "the forward of host-c's ingress port (the published ports watch)", func() (bool, string) {
		return forwardTo(fwd, 8443, "198.18.0.3"), fmt.Sprint(fwd.forwards())
	})
	if _, err := cports.Release(ctx, ep); err != nil {
		t.Fatal(err)
	}
	waitLong(t, "the forward's removal (the published ports watch)", func() (bool, string) {
		return !forwardTo(fwd, 8443, "198.18.0.3"), fmt.Sprint(fwd.forwards())
	})

	// One of host-a's endpoints is released elsewhere (ringctl, a
	// sweep): its forwards leave portmap-ingress's table, the other's
	// stay.
	if got := fp.has(); len(got) != 2 {
		t.Fatalf("portmap-ingress's table %v: the agent removed forwards of endpoints it holds", got)
	}
	if _, err := aports.Release(ctx, own("a-later")); err != nil {
		t.Fatal(err)
	}
	waitLong(t, "the released endpoint's forwards removed (the watch of this host's endpoint index)", func() (bool, string) {
		got := fp.has()
		return slices.Equal(got, []string{portmap.Mark(own("a-kept"))}), fmt.Sprint(got)
	})
}
