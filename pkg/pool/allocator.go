package pool

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"time"

	"github.com/ringipam/ringipam/pkg/retry"
	"github.com/ringipam/ringipam/pkg/store"
)

// Allocator allocates and releases addresses for one host on a shared store.
// It is safe for concurrent use; goroutines of one process that allocate in
// the same pool are serialised in-process so they do not conflict in the
// store. Every method honours ctx's deadline and adds its own (Timeout) if
// ctx has none.
type Allocator struct {
	st      store.Store
	host    string
	policy  retry.Policy
	timeout time.Duration
	now     func() time.Time
	locks   keyedMutex
	hostLk  HostLocker
	hold    time.Duration
	notes   NoteKeeper
	// seen: this allocator serves the host's verbs and keeps its
	// last-seen time fresh (WithLastSeen).
	seen bool
	// seenEvery is how stale the heartbeat lets the status record's
	// last-seen time get (WithSeenEvery; 0: every heartbeat writes it).
	seenEvery time.Duration
	stats     Stats
	// layoutOK is set once a read saw this code's store layout, so later
	// reads need not ask again (see get).
	layoutOK atomic.Bool
	// broken is always the zero value in the product; the model checks
	// (model_test.go) switch one guard off at a time to show they catch it.
	broken faults
}

// faults are the broken variants of the ring and reclaim protocols, each
// one guard switched off (as portalloc.Rules switches off the corrections
// of seed 000). The zero value is the product; only tests set a field.
type faults struct {
	noRingCond  bool // claims and moves commit without the range keys' conditions (revisions, absent ranges)
	noHostCond  bool // allocations and releases commit without requiring the host state unchanged
	noLiveCond  bool // reclaim commits without requiring the liveness key as read
	noRangeCond bool // a claim of a live host's space commits without its two guards: no address in the space, the donor's state unchanged
	ignoreTombs bool // tombstones are ignored: a host's tombstoned ranges are its own, a tombstoned range is claimed whole
	// The sweeper's (Sweeper) release of an orphaned host's published
	// ports: with a forced guard (the liveness key as read, even
	// present), or with no guard at all.
	sweepForce   bool
	sweepNoGuard bool
}

// DefaultReservationHold is how long a released address stays held for its
// reservation name unless WithReservationHold says otherwise.
const DefaultReservationHold = 10 * time.Minute

// WithReservationHold sets how long an address released by an owner with a
// reservation name stays held for that name: skipped by dynamic allocation,
// refused to other owners' static requests, given back to the same name.
// Zero frees such addresses at once (the name is still remembered, as a
// preference).
func WithReservationHold(d time.Duration) Option { return func(a *Allocator) { a.hold = max(d, 0) } }

// HostLocker serialises the allocators of one host across processes (see
// pkg/hostlock). Lock waits until ctx ends and returns the release function.
type HostLocker interface {
	Lock(ctx context.Context, name string) (func(), error)
}

// WithHostLock makes every change to a pool on this host hold l's lock for
// that pool, so that concurrent processes on one host queue instead of
// conflicting in the store.
func WithHostLock(l HostLocker) Option { return func(a *Allocator) { a.hostLk = l } }

// WithLastSeen says the allocator serves its host's own verbs (the CNI
// plugin, the Docker driver): each call that reads the host's record (see
// LastSeenEvery) keeps the host's last-seen time fresh. Without it (ringctl,
// the agent, tools acting on a host's behalf) nothing refreshes it.
func WithLastSeen() Option { return func(a *Allocator) { a.seen = true } }

// WithSeenEvery makes Heartbeat write the status record's last-seen time
// only when it is older than d (the host agent: SeenEvery(orphanAfter));
// without it every heartbeat writes it.
func WithSeenEvery(d time.Duration) Option { return func(a *Allocator) { a.seenEvery = max(d, 0) } }

// Option configures an Allocator.
type Option func(*Allocator)

// WithRetry sets the retry policy for store conflicts.
func WithRetry(p retry.Policy) Option { return func(a *Allocator) { a.policy = p } }

// WithTimeout sets the deadline each call gets when its context has none.
func WithTimeout(d time.Duration) Option { return func(a *Allocator) { a.timeout = d } }

