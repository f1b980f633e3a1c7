package pool

import (
	"context"
	"fmt"
	"net/netip"
	"strings"

	"github.com/ringipam/ringipam/pkg/store"
)

// Check reads pool's whole state and returns every violated invariant, as
// sentences (nil when all hold):
//   - the ring's ranges cover the pool exactly once (no overlap, no gap);
//   - every held address is one the pool hands out and lies in a range its
//     host owns;
//   - no address is held by two owners: address keys and owner records agree;
//   - each host's used count equals the addresses it holds.
//
// It reads everything, so it is for tests and for operators (ringctl), not
// for hot paths.
func (a *Allocator) Check(ctx context.Context, pool string) ([]string, error) {
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	kvs, err := a.get(ctx, defKey(pool), registryKey)
	if err != nil {
		return nil, err
	}
	def, err := decodeDef(pool, kvs[0])
	if err != nil {
		return nil, err
	}
	r, ringErr := a.poolRing(ctx, pool, def)
	kvs = []store.KV{kvs[0], {}, kvs[1]}
	var bad []string
	if reg, err := decodeRegistry(kvs[2]); err != nil {
		bad = append(bad, err.Error())
	} else {
		listed := false
		for _, p := range reg.Pools {
			listed = listed || p.Name == pool
		}
		if !listed {
			bad = append(bad, "pool "+pool+" is not in the pool registry")
		}
		for _, o := range reg.overlaps() {
			if strings.Contains(o, " "+pool+" ") {
				bad = append(bad, o)
			}
		}
	}
	if ringErr != nil {
		bad = append(bad, "ring: "+ringErr.Error())
		return bad, nil
	}
	if err := r.check(); err != nil {
		bad = append(bad, "ring: "+err.Error())
		return bad, nil
	}
	held, err := a.st.Scan(ctx, addrPrefix(pool), store.PrefixEnd(addrPrefix(pool)), 0)
	if err != nil {
		return nil, err
	}
	owners, err := a.st.Scan(ctx, prefixOwner, store.PrefixEnd(prefixOwner), 0)
	if err != nil {
		return nil, err
	}
	hosts, err := a.st.Scan(ctx, hostPrefix(pool), store.PrefixEnd(hostPrefix(pool)), 0)
	if err != nil {
		return nil, err
	}
	faults, err := a.stateRangeFaults(ctx, pool, def, hosts)
	if err != nil {
		return nil, err
	}
	bad = append(bad, faults...)
	recs := map[string]Allocation{}
	for _, kv := range owners {
		var rec Allocation
		if err := decodeAllocation(kv.Value, &rec); err != nil {
			bad = append(bad, fmt.Sprintf("%s is corrupt: %v", kv.Key, err))
			continue
		}
		recs[rec.Owner.String()] = rec
	}
	holderOf := map[u128]string{}
	count := map[string]uint64{}
	is4 := def.is4()
	for _, kv := range held {
		v, ok := parseAddrKey(kv.Key)
		if !ok {
			bad = append(bad, "unparsable address key "+kv.Key)
			continue
		}
		addr := v.addr(is4)
		h := parseHolder(kv.Value)
		host, owner := h.Host, h.Owner
		if h.IsHold() {
			owner = "a hold for reservation " + h.HoldName
		}
		holderOf[v] = owner
		if !h.IsHold() {
			count[host]++
		}
		if !def.Contains(addr) {
			bad = append(bad, fmt.Sprintf("%s is held by %s but is not an address the pool hands out", addr, owner))
		}
		if t := r.ownerOf(v); t.Host != host {
			bad = append(bad, fmt.Sprintf("%s is held by %s on host %s but lies in a range of %q", addr, owner, host, t.Host))
		}
		if h.IsHold() {
			continue // a hold has no owner record; its reservation lists it
		}
		rec, ok := recs[owner]
		if !ok {
			bad = append(bad, fmt.Sprintf("%s is held by %s, which has no owner record", addr, owner))
		} else if got, ok := rec.addrIn(pool, addr); !ok || got != addr {
			bad = append(bad, fmt.Sprintf("%s is held by %s, whose record does not list it", addr, owner))
		}
	}
	for _, rec := range recs {
		for _, x := range rec.Addrs {
			if x.Pool != pool {
				continue
			}
			if h, ok := holderOf[toU128(x.Addr)]; !ok || h != rec.Owner.String() {
				bad = append(bad, fmt.Sprintf("%s lists %s, but the address is held by %q", rec.Owner, x.Addr, h))
			}
		}
	}
	for _, kv := range hosts {
		host := strings.TrimPrefix(kv.Key, hostPrefix(pool))
		var hs hostState
		if err := decodeHostState(kv.Value, &hs); err != nil {
			bad = append(bad, fmt.Sprintf("%s is corrupt: %v", kv.Key, err))
			continue
		}
		if hs.Used != count[host] {
			bad = append(bad, fmt.Sprintf("host %s counts %d used addresses but holds %d", host, hs.Used, count[host]))
		}
	}
	return bad, nil
}

func (a Allocation) addrIn(pool string, addr netip.Addr) (netip.Addr, bool) {
	for _, x := range a.Addrs {
		if x.Pool == pool && x.Addr == addr {
			return x.Addr, true
		}
	}
	return netip.Addr{}, false
}
