package agent

import (
	"context"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/ringipam/ringipam/pkg/pool"
)

// metrics are the agent's Prometheus metrics, on a registry of their own.
// This host's own figures come from its own keys (its host state in each
// pool), read at scrape time at most once per StatusRefresh; the
// pool-wide gauges (every pool, every host) only on the elected leader,
// which computes them at scrape time too, at most once per StatusRefresh
// (leader.go); counters count what this agent did.
type metrics struct {
	registry  *prometheus.Registry
	reclaims  prometheus.Counter
	released  prometheus.Counter
	ports     prometheus.Counter
	storeErrs *prometheus.CounterVec
	syncErrs  prometheus.Counter
	// stalePortmap counts attachments whose forwards the agent removed
	// from portmap-ingress's table (this host no longer held them).
	stalePortmap prometheus.Counter
	// calls counts the plugins' invocations run on the agent socket.
	calls *prometheus.CounterVec
	// socketRefused counts connections to the agent socket closed or
	// answered without running anything, by reason.
	socketRefused *prometheus.CounterVec
	// delQueue counts the queued DELs the agent ran, by result.
	delQueue *prometheus.CounterVec
	// routes counts the routes to other hosts' ranges by state (--routes).
	routes *prometheus.GaugeVec
	// sweeps, compactions and removed count the leader's work.
	sweeps      prometheus.Counter
	compactions prometheus.Counter
	removed     prometheus.Counter
	// nodeReclaims counts the hosts of deleted Nodes the leader
	// reclaimed; vanished the owners of vanished pods released; criErrs
	// the passes the runtime could not be asked (kube.go, vanished.go).
	nodeReclaims prometheus.Counter
	vanished     prometheus.Counter
	criErrs      prometheus.Counter
	viewFn       func() metricsView
}

// metricsView is what a scrape shows of the agent's state.
type metricsView struct {
	leader   bool
	figures  *figures    // the pool-wide figures: the leader's, nil elsewhere
	own      *ownFigures // this host's own
	orphaned bool
	liveness bool
	forwards int
}

var (
	descPoolAddrs = prometheus.NewDesc("ringipam_pool_addresses", "Addresses of a pool by state: used (held by an owner) or available (capacity minus used; held reservations not subtracted).", []string{"pool", "state"}, nil)
	descHostAddrs = prometheus.NewDesc("ringipam_pool_host_addresses", "Addresses held in a pool by the owners of each host.", []string{"pool", "host"}, nil)
	descRanges    = prometheus.NewDesc("ringipam_pool_ranges", "Ranges of a pool's ring by owning host (\"\" unowned) and whether tombstoned.", []string{"pool", "host", "tombstone"}, nil)
	descHosts     = prometheus.NewDesc("ringipam_hosts", "Hosts the store knows, by state (up, down, orphaned).", []string{"state"}, nil)
	descOrphaned  = prometheus.NewDesc("ringipam_host_orphaned", "1 while this host is marked orphaned (its old containers lost their addresses) and nobody acknowledged it.", nil, nil)
	descLiveness  = prometheus.NewDesc("ringipam_liveness_held", "1 while this agent holds its host's liveness record.", nil, nil)
	descForwards  = prometheus.NewDesc("ringipam_ingress_forwards", "Ingress ports of other hosts this host forwards.", nil, nil)
	descTaken     = prometheus.NewDesc("ringipam_snapshot_timestamp_seconds", "When the pool-wide figures were read from the store (the leader only).", nil, nil)
	descLeader    = prometheus.NewDesc("ringipam_leader", "1 while this agent is the elected leader: the one that sweeps orphaned hosts, compacts the history and reports the pool-wide figures (ringipam_pool_*, ringipam_hosts).", nil, nil)
	descOwnAddrs  = prometheus.NewDesc("ringipam_host_pool_addresses", "Addresses this host's owners hold in each pool (from this host's own state).", []string{"pool"}, nil)
)

