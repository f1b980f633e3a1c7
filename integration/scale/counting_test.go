//go:build integration

package scale_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ringipam/ringipam/cmd/ringipamd/agent"
	"github.com/ringipam/ringipam/integration/scale/harness"
	"github.com/ringipam/ringipam/pkg/storeconfig"
)

// The short form of the scale harness (issue 41, "What it must show"): at
// 10 and at 50 simulated agents on one real etcd, what one heartbeat
// interval of idle, one host joining (its host record written), one ring
// change (that host's first claim) and one ingress port published cost
// each agent, in etcd requests (keep-alives aside) and watch messages.
// Each must be O(1) per agent: the per-agent count at 50 at most 1.5
// times the count at 10. Counts, not timings: each phase is a fixed
// window (eventWindow) that ends after its event reached every agent.

const (
	countHeartbeat = 5 * time.Second
	eventWindow    = 4 * time.Second
)

// perAgent is one size's per-agent counts, by phase.
type perAgent map[string][2]float64 // phase -> {requests, watch messages}

func measureEvents(t *testing.T, n int) perAgent {
	t.Helper()
	c := harness.NewCluster(t, harness.Options{N: n, Agent: func(cfg *agent.Config) {
		cfg.Heartbeat = storeconfig.Duration(countHeartbeat)
	}})
	hosts, err := c.AddHosts(n, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	// Every host's first ADD (four at a time, each retried as a runtime
	// retries a failed ADD: the simultaneous start is make scale's phase, not
	// this test's): the ring holds a range of each.
	results := make([][]byte, n)
	ctrs := make([]string, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	sem := make(chan struct{}, 4)
	for i, h := range hosts {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			for try := 0; try < 5; try++ {
				ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
				ctrs[i], results[i], _, errs[i] = h.Add(ctx)
				cancel()
				if errs[i] == nil {
					break
				}
			}
		})
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	// Settled: every agent routes to every other host.
	if missing := c.WaitAll(3*time.Minute, nil, func(h *harness.Host) bool {
		for _, o := range hosts {
			if o != h && !h.RoutesTo(o.Name) {
				return false
			}
		}
		return true
	}); missing > 0 {
		t.Fatalf("N=%d: %d agents never routed to every other host", n, missing)
	}
	out := perAgent{}
	phase := func(name string, fn func() error) {
		t.Helper()
		running := len(c.Running())
		a := c.Take()
		start := time.Now()
		if err := fn(); err != nil {
			t.Fatalf("N=%d, %s: %v", n, name, err)
		}
		if rest := eventWindow - time.Since(start); rest > 0 {
			time.Sleep(rest)
		}
		cost := harness.Diff(a, c.Take())
		running = max(running, len(c.Running()))
		out[name] = [2]float64{cost.RequestsTotal() / float64(running), cost.WatchMsgs / float64(running)}
		t.Logf("N=%d %-8s %5.1fs: per agent %.1f requests %v, %.1f watch messages", n, name, cost.Seconds,
			out[name][0], cost.Requests, out[name][1])
	}
	phase("idle", func() error { time.Sleep(countHeartbeat); return nil })
	var joiner *harness.Host
	phase("join", func() error {
		hs, err := c.AddHosts(1, nil, nil)
		if err == nil {
			joiner = hs[0]
		}
		return err
	})
	phase("ring", func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		if _, _, _, err := joiner.Add(ctx); err != nil {
			return err
		}
		if missing := c.WaitAll(2*time.Minute, joiner, func(h *harness.Host) bool { return h.RoutesTo(joiner.Name) }); missing > 0 {
			return fmt.Errorf("%d agents never routed to %s", missing, joiner.Name)
		}
		return nil
	})
	phase("publish", func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		if err := hosts[0].Publish(ctx, ctrs[0], results[0], "ingress", 31001); err != nil {
			return err
		}
		if missing := c.WaitAll(2*time.Minute, hosts[0], func(h *harness.Host) bool { return h.Forwards(31001) }); missing > 0 {
			return fmt.Errorf("%d agents never forwarded 31001", missing)
		}
		return nil
	})
	return out
}

func TestPerAgentCostDoesNotGrowWithHosts(t *testing.T) {
	const a, b, limit = 10, 50, 1.5
	small := measureEvents(t, a)
	large := measureEvents(t, b)
	var failed []string
	for _, ph := range []string{"idle", "join", "ring", "publish"} {
		for k, what := range []string{"etcd requests", "watch messages"} {
			s, l := small[ph][k], large[ph][k]
			// Below 2 per agent a count is noise-free but tiny: 1 -> 2
			// is not growth with N.
			if l > limit*max(s, 2) {
				failed = append(failed, fmt.Sprintf("%s: %s per agent %.1f at N=%d, %.1f at N=%d (x%.2f, limit x%.1f)",
					ph, what, s, a, l, b, l/max(s, 1e-9), limit))
			}
		}
	}
	if len(failed) > 0 {
		t.Errorf("what an agent costs etcd grows with the number of hosts:\n%s", strings.Join(failed, "\n"))
	}
}
