package pool

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/ringipam/ringipam/pkg/store"
)

// The bounded steps of planClaim, between its random blocks and its last
// resort (claimLastResort): what each reads does not grow with the
// number of hosts or ranges of the pool.

// Bounds of the gap search: range keys read per page, and in all.
const (
	gapPage    = 32
	maxGapKeys = 2 * gapPage
)

// maxIndexedTombs and maxIndexedDonors bound the tombstone and free-space
// index entries (freeindex.go) one claim reads.
const (
	maxIndexedTombs  = 8
	maxIndexedDonors = 8
)

// claimNearGap looks for unowned space from start on, wrapping around at
// the top of the pool, by pages of range keys (gapPage at a time, at most
// maxGapKeys), and claims the first gap it finds, cut to its aligned block
// (claimGap, whose conditions make it safe whatever the pages read: they
// are not conditions). It reports false when the keys it may read showed
// no gap; the last resort then reads them all. A transaction that already
// changed range keys (a second claim of one request in one pool) skips
// it: the pages would have to be read through its edits.
func (a *Allocator) claimNearGap(ctx context.Context, tx *ringTxn, segs []span, start u128) (bool, error) {
	if len(tx.edits) > 0 {
		return false, nil
	}
	pool, is4, space := tx.pool, tx.is4, tx.space
	if !space.contains(start) {
		start = space.lo
	}
	try := func(gap span) (bool, error) {
		free := clip(gap, segs)
		if len(free) == 0 {
			return false, nil
		}
		b, c := tx.blockOf(free[0].lo)
		c = span{maxU(c.lo, gap.lo), minU(c.hi, gap.hi)}
		succ, ok, err := tx.next(ctx, c.lo)
		if err != nil {
			return false, err
		}
		if ok && succ.lo.cmp(c.hi) <= 0 {
			return false, fmt.Errorf("%w: pool %s: space was claimed meanwhile", store.ErrConflict, pool)
		}
		return true, tx.claimGap(ctx, c, b, succ, ok, a.host)
	}
	// prev is the first address not yet seen owned; top: the ranges
	// seen reach the top of the space. After wrapping, gaps end before
	// limit: the lowest address the first pass saw (the start, or the
	// start of the range holding it).
	prev, top, wrapped, limit, first := start, false, false, start, true
	from, end := rangeKey(pool, start, is4), store.PrefixEnd(rangePrefix(pool))
	for read := 0; read < maxGapKeys; {
		kvs, err := a.st.Scan(ctx, from, end, gapPage)
		if err != nil {
			return false, err
		}
		read += len(kvs)
		for _, kv := range kvs {
			r, err := decodeRangeKV(kv, is4)
			if err != nil {
				return false, fmt.Errorf("pool %s: %w", pool, err)
			}
			if first {
				first = false
				limit = minU(limit, r.lo)
			}
			if r.lo.cmp(prev) > 0 {
				gap := span{prev, r.lo.dec()}
				if wrapped && gap.hi.cmp(limit) >= 0 {
					if limit == space.lo {
						return false, nil
					}
					gap.hi = limit.dec()
				}
				if gap.lo.cmp(gap.hi) <= 0 {
					if done, err := try(gap); done || err != nil {
						return done, err
					}
				}
			}
			if r.hi.cmp(prev) >= 0 {
				if r.hi == space.hi {
					top = true
				} else {
					prev = r.hi.inc()
				}
			}
			if wrapped && (top || prev.cmp(limit) >= 0) {
				return false, nil
			}
		}
		if len(kvs) == gapPage {
			from = kvs[len(kvs)-1].Key + "\x00"
			continue
		}
		// The end of the keys of this pass: the space after the last.
		if !wrapped {
			first = false
			if !top {
				if done, err := try(span{prev, space.hi}); done || err != nil {
					return done, err
				}
			}
			if limit == space.lo {
				return false, nil
			}
			wrapped, top, prev = true, false, space.lo
			from, end = rangePrefix(pool), rangeKey(pool, limit, is4)
			continue
		}
		if !top && prev.cmp(limit) < 0 {
			return try(span{prev, limit.dec()})
		}
		return false, nil
	}
	return false, nil
}

// scanIndex reads up to limit keys of an index prefix, from the key from
// on and then, wrapping around, from the prefix's start.
func (a *Allocator) scanIndex(ctx context.Context, prefix, from string, limit int) ([]store.KV, error) {
	kvs, err := a.st.Scan(ctx, from, store.PrefixEnd(prefix), limit)
	if err != nil || len(kvs) == limit || from == prefix {
		return kvs, err
	}
	more, err := a.st.Scan(ctx, prefix, from, limit-len(kvs))
	return append(kvs, more...), err
}

