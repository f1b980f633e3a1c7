package agent

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net"
	"sync"
	"time"

	"go.etcd.io/etcd/client/v3/concurrency"

	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/portalloc"
	"github.com/ringipam/ringipam/pkg/retry"
)

// One leader for the cluster's upkeep.
//
// The agents that sweep (--sweep, the default) elect one of them through
// etcd's concurrency.Election on the prefix e/ (pool.ElectionKeyPrefix),
// on a session (a lease of --lease-ttl) of its own: each candidate writes
// one key and waits for the deletion of the candidate just before it only,
// so a campaign costs O(1) whatever the cluster's size. Only the leader:
//
//   - sweeps orphaned hosts every --sweep-interval (pool.Sweeper: the
//     pool's reclaim, then the release of their published ports under the
//     reclaim guard, and the removal of reclaimed hosts' records after the
//     retention);
//   - compacts the address history every pool.CompactHistoryEvery, the
//     first time that long after it took the lead (not at every start);
//   - computes the pool-wide figures (the metrics of every pool and of the
//     hosts by state) every --status-refresh.
//
// A leader whose session ends (its lease expired during a partition, or
// etcd went away) stops all of it and campaigns again; a leader that stops
// resigns at once. Two leaders for a moment (an old one that has not yet
// seen its lease expire) do no harm: every commit of a sweep or a
// compaction is conditioned on what it read, as it was when every agent
// swept. On the local store (one host, no etcd) the agent leads alone.

// compactEvery is how often the leader compacts the history (tests
// shorten it).
func (a *Agent) compactEvery() time.Duration {
	if a.compactInterval > 0 {
		return a.compactInterval
	}
	return pool.CompactHistoryEvery
}

// withCompactEvery makes the leader compact the history every d (tests).
func withCompactEvery(d time.Duration) Option { return func(o *options) { o.compactEvery = d } }

// withSeenEvery replaces pool.SeenEvery(orphanAfter) as how often the
// heartbeat refreshes the status record's last-seen time (tests).
func withSeenEvery(d time.Duration) Option { return func(o *options) { o.seenEvery = d } }

// withAPIListener wraps the plugins' socket listener (tests: one whose
// Accept fails on demand).
func withAPIListener(wrap func(net.Listener) net.Listener) Option {
	return func(o *options) { o.apiWrap = wrap }
}

// Leading reports whether this agent leads now (see above).
func (a *Agent) Leading() bool { return a.leading.Load() }

// electionLoop campaigns until ctx ends, and runs the leader's work while
// this agent leads (etcd).
func (a *Agent) electionLoop(ctx context.Context) {
	ttl := int(math.Ceil(time.Duration(a.cfg.LeaseTTL).Seconds()))
	backoff := retry.Policy{Attempts: math.MaxInt32, BaseDelay: 200 * time.Millisecond, MaxDelay: max(time.Duration(a.cfg.LeaseTTL)/3, time.Second)}
	_ = retry.Do(ctx, backoff, func(error) bool { return ctx.Err() == nil }, func(int) error {
		err := a.campaign(ctx, ttl)
		if ctx.Err() != nil {
			return nil
		}
		if err != nil {
			a.storeError("election", err)
		}
		return errors.New("campaign again")
	})
}

// campaign runs one session: it campaigns, leads while it wins, and
// returns when the session or ctx ends (a clean stop resigns and revokes
// the session's lease, so the next candidate leads at once).
func (a *Agent) campaign(ctx context.Context, ttl int) error {
	// The session's keep-alives stop with ctx; its lease is revoked on
	// the way out (below) with a deadline of its own, so a clean stop
	// hands the lead over at once.
	sess, err := concurrency.NewSession(a.cli, concurrency.WithTTL(ttl), concurrency.WithContext(ctx))
	if err != nil {
		return fmt.Errorf("session: %w", err)
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), time.Duration(a.cfg.Timeout))
		defer cancel()
		_, _ = a.cli.Revoke(cctx, sess.Lease())
	}()
	lctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-sess.Done():
			cancel()
		case <-lctx.Done():
		}
	}()
	el := concurrency.NewElection(sess, a.prefix+pool.ElectionKeyPrefix)
	if err := el.Campaign(lctx, a.cfg.Host); err != nil {
		if lctx.Err() != nil && ctx.Err() == nil {
			return fmt.Errorf("campaign: the session ended (lease lost)")
		}
		return fmt.Errorf("campaign: %w", err)
	}
	a.log.Info("leading: this agent sweeps, compacts the history and computes the pool-wide figures", "host", a.cfg.Host)
	a.leading.Store(true)
	a.lead(lctx)
	a.leading.Store(false)
	if ctx.Err() != nil {
		a.log.Info("leading no more: stopping", "host", a.cfg.Host)
		return nil
	}
	a.log.Warn("leading no more: the election's session ended (the store was out of reach longer than the lease TTL); campaigning again", "host", a.cfg.Host)
	return fmt.Errorf("leadership lost")
}

