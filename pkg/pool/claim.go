package pool

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/ringipam/ringipam/pkg/store"
)

// maxRandomBlocks bounds the random aligned blocks a claim of unowned
// space tries (one single-key read each) before it scans the ranges for
// a gap.
const maxRandomBlocks = 8

// planClaim gives this host more of t's pool, in t's ring transaction:
// the allocation that needed the space commits it together with the new
// address, so claimed space cannot be taken away before it is used. In
// order of preference:
//  1. unowned space: an aligned block (blockSize) that holds no range,
//     the pool's first block, then up to maxRandomBlocks pseudo-random
//     ones (blockAddr: hosts that start together claim different blocks,
//     as with Calico's random block search), each found with one
//     single-key read;
//     failing that, the first gap after a pseudo-random position, read
//     by at most two pages of range keys (claimNearGap), cut to its
//     aligned block (claimGap says why that is safe);
//  2. a tombstoned range the tombstone index names that holds no address
//     any more, whole; else the largest free hole of those ranges;
//  3. a range of a live host the free-space index names (at most
//     maxIndexedDonors of them, the one with the most free addresses
//     first) that holds no address, whole; else the upper half of its
//     largest free hole (only free addresses change hands);
//  4. the last resort (claimLastResort): cases 1 to 3 over every range
//     key and every host state of the pool. Only a claim the indexes
//     could not serve gets there: a full pool always does.
//
// In cases 3 and 4 the donor is alive and may commit an allocation in the space
// given between this read and the claim's commit; the claim rewrites the
// donor's state (its ranges), conditioned on its revision, which any such
// allocation changes, and it also requires that no address key exists in
// the space given (noAddrIn, which the scans that found it free read):
// two guards, each enough alone (the broken variant noRangeCond drops
// both). No address ever lies in a range its host does not own, not even
// briefly, and no step after the commit is needed. Cases 1 and 2 need no
// such condition: an address is created in unowned or tombstoned space
// only by a commit that changes its range keys (a static request moves
// its address to its host), and those keys are conditions.
//
// With no free address anywhere it returns a *CapacityError.
func (a *Allocator) planClaim(ctx context.Context, t *poolTxn) error {
	pool, def, tx := t.name, t.def, t.ringTxn(a)
	segs := dynamicSegmentsOf(def)
	a.stats.claims.Add(1)
	if len(segs) == 0 {
		return &CapacityError{Pool: pool, Capacity: "0"}
	}
	// 1. Unowned space, by aligned blocks.
	// A host's first claim tries the pool's first block, then its
	// pseudo-random ones; its k-th claim tries the k-th group of
	// maxRandomBlocks (fresh positions: the earlier ones are taken, often
	// by itself).
	var tried []u128
	claimNo := len(t.host.Ranges)
	for i := 0; i <= maxRandomBlocks; i++ {
		v := segs[0].lo
		switch {
		case i > 0:
			v = blockAddr(segs, a.host, pool, claimNo*maxRandomBlocks+i)
		case claimNo > 0:
			continue
		}
		b, c := tx.blockOf(v)
		if slices.Contains(tried, b.lo) || len(clip(c, segs)) == 0 {
			continue
		}
		tried = append(tried, b.lo)
		succ, ok, err := tx.next(ctx, c.lo)
		if err != nil {
			return err
		}
		if !ok || succ.lo.cmp(c.hi) > 0 {
			return tx.claimGap(ctx, c, b, succ, ok, a.host)
		}
	}
	// 1b. The first gap near a pseudo-random position, by a bounded
	// paged read of the range keys (not all of them).
	if done, err := a.claimNearGap(ctx, tx, segs, blockAddr(segs, a.host, pool, -1-claimNo)); done || err != nil {
		return err
	}
	// 2. Tombstoned space the tombstone index names.
	if done, err := a.claimIndexedTomb(ctx, tx, segs, blockAddr(segs, a.host, pool, -2-claimNo)); done || err != nil {
		return err
	}
	// 3. A donor the free-space index names.
	asked := map[string]bool{}
	if done, err := a.donateIndexed(ctx, tx, segs, asked); done || err != nil {
		return err
	}
	// The last resort, when the indexes offered nothing (a full pool,
	// or free space only hosts or tombstones the indexes do not list):
	// every range key and every host state of the pool, as before the
	// indexes.
	return a.claimLastResort(ctx, tx, segs, asked)
}

