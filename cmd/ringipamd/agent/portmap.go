package agent

import (
	"context"
	"strings"
	"time"

	"github.com/ringipam/ringipam/pkg/cni/portmap"
	"github.com/ringipam/ringipam/pkg/portalloc"
)

// portmap-ingress's table on this host is the plugin's: its ADD installs an
// attachment's forwards after committing the attachment's ports, its DEL
// and GC remove them. What the plugin cannot see is the store losing an
// endpoint behind its back: a host that was orphaned and reclaimed while
// it was away comes back with forwards of ports the cluster has released
// (and may have given to another endpoint), which would keep serving the
// old containers until the runtime's DEL. The agent closes that gap: on
// start, whenever its copy of the host's index of its endpoints loses one
// (a watch on etcd), and on every resync it compares the table's
// attachments (their marks) with the endpoints that index names, and
// removes the forwards of every attachment this host no longer holds.
//
// A removal is decided under the attachment's own lock (the one its ADD
// and DEL hold, portmap.MarkLock), with the store read again there: an ADD
// commits the ports before it installs the forwards and holds the lock
// throughout, so under the lock an attachment with forwards either holds
// its record (kept) or has none and no ADD is under way (removed); an ADD
// that starts afterwards installs its forwards anew.

// portmapState is what the reconciliation remembers of its last pass.
type portmapState struct {
	held map[string]bool // marks of the endpoints this host held
	read time.Time       // when the table was last read; zero: never
}

// reconcilePortmap takes the endpoints this host holds from the copy of
// its endpoint index (p/i/<host>/, followed by a watch on etcd: no store
// read) and, when the agent has just started, when an endpoint left since
// the last pass, or on a resync (force), reads the table and removes the
// forwards of attachments this host does not hold (each decided under its
// lock with the store read again there: removeStale).
func (a *Agent) reconcilePortmap(ctx context.Context, s *portmapState, force bool) {
	held := a.heldFromCache()
	lost := false
	for m := range s.held {
		lost = lost || !held[m]
	}
	s.held = held
	if !lost && !force && !s.read.IsZero() {
		return
	}
	octx, cancel := a.op(ctx)
	marks, err := a.pm.Marks(octx)
	cancel()
	if err != nil {
		a.metrics.syncErrs.Inc()
		a.log.Warn("reading portmap-ingress's table failed", "err", err)
		return
	}
	s.read = a.now()
	for m := range marks {
		if held[m] || !strings.HasPrefix(m, portalloc.Kind+"/") {
			continue
		}
		a.removeStale(ctx, m)
	}
}

// heldFromCache are the marks of the attachments this host's endpoint
// index names, from its copy.
func (a *Agent) heldFromCache() map[string]bool {
	snap := a.caches.own.Snapshot()
	held := make(map[string]bool, len(snap.Entries))
	for _, e := range snap.Entries {
		if e.Err == nil {
			held[e.Value] = true
		}
	}
	return held
}

// heldMarks are the marks of the attachments this host holds in the store.
func (a *Agent) heldMarks(ctx context.Context) (map[string]bool, error) {
	octx, cancel := a.op(ctx)
	defer cancel()
	eps, err := a.ports.HostEndpoints(octx, a.cfg.Host, "")
	if err != nil {
		return nil, err // a corrupt record: decide nothing on a partial view
	}
	held := make(map[string]bool, len(eps))
	for id := range eps {
		held[portmap.Mark(id)] = true
	}
	return held, nil
}

// removeStale removes the forwards marked mark, under the attachment's lock,
// unless the store (read again under the lock) says this host holds it.
func (a *Agent) removeStale(ctx context.Context, mark string) {
	octx, cancel := a.op(ctx)
	defer cancel()
	lock := portmap.MarkLock(mark)
	unlock, err := a.locks.Lock(octx, lock)
	if err != nil {
		a.log.Warn("portmap-ingress: the forwards of an attachment this host does not hold wait for its lock", "mark", mark, "err", err)
		return
	}
	defer unlock()
	held, err := a.heldMarks(octx)
	if err != nil {
		a.storeError("portmap-endpoints", err)
		return
	}
	if held[mark] {
		return // an ADD finished meanwhile
	}
	if id, ok := portalloc.ParseEndpointID(mark); ok {
		// A record the index does not name (written by an older
		// portmap-ingress after the index was built) still counts.
		e, found, err := a.ports.Lookup(octx, id)
		if err != nil {
			a.storeError("portmap-endpoints", err)
			return
		}
		if found && e.Host == a.cfg.Host {
			return
		}
	}
	if err := a.pm.Remove(octx, mark); err != nil {
		a.metrics.syncErrs.Inc()
		a.log.Warn("removing forwards of an attachment this host no longer holds failed", "mark", mark, "err", err)
		return
	}
	_ = a.locks.Discard(lock) // as its DEL would; a file left is swept by the next GC
	a.metrics.stalePortmap.Inc()
	a.log.Warn("removed the forwards of an attachment this host no longer holds in the store (reclaimed while the host was away, or released elsewhere)", "mark", mark)
}
