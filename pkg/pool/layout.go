package pool

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net"
	"slices"
	"strings"

	"github.com/ringipam/ringipam/pkg/store"
)

// layoutVersion is the store layout this code reads and writes. Version 1
// (no layoutKey) keyed owners as o/<network>/<container>/<ifname> with no
// front end, reservations as r/<network>/<name>, and had no pool registry.
// Version 2 added the owner's kind to owner keys, address holders and
// reservation keys, and the pool registry (registryKey). Version 3 adds
// each host's index of its owners (hostOwnerKey). Version 4 splits each
// pool's ring, one key g/<pool> in version 3, into one key per range
// (ranges.go) and lists each host's ranges in its host state; g/<pool>
// then holds movedMarker.
const layoutVersion = "4"

// ErrLayout: the store was written by a newer ringipam whose layout this
// code does not understand.
var ErrLayout = errors.New("unsupported store layout")

// get reads keys like store.Get, but the first read of an Allocator also
// reads the layout version in the same round trip and, on a store of an
// older layout, migrates it once before answering.
func (a *Allocator) get(ctx context.Context, keys ...string) ([]store.KV, error) {
	if a.layoutOK.Load() {
		return a.st.Get(ctx, keys...)
	}
	kvs, err := a.st.Get(ctx, append(keys[:len(keys):len(keys)], layoutKey)...)
	if err != nil {
		return nil, err
	}
	migrated, err := a.layoutRead(ctx, kvs[len(kvs)-1])
	switch {
	case err != nil:
		return nil, err
	case !migrated:
		return kvs[:len(kvs)-1], nil
	case len(keys) == 0:
		return []store.KV{}, nil
	}
	return a.st.Get(ctx, keys...)
}

// layoutRead acts on the layout version lv as read: this code's layout is
// remembered; a newer one is an error; an older one (none: an empty store,
// or version 1; or version 2) is migrated, and then what was read with it
// is stale (migrated true).
func (a *Allocator) layoutRead(ctx context.Context, lv store.KV) (migrated bool, err error) {
	switch v := string(lv.Value); {
	case v == layoutVersion:
		a.layoutOK.Store(true)
		return false, nil
	case lv.Exists() && v != "2" && v != "3":
		return false, fmt.Errorf("%w: the store has layout %q, this ringipam reads %q: upgrade ringipam", ErrLayout, v, layoutVersion)
	}
	if err := a.run(ctx, func(int) error { return a.migrate(ctx) }); err != nil {
		return false, fmt.Errorf("migrating the store to layout %s: %w", layoutVersion, err)
	}
	a.layoutOK.Store(true)
	return true, nil
}

// ensureLayout makes sure the store has this code's layout (for operations
// that only scan).
func (a *Allocator) ensureLayout(ctx context.Context) error {
	_, err := a.get(ctx)
	return err
}

// migrate brings a store of layout 1 or 2 to this code's layout. From
// layout 1, one owner per commit moves to its kind's keys (its record, its
// address keys and its reservation together, so the store is consistent
// after every step), and reservations no owner holds follow. Then every
// owner is entered in its host's index (reindex), and a last commit,
// conditioned on the version being as read, records the version (and,
// from layout 1, the pool registry). Running it again, or from several
// processes at once, is safe: what was migrated is recognised and skipped,
// and a conflict restarts it.
func (a *Allocator) migrate(ctx context.Context) error {
	lv, err := a.st.Get(ctx, layoutKey)
	if err != nil {
		return err
	}
	from := lv[0]
	if string(from.Value) == layoutVersion {
		return nil // another process finished first
	}
	if !from.Exists() {
		if err := a.migrateV1(ctx); err != nil {
			return err
		}
	}
	if string(from.Value) != "3" {
		if _, _, err := a.reindex(ctx, false); err != nil {
			return err
		}
	}
	if err := a.migrateRings(ctx); err != nil {
		return err
	}
	conds := []store.Cond{store.Unchanged(from)}
	ops := []store.Op{store.Put(layoutKey, []byte(layoutVersion))}
	if !from.Exists() {
		regKV, reg, err := a.registryOfV1(ctx)
		if err != nil {
			return err
		}
		b, _ := json.Marshal(reg)
		conds = append(conds, store.Unchanged(regKV))
		ops = append(ops, store.Put(registryKey, b))
	}
	return a.st.Commit(ctx, conds, ops)
}

