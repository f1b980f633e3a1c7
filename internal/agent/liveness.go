package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"os"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/retry"
	"github.com/ringipam/ringipam/pkg/store"
)

// livenessValue is what the liveness key holds: who keeps it, for operators.
type livenessValue struct {
	Addr    string `json:"addr,omitempty"`
	PID     int    `json:"pid"`
	Started int64  `json:"started"`
}

// leaseKeeper keeps this host's liveness key attached to an etcd lease that
// it renews (the client's KeepAlive): the key vanishes one TTL after the
// agent dies, whatever killed it, and at once when the agent stops cleanly
// (the lease is revoked). A lease lost while the agent runs (a partition
// longer than the TTL) is granted anew and the key written again.
type leaseKeeper struct {
	cli   *clientv3.Client
	key   string // full etcd key (the store prefix included)
	value []byte
	ttl   time.Duration
	log   *slog.Logger
	held  atomic.Bool
	// grants counts leases granted (1 in a quiet life).
	grants atomic.Int64
}

func newLeaseKeeper(cli *clientv3.Client, prefix, host, addr string, ttl time.Duration, log *slog.Logger) *leaseKeeper {
	v, _ := json.Marshal(livenessValue{Addr: addr, PID: os.Getpid(), Started: time.Now().Unix()})
	return &leaseKeeper{cli: cli, key: prefix + pool.LivenessKey(host), value: v, ttl: ttl, log: log}
}

// run keeps the lease until ctx ends, then revokes it.
func (k *leaseKeeper) run(ctx context.Context) {
	// Taking a lease is retried with backoff for as long as the agent runs.
	backoff := retry.Policy{Attempts: math.MaxInt32, BaseDelay: 200 * time.Millisecond, MaxDelay: max(k.ttl/3, time.Second)}
	for ctx.Err() == nil {
		var id clientv3.LeaseID
		err := retry.Do(ctx, backoff, func(error) bool { return true }, func(int) error {
			var err error
			if id, err = k.grant(ctx); err != nil {
				k.log.Warn("liveness: cannot take the lease; retrying", "err", err)
			}
			return err
		})
		if err != nil {
			return // ctx ended
		}
		k.held.Store(true)
		k.keep(ctx, id)
		k.held.Store(false)
		if ctx.Err() != nil {
			if err := revokeQuietly(k.cli, id); err != nil {
				k.log.Warn("liveness: revoking the lease on shutdown failed; the host is down after the TTL", "err", err)
			}
			return
		}
		k.log.Warn("liveness: lease lost (the store was out of reach longer than the TTL); taking a new one", "ttl", k.ttl)
	}
}

// grant takes a new lease and writes the liveness key on it.
func (k *leaseKeeper) grant(ctx context.Context) (clientv3.LeaseID, error) {
	ctx, cancel := context.WithTimeout(ctx, k.ttl)
	defer cancel()
	secs := int64((k.ttl + time.Second - 1) / time.Second)
	lease, err := k.cli.Grant(ctx, secs)
	if err != nil {
		return 0, fmt.Errorf("grant: %w", err)
	}
	if _, err := k.cli.Put(ctx, k.key, string(k.value), clientv3.WithLease(lease.ID)); err != nil {
		return 0, errors.Join(fmt.Errorf("put %s: %w", k.key, err), revokeQuietly(k.cli, lease.ID))
	}
	k.grants.Add(1)
	k.log.Info("liveness: lease held", "key", k.key, "ttl", k.ttl, "lease", fmt.Sprintf("%x", int64(lease.ID)))
	return lease.ID, nil
}

func revokeQuietly(cli *clientv3.Client, id clientv3.LeaseID) error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_, err := cli.Revoke(ctx, id)
	return err
}

// keep renews lease id until it is lost or ctx ends. The client's
// KeepAlive channel closes when renewals stop working; a renewal that has
// not come back within the TTL also counts as lost, since the server will
// have expired the lease by then.
func (k *leaseKeeper) keep(ctx context.Context, id clientv3.LeaseID) {
	kctx, cancel := context.WithCancel(ctx)
	defer cancel()
	ch, err := k.cli.KeepAlive(kctx, id)
	if err != nil {
		return
	}
	timer := time.NewTimer(k.ttl)
	defer timer.Stop()
	for {
		select {
		case resp, ok := <-ch:
			if !ok || resp == nil {
				return
			}
			if !timer.Stop() {
				<-timer.C
			}
			timer.Reset(time.Duration(resp.TTL) * time.Second)
		case <-timer.C:
			return
		case <-ctx.Done():
			return
		}
	}
}

// plainLiveness is liveness on a store without leases (the local store of
// a single host): the key is written once and deleted on a clean stop.
// Nothing judges a single host's peers, so nothing depends on expiry.
type plainLiveness struct {
	st    store.Store
	key   string
	value []byte
	held  atomic.Bool
}

func (p *plainLiveness) run(ctx context.Context, timeout time.Duration, log *slog.Logger) {
	write := func(ctx context.Context, ops ...store.Op) error {
		ctx, cancel := context.WithTimeout(ctx, timeout)
		defer cancel()
		return p.st.Commit(ctx, nil, ops)
	}
	if err := write(ctx, store.Put(p.key, p.value)); err != nil {
		log.Warn("liveness: cannot write the liveness key", "err", err)
	} else {
		p.held.Store(true)
	}
	<-ctx.Done()
	if err := write(context.Background(), store.Delete(p.key)); err != nil {
		log.Warn("liveness: cannot delete the liveness key on shutdown", "err", err)
	}
	p.held.Store(false)
}

// sleep waits d or until ctx ends.
func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
