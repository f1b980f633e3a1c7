package agent

import (
	"context"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/memory"
	"github.com/ringipam/ringipam/pkg/storeconfig"
)

// movingClock is a clock the test moves.
type movingClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *movingClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *movingClock) advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

// TestLivezFollowsTheHeartbeatLoop drives /livez through the agent's own
// loops (nothing set by hand): the agent's clock jumps past the stall
// limit, so the beat recorded so far is stale; /livez answers 200 again
// only because the heartbeat loop records its next turn (a loop that
// stopped recording would leave it 503).
func TestLivezFollowsTheHeartbeatLoop(t *testing.T) {
	clk := &movingClock{now: time.Date(2026, 11, 26, 12, 0, 0, 0, time.UTC)}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	a := newTestAgent(t, memory.New(), "host-a", nil, WithClock(clk.Now), WithListener(l))
	code := func(path string) int {
		_, c := get("http://" + l.Addr().String() + path)
		return c
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()
	waitFor(t, "/livez and /readyz 200 once the agent runs", func() bool { return code("/livez") == 200 && code("/readyz") == 200 })
	stall := stallAfter(time.Duration(a.cfg.Heartbeat), time.Duration(a.cfg.Timeout))
	for range 3 {
		before := a.lastBeat.Load()
		clk.advance(2 * stall)
		if time.Unix(0, before).Add(stall).After(clk.Now()) {
			t.Fatal("the clock did not move past the stall limit")
		}
		waitFor(t, "/livez 200 again after the clock jumped (the heartbeat loop's next turn)", func() bool {
			return code("/livez") == 200 && a.lastBeat.Load() > before
		})
	}
}

// scanCounter counts the scans of a store's owner records (o/: what the
// status page lists and nothing on a timer does).
type scanCounter struct {
	*memory.Store
	scans atomic.Int64
}

func (c *scanCounter) Scan(ctx context.Context, from, to string, limit int) ([]store.KV, error) {
	if strings.HasPrefix(from, "o/") {
		c.scans.Add(1)
	}
	return c.Store.Scan(ctx, from, to, limit)
}

// TestStatusPageIsReadOnDemandAndShared: the cluster-wide view is read
// when asked for, not on a timer, and requests within StatusRefresh share
// one read.
func TestStatusPageIsReadOnDemandAndShared(t *testing.T) {
	st := &scanCounter{Store: memory.New()}
	alloc(t, st, "host-b", "p", "b-1")
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	a := newTestAgent(t, st, "host-a", nil, WithListener(l))
	a.cfg.StatusRefresh = storeconfig.Duration(time.Hour)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()
	base := "http://" + l.Addr().String()
	waitFor(t, "the status page", func() bool {
		body, code := get(base + "/status.json")
		return code == 200 && strings.Contains(body, `"host-b"`)
	})
	before := st.scans.Load()
	for range 20 {
		if body, code := get(base + "/status.json"); code != 200 || !strings.Contains(body, `"host-b"`) {
			t.Fatalf("/status.json: %d %s", code, body)
		}
	}
	if before == 0 {
		t.Fatal("the status page listed no owner")
	}
	if n := st.scans.Load() - before; n != 0 {
		t.Fatalf("20 requests within StatusRefresh listed the owners %d times, want none (one shared read)", n)
	}
}
