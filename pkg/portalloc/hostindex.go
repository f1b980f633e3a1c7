package portalloc

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/ringipam/ringipam/pkg/retry"
	"github.com/ringipam/ringipam/pkg/store"
)

// Each host's index of its endpoints: p/i/<host>/<network>/<container>/<if>,
// empty, present exactly while the endpoint's record exists and names that
// host. Every commit that writes or deletes a record writes or deletes its
// index key; p/x says that every record of the store is in the index (the
// first reader of the index enters the records written before it existed,
// see ensureIndex).
const (
	prefixHostIndex = "p/i/"
	indexedKey      = "p/x"
)

// ErrGuard: a reclaim's guard no longer holds (the gone host's liveness key
// appeared: it is back), so nothing more of it is released.
var ErrGuard = errors.New("the host is back: its reclaim's guard no longer holds")

func hostIndexPrefix(host, network string) string {
	p := prefixHostIndex + host + "/"
	if network != "" {
		p += network + "/"
	}
	return p
}

func hostIndexKey(host string, id EndpointID) string { return hostIndexPrefix(host, "") + id.path() }

// parseHostIndexKey reads the host and endpoint a p/i/ key names.
func parseHostIndexKey(key string) (string, EndpointID, bool) {
	host, rest, ok := strings.Cut(strings.TrimPrefix(key, prefixHostIndex), "/")
	if !ok || host == "" || !strings.HasPrefix(key, prefixHostIndex) {
		return "", EndpointID{}, false
	}
	id, ok := ParseEndpointID(Kind + "/" + rest)
	return host, id, ok
}

// ensureIndex makes sure every endpoint record is in its host's index
// before the index is trusted: once p/x is seen (remembered by the
// Allocator) nothing is read again; on a store written before the index
// existed the first reader enters every record (Reindex) and writes p/x.
func (a *Allocator) ensureIndex(ctx context.Context) error {
	if a.indexed.Load() {
		return nil
	}
	kvs, err := a.st.Get(ctx, indexedKey)
	if err != nil {
		return err
	}
	if !kvs[0].Exists() {
		if _, _, err := a.reindex(ctx, false); err != nil {
			return fmt.Errorf("entering the published ports in their hosts' index: %w", err)
		}
		err := a.st.Commit(ctx, []store.Cond{store.Unchanged(kvs[0])}, []store.Op{store.Put(indexedKey, []byte("1"))})
		if err != nil && !errors.Is(err, store.ErrConflict) { // a conflict: another process wrote it
			return err
		}
	}
	a.indexed.Store(true)
	return nil
}

// Reindex makes every host's index of its endpoints match the endpoint
// records: a record missing from its host's index is entered, an index key
// whose record is absent or names another host is deleted, each
// conditioned on what was read. It returns how many keys it entered and
// deleted. Nothing needs it once every process runs this version (their
// commits keep the index exact); it repairs what an older portmap-ingress
// wrote after the index was built (ringctl gc runs it).
func (a *Allocator) Reindex(ctx context.Context) (entered, deleted int, err error) {
	return a.reindex(ctx, false)
}

// PlanReindex counts what Reindex would do, changing nothing.
func (a *Allocator) PlanReindex(ctx context.Context) (entered, deleted int, err error) {
	return a.reindex(ctx, true)
}

func (a *Allocator) reindex(ctx context.Context, dry bool) (entered, deleted int, err error) {
	err = retry.Do(ctx, a.policy, func(err error) bool { return errors.Is(err, store.ErrConflict) }, func(int) error {
		entered, deleted = 0, 0
		recs, err := a.st.Scan(ctx, prefixEndpoint, store.PrefixEnd(prefixEndpoint), 0)
		if err != nil {
			return err
		}
		idx, err := a.st.Scan(ctx, prefixHostIndex, store.PrefixEnd(prefixHostIndex), 0)
		if err != nil {
			return err
		}
		want := map[string]store.KV{} // index key -> the record that wants it
		for _, kv := range recs {
			id, ok := endpointOfKey(kv.Key)
			if !ok {
				continue // reported by Audit
			}
			e, err := decodeEndpoint(id, kv)
			if err != nil || e.Host == "" || strings.Contains(e.Host, "/") {
				continue // reported by Audit
			}
			want[hostIndexKey(e.Host, id)] = kv
		}
		var conds []store.Cond
		var ops []store.Op
		flush := func() error {
			if len(ops) == 0 || dry {
				conds, ops = nil, nil
				return nil
			}
			err := a.st.Commit(ctx, conds, ops)
			conds, ops = nil, nil
			return err
		}
		add := func(c []store.Cond, o store.Op) error {
			if len(conds)+len(ops)+len(c)+1 > store.MaxOps/2 {
				if err := flush(); err != nil {
					return err
				}
			}
			conds, ops = append(conds, c...), append(ops, o)
			return nil
		}
		have := map[string]bool{}
		for _, kv := range idx {
			have[kv.Key] = true
			if _, ok := want[kv.Key]; ok {
				continue
			}
			// The record it names is absent or another host's: the scan
			// of the records came first, so condition on the record too.
			c := []store.Cond{store.Unchanged(kv)}
			if _, id, ok := parseHostIndexKey(kv.Key); ok {
				c = append(c, store.Unchanged(recordKV(recs, endpointKey(id))))
			}
			deleted++
			if err := add(c, store.Delete(kv.Key)); err != nil {
				return err
			}
		}
		for _, k := range slices.Sorted(maps.Keys(want)) {
			if have[k] {
				continue
			}
			entered++
			if err := add([]store.Cond{store.Unchanged(want[k]), {Key: k}}, store.Put(k, []byte{})); err != nil {
				return err
			}
		}
		return flush()
	})
	if errors.Is(err, retry.ErrExhausted) {
		err = errors.Join(ErrTryAgain, err)
	}
	return entered, deleted, err
}

