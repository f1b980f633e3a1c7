package pool

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/ringipam/ringipam/pkg/store"
)

// Hosts that are gone (SwarmKit's WorkerSpec, Weave's rmpeer).
//
// A host is up while its liveness key (LivenessKey) exists: the host agent
// writes it attached to an etcd lease it keeps alive, so the key vanishes a
// lease TTL after the agent dies. Liveness is the lease alone: nothing is
// written on a timer to say a host is up. Every host also has a last-seen
// time, the latest of: its status record (s/<host>: the agent's heartbeat,
// refreshed at most every SeenEvery, and its plugins' last-seen touch, at
// most every LastSeenEvery), its host record (n/<host>: what agents before
// the status record wrote there), and every ADD and DEL in the pool's host
// state. A host with no live liveness key is down; one that has been down
// (not seen) for longer than orphanAfter is orphaned, and Reclaim takes its
// space back. Nothing of a host whose liveness key exists is ever
// reclaimed: every reclaiming commit requires the key absent.
//
// The host record n/<host>, which every routing and forwarding agent
// watches, changes only when what it says changes (the host's address, its
// orphaned mark): never on a timer. The status record s/<host> is watched
// by nobody.

// DefaultOrphanAfter is how long a host must have been down before it is
// orphaned (the WorkerSpec's 48 hours).
const DefaultOrphanAfter = 48 * time.Hour

// hostRecord is what the store keeps about a host itself.
type hostRecord struct {
	// Addr is where other hosts forward its ingress ports and route its
	// ranges: the first address of its agent's --addr, the only one
	// before dual-stack hosts (and what older agents still read).
	Addr string `json:"addr,omitempty"`
	// Addrs are all of --addr's addresses (at most one per family), only
	// when there are more than one; Addr is then Addrs[0].
	Addrs []string `json:"as,omitempty"`
	// Seen is when the record was last written by an agent (Unix
	// seconds). Agents before the status record wrote it on every
	// heartbeat; this code writes it only with a change of the record,
	// and reads it as one more last-seen source.
	Seen int64 `json:"s,omitempty"`
	// Checked is the plugins' last-seen touch as agents before the
	// status record wrote it (see hostStatus.Checked); read, never
	// written here.
	Checked  int64 `json:"c,omitempty"`
	Orphaned int64 `json:"o,omitempty"` // when it was orphaned; 0: never, or acknowledged
	// Reclaimed counts the owners released when it was orphaned.
	Reclaimed int `json:"r,omitempty"`
	// Routes is the routes summary as agents before the status record
	// wrote it (see hostStatus.Routes); read, never written here.
	Routes *RoutesSummary `json:"rt,omitempty"`
	// Kube marks a host that is a Kubernetes node of the same name (its
	// agent ran with Kubernetes on: MarkKubeNode): only such a host is
	// reclaimed when its Node object is deleted. Written once.
	Kube bool `json:"k,omitempty"`
}

// hostStatus is what the store keeps about a host that changes on a timer
// or with its routes (s/<host>): kept out of the host record, which every
// routing agent watches, and watched by nobody.
type hostStatus struct {
	Seen int64 `json:"s,omitempty"` // the agent's last heartbeat write (Unix seconds; see SeenEvery)
	// Checked is when a verb that committed nothing last refreshed the
	// host's last-seen time (Unix seconds), written at most every
	// LastSeenEvery (see there): the last-seen time of hosts whose
	// containers live long, agent or not.
	Checked int64 `json:"c,omitempty"`
	// Routes is what the host's agent last reported of the routes it
	// holds (ringipamd --routes); nil when it routes nothing.
	Routes *RoutesSummary `json:"rt,omitempty"`
}

// decodeStatus decodes a status record as read (absent: the zero value).
func decodeStatus(kv store.KV) (hostStatus, error) {
	var st hostStatus
	if kv.Exists() {
		if err := json.Unmarshal(kv.Value, &st); err != nil {
			return hostStatus{}, fmt.Errorf("%s: corrupt host status: %w", kv.Key, err)
		}
	}
	return st, nil
}