// migrateV1 moves a version-1 store's owners and reservations to their
// kinds' keys.
func (a *Allocator) migrateV1(ctx context.Context) error {
	owners, err := a.st.Scan(ctx, prefixOwner, store.PrefixEnd(prefixOwner), 0)
	if err != nil {
		return err
	}
	for _, kv := range owners {
		if strings.Count(kv.Key, "/") != 3 { // o/<network>/<ctr>/<if>: version 1
			continue
		}
		if err := a.migrateOwner(ctx, kv); err != nil {
			return err
		}
	}
	resvs, err := a.st.Scan(ctx, prefixResv, store.PrefixEnd(prefixResv), 0)
	if err != nil {
		return err
	}
	for _, kv := range resvs {
		var r reservation
		if json.Unmarshal(kv.Value, &r) == nil && r.Kind != "" {
			continue // already version 2
		}
		// A version-1 reservation no owner holds: only the CNI plugin
		// used reservations in version 1.
		network, name, ok := strings.Cut(strings.TrimPrefix(kv.Key, prefixResv), "/")
		if !ok || network == "" {
			continue
		}
		r.Kind = KindCNI
		b, _ := json.Marshal(r)
		nk := resvKey(KindCNI, network, name)
		if err := a.st.Commit(ctx, []store.Cond{store.Unchanged(kv), {Key: nk}},
			[]store.Op{store.Delete(kv.Key), store.Put(nk, b)}); err != nil {
			return err
		}
	}
	return nil
}

// registryOfV1 is the pool registry of a version-1 store: every recorded
// pool, read from its d/ key.
func (a *Allocator) registryOfV1(ctx context.Context) (store.KV, registry, error) {
	defs, err := a.st.Scan(ctx, prefixDef, store.PrefixEnd(prefixDef), 0)
	if err != nil {
		return store.KV{}, registry{}, err
	}
	kvs, err := a.st.Get(ctx, registryKey)
	if err != nil {
		return store.KV{}, registry{}, err
	}
	reg, err := decodeRegistry(kvs[0])
	if err != nil {
		return store.KV{}, registry{}, err
	}
	for _, kv := range defs {
		d, err := parseDef(strings.TrimPrefix(kv.Key, prefixDef), kv.Value)
		if err != nil {
			return store.KV{}, registry{}, err
		}
		// Pools recorded before the registry existed may overlap; they
		// are listed all the same (Check reports the overlap) rather than
		// refused, which would strand their allocations.
		if next, err := reg.admit(d); err == nil {
			reg = next
		} else {
			reg.Pools = append(reg.Pools, registeredOf(d))
		}
	}
	return kvs[0], reg, nil
}

// Reindex makes every host's index of its owners (hostOwnerKey) match the
// owner records: a record missing from its host's index is entered, an
// index key whose record is gone or another host's is deleted. Writers of
// this layout keep the index exact; what Reindex finds is what a process of
// an older ringipam wrote while the store was being migrated. It reads
// every owner, for operators (ringctl gc) and the migration, and returns
// how many keys it entered and deleted.
func (a *Allocator) Reindex(ctx context.Context) (entered, deleted int, err error) {
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	if err := a.ensureLayout(ctx); err != nil {
		return 0, 0, err
	}
	err = a.run(ctx, func(int) error {
		e, d, err := a.reindex(ctx, false)
		entered += e
		deleted += d
		return err
	})
	return entered, deleted, err
}

