//go:build integration

package testenv_test

import (
	"context"
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

// A three-member cluster on loopback: every member serves, the status API
// names one leader, and killing the leader elects another among the rest;
// the killed member comes back on its data and follows.
func TestClusterLeaderFailover(t *testing.T) {
	c := testenv.StartEtcdCluster(t, testenv.ClusterOptions{})
	if n := len(c.Endpoints()); n != 3 {
		t.Fatalf("%d endpoints, want 3", n)
	}
	for _, ep := range c.Endpoints() {
		if err := dial(t, ep); err != nil {
			t.Fatalf("member at %s does not listen: %v", ep, err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	old, oldID, err := c.Leader(ctx)
	if err != nil {
		t.Fatal(err)
	}
	c.Members()[old].Stop()
	var now int
	var id uint64
	for {
		if now, id, err = c.Leader(ctx); err == nil && id != oldID {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("no new leader after killing %x: %v", oldID, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if now == old {
		t.Fatalf("leader index %d did not change after it was killed", now)
	}
	c.Members()[old].Start()
	st, err := c.Members()[old].Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.Leader == 0 || st.ID != oldID {
		t.Fatalf("restarted member: %+v, want id %x following a leader", st, oldID)
	}
}
