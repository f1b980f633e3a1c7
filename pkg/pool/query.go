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

// Lookup returns what owner holds, and false when it holds nothing. When
// the owner is this host's, the host's last-seen time is refreshed if it
// is older than an hour (the read rides on the lookup's own; the write is
// one round trip per host per hour), so hosts whose containers are only
// checked are not taken for gone.
func (a *Allocator) Lookup(ctx context.Context, owner Owner) (Allocation, bool, error) {
	if err := owner.Validate(); err != nil {
		return Allocation{}, false, err
	}
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	kvs, err := a.get(ctx, ownerKey(owner), statusKey(a.host))
	if err != nil {
		return Allocation{}, false, err
	}
	alloc, ok, err := decodeOwner(owner, kvs[0])
	// CHECK commits nothing. An allocator without WithLastSeen (ringctl)
	// still refreshes it when it finds one of its host's owners, as
	// before WithLastSeen existed.
	if err == nil && (a.seen || ok && alloc.Host == a.host) {
		a.touch(ctx, kvs[1])
	}
	return alloc, ok, err
}

func (a *Allocator) lookup(ctx context.Context, owner Owner) (Allocation, bool, error) {
	kvs, err := a.get(ctx, ownerKey(owner))
	if err != nil {
		return Allocation{}, false, err
	}
	return decodeOwner(owner, kvs[0])
}

// decodeOwner decodes an owner record as read; false when it is absent.
func decodeOwner(owner Owner, kv store.KV) (Allocation, bool, error) {
	if !kv.Exists() {
		return Allocation{}, false, nil
	}
	var rec Allocation
	if err := decodeAllocation(kv.Value, &rec); err != nil {
		return Allocation{}, false, fmt.Errorf("owner %s: stored allocation is corrupt: %w", owner, err)
	}
	return rec, true, nil
}

// Filter selects allocations in List; empty fields match anything.
type Filter struct {
	Kind    Kind // the front end; a Network filter needs it to be cheap
	Host    string
	Network string
	Pool    string
}

// List returns the allocations that match f, ordered by owner key. With a
// Host it reads that host's owners only, through the host's index.
func (a *Allocator) List(ctx context.Context, f Filter) ([]Allocation, error) {
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	if err := a.ensureLayout(ctx); err != nil {
		return nil, err
	}
	var recs []Allocation
	if f.Host != "" {
		held, _, err := a.hostOwners(ctx, f.Host, f.Kind, f.Network)
		if err != nil {
			return nil, err
		}
		for _, r := range held {
			recs = append(recs, r.rec)
		}
	} else {
		prefix := ownersPrefix(f.Kind, f.Network)
		kvs, err := a.st.Scan(ctx, prefix, store.PrefixEnd(prefix), 0)
		if err != nil {
			return nil, err
		}
		for _, kv := range kvs {
			var rec Allocation
			if err := json.Unmarshal(kv.Value, &rec); err != nil {
				return nil, fmt.Errorf("%s: stored allocation is corrupt: %w", kv.Key, err)
			}
			recs = append(recs, rec)
		}
	}
	var out []Allocation
	for _, rec := range recs {
		if f.Network != "" && rec.Owner.Network != f.Network {
			continue
		}
		if f.Pool != "" && !holdsPool(rec, f.Pool) {
			continue
		}
		out = append(out, rec)
	}
	return out, nil
}

func holdsPool(a Allocation, pool string) bool {
	for _, x := range a.Addrs {
		if x.Pool == pool {
			return true
		}
	}
	return false
}

// hostOwners reads host's owners of kind on network (empty: all) through
// the host's index: one scan of its index keys and one read of the records
// they name, so the cost follows this host's owners, never the network's.
// An index key whose record is absent, or is another host's, is returned
// in dangling with the record as read; no writer of this layout leaves one
// (see Reindex).
func (a *Allocator) hostOwners(ctx context.Context, host string, kind Kind, network string) (held, dangling []ownerRead, err error) {
	held, dangling, _, err = a.hostOwnersAnd(ctx, host, kind, network)
	return held, dangling, err
}