// PlanReindex returns what Reindex would enter and delete now; it changes
// nothing.
func (a *Allocator) PlanReindex(ctx context.Context) (entered, deleted int, err error) {
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	if err := a.ensureLayout(ctx); err != nil {
		return 0, 0, err
	}
	return a.reindex(ctx, true)
}

// reindex is one pass of Reindex; each commit is conditioned on the owner
// records it decided on, so a conflict means "read again". It counts what
// its successful commits entered and deleted; dry commits nothing and
// counts what it would.
func (a *Allocator) reindex(ctx context.Context, dry bool) (entered, deleted int, err error) {
	owners, err := a.st.Scan(ctx, prefixOwner, store.PrefixEnd(prefixOwner), 0)
	if err != nil {
		return 0, 0, err
	}
	index, err := a.st.Scan(ctx, prefixHostOwner, store.PrefixEnd(prefixHostOwner), 0)
	if err != nil {
		return 0, 0, err
	}
	indexed := map[string]bool{}
	for _, kv := range index {
		indexed[kv.Key] = true
	}
	b := pairBatch{commit: func(conds []store.Cond, ops []store.Op) error {
		if !dry {
			if err := a.st.Commit(ctx, conds, ops); err != nil {
				return err
			}
		}
		for _, o := range ops {
			if o.Delete {
				deleted++
			} else {
				entered++
			}
		}
		return nil
	}}
	revision := map[string]int64{} // owner key -> revision as scanned
	want := map[string]bool{}      // index keys the records call for
	for _, kv := range owners {
		revision[kv.Key] = kv.Revision
		owner, ok := parseOwner(strings.TrimPrefix(kv.Key, prefixOwner))
		var rec Allocation
		if !ok || json.Unmarshal(kv.Value, &rec) != nil || validName("host", rec.Host) != nil {
			continue // a version-1 key, or corrupt: Audit reports it
		}
		for _, h := range rec.holders() {
			ik := hostOwnerKey(h, owner)
			want[ik] = true
			if !indexed[ik] {
				if err := b.add(store.Unchanged(kv), store.Put(ik, []byte{})); err != nil {
					return entered, deleted, err
				}
			}
		}
	}
	for _, kv := range index {
		if want[kv.Key] {
			continue
		}
		_, owner, _ := strings.Cut(strings.TrimPrefix(kv.Key, prefixHostOwner), "/")
		ownerK := ownerKeyOf(owner)
		if err := b.add(store.Cond{Key: ownerK, Revision: revision[ownerK]}, store.Delete(kv.Key)); err != nil {
			return entered, deleted, err
		}
	}
	return entered, deleted, b.flush()
}

// pairBatch gathers (condition, write) pairs into commits of at most
// store.MaxOps entries, each handed to commit; a batch is dropped after its
// commit whatever the outcome.
type pairBatch struct {
	commit func([]store.Cond, []store.Op) error
	conds  []store.Cond
	ops    []store.Op
}

func (b *pairBatch) add(c store.Cond, o store.Op) error {
	if len(b.conds)+len(b.ops)+2 > store.MaxOps {
		if err := b.flush(); err != nil {
			return err
		}
	}
	b.conds, b.ops = append(b.conds, c), append(b.ops, o)
	return nil
}

func (b *pairBatch) flush() error {
	if len(b.ops) == 0 {
		return nil
	}
	err := b.commit(b.conds, b.ops)
	b.conds, b.ops = nil, nil
	return err
}

// v1Kind tells which front end wrote a version-1 owner: the Docker driver
// keyed endpoints by MAC address with the host as interface, and aux
// addresses as "aux-<address>" with no interface; everything else is CNI.
func v1Kind(o Owner) (Kind, Owner) {
	if _, err := net.ParseMAC(o.ContainerID); err == nil && strings.Contains(o.ContainerID, ":") && o.IfName != "" {
		return KindDocker, Owner{Kind: KindDocker, Network: o.Network, ContainerID: o.ContainerID}
	}
	if strings.HasPrefix(o.ContainerID, "aux-") && o.IfName == "" {
		return KindDocker, Owner{Kind: KindDocker, Network: o.Network, ContainerID: o.ContainerID}
	}
	o.Kind = KindCNI
	return KindCNI, o
}

