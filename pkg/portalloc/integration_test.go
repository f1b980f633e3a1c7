//go:build integration

package portalloc

import (
	"testing"
	"time"

	"github.com/ringipam/ringipam/internal/testenv"
	"github.com/ringipam/ringipam/pkg/store/etcd"
)

// On a real etcd: the basics (an ingress port on host A refused on host B,
// host ports, exhaustion, release), and two hosts choosing dynamic ingress
// ports 8 at a time each without a collision.
func TestAllocatorEtcd(t *testing.T) {
	srv := testenv.StartEtcd(t)
	for _, tc := range []struct {
		name string
		run  func(*testing.T, *etcd.Store)
	}{
		{"basics", func(t *testing.T, st *etcd.Store) { runAllocatorBasics(t, st) }},
		{"concurrent dynamic ingress", func(t *testing.T, st *etcd.Store) { runConcurrentDynamicIngress(t, st) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st, err := etcd.New(etcd.Config{Endpoints: srv.Endpoints(), Prefix: "/" + tc.name + "/", DialTimeout: 5 * time.Second, RequestTimeout: 30 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			defer st.Close()
			tc.run(t, st)
		})
	}
}
