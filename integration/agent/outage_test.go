//go:build integration

package agent_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/ringipam/ringipam/pkg/storeconfig"
)

// TestLivezThroughAnEtcdOutage: with its etcd stopped, the agent stays
// live (/livez 200: its loops keep turning, every store operation has a
// deadline) and is not ready (/readyz 503: it holds no liveness record);
// with etcd started again it is ready again. The outage lasts longer than
// the stall limit of /livez, so a heartbeat loop that stopped turning
// during it would show.
func TestLivezThroughAnEtcdOutage(t *testing.T) {
	c := newCluster(t)
	cfg := c.agentConfig("outage-host")
	cfg.Timeout = storeconfig.Duration(2 * time.Second)
	a := startAgent(t, cfg)
	code := func(path string) int {
		_, code, _ := httpGet(a.url + path)
		return code
	}
	waitFor(t, 20*time.Second, "/livez and /readyz 200", func() (bool, string) {
		l, r := code("/livez"), code("/readyz")
		return l == 200 && r == 200, fmt.Sprintf("livez %d, readyz %d", l, r)
	})
	c.etcd.Stop()
	stopped := time.Now()
	waitFor(t, 30*time.Second, "/readyz 503 with etcd stopped", func() (bool, string) {
		r := code("/readyz")
		return r == 503, fmt.Sprintf("readyz %d", r)
	})
	// Heartbeat 200ms, timeout 2s: the stall limit is 6.6s.
	stall := 3*time.Duration(cfg.Heartbeat) + 3*time.Duration(cfg.Timeout)
	polls := 0
	for time.Since(stopped) < stall+3*time.Second {
		if l := code("/livez"); l != 200 {
			t.Fatalf("/livez %d %s into the etcd outage, want 200 (the agent is alive, waiting)", l, time.Since(stopped).Round(time.Second))
		}
		if r := code("/readyz"); r != 503 {
			t.Fatalf("/readyz %d during the etcd outage, want 503", r)
		}
		polls++
		time.Sleep(200 * time.Millisecond)
	}
	t.Logf("/livez 200 and /readyz 503 over %d polls through %s of etcd outage", polls, time.Since(stopped).Round(time.Second))
	c.etcd.Start()
	waitFor(t, 60*time.Second, "/readyz 200 once etcd is back", func() (bool, string) {
		l, r := code("/livez"), code("/readyz")
		return l == 200 && r == 200, fmt.Sprintf("livez %d, readyz %d", l, r)
	})
}