// migrateOwner moves one version-1 owner record, its address keys and its
// reservation to version 2 in one commit.
func (a *Allocator) migrateOwner(ctx context.Context, kv store.KV) error {
	var rec Allocation
	if err := json.Unmarshal(kv.Value, &rec); err != nil {
		return fmt.Errorf("%s: stored allocation is corrupt: %w", kv.Key, err)
	}
	parts := strings.Split(strings.TrimPrefix(kv.Key, prefixOwner), "/")
	old := Owner{Network: parts[0], ContainerID: parts[1], IfName: parts[2]}
	oldStr := old.Network + "/" + old.ContainerID + "/" + old.IfName
	kind, owner := v1Kind(old)
	rec.Owner = owner
	keys := []string{ownerKey(owner)}
	for _, x := range rec.Addrs {
		keys = append(keys, addrKey(x.Pool, toU128(x.Addr), x.Addr.Is4()))
	}
	oldResv := ""
	if rec.Reservation != "" {
		oldResv = prefixResv + old.Network + "/" + rec.Reservation
		keys = append(keys, oldResv, resvKey(kind, owner.Network, rec.Reservation))
	}
	got, err := a.st.Get(ctx, keys...)
	if err != nil {
		return err
	}
	conds := []store.Cond{store.Unchanged(kv), store.Unchanged(got[0])}
	b, _ := json.Marshal(rec)
	ops := []store.Op{store.Delete(kv.Key), store.Put(ownerKey(owner), b)}
	for i := range rec.Addrs {
		akv := got[1+i]
		if !akv.Exists() {
			continue
		}
		h := parseHolder(akv.Value)
		if h.Owner != oldStr {
			continue
		}
		conds = append(conds, store.Unchanged(akv))
		ops = append(ops, store.Put(akv.Key, ownerHolder(h.Host, owner).encode()))
	}
	if oldResv != "" {
		rkv, nkv := got[len(got)-2], got[len(got)-1]
		if rkv.Exists() {
			var r reservation
			if err := json.Unmarshal(rkv.Value, &r); err != nil {
				return fmt.Errorf("%s: corrupt reservation: %w", rkv.Key, err)
			}
			r.Kind = kind
			if r.Owner == oldStr {
				r.Owner = owner.String()
			}
			rb, _ := json.Marshal(r)
			conds = append(conds, store.Unchanged(rkv), store.Unchanged(nkv))
			ops = append(ops, store.Delete(rkv.Key), store.Put(nkv.Key, rb))
		}
	}
	return a.st.Commit(ctx, conds, ops)
}

// migrateRings splits every pool's layout-3 ring (one key g/<pool>) into
// range keys and lists each host's live ranges in its host state, pool by
// pool. Every commit of a pool is conditioned on the old ring as read, so
// a layout-3 process that changes the ring meanwhile restarts the pool's
// migration (which recomputes everything from the ring, deleting range
// keys an interrupted attempt left that the ring no longer says); the
// last one replaces the old ring with movedMarker. A pool's range keys
// and states may take several commits (store.MaxOps): until its last
// one, no process of this layout reads them (the version is written
// after every pool). A layout-3 process rewriting a host state after its
// migration drops the state's ranges; the host's next allocation repairs
// them from the range keys (repairState).
func (a *Allocator) migrateRings(ctx context.Context) error {
	defs, err := a.st.Scan(ctx, prefixDef, store.PrefixEnd(prefixDef), 0)
	if err != nil {
		return err
	}
	for _, kv := range defs {
		pool := strings.TrimPrefix(kv.Key, prefixDef)
		def, err := parseDef(pool, kv.Value)
		if err != nil {
			return err
		}
		if err := a.migrateRing(ctx, pool, def); err != nil {
			return fmt.Errorf("pool %s: %w", pool, err)
		}
	}
	return nil
}

