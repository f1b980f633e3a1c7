package pool

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"time"

	"github.com/ringipam/ringipam/pkg/store"
)

// ErrHostLive: a host whose liveness key exists cannot be reclaimed (unless
// forced).
var ErrHostLive = errors.New("host is up")

// ReclaimOptions say what Reclaim does with a host's space.
type ReclaimOptions struct {
	// ToCaller gives the free space of the host's ranges to the calling
	// host at once (Weave's rmpeer); otherwise the ranges are tombstoned
	// and any host claims them as it needs space.
	ToCaller bool
	// Force reclaims a host even though its liveness key exists.
	Force bool
	// Leave is a host leaving on purpose (seed 002's `weave reset`): the
	// free space of each of its ranges goes to the owner of the nearest
	// range before it on the ring, unowned space between them staying
	// unowned (it stays tombstoned where that range is tombstoned, or
	// there is none), and the host is not marked orphaned. A host may
	// leave itself. Excludes ToCaller. Finding those owners reads the
	// pool's range keys once (a leave is rare).
	Leave bool
}

// ReclaimReport says what one Reclaim did. Counts are of what this call
// committed: of two concurrent reclaims each owner is counted by exactly one.
type ReclaimReport struct {
	Host       string
	Pools      int // pools whose ranges of the host were tombstoned now
	Released   int // owners released
	Handed     int // free holes given to the caller (ToCaller)
	Orphaned   time.Time
	AlreadyWas bool // the host had been reclaimed before (nothing of its old view was left)
	// TombstonedPools and ReleasedOwners name what Pools and Released count.
	TombstonedPools []string
	ReleasedOwners  []Allocation
	// Unshared are the shared owners (see Share) whose claim of the host
	// was dropped while other hosts keep them: not released.
	Unshared []Allocation
}

