package pool

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/ringipam/ringipam/pkg/store"
)

// Invariants Audit checks, one name each (Violation.Invariant).
const (
	// InvTwoOwners: no address is listed by two owner records.
	InvTwoOwners = "two-owners"
	// InvRingCover: every pool's ring covers the pool exactly once (tokens
	// in order, the first at the pool's start, none outside it).
	InvRingCover = "ring-cover"
	// InvNotInPool: every held address is one its pool hands out.
	InvNotInPool = "not-in-pool"
	// InvOutsideRange: every address is held in a range its host owns, and
	// an owner record's host is the host its address keys name. No step of
	// ringipam breaks it, not even for a moment: a claim of a live host's
	// space requires, in its one commit, that the space holds no address
	// (a range condition), and every other ring change that gives away
	// space is conditioned on the ring, which any allocation there would
	// have changed. A violation is corruption (or a stray left by a
	// ringipam from before the range condition that died between a claim
	// and its hand-back); releasing the owner ends it.
	InvOutsideRange = "outside-range"
	// InvTombstoned: an address in a tombstoned range is only ever a
	// reservation's hold; an owner still holding one there is a release
	// that reclaiming did not finish.
	InvTombstoned = "tombstoned"
	// InvRecords: owner records, reservation records and address keys
	// agree: each address key names an owner whose record lists it (or a
	// reservation that lists it), and each record's addresses are held by
	// it.
	InvRecords = "records-disagree"
	// InvOverlap: no two pools overlap (unless one is isolated), and the
	// pool registry lists every recorded pool.
	InvOverlap = "pool-overlap"
	// InvHostCount: each host's used count in a pool is the number of
	// addresses its owners hold there.
	InvHostCount = "host-count"
	// InvHostIndex: each host's index of its owners (i/<host>/<owner>)
	// lists exactly the owner records that name that host, which its GC
	// and its reclaim read instead of every owner.
	InvHostIndex = "host-index"
	// InvFreeIndex: the free-space indexes (freeindex.go) agree with what
	// they summarise: f/<pool>/<host> exists exactly while the host's
	// state says so, and the state says so exactly while it has a free
	// address; t/<pool>/<last> exists exactly while that range key is
	// tombstoned. A disagreement costs claims reads (a stale entry) or
	// sends them to their last resort (a missing one), never safety:
	// every candidate is read again and conditioned on. A state or a
	// tombstone written by a ringipam before the indexes is not listed
	// until the state is written again (a state) or is reported here (a
	// tombstone: found by the last resort only).
	InvFreeIndex = "free-index"
	// InvCorrupt: every record can be read.
	InvCorrupt = "corrupt"
)

// Violation is one broken invariant found by Audit.
type Violation struct {
	Invariant string `json:"invariant"`
	Pool      string `json:"pool,omitempty"`
	Detail    string `json:"detail"`
}

func (v Violation) String() string {
	if v.Pool == "" {
		return v.Invariant + ": " + v.Detail
	}
	return v.Invariant + ": pool " + v.Pool + ": " + v.Detail
}

