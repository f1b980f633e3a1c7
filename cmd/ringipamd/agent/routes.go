package agent

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/routes"
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
	// published is the summary last written to the host record (At
	// aside), so that a change is written at once, not at the next
	// heartbeat.
	published pool.RoutesSummary
	// v6Noted are the IPv6 pools whose local side was logged.
	v6Noted map[string]bool
}

// routesLoop keeps the routing table equal to the plan made of the rings
// and hosts: when the agent starts, on every sync interval, and at once
// when a watch sees a ring or a host record change.
func (a *Agent) routesLoop(ctx context.Context) {
	var s routesState
	for {
		a.syncRoutes(ctx, &s)
		t := time.NewTimer(time.Duration(a.cfg.SyncInterval))
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-a.routesKick:
		case <-t.C:
		}
		t.Stop()
	}
}

// planRoutes reads the pools, their rings and the hosts, and plans; it
// returns the plan, the on-link prefixes it used and the pools' IPv4
// subnets.
func (a *Agent) planRoutes(ctx context.Context) (routes.Result, []netip.Prefix, []netip.Prefix, bool) {
	octx, cancel := a.op(ctx)
	defer cancel()
	defs, err := a.alloc.Pools(octx)
	if err != nil {
		a.storeError("pools", err)
		return routes.Result{}, nil, nil, false
	}
	var in routes.Input
	in.Self = a.cfg.Host
	var names []string
	var subnets []netip.Prefix
	for _, d := range defs {
		ring, err := a.alloc.RingOf(octx, d.Name)
		if err != nil {
			a.storeError("ring", err)
			return routes.Result{}, nil, nil, false
		}
		for _, r := range ring.Ranges {
			if r.Host != "" && !r.Tombstone && r.Host != a.cfg.Host && !slices.Contains(names, r.Host) {
				names = append(names, r.Host)
			}
		}
		in.Pools = append(in.Pools, routes.Pool{Def: d, Ring: ring})
		for _, r := range d.Ranges {
			if r.Subnet.Addr().Is4() && !slices.Contains(subnets, r.Subnet) {
				subnets = append(subnets, r.Subnet)
			}
		}
	}
	hosts, err := a.hostsFor(ctx, names, hostsMaxAge)
	if err != nil {
		a.storeError("hosts", err)
		return routes.Result{}, nil, nil, false
	}
	in.Hosts = routes.HostsFrom(hosts)
	if in.OnLink, err = a.rt.OnLink(); err != nil {
		a.metrics.routes.WithLabelValues("failed").Set(1)
		a.log.Warn("routes: reading this host's addresses failed", "err", err)
		return routes.Result{}, nil, nil, false
	}
	return routes.Plan(in), in.OnLink, subnets, true
}

// syncRoutes plans and, when the plan changed, something failed last time
// or resyncEvery passed, applies it. Refusals and failures are logged when
// they change, not on every pass.
func (a *Agent) syncRoutes(ctx context.Context, s *routesState) {
	plan, onLink, subnets, ok := a.planRoutes(ctx)
	if !ok {
		return
	}
	// The local side, on every pass: a bridge appears with its first
	// container, after the agent started.
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
	if slices.Equal(plan.Routes, s.last) && s.failed == "" && !s.synced.IsZero() && a.now().Sub(s.synced) < resyncEvery {
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
	if !sameSummary(sum, s.published) {
		octx, cancel := a.op(ctx)
		err := a.alloc.ReportRoutes(octx, sum)
		cancel()
		if err != nil {
			a.storeError("report-routes", err)
			return // the heartbeat writes it
		}
		s.published = sum
	}
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

// watchPrefix kicks kick whenever a key under prefix changes (etcd only;
// the poll covers the rest).
func (a *Agent) watchPrefix(ctx context.Context, prefix string, kick chan<- struct{}) {
	for ctx.Err() == nil {
		wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
		for resp := range a.cli.Watch(wctx, a.prefix+prefix, clientv3.WithPrefix()) {
			if resp.Err() != nil {
				break
			}
			if prefix == pool.HostRecordKeyPrefix {
				// A host record changed (a host came, or its --addr
				// changed): the next plan reads the hosts again
				// rather than the list cached for hostsMaxAge.
				a.forgetHosts()
			}
			select {
			case kick <- struct{}{}:
			default:
			}
		}
		cancel()
		if sleep(ctx, time.Second) != nil {
			return
		}
	}
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
