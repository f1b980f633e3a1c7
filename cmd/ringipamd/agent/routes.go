package agent

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/routes"
	"github.com/ringipam/ringipam/pkg/watchcache"
)

// router is the kernel side of the routes to other hosts' ranges
// (routes.Table; a fake in unit tests).
type router interface {
	OnLink() ([]netip.Prefix, error)
	Apply(rs []routes.Route) (routes.Change, error)
	ProxyARP(subnets []netip.Prefix) ([]string, error)
	Clear() error
	Close()
}

// withRouter replaces the netlink routing table (unit tests).
// routesSettle is how long the routes loop waits after a change of its
// copies before it plans, gathering the changes of a burst into one plan.
const routesSettle = 200 * time.Millisecond

// routesMinInterval is the least time between two plans made for changes
// (kube-proxy's --iptables-min-sync-period, 1 s by default, for the same
// reason): a plan visits every range and host of the copies, so while
// hosts start or claim without pause (a cluster created, every node
// rebooted) each agent plans once a second, not once per settle.
const routesMinInterval = time.Second

// planDelay is how long after now the routes loop plans a change that
// arrived in a quiet period: routesSettle, or until routesMinInterval has
// passed since the last plan (planned) if that is later.
func planDelay(now, planned time.Time) time.Duration {
	return max(routesSettle, planned.Add(routesMinInterval).Sub(now))
}

// summaryEvery is the least time between two writes of this host's routes
// summary into its status record (ringctl status reads it; nobody
// watches it): a burst of ring changes, as when a cluster starts, costs
// each host one write per summaryEvery, not one per change.
const summaryEvery = 5 * time.Second

func withRouter(r router) Option { return func(o *options) { o.router = r } }

// RoutesView is what the status page shows of the routes this agent holds.
type RoutesView struct {
	Table   int            `json:"table"`
	Routes  []routes.Route `json:"routes"`
	Refused []string       `json:"refused,omitempty"`
	// Failed is the kernel's refusal of the last apply ("" when every
	// route is installed).
	Failed string `json:"failed,omitempty"`
	// Synced is when the routes were last installed as planned.
	Synced time.Time `json:"synced,omitzero"`
	// ProxyARP are the links (the pools' bridges) answering ARP for
	// other hosts' addresses.
	ProxyARP []string `json:"proxyARP,omitempty"`
}

// routesState is what the routes loop remembers of its last pass.
type routesState struct {
	last     []routes.Route
	synced   time.Time
	refused  string // the refusals last logged
	failed   string // the apply error last logged
	proxy    []string
	proxyErr string
	// onLink and subnets are the on-link prefixes and the pools' IPv4
	// subnets of the last plan (the kernel tick compares and re-applies
	// them without planning).
	onLink, subnets []netip.Prefix
	// rings are the pools' decoded rings, kept while neither the
	// definition nor the ring changes (decoded once per change, not per
	// pass).
	rings map[string]decodedRing
	// published is the summary last written to the host record (At
	// aside), so that a change is written at once, not at the next
	// heartbeat; publishedAt is when, and pending says a changed summary
	// waits for summaryEvery to pass since (flushed by the routes loop).
	published   pool.RoutesSummary
	publishedAt time.Time
	pending     bool
	// v6Noted are the IPv6 pools whose local side was logged.
	v6Noted map[string]bool
}

// decodedRing is one pool's ring as decoded, with the revisions it was
// decoded from: the definition's, and the newest of its range keys with
// their number (a key written raises the newest revision, one deleted
// lowers the number).
type decodedRing struct {
	defRev, ringRev int64
	ringKeys        int
	ring            pool.Ring
}

// ringKeysOf groups the cached range keys (RingKeyPrefix, decoded as they
// arrived) by pool, with the newest revision among each pool's; the
// layout-3 ring keys' markers are no pool's. A key that did not decode is
// its pool's error.
func ringKeysOf(entries map[string]watchcache.Entry[pool.RangeKey]) (map[string][]pool.RangeKey, map[string]int64, map[string]error) {
	keys, newest, bad := map[string][]pool.RangeKey{}, map[string]int64{}, map[string]error{}
	for k, e := range entries {
		p, ok := pool.RangeKeyPool(k)
		if !ok {
			continue
		}
		if e.Err != nil {
			bad[p] = e.Err
			continue
		}
		keys[p] = append(keys[p], e.Value)
		newest[p] = max(newest[p], e.ModRevision)
	}
	return keys, newest, bad
}

