package pool

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/ringipam/ringipam/pkg/store"
)

// The indexes of free space a claim reads instead of every range key and
// every host state of its pool (issue 42, item 2). Both are hints: every
// candidate they name is read again (its range key, its host state) and
// the claim's commit is conditioned on what it read, exactly as when the
// candidate came from a full scan, so an entry that is wrong costs a read,
// never safety; and a candidate the index misses is still found by the
// claim's last resort, the full scans, which a claim reaches only when the
// indexes offered nothing (a full pool always gets there before it answers
// a *CapacityError). That is why they need no layout version of their
// own: a layout-4 store written before them works as it is, and its
// indexes fill as the hosts write their states (see freeIndexOps).
//
//	f/<pool>/<host>        empty: the host's state says it has a free address (hostState.Free)
//	t/<pool>/<hex last>    empty: the range key g/<pool>/<hex last> is tombstoned
const (
	prefixFree = "f/" // f/<pool>/<host>: a host with free addresses to give
	prefixTomb = "t/" // t/<pool>/<hex last>: a tombstoned range
)

func freePrefix(pool string) string    { return prefixFree + pool + "/" }
func freeKey(pool, host string) string { return freePrefix(pool) + host }
func tombPrefix(pool string) string    { return prefixTomb + pool + "/" }
func tombKeyOf(rangeKey string) string { return prefixTomb + strings.TrimPrefix(rangeKey, prefixRing) }
func rangeKeyOfTomb(tombKey string) string {
	return prefixRing + strings.TrimPrefix(tombKey, prefixTomb)
}

// What a host state says of its free-space index key (hostState.Free).
const (
	// freeUnknown: the state was written by a ringipam before the index
	// (or never written since): whether f/<pool>/<host> exists is not
	// known, so the next write of the state sets the key as it should be
	// either way.
	freeUnknown = 0
	freeAbsent  = 1 // the state has no free address; no index key
	freePresent = 2 // the state has a free address; its index key exists
)

// hasFree reports whether h's ranges hold more addresses than its owners
// use: the threshold of the free-space index is one free address (a
// donor gives whole empty ranges, or half of its largest hole, or a
// last address). Holds of released reservations are not in Used, so a
// host whose only free addresses are held is listed too: a claim that
// reads it finds no hole and goes on to the next.
func (h hostState) hasFree() bool {
	return capacityOf(h.spans()).cmp(u128{lo: h.Used}) > 0
}

// freeIndexOps brings host's free-space index key in pool in line with
// h, the state about to be written for it, and records in h what it did:
// nothing at all unless the state crosses the threshold (an ordinary
// allocation or release writes no extra key), a put or a delete when it
// does, and either when the state as read did not say (freeUnknown).
// Every write of a host state goes through here, in the commit that
// writes the state.
func freeIndexOps(pool, host string, h *hostState) []store.Op {
	want := freeAbsent
	if h.hasFree() {
		want = freePresent
	}
	if h.Free == want {
		return nil
	}
	h.Free = want
	if want == freePresent {
		return []store.Op{store.Put(freeKey(pool, host), []byte{})}
	}
	return []store.Op{store.Delete(freeKey(pool, host))}
}

// putHostState is the write of host's state h in pool with its index
// key (freeIndexOps).
func putHostState(pool, host string, h *hostState) []store.Op {
	ops := freeIndexOps(pool, host, h)
	return append(ops, store.Put(hostKey(pool, host), encodeHostState(*h)))
}

// deleteHostState deletes host's state in pool and its index key.
func deleteHostState(pool, host string) []store.Op {
	return []store.Op{store.Delete(hostKey(pool, host)), store.Delete(freeKey(pool, host))}
}

// indexFaults compares pool's free-space and tombstone indexes with the
// host states (hostKVs, as scanned) and range keys they summarise, one
// sentence per disagreement (Audit's InvFreeIndex).
func (a *Allocator) indexFaults(ctx context.Context, pool string, def Def, hostKVs []store.KV) ([]string, error) {
	var bad []string
	free, err := a.st.Scan(ctx, freePrefix(pool), store.PrefixEnd(freePrefix(pool)), 0)
	if err != nil {
		return nil, err
	}
	listed := map[string]bool{}
	for _, kv := range free {
		listed[strings.TrimPrefix(kv.Key, freePrefix(pool))] = true
	}
	for _, kv := range hostKVs {
		host := strings.TrimPrefix(kv.Key, hostPrefix(pool))
		var hs hostState
		if decodeHostState(kv.Value, &hs) != nil {
			continue // reported as corrupt elsewhere
		}
		present := listed[host]
		delete(listed, host)
		switch {
		case hs.Free == freeUnknown:
			// Written by a ringipam before the index: set on its next write.
		case (hs.Free == freePresent) != present:
			bad = append(bad, fmt.Sprintf("host %s's state says its free-space index key exists: %v, but it %s", host, hs.Free == freePresent, map[bool]string{true: "does", false: "does not"}[present]))
		case (hs.Free == freePresent) != hs.hasFree():
			bad = append(bad, fmt.Sprintf("host %s's state says it has free addresses: %v, but it has %d used in %s", host, hs.Free == freePresent, hs.Used, spansString(hs.spans(), def.is4())))
		}
	}
	for host := range listed {
		bad = append(bad, fmt.Sprintf("the free-space index lists host %s, which has no state in the pool", host))
	}
	tombs, err := a.st.Scan(ctx, tombPrefix(pool), store.PrefixEnd(tombPrefix(pool)), 0)
	if err != nil {
		return nil, err
	}
	rs, err := a.scanRanges(ctx, pool, def.is4())
	if err != nil {
		return nil, err
	}
	isTomb := map[string]bool{}
	for _, r := range rs {
		isTomb[r.key] = r.tomb
	}
	indexed := map[string]bool{}
	for _, kv := range tombs {
		rk := rangeKeyOfTomb(kv.Key)
		indexed[rk] = true
		if !isTomb[rk] {
			bad = append(bad, fmt.Sprintf("the tombstone index lists %s, which is not a tombstoned range", rk))
		}
	}
	for _, r := range rs {
		if r.tomb && !indexed[r.key] {
			bad = append(bad, fmt.Sprintf("tombstoned range %s is missing from the tombstone index (claims find it only by their last resort)", r.key))
		}
	}
	slices.Sort(bad)
	return bad, nil
}
