//go:build integration

package portalloc

import (
	"context"
	"fmt"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ringipam/ringipam/internal/testenv"
	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/etcd"
)

// On a real etcd, through etcd's client: the basics (an ingress port on host A refused on host B,
// host ports, exhaustion, release), two hosts choosing dynamic ingress
// ports 8 at a time each without a collision, and two requests that read
// before either commits on a narrow range (runCommitRace).
func TestAllocatorEtcd(t *testing.T) {
	srv := testenv.StartEtcd(t)
	clients := []struct {
		name string
		open func(prefix string) (store.Store, error)
	}{
		{"grpc", func(prefix string) (store.Store, error) {
			return etcd.New(etcd.Config{Endpoints: srv.Endpoints(), Prefix: prefix, DialTimeout: 5 * time.Second, RequestTimeout: 30 * time.Second})
		}},
	}
	for _, c := range clients {
		for _, tc := range []struct {
			name string
			run  func(*testing.T, store.Store)
		}{
			{"basics", runAllocatorBasics},
			{"concurrent dynamic ingress", runConcurrentDynamicIngress},
			{"commit race", runCommitRace},
		} {
			t.Run(c.name+"/"+tc.name, func(t *testing.T) {
				st, err := c.open("/" + c.name + "-" + tc.name + "/")
				if err != nil {
					t.Fatal(err)
				}
				defer st.Close()
				tc.run(t, st)
			})
		}
	}
}

// On a real etcd: the host comes back (its liveness key is written) between
// the sweep's reads and its release commit; nothing more of it is released.
func TestHostReturnsMidSweepEtcd(t *testing.T) {
	srv := testenv.StartEtcd(t)
	n := 0
	runHostReturnsMidSweep(t, func(t *testing.T) store.Store {
		n++
		st, err := etcd.New(etcd.Config{Endpoints: srv.Endpoints(), Prefix: fmt.Sprintf("/returning-%d/", n), DialTimeout: 5 * time.Second, RequestTimeout: 30 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { st.Close() })
		return st
	})
}

// On a real etcd, through a watch of p/a/ as the agents keep one: a hostPort
// DaemonSet on 50 hosts reaches the watchers of p/a/ once (the marker),
// not once per host with a value growing with the hosts (today's main:
// 50 events, the last one listing 50 bindings). The watch is read up to a
// sentinel key written after the last host, so no timing is involved.
func TestDaemonSetReachesTheWatchersOnceEtcd(t *testing.T) {
	srv := testenv.StartEtcd(t)
	const prefix, hosts = "/daemonset/", 50
	st, err := etcd.New(etcd.Config{Endpoints: srv.Endpoints(), Prefix: prefix, DialTimeout: 5 * time.Second, RequestTimeout: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	cli, err := clientv3.New(clientv3.Config{Endpoints: srv.Endpoints(), DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	wch := cli.Watch(clientv3.WithRequireLeader(ctx), prefix+"p/a/", clientv3.WithPrefix())
	for i := range hosts {
		a, err := New(st, fmt.Sprint("node-", i))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := a.Allocate(ctx, ep(fmt.Sprint("exporter-", i)), []Port{{Mode: Host, Name: "metrics", Protocol: "tcp", Number: 9100}}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := cli.Put(ctx, prefix+"p/a/~sentinel", "x"); err != nil {
		t.Fatal(err)
	}
	events, bytes := 0, 0
	for done := false; !done; {
		select {
		case resp, ok := <-wch:
			if !ok || resp.Err() != nil {
				t.Fatalf("watch ended: %v", resp.Err())
			}
			for _, ev := range resp.Events {
				if string(ev.Kv.Key) == prefix+"p/a/~sentinel" {
					done = true
					continue
				}
				events++
				bytes += len(ev.Kv.Value)
			}
		case <-ctx.Done():
			t.Fatal("no sentinel event within the deadline")
		}
	}
	if _, err := cli.Delete(ctx, prefix+"p/a/~sentinel"); err != nil {
		t.Fatal(err)
	}
	if events != 1 || bytes > 200 {
		t.Errorf("the DaemonSet on %d hosts sent the watchers of p/a/ %d events, %d bytes of values; want 1 event (the marker), under 200 bytes", hosts, events, bytes)
	}
	kvs, err := st.Scan(ctx, "p/h/tcp/09100/", store.PrefixEnd("p/h/tcp/09100/"), 0)
	if err != nil || len(kvs) != hosts {
		t.Errorf("%d keys under p/h/tcp/09100/ (%v), want one per host", len(kvs), err)
	}
	if f, err := Audit(ctx, st, Holders{}); err != nil || f != nil {
		t.Errorf("audit: %v %v", f, err)
	}
}
