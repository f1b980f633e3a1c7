//go:build integration

package testenv_test

import (
	"net"
	"net/url"
	"testing"
	"time"

	"github.com/ringipam/ringipam/internal/testenv"
)

func dial(t *testing.T, endpoint string) error {
	t.Helper()
	u, err := url.Parse(endpoint)
	if err != nil {
		t.Fatal(err)
	}
	c, err := net.DialTimeout("tcp", u.Host, 2*time.Second)
	if err == nil {
		c.Close()
	}
	return err
}

// Stop frees the port, Start brings the server back on the same one, and
// Close stops it for good.
func TestEtcdLifecycle(t *testing.T) {
	e := testenv.StartEtcd(t)
	ep := e.Endpoints()[0]
	if err := dial(t, ep); err != nil {
		t.Fatalf("started etcd does not listen on %s: %v", ep, err)
	}
	e.Stop()
	if err := dial(t, ep); err == nil {
		t.Fatalf("stopped etcd still listens on %s", ep)
	}
	e.Start()
	if e.Endpoints()[0] != ep {
		t.Fatalf("restart moved from %s to %s", ep, e.Endpoints()[0])
	}
	if err := dial(t, ep); err != nil {
		t.Fatalf("restarted etcd does not listen: %v", err)
	}
	e.Close()
	e.Close() // idempotent
	if err := dial(t, ep); err == nil {
		t.Fatalf("closed etcd still listens on %s", ep)
	}
}

// Two servers in one test do not collide.
func TestTwoServers(t *testing.T) {
	a, b := testenv.StartEtcd(t), testenv.StartEtcd(t)
	if a.Endpoints()[0] == b.Endpoints()[0] || a.DataDir() == b.DataDir() {
		t.Fatalf("servers share %v / %s", a.Endpoints(), a.DataDir())
	}
}
