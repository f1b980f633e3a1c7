//go:build integration

package portalloc

import (
	"fmt"
	"testing"
	"time"

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
