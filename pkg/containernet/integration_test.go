//go:build integration

package containernet

import (
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/ringipam/ringipam/internal/testenv"
	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/etcd"
	"github.com/ringipam/ringipam/pkg/store/local"
)

// The property tests of property_test.go on the real backends: the local
// bbolt file and a real etcd server.

// backends opens a fresh store per call; one etcd server serves the whole
// of outer (its cleanup stops it when outer ends).
func backends(outer *testing.T) map[string]func(t *testing.T) store.Store {
	var e *testenv.Etcd
	return map[string]func(t *testing.T) store.Store{
		"local": func(t *testing.T) store.Store {
			st, err := local.New(local.Config{Path: filepath.Join(t.TempDir(), "store.db"), OpenTimeout: 10 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { st.Close() })
			return st
		},
		"etcd": func(t *testing.T) store.Store {
			if e == nil {
				e = testenv.StartEtcd(outer)
			}
			st, err := etcd.New(etcd.Config{Endpoints: e.Endpoints(), Prefix: fmt.Sprintf("/cnet-%s/", t.Name()),
				DialTimeout: 10 * time.Second, RequestTimeout: 10 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { st.Close() })
			return st
		},
	}
}

func TestPropertyStores(t *testing.T) {
	for name, open := range backends(t) {
		t.Run(name, func(t *testing.T) {
			for _, seed := range seeds(2) {
				t.Run(fmt.Sprint(seed), func(t *testing.T) {
					runProperty(t, open(t), seed, 1500)
				})
			}
		})
	}
}

func TestConcurrentStores(t *testing.T) {
	for name, open := range backends(t) {
		t.Run(name, func(t *testing.T) {
			for _, seed := range seeds(1) {
				runConcurrent(t, open(t), seed, 100)
			}
		})
	}
}
