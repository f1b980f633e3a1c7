package agent

import (
	"context"
	"errors"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/ringipam/ringipam/pkg/cni/portmap"
	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/portalloc"
	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/watchcache"
)

// Watch, then apply (docs/DESIGN-NOTES.md): the routes and ingress loops
// decide from copies of the prefixes they need (package watchcache), never
// from a read of the store per event. On etcd each copy is listed once and
// then follows its watch; on a local store (one host) a poll every
// SyncInterval scans the same prefixes and replaces the copies. Either way
// the loops wake when a copy changes, and on a resync that replays their
// decisions from the copies (kernel tables re-applied, nothing read).

// hostView is what the loops use of a host record: its addresses and its
// orphaned mark (the elected sweeper sets it when it reclaims the host).
// Other fields (last seen, the routes summary) change without waking
// anyone.
type hostView struct {
	Addr     string
	Orphaned int64 // Unix seconds; 0: not orphaned, or acknowledged
}

// ingressHolder is what the ingress loop uses of a published address: who
// holds it in ingress mode (host-mode bindings change without waking it).
type ingressHolder struct {
	Address     portalloc.Address
	Ingress     string
	IngressHost string
}

// caches are the agent's copies; a nil field is a prefix no loop of this
// agent needs.
type caches struct {
	defs  *watchcache.Cache[pool.Def]
	rings *watchcache.Cache[pool.RangeKey]
	hosts *watchcache.Cache[hostView]
	live  *watchcache.Cache[struct{}]
	ports *watchcache.Cache[*ingressHolder] // nil value: a key naming no address
	own   *watchcache.Cache[string]         // this host's endpoints: portmap marks
}

func equal[T comparable](x, y T) bool { return x == y }

func sameHolder(x, y *ingressHolder) bool { return x == y || x != nil && y != nil && *x == *y }

// newCaches makes the copies the agent's loops need (none runs yet).
func (a *Agent) newCaches() *caches {
	c := &caches{}
	routes, ingress := a.rt != nil, a.cfg.Ingress
	logf := func(msg string, args ...any) { a.log.Info(msg, args...) }
	if routes {
		c.defs = watchcache.New(watchcache.Config[pool.Def]{Client: a.cli, Trim: a.prefix, Prefix: pool.DefKeyPrefix,
			Decode: pool.ParseDef, Timeout: time.Duration(a.cfg.Timeout), Log: logf})
		// Range keys are decoded once, as they arrive (a layout-3
		// ring's marker is no range: left alone).
		c.rings = watchcache.New(watchcache.Config[pool.RangeKey]{Client: a.cli, Trim: a.prefix, Prefix: pool.RingKeyPrefix,
			Decode: func(k string, v []byte) (pool.RangeKey, error) {
				if _, ok := pool.RangeKeyPool(k); !ok {
					return pool.RangeKey{}, nil
				}
				return pool.DecodeRangeKey(k, v)
			}, Timeout: time.Duration(a.cfg.Timeout), Log: logf})
	}
	if routes || ingress {
		c.hosts = watchcache.New(watchcache.Config[hostView]{Client: a.cli, Trim: a.prefix, Prefix: pool.HostRecordKeyPrefix,
			Decode: func(k string, v []byte) (hostView, error) {
				h, err := pool.DecodeHostRecord(k, v)
				if err != nil {
					return hostView{}, err
				}
				hv := hostView{Addr: h.Addr}
				if !h.OrphanedAt.IsZero() {
					hv.Orphaned = h.OrphanedAt.Unix()
				}
				return hv, nil
			}, Equal: equal[hostView], Timeout: time.Duration(a.cfg.Timeout), Log: logf})
		c.live = watchcache.New(watchcache.Config[struct{}]{Client: a.cli, Trim: a.prefix, Prefix: pool.LivenessKeyPrefix,
			Decode: func(string, []byte) (struct{}, error) { return struct{}{}, nil },
			Equal:  equal[struct{}], Timeout: time.Duration(a.cfg.Timeout), Log: logf})
	}
	if ingress {
		c.ports = watchcache.New(watchcache.Config[*ingressHolder]{Client: a.cli, Trim: a.prefix, Prefix: portalloc.PublishedKeyPrefix,
			Decode: func(k string, v []byte) (*ingressHolder, error) {
				p, ok, err := portalloc.DecodePublished(k, v)
				if !ok || err != nil {
					return nil, err
				}
				return &ingressHolder{Address: p.Address, Ingress: p.State.Ingress, IngressHost: p.State.IngressHost}, nil
			}, Equal: sameHolder, Timeout: time.Duration(a.cfg.Timeout), Log: logf})
	}
	if a.pm != nil {
		c.own = watchcache.New(watchcache.Config[string]{Client: a.cli, Trim: a.prefix, Prefix: portalloc.HostIndexPrefix(a.cfg.Host),
			Decode: func(k string, _ []byte) (string, error) {
				if _, id, ok := portalloc.DecodeHostIndexKey(k); ok {
					return portmap.Mark(id), nil
				}
				return "", errors.New("not an endpoint's index key")
			}, Equal: equal[string], Timeout: time.Duration(a.cfg.Timeout), Log: logf})
	}
	return c
}

