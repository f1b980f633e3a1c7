package pool

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ringipam/ringipam/pkg/store"
)

// The sweep of orphaned hosts, as the one elected host agent runs it
// (cmd/ringipamd) and the model checks run it (model_test.go): one code,
// so the checks check the product.
//
// Per host that is orphaned (down longer than orphanAfter; never this
// allocator's own host), one Sweeper.Sweep:
//
//  1. reclaims its addresses when something is left to take back (see
//     Sweep: its ranges, used counts or owners);
//  2. releases its published ports (PortReleaser, portalloc.ReleaseHost)
//     under the pool's ReclaimGuard: each release requires the liveness
//     key as read (absent), so a host that comes back mid-way keeps every
//     port not yet released;
//  3. a host found with nothing left to take back (no range, no count, no
//     owner, no port) is remembered and not read again while Hosts shows
//     it unchanged; after the retention (SweepOptions.Retention) its
//     records go: its host record, its status record and any host state
//     left, in one commit conditioned on all of them as read and on its
//     liveness key absent, so a host that came back is never touched.
//
// The retention is counted from the host's orphaning (its mark; a host
// never marked: from when it became orphaned, last seen + orphanAfter), and
// defaults to orphanAfter: a host that comes back within twice orphanAfter
// of its last sign of life still reads its orphaned mark and reports it.

// PortReleaser releases every published port of a gone host under guard
// (portalloc.Allocator's ReleaseHost): it stops, with an error, once the
// guard no longer holds.
type PortReleaser[R any] interface {
	ReleaseHost(ctx context.Context, host string, guard []store.Cond) ([]R, error)
}

// SweepOptions configure a Sweeper.
type SweepOptions struct {
	// OrphanAfter is how long a host must be down before it is
	// orphaned (<= 0: DefaultOrphanAfter).
	OrphanAfter time.Duration
	// Retention is how long a reclaimed host's records are kept after
	// its orphaning (<= 0: DefaultRetention(OrphanAfter)).
	Retention time.Duration
}

// DefaultRetention is how long a reclaimed host's records are kept after
// its orphaning: orphanAfter, so that a host that comes back within twice
// orphanAfter of its last sign of life (96 h at the default) still learns
// that it was orphaned. A host that comes back later starts afresh.
func DefaultRetention(orphanAfter time.Duration) time.Duration {
	if orphanAfter <= 0 {
		orphanAfter = DefaultOrphanAfter
	}
	return orphanAfter
}

// SweepReport is what one Sweeper.Sweep did.
type SweepReport struct {
	Reclaims []ReclaimReport
	// Ports counts, per host, the endpoints whose ports were released.
	Ports map[string]int
	// Back are the hosts that came back while their ports were released.
	Back []string
	// Removed are the hosts whose records went after the retention.
	Removed []string
	// Skipped counts the hosts known to have nothing left, not read again.
	Skipped int
}

// Sweeper sweeps orphaned hosts (see above). Its memory of the hosts with
// nothing left makes a sweep of a cluster whose orphans are all reclaimed
// cost one Hosts read. Not safe for concurrent use.
type Sweeper[R any] struct {
	Alloc *Allocator
	// Ports releases the published ports; nil: none.
	Ports   PortReleaser[R]
	Options SweepOptions
	done    map[string]sweptHost
}

// sweptHost is what a Sweeper remembers of a host with nothing left.
type sweptHost struct {
	orphaned time.Time // its orphaned mark when found so
	removed  bool      // its records are gone (or none was left)
}

// Sweep sweeps once: see the type's doc. Hosts that come back are skipped
// quietly; the errors of the others are joined.
func (s *Sweeper[R]) Sweep(ctx context.Context) (SweepReport, error) {
	a := s.Alloc
	orphanAfter := s.Options.OrphanAfter
	if orphanAfter <= 0 {
		orphanAfter = DefaultOrphanAfter
	}
	retention := s.Options.Retention
	if retention <= 0 {
		retention = DefaultRetention(orphanAfter)
	}
	if s.done == nil {
		s.done = map[string]sweptHost{}
	}
	rep := SweepReport{Ports: map[string]int{}}
	hosts, err := a.Hosts(ctx, orphanAfter)
	if err != nil {
		return rep, err
	}
	var errs []error
	known := map[string]bool{}
	for _, h := range hosts {
		known[h.Name] = true
		if h.State != HostOrphaned || h.Name == a.host {
			delete(s.done, h.Name)
			continue
		}
		empty := h.Ranges == 0 && h.Used == 0
		if d, ok := s.done[h.Name]; ok && empty && d.orphaned.Equal(h.OrphanedAt) {
			rep.Skipped++
			if !d.removed && s.due(h, orphanAfter, retention) {
				removed, err := s.remove(ctx, h)
				if err != nil {
					errs = append(errs, err)
					continue
				}
				d.removed = true
				s.done[h.Name] = d
				if removed {
					rep.Removed = append(rep.Removed, h.Name)
				}
			}
			continue
		}
		delete(s.done, h.Name)
		nothing, err := s.sweepHost(ctx, h, &rep)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if nothing && empty {
			s.done[h.Name] = sweptHost{orphaned: h.OrphanedAt}
		}
	}
	for name := range s.done {
		if !known[name] {
			delete(s.done, name)
		}
	}
	return rep, errors.Join(errs...)
}