// routesLoop keeps the routing table equal to the plan made of the copies
// of the definitions, rings, host records and liveness keys
// (informer.go): when the agent starts, at once when a copy changes (on
// etcd, through its watch), and on every resync (Resync, jittered; no
// store read: the plan is applied again from the copies, repairing hand
// edits). Every SyncInterval it also looks at what the kernel alone can
// change: this host's on-link prefixes (planned again when they changed),
// proxy ARP on bridges that appeared since (a bridge comes with its first
// container), and a failed apply (tried again).
func (a *Agent) routesLoop(ctx context.Context) {
	c := a.caches
	defsK, ringsK, hostsK, liveK := c.defs.Subscribe(), c.rings.Subscribe(), c.hosts.Subscribe(), c.live.Subscribe()
	if !synced(ctx, c.defs, c.rings, c.hosts, c.live) {
		return
	}
	var s routesState
	a.syncRoutes(ctx, &s, true)
	tick := time.NewTicker(time.Duration(a.cfg.SyncInterval))
	defer tick.Stop()
	resync := time.NewTimer(jittered(a.resyncPeriod()))
	defer resync.Stop()
	// A change of a copy is planned routesSettle later, with every
	// change that arrived meanwhile, and no sooner than routesMinInterval
	// after the last plan: when many hosts start or claim at once each
	// agent plans once per burst and at most once a second, not once per
	// event (each plan reads every range and host of its copies).
	settle := time.NewTimer(time.Hour)
	settle.Stop()
	defer settle.Stop()
	settling := false
	planned := time.Now()
	changed := func() {
		if !settling {
			settling = true
			settle.Reset(planDelay(time.Now(), planned))
		}
	}
	flush := time.NewTimer(time.Hour)
	flush.Stop()
	defer flush.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-defsK:
			changed()
			continue
		case <-ringsK:
			changed()
			continue
		case <-hostsK:
			changed()
			continue
		case <-liveK:
			changed()
			continue
		case <-settle.C:
			settling = false
			a.syncRoutes(ctx, &s, false)
			planned = time.Now()
		case <-flush.C:
			a.flushSummary(ctx, &s)
		case <-tick.C:
			a.routesKernelTick(ctx, &s)
		case <-resync.C:
			resync.Reset(jittered(a.resyncPeriod()))
			a.syncRoutes(ctx, &s, true)
		}
		if s.pending {
			flush.Reset(max(time.Until(s.publishedAt.Add(summaryEvery)), 0))
		}
	}
}

// routesKernelTick re-plans when this host's on-link prefixes changed or
// the last apply failed, and turns proxy ARP on for bridges that appeared:
// no store read, nothing planned when nothing local changed.
func (a *Agent) routesKernelTick(ctx context.Context, s *routesState) {
	onLink, err := a.rt.OnLink()
	if err == nil && !slices.Equal(onLink, s.onLink) || s.failed != "" {
		a.syncRoutes(ctx, s, s.failed != "")
		return
	}
	a.proxyARP(s, s.subnets)
}