// claimLastResort is planClaim's search of the whole pool: the first gap
// of the ring, then its tombstoned ranges, then every live host as a
// donor (those in skip excepted: they were tried). It reads every range
// key and every host state of the pool; only a claim that the indexes
// could not serve gets here, and a full pool always does before it
// answers a *CapacityError.
func (a *Allocator) claimLastResort(ctx context.Context, tx *ringTxn, segs []span, skip map[string]bool) error {
	pool, is4 := tx.pool, tx.is4
	a.stats.lastResort.Add(1)
	rs, err := a.scanRanges(ctx, pool, is4)
	if err != nil {
		return err
	}
	rs = tx.overlay(rs)
	prev, open := tx.space.lo, true
	var tombs []rangeKV
	for i := 0; ; i++ {
		var gap span
		hasGap := false
		switch {
		case i < len(rs) && open && rs[i].lo.cmp(prev) > 0:
			gap, hasGap = span{prev, rs[i].lo.dec()}, true
		case i == len(rs) && open:
			gap, hasGap = span{prev, tx.space.hi}, true
		}
		if free := clip(gap, segs); hasGap && len(free) > 0 {
			b, c := tx.blockOf(free[0].lo)
			c = span{maxU(c.lo, gap.lo), minU(c.hi, gap.hi)}
			succ, ok, err := tx.next(ctx, c.lo)
			if err != nil {
				return err
			}
			if ok && succ.lo.cmp(c.hi) <= 0 {
				return fmt.Errorf("%w: pool %s: space was claimed meanwhile", store.ErrConflict, pool)
			}
			return tx.claimGap(ctx, c, b, succ, ok, a.host)
		}
		if i == len(rs) {
			break
		}
		if rs[i].tomb && len(clip(rs[i].span, segs)) > 0 {
			tombs = append(tombs, rs[i])
		}
		open = rs[i].hi.cmp(tx.space.hi) < 0
		if open {
			prev = rs[i].hi.inc()
		}
	}
	// 2. Tombstoned space: an empty range whole, else the largest free
	// hole of the tombstoned ranges (nobody allocates there any more, so
	// there is no donor to race). Only its free addresses change hands;
	// the held ones stay tombstoned until they are released.
	var tombSpans []span
	for _, r := range tombs {
		held, err := a.st.Scan(ctx, addrKey(pool, r.lo, is4), addrKeysEnd(pool, r.hi, is4), 1)
		if err != nil {
			return err
		}
		if len(held) == 0 || a.broken.ignoreTombs {
			return a.takeFrom(ctx, tx, r.span, r.lo)
		}
		tombSpans = append(tombSpans, clip(r.span, segs)...)
	}
	if len(tombSpans) > 0 {
		hole, ok, err := a.largestHole(ctx, pool, is4, tombSpans, netip.Addr{})
		if err != nil {
			return err
		}
		if ok {
			return a.takeFrom(ctx, tx, hole, hole.lo)
		}
	}

	// 3. Donation: the live host with the most free space.
	hostKVs, err := a.st.Scan(ctx, hostPrefix(pool), store.PrefixEnd(hostPrefix(pool)), 0)
	if err != nil {
		return err
	}
	var donors []donor
	var used uint64
	for _, kv := range hostKVs {
		d, err := tx.donorOf(kv.Key[len(hostPrefix(pool)):], kv, segs)
		if err != nil {
			return err
		}
		used += d.state.Used
		if d.host == a.host || skip[d.host] || d.free == (u128{}) {
			continue
		}
		donors = append(donors, d)
	}
	sortDonors(donors)
	for _, d := range donors {
		if done, err := a.tryDonor(ctx, tx, segs, d.host, d.kv, d.state); done || err != nil {
			return err
		}
	}
	return &CapacityError{Pool: pool, Used: used, Capacity: capacityOf(segs).String()}
}

// donor is a host of the pool that may give free space: its state as read
// (or as this commit already changed it) and how many of its addresses in
// the dynamic segments are free.
type donor struct {
	host  string
	kv    store.KV
	state hostState
	free  u128
}

// donorOf decodes kv, host's state of tx's pool, as a donor. A state this
// commit changed already (an earlier claim of the same request) is
// planned on as changed. free is zero when it has nothing free in segs.
func (tx *ringTxn) donorOf(host string, kv store.KV, segs []span) (donor, error) {
	d := donor{host: host, kv: kv}
	if err := decodeHostState(kv.Value, &d.state); err != nil {
		return donor{}, fmt.Errorf("pool %s host %s: corrupt state: %w", tx.pool, host, err)
	}
	if he, ok := tx.hosts[host]; ok && he.st != nil && !he.own {
		d.state, d.kv = *he.st, he.kv
	}
	if c := capacityOf(clipAll(d.state.spans(), segs)); c.cmp(u128{lo: d.state.Used}) > 0 {
		d.free = c.sub(u128{lo: d.state.Used})
	}
	return d, nil
}