func newMetrics(view func() metricsView) *metrics {
	m := &metrics{
		registry: prometheus.NewRegistry(),
		reclaims: prometheus.NewCounter(prometheus.CounterOpts{Name: "ringipam_reclaims_total",
			Help: "Hosts this agent reclaimed (orphaned hosts whose ranges it tombstoned)."}),
		released: prometheus.NewCounter(prometheus.CounterOpts{Name: "ringipam_reclaimed_owners_total",
			Help: "Owners of orphaned hosts this agent released."}),
		ports: prometheus.NewCounter(prometheus.CounterOpts{Name: "ringipam_reclaimed_port_endpoints_total",
			Help: "Endpoints with published ports on orphaned hosts this agent released."}),
		storeErrs: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ringipam_store_errors_total",
			Help: "Failed store operations of the agent, by operation."}, []string{"op"}),
		syncErrs: prometheus.NewCounter(prometheus.CounterOpts{Name: "ringipam_ingress_sync_errors_total",
			Help: "Ingress forward syncs that failed to reach the packet filter."}),
		stalePortmap: prometheus.NewCounter(prometheus.CounterOpts{Name: "ringipam_portmap_stale_removed_total",
			Help: "Attachments whose forwards this agent removed from portmap-ingress's table because the store no longer records them on this host."}),
		calls: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ringipam_agent_calls_total",
			Help: "Plugin invocations run on the agent's socket, by plugin (ipam-ring, portmap-ingress), CNI command and result (ok, try-again: code 11, error: any other failure)."}, []string{"plugin", "command", "result"}),
		socketRefused: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ringipam_agent_socket_refused_total",
			Help: "Connections to the agent's socket closed or answered without running anything, by reason: peer (a process not running as root, closed unread), too-large (a request line over the limit), malformed (an undecodable request), version (another agent API version), plugin (an unknown plugin)."}, []string{"reason"}),
		delQueue: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ringipam_del_queue_runs_total",
			Help: "DELs the plugins queued while no agent answered that this agent ran, by result (ok: released and removed from the queue; failed: left for the next drain; dead: can never succeed (undecodable, or refused with CNI code 1, 2, 4, 6 or 7), moved to the queue's failed/ directory)."}, []string{"result"}),
		routes: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "ringipam_routes",
			Help: "With --routes: routes to other hosts' ranges by state (installed: in the kernel as planned; failed: planned but refused by the kernel; refused: ranges of other live hosts the plan cannot route, e.g. a next hop not on a directly connected network)."}, []string{"state"}),
		sweeps: prometheus.NewCounter(prometheus.CounterOpts{Name: "ringipam_sweeps_total",
			Help: "Sweeps of orphaned hosts this agent ran (as the leader)."}),
		compactions: prometheus.NewCounter(prometheus.CounterOpts{Name: "ringipam_history_compactions_total",
			Help: "Compactions of the address history this agent ran (as the leader)."}),
		removed: prometheus.NewCounter(prometheus.CounterOpts{Name: "ringipam_removed_hosts_total",
			Help: "Reclaimed hosts whose records this agent removed after the retention (as the leader)."}),
		nodeReclaims: prometheus.NewCounter(prometheus.CounterOpts{Name: "ringipam_node_reclaims_total",
			Help: "Hosts of deleted Kubernetes Nodes this agent reclaimed (as the leader, --kube-reclaim-nodes)."}),
		vanished: prometheus.NewCounter(prometheus.CounterOpts{Name: "ringipam_vanished_pods_released_total",
			Help: "Owners of this host whose pod vanished without a DEL (gone from the apiserver and the runtime) released (--kube-vanished-pods)."}),
		criErrs: prometheus.NewCounter(prometheus.CounterOpts{Name: "ringipam_cri_errors_total",
			Help: "Passes of the vanished-pods collection that could not ask the runtime for its sandboxes (nothing released)."}),
		viewFn: view,
	}
	for _, reason := range []string{"peer", "too-large", "malformed", "version", "plugin"} {
		m.socketRefused.WithLabelValues(reason) // shown from 0
	}
	for _, result := range []string{"ok", "failed", "dead"} {
		m.delQueue.WithLabelValues(result)
	}
	registerBuildInfo(m.registry)
	m.registry.MustRegister(m.reclaims, m.released, m.ports, m.storeErrs, m.syncErrs, m.stalePortmap, m.calls, m.socketRefused, m.delQueue, m.routes, m.sweeps, m.compactions, m.removed, m,
		m.nodeReclaims, m.vanished, m.criErrs,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// Describe implements prometheus.Collector.
func (m *metrics) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descPoolAddrs, descHostAddrs, descRanges, descHosts, descOrphaned, descLiveness, descForwards, descTaken, descLeader, descOwnAddrs} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (m *metrics) Collect(ch chan<- prometheus.Metric) {
	v := m.viewFn()
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	b2f := func(b bool) float64 {
		if b {
			return 1
		}
		return 0
	}
	gauge(descLeader, b2f(v.leader))
	gauge(descOrphaned, b2f(v.orphaned))
	gauge(descLiveness, b2f(v.liveness))
	gauge(descForwards, float64(v.forwards))
	if v.own != nil {
		for _, u := range v.own.pools {
			gauge(descOwnAddrs, float64(u.Used), u.Pool)
		}
	}
	f := v.figures
	if f == nil {
		return
	}
	for _, p := range f.pools {
		gauge(descPoolAddrs, float64(p.Usage.Used), p.Name, "used")
		gauge(descPoolAddrs, float64(p.Usage.Available), p.Name, "available")
		for _, h := range p.Usage.Hosts {
			gauge(descHostAddrs, float64(h.Used), p.Name, h.Host)
		}
		type key struct {
			host string
			tomb bool
		}
		ranges := map[key]int{}
		for _, r := range p.Ring.Ranges {
			ranges[key{r.Host, r.Tombstone}]++
		}
		for k, n := range ranges {
			t := "false"
			if k.tomb {
				t = "true"
			}
			gauge(descRanges, float64(n), p.Name, k.host, t)
		}
	}
	states := map[string]int{"up": 0, "down": 0, "orphaned": 0}
	for _, h := range f.hosts {
		states[string(h.State)]++
	}
	for st, n := range states {
		gauge(descHosts, float64(n), st)
	}
	gauge(descTaken, float64(f.taken.UnixNano())/1e9)
}