// Audit reads the whole store and returns every violated invariant (the
// Inv* constants), sorted; nil when all hold. Unlike Check it looks across
// pools (overlaps, an address listed by two owners, the registry) and at
// reservation holds. It reads everything and changes nothing: it is for
// operators (ringctl check) and tests.
func (a *Allocator) Audit(ctx context.Context) ([]Violation, error) {
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	if err := a.ensureLayout(ctx); err != nil {
		return nil, err
	}
	scan := func(prefix string) ([]store.KV, error) {
		return a.st.Scan(ctx, prefix, store.PrefixEnd(prefix), 0)
	}
	var out []Violation
	bad := func(inv, pool, format string, args ...any) {
		out = append(out, Violation{Invariant: inv, Pool: pool, Detail: fmt.Sprintf(format, args...)})
	}

	// Pools and their rings.
	defKVs, err := scan(prefixDef)
	if err != nil {
		return nil, err
	}
	defs := map[string]Def{}
	rings := map[string]ring{}
	var names []string
	for _, kv := range defKVs {
		name := strings.TrimPrefix(kv.Key, prefixDef)
		d, err := parseDef(name, kv.Value)
		if err != nil {
			bad(InvCorrupt, name, "definition: %v", err)
			continue
		}
		if _, err := d.Normalize(); err != nil {
			bad(InvCorrupt, name, "definition is not valid: %v", err)
			continue
		}
		defs[name] = d
		names = append(names, name)
	}
	for _, name := range names {
		r, err := a.poolRing(ctx, name, defs[name])
		if err != nil {
			bad(InvRingCover, name, "%v", err)
			continue
		}
		hostKVs, err := scan(hostPrefix(name))
		if err != nil {
			return nil, err
		}
		faults, err := a.stateRangeFaults(ctx, name, defs[name], hostKVs)
		if err != nil {
			return nil, err
		}
		for _, f := range faults {
			bad(InvOutsideRange, name, "%s", f)
		}
		idxFaults, err := a.indexFaults(ctx, name, defs[name], hostKVs)
		if err != nil {
			return nil, err
		}
		for _, f := range idxFaults {
			bad(InvFreeIndex, name, "%s", f)
		}
		if err := r.check(); err != nil {
			bad(InvRingCover, name, "the ring does not cover the pool exactly once: %v", err)
			continue
		}
		rings[name] = r
	}

	// Overlaps, from the definitions themselves, and the registry.
	for i, p := range names {
		for _, q := range names[i+1:] {
			if x, y, ok := overlap(registeredOf(defs[p]), registeredOf(defs[q])); ok && !defs[p].Isolated && !defs[q].Isolated {
				bad(InvOverlap, "", "pools %s (%s) and %s (%s) overlap and neither is isolated", p, x, q, y)
			}
		}
	}
	regKV, err := a.st.Get(ctx, registryKey)
	if err != nil {
		return nil, err
	}
	if reg, err := decodeRegistry(regKV[0]); err != nil {
		bad(InvCorrupt, "", "%v", err)
	} else {
		listed := map[string]bool{}
		for _, p := range reg.Pools {
			listed[p.Name] = true
		}
		for _, name := range names {
			if !listed[name] {
				bad(InvOverlap, name, "the pool is recorded but missing from the pool registry, so overlaps with it go unnoticed")
			}
		}
	}

	// Owner records, and who lists each address.
	ownerKVs, err := scan(prefixOwner)
	if err != nil {
		return nil, err
	}
	type poolAddr struct {
		pool string
		addr netip.Addr
	}
	recs := map[string]Allocation{}
	listedBy := map[poolAddr][]string{}
	for _, kv := range ownerKVs {
		var rec Allocation
		if err := json.Unmarshal(kv.Value, &rec); err != nil {
			bad(InvCorrupt, "", "%s: %v", kv.Key, err)
			continue
		}
		o := rec.Owner.String()
		if ownerKeyOf(o) != kv.Key {
			bad(InvRecords, "", "%s holds the record of owner %s", kv.Key, o)
		}
		recs[o] = rec
		for _, x := range rec.Addrs {
			pa := poolAddr{x.Pool, x.Addr}
			listedBy[pa] = append(listedBy[pa], o)
			if _, ok := defs[x.Pool]; !ok {
				bad(InvRecords, x.Pool, "%s lists %s in a pool that is not recorded", o, x.Addr)
			}
		}
	}
	// Each host's index of its owners.
	indexKVs, err := scan(prefixHostOwner)
	if err != nil {
		return nil, err
	}
	indexed := map[string]bool{}
	for _, kv := range indexKVs {
		indexed[kv.Key] = true
		host, o, _ := strings.Cut(strings.TrimPrefix(kv.Key, prefixHostOwner), "/")
		if rec, ok := recs[o]; !ok || !rec.HeldBy(host) {
			bad(InvHostIndex, "", "%s names an owner that host %s does not hold (ringctl gc repairs the index)", kv.Key, host)
		}
	}
	for o, rec := range recs {
		for _, h := range rec.holders() {
			if ik := hostOwnerKey(h, rec.Owner); !indexed[ik] {
				bad(InvHostIndex, "", "owner %s of host %s is missing from the host's index %s (ringctl gc repairs the index)", o, h, ik)
			}
		}
	}
	for pa, owners := range listedBy {
		if len(owners) > 1 {
			slices.Sort(owners)
			bad(InvTwoOwners, pa.pool, "%s is listed by %d owners: %s", pa.addr, len(owners), strings.Join(owners, ", "))
		}
	}

	// Reservations.
	resvKVs, err := scan(prefixResv)
	if err != nil {
		return nil, err
	}
	resvs := map[string]reservation{}
	for _, kv := range resvKVs {
		var r reservation
		if err := json.Unmarshal(kv.Value, &r); err != nil {
			bad(InvCorrupt, "", "%s: %v", kv.Key, err)
			continue
		}
		resvs[kv.Key] = r
	}

	// Address keys against rings, owners and reservations.
	addrKVs, err := scan(prefixAddr)
	if err != nil {
		return nil, err
	}
	holderOf := map[poolAddr]string{}
	count := map[string]map[string]uint64{} // pool -> host -> owner-held addresses
	for _, kv := range addrKVs {
		h, ok := heldOf(kv)
		if !ok {
			bad(InvCorrupt, "", "unparsable address key %s", kv.Key)
			continue
		}
		d, known := defs[h.Pool]
		if !known {
			bad(InvRecords, h.Pool, "%s is held in a pool that is not recorded", h.Addr)
			continue
		}
		who := h.Owner
		if h.Hold != nil {
			who = "the hold of reservation " + h.Hold.Reservation
		}
		holderOf[poolAddr{h.Pool, h.Addr}] = h.Owner
		if h.Hold == nil {
			if count[h.Pool] == nil {
				count[h.Pool] = map[string]uint64{}
			}
			count[h.Pool][h.Host]++
		}
		if !d.Contains(h.Addr) {
			bad(InvNotInPool, h.Pool, "%s is held by %s but is not an address the pool hands out", h.Addr, who)
		}
		if r, ok := rings[h.Pool]; ok && d.is4() == h.Addr.Is4() {
			t := r.ownerOf(toU128(h.Addr))
			switch {
			case t.Host != h.Host:
				bad(InvOutsideRange, h.Pool, "%s is held by %s on host %s but lies in a range of %s (corruption: no ringipam step leaves an address outside its host's ranges; releasing the owner ends it)", h.Addr, who, hostName(h.Host), hostName(t.Host))
			case t.Tomb && h.Hold == nil:
				bad(InvTombstoned, h.Pool, "%s is held by %s in a tombstoned range of %s: reclaiming left it behind (run ringctl rmpeer %s again)", h.Addr, who, hostName(h.Host), h.Host)
			}
		}
		if h.Hold != nil {
			r, ok := resvs[resvKey(h.Hold.Kind, h.Hold.Network, h.Hold.Reservation)]
			if !ok || !slices.ContainsFunc(r.Addrs, func(x Assigned) bool { return x.Pool == h.Pool && x.Addr == h.Addr }) {
				bad(InvRecords, h.Pool, "%s is held for reservation %s (%s network %s), which does not list it", h.Addr, h.Hold.Reservation, h.Hold.Kind, h.Hold.Network)
			}
			continue
		}
		rec, ok := recs[h.Owner]
		switch {
		case !ok:
			bad(InvRecords, h.Pool, "%s is held by %s, which has no owner record", h.Addr, h.Owner)
		case !slices.ContainsFunc(rec.Addrs, func(x Assigned) bool { return x.Pool == h.Pool && x.Addr == h.Addr }):
			bad(InvRecords, h.Pool, "%s is held by %s, whose record does not list it", h.Addr, h.Owner)
		case rec.Host != h.Host:
			bad(InvOutsideRange, h.Pool, "%s is held on host %s but its owner %s was allocated on host %s", h.Addr, hostName(h.Host), h.Owner, hostName(rec.Host))
		}
	}
	for o, rec := range recs {
		for _, x := range rec.Addrs {
			if _, ok := defs[x.Pool]; !ok {
				continue
			}
			if got, ok := holderOf[poolAddr{x.Pool, x.Addr}]; !ok {
				bad(InvRecords, x.Pool, "%s lists %s, but no address key holds it", o, x.Addr)
			} else if got != o {
				bad(InvRecords, x.Pool, "%s lists %s, but the address key names %s", o, x.Addr, describeHolder(got))
			}
		}
	}

	// Host counts.
	hostKVs, err := scan(prefixHost)
	if err != nil {
		return nil, err
	}
	for _, kv := range hostKVs {
		pool, host, ok := strings.Cut(strings.TrimPrefix(kv.Key, prefixHost), "/")
		if !ok {
			bad(InvCorrupt, "", "unparsable host state key %s", kv.Key)
			continue
		}
		var hs hostState
		if err := json.Unmarshal(kv.Value, &hs); err != nil {
			bad(InvCorrupt, pool, "%s: %v", kv.Key, err)
			continue
		}
		if n := count[pool][host]; hs.Used != n {
			bad(InvHostCount, pool, "host %s counts %d used addresses but its owners hold %d", host, hs.Used, n)
		}
	}
	slices.SortFunc(out, func(x, y Violation) int {
		return cmp.Or(cmp.Compare(x.Invariant, y.Invariant), cmp.Compare(x.Pool, y.Pool), cmp.Compare(x.Detail, y.Detail))
	})
	return slices.Compact(out), nil
}