// claimIndexedTomb takes tombstoned space from the ranges the tombstone
// index names, up to maxIndexedTombs of them from a pseudo-random
// position: a range that holds no address whole, else the largest free
// hole among them. Each is read again (its range key, through tx, which
// conditions on it); an entry whose range is not tombstoned any more is
// passed over.
func (a *Allocator) claimIndexedTomb(ctx context.Context, tx *ringTxn, segs []span, start u128) (bool, error) {
	pool, is4 := tx.pool, tx.is4
	idx, err := a.scanIndex(ctx, tombPrefix(pool), tombPrefix(pool)+hexOf(start, is4), maxIndexedTombs)
	if err != nil {
		return false, err
	}
	var tombSpans []span
	for _, kv := range idx {
		rk := rangeKeyOfTomb(kv.Key)
		last, ok := parseAddrKey(rk)
		if !ok || !strings.HasPrefix(rk, rangePrefix(pool)) {
			continue
		}
		r, held, _, err := tx.at(ctx, last)
		if err != nil {
			return false, err
		}
		if !held || !r.tomb || r.key != rk || len(clip(r.span, segs)) == 0 {
			continue
		}
		addrs, err := a.st.Scan(ctx, addrKey(pool, r.lo, is4), addrKeysEnd(pool, r.hi, is4), 1)
		if err != nil {
			return false, err
		}
		if len(addrs) == 0 || a.broken.ignoreTombs {
			return true, a.takeFrom(ctx, tx, r.span, r.lo)
		}
		tombSpans = append(tombSpans, clip(r.span, segs)...)
	}
	if len(tombSpans) == 0 {
		return false, nil
	}
	hole, ok, err := a.largestHole(ctx, pool, is4, tombSpans, netip.Addr{})
	if err != nil || !ok {
		return false, err
	}
	return true, a.takeFrom(ctx, tx, hole, hole.lo)
}

// donateIndexed asks the hosts the free-space index names, up to
// maxIndexedDonors of them from this host's own name on (hosts claiming
// at once start at different entries), read in one round trip, the one
// with the most free addresses first. asked gets every host it tried.
func (a *Allocator) donateIndexed(ctx context.Context, tx *ringTxn, segs []span, asked map[string]bool) (bool, error) {
	pool := tx.pool
	idx, err := a.scanIndex(ctx, freePrefix(pool), freeKey(pool, a.host)+"\x00", maxIndexedDonors)
	if err != nil {
		return false, err
	}
	var hosts, keys []string
	for _, kv := range idx {
		h := strings.TrimPrefix(kv.Key, freePrefix(pool))
		if h == a.host || slices.Contains(hosts, h) {
			continue
		}
		hosts = append(hosts, h)
		keys = append(keys, hostKey(pool, h))
	}
	if len(keys) == 0 {
		return false, nil
	}
	kvs, err := a.st.Get(ctx, keys...)
	if err != nil {
		return false, err
	}
	var cands []donor
	for i, kv := range kvs {
		if !kv.Exists() {
			continue // a stale entry: the state is gone
		}
		c, err := tx.donorOf(hosts[i], kv, segs)
		if err != nil {
			return false, err
		}
		if c.free != (u128{}) {
			cands = append(cands, c)
		}
	}
	sortDonors(cands)
	for _, c := range cands {
		asked[c.host] = true
		if done, err := a.tryDonor(ctx, tx, segs, c.host, c.kv, c.state); done || err != nil {
			return done, err
		}
	}
	return false, nil
}

// tryDonor plans the donation of free space of host (its state st, read
// as kv) to this host in tx: a range of the donor that holds no address
// at all, whole (seed 002's first case), else the upper half of its
// largest free hole. It reports false when the donor has no free
// address after all. The donation's two guards: the donor's state
// unchanged (tx.seed as a donor) and no address in the space given.
func (a *Allocator) tryDonor(ctx context.Context, tx *ringTxn, segs []span, host string, kv store.KV, st hostState) (bool, error) {
	pool, is4 := tx.pool, tx.is4
	give, ok, err := a.emptyRange(ctx, pool, is4, st.spans(), segs)
	if err != nil {
		return false, err
	}
	if !ok {
		hole, found, err := a.largestHole(ctx, pool, is4, clipAll(st.spans(), segs), st.Cursor)
		if err != nil || !found {
			return false, err
		}
		give = hole
		if n := hole.size(); n.cmp(u128{lo: 1}) > 0 {
			give.lo = hole.lo.add(n.half())
		}
	}
	tx.seed(host, kv, st, true)
	if !a.broken.noRangeCond {
		tx.conds = append(tx.conds, noAddrIn(pool, is4, give))
	}
	return true, a.takeFrom(ctx, tx, give, give.lo)
}