// ownFigures are this host's own figures, read from its own keys.
type ownFigures struct {
	read  time.Time // time.Now when read
	pools []pool.PoolUse
}

// metricsView is a scrape's view: this host's own figures read again when
// older than StatusRefresh (two reads of its own keys), the rest from
// memory.
func (a *Agent) metricsView() metricsView {
	v := metricsView{leader: a.leading.Load(), figures: a.leaderFigures(), liveness: a.held != nil && a.held()}
	a.mu.Lock()
	v.orphaned, v.forwards = !a.orphaned.IsZero(), len(a.forwards)
	a.mu.Unlock()
	v.own = a.ownFigures()
	return v
}

// ownFigures returns this host's own figures, read when the last are older
// than StatusRefresh (one read at a time); the last ones when the store
// cannot be read.
func (a *Agent) ownFigures() *ownFigures {
	fresh := func() *ownFigures {
		if o := a.own.Load(); o != nil && time.Since(o.read) < time.Duration(a.cfg.StatusRefresh) {
			return o
		}
		return nil
	}
	return readShared(&a.snapMu, fresh, func() *ownFigures {
		ctx, cancel := context.WithTimeout(context.Background(), time.Duration(a.cfg.Timeout))
		defer cancel()
		use, err := a.alloc.OwnUsage(ctx)
		if err != nil {
			a.storeError("own-usage", err)
			return a.own.Load()
		}
		o := &ownFigures{read: time.Now(), pools: use}
		a.own.Store(o)
		return o
	})
}
