package pool

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"strings"

	"github.com/ringipam/ringipam/pkg/store"
)

// layoutVersion is the store layout this code reads and writes. Version 1
// (no layoutKey) keyed owners as o/<network>/<container>/<ifname> with no
// front end, reservations as r/<network>/<name>, and had no pool registry.
// Version 2 adds the owner's kind to owner keys, address holders and
// reservation keys, and the pool registry (registryKey).
const layoutVersion = "2"

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
// remembered; a newer one is an error; none (an empty store, or version 1)
// is migrated, and then what was read with it is stale (migrated true).
func (a *Allocator) layoutRead(ctx context.Context, lv store.KV) (migrated bool, err error) {
	switch v := string(lv.Value); {
	case v == layoutVersion:
		a.layoutOK.Store(true)
		return false, nil
	case lv.Exists():
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

// migrate rewrites a version-1 store as version 2, one owner per commit
// (its record, its address keys and its reservation move together, so the
// store is consistent after every step), then records the pool registry and
// the version in a last commit conditioned on the version being absent.
// Running it again, or from several processes at once, is safe: what was
// migrated is recognised and skipped, and a conflict restarts it.
func (a *Allocator) migrate(ctx context.Context) error {
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
	defs, err := a.st.Scan(ctx, prefixDef, store.PrefixEnd(prefixDef), 0)
	if err != nil {
		return err
	}
	kvs, err := a.st.Get(ctx, registryKey, layoutKey)
	if err != nil {
		return err
	}
	if string(kvs[1].Value) == layoutVersion {
		return nil // another process finished first
	}
	reg, err := decodeRegistry(kvs[0])
	if err != nil {
		return err
	}
	for _, kv := range defs {
		d, err := parseDef(strings.TrimPrefix(kv.Key, prefixDef), kv.Value)
		if err != nil {
			return err
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
	b, _ := json.Marshal(reg)
	return a.st.Commit(ctx, []store.Cond{store.Unchanged(kvs[0]), store.Unchanged(kvs[1])},
		[]store.Op{store.Put(registryKey, b), store.Put(layoutKey, []byte(layoutVersion))})
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
