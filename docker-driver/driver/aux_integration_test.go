//go:build integration

package driver

import (
	"testing"
	"time"

	"github.com/ringipam/ringipam/internal/testenv"
	"github.com/ringipam/ringipam/pkg/store/etcd"
)

// TestAuxSurvivesReclaimEtcd runs auxSurvivesReclaim through the driver on
// a real etcd.
func TestAuxSurvivesReclaimEtcd(t *testing.T) {
	srv := testenv.StartEtcd(t)
	st, err := etcd.New(etcd.Config{Endpoints: srv.Endpoints(), Prefix: "/aux/", DialTimeout: 5 * time.Second, RequestTimeout: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	auxSurvivesReclaim(t, st)
}
