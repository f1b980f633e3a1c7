package pool

import (
	"context"
	"encoding/json"
	"errors"
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
	ks.add(a.seenKey()...)
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
		if err == nil {
			a.touch(ctx, known[statusKey(a.host)]) // a DEL of nothing commits nothing
		}
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
		r, ok, err := readOwner(owner, known[ownerKey(owner)])
		if err != nil || !ok {
			found = false
			return err
		}
		got, err := a.releaseRecords(ctx, []ownerRead{r}, known, releaseMode{})
		if err != nil {
			return err
		}
		released, found = got[0], true
		return nil
	})
	return released, found, err
}

// ownerRead is an owner's record as read: its key and revision, and the
// record decoded.
type ownerRead struct {
	owner Owner
	kv    store.KV
	rec   Allocation
	index string // the host index key it was found by (hostOwners)
}

// readOwner decodes owner's record kv as read; false when it is absent.
func readOwner(owner Owner, kv store.KV) (ownerRead, bool, error) {
	rec, ok, err := decodeOwner(owner, kv)
	if err != nil || !ok {
		return ownerRead{}, false, err
	}
	return ownerRead{owner: owner, kv: kv, rec: rec}, true, nil
}

// releaseMode is how a release is recorded. A release (the zero value)
// counts the freed addresses off their hosts' states and records release
// or hold events. A reclaim of a gone host's owner keeps no count (the
// tombstoning dropped the host's state), records reclaim events, and
// carries the reclaim's guard conditions.
type releaseMode struct {
	reclaim bool
	guard   []store.Cond
}

// releaseRecords frees what each record of owners (as read, all present)
// lists, in one commit conditioned on every record being unchanged, and
// returns the records released, in order. known holds keys already read;
// the others the commit depends on (host states, reservations) are read
// now, in one round trip.
func (a *Allocator) releaseRecords(ctx context.Context, owners []ownerRead, known map[string]store.KV, mode releaseMode) ([]Allocation, error) {
	var missing []string
	for _, k := range releaseReads(owners, mode) {
		if _, ok := known[k]; !ok {
			missing = append(missing, k)
		}
	}
	if len(missing) > 0 {
		got, err := a.st.Get(ctx, missing...)
		if err != nil {
			return nil, err
		}
		for _, kv := range got {
			known[kv.Key] = kv
		}
	}
	conds, ops, ownPools, err := a.releaseCommit(owners, known, mode)
	if err != nil {
		return nil, err
	}
	var rev int64
	if len(ownPools) > 0 {
		rev, err = a.commitNoted(ctx, conds, ops)
	} else {
		err = a.st.Commit(ctx, conds, ops)
	}
	if err != nil {
		return nil, err
	}
	a.stats.commits.Add(1)
	a.noteRelease(ownPools, ops, rev)
	out := make([]Allocation, len(owners))
	for i, o := range owners {
		out[i] = o.rec
	}
	return out, nil
}

// releaseOwners releases owners as read (present), as many to a commit as
// store.MaxOps allows, each commit under the lock of its pools and after
// one read of the keys it decides on (see releaseRecords). An owner changed
// meanwhile is read again; one gone meanwhile, or now another host's, is
// left alone. It goes through every owner even when one fails (a failed
// commit is tried again owner by owner, so one owner's failure is its own)
// and returns what it released with the joined errors.
func (a *Allocator) releaseOwners(ctx context.Context, owners []ownerRead) ([]Allocation, error) {
	var released []Allocation
	var errs []error
	for len(owners) > 0 {
		n := 1
		for n < len(owners) && releaseSize(owners[:n+1]) <= store.MaxOps {
			n++
		}
		batch := owners[:n]
		owners = owners[n:]
		got, err := a.releaseBatch(ctx, batch)
		if err != nil && len(batch) > 1 {
			got, err = nil, nil
			for _, o := range batch {
				one, oerr := a.releaseBatch(ctx, []ownerRead{o})
				got = append(got, one...)
				if oerr != nil {
					err = errors.Join(err, fmt.Errorf("release %s: %w", o.owner, oerr))
				}
			}
		} else if err != nil {
			err = fmt.Errorf("release %s: %w", batch[0].owner, err)
		}
		released = append(released, got...)
		errs = append(errs, err)
	}
	return released, errors.Join(errs...)
}

// releaseBatch releases batch in one commit (see releaseOwners).
func (a *Allocator) releaseBatch(ctx context.Context, batch []ownerRead) ([]Allocation, error) {
	var pools []string
	for _, o := range batch {
		for _, x := range o.rec.Addrs {
			if !slices.Contains(pools, x.Pool) {
				pools = append(pools, x.Pool)
			}
		}
	}
	unlock, err := a.lockPools(ctx, pools)
	if err != nil {
		return nil, err
	}
	defer unlock()
	var out []Allocation
	err = a.run(ctx, func(attempt int) error {
		out = nil
		if attempt > 0 {
			keys := make([]string, len(batch))
			for i, o := range batch {
				keys[i] = o.kv.Key
			}
			kvs, err := a.st.Get(ctx, keys...)
			if err != nil {
				return err
			}
			var again []ownerRead
			for i, kv := range kvs {
				r, ok, err := readOwner(batch[i].owner, kv)
				if err != nil {
					return err
				}
				if ok && r.rec.Host == batch[i].rec.Host {
					again = append(again, r)
				}
			}
			batch = again
		}
		if len(batch) == 0 {
			return nil
		}
		known := map[string]store.KV{}
		for _, o := range batch {
			known[o.kv.Key] = o.kv
		}
		got, err := a.releaseRecords(ctx, batch, known, releaseMode{})
		out = got
		return err
	})
	return out, err
}