// utcNow is the default clock: timestamps in the store (the history's
// events) are written in UTC, the same on every host of a cluster whatever
// its time zone (and a plugin process never reads the zone database).
func utcNow() time.Time { return time.Now().UTC() }

// WithClock sets the clock used for timestamps (tests).
func WithClock(now func() time.Time) Option { return func(a *Allocator) { a.now = now } }

// New returns an Allocator for host on st. host must be a stable name.
func New(st store.Store, host string, opts ...Option) (*Allocator, error) {
	if err := validName("host", host); err != nil {
		return nil, err
	}
	a := &Allocator{st: st, host: host, policy: retry.Default, timeout: 30 * time.Second, now: utcNow, hold: DefaultReservationHold}
	for _, o := range opts {
		o(a)
	}
	return a, nil
}

// Host returns the name of the host this allocator allocates for.
func (a *Allocator) Host() string { return a.host }

// Store returns the store the allocator works on.
func (a *Allocator) Store() store.Store { return a.st }

// Stats counts store conflicts seen by this allocator.
func (a *Allocator) Stats() StatsSnapshot { return a.stats.snapshot() }

func (a *Allocator) ctx(ctx context.Context) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok {
		return context.WithCancel(ctx)
	}
	return context.WithTimeout(ctx, a.timeout)
}

// run runs op under the bounded retry policy and maps exhaustion to
// ErrTryAgain. It retries store conflicts, and also an unavailable store
// while ctx has time left: a commit that timed out may or may not have been
// applied (etcd cannot say), and every operation run here is idempotent
// (allocation per owner, release of a record read afresh), so trying again
// within the caller's deadline turns an ambiguous outcome into a definite
// one. When the deadline is spent the last error is returned, wrapping
// store.ErrUnavailable and the context's error.
func (a *Allocator) run(ctx context.Context, op func(attempt int) error) error {
	err := retry.Do(ctx, a.policy, func(err error) bool {
		switch {
		case errors.Is(err, store.ErrConflict):
			a.stats.conflict()
			return true
		case errors.Is(err, store.ErrUnavailable):
			a.stats.unavailable.Add(1)
			return ctx.Err() == nil
		}
		return false
	}, op)
	if errors.Is(err, retry.ErrExhausted) {
		return errors.Join(ErrTryAgain, err)
	}
	return err
}

// lockPools serialises this host's work on pools: in-process first, then
// across processes. A store that can be held (storeHolder: the local
// store, whose file lock excludes every other process from the hold to
// the commit) is held, and that is the whole cross-process lock: a host
// lock on top would only cost its file. Any other store takes the
// HostLocker's locks, when one is set (names in sorted order).
func (a *Allocator) lockPools(ctx context.Context, pools []string) (func(), error) {
	unlock, err := a.locks.lock(ctx, pools...)
	if err != nil {
		return nil, err
	}
	if holder, ok := a.st.(storeHolder); ok {
		release, err := holder.Hold(ctx)
		if err != nil {
			unlock()
			return nil, fmt.Errorf("holding the store: %w", err)
		}
		return func() { release(); unlock() }, nil
	}
	if a.hostLk == nil {
		return unlock, nil
	}
	releases := []func(){unlock}
	undo := func() {
		for i := len(releases) - 1; i >= 0; i-- {
			releases[i]()
		}
	}
	names := slices.Clone(pools)
	slices.Sort(names)
	for _, n := range slices.Compact(names) {
		// One lock per (pool, host): hosts simulated on one machine, or a
		// lock directory shared by mistake, never serialise each other.
		release, err := a.hostLk.Lock(ctx, n+"@"+a.host)
		if err != nil {
			undo()
			return nil, fmt.Errorf("%w: host lock for pool %s: %w", ErrTryAgain, n, err)
		}
		releases = append(releases, release)
	}
	return undo, nil
}

// storeHolder is a store that can keep what one operation needs open across
// its calls (the local store's file, opened and locked once for the reads
// and the commit of an allocation instead of once per call).
type storeHolder interface {
	Hold(ctx context.Context) (release func(), err error)
}
