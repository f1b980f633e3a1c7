package pool

import (
	"context"
	"fmt"
	"slices"

	"github.com/ringipam/ringipam/pkg/store"
)

// Shared owners (the Docker driver's --aux-address: every host's network on
// a pool reserves the same address).
//
// A shared owner's record lists its holders (Allocation.Holders): every
// host whose network reserves it. One of them, the record's Host, counts
// its addresses and owns the ranges they lie in, as for any owner; every
// holder has the owner in its host index, so its reclaim finds it. A
// holder's claim goes when it unshares (its network released the address)
// or is reclaimed; the addresses are freed only with the last claim. When
// the counting host's claim goes and others remain, the next holder takes
// the record over in the same commit: its count, its index key, the
// address keys and a one-address range of the ring move to it, so every
// invariant Audit checks holds between commits.
//
// Records written before Holders existed (no holders) are held by their
// Host alone; Share adopts extra holders into them (see Share's adopt).

// Share reserves w (a static address: w.Addr must be set) for owner on
// behalf of this host's network, jointly with every host that shares it
// already: the first Share allocates it, later Shares (of any host) join
// the holders; a Share by a holder changes nothing. adopt names further
// holders to record, for callers that kept the holders elsewhere before
// (the Docker driver's markers). It returns the record as committed.
func (a *Allocator) Share(ctx context.Context, owner Owner, w Want, adopt ...string) (Allocation, error) {
	if !w.Addr.IsValid() {
		return Allocation{}, fmt.Errorf("%w: a shared owner needs a static address", ErrInvalid)
	}
	for _, h := range adopt {
		if err := validName("host", h); err != nil {
			return Allocation{}, err
		}
	}
	al, err := a.Allocate(ctx, Request{Owner: owner, Wants: []Want{w}, shared: true})
	if err != nil {
		return Allocation{}, err
	}
	if al.HeldBy(a.host) && len(adopt) == 0 {
		return al, nil
	}
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	err = a.run(ctx, func(int) error {
		kvs, err := a.get(ctx, ownerKey(owner))
		if err != nil {
			return err
		}
		rec, ok, err := decodeOwner(owner, kvs[0])
		if err != nil {
			return err
		}
		if !ok {
			// Its last holder released it between the two reads.
			return fmt.Errorf("%w: shared owner %s was released meanwhile; ask again", ErrTryAgain, owner)
		}
		if got, _ := rec.Addr(w.Pool, w.Role); got != w.Addr {
			return &ExistsError{Owner: owner.String(), Holds: addrsOf(rec), Asked: w.Addr}
		}
		holders := slices.Clone(rec.holders())
		var ops []store.Op
		for _, h := range append([]string{a.host}, adopt...) {
			if !slices.Contains(holders, h) {
				holders = append(holders, h)
				ops = append(ops, store.Put(hostOwnerKey(h, owner), []byte{}))
			}
		}
		al = rec
		if len(ops) == 0 && len(rec.Holders) > 0 {
			return nil
		}
		al.Holders = holders
		b, err := encodeAllocation(al)
		if err != nil {
			return err
		}
		ops = append(ops, store.Put(kvs[0].Key, b))
		return a.st.Commit(ctx, []store.Cond{store.Unchanged(kvs[0])}, ops)
	})
	return al, err
}

// Unshare drops this host's claim on shared owner: the last claim releases
// its addresses (as Release does), an earlier one only leaves the holders.
// held is false when this host held no claim (nothing changed); released
// says whether the addresses were freed.
func (a *Allocator) Unshare(ctx context.Context, owner Owner) (rec Allocation, held, released bool, err error) {
	if err := owner.Validate(); err != nil {
		return Allocation{}, false, false, err
	}
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	err = a.run(ctx, func(int) error {
		held, released = false, false
		kvs, err := a.get(ctx, ownerKey(owner))
		if err != nil {
			return err
		}
		r, ok, err := readOwner(owner, kvs[0])
		if err != nil || !ok || !r.rec.HeldBy(a.host) {
			return err
		}
		rec, held = r.rec, true
		if len(without(r.rec.holders(), a.host)) == 0 {
			if _, err := a.releaseRecords(ctx, []ownerRead{r}, map[string]store.KV{r.kv.Key: r.kv}, releaseMode{}); err != nil {
				return err
			}
			released = true
			return nil
		}
		return a.dropHolder(ctx, r, a.host, releaseMode{})
	})
	return rec, held, released, err
}

