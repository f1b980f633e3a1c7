package pool

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"slices"
	"time"

	"github.com/ringipam/ringipam/pkg/store"
)

// Release frees everything owner holds, in one transaction, and reports what
// was released. Releasing an owner that holds nothing succeeds with false.
// When the owner carried a reservation name, its addresses stay held for
// that name for the reservation hold (WithReservationHold) instead of
// becoming free.
func (a *Allocator) Release(ctx context.Context, owner Owner) (Allocation, bool, error) {
	if err := owner.Validate(); err != nil {
		return Allocation{}, false, err
	}
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	kvs, err := a.get(ctx, ownerKey(owner))
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
	var ks keyset
	var pools []string
	for _, x := range rec.Addrs {
		ks.add(addrKey(x.Pool, toU128(x.Addr), x.Addr.Is4()))
		if !slices.Contains(pools, x.Pool) {
			pools = append(pools, x.Pool)
			ks.add(hostKey(x.Pool, rec.Host))
		}
	}
	resvK := ""
	if rec.Reservation != "" {
		resvK = resvKey(owner.Kind, owner.Network, rec.Reservation)
		ks.add(resvK)
	}
	got, err := a.st.Get(ctx, ks.keys...)
	if err != nil {
		return Allocation{}, false, err
	}
	conds := []store.Cond{store.Unchanged(ownerKV)}
	ops := []store.Op{store.Delete(ownerKey(owner))}

	// A reservation this owner holds keeps its addresses for the hold.
	var resv reservation
	var resvKV store.KV
	hold := false
	until := a.now().Add(a.hold)
	if resvK != "" {
		resvKV = ks.kv(got, resvK)
		if resvKV.Exists() && json.Unmarshal(resvKV.Value, &resv) == nil && resv.Owner == owner.String() {
			hold = a.hold > 0
			resv.Owner = ""
			resv.Until = 0
			if hold {
				resv.Until = until.Unix()
			}
			b, _ := json.Marshal(resv)
			conds = append(conds, store.Unchanged(resvKV))
			ops = append(ops, store.Put(resvKV.Key, b))
		}
	}
	freed := map[string]uint64{}
	for _, x := range rec.Addrs {
		kv := ks.kv(got, addrKey(x.Pool, toU128(x.Addr), x.Addr.Is4()))
		if !kv.Exists() || parseHolder(kv.Value).Owner != owner.String() {
			continue // not ours (should not happen): never free another owner's address
		}
		conds = append(conds, store.Unchanged(kv))
		if hold {
			ops = append(ops, store.Put(kv.Key, holdHolder(rec.Host, owner.Kind, owner.Network, rec.Reservation, until).encode()))
		} else {
			ops = append(ops, store.Delete(kv.Key))
		}
		freed[x.Pool]++
	}
	for _, p := range pools {
		if freed[p] == 0 {
			continue
		}
		kv := ks.kv(got, hostKey(p, rec.Host))
		var hs hostState
		if kv.Exists() {
			if err := json.Unmarshal(kv.Value, &hs); err != nil {
				return Allocation{}, false, fmt.Errorf("pool %s host %s: corrupt state: %w", p, rec.Host, err)
			}
		}
		hs.Used -= min(hs.Used, freed[p])
		b, _ := json.Marshal(hs)
		conds = append(conds, store.Unchanged(kv))
		ops = append(ops, store.Put(kv.Key, b))
	}
	if err := a.st.Commit(ctx, conds, ops); err != nil {
		return Allocation{}, false, err
	}
	a.stats.commits.Add(1)
	return rec, true, nil
}

// Hold is an address kept for a released reservation.
type Hold struct {
	Pool        string
	Addr        netip.Addr
	Host        string
	Kind        Kind
	Network     string
	Reservation string
	Until       time.Time
}

// DropHold frees the addresses held for reservation name of (kind, network)
// at once, and forgets the name unless an owner holds it now. It returns the
// holds it dropped; a name with no hold drops nothing and succeeds.
func (a *Allocator) DropHold(ctx context.Context, kind Kind, network, name string) ([]Hold, error) {
	if !kind.Valid() || network == "" || name == "" {
		return nil, fmt.Errorf("%w: DropHold needs a kind, a network and a reservation name", ErrInvalid)
	}
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	var dropped []Hold
	err := a.run(ctx, func(int) error {
		dropped = nil
		kvs, err := a.get(ctx, resvKey(kind, network, name))
		if err != nil {
			return err
		}
		rkv := kvs[0]
		if !rkv.Exists() {
			return nil
		}
		var r reservation
		if err := json.Unmarshal(rkv.Value, &r); err != nil {
			return fmt.Errorf("reservation %s: corrupt: %w", name, err)
		}
		var keys []string
		for _, x := range r.Addrs {
			keys = append(keys, addrKey(x.Pool, toU128(x.Addr), x.Addr.Is4()))
		}
		held, err := a.st.Get(ctx, keys...)
		if err != nil {
			return err
		}
		conds := []store.Cond{store.Unchanged(rkv)}
		var ops []store.Op
		for i, kv := range held {
			h := parseHolder(kv.Value)
			if !kv.Exists() || !h.heldFor(kind, network, name) {
				continue
			}
			conds = append(conds, store.Unchanged(kv))
			ops = append(ops, store.Delete(kv.Key))
			dropped = append(dropped, Hold{Pool: r.Addrs[i].Pool, Addr: r.Addrs[i].Addr, Host: h.Host, Kind: kind, Network: network, Reservation: name, Until: h.Until})
		}
		if r.Owner == "" {
			ops = append(ops, store.Delete(rkv.Key))
		} else if len(ops) == 0 {
			return nil
		}
		return a.st.Commit(ctx, conds, ops)
	})
	return dropped, err
}