// hostOwnersAnd is hostOwners that also reads the keys also in its read of
// the records (no extra round trip when there are records to read).
func (a *Allocator) hostOwnersAnd(ctx context.Context, host string, kind Kind, network string, also ...string) (held, dangling []ownerRead, alsoKVs []store.KV, err error) {
	prefix := hostOwnersPrefix(host, kind, network)
	idx, err := a.st.Scan(ctx, prefix, store.PrefixEnd(prefix), 0)
	if err != nil {
		return nil, nil, nil, err
	}
	hostIndex := hostOwnersPrefix(host, "", "")
	owners := make([]Owner, 0, len(idx))
	keys := make([]string, 0, len(idx))
	for _, kv := range idx {
		o, ok := parseOwner(strings.TrimPrefix(kv.Key, hostIndex))
		if !ok {
			return nil, nil, nil, fmt.Errorf("%s: not an index key of an owner", kv.Key)
		}
		owners = append(owners, o)
		keys = append(keys, ownerKey(o))
	}
	recs, err := a.st.Get(ctx, append(keys, also...)...)
	if err != nil {
		return nil, nil, nil, err
	}
	recs, alsoKVs = recs[:len(keys)], recs[len(keys):]
	for i, kv := range recs {
		r, ok, err := readOwner(owners[i], kv)
		if err != nil {
			return nil, nil, nil, err
		}
		if !ok || !r.rec.HeldBy(host) {
			dangling = append(dangling, ownerRead{owner: owners[i], kv: kv, index: idx[i].Key})
			continue
		}
		r.index = idx[i].Key
		held = append(held, r)
	}
	return held, dangling, alsoKVs, nil
}

// GC releases this host's allocations of front end kind on network whose
// owner is not in valid, and returns them. Other hosts' allocations, and
// other front ends' owners, are never read or touched, so GCs of several
// hosts never conflict. It reads this host's owners of the network (two
// round trips, see hostOwners) and releases the stale ones several to a
// commit; it goes through every stale owner even when one fails, and
// returns the joined errors.
func (a *Allocator) GC(ctx context.Context, kind Kind, network string, valid []Owner) ([]Allocation, error) {
	if !kind.Valid() || network == "" || strings.Contains(network, "/") {
		return nil, fmt.Errorf("%w: GC needs a front end kind and a network name", ErrInvalid)
	}
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	if err := a.ensureLayout(ctx); err != nil {
		return nil, err
	}
	keep := map[string]bool{}
	for _, o := range valid {
		keep[o.String()] = true
	}
	held, dangling, seen, err := a.hostOwnersAnd(ctx, a.host, kind, network, a.seenKey()...)
	if err != nil {
		return nil, err
	}
	var stale []ownerRead
	for _, r := range held {
		if !keep[r.owner.String()] {
			stale = append(stale, r)
		}
	}
	if len(stale) == 0 && len(dangling) == 0 && len(seen) > 0 {
		a.touch(ctx, seen[0]) // a GC that releases nothing commits nothing
	}
	released, err := a.releaseOwners(ctx, stale)
	return released, errors.Join(err, a.dropIndex(ctx, dangling))
}

// Usage reports how full pool is.
func (a *Allocator) Usage(ctx context.Context, pool string) (Usage, error) {
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	def, err := a.Definition(ctx, pool)
	if err != nil {
		return Usage{}, err
	}
	// Definition read the layout.
	kvs, err := a.st.Scan(ctx, hostPrefix(pool), store.PrefixEnd(hostPrefix(pool)), 0)
	if err != nil {
		return Usage{}, err
	}
	u := Usage{Pool: pool}
	for _, kv := range kvs {
		var hs hostState
		if err := json.Unmarshal(kv.Value, &hs); err != nil {
			return Usage{}, fmt.Errorf("%s: corrupt host state: %w", kv.Key, err)
		}
		u.Used += hs.Used
		hu := HostUsage{Host: strings.TrimPrefix(kv.Key, hostPrefix(pool)), Used: hs.Used}
		if hs.Seen != 0 {
			hu.LastSeen = time.Unix(hs.Seen, 0)
		}
		u.Hosts = append(u.Hosts, hu)
	}
	c := capacityOf(segmentsOf(def))
	u.Capacity = c.String()
	u.Free = c.cmp(u128{lo: u.Used}) > 0
	if u.Free {
		left := c.sub(u128{lo: u.Used})
		u.Available = left.lo
		if left.hi != 0 {
			u.Available = ^uint64(0)
		}
	}
	return u, nil
}