func hostName(h string) string {
	if h == "" {
		return "nobody (unowned)"
	}
	return h
}

func describeHolder(owner string) string {
	if owner == "" {
		return "a reservation's hold"
	}
	return owner
}

// Records returns every readable, valid pool definition and every
// readable owner record of the store, for audits that look past the
// pool's own invariants (pkg/containernet's, the holders of published
// ports); what cannot be read is left out (Audit reports it).
func (a *Allocator) Records(ctx context.Context) ([]Def, []Allocation, error) {
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	if err := a.ensureLayout(ctx); err != nil {
		return nil, nil, err
	}
	defKVs, err := a.st.Scan(ctx, prefixDef, store.PrefixEnd(prefixDef), 0)
	if err != nil {
		return nil, nil, err
	}
	var defs []Def
	for _, kv := range defKVs {
		d, err := parseDef(strings.TrimPrefix(kv.Key, prefixDef), kv.Value)
		if err != nil {
			continue
		}
		if d, err = d.Normalize(); err == nil {
			defs = append(defs, d)
		}
	}
	ownerKVs, err := a.st.Scan(ctx, prefixOwner, store.PrefixEnd(prefixOwner), 0)
	if err != nil {
		return nil, nil, err
	}
	var recs []Allocation
	for _, kv := range ownerKVs {
		var rec Allocation
		if json.Unmarshal(kv.Value, &rec) == nil && ownerKeyOf(rec.Owner.String()) == kv.Key {
			recs = append(recs, rec)
		}
	}
	return defs, recs, nil
}