func (a *Allocator) migrateRing(ctx context.Context, pool string, def Def) error {
	got, err := a.st.Get(ctx, oldRingKey(pool))
	if err != nil {
		return err
	}
	old := got[0]
	var tokens []token
	if old.Exists() {
		if err := json.Unmarshal(old.Value, &tokens); err != nil {
			return nil // movedMarker: migrated already
		}
	}
	r := ringFrom(def, tokens)
	if err := r.check(); err != nil {
		return fmt.Errorf("the layout-3 ring is not valid: %w", err)
	}
	is4 := def.is4()
	want := map[string][]byte{}
	own := map[string][]span{}
	tombs := map[string]bool{}
	for i, t := range r.tokens {
		if t.Host == "" {
			continue
		}
		sp := r.spanOf(i)
		want[rangeKey(pool, sp.hi, is4)] = rangeKV{span: sp, host: t.Host, tomb: t.Tomb}.encode(is4)
		if !t.Tomb {
			own[t.Host] = append(own[t.Host], sp)
		} else {
			tombs[tombKeyOf(rangeKey(pool, sp.hi, is4))] = true
		}
	}
	have, err := a.st.Scan(ctx, rangePrefix(pool), store.PrefixEnd(rangePrefix(pool)), 0)
	if err != nil {
		return err
	}
	states, err := a.st.Scan(ctx, hostPrefix(pool), store.PrefixEnd(hostPrefix(pool)), 0)
	if err != nil {
		return err
	}
	var ops []store.Op
	var conds []store.Cond
	for _, kv := range have {
		if v, ok := want[kv.Key]; !ok {
			ops = append(ops, store.Delete(kv.Key), store.Delete(tombKeyOf(kv.Key)))
		} else if string(v) == string(kv.Value) {
			delete(want, kv.Key)
		}
	}
	for _, k := range slices.Sorted(maps.Keys(want)) {
		ops = append(ops, store.Put(k, want[k]))
	}
	// The tombstone index (freeindex.go), written again on every run:
	// idempotent, and a run that stopped half-way may have written the
	// range key but not its entry.
	for _, k := range slices.Sorted(maps.Keys(tombs)) {
		ops = append(ops, store.Put(k, []byte{}))
	}
	seen := map[string]bool{}
	for _, kv := range states {
		host := strings.TrimPrefix(kv.Key, hostPrefix(pool))
		seen[host] = true
		var hs hostState
		if err := decodeHostState(kv.Value, &hs); err != nil {
			return fmt.Errorf("%s: corrupt host state: %w", kv.Key, err)
		}
		hs.setSpans(own[host], is4)
		hs.Layout = stateLayout
		idx := freeIndexOps(pool, host, &hs)
		if b := encodeHostState(hs); string(b) != string(kv.Value) {
			ops = append(ops, store.Put(kv.Key, b))
			ops = append(ops, idx...)
			conds = append(conds, store.Unchanged(kv))
		}
	}
	for _, host := range slices.Sorted(maps.Keys(own)) {
		if !seen[host] { // a host that owns ranges but never wrote its state
			hs := hostState{Layout: stateLayout}
			hs.setSpans(own[host], is4)
			ops = append(ops, putHostState(pool, host, &hs)...)
			conds = append(conds, store.Cond{Key: hostKey(pool, host)})
		}
	}
	ops = append(ops, store.Put(oldRingKey(pool), movedMarker(pool)))
	// Commits of at most store.MaxOps entries, each conditioned on the old
	// ring; the marker goes last.
	for len(ops) > 0 {
		n := min(len(ops), store.MaxOps/2-1)
		batch := ops[:n]
		bc := []store.Cond{store.Unchanged(old)}
		for _, o := range batch {
			for _, c := range conds {
				if c.Key == o.Key {
					bc = append(bc, c)
				}
			}
		}
		if err := a.st.Commit(ctx, bc, batch); err != nil {
			return err
		}
		ops = ops[n:]
	}
	return nil
}