// Reclaim takes a host's space back (rmpeer, or orphaning by Sweep):
//
//  1. per pool, in one commit, its ranges are tombstoned and its host state
//     dropped, so from then on it cannot allocate from its old view (its
//     own allocations are conditioned on the ring and its host state);
//  2. every owner holding an address in a tombstoned range of the host is
//     released, one commit each (addresses of a reservation stay held for
//     the name as on any release, so a pod rescheduled elsewhere gets its
//     address back);
//  3. with ToCaller, the free holes of those ranges go to this allocator's
//     host (only free addresses change hands);
//  4. the host record is marked orphaned, for the host to learn when it
//     returns.
//
// Every commit requires the host's liveness key absent (unless Force), so a
// host that comes back mid-way is not touched further. Owners the host
// allocated after step 1 lie in new ranges and are never released. Reclaim
// is idempotent and safe to run from several processes at once.
func (a *Allocator) Reclaim(ctx context.Context, host string, opt ReclaimOptions) (ReclaimReport, error) {
	if err := validName("host", host); err != nil {
		return ReclaimReport{}, err
	}
	if host == a.host && !opt.Leave {
		return ReclaimReport{}, fmt.Errorf("%w: a host cannot reclaim itself (%s); it may leave", ErrInvalid, host)
	}
	if opt.Leave && opt.ToCaller {
		return ReclaimReport{}, fmt.Errorf("%w: a leaving host's space goes to its neighbours on the ring, not to the caller", ErrInvalid)
	}
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	rep := ReclaimReport{Host: host}
	// Conditions every commit carries: the liveness key as read.
	guard, err := a.ReclaimGuard(ctx, host, opt.Force)
	if err != nil {
		return rep, err
	}
	if a.broken.noLiveCond {
		guard = nil
	}
	defs, err := a.st.Scan(ctx, prefixDef, store.PrefixEnd(prefixDef), 0)
	if err != nil {
		return rep, err
	}
	var pools []string
	for _, kv := range defs {
		pools = append(pools, strings.TrimPrefix(kv.Key, prefixDef))
	}
	// 1. Fence: tombstone and drop the host state, pool by pool.
	fenced := map[string][]span{}
	for _, p := range pools {
		changed := false
		err := a.run(ctx, func(int) error {
			for {
				done, tombed, err := a.tombstoneBatch(ctx, p, host, guard)
				if err != nil {
					return err
				}
				if len(tombed) > 0 {
					changed = true
					fenced[p] = append(fenced[p], tombed...)
				}
				if done {
					return nil
				}
			}
		})
		if err != nil {
			return rep, fmt.Errorf("tombstoning %s in pool %s: %w", host, p, err)
		}
		if changed {
			rep.Pools++
			rep.TombstonedPools = append(rep.TombstonedPools, p)
		}
	}
	// 2. Release the owners of its old view (found through its index).
	held, _, err := a.hostOwners(ctx, host, "", "")
	if err != nil {
		return rep, err
	}
	for _, h := range held {
		rec := h.rec
		if len(without(rec.holders(), host)) > 0 {
			// A shared owner other hosts' networks still reserve: only
			// this host's claim goes.
			dropped, err := a.reclaimClaim(ctx, h, host, guard)
			if err != nil {
				return rep, fmt.Errorf("dropping %s's claim on %s: %w", host, rec.Owner, err)
			}
			if dropped {
				rep.Unshared = append(rep.Unshared, rec)
			}
			continue
		}
		stale, err := a.inTombstone(ctx, host, rec)
		if err != nil {
			return rep, err
		}
		if !stale {
			continue
		}
		released := false
		err = a.run(ctx, func(attempt int) error {
			released = false
			cur := h.kv
			if attempt > 0 {
				got, err := a.st.Get(ctx, cur.Key)
				if err != nil {
					return err
				}
				cur = got[0]
			}
			if !cur.Exists() {
				return nil // released by someone else meanwhile
			}
			ok, err := a.releaseOrphan(ctx, rec.Owner, cur, guard)
			released = ok
			return err
		})
		if err != nil {
			return rep, fmt.Errorf("releasing %s of host %s: %w", rec.Owner, host, err)
		}
		if released {
			rep.Released++
			rep.ReleasedOwners = append(rep.ReleasedOwners, rec)
		}
	}
	// 3. Hand the free space over.
	if opt.ToCaller || opt.Leave {
		for _, p := range pools {
			n, err := a.handOver(ctx, p, host, opt.Leave, guard, fenced[p])
			if err != nil {
				return rep, fmt.Errorf("handing %s's space in pool %s to %s: %w", host, p, a.host, err)
			}
			rep.Handed += n
		}
	}
	// 4. Mark the host orphaned (not a host that left on purpose).
	if opt.Leave {
		return rep, nil
	}
	err = a.run(ctx, func(int) error {
		kvs, err := a.st.Get(ctx, hostRecordKey(host))
		if err != nil {
			return err
		}
		rec, err := decodeRecord(kvs[0])
		if err != nil {
			return err
		}
		if rec.Orphaned != 0 && rep.Pools == 0 && rep.Released == 0 {
			rep.AlreadyWas = true
			rep.Orphaned = time.Unix(rec.Orphaned, 0)
			return nil
		}
		if rec.Orphaned == 0 {
			rec.Orphaned = a.now().Unix()
		}
		rec.Reclaimed += rep.Released
		rep.Orphaned = time.Unix(rec.Orphaned, 0)
		b, _ := json.Marshal(rec)
		return a.st.Commit(ctx, append([]store.Cond{store.Unchanged(kvs[0])}, guard...), []store.Op{store.Put(kvs[0].Key, b)})
	})
	return rep, err
}

// Sweep reclaims (tombstoning their ranges) every host that is down longer
// than orphanAfter and still has something to take back. Several agents may
// sweep at once: each owner is released by exactly one of them.
func (a *Allocator) Sweep(ctx context.Context, orphanAfter time.Duration) ([]ReclaimReport, error) {
	hosts, err := a.Hosts(ctx, orphanAfter)
	if err != nil {
		return nil, err
	}
	var out []ReclaimReport
	var errs []error
	for _, h := range hosts {
		ok, byIndex, err := a.sweepable(ctx, h)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if !ok {
			continue // not orphaned, or reclaimed before with nothing new
		}
		rep, err := a.Reclaim(ctx, h.Name, ReclaimOptions{})
		if err != nil {
			if !errors.Is(err, ErrHostLive) {
				errs = append(errs, err)
			}
			continue
		}
		if byIndex && rep.AlreadyWas && len(rep.Unshared) == 0 {
			// Its owners left are none of its reclaim's (they lie
			// outside its tombstoned ranges): nothing taken, no report.
			continue
		}
		out = append(out, rep)
	}
	return out, errors.Join(errs...)
}