// runner is one cache as the agent runs it.
type runner interface {
	Run(ctx context.Context) error
	Replace(kvs []watchcache.RawKV, rev int64) bool
	Prefix() string
}

func (c *caches) all() []runner {
	var out []runner
	if c.defs != nil {
		out = append(out, c.defs, c.rings)
	}
	if c.hosts != nil {
		out = append(out, c.hosts, c.live)
	}
	if c.ports != nil {
		out = append(out, c.ports)
	}
	if c.own != nil {
		out = append(out, c.own)
	}
	return out
}

// runCaches keeps the copies: on etcd each follows its watch; on a local
// store one loop scans every prefix every SyncInterval.
func (a *Agent) runCaches(loop func(func(context.Context))) {
	rs := a.caches.all()
	if a.cli != nil {
		for _, r := range rs {
			loop(func(ctx context.Context) { _ = r.Run(ctx) })
		}
		return
	}
	loop(func(ctx context.Context) {
		for {
			for _, r := range rs {
				octx, cancel := a.op(ctx)
				kvs, err := a.st.Scan(octx, r.Prefix(), store.PrefixEnd(r.Prefix()), 0)
				cancel()
				if err != nil {
					a.storeError("scan "+r.Prefix(), err)
					continue
				}
				raw := make([]watchcache.RawKV, len(kvs))
				for i, kv := range kvs {
					raw[i] = watchcache.RawKV{Key: kv.Key, Value: kv.Value, ModRevision: kv.Revision}
				}
				r.Replace(raw, 0)
			}
			if sleep(ctx, time.Duration(a.cfg.SyncInterval)) != nil {
				return
			}
		}
	})
}

// synced waits until every copy in cs holds a listing; false when ctx
// ended first.
func synced(ctx context.Context, cs ...interface{ Synced() <-chan struct{} }) bool {
	for _, c := range cs {
		select {
		case <-ctx.Done():
			return false
		case <-c.Synced():
		}
	}
	return true
}

// resyncPeriod is how often the loops replay their decisions from the
// copies although nothing changed (kernel tables re-applied: hand edits
// repaired): Resync on etcd; on a local store at least every resyncEvery,
// as before the copies.
func (a *Agent) resyncPeriod() time.Duration {
	if a.cli == nil {
		return min(time.Duration(a.cfg.Resync), resyncEvery)
	}
	return time.Duration(a.cfg.Resync)
}

// jittered is d plus up to a fifth of it, so that hosts started together
// do not resync together.
func jittered(d time.Duration) time.Duration { return d + rand.N(d/5+1) }

