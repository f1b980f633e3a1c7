package pool

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/ringipam/ringipam/pkg/store"
)

// Decoders of raw stored values, for a reader that keeps its own copy of
// some prefixes (the host agent's watch caches, package watchcache) and
// must not read the store again to learn what a value says. Keys are
// relative to the store's prefix, as store.KV gives them.

// Prefixes of keys a watcher outside the package follows, beside
// RingKeyPrefix and HostRecordKeyPrefix (keys.go): DefKeyPrefix holds every
// pool's definition, LivenessKeyPrefix every up host's liveness key.
const (
	DefKeyPrefix      = prefixDef
	LivenessKeyPrefix = prefixLive
)

// ParseDef decodes the stored definition of the pool whose key (d/<pool>)
// is key; the pool's name comes from the key.
func ParseDef(key string, value []byte) (Def, error) {
	name, ok := strings.CutPrefix(key, prefixDef)
	if !ok || name == "" {
		return Def{}, fmt.Errorf("%q is not a pool definition's key", key)
	}
	d, err := parseDef(name, value)
	if err != nil {
		return Def{}, err
	}
	if d.Name == "" {
		d.Name = name
	}
	return d, nil
}

// RangeKeyPool returns the pool of a range key (g/<pool>/<last address>,
// under RingKeyPrefix); false for any other key, such as the marker
// layout 3's ring key holds.
func RangeKeyPool(key string) (string, bool) {
	rest, ok := strings.CutPrefix(key, prefixRing)
	if !ok {
		return "", false
	}
	pool, last, ok := strings.Cut(rest, "/")
	return pool, ok && pool != "" && last != ""
}

// DecodeRingKeys decodes pool's ring from the values of its range keys
// (every key under RingKeyPrefix that RangeKeyPool says is pool's: keys
// maps each to its value, in any order), with the pool's definition, as
// RingOf returns it. No key: every range unowned.
func DecodeRingKeys(pool string, def Def, keys map[string][]byte) (Ring, error) {
	var rs []RangeKey
	for k, v := range keys {
		r, err := DecodeRangeKey(k, v)
		if err != nil {
			return Ring{}, fmt.Errorf("pool %s: %w", pool, err)
		}
		rs = append(rs, r)
	}
	return RingOfRangeKeys(pool, def, rs)
}

// RangeKey is one range key (RingKeyPrefix) as decoded by DecodeRangeKey,
// for readers that keep the ring's keys decoded as they change (a watch's
// copy) and make the ring of them with RingOfRangeKeys.
type RangeKey struct {
	r   rangeKV
	is4 bool
}

// DecodeRangeKey decodes the range key key (g/<pool>/<hex last address>)
// and its value, its family from the range's start.
func DecodeRangeKey(key string, value []byte) (RangeKey, error) {
	var rec rangeRec
	if err := json.Unmarshal(value, &rec); err != nil {
		return RangeKey{}, fmt.Errorf("%s: corrupt range: %w", key, err)
	}
	is4 := rec.Start.Is4()
	r, err := decodeRangeKV(store.KV{Key: key, Value: value, Revision: 1}, is4)
	if err != nil {
		return RangeKey{}, err
	}
	return RangeKey{r: r, is4: is4}, nil
}

// RingOfRangeKeys is pool's ring made of its decoded range keys (in any
// order), with the pool's definition, as RingOf returns it.
func RingOfRangeKeys(pool string, def Def, keys []RangeKey) (Ring, error) {
	is4 := def.is4()
	rs := make([]rangeKV, 0, len(keys))
	for _, k := range keys {
		if k.is4 != is4 {
			return Ring{}, fmt.Errorf("pool %s: %s: a range of the other address family", pool, k.r.key)
		}
		rs = append(rs, k.r)
	}
	slices.SortFunc(rs, func(x, y rangeKV) int { return x.hi.cmp(y.hi) })
	r, err := ringOfRanges(def, rs)
	if err != nil {
		return Ring{}, fmt.Errorf("pool %s: %w", pool, err)
	}
	if err := r.check(); err != nil {
		return Ring{}, fmt.Errorf("pool %s: %w", pool, err)
	}
	return r.view(pool), nil
}

// DecodeHostRecord decodes the host record whose key (n/<host>) is key into
// what Hosts reports of it: Name, Agent, Addr, OrphanedAt, Reclaimed,
// Routes and the LastSeen the record itself holds. State, Ranges, Used and
// Pools are not in the record: the caller judges State (a host is up while
// its liveness key exists, orphaned when the record carries the orphaned
// mark, else down).
func DecodeHostRecord(key string, value []byte) (HostInfo, error) {
	name, ok := strings.CutPrefix(key, prefixHostRecord)
	if !ok || name == "" {
		return HostInfo{}, fmt.Errorf("%q is not a host record's key", key)
	}
	var rec hostRecord
	if err := json.Unmarshal(value, &rec); err != nil {
		return HostInfo{}, fmt.Errorf("%s: corrupt host record: %w", key, err)
	}
	h := HostInfo{Name: name, Agent: rec.Seen != 0 || rec.addr() != "", Addr: rec.addr(), Reclaimed: rec.Reclaimed, Routes: rec.Routes}
	if last := max(rec.Seen, rec.Checked); last != 0 {
		h.LastSeen = time.Unix(last, 0)
	}
	if rec.Orphaned != 0 {
		h.OrphanedAt = time.Unix(rec.Orphaned, 0)
	}
	return h, nil
}

// LivenessKeyHost is the host whose liveness key (l/<host>) key is.
func LivenessKeyHost(key string) (string, bool) {
	h, ok := strings.CutPrefix(key, prefixLive)
	return h, ok && h != ""
}