// RingOf returns pool's ring as stored (all unowned before first use).
func (a *Allocator) RingOf(ctx context.Context, pool string) (Ring, error) {
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	kvs, err := a.get(ctx, defKey(pool))
	if err != nil {
		return Ring{}, err
	}
	def, err := decodeDef(pool, kvs[0])
	if err != nil {
		return Ring{}, err
	}
	r, err := a.poolRing(ctx, pool, def)
	if err != nil {
		return Ring{}, err
	}
	if err := r.check(); err != nil {
		return Ring{}, fmt.Errorf("pool %s: %w", pool, err)
	}
	return r.view(pool), nil
}

// HolderOf returns the allocation that holds addr in pool, and false when
// the address is free. An address held for a released reservation comes
// back as an Allocation with no container (Owner has only Kind and
// Network) and Reservation set. It costs two reads whatever the pool's size.
func (a *Allocator) HolderOf(ctx context.Context, pool string, addr netip.Addr) (Allocation, bool, error) {
	if err := validName("pool name", pool); err != nil {
		return Allocation{}, false, err
	}
	if !addr.IsValid() {
		return Allocation{}, false, fmt.Errorf("%w: no address given", ErrInvalid)
	}
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	kvs, err := a.get(ctx, addrKey(pool, toU128(addr), addr.Is4()))
	if err != nil || !kvs[0].Exists() {
		return Allocation{}, false, err
	}
	h := parseHolder(kvs[0].Value)
	if h.IsHold() {
		if h.expired(a.now()) {
			return Allocation{}, false, nil
		}
		return Allocation{Owner: Owner{Kind: h.HoldKind, Network: h.HoldNetwork}, Host: h.Host, Reservation: h.HoldName,
			Addrs: []Assigned{{Pool: pool, Role: RoleIP, Addr: addr}}}, true, nil
	}
	owner, ok := parseOwner(h.Owner)
	if !ok {
		return Allocation{}, false, fmt.Errorf("%s: unparsable holder %q", kvs[0].Key, h.Owner)
	}
	return a.lookup(ctx, owner)
}

// HasRoom reports whether this host can allocate need addresses in pool
// (its STATUS): true at once when its own ranges hold need free
// addresses, read from its own host state and the definition alone (one
// round trip, whatever the number of hosts); otherwise Usage decides, as
// a claim would find the space elsewhere (it reads every host state of
// the pool: only a host whose own ranges are full pays it). u is Usage's
// answer then, and only this host's figures otherwise.
func (a *Allocator) HasRoom(ctx context.Context, pool string, need uint64) (ok bool, u Usage, err error) {
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	kvs, err := a.get(ctx, defKey(pool), hostKey(pool, a.host))
	if err != nil {
		return false, Usage{}, err
	}
	def, err := decodeDef(pool, kvs[0])
	if err != nil {
		return false, Usage{}, err
	}
	if kvs[1].Exists() {
		var hs hostState
		if err := decodeHostState(kvs[1].Value, &hs); err != nil {
			return false, Usage{}, fmt.Errorf("%s: corrupt host state: %w", kvs[1].Key, err)
		}
		capa := capacityOf(clipAll(hs.spans(), dynamicSegmentsOf(def)))
		if capa.cmp(u128{lo: hs.Used}) > 0 && capa.sub(u128{lo: hs.Used}).cmp(u128{lo: need}) >= 0 {
			return true, Usage{Pool: pool, Used: hs.Used, Capacity: capacityOf(segmentsOf(def)).String(), Free: true}, nil
		}
	}
	u, err = a.Usage(ctx, pool)
	if err != nil {
		return false, Usage{}, err
	}
	return u.Available >= need, u, nil
}