// recordKV finds key in kvs (sorted by key, as a scan returns them); absent:
// a KV with revision 0.
func recordKV(kvs []store.KV, key string) store.KV {
	i, ok := slices.BinarySearchFunc(kvs, key, func(kv store.KV, k string) int { return strings.Compare(kv.Key, k) })
	if !ok {
		return store.KV{Key: key}
	}
	return kvs[i]
}

// HostEndpoints returns the endpoints recorded on host (of network, when not
// empty) with their records, through the host's index: one scan of the
// index and one read of the records it names, in proportion to the host's
// endpoints whatever other hosts publish. An index key whose record is
// absent or names another host is skipped. A corrupt record is reported,
// the readable ones still returned.
func (a *Allocator) HostEndpoints(ctx context.Context, host, network string) (map[EndpointID]Endpoint, error) {
	if host == "" || strings.ContainsAny(host, "/\x00") || strings.Contains(network, "/") {
		return nil, fmt.Errorf("%w: host %q, network %q", ErrInvalid, host, network)
	}
	ids, err := a.hostIndex(ctx, host, network)
	if err != nil || len(ids) == 0 {
		return map[EndpointID]Endpoint{}, err
	}
	keys := make([]string, len(ids))
	for i, id := range ids {
		keys[i] = endpointKey(id)
	}
	kvs, err := a.st.Get(ctx, keys...)
	if err != nil {
		return nil, err
	}
	out := make(map[EndpointID]Endpoint, len(ids))
	var errs []error
	for i, kv := range kvs {
		e, err := decodeEndpoint(ids[i], kv)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if kv.Exists() && e.Host == host {
			out[ids[i]] = e
		}
	}
	return out, errors.Join(errs...)
}

// hostIndex lists the endpoints host's index names (of network, when not
// empty): one scan, after ensureIndex.
func (a *Allocator) hostIndex(ctx context.Context, host, network string) ([]EndpointID, error) {
	if err := a.ensureIndex(ctx); err != nil {
		return nil, err
	}
	prefix := hostIndexPrefix(host, network)
	idx, err := a.st.Scan(ctx, prefix, store.PrefixEnd(prefix), 0)
	if err != nil {
		return nil, err
	}
	ids := make([]EndpointID, 0, len(idx))
	for _, kv := range idx {
		if _, id, ok := parseHostIndexKey(kv.Key); ok {
			ids = append(ids, id)
		}
	}
	return ids, nil
}

// Released is one endpoint ReleaseHost released, with the ports it held.
type Released struct {
	ID    EndpointID
	Ports []Port
}

// ReleaseHost releases the ports of every endpoint recorded on host (a host
// that is gone: see pool.Reclaim), each in its own commit, and returns what
// this call released. It reads only host's endpoints (its index).
//
// guard is pool's reclaim guard (pool.Allocator.ReclaimGuard: the host's
// liveness key as read, absent): every commit carries it, and every attempt
// reads its keys with the endpoint's record, so once the host is back
// (its liveness key appeared) ReleaseHost stops with ErrGuard and the host
// keeps every port not yet released. An endpoint whose record no longer
// names host (released, or taken over by another host, meanwhile) is
// skipped. Safe to run from several processes at once: each endpoint is
// released by exactly one of them.
func (a *Allocator) ReleaseHost(ctx context.Context, host string, guard []store.Cond) ([]Released, error) {
	ids, err := a.hostIndex(ctx, host, "")
	if err != nil {
		return nil, err
	}
	var out []Released
	var errs []error
	g := &reclaimGuard{host: host, conds: guard}
	for _, id := range ids {
		res, err := a.allocate(ctx, id, nil, g)
		if errors.Is(err, ErrGuard) {
			return out, err
		}
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if len(res.Previous) > 0 || len(res.Changes) > 0 {
			out = append(out, Released{ID: id, Ports: res.Previous})
		}
	}
	return out, errors.Join(errs...)
}
