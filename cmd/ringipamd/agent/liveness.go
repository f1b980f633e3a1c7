package agent

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"os"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/containernetworking/cni/pkg/types"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ringipam/ringipam/pkg/agentapi"
	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/retry"
	"github.com/ringipam/ringipam/pkg/store"
)

// livenessValue is what the liveness key holds: who keeps it, for
// operators, and which agent process (Instance, random per start): host
// names are unique (seed 002), so an agent writes the key only when it is
// absent or its own.
type livenessValue struct {
	Addr     string `json:"addr,omitempty"`
	PID      int    `json:"pid"`
	Started  int64  `json:"started"`
	Instance string `json:"instance,omitempty"`
}

// newLivenessValue is this agent process's liveness value.
func newLivenessValue(addr string) livenessValue {
	b := make([]byte, 8)
	_, _ = rand.Read(b)
	return livenessValue{Addr: addr, PID: os.Getpid(), Started: time.Now().Unix(), Instance: hex.EncodeToString(b)}
}

// NameTakenError: the host's liveness key is held by another running agent
// instance, so this agent may not use the host name.
type NameTakenError struct {
	Host   string
	Holder livenessValue
}

func (e *NameTakenError) Error() string {
	started := time.Unix(e.Holder.Started, 0).UTC().Format(time.RFC3339)
	return fmt.Sprintf("host name %q is in use by another running ringipamd (pid %d, started %s, addr %q): host names must be unique; "+
		"give this agent another --host, or stop the other one (its liveness key goes when it stops, or one lease TTL after it dies)",
		e.Host, e.Holder.PID, started, e.Holder.Addr)
}

// nameReport is how the liveness loops report a NameTakenError (everHeld:
// this agent held the name before), or, with err nil, that the name is
// held now.
type nameReport func(err *NameTakenError, everHeld bool)

// taken decides on a liveness key that exists: nil when it is this
// instance's (or unreadable, which no agent writes), else the error.
func taken(host string, raw []byte, self livenessValue, alive func(livenessValue) bool) *NameTakenError {
	var v livenessValue
	if json.Unmarshal(raw, &v) != nil || v.Instance == self.Instance || !alive(v) {
		return nil
	}
	return &NameTakenError{Host: host, Holder: v}
}

// leaseKeeper keeps this host's liveness key attached to an etcd lease that
// it renews (the client's KeepAlive): the key vanishes one TTL after the
// agent dies, whatever killed it, and at once when the agent stops cleanly
// (the lease is revoked). A lease lost while the agent runs (a partition
// longer than the TTL) is granted anew and the key written again.
type leaseKeeper struct {
	cli   *clientv3.Client
	host  string
	key   string // full etcd key (the store prefix included)
	self  livenessValue
	value []byte
	ttl   time.Duration
	log   *slog.Logger
	held  atomic.Bool
	// lost reports the key held by another instance (never nil).
	lost nameReport
	// grants counts leases granted (1 in a quiet life).
	grants atomic.Int64
}

func newLeaseKeeper(cli *clientv3.Client, prefix, host string, self livenessValue, ttl time.Duration, log *slog.Logger, lost nameReport) *leaseKeeper {
	v, _ := json.Marshal(self)
	return &leaseKeeper{cli: cli, host: host, key: prefix + pool.LivenessKey(host), self: self, value: v, ttl: ttl, log: log, lost: lost}
}

