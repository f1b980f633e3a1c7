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
// becoming free. It costs three round trips; ReleaseWith, given the right
// hint, two.
func (a *Allocator) Release(ctx context.Context, owner Owner) (Allocation, bool, error) {
	return a.ReleaseWith(ctx, owner, ReleaseHint{})
}

// ReleaseHint names what a caller expects the owner to hold, so that the
// first read of a release also reads the keys its commit depends on (the
// host states of those pools on this host, the reservation). A wrong or
// empty hint costs one more read, never a wrong release.
type ReleaseHint struct {
	Pools       []string
	Reservation string
}

// ReleaseWith is Release with a hint (see ReleaseHint).
//
// It rests on one invariant of the layout: an address key listed in an
// owner record is written only in a commit that also writes that record.
// So while the record is unchanged (the commit's condition) its address
// keys are the owner's, and the release deletes (or turns into holds)
// them without reading them.
func (a *Allocator) ReleaseWith(ctx context.Context, owner Owner, hint ReleaseHint) (Allocation, bool, error) {
	if err := owner.Validate(); err != nil {
		return Allocation{}, false, err
	}
	if err := validReservation(hint.Reservation); err != nil {
		return Allocation{}, false, err
	}
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	var ks keyset
	ks.add(ownerKey(owner))
	var hinted []string
	for _, p := range hint.Pools {
		if validName("pool name", p) == nil {
			ks.add(hostKey(p, a.host))
			hinted = append(hinted, p)
		}
	}
	if hint.Reservation != "" {
		ks.add(resvKey(owner.Kind, owner.Network, hint.Reservation))
	}
	// The pools the hint names are locked before the read, so that the read
	// and the commit share one hold of the store; the owner's record decides,
	// and pools it names beyond the hint are locked once it is known.
	unlock := func() {}
	defer func() { unlock() }()
	lock := func(pools []string) error {
		unlock()
		unlock = func() {}
		u, err := a.lockPools(ctx, pools)
		if err == nil {
			unlock = u
		}
		return err
	}
	if len(hinted) > 0 {
		if err := lock(hinted); err != nil {
			return Allocation{}, false, err
		}
	}
	kvs, err := a.get(ctx, ks.keys...)
	if err != nil {
		return Allocation{}, false, err
	}
	known := map[string]store.KV{}
	for _, kv := range kvs {
		known[kv.Key] = kv
	}
	cur, ok, err := decodeOwner(owner, known[ownerKey(owner)])
	if err != nil || !ok {
		return Allocation{}, false, err
	}
	pools := slices.Clone(hinted)
	for _, x := range cur.Addrs {
		if !slices.Contains(hinted, x.Pool) {
			pools = append(pools, x.Pool)
		}
	}
	if len(pools) > len(hinted) {
		if err := lock(pools); err != nil {
			return Allocation{}, false, err
		}
	}
	// The first attempt commits against what was read above (the commit is
	// conditioned on it, so a change while waiting for the lock is a
	// conflict); later attempts read again.
	var released Allocation
	var found bool
	err = a.run(ctx, func(attempt int) error {
		if attempt > 0 {
			clear(known)
			kvs, err := a.st.Get(ctx, ownerKey(owner))
			if err != nil {
				return err
			}
			known[kvs[0].Key] = kvs[0]
		}
		var err error
		released, found, err = a.releaseRecord(ctx, owner, known)
		return err
	})
	return released, found, err
}

// releaseRecord frees what owner's record (in known) lists, in one commit
// conditioned on that record being unchanged. known holds keys already
// read; the others the commit depends on are read now.
func (a *Allocator) releaseRecord(ctx context.Context, owner Owner, known map[string]store.KV) (Allocation, bool, error) {
	ownerKV := known[ownerKey(owner)]
	rec, ok, err := decodeOwner(owner, ownerKV)
	if err != nil || !ok {
		return Allocation{}, false, err
	}
	var pools []string
	var need []string
	for _, x := range rec.Addrs {
		if !slices.Contains(pools, x.Pool) {
			pools = append(pools, x.Pool)
			need = append(need, hostKey(x.Pool, rec.Host))
		}
	}
	resvK := ""
	if rec.Reservation != "" {
		resvK = resvKey(owner.Kind, owner.Network, rec.Reservation)
		need = append(need, resvK)
	}
	var missing []string
	for _, k := range need {
		if _, ok := known[k]; !ok {
			missing = append(missing, k)
		}
	}
	if len(missing) > 0 {
		got, err := a.st.Get(ctx, missing...)
		if err != nil {
			return Allocation{}, false, err
		}
		for _, kv := range got {
			known[kv.Key] = kv
		}
	}
	conds := []store.Cond{store.Unchanged(ownerKV)}
	ops := []store.Op{store.Delete(ownerKey(owner))}

	// A reservation this owner holds keeps its addresses for the hold.
	hold := false
	until := a.now().Add(a.hold)
	if resvK != "" {
		resvKV := known[resvK]
		var resv reservation
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
		key := addrKey(x.Pool, toU128(x.Addr), x.Addr.Is4())
		ev := Event{Time: a.now(), What: EventRelease, Owner: owner.String(), Host: rec.Host, Reserv: rec.Reservation}
		if hold {
			ops = append(ops, store.Put(key, holdHolder(rec.Host, owner.Kind, owner.Network, rec.Reservation, until).encode()))
			ev.What = EventHold
		} else {
			ops = append(ops, store.Delete(key))
		}
		ops = append(ops, historyOp(x.Pool, x.Addr, ev))
		freed[x.Pool]++
	}
	for _, p := range pools {
		kv := known[hostKey(p, rec.Host)]
		var hs hostState
		if kv.Exists() {
			if err := decodeHostState(kv.Value, &hs); err != nil {
				return Allocation{}, false, fmt.Errorf("pool %s host %s: corrupt state: %w", p, rec.Host, err)
			}
		}
		hs.Used -= min(hs.Used, freed[p])
		if rec.Host == a.host {
			hs.Seen = a.now().Unix()
		}
		b := encodeHostState(hs)
		conds = append(conds, store.Unchanged(kv))
		ops = append(ops, store.Put(kv.Key, b))
	}
	if err := a.st.Commit(ctx, conds, ops); err != nil {
		return Allocation{}, false, err
	}
	a.stats.commits.Add(1)
	if rec.Host == a.host {
		a.noteRelease(pools, ops)
	}
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