// reclaimClaim drops host's claim on the shared owner h (read through the
// host's index) that other holders keep, reading it again after a conflict.
// dropped is false when the claim was gone already.
func (a *Allocator) reclaimClaim(ctx context.Context, h ownerRead, host string, guard []store.Cond) (dropped bool, err error) {
	err = a.run(ctx, func(attempt int) error {
		dropped = false
		r := h
		if attempt > 0 {
			got, err := a.st.Get(ctx, h.kv.Key)
			if err != nil {
				return err
			}
			var ok bool
			if r, ok, err = readOwner(h.owner, got[0]); err != nil || !ok || !r.rec.HeldBy(host) {
				return err
			}
		}
		if len(without(r.rec.holders(), host)) == 0 {
			// The others unshared meanwhile: the next sweep releases it.
			return nil
		}
		if err := a.dropHolder(ctx, r, host, releaseMode{reclaim: true, guard: guard}); err != nil {
			return err
		}
		dropped = true
		return nil
	})
	return dropped, err
}

// maxTombBatch bounds the ranges one tombstoning commit changes (each a
// write and a condition), far below store.MaxOps.
const maxTombBatch = 32

// tombstoneBatch tombstones up to maxTombBatch of host's ranges in pool,
// as its state lists them, and takes them off the state, in one commit
// conditioned on the state and the range keys; the last batch deletes
// the state (done). Between batches the host's state and its range keys
// agree, as after every commit. tombed are the ranges tombstoned now.
func (a *Allocator) tombstoneBatch(ctx context.Context, pool, host string, guard []store.Cond) (done bool, tombed []span, err error) {
	kvs, err := a.st.Get(ctx, defKey(pool), hostKey(pool, host))
	if err != nil {
		return false, nil, err
	}
	if !kvs[1].Exists() {
		return true, nil, nil
	}
	def, err := decodeDef(pool, kvs[0])
	if err != nil {
		return false, nil, err
	}
	t := &poolTxn{name: pool, def: def, hostKV: kvs[1]}
	if err := decodeHostState(kvs[1].Value, &t.host); err != nil {
		return false, nil, fmt.Errorf("pool %s host %s: corrupt state: %w", pool, host, err)
	}
	if err := (&Allocator{st: a.st, host: host}).repairState(ctx, t); err != nil {
		return false, nil, err
	}
	tx := a.newRingTxn(pool, def)
	tx.own(host, kvs[1], &t.host)
	spans := t.host.spans()
	for _, s := range spans[:min(len(spans), maxTombBatch)] {
		r, held, _, err := tx.at(ctx, s.lo)
		if err != nil {
			return false, nil, err
		}
		if held && r.span == s && r.host == host && !r.tomb {
			if err := tx.assign(ctx, r, s, host, true); err != nil {
				return false, nil, err
			}
			tombed = append(tombed, s)
		} else {
			t.host.removeSpan(s, def.is4()) // not its range after all
		}
	}
	conds, ops := tx.finish()
	conds = append(append(conds, store.Unchanged(kvs[1])), guard...)
	done = len(t.host.Ranges) == 0
	if done {
		ops = append(ops, deleteHostState(pool, host)...)
	} else {
		ops = append(ops, putHostState(pool, host, &t.host)...)
	}
	if err := a.st.Commit(ctx, conds, ops); err != nil {
		return false, nil, err
	}
	return done, tombed, nil
}

// rangeAt returns the range of pool holding addr, if any (one read).
func (a *Allocator) rangeAt(ctx context.Context, pool string, addr netip.Addr) (rangeKV, bool, error) {
	v, is4 := toU128(addr), addr.Is4()
	kvs, err := a.st.Scan(ctx, rangeKey(pool, v, is4), store.PrefixEnd(rangePrefix(pool)), 1)
	if err != nil || len(kvs) == 0 {
		return rangeKV{}, false, err
	}
	r, err := decodeRangeKV(kvs[0], is4)
	if err != nil {
		return rangeKV{}, false, fmt.Errorf("pool %s: %w", pool, err)
	}
	return r, r.lo.cmp(v) <= 0, nil
}

// inTombstone reports whether rec holds an address in a tombstoned range of
// host (the owner belongs to the host's old view): one read per address.
func (a *Allocator) inTombstone(ctx context.Context, host string, rec Allocation) (bool, error) {
	for _, x := range rec.Addrs {
		r, held, err := a.rangeAt(ctx, x.Pool, x.Addr)
		if err != nil {
			return false, err
		}
		if held && r.host == host && r.tomb {
			return true, nil
		}
	}
	return false, nil
}