// knownHosts are the hosts the copies know (host records and liveness
// keys, and the names in extra: hosts seen only in a ring), with their
// state: up while the liveness key exists, else orphaned when the record
// carries the orphaned mark, else down. A host whose last-seen time passed
// orphanAfter counts as down until the sweeper marks it.
func (a *Agent) knownHosts(extra []string) []pool.HostInfo {
	base := a.recordedHosts()
	out := slices.Clone(base)
	for _, n := range extra {
		if _, found := slices.BinarySearchFunc(base, n, func(h pool.HostInfo, n string) int { return strings.Compare(h.Name, n) }); !found {
			out = append(out, pool.HostInfo{Name: n, State: pool.HostDown})
		}
	}
	if len(out) > len(base) {
		slices.SortFunc(out, func(x, y pool.HostInfo) int { return strings.Compare(x.Name, y.Name) })
		out = slices.CompactFunc(out, func(x, y pool.HostInfo) bool { return x.Name == y.Name })
	}
	return out
}

// knownHostsMemo is the last recordedHosts answer and the generations of
// the two copies it came from.
type knownHostsMemo struct {
	mu                sync.Mutex
	ok                bool
	hostsGen, liveGen uint64
	hosts             []pool.HostInfo
}

// recordedHosts are the hosts of the host records and liveness keys,
// sorted by name. It is computed again only when one of the two copies
// changed: the routes loop plans on every ring change, which leaves both
// alone (a cluster filling up changes its rings often, and a
// host's list is what grows with the cluster).
func (a *Agent) recordedHosts() []pool.HostInfo {
	m := &a.hostsMemo
	m.mu.Lock()
	defer m.mu.Unlock()
	hg, lg := a.caches.hosts.Generation(), a.caches.live.Generation()
	if m.ok && m.hostsGen == hg && m.liveGen == lg {
		return m.hosts
	}
	recs, live := a.caches.hosts.Snapshot(), a.caches.live.Snapshot()
	byName := map[string]*pool.HostInfo{}
	info := func(name string) *pool.HostInfo {
		h, ok := byName[name]
		if !ok {
			h = &pool.HostInfo{Name: name, State: pool.HostDown}
			byName[name] = h
		}
		return h
	}
	for k, e := range recs.Entries {
		a.applyHostRecord(info(strings.TrimPrefix(k, pool.HostRecordKeyPrefix)), e)
	}
	for k := range live.Entries {
		if name, ok := pool.LivenessKeyHost(k); ok {
			info(name).State = pool.HostUp
		}
	}
	out := make([]pool.HostInfo, 0, len(byName))
	for _, h := range byName {
		out = append(out, *h)
	}
	slices.SortFunc(out, func(x, y pool.HostInfo) int { return strings.Compare(x.Name, y.Name) })
	m.ok, m.hostsGen, m.liveGen, m.hosts = true, hg, lg, out
	return out
}

// applyHostRecord sets what host record e says of h: an agent has run
// there, its address, and the orphaned mark (a record that did not decode
// is logged and says nothing).
func (a *Agent) applyHostRecord(h *pool.HostInfo, e watchcache.Entry[hostView]) {
	if e.Err != nil {
		a.storeError("host-record", e.Err)
		return
	}
	h.Agent, h.Addr = true, e.Value.Addr
	if e.Value.Orphaned != 0 {
		h.State, h.OrphanedAt = pool.HostOrphaned, time.Unix(e.Value.Orphaned, 0)
	}
}

// hostsNamed are the hosts of names that the copies know (a host record or
// a liveness key; knownHosts's states), sorted by name; a name neither
// copy holds is left out. Each is looked up alone: the cost follows the
// names (the holders of the ingress ports), not the cluster.
func (a *Agent) hostsNamed(names []string) []pool.HostInfo {
	names = slices.Compact(slices.Sorted(slices.Values(names)))
	out := make([]pool.HostInfo, 0, len(names))
	for _, n := range names {
		h := pool.HostInfo{Name: n, State: pool.HostDown}
		rec, recorded := a.caches.hosts.Get(pool.HostRecordKeyPrefix + n)
		if recorded {
			a.applyHostRecord(&h, rec)
		}
		_, up := a.caches.live.Get(pool.LivenessKey(n))
		if up {
			h.State = pool.HostUp
		}
		if recorded || up {
			out = append(out, h)
		}
	}
	return out
}