// planRoutes plans from the copies; it returns the plan, the on-link
// prefixes it used and the pools' IPv4 subnets. It reads nothing from the
// store.
func (a *Agent) planRoutes(s *routesState) (routes.Result, []netip.Prefix, []netip.Prefix, bool) {
	defs, rings := a.caches.defs.Snapshot(), a.caches.rings.Snapshot()
	var in routes.Input
	in.Self = a.cfg.Host
	var names []string
	var subnets []netip.Prefix
	keep := map[string]decodedRing{}
	ringKeys, ringRevs, ringErrs := ringKeysOf(rings.Entries)
	named := map[string]bool{}
	for _, k := range slices.Sorted(maps.Keys(defs.Entries)) {
		e := defs.Entries[k]
		if e.Err != nil {
			a.storeError("pools", e.Err)
			return routes.Result{}, nil, nil, false
		}
		d := e.Value
		keys, rev := ringKeys[d.Name], ringRevs[d.Name]
		dr, ok := s.rings[d.Name]
		if err := ringErrs[d.Name]; err != nil {
			a.storeError("ring", fmt.Errorf("pool %s: %w", d.Name, err))
			return routes.Result{}, nil, nil, false
		}
		if !ok || dr.defRev != e.ModRevision || dr.ringRev != rev || dr.ringKeys != len(keys) {
			ring, err := pool.RingOfRangeKeys(d.Name, d, keys)
			if err != nil {
				a.storeError("ring", err)
				return routes.Result{}, nil, nil, false
			}
			dr = decodedRing{defRev: e.ModRevision, ringRev: rev, ringKeys: len(keys), ring: ring}
		}
		keep[d.Name] = dr
		for _, r := range dr.ring.Ranges {
			if r.Host != "" && r.Host != a.cfg.Host && !named[r.Host] {
				named[r.Host] = true
				names = append(names, r.Host)
			}
		}
		in.Pools = append(in.Pools, routes.Pool{Def: d, Ring: dr.ring})
		for _, r := range d.Ranges {
			if r.Subnet.Addr().Is4() && !slices.Contains(subnets, r.Subnet) {
				subnets = append(subnets, r.Subnet)
			}
		}
	}
	s.rings = keep
	in.Hosts = routes.HostsFrom(a.knownHosts(names))
	var err error
	if in.OnLink, err = a.rt.OnLink(); err != nil {
		a.metrics.routes.WithLabelValues("failed").Set(1)
		a.log.Warn("routes: reading this host's addresses failed", "err", err)
		return routes.Result{}, nil, nil, false
	}
	return routes.Plan(in), in.OnLink, subnets, true
}

// proxyARP turns proxy ARP on for the links of subnets, and logs what
// changed.
func (a *Agent) proxyARP(s *routesState, subnets []netip.Prefix) []string {
	links, err := a.rt.ProxyARP(subnets)
	if msg := fmt.Sprint(err); err != nil && msg != s.proxyErr {
		a.log.Warn("routes: turning proxy ARP on for the pools' bridges failed", "err", err)
		s.proxyErr = msg
	} else if err == nil {
		s.proxyErr = ""
	}
	if !slices.Equal(links, s.proxy) {
		a.log.Info("routes: proxy ARP for other hosts' addresses", "links", links)
		s.proxy = links
	}
	return links
}

// syncRoutes plans from the copies and, when the plan changed, the last
// apply failed or force (a resync), applies it. Refusals and failures are
// logged when they change, not on every pass.
func (a *Agent) syncRoutes(ctx context.Context, s *routesState, force bool) {
	plan, onLink, subnets, ok := a.planRoutes(s)
	if !ok {
		return
	}
	s.onLink, s.subnets = onLink, subnets
	// The local side, on every pass: a bridge appears with its first
	// container, after the agent started.
	links := a.proxyARP(s, subnets)
	a.noteIPv6(s, plan.Routes)
	refused := make([]string, len(plan.Refused))
	for i, r := range plan.Refused {
		refused[i] = r.String()
	}
	if j := strings.Join(refused, "\n"); j != s.refused {
		for _, r := range plan.Refused {
			a.log.Warn("routes: a range of another host is not routed", "pool", r.Pool, "host", r.Host,
				"range", fmt.Sprintf("%s-%s", r.Start, r.End), "reason", r.Reason)
		}
		s.refused = j
	}
	a.metrics.routes.WithLabelValues("refused").Set(float64(len(plan.Refused)))
	view := RoutesView{Table: a.routeTable, Routes: plan.Routes, Refused: refused, ProxyARP: links}
	if !force && slices.Equal(plan.Routes, s.last) && s.failed == "" && !s.synced.IsZero() {
		view.Synced = s.synced
		a.setRoutes(view)
		a.publishRoutes(ctx, s, plan, onLink, 0, s.synced) // refusals may have changed
		return
	}
	ch, err := a.rt.Apply(plan.Routes)
	failed := 0
	if err != nil {
		var joined interface{ Unwrap() []error }
		if errors.As(err, &joined) {
			failed = len(joined.Unwrap())
		} else {
			failed = 1
		}
		if err.Error() != s.failed {
			a.log.Warn("routes: installing failed", "failed", failed, "err", err)
		}
		s.failed, view.Failed = err.Error(), err.Error()
	} else {
		if s.failed != "" {
			a.log.Info("routes: installed after earlier failures")
		}
		s.failed = ""
		s.synced = a.now()
		view.Synced = s.synced
	}
	if ch.Added+ch.Replaced+ch.Deleted > 0 {
		a.log.Info("routes", "routes", len(plan.Routes), "added", ch.Added, "replaced", ch.Replaced, "deleted", ch.Deleted)
	}
	s.last = plan.Routes
	a.metrics.routes.WithLabelValues("installed").Set(float64(max(len(plan.Routes)-failed, 0)))
	a.metrics.routes.WithLabelValues("failed").Set(float64(failed))
	a.setRoutes(view)
	at := s.synced
	if err != nil {
		at = a.now()
	}
	a.publishRoutes(ctx, s, plan, onLink, failed, at)
}