// decodeRecord decodes a host record as read (absent: the zero value).
func decodeRecord(kv store.KV) (hostRecord, error) {
	var rec hostRecord
	if kv.Exists() {
		if err := json.Unmarshal(kv.Value, &rec); err != nil {
			return hostRecord{}, fmt.Errorf("%s: corrupt host record: %w", kv.Key, err)
		}
	}
	return rec, nil
}

// SeenEvery is how stale a host agent lets its recorded last-seen time
// (the status record's Seen) get before its heartbeat writes it again,
// for a cluster orphaning hosts after orphanAfter: orphanAfter/48, within
// [1 min, 1 h] (1 h at the default 48 h). A host that stops is judged
// down by its lease, not by this time; the time only decides when a down
// host is orphaned, so it may lag by up to SeenEvery: a host is orphaned
// between orphanAfter and orphanAfter+SeenEvery after it was last up,
// about 2% late. An idle agent so writes its status once per SeenEvery
// and its host record never.
func SeenEvery(orphanAfter time.Duration) time.Duration {
	if orphanAfter <= 0 {
		orphanAfter = DefaultOrphanAfter
	}
	return min(max(orphanAfter/48, time.Minute), time.Hour)
}

// RoutesSummary is a host agent's report of the routes to other hosts'
// ranges it holds (ringipamd --routes), kept in its status record so that
// ringctl, which reaches no agent, can show them and compare them with the
// plan it makes itself (package routes) from the same ring. Small on
// purpose: counts and a digest of the routes, not the routes.
type RoutesSummary struct {
	Held    int    `json:"n"`           // routes installed
	Failed  int    `json:"f,omitempty"` // planned routes the kernel refused
	Refused int    `json:"x,omitempty"` // ranges the plan cannot route
	Digest  string `json:"d"`           // routes.Digest of the plan applied
	// OnLink are the prefixes directly connected to the host that the
	// plan was made with (the planner's only input not in the store).
	OnLink []netip.Prefix `json:"l,omitempty"`
	At     int64          `json:"t"` // when the plan was applied (Unix seconds)
}

// HostState is a host's state as the cluster sees it.
type HostState string

const (
	HostUp       HostState = "up"       // its liveness key exists
	HostDown     HostState = "down"     // no liveness key, seen within orphanAfter
	HostOrphaned HostState = "orphaned" // down and not seen for longer than orphanAfter
)

// HostInfo is one host as Hosts reports it.
type HostInfo struct {
	Name  string
	State HostState
	Agent bool // it has a host record (an agent has run there)
	// Addr is its recorded address, if any: its agent's --addr, one
	// address per family separated by a comma ("198.18.0.1,fd00::1");
	// AddrList splits it.
	Addr     string
	LastSeen time.Time // latest of heartbeat and allocations; zero if never
	// OrphanedAt is when it was orphaned and reclaimed; zero if it was not
	// (or the host acknowledged it since).
	OrphanedAt time.Time
	Reclaimed  int // owners released when it was orphaned
	// KubeNode: the host is a Kubernetes node of the same name (its
	// agent marked it: MarkKubeNode).
	KubeNode bool
	// Routes is what its agent last reported of the routes it holds;
	// nil when it routes nothing (see RoutesSummary).
	Routes *RoutesSummary
	Ranges int      // live (not tombstoned) ranges it owns, all pools
	Used   uint64   // addresses its owners hold, all pools
	Pools  []string // pools it has state in
}

// AddrList returns h's recorded addresses, one per family ("" parts left
// out); nil when it has none.
func (h HostInfo) AddrList() []string { return SplitAddrs(h.Addr) }