// run keeps the lease until ctx ends, then revokes it.
func (k *leaseKeeper) run(ctx context.Context) {
	// Taking a lease is retried with backoff for as long as the agent runs.
	backoff := retry.Policy{Attempts: math.MaxInt32, BaseDelay: 200 * time.Millisecond, MaxDelay: max(k.ttl/3, time.Second)}
	waited := false
	for ctx.Err() == nil {
		var id clientv3.LeaseID
		err := retry.Do(ctx, backoff, func(error) bool { return true }, func(int) error {
			var err error
			id, err = k.grant(ctx)
			var nt *NameTakenError
			switch {
			case errors.As(err, &nt) && !waited:
				// A holder that died without revoking (SIGKILL, OOM: this
				// very agent restarted in its container by kubelet or
				// systemd) keeps the key until its lease expires: wait
				// that long for it to go before calling the name taken.
				waited = true
				if k.waitReleased(ctx) {
					return err // gone: take it now
				}
				k.lost(nt, k.grants.Load() > 0)
			case errors.As(err, &nt):
				k.lost(nt, k.grants.Load() > 0)
			case err != nil:
				k.log.Warn("liveness: cannot take the lease; retrying", "err", err)
			}
			return err
		})
		if err != nil {
			return // ctx ended
		}
		k.held.Store(true)
		k.lost(nil, true)
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

// waitReleased waits up to ReleaseWait(ttl) for the liveness key to be
// absent (its holder's lease expired), reading it every half second; it
// reports whether it went. A live holder keeps renewing its lease and
// the key stays.
func (k *leaseKeeper) waitReleased(ctx context.Context) bool {
	ctx, cancel := context.WithTimeout(ctx, ReleaseWait(k.ttl))
	defer cancel()
	for {
		rctx, rcancel := context.WithTimeout(ctx, time.Second)
		resp, err := k.cli.Get(rctx, k.key, clientv3.WithCountOnly())
		rcancel()
		if err == nil && resp.Count == 0 {
			return true
		}
		if sleep(ctx, 500*time.Millisecond) != nil {
			return false
		}
	}
}

// ReleaseWait is how long an agent that finds its host's liveness key held
// by another instance waits for it to vanish before it gives up the name:
// one lease TTL and half of one more (the holder's lease, granted with
// this TTL, expires within one TTL of its last renewal).
func ReleaseWait(ttl time.Duration) time.Duration { return ttl + ttl/2 }

// grant takes a new lease and writes the liveness key on it.
func (k *leaseKeeper) grant(ctx context.Context) (clientv3.LeaseID, error) {
	ctx, cancel := context.WithTimeout(ctx, k.ttl)
	defer cancel()
	secs := int64((k.ttl + time.Second - 1) / time.Second)
	lease, err := k.cli.Grant(ctx, secs)
	if err != nil {
		return 0, fmt.Errorf("grant: %w", err)
	}
	// Create-if-absent; an existing key of this very instance (a lease
	// lost but not yet expired) is taken over; another live instance's
	// is not.
	put := clientv3.OpPut(k.key, string(k.value), clientv3.WithLease(lease.ID))
	resp, err := k.cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(k.key), "=", 0)).Then(put).Else(clientv3.OpGet(k.key)).Commit()
	if err != nil {
		return 0, errors.Join(fmt.Errorf("put %s: %w", k.key, err), revokeQuietly(k.cli, lease.ID))
	}
	if !resp.Succeeded {
		kvs := resp.Responses[0].GetResponseRange().Kvs
		if len(kvs) == 0 {
			return 0, errors.Join(fmt.Errorf("put %s: it vanished while read; retrying", k.key), revokeQuietly(k.cli, lease.ID))
		}
		if nt := taken(k.host, kvs[0].Value, k.self, func(livenessValue) bool { return true }); nt != nil {
			return 0, errors.Join(nt, revokeQuietly(k.cli, lease.ID))
		}
		r, err := k.cli.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(k.key), "=", kvs[0].ModRevision)).Then(put).Commit()
		if err == nil && !r.Succeeded {
			err = fmt.Errorf("it changed while read; retrying")
		}
		if err != nil {
			return 0, errors.Join(fmt.Errorf("put %s: %w", k.key, err), revokeQuietly(k.cli, lease.ID))
		}
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
// Nothing judges a single host's peers, so nothing depends on expiry. A
// key left by an agent that died is taken over when its process is gone.
type plainLiveness struct {
	st    store.Store
	host  string
	key   string
	self  livenessValue
	held  atomic.Bool
	lost  nameReport
	alive func(livenessValue) bool // nil: the process is running on this machine
}

func (p *plainLiveness) run(ctx context.Context, timeout time.Duration, log *slog.Logger) {
	value, _ := json.Marshal(p.self)
	alive := p.alive
	if alive == nil {
		alive = func(v livenessValue) bool { return v.PID > 0 && syscall.Kill(v.PID, 0) != syscall.ESRCH }
	}
	claim := func(ctx context.Context) error {
		ctx, cancel := context.WithTimeout(ctx, timeout)
		defer cancel()
		kvs, err := p.st.Get(ctx, p.key)
		if err != nil {
			return err
		}
		if kvs[0].Exists() {
			if nt := taken(p.host, kvs[0].Value, p.self, alive); nt != nil {
				return nt
			}
		}
		return p.st.Commit(ctx, []store.Cond{store.Unchanged(kvs[0])}, []store.Op{store.Put(p.key, value)})
	}
	err := claim(ctx)
	var nt *NameTakenError
	switch {
	case errors.As(err, &nt):
		p.lost(nt, false)
		return
	case err != nil:
		log.Warn("liveness: cannot write the liveness key", "err", err)
	default:
		p.held.Store(true)
		p.lost(nil, true)
	}
	<-ctx.Done()
	if !p.held.Load() {
		return
	}
	dctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	kvs, err := p.st.Get(dctx, p.key)
	if err == nil && kvs[0].Exists() && taken(p.host, kvs[0].Value, p.self, func(livenessValue) bool { return true }) == nil {
		err = p.st.Commit(dctx, []store.Cond{store.Unchanged(kvs[0])}, []store.Op{store.Delete(p.key)})
	}
	if err != nil {
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

// nameGuard serves the plugins' invocations through inner while this agent
// holds its host name; once another instance holds it, every invocation
// but DEL fails (STATUS included, so the runtime stops using the host):
// this host's ADDs would share that instance's ranges, and its GC could
// release that instance's containers.
type nameGuard struct {
	inner agentapi.Handler
	lost  func() bool
	host  string
}

// Serve implements agentapi.Handler.
func (g nameGuard) Serve(ctx context.Context, req *agentapi.Request) agentapi.Answer {
	if req.Command == "DEL" || !g.lost() {
		return g.inner.Serve(ctx, req)
	}
	msg := fmt.Sprintf("host %s: another ringipamd holds this host's name (its liveness key); this host's agent lost it. Host names must be unique: stop one of them", g.host)
	return agentapi.Answer{CNIError: types.NewError(types.ErrTryAgainLater, msg, "")}
}