// sortDonors orders donors by most free space first, then by name.
func sortDonors(ds []donor) {
	slices.SortFunc(ds, func(x, y donor) int {
		if c := y.free.cmp(x.free); c != 0 {
			return c
		}
		return strings.Compare(x.host, y.host)
	})
}

// takeFrom gives s, inside the range holding v, to this host in tx.
func (a *Allocator) takeFrom(ctx context.Context, tx *ringTxn, s span, v u128) error {
	r, held, _, err := tx.at(ctx, v)
	if err != nil {
		return err
	}
	if !held || r.lo.cmp(s.lo) > 0 || r.hi.cmp(s.hi) < 0 {
		return fmt.Errorf("%w: pool %s: the range holding %s changed while it was read", store.ErrConflict, tx.pool, v.addr(tx.is4))
	}
	return tx.assign(ctx, r, s, a.host, false)
}

// clipAll clips every span to the segments.
func clipAll(ss []span, segs []span) []span {
	var out []span
	for _, s := range ss {
		out = append(out, clip(s, segs)...)
	}
	return out
}

// maxEmptyRangeScan bounds how many of a donor's ranges a claim reads to
// find one that holds no address (one single-key scan each).
const maxEmptyRangeScan = 16

// emptyRange returns one of a donor's ranges (from its state), with
// addresses dynamic allocation may hand out, that holds no address (no
// owner, no hold).
func (a *Allocator) emptyRange(ctx context.Context, pool string, is4 bool, ranges []span, segs []span) (span, bool, error) {
	scanned := 0
	for _, s := range ranges {
		if len(clip(s, segs)) == 0 {
			continue
		}
		if scanned == maxEmptyRangeScan {
			break
		}
		scanned++
		held, err := a.st.Scan(ctx, addrKey(pool, s.lo, is4), addrKeysEnd(pool, s.hi, is4), 1)
		if err != nil {
			return span{}, false, err
		}
		if len(held) == 0 {
			return s, true, nil
		}
	}
	return span{}, false, nil
}

// minCursorHole is the smallest hole after a donor's cursor that a claim
// takes half of without scanning for a larger one.
const minCursorHole = 64

// maxHoleScan bounds how many held addresses a claim reads to find a hole.
const maxHoleScan = 1 << 20

// largestHole finds free space in a donor's spans. It first looks right after
// the donor's cursor (round robin leaves the space ahead of it free); failing
// that it scans the donor's held addresses for the largest gap.
func (a *Allocator) largestHole(ctx context.Context, pool string, is4 bool, spans []span, cursor netip.Addr) (span, bool, error) {
	if cursor.IsValid() && cursor.Is4() == is4 {
		c := toU128(cursor).inc()
		for _, s := range spans {
			if !s.contains(c) {
				continue
			}
			held, err := a.st.Scan(ctx, addrKey(pool, c, is4), addrKeysEnd(pool, s.hi, is4), 1)
			if err != nil {
				return span{}, false, err
			}
			hole := span{c, s.hi}
			if len(held) > 0 {
				k, ok := parseAddrKey(held[0].Key)
				if !ok || k.cmp(c) <= 0 {
					break
				}
				hole.hi = k.dec()
			}
			// A small hole right after the cursor is where the donor
			// allocates next: taking it would race the donor. Look for
			// the largest hole instead.
			if hole.size().cmp(u128{lo: minCursorHole}) >= 0 {
				return hole, true, nil
			}
		}
	}
	var best span
	found := false
	consider := func(h span) {
		if !found || h.size().cmp(best.size()) > 0 {
			best, found = h, true
		}
	}
	read := 0
	for _, s := range spans {
		cur, done := s.lo, false
		for !done && read < maxHoleScan {
			kvs, err := a.st.Scan(ctx, addrKey(pool, cur, is4), addrKeysEnd(pool, s.hi, is4), 1024)
			if err != nil {
				return span{}, false, err
			}
			read += len(kvs)
			for _, kv := range kvs {
				k, ok := parseAddrKey(kv.Key)
				if !ok {
					continue
				}
				if k.cmp(cur) > 0 {
					consider(span{cur, k.dec()})
				}
				if k == s.hi {
					done = true
					break
				}
				cur = k.inc()
			}
			if len(kvs) < 1024 {
				if !done {
					consider(span{cur, s.hi})
				}
				done = true
			}
		}
	}
	return best, found, nil
}