// dropIndex deletes the index keys of dangling (see hostOwners), each on
// condition that its owner's record is still as read; one changed meanwhile
// is left for the next call.
func (a *Allocator) dropIndex(ctx context.Context, dangling []ownerRead) error {
	b := pairBatch{commit: func(conds []store.Cond, ops []store.Op) error {
		if err := a.st.Commit(ctx, conds, ops); !errors.Is(err, store.ErrConflict) {
			return err
		}
		return nil
	}}
	for _, d := range dangling {
		if err := b.add(store.Cond{Key: ownerKey(d.owner), Revision: d.kv.Revision}, store.Delete(d.index)); err != nil {
			return err
		}
	}
	return b.flush()
}

// releaseReads are the keys a release of owners decides on besides their
// records: the state of each (pool, host) they hold addresses in (unless
// mode is a reclaim), and the reservations they name.
func releaseReads(owners []ownerRead, mode releaseMode) []string {
	var ks keyset
	for _, o := range owners {
		for _, x := range o.rec.Addrs {
			if !mode.reclaim {
				ks.add(hostKey(x.Pool, o.rec.Host))
			}
		}
		if o.rec.Reservation != "" {
			ks.add(resvKey(o.owner.Kind, o.owner.Network, o.rec.Reservation))
		}
	}
	return ks.keys
}

// releaseSize bounds the conditions plus operations of releaseCommit for
// owners, so callers can keep a commit within store.MaxOps.
func releaseSize(owners []ownerRead) int {
	n := 2 * len(releaseReads(owners, releaseMode{})) // a condition and a write each
	for _, o := range owners {
		n += 3 + 2*len(o.rec.Addrs) // record: condition, delete, index delete; per address: key, history
	}
	return n
}

// releaseCommit plans the release of owners on the state in known (which
// holds every key of releaseReads): the conditions, the writes, and the
// pools of this host whose state it changes.
func (a *Allocator) releaseCommit(owners []ownerRead, known map[string]store.KV, mode releaseMode) ([]store.Cond, []store.Op, []string, error) {
	conds := slices.Clone(mode.guard)
	var ops []store.Op
	var states keyset // (pool, host) states, in first-seen order
	freed := map[string]uint64{}
	until := a.now().Add(a.hold)
	for _, o := range owners {
		rec, owner := o.rec, o.owner
		conds = append(conds, store.Unchanged(o.kv))
		ops = append(ops, store.Delete(o.kv.Key), store.Delete(hostOwnerKey(rec.Host, owner)))
		// A reservation this owner holds keeps its addresses for the hold.
		hold := false
		if rec.Reservation != "" {
			resvKV := known[resvKey(owner.Kind, owner.Network, rec.Reservation)]
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
		for _, x := range rec.Addrs {
			key := addrKey(x.Pool, toU128(x.Addr), x.Addr.Is4())
			ev := Event{Time: a.now(), What: EventRelease, Owner: owner.String(), Host: rec.Host, Reserv: rec.Reservation}
			if hold {
				ops = append(ops, store.Put(key, holdHolder(rec.Host, owner.Kind, owner.Network, rec.Reservation, until).encode()))
				ev.What = EventHold
			} else {
				ops = append(ops, store.Delete(key))
			}
			if mode.reclaim {
				ev.What = EventReclaim
			}
			ops = append(ops, historyOp(x.Pool, x.Addr, ev))
			if mode.reclaim {
				continue
			}
			hk := hostKey(x.Pool, rec.Host)
			states.add(hk)
			freed[hk]++
		}
	}
	var ownPools []string
	for _, hk := range states.keys {
		kv := known[hk]
		hs := hostState{Layout: stateLayout} // absent: the host owns no live range
		if kv.Exists() {
			hs = hostState{}
			if err := decodeHostState(kv.Value, &hs); err != nil {
				return nil, nil, nil, fmt.Errorf("%s: corrupt host state: %w", hk, err)
			}
		}
		hs.Used -= min(hs.Used, freed[hk])
		if pool, host := parseHostKey(hk); host == a.host {
			hs.Seen = a.now().Unix()
			ownPools = append(ownPools, pool)
		}
		if !a.broken.noHostCond {
			conds = append(conds, store.Cond{Key: hk, Revision: kv.Revision})
		}
		pool, host := parseHostKey(hk)
		ops = append(ops, putHostState(pool, host, &hs)...)
	}
	return conds, ops, ownPools, nil
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