// sweepHost reclaims what is left of orphaned host h and releases its
// ports; nothing: there was nothing to take back.
func (s *Sweeper[R]) sweepHost(ctx context.Context, h HostInfo, rep *SweepReport) (nothing bool, err error) {
	a := s.Alloc
	var reclaim, byIndex bool
	if !h.Agent && h.OrphanedAt.IsZero() && h.Ranges == 0 && h.Used == 0 && len(h.Pools) == 0 {
		// Known only by tombstones left in a ring (its records are gone
		// after the retention): reclaimed only for owners left.
		reclaim, err = a.ownersLeft(ctx, h.Name)
		byIndex = reclaim
	} else {
		reclaim, byIndex, err = a.sweepable(ctx, h)
	}
	if err != nil {
		return false, err
	}
	nothing = !reclaim
	if reclaim {
		r, err := a.Reclaim(ctx, h.Name, ReclaimOptions{})
		switch {
		case errors.Is(err, ErrHostLive):
			return false, nil // back
		case err != nil:
			return false, err
		}
		if !byIndex || !r.AlreadyWas || len(r.Unshared) > 0 {
			rep.Reclaims = append(rep.Reclaims, r)
		}
	}
	if s.Ports == nil {
		return nothing, nil
	}
	guard, err := a.ReclaimGuard(ctx, h.Name, a.broken.sweepForce)
	switch {
	case errors.Is(err, ErrHostLive):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("releasing the published ports of %s: %w", h.Name, err)
	}
	if a.broken.sweepNoGuard {
		guard = nil
	}
	rel, err := s.Ports.ReleaseHost(ctx, h.Name, guard)
	if n := len(rel); n > 0 {
		rep.Ports[h.Name] += n
		nothing = false
	}
	if err != nil {
		if back, lerr := a.isLive(ctx, h.Name); lerr == nil && back {
			rep.Back = append(rep.Back, h.Name)
			return false, nil
		}
		return false, fmt.Errorf("releasing the published ports of %s: %w", h.Name, err)
	}
	return nothing, nil
}

// due reports whether orphaned host h's retention is over.
func (s *Sweeper[R]) due(h HostInfo, orphanAfter, retention time.Duration) bool {
	since := h.OrphanedAt
	if since.IsZero() {
		if h.LastSeen.IsZero() {
			return true
		}
		since = h.LastSeen.Add(orphanAfter)
	}
	return s.Alloc.now().Sub(since) > retention
}

// remove deletes what is left of reclaimed host h's records (see the
// Sweeper's doc); removed is false when nothing was left or it came back.
func (s *Sweeper[R]) remove(ctx context.Context, h HostInfo) (removed bool, err error) {
	return s.Alloc.forgetHost(ctx, h.Name, h.Pools)
}

// isLive reports whether host's liveness key exists.
func (a *Allocator) isLive(ctx context.Context, host string) (bool, error) {
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	kvs, err := a.get(ctx, LivenessKey(host))
	if err != nil {
		return false, err
	}
	return kvs[0].Exists(), nil
}

// forgetHost deletes host's host record, status record and its state in
// pools, in one commit conditioned on each as read, on its liveness key
// absent and on its index of owners empty: a host that came back (its
// agent holds the key, or wrote either record, or allocated) is not
// touched. removed is false when there was nothing to delete or the host
// is back.
func (a *Allocator) forgetHost(ctx context.Context, host string, pools []string) (removed bool, err error) {
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	keys := []string{LivenessKey(host), hostRecordKey(host), statusKey(host)}
	for _, p := range pools {
		keys = append(keys, hostKey(p, host))
	}
	kvs, err := a.get(ctx, keys...)
	if err != nil || kvs[0].Exists() {
		return false, err // back
	}
	conds := []store.Cond{store.Unchanged(kvs[0])}
	var ops []store.Op
	for i, kv := range kvs[1:] {
		conds = append(conds, store.Unchanged(kv))
		if kv.Exists() {
			ops = append(ops, store.Delete(kv.Key))
			if i >= 2 { // a state in pools[i-2], and its free-space index key
				ops = append(ops, store.Delete(freeKey(pools[i-2], host)))
			}
		}
	}
	if len(ops) == 0 {
		return false, nil
	}
	idx := hostOwnersPrefix(host, "", "")
	conds = append(conds, store.AbsentRange(idx, store.PrefixEnd(idx)))
	// Not retried: a conflict is a host that came back, or changed;
	// the next sweep judges it again from what it reads then.
	if err := a.st.Commit(ctx, conds, ops); err != nil {
		if errors.Is(err, store.ErrConflict) {
			return false, nil
		}
		return false, err
	}
	return true, nil
}
