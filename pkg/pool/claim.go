package pool

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/ringipam/ringipam/pkg/store"
)

// planClaim returns a ring in which this host owns more of pool. The
// allocation that needed the space commits it together with the new
// address, conditioned on the ring being unchanged, so claimed space cannot
// be taken away before it is used. In order of preference:
//  1. an unowned range, whole;
//  2. a tombstoned range that holds no address any more, whole; else the
//     largest free hole of the tombstoned ranges, whole;
//  3. a range of the live host with the most free addresses that holds no
//     address, whole; else the upper half of its largest free hole (only
//     free addresses change hands).
//
// In case 3 the donor is alive and may commit an allocation in the space
// given between this read and the claim's commit; its commit does not
// change the ring, so the ring's condition does not see it. The returned
// condition (non-nil in case 3 only) says that no address key exists in
// the space given, which the scans that found it free read: the commit
// requires it too, so a donor's allocation that landed there first fails
// the claim, which plans again. No address ever lies in a range its host
// does not own, not even briefly, and no step after the commit is needed.
// Cases 1 and 2 need no such condition: an address is created in unowned
// or tombstoned space only by a commit that changes the ring (a static
// request moves its address to its host).
//
// With no free address anywhere it returns a *CapacityError.
func (a *Allocator) planClaim(ctx context.Context, pool string, def Def, r ring) (ring, *store.Cond, error) {
	segs := dynamicSegmentsOf(def)
	is4 := def.is4()
	a.stats.claims.Add(1)
	for i, t := range r.tokens {
		if t.Host == "" && len(clip(r.spanOf(i), segs)) > 0 {
			s := r.spanOf(i)
			return r.assign(s.lo, s.hi, a.host), nil, nil
		}
	}
	// Tombstoned space: an empty range whole, else the largest free hole
	// of the tombstoned ranges, whole (nobody allocates there any more, so
	// there is no donor to race). Only its free addresses change hands; the
	// held ones stay tombstoned until they are released.
	var tombs []span
	for i, t := range r.tokens {
		if !t.Tomb {
			continue
		}
		clipped := clip(r.spanOf(i), segs)
		if len(clipped) == 0 {
			continue
		}
		s := r.spanOf(i)
		held, err := a.st.Scan(ctx, addrKey(pool, s.lo, is4), addrKeysEnd(pool, s.hi, is4), 1)
		if err != nil {
			return ring{}, nil, err
		}
		if len(held) == 0 || a.broken.ignoreTombs {
			return r.assign(s.lo, s.hi, a.host), nil, nil
		}
		tombs = append(tombs, clipped...)
	}
	if len(tombs) > 0 {
		hole, ok, err := a.largestHole(ctx, pool, is4, tombs, netip.Addr{})
		if err != nil {
			return ring{}, nil, err
		}
		if ok {
			return r.assign(hole.lo, hole.hi, a.host), nil, nil
		}
	}

	hostKVs, err := a.st.Scan(ctx, hostPrefix(pool), store.PrefixEnd(hostPrefix(pool)), 0)
	if err != nil {
		return ring{}, nil, err
	}
	type donor struct {
		host  string
		state hostState
		kv    store.KV
		spans []span
		free  u128
	}
	var donors []donor
	var used uint64
	states := map[string]store.KV{}
	for _, kv := range hostKVs {
		states[kv.Key[len(hostPrefix(pool)):]] = kv
	}
	// A host that owns ranges but never wrote its state is a donor too
	// (its state key is then required to stay absent).
	for _, t := range r.tokens {
		if _, ok := states[t.Host]; t.Host != "" && !t.Tomb && !ok {
			states[t.Host] = store.KV{Key: hostKey(pool, t.Host)}
		}
	}
	for host, kv := range states {
		d := donor{host: host, kv: kv}
		if kv.Exists() {
			if err := json.Unmarshal(kv.Value, &d.state); err != nil {
				return ring{}, nil, fmt.Errorf("pool %s host %s: corrupt state: %w", pool, d.host, err)
			}
		}
		used += d.state.Used
		if d.host == a.host {
			continue
		}
		d.spans = r.ownedBy(d.host, segs)
		c := capacityOf(d.spans)
		if c.cmp(u128{lo: d.state.Used}) > 0 {
			d.free = c.sub(u128{lo: d.state.Used})
			donors = append(donors, d)
		}
	}
	slices.SortFunc(donors, func(x, y donor) int {
		if c := y.free.cmp(x.free); c != 0 {
			return c
		}
		return strings.Compare(x.host, y.host)
	})
	for _, d := range donors {
		// A range of the donor that holds no address at all changes owner
		// whole (seed 002's first case), a one-token change.
		if s, ok, err := a.emptyRange(ctx, pool, is4, r, d.host, segs); err != nil {
			return ring{}, nil, err
		} else if ok {
			c := noAddrIn(pool, is4, s)
			return r.assign(s.lo, s.hi, a.host), &c, nil
		}
		hole, ok, err := a.largestHole(ctx, pool, is4, d.spans, d.state.Cursor)
		if err != nil {
			return ring{}, nil, err
		}
		if !ok {
			continue
		}
		give := hole
		if n := hole.size(); n.cmp(u128{lo: 1}) > 0 {
			give.lo = hole.lo.add(n.half())
		}
		c := noAddrIn(pool, is4, give)
		return r.assign(give.lo, give.hi, a.host), &c, nil
	}
	return ring{}, nil, &CapacityError{Pool: pool, Used: used, Capacity: capacityOf(segs).String()}
}

// maxEmptyRangeScan bounds how many of a donor's ranges a claim reads to
// find one that holds no address (one single-key scan each).
const maxEmptyRangeScan = 16

// emptyRange returns a live range of host, with addresses dynamic
// allocation may hand out, that holds no address (no owner, no hold).
func (a *Allocator) emptyRange(ctx context.Context, pool string, is4 bool, r ring, host string, segs []span) (span, bool, error) {
	scanned := 0
	for i, t := range r.tokens {
		if t.Host != host || t.Tomb || len(clip(r.spanOf(i), segs)) == 0 {
			continue
		}
		if scanned == maxEmptyRangeScan {
			break
		}
		scanned++
		s := r.spanOf(i)
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