// SplitAddrs splits an --addr value ("198.18.0.1,fd00::1") into its
// addresses, spaces trimmed and empty parts left out. It does not parse
// them.
func SplitAddrs(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

// addr is the record's addresses as HostInfo.Addr reports them: Addrs
// joined, or for a record written before dual-stack hosts its one Addr.
func (r hostRecord) addr() string {
	if len(r.Addrs) > 0 {
		return strings.Join(r.Addrs, ",")
	}
	return r.Addr
}

// setAddr records addr (an --addr value, one address per family) in the
// form older readers understand too: the first address in Addr.
func (r *hostRecord) setAddr(addr string) {
	as := SplitAddrs(addr)
	r.Addr, r.Addrs = "", nil
	if len(as) > 0 {
		r.Addr = as[0]
	}
	if len(as) > 1 {
		r.Addrs = as
	}
}

// Heartbeat records that this host is alive now and where it can be reached
// (addr, may be empty: an --addr value, one address per family separated by
// commas), and returns its record as it was: a host that was orphaned
// while it was away learns it here (OrphanedAt set). A non-nil routes
// replaces the routes summary (nil keeps it; an empty summary with Digest
// "" removes it; see ReportRoutes).
//
// It reads the host record and the status record in one round trip and
// writes only what changed: the host record (watched by every routing
// agent) when it is absent or records another address; the status record
// when its last-seen time is older than the allocator's SeenEvery
// (WithSeenEvery; every call without it) or the routes summary changed.
// An idle agent's heartbeat so costs one read, and one unwatched write per
// SeenEvery.
func (a *Allocator) Heartbeat(ctx context.Context, addr string, routes *RoutesSummary) (HostInfo, error) {
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	var before hostRecord
	err := a.run(ctx, func(int) error {
		kvs, err := a.get(ctx, hostRecordKey(a.host), statusKey(a.host))
		if err != nil {
			return err
		}
		if before, err = decodeRecord(kvs[0]); err != nil {
			return err
		}
		st, err := decodeStatus(kvs[1])
		if err != nil {
			return err
		}
		now := a.now().Unix()
		var conds []store.Cond
		var ops []store.Op
		if as := SplitAddrs(addr); len(as) > 0 && (!kvs[0].Exists() || before.addr() != strings.Join(as, ",")) {
			rec := before
			rec.setAddr(addr)
			rec.Seen = now // for agents that read last-seen here only
			b, _ := json.Marshal(rec)
			conds, ops = append(conds, store.Unchanged(kvs[0])), append(ops, store.Put(kvs[0].Key, b))
		}
		next := st
		if now-st.Seen >= int64(a.seenEvery/time.Second) {
			next.Seen = now
		}
		if routes != nil {
			next.Routes = nil
			if routes.Digest != "" {
				next.Routes = routes
			}
		}
		if next.Seen != st.Seen || !sameRoutes(next.Routes, st.Routes) {
			next.Seen = now
			b, _ := json.Marshal(next)
			conds, ops = append(conds, store.Unchanged(kvs[1])), append(ops, store.Put(kvs[1].Key, b))
		}
		if len(ops) == 0 {
			return nil
		}
		return a.st.Commit(ctx, conds, ops)
	})
	if err != nil {
		return HostInfo{}, err
	}
	info := HostInfo{Name: a.host, Agent: true, Addr: before.addr(), Reclaimed: before.Reclaimed}
	if before.Orphaned != 0 {
		info.OrphanedAt = time.Unix(before.Orphaned, 0)
	}
	return info, nil
}

// MarkKubeNode records in this host's host record that the host is the
// Kubernetes node of the same name (the agent does it once, when it runs
// with Kubernetes on), so that the deletion of that Node reclaims it and a
// host of a store shared with hosts outside Kubernetes is never reclaimed
// for having no Node. The record is written only when the mark is
// missing: the host record is watched by every routing agent.
func (a *Allocator) MarkKubeNode(ctx context.Context) error {
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	return a.run(ctx, func(int) error {
		kvs, err := a.get(ctx, hostRecordKey(a.host))
		if err != nil {
			return err
		}
		rec, err := decodeRecord(kvs[0])
		if err != nil || rec.Kube {
			return err
		}
		rec.Kube = true
		if rec.Seen == 0 {
			rec.Seen = a.now().Unix()
		}
		b, _ := json.Marshal(rec)
		return a.st.Commit(ctx, []store.Cond{store.Unchanged(kvs[0])}, []store.Op{store.Put(kvs[0].Key, b)})
	})
}

// ReportRoutes records the host agent's routes summary in its status
// record (an empty Digest removes it), written only when it differs from
// the recorded one but for its time: ringctl compares it with the ring.
func (a *Allocator) ReportRoutes(ctx context.Context, sum RoutesSummary) error {
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	return a.run(ctx, func(int) error {
		kvs, err := a.get(ctx, statusKey(a.host))
		if err != nil {
			return err
		}
		st, err := decodeStatus(kvs[0])
		if err != nil {
			return err
		}
		var want *RoutesSummary
		if sum.Digest != "" {
			want = &sum
		}
		if kvs[0].Exists() && sameRoutes(st.Routes, want) {
			return nil
		}
		st.Routes = want
		st.Seen = a.now().Unix()
		b, _ := json.Marshal(st)
		return a.st.Commit(ctx, []store.Cond{store.Unchanged(kvs[0])}, []store.Op{store.Put(kvs[0].Key, b)})
	})
}

// sameRoutes compares two summaries but for their time (nil: none).
func sameRoutes(x, y *RoutesSummary) bool {
	if x == nil || y == nil {
		return x == y
	}
	return x.Held == y.Held && x.Failed == y.Failed && x.Refused == y.Refused && x.Digest == y.Digest &&
		slices.Equal(x.OnLink, y.OnLink)
}

// AckOrphaned clears this host's orphaned mark (an operator, or the agent
// after it reported it, acknowledges that the host's old containers lost
// their addresses). It returns when the host was orphaned; zero if it was
// not.
func (a *Allocator) AckOrphaned(ctx context.Context) (time.Time, error) {
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	var at time.Time
	err := a.run(ctx, func(int) error {
		kvs, err := a.get(ctx, hostRecordKey(a.host))
		if err != nil || !kvs[0].Exists() {
			return err
		}
		rec, err := decodeRecord(kvs[0])
		if err != nil {
			return err
		}
		if rec.Orphaned == 0 {
			return nil
		}
		at = time.Unix(rec.Orphaned, 0)
		rec.Orphaned, rec.Reclaimed = 0, 0
		b, _ := json.Marshal(rec)
		return a.st.Commit(ctx, []store.Cond{store.Unchanged(kvs[0])}, []store.Op{store.Put(kvs[0].Key, b)})
	})
	return at, err
}

// Orphaned reports when this host was orphaned, zero if it was not (or it
// was acknowledged): one read, for STATUS.
func (a *Allocator) Orphaned(ctx context.Context) (time.Time, error) {
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	kvs, err := a.get(ctx, hostRecordKey(a.host), statusKey(a.host))
	if err != nil {
		return time.Time{}, err
	}
	rec, err := decodeRecord(kvs[0])
	if err != nil {
		return time.Time{}, err
	}
	if a.seen {
		a.touch(ctx, kvs[1]) // STATUS commits nothing
	}
	if rec.Orphaned == 0 {
		return time.Time{}, nil
	}
	return time.Unix(rec.Orphaned, 0), nil
}

// Hosts reports every host the store knows (by host record, liveness key,
// pool state or ring range), with its state judged by orphanAfter (<= 0:
// DefaultOrphanAfter) at the allocator's clock.
func (a *Allocator) Hosts(ctx context.Context, orphanAfter time.Duration) ([]HostInfo, error) {
	if orphanAfter <= 0 {
		orphanAfter = DefaultOrphanAfter
	}
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	if err := a.ensureLayout(ctx); err != nil {
		return nil, err
	}
	hosts := map[string]*HostInfo{}
	info := func(name string) *HostInfo {
		h, ok := hosts[name]
		if !ok {
			h = &HostInfo{Name: name}
			hosts[name] = h
		}
		return h
	}
	seen := func(h *HostInfo, unix int64) {
		if t := time.Unix(unix, 0); unix != 0 && t.After(h.LastSeen) {
			h.LastSeen = t
		}
	}
	scan := func(prefix string) ([]store.KV, error) {
		return a.st.Scan(ctx, prefix, store.PrefixEnd(prefix), 0)
	}
	recs, err := scan(prefixHostRecord)
	if err != nil {
		return nil, err
	}
	// The routes summary of the newer of the two records: the status
	// record once an agent of this code ran, the host record of an agent
	// before it (or after a downgrade).
	routesAt := map[string]int64{}
	for _, kv := range recs {
		rec, err := decodeRecord(kv)
		if err != nil {
			return nil, err
		}
		h := info(strings.TrimPrefix(kv.Key, prefixHostRecord))
		h.Agent, h.Addr, h.Reclaimed, h.Routes = rec.Seen != 0 || rec.addr() != "", rec.addr(), rec.Reclaimed, rec.Routes
		h.KubeNode = rec.Kube
		routesAt[h.Name] = max(rec.Seen, rec.Checked)
		seen(h, rec.Seen)
		seen(h, rec.Checked)
		if rec.Orphaned != 0 {
			h.OrphanedAt = time.Unix(rec.Orphaned, 0)
		}
	}
	stats, err := scan(prefixStatus)
	if err != nil {
		return nil, err
	}
	for _, kv := range stats {
		st, err := decodeStatus(kv)
		if err != nil {
			return nil, err
		}
		h := info(strings.TrimPrefix(kv.Key, prefixStatus))
		h.Agent = h.Agent || st.Seen != 0
		if at, ok := routesAt[h.Name]; !ok || max(st.Seen, st.Checked) >= at {
			h.Routes = st.Routes
		}
		seen(h, st.Seen)
		seen(h, st.Checked)
	}
	live, err := scan(prefixLive)
	if err != nil {
		return nil, err
	}
	up := map[string]bool{}
	for _, kv := range live {
		up[strings.TrimPrefix(kv.Key, prefixLive)] = true
		info(strings.TrimPrefix(kv.Key, prefixLive))
	}
	states, err := scan(prefixHost)
	if err != nil {
		return nil, err
	}
	for _, kv := range states {
		pool, host, ok := strings.Cut(strings.TrimPrefix(kv.Key, prefixHost), "/")
		if !ok {
			continue
		}
		var hs hostState
		if err := json.Unmarshal(kv.Value, &hs); err != nil {
			return nil, fmt.Errorf("%s: corrupt host state: %w", kv.Key, err)
		}
		h := info(host)
		h.Used += hs.Used
		h.Pools = append(h.Pools, pool)
		seen(h, hs.Seen)
	}
	rings, err := scan(prefixRing)
	if err != nil {
		return nil, err
	}
	for _, kv := range rings {
		if _, ok := RangeKeyPool(kv.Key); !ok {
			continue // a layout-3 ring key's marker
		}
		var rec rangeRec
		if err := json.Unmarshal(kv.Value, &rec); err != nil {
			return nil, fmt.Errorf("%s: corrupt range: %w", kv.Key, err)
		}
		if rec.Host == "" {
			continue
		}
		h := info(rec.Host)
		if !rec.Tomb {
			h.Ranges++
		}
	}
	now := a.now()
	var out []HostInfo
	for _, h := range hosts {
		switch {
		case up[h.Name]:
			h.State = HostUp
		case now.Sub(h.LastSeen) > orphanAfter:
			h.State = HostOrphaned
		default:
			h.State = HostDown
		}
		slices.Sort(h.Pools)
		out = append(out, *h)
	}
	slices.SortFunc(out, func(x, y HostInfo) int { return strings.Compare(x.Name, y.Name) })
	return out, nil
}

// LastSeenEvery is how stale a host's recorded last-seen time may get
// before a verb of an allocator WithLastSeen refreshes it. Every verb
// (ADD, replayed or not; DEL; CHECK; GC; STATUS; the Docker driver's
// calls) reads the host's status record in the round trip it makes anyway; a verb
// that commits refreshes the host's state in the pools it changes (the
// host states' Seen) in that commit; a verb that commits nothing writes
// the status record (Checked) only when it is older than LastSeenEvery: one
// conditional write per host per minute at most, none while fresh. So a
// host's last-seen time lags its last verb by less than LastSeenEvery, and
// a host is orphaned only after orphanAfter (>> LastSeenEvery; 48 h by
// default) without any verb and without its agent.
const LastSeenEvery = time.Minute

// seenKey is the key a verb reads to keep the last-seen time (see
// LastSeenEvery), or none when the allocator does not keep it.
func (a *Allocator) seenKey() []string {
	if !a.seen {
		return nil
	}
	return []string{statusKey(a.host)}
}

// RefreshSeen keeps this host's last-seen time fresh for a verb that reads
// nothing else (a CNI GC without a list of attachments): one read, and one
// conditional write when the record is older than LastSeenEvery. It does
// nothing for an allocator without WithLastSeen.
func (a *Allocator) RefreshSeen(ctx context.Context) error {
	if !a.seen {
		return nil
	}
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	kvs, err := a.get(ctx, statusKey(a.host))
	if err != nil {
		return err
	}
	a.touch(ctx, kvs[0])
	return nil
}

// touch refreshes this host's last-seen time for a verb that commits
// nothing, when its status record as read (kv, from the verb's own read)
// is older than LastSeenEvery. Best effort: a conflict with a heartbeat or
// a failure only means the next verb tries again. It writes the status
// record, which nobody watches.
func (a *Allocator) touch(ctx context.Context, kv store.KV) {
	if kv.Key != statusKey(a.host) {
		return
	}
	var rec hostStatus
	if kv.Exists() && json.Unmarshal(kv.Value, &rec) != nil {
		return
	}
	now := a.now().Unix()
	if last := max(rec.Seen, rec.Checked); now-last < int64(LastSeenEvery/time.Second) {
		return
	}
	rec.Checked = now
	b, _ := json.Marshal(rec)
	if a.st.Commit(ctx, []store.Cond{store.Unchanged(kv)}, []store.Op{store.Put(kv.Key, b)}) == nil {
		a.stats.commits.Add(1)
	}
}

// PoolUse is this host's state in one pool, as OwnUsage reads it.
type PoolUse struct {
	Pool     string
	Used     uint64    // addresses this host's owners hold in the pool
	LastSeen time.Time // its last allocation or release there; zero if never
}

// OwnUsage reports this allocator's host's state in every pool from its
// own keys: the pool definitions (one scan, independent of the number of
// hosts) and its host states (one read); nothing of another host. Pools
// the host has no state in are reported with nothing used.
func (a *Allocator) OwnUsage(ctx context.Context) ([]PoolUse, error) {
	defs, err := a.Pools(ctx)
	if err != nil || len(defs) == 0 {
		return nil, err
	}
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	keys := make([]string, len(defs))
	for i, d := range defs {
		keys[i] = hostKey(d.Name, a.host)
	}
	kvs, err := a.get(ctx, keys...)
	if err != nil {
		return nil, err
	}
	out := make([]PoolUse, len(defs))
	for i, kv := range kvs {
		out[i].Pool = defs[i].Name
		if !kv.Exists() {
			continue
		}
		var hs hostState
		if err := json.Unmarshal(kv.Value, &hs); err != nil {
			return nil, fmt.Errorf("%s: corrupt host state: %w", kv.Key, err)
		}
		out[i].Used = hs.Used
		if hs.Seen != 0 {
			out[i].LastSeen = time.Unix(hs.Seen, 0)
		}
	}
	return out, nil
}
