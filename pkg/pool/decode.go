package pool

import (
	"encoding/json"
	"fmt"
	"strings"
	"time"
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

// DecodeRing decodes the stored ring of pool (the value of g/<pool>; nil
// when the pool has no ring yet: every range unowned), with the pool's
// definition, as RingOf returns it.
func DecodeRing(pool string, def Def, value []byte) (Ring, error) {
	var tokens []token
	if value != nil {
		if err := json.Unmarshal(value, &tokens); err != nil {
			return Ring{}, fmt.Errorf("pool %s: stored ring is corrupt: %w", pool, err)
		}
	}
	r := ringFrom(def, tokens)
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
