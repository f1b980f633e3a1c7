//go:build integration

package driver

import (
	"testing"
	"time"

	"github.com/ringipam/ringipam/internal/testenv"
	"github.com/ringipam/ringipam/pkg/store/etcd"
)

// TestConcurrentNetworksEtcd is runConcurrentNetworks on a real etcd.
func TestConcurrentNetworksEtcd(t *testing.T) {
	srv := testenv.StartEtcd(t)
	st, err := etcd.New(etcd.Config{Endpoints: srv.Endpoints(), Prefix: "/networks-race/", DialTimeout: 5 * time.Second, RequestTimeout: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	runConcurrentNetworks(t, st)
}