func without(hosts []string, host string) []string {
	return slices.DeleteFunc(slices.Clone(hosts), func(h string) bool { return h == host })
}

// dropHolder removes host's claim from a shared owner (as read in r) that
// other holders keep, in one commit conditioned on the record and on
// mode.guard. When host is the record's Host, the next holder takes it over
// (see the section comment); host's count is lowered unless mode is a
// reclaim (whose tombstoning dropped host's state).
func (a *Allocator) dropHolder(ctx context.Context, r ownerRead, host string, mode releaseMode) error {
	rec := r.rec
	rest := without(rec.holders(), host)
	if len(rest) == 0 {
		return fmt.Errorf("%w: dropHolder of %s's last holder", ErrInvalid, r.owner)
	}
	next := rec
	next.Holders = rest
	conds := append(slices.Clone(mode.guard), store.Unchanged(r.kv))
	ops := []store.Op{store.Delete(hostOwnerKey(host, r.owner))}
	if rec.Host == host {
		to := rest[0]
		next.Host = to
		var ks keyset
		for _, x := range rec.Addrs {
			ks.add(defKey(x.Pool), hostKey(x.Pool, to))
			if !mode.reclaim {
				ks.add(hostKey(x.Pool, host))
			}
		}
		kvs, err := a.st.Get(ctx, ks.keys...)
		if err != nil {
			return err
		}
		// Each pool's ring transaction moves the addresses to the next
		// holder's ranges and keeps the two hosts' states: their ranges
		// and counts.
		txs := map[string]*ringTxn{}
		var order []string
		for _, x := range rec.Addrs {
			tx, ok := txs[x.Pool]
			if !ok {
				def, err := decodeDef(x.Pool, ks.kv(kvs, defKey(x.Pool)))
				if err != nil {
					return err
				}
				tx = a.newRingTxn(x.Pool, def)
				hosts := []string{to}
				if !mode.reclaim {
					hosts = append(hosts, host)
				}
				for _, h := range hosts {
					kv := ks.kv(kvs, hostKey(x.Pool, h))
					hs := hostState{Layout: stateLayout}
					if kv.Exists() {
						hs = hostState{}
						if err := decodeHostState(kv.Value, &hs); err != nil {
							return fmt.Errorf("%s: corrupt host state: %w", kv.Key, err)
						}
					}
					tx.seed(h, kv, hs, false)
					tx.hosts[h].dirty = true
				}
				txs[x.Pool] = tx
				order = append(order, x.Pool)
			}
			v := toU128(x.Addr)
			ops = append(ops, store.Put(addrKey(x.Pool, v, x.Addr.Is4()), ownerHolder(to, r.owner).encode()))
			if r, held, _, err := tx.at(ctx, v); err != nil {
				return err
			} else if held && (r.host != to || r.tomb) {
				if err := tx.assign(ctx, r, span{v, v}, to, false); err != nil {
					return err
				}
			} else if !held {
				b, _ := tx.blockOf(v)
				if err := tx.claimGap(ctx, span{v, v}, b, r, r.key != "", to); err != nil {
					return err
				}
			}
			tx.hosts[to].st.Used++
			if !mode.reclaim {
				if he := tx.hosts[host]; he.st != nil {
					he.st.Used -= min(he.st.Used, 1)
				}
			}
		}
		for _, p := range order {
			tx := txs[p]
			if he := tx.hosts[a.host]; he != nil && he.st != nil {
				he.st.Seen = a.now().Unix()
			}
			c, o := tx.finish()
			conds = append(conds, c...)
			ops = append(ops, o...)
		}
	}
	b, err := encodeAllocation(next)
	if err != nil {
		return err
	}
	ops = append(ops, store.Put(r.kv.Key, b))
	if err := a.st.Commit(ctx, conds, ops); err != nil {
		return err
	}
	a.stats.commits.Add(1)
	return nil
}