// lead runs the leader's work until ctx ends.
func (a *Agent) lead(ctx context.Context) {
	var wg sync.WaitGroup
	run := func(fn func(context.Context)) {
		wg.Add(1)
		go func() { defer wg.Done(); fn(ctx) }()
	}
	if a.cfg.Sweep && a.cfg.OrphanAfter > 0 {
		sw := &pool.Sweeper[portalloc.Released]{Alloc: a.alloc, Ports: a.ports,
			Options: pool.SweepOptions{OrphanAfter: time.Duration(a.cfg.OrphanAfter), Retention: Retention(time.Duration(a.cfg.OrphanAfter))}}
		run(func(ctx context.Context) {
			a.every(ctx, time.Duration(a.cfg.SweepInterval), func(ctx context.Context) { a.sweep(ctx, sw) })
		})
	}
	if a.cfg.Sweep {
		run(func(ctx context.Context) {
			for sleep(ctx, a.compactEvery()) == nil {
				a.compactHistory(ctx)
			}
		})
	}
	if a.cfg.KubeReclaimNodes && a.cli != nil {
		run(a.reclaimDeletedNodes)
	}
	wg.Wait()
	a.figMu.Lock()
	a.figures.Store(nil)
	a.figMu.Unlock()
}

// Retention is how long the leader keeps a reclaimed host's records after
// its orphaning (pool.DefaultRetention: orphanAfter).
func Retention(orphanAfter time.Duration) time.Duration { return pool.DefaultRetention(orphanAfter) }

// figures are the pool-wide figures the leader computes.
type figures struct {
	taken time.Time
	hosts []pool.HostInfo
	pools []PoolView // without the per-range use (Used): no owner is read
}

// leaderFigures returns the pool-wide figures when this agent leads: the
// last ones while younger than StatusRefresh, else computed anew, at
// scrape time (one computation at a time, shared by the scrapes waiting
// for it); the last ones when the store cannot be read. On demand, as
// this host's own figures are: a leader nobody scrapes reads nothing (it
// read the hosts and every pool's states every StatusRefresh before, 40
// to 66 reads a minute for the cluster, 4 an idle host a minute of a
// 10-host cluster).
func (a *Agent) leaderFigures() *figures {
	fresh := func() *figures {
		if f := a.figures.Load(); f != nil && a.now().Sub(f.taken) < time.Duration(a.cfg.StatusRefresh) {
			return f
		}
		return nil
	}
	if !a.leading.Load() {
		return nil
	}
	return readShared(&a.figMu, fresh, func() *figures {
		if a.leading.Load() {
			a.refreshFigures(context.Background())
		}
		if !a.leading.Load() {
			// Leadership ended meanwhile: lead's end cleared them, or will.
			return nil
		}
		return a.figures.Load()
	})
}

// refreshFigures computes the pool-wide figures (the leader): the hosts
// and, per pool, its usage (its host states) and its ring. No owner is
// listed.
func (a *Agent) refreshFigures(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Duration(a.cfg.Timeout))
	defer cancel()
	hosts, err := a.alloc.Hosts(ctx, time.Duration(a.cfg.OrphanAfter))
	if err != nil {
		a.storeError("hosts", err)
		return
	}
	pools, err := readPools(ctx, a.alloc, false)
	if err != nil {
		a.storeError("pools", err)
		return
	}
	f := &figures{taken: a.now(), hosts: hosts, pools: pools}
	if ctx.Err() == nil {
		a.figures.Store(f)
	}
}