// releaseOrphan releases one owner of a reclaimed host: its record, its
// index key and its address keys go (or become holds for its reservation),
// in one commit conditioned on the record and on guard. The host's state
// was dropped by the tombstoning, so no count is kept.
func (a *Allocator) releaseOrphan(ctx context.Context, owner Owner, ownerKV store.KV, guard []store.Cond) (bool, error) {
	r, ok, err := readOwner(owner, ownerKV)
	if err != nil || !ok {
		return false, err
	}
	known := map[string]store.KV{ownerKV.Key: ownerKV}
	if _, err := a.releaseRecords(ctx, []ownerRead{r}, known, releaseMode{reclaim: true, guard: guard}); err != nil {
		return false, err
	}
	return true, nil
}

// maxHandBatch bounds the free holes one commit of handOver gives away
// (each a few range keys), far below store.MaxOps.
const maxHandBatch = 16

// handOver gives every free hole of host's tombstoned ranges in pool to this
// allocator's host, or with toPrevious to the live owner of the nearest
// range before each (none: it stays tombstoned), in commits of at most
// maxHandBatch holes conditioned on the range keys and the heirs' states.
// Addresses still held there (holds of reservations) stay tombstoned.
// known are the host's ranges the fence tombstoned now; without them
// (a reclaim run again) every range key of the pool is read.
func (a *Allocator) handOver(ctx context.Context, pool, host string, toPrevious bool, guard []store.Cond, known []span) (int, error) {
	handed := 0
	err := a.run(ctx, func(int) error {
		kvs, err := a.st.Get(ctx, defKey(pool))
		if err != nil {
			return err
		}
		def, err := decodeDef(pool, kvs[0])
		if err != nil {
			return err
		}
		is4 := def.is4()
		tombs := known
		var rs []rangeKV
		if tombs == nil || toPrevious {
			if rs, err = a.scanRanges(ctx, pool, is4); err != nil {
				return err
			}
		}
		if tombs == nil {
			for _, r := range rs {
				if r.host == host && r.tomb {
					tombs = append(tombs, r.span)
				}
			}
		}
		for _, s := range tombs {
			heir := a.host
			if toPrevious {
				// The owner of the nearest range before it on the ring
				// (unowned space between them stays unowned).
				heir = ""
				for _, r := range rs {
					if r.hi.cmp(s.lo) >= 0 {
						break
					}
					heir = ""
					if !r.tomb && r.host != host {
						heir = r.host
					}
				}
			}
			if heir == "" {
				continue
			}
			for {
				tx := a.newRingTxn(pool, def)
				n, err := a.handOverSome(ctx, tx, s, host, heir)
				if err != nil {
					return err
				}
				if n == 0 {
					break
				}
				conds, ops := tx.finish()
				if err := a.st.Commit(ctx, append(conds, guard...), ops); err != nil {
					return err
				}
				handed += n
			}
		}
		return nil
	})
	return handed, err
}

// handOverSome gives up to maxHandBatch free holes of host's tombstoned
// ranges inside s to heir, in tx, and returns how many.
func (a *Allocator) handOverSome(ctx context.Context, tx *ringTxn, s span, host, heir string) (int, error) {
	n := 0
	v := s.lo
	for n < maxHandBatch {
		r, held, ok, err := tx.at(ctx, v)
		if err != nil {
			return 0, err
		}
		if !ok || r.lo.cmp(s.hi) > 0 {
			return n, nil
		}
		if !held {
			v = r.lo
			continue
		}
		if r.host == host && r.tomb {
			held, err := a.st.Scan(ctx, addrKey(tx.pool, r.lo, tx.is4), addrKeysEnd(tx.pool, r.hi, tx.is4), 0)
			if err != nil {
				return 0, err
			}
			var holes []span
			cur, done := r.lo, false
			for _, kv := range held {
				k, ok := parseAddrKey(kv.Key)
				if !ok {
					continue
				}
				if k.cmp(cur) > 0 {
					holes = append(holes, span{cur, k.dec()})
				}
				if k == r.hi {
					done = true
					break
				}
				cur = k.inc()
			}
			if !done {
				holes = append(holes, span{cur, r.hi})
			}
			for _, h := range holes {
				if n == maxHandBatch {
					return n, nil
				}
				cur, _, _, err := tx.at(ctx, h.lo)
				if err != nil {
					return 0, err
				}
				if err := tx.assign(ctx, cur, h, heir, false); err != nil {
					return 0, err
				}
				n++
			}
		}
		if r.hi.cmp(s.hi) >= 0 {
			return n, nil
		}
		v = r.hi.inc()
	}
	return n, nil
}
