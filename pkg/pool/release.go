package pool

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"

	"github.com/ringipam/ringipam/pkg/store"
)

// Release frees everything owner holds, in one transaction, and reports what
// was released. Releasing an owner that holds nothing succeeds with false.
// A reservation the owner held keeps remembering its addresses.
func (a *Allocator) Release(ctx context.Context, owner Owner) (Allocation, bool, error) {
	if err := owner.Validate(); err != nil {
		return Allocation{}, false, err
	}
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	kvs, err := a.st.Get(ctx, ownerKey(owner))
	if err != nil {
		return Allocation{}, false, err
	}
	cur, ok, err := decodeOwner(owner, kvs[0])
	if err != nil || !ok {
		return Allocation{}, false, err
	}
	var pools []string
	for _, x := range cur.Addrs {
		pools = append(pools, x.Pool)
	}
	unlock, err := a.lockPools(ctx, pools)
	if err != nil {
		return Allocation{}, false, err
	}
	defer unlock()
	// The first attempt commits against the record read above (the commit
	// is conditioned on it, so a change while waiting for the lock is a
	// conflict); later attempts read it again.
	ownerKV := kvs[0]
	var released Allocation
	var found bool
	err = a.run(ctx, func(attempt int) error {
		if attempt > 0 {
			kvs, err := a.st.Get(ctx, ownerKey(owner))
			if err != nil {
				return err
			}
			ownerKV = kvs[0]
		}
		var err error
		released, found, err = a.releaseRecord(ctx, owner, ownerKV)
		return err
	})
	return released, found, err
}

// releaseRecord frees what the owner record ownerKV lists, in one commit
// conditioned on that record being unchanged.
func (a *Allocator) releaseRecord(ctx context.Context, owner Owner, ownerKV store.KV) (Allocation, bool, error) {
	rec, ok, err := decodeOwner(owner, ownerKV)
	if err != nil || !ok {
		return Allocation{}, false, err
	}
	var keys []string
	var pools []string
	for _, x := range rec.Addrs {
		keys = append(keys, addrKey(x.Pool, toU128(x.Addr), x.Addr.Is4()))
	}
	for _, x := range rec.Addrs {
		if !slices.Contains(pools, x.Pool) {
			pools = append(pools, x.Pool)
			keys = append(keys, hostKey(x.Pool, rec.Host))
		}
	}
	if rec.Reservation != "" {
		keys = append(keys, resvKey(owner.Network, rec.Reservation))
	}
	got, err := a.st.Get(ctx, keys...)
	if err != nil {
		return Allocation{}, false, err
	}
	conds := []store.Cond{store.Unchanged(ownerKV)}
	ops := []store.Op{store.Delete(ownerKey(owner))}
	freed := map[string]uint64{}
	for i, x := range rec.Addrs {
		kv := got[i]
		if !kv.Exists() {
			continue
		}
		if _, holder := parseHolder(kv.Value); holder != owner.String() {
			continue // not ours (should not happen): never free another owner's address
		}
		conds = append(conds, store.Unchanged(kv))
		ops = append(ops, store.Delete(kv.Key))
		freed[x.Pool]++
	}
	for i, p := range pools {
		kv := got[len(rec.Addrs)+i]
		var hs hostState
		if kv.Exists() {
			if err := json.Unmarshal(kv.Value, &hs); err != nil {
				return Allocation{}, false, fmt.Errorf("pool %s host %s: corrupt state: %w", p, rec.Host, err)
			}
		}
		if freed[p] == 0 {
			continue
		}
		hs.Used -= min(hs.Used, freed[p])
		b, _ := json.Marshal(hs)
		conds = append(conds, store.Unchanged(kv))
		ops = append(ops, store.Put(kv.Key, b))
	}
	if rec.Reservation != "" {
		kv := got[len(got)-1]
		var r reservation
		if kv.Exists() {
			if err := json.Unmarshal(kv.Value, &r); err == nil && r.Owner == owner.String() {
				r.Owner = ""
				b, _ := json.Marshal(r)
				conds = append(conds, store.Unchanged(kv))
				ops = append(ops, store.Put(kv.Key, b))
			}
		}
	}
	if err := a.st.Commit(ctx, conds, ops); err != nil {
		return Allocation{}, false, err
	}
	a.stats.commits.Add(1)
	return rec, true, nil
}