// noteIPv6 logs once per IPv6 pool the agent routes what its containers
// need to use the routes: there is no range-wide proxy NDP, so containers
// on a bridge send other hosts' addresses to the host only with the subnet
// route ipam-ring's ipv6ViaGateway adds; Docker's bridge networks get no
// such route (libnetwork's IPAM API returns no routes).
func (a *Agent) noteIPv6(s *routesState, rs []routes.Route) {
	for _, r := range rs {
		if !r.Dst.Addr().Is6() || s.v6Noted[r.Pool] {
			continue
		}
		if s.v6Noted == nil {
			s.v6Noted = map[string]bool{}
		}
		s.v6Noted[r.Pool] = true
		a.log.Info("routes: IPv6 pool routed to other hosts; its containers on this host reach them through ptp (nothing more needed) "+
			"or through a bridge network whose ipam-ring configuration has \"ipv6ViaGateway\": true. "+
			"Docker networks on this pool cannot: the Docker IPAM API returns no routes and Linux has no range-wide proxy NDP, "+
			"so IPv6 across dockerd hosts does not work (IPv4 does)", "pool", r.Pool)
	}
}

// publishRoutes keeps the routes summary and writes it into the host's
// status record (pool.Allocator.ReportRoutes: never watched) when it
// changed: ringctl status compares it with the ring. A failed write is
// tried again by the next heartbeat (routesReport).
func (a *Agent) publishRoutes(ctx context.Context, s *routesState, plan routes.Result, onLink []netip.Prefix, failed int, at time.Time) {
	sum := pool.RoutesSummary{Held: max(len(plan.Routes)-failed, 0), Failed: failed, Refused: len(plan.Refused),
		Digest: routes.Digest(plan.Routes), OnLink: onLink, At: at.Unix()}
	a.mu.Lock()
	a.routesSummary = &sum
	a.mu.Unlock()
	s.pending = !sameSummary(sum, s.published)
	if s.pending && time.Since(s.publishedAt) >= summaryEvery {
		a.flushSummary(ctx, s)
	}
}

// flushSummary writes the routes summary into the host's status record if
// it changed since the last write. A failed write is tried again by the
// next heartbeat, which writes the summary too.
func (a *Agent) flushSummary(ctx context.Context, s *routesState) {
	a.mu.Lock()
	sum := a.routesSummary
	a.mu.Unlock()
	if sum == nil || sameSummary(*sum, s.published) {
		s.pending = false
		return
	}
	octx, cancel := a.op(ctx)
	err := a.alloc.ReportRoutes(octx, *sum)
	cancel()
	s.pending, s.publishedAt = false, time.Now()
	if err != nil {
		a.storeError("report-routes", err)
		return // the heartbeat writes it
	}
	s.published = *sum
}

// sameSummary compares two summaries but for their time.
func sameSummary(x, y pool.RoutesSummary) bool {
	return x.Held == y.Held && x.Failed == y.Failed && x.Refused == y.Refused && x.Digest == y.Digest &&
		slices.Equal(x.OnLink, y.OnLink)
}

// routesReport is the routes summary the heartbeat keeps in the host's
// status record (written only when it differs from the recorded one): the
// last one with --routes, a removal without (a summary left by an earlier
// run with --routes would be a lie).
func (a *Agent) routesReport() *pool.RoutesSummary {
	if a.rt == nil {
		return &pool.RoutesSummary{}
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.routesSummary // nil (keep) before the first pass
}

func (a *Agent) setRoutes(v RoutesView) {
	a.mu.Lock()
	a.routesView = &v
	a.mu.Unlock()
}

// removeRoutes takes every route of the agent out of the kernel and puts
// back the proxy ARP values it changed (on stop: routes nobody keeps up to
// date are worse than none).
func (a *Agent) removeRoutes() {
	if err := a.rt.Clear(); err != nil {
		a.log.Warn("removing the routes", "err", err)
	}
	a.rt.Close()
}
