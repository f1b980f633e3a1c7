package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/containernetworking/cni/pkg/types"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ringipam/ringipam/pkg/agentapi"
	"github.com/ringipam/ringipam/pkg/cni/ipam"
	"github.com/ringipam/ringipam/pkg/cni/portmap"
	"github.com/ringipam/ringipam/pkg/hostlock"
	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/portalloc"
	"github.com/ringipam/ringipam/pkg/routes"
	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/etcd"
	"github.com/ringipam/ringipam/pkg/storeconfig"
)

// ParseLevel maps a log level name to slog's level.
func ParseLevel(s string) (slog.Level, error) {
	switch s {
	case "debug":
		return slog.LevelDebug, nil
	case "", "info":
		return slog.LevelInfo, nil
	case "warn":
		return slog.LevelWarn, nil
	case "error":
		return slog.LevelError, nil
	}
	return 0, fmt.Errorf("log level %q is not debug, info, warn or error", s)
}

// NewLogger is the agent's text logger at cfg's level.
func NewLogger(cfg Config, w interface{ Write([]byte) (int, error) }) *slog.Logger {
	lvl, _ := ParseLevel(cfg.LogLevel)
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: lvl}))
}

// Option changes an Agent for tests.
type Option func(*options)

type options struct {
	now       func() time.Time
	forwarder forwarder
	listener  net.Listener
	store     store.Store
	portmap   portmap.Dataplane
	locks     hostlock.Dir
	router    router
	// Tests of the liveness and the leader (leader.go).
	compactEvery time.Duration
	seenEvery    time.Duration
	apiWrap      func(net.Listener) net.Listener
	kube         *kubeClients
}

// WithClock makes the agent (and its sweeps) judge time by now.
func WithClock(now func() time.Time) Option { return func(o *options) { o.now = now } }

// WithListener serves HTTP on l instead of listening on cfg.Listen.
func WithListener(l net.Listener) Option { return func(o *options) { o.listener = l } }

// forwarder is the packet-filter side of ingress forwarding.
type forwarder interface {
	Sync(ctx context.Context, fs []Forward) error
	Remove(ctx context.Context) error
}

// withStore runs the agent on st (closed by Run) instead of opening
// cfg.Store (unit tests: the memory store).
func withStore(st store.Store) Option { return func(o *options) { o.store = st } }

// withForwarder replaces the nftables forwarder (unit tests).
func withForwarder(f forwarder) Option { return func(o *options) { o.forwarder = f } }

// withPortmap replaces portmap-ingress's data path and the directory of its
// attachments' locks (unit tests).
func withPortmap(dp portmap.Dataplane, locks hostlock.Dir) Option {
	return func(o *options) { o.portmap, o.locks = dp, locks }
}

// Agent is one host's agent. Make it with New, run it with Run.
type Agent struct {
	// hostsMemo keeps recordedHosts between changes of its copies.
	hostsMemo knownHostsMemo
	cfg       Config
	log       *slog.Logger
	now       func() time.Time
	st        store.Store
	cli       *clientv3.Client // nil on the local store
	prefix    string
	alloc     *pool.Allocator
	ports     *portalloc.Allocator
	fwd       forwarder
	pm        portmap.Dataplane // portmap-ingress's table, reconciled; nil: off
	locks     hostlock.Dir      // where portmap-ingress's attachments' locks live
	metrics   *metrics
	httpL     net.Listener
	// rt holds the routes to other hosts' ranges (--routes); nil: off.
	rt         router
	routeTable int
	// caches are the copies the routes and ingress loops decide from
	// (informer.go); set by Run.
	caches *caches

	held func() bool
	// heldSrc is what held reads: the liveness loop's flag, set when Run
	// starts it (read by the HTTP handlers, so atomically).
	heldSrc  atomic.Pointer[func() bool]
	nameLost atomic.Bool // another instance holds this host's liveness key now
	// lastBeat is when the heartbeat loop last started an iteration (unix
	// nanoseconds; /livez); apiDown: the plugins' socket stopped serving.
	lastBeat atomic.Int64
	apiDown  atomic.Bool
	// drainFailed is how many queued DELs the last drain left failed.
	drainFailed atomic.Int64
	// readopt: a lease was taken since the last successful Readopt (the
	// next heartbeat runs it; see pool.Allocator.Readopt).
	readopt  atomic.Bool
	snapshot atomic.Pointer[Snapshot]
	// leading: this agent is the elected leader (leader.go); figures are
	// the pool-wide figures it computes on demand (nil when not leading),
	// one computation at a time (figMu).
	leading         atomic.Bool
	figures         atomic.Pointer[figures]
	figMu           sync.Mutex
	compactInterval time.Duration
	apiWrap         func(net.Listener) net.Listener
	// snapMu serialises the on-demand reads of the status page's
	// snapshot and of this host's own figures (own).
	snapMu   sync.Mutex
	snapRead atomic.Int64 // when current last read the snapshot (time.Now, Unix ns)
	own      atomic.Pointer[ownFigures]

	mu       sync.Mutex
	orphaned time.Time // this host's unacknowledged orphaning
	forwards []Forward
	problems []string
	// routesView is the last pass of the routes loop; nil: routes off or
	// not planned yet.
	routesView *RoutesView
	// kube are the apiserver's clients (kube.go); nil: Kubernetes off.
	// kubeMarked: this host's record carries the Kubernetes node mark.
	kube       *kubeClients
	kubeMarked atomic.Bool
	// routesSummary is what the heartbeat publishes of the routes (nil
	// until the first pass of the routes loop).
	routesSummary *pool.RoutesSummary
}

// New opens the store and prepares the agent; nothing runs until Run.
func New(cfg Config, log *slog.Logger, opts ...Option) (*Agent, error) {
	var o options
	for _, f := range opts {
		f(&o)
	}
	if o.now == nil {
		o.now = time.Now
	}
	a := &Agent{cfg: cfg, log: log, now: o.now, fwd: o.forwarder, pm: o.portmap, locks: o.locks, httpL: o.listener,
		rt: o.router, compactInterval: o.compactEvery, apiWrap: o.apiWrap}
	if a.locks == "" {
		a.locks = hostlock.DefaultDir
	}
	a.held = func() bool {
		f := a.heldSrc.Load()
		return f != nil && (*f)()
	}
	var err error
	switch {
	case o.store != nil:
		a.st = o.store
	case cfg.Store.Type == storeconfig.TypeEtcd:
		// The concrete etcd store: the agent needs its leases and watches.
		es, err := etcd.Open(cfg.Store)
		if err != nil {
			return nil, fmt.Errorf("open store: %w", err)
		}
		a.st, a.cli, a.prefix = es, es.Client(), es.Prefix()
	default:
		if a.st, err = storeconfig.Open(cfg.Store); err != nil {
			return nil, fmt.Errorf("open store: %w", err)
		}
	}
	seenEvery := o.seenEvery
	if seenEvery <= 0 {
		seenEvery = pool.SeenEvery(time.Duration(cfg.OrphanAfter))
	}
	a.alloc, err = pool.New(a.st, cfg.Host, pool.WithTimeout(time.Duration(cfg.Timeout)), pool.WithClock(a.now), pool.WithSeenEvery(seenEvery))
	if err != nil {
		a.st.Close()
		return nil, err
	}
	if a.ports, err = portalloc.New(a.st, cfg.Host); err != nil {
		a.st.Close()
		return nil, err
	}
	if cfg.Ingress && a.fwd == nil {
		f, err := newNFTForwarder(cfg.IngressTable)
		if err != nil {
			a.st.Close()
			return nil, fmt.Errorf("ingress forwarding (turn it off with --ingress=false): %w", err)
		}
		a.fwd = f
	}
	if cfg.Ingress && a.pm == nil && cfg.PortmapTable != "off" {
		dp, err := portmap.NewDataplane(cfg.PortmapDataplane, cfg.PortmapTable)
		switch {
		case errors.Is(err, portmap.ErrNoDataplane):
			// No packet filter tool: portmap-ingress cannot have
			// installed a forward here either.
		case err != nil:
			a.st.Close()
			return nil, fmt.Errorf("portmap-ingress's table (leave it alone with --portmap-table=off): %w", err)
		default:
			a.pm = dp
		}
	}
	if cfg.Routes {
		tc, err := cfg.routesTable().Complete()
		if err != nil {
			a.st.Close()
			return nil, fmt.Errorf("%w: %w", ErrConfig, err)
		}
		a.routeTable = tc.Table
		if a.rt == nil {
			t, err := routes.OpenTable(tc)
			if err != nil {
				a.st.Close()
				return nil, fmt.Errorf("routes (turn them off with --routes=false): %w", err)
			}
			a.rt = t
		}
	} else {
		a.rt = nil
	}
	a.kube = o.kube
	if cfg.kube() && a.kube == nil {
		if a.kube, err = newKubeClients(cfg.Kubeconfig); err != nil {
			a.st.Close()
			return nil, err
		}
	}
	a.metrics = newMetrics(a.metricsView)
	return a, nil
}

// Run runs the agent until ctx ends, then revokes its liveness record,
// removes its ingress forwards and closes the store.
func Run(ctx context.Context, cfg Config, log *slog.Logger, opts ...Option) error {
	a, err := New(cfg, log, opts...)
	if err != nil {
		return err
	}
	return a.Run(ctx)
}

// Run runs the loops and the HTTP server until ctx ends.
func (a *Agent) Run(ctx context.Context) error {
	defer a.st.Close()
	if a.rt != nil {
		// After the loops stopped, also when Run returns early.
		defer a.removeRoutes()
	}
	l := a.httpL
	if l == nil && a.cfg.Listen != "off" && a.cfg.Listen != "" {
		var err error
		if l, err = net.Listen("tcp", a.cfg.Listen); err != nil {
			return fmt.Errorf("listen %s: %w", a.cfg.Listen, err)
		}
	}
	var apiL net.Listener
	if sock := a.cfg.Store.Socket(); sock != "" && a.cli != nil {
		var err error
		if apiL, err = agentapi.Listen(sock); err != nil {
			if l != nil {
				l.Close()
			}
			return fmt.Errorf("%w (another ringipamd of this host? --agent-socket names another socket)", err)
		}
		if a.apiWrap != nil {
			apiL = a.apiWrap(apiL)
		}
	}
	a.log.Info("ringipamd starting", "host", a.cfg.Host, "addr", a.cfg.Addr, "store", a.cfg.Store.Describe(),
		"listen", a.cfg.Listen, "orphanAfter", time.Duration(a.cfg.OrphanAfter), "sweep", a.cfg.Sweep, "ingress", a.cfg.Ingress, "routes", a.cfg.Routes)

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	a.lastBeat.Store(a.now().UnixNano())
	var wg sync.WaitGroup
	loop := func(fn func(context.Context)) {
		wg.Add(1)
		go func() { defer wg.Done(); fn(ctx) }()
	}
	// Liveness first: a host name held by another running instance stops
	// this agent before it does anything under that name (seed 002: host
	// names are unique). The wait is bounded: with the store out of reach
	// the agent starts anyway, and still stops if the name turns out taken
	// before it held it once.
	fatal := make(chan error, 1)
	ready := make(chan struct{})
	var readyOnce sync.Once
	report := func(nt *NameTakenError, everHeld bool) {
		switch {
		case nt == nil:
			a.readopt.Store(true)
			readyOnce.Do(func() { close(ready) })
			if a.nameLost.Swap(false) {
				a.log.Info("liveness: this host's name is held by this agent again", "host", a.cfg.Host)
			}
		case !everHeld:
			select {
			case fatal <- nt:
			default:
			}
			readyOnce.Do(func() { close(ready) })
		case !a.nameLost.Swap(true):
			a.log.Error("THIS HOST'S NAME IS HELD BY ANOTHER RINGIPAMD: its plugins' invocations through this agent fail (STATUS too) until the name is this agent's again",
				"host", a.cfg.Host, "err", nt)
		}
	}
	self := newLivenessValue(a.cfg.Addr)
	if a.cli != nil {
		k := newLeaseKeeper(a.cli, a.prefix, a.cfg.Host, self, time.Duration(a.cfg.LeaseTTL), a.log, report)
		held := k.held.Load
		a.heldSrc.Store(&held)
		loop(k.run)
	} else {
		p := &plainLiveness{st: a.st, host: a.cfg.Host, key: pool.LivenessKey(a.cfg.Host), self: self, lost: report}
		held := p.held.Load
		a.heldSrc.Store(&held)
		loop(func(ctx context.Context) { p.run(ctx, time.Duration(a.cfg.Timeout), a.log) })
	}
	// Long enough for a stale key of this host's previous instance to
	// expire (leaseKeeper.waitReleased), so that a duplicate is refused
	// before it serves anything.
	wait := time.NewTimer(time.Duration(a.cfg.Timeout) + ReleaseWait(time.Duration(a.cfg.LeaseTTL)))
	select {
	case <-ready:
	case <-wait.C:
		a.log.Warn("liveness: the host's liveness key is not held yet; starting anyway", "host", a.cfg.Host)
	case <-ctx.Done():
	}
	wait.Stop()
	select {
	case err := <-fatal:
		cancel()
		wg.Wait()
		if apiL != nil {
			apiL.Close()
		}
		if l != nil {
			l.Close()
		}
		return err
	default:
	}
	if a.rt != nil || a.cfg.Ingress || a.pm != nil {
		// The copies the routes and ingress loops decide from: on etcd
		// each follows its watch (informer.go).
		a.caches = a.newCaches()
		a.runCaches(loop)
	}
	if a.rt != nil {
		loop(a.routesLoop)
	}
	loop(func(ctx context.Context) {
		a.every(ctx, time.Duration(a.cfg.Heartbeat), func(ctx context.Context) {
			a.lastBeat.Store(a.now().UnixNano())
			a.heartbeat(ctx)
		})
	})
	switch {
	case a.cli == nil:
		// The local store: one host, which leads alone.
		a.leading.Store(true)
		loop(func(ctx context.Context) { a.lead(ctx); a.leading.Store(false) })
	case a.cfg.Sweep:
		loop(a.electionLoop)
	}
	if a.cfg.Ingress || a.pm != nil {
		loop(a.ingressLoop)
	}
	if a.cfg.KubeVanishedPods {
		loop(a.collectVanishedPods)
	}
	var srvErr error
	if l != nil {
		srv := &http.Server{Handler: a.Handler(), ReadHeaderTimeout: 10 * time.Second}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := srv.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
				srvErr = err
			}
		}()
		go func() {
			<-ctx.Done()
			sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_ = srv.Shutdown(sctx)
		}()
		a.log.Info("serving the status page and metrics", "addr", l.Addr().String())
	}
	if apiL != nil {
		handlers := a.handlers()
		// The DELs queued while no agent answered: before serving (their
		// addresses are free for the ADDs to come), then on every sync
		// interval (what failed now, or what a plugin queued meanwhile).
		a.drain(ctx, handlers, time.Duration(a.cfg.Timeout)*drainAtStartTimeouts)
		loop(func(ctx context.Context) {
			t := time.NewTicker(time.Duration(a.cfg.SyncInterval))
			defer t.Stop()
			for {
				select {
				case <-ctx.Done():
					return
				case <-t.C:
					a.drain(ctx, handlers, 0)
				}
			}
		})
		srv := &agentapi.Server{Handlers: handlers, Log: func(msg string, args ...any) { a.log.Warn(msg, args...) }}
		srv.OnCall = func(plugin, command string, ans *agentapi.Answer) {
			result := "ok"
			switch {
			case ans.CNIError != nil && ans.CNIError.Code == types.ErrTryAgainLater:
				result = "try-again"
			case ans.Failed():
				result = "error"
			}
			a.metrics.calls.WithLabelValues(plugin, command, result).Inc()
		}
		// Root only (PeerUID 0); the server logs each refusal.
		srv.OnRefused = func(reason string, _ error) { a.metrics.socketRefused.WithLabelValues(reason).Inc() }
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := srv.Serve(ctx, apiL); err != nil {
				a.apiDown.Store(true)
				a.log.Error("agent socket", "err", err)
			}
		}()
		a.log.Info("serving ipam-ring's and portmap-ingress's invocations", "socket", apiL.Addr().String(), "delQueue", a.cfg.Store.DelQueueDir())
	}
	var runErr error
	select {
	case <-ctx.Done():
	case runErr = <-fatal:
		cancel()
	}
	wg.Wait()
	if a.cfg.LeaveOnStop && runErr == nil && !a.nameLost.Load() {
		runErr = a.leave()
	}
	if a.cfg.Ingress && a.fwd != nil {
		// Forwards nobody keeps up to date are worse than none.
		rctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		if err := a.fwd.Remove(rctx); err != nil {
			a.log.Warn("removing the ingress forwards", "err", err)
		}
		cancel()
	}
	a.log.Info("ringipamd stopped")
	return errors.Join(runErr, srvErr)
}

// leave makes this host leave the ring after its loops stopped (the
// liveness lease is revoked by then; Force covers a revocation that
// failed: the agent is the host itself).
func (a *Agent) leave() error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Duration(a.cfg.Timeout))
	defer cancel()
	rep, err := a.alloc.Reclaim(ctx, a.cfg.Host, pool.ReclaimOptions{Leave: true, Force: true})
	if err != nil {
		return fmt.Errorf("leaving the ring: %w", err)
	}
	guard, err := a.alloc.ReclaimGuard(ctx, a.cfg.Host, true)
	if err != nil {
		return fmt.Errorf("leaving the ring: %w", err)
	}
	rel, err := a.ports.ReleaseHost(ctx, a.cfg.Host, guard)
	if err != nil {
		return fmt.Errorf("leaving the ring: releasing this host's published ports: %w", err)
	}
	n := len(rel)
	a.log.Info("left the ring", "host", a.cfg.Host, "pools", rep.TombstonedPools, "ownersReleased", rep.Released,
		"rangesHandedOn", rep.Handed, "endpointsWithPortsReleased", n)
	return nil
}

// every runs fn now and then every d (with up to 10% jitter) until ctx ends.
func (a *Agent) every(ctx context.Context, d time.Duration, fn func(context.Context)) {
	for {
		fn(ctx)
		jitter := time.Duration(float64(d) * 0.1 * float64(a.now().UnixNano()%1000) / 1000)
		if sleep(ctx, d+jitter) != nil {
			return
		}
	}
}

// op bounds one store operation by the configured timeout.
func (a *Agent) op(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, time.Duration(a.cfg.Timeout))
}

func (a *Agent) storeError(op string, err error) {
	if err == nil || errors.Is(err, context.Canceled) {
		return
	}
	a.metrics.storeErrs.WithLabelValues(op).Inc()
	a.log.Warn("store operation failed", "op", op, "err", err)
}

// heartbeat keeps the host's records and learns whether it was orphaned
// while away: then it says so loudly, until acknowledged. Liveness is the
// lease's (l/<host>): an idle heartbeat reads the host's two records (one
// round trip) and writes the status record's last-seen time once per
// SeenEvery; the watched host record only when its address changes.
func (a *Agent) heartbeat(ctx context.Context) {
	ctx, cancel := a.op(ctx)
	defer cancel()
	info, err := a.alloc.Heartbeat(ctx, a.cfg.Addr, a.routesReport())
	if err != nil {
		a.storeError("heartbeat", err)
		return
	}
	if a.cfg.KubeReclaimNodes && !a.kubeMarked.Load() {
		if err := a.alloc.MarkKubeNode(ctx); err != nil {
			a.storeError("kube-node-mark", err)
		} else {
			a.kubeMarked.Store(true)
		}
	}
	if a.readopt.Swap(false) {
		// Back under a lease: owners a reclaim cut short by this host's
		// return left in its tombstoned ranges are its own again.
		pools, err := a.alloc.Readopt(ctx)
		if err != nil {
			a.readopt.Store(true) // the next heartbeat tries again
			a.storeError("readopt", err)
		} else if len(pools) > 0 {
			a.log.Warn("this host came back while its reclaim was under way: its owners left in tombstoned ranges are its own again", "host", a.cfg.Host, "pools", pools)
		}
	}
	a.mu.Lock()
	was := a.orphaned
	a.orphaned = info.OrphanedAt
	a.mu.Unlock()
	if !info.OrphanedAt.IsZero() {
		a.log.Error("THIS HOST WAS ORPHANED: it was down longer than orphanAfter and its space was reclaimed; "+
			"containers started before then lost their addresses (CHECK fails for them) and must be recreated; "+
			"new containers get fresh addresses. Acknowledge with `ringctl host ack`.",
			"host", a.cfg.Host, "orphanedAt", info.OrphanedAt.UTC(), "ownersReleased", info.Reclaimed)
	} else if !was.IsZero() {
		a.log.Info("orphaned mark acknowledged", "host", a.cfg.Host)
	}
}

// sweep is one sweep of the leader (see leader.go): sw reclaims orphaned
// hosts, releases their published ports under the reclaim guard, skips
// the hosts with nothing left and removes their records after the
// retention.
func (a *Agent) sweep(ctx context.Context, sw *pool.Sweeper[portalloc.Released]) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Duration(a.cfg.Timeout))
	defer cancel()
	rep, err := sw.Sweep(ctx)
	a.storeError("sweep", err)
	a.metrics.sweeps.Inc()
	for _, r := range rep.Reclaims {
		a.metrics.reclaims.Inc()
		a.metrics.released.Add(float64(r.Released))
		a.log.Warn("reclaimed an orphaned host", "host", r.Host, "pools", r.Pools, "ownersReleased", r.Released, "alreadyReclaimed", r.AlreadyWas)
	}
	for host, n := range rep.Ports {
		a.metrics.ports.Add(float64(n))
		a.log.Warn("released the published ports of an orphaned host", "host", host, "endpoints", n)
	}
	for _, host := range rep.Back {
		a.log.Info("an orphaned host came back while its published ports were released: it keeps the rest", "host", host)
	}
	for _, host := range rep.Removed {
		a.metrics.removed.Inc()
		a.log.Info("removed the records of a host reclaimed longer ago than the retention", "host", host,
			"retention", Retention(time.Duration(a.cfg.OrphanAfter)))
	}
}

// compactHistory keeps the newest pool.HistoryKeep events of every address
// (the history is written without reads, one key per event): the
// leader's. Two compacting at once (a leader change) delete the same keys,
// which is harmless.
func (a *Agent) compactHistory(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Duration(a.cfg.Timeout))
	defer cancel()
	n, err := a.alloc.CompactHistory(ctx, pool.HistoryKeep, 0)
	a.storeError("compact-history", err)
	a.metrics.compactions.Inc()
	if n > 0 {
		a.log.Info("compacted the address history", "eventsDeleted", n, "keptPerAddress", pool.HistoryKeep)
	}
}

// resyncEvery is how often, on a local store, the kernel and nftables
// tables are rewritten from the copies although nothing changed, to
// repair what someone changed by hand (etcd: Resync).
const resyncEvery = 30 * time.Second

// ingressLoop keeps the forwards equal to the copies of the published
// ports, host records and liveness keys (informer.go): when the agent
// starts, at once when a copy changes (on etcd, through its watch), and on
// every resync (Resync, jittered: the table rewritten from the copies, no
// store read). The agent's table forwards the ingress ports held on other
// hosts (rewritten only when the forwards changed, on a resync, and every
// SyncInterval after a failure), and portmap-ingress's table loses the
// forwards of endpoints this host no longer holds (reconcilePortmap: when
// the copy of this host's endpoint index loses one, and on every resync).
func (a *Agent) ingressLoop(ctx context.Context) {
	c := a.caches
	var portsK, hostsK, liveK, ownK <-chan struct{} // nil: never ready
	var wait []interface{ Synced() <-chan struct{} }
	if a.cfg.Ingress {
		portsK, hostsK, liveK = c.ports.Subscribe(), c.hosts.Subscribe(), c.live.Subscribe()
		wait = append(wait, c.ports, c.hosts, c.live)
	}
	if a.pm != nil {
		ownK = c.own.Subscribe()
		wait = append(wait, c.own)
	}
	if !synced(ctx, wait...) {
		return
	}
	var ing ingressState
	var pm portmapState
	pass := func(ports, own, force bool) {
		if own && a.pm != nil {
			a.reconcilePortmap(ctx, &pm, force)
		}
		if ports && a.cfg.Ingress {
			a.syncIngress(ctx, &ing, force)
		}
	}
	pass(true, true, true)
	tick := time.NewTicker(time.Duration(a.cfg.SyncInterval))
	defer tick.Stop()
	resync := time.NewTimer(jittered(a.resyncPeriod()))
	defer resync.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-portsK:
			pass(true, false, false)
		case <-hostsK:
			pass(true, false, false)
		case <-liveK:
			pass(true, false, false)
		case <-ownK:
			pass(false, true, false)
		case <-tick.C:
			if ing.failed {
				pass(true, false, true)
			}
		case <-resync.C:
			resync.Reset(jittered(a.resyncPeriod()))
			pass(true, true, true)
		}
	}
}

// ingressState is what the ingress loop remembers of its last sync.
type ingressState struct {
	last   []Forward
	synced time.Time
	failed bool // the last Sync failed: tried again every SyncInterval
}

// syncIngress rewrites the agent's table when the forwards changed, the
// last rewrite failed, or force (a resync).
func (a *Agent) syncIngress(ctx context.Context, s *ingressState, force bool) {
	fs := a.desired()
	if !force && !s.failed && slices.Equal(fs, s.last) && !s.synced.IsZero() {
		return
	}
	sctx, cancel := a.op(ctx)
	err := a.fwd.Sync(sctx, fs)
	cancel()
	if err != nil {
		s.failed = true
		a.metrics.syncErrs.Inc()
		a.log.Warn("installing ingress forwards failed", "err", err)
		return
	}
	if !slices.Equal(fs, s.last) {
		a.log.Info("ingress forwards", "count", len(fs))
	}
	s.last, s.synced, s.failed = fs, a.now(), false
}

// desired computes the forwards from the copies of the published ports,
// host records and liveness keys: no store read.
func (a *Agent) desired() []Forward {
	snap := a.caches.ports.Snapshot()
	var ports []portalloc.Published
	var holders []string
	for _, e := range snap.Entries {
		if e.Err != nil {
			a.storeError("list-ports", e.Err)
			continue
		}
		if h := e.Value; h != nil && h.Ingress != "" {
			ports = append(ports, portalloc.Published{Address: h.Address, State: portalloc.AddrState{Ingress: h.Ingress, IngressHost: h.IngressHost}})
			holders = append(holders, h.IngressHost)
		}
	}
	// Only the holders' hosts: what a pass costs follows the ingress
	// ports, not the number of hosts.
	fs, problems := DesiredForwards(a.cfg.Host, ports, a.hostsNamed(holders))
	slices.Sort(problems)
	a.mu.Lock()
	a.forwards, a.problems = fs, problems
	a.mu.Unlock()
	return fs
}

// refreshSnapshot reads the cluster-wide view the status page and
// /status.json show: every host, and every pool with the use of each of
// its ranges (every owner of the pool is listed). Only on demand (current).
func (a *Agent) refreshSnapshot(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Duration(a.cfg.Timeout))
	defer cancel()
	hosts, err := a.alloc.Hosts(ctx, time.Duration(a.cfg.OrphanAfter))
	if err != nil {
		a.storeError("hosts", err)
		return
	}
	pools, err := readPools(ctx, a.alloc, true)
	if err != nil {
		a.storeError("pools", err)
		return
	}
	a.mu.Lock()
	s := &Snapshot{Taken: a.now(), Host: a.cfg.Host, Addr: a.cfg.Addr, Orphaned: a.orphaned, Hosts: hosts, Pools: pools,
		Forwards: slices.Clone(a.forwards), Problems: slices.Clone(a.problems), Routes: a.routesView}
	a.mu.Unlock()
	s.Liveness = a.held != nil && a.held()
	s.Leader = a.leading.Load()
	a.snapshot.Store(s)
}

// Handler serves / (the status page), /status.json, /metrics, /livez,
// /readyz and /healthz (the same as /readyz; see health.go).
func (a *Agent) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(a.metrics.registry, promhttp.HandlerOpts{Registry: a.metrics.registry}))
	mux.HandleFunc("GET /status.json", func(w http.ResponseWriter, r *http.Request) {
		s := a.current(r.Context())
		w.Header().Set("Content-Type", "application/json")
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		_ = enc.Encode(s)
	})
	answer := func(check func(healthInput) error) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			if err := check(a.healthInput()); err != nil {
				http.Error(w, err.Error(), http.StatusServiceUnavailable)
				return
			}
			fmt.Fprintln(w, "ok")
		}
	}
	mux.HandleFunc("GET /livez", answer(liveness))
	mux.HandleFunc("GET /readyz", answer(readiness))
	mux.HandleFunc("GET /healthz", answer(readiness))
	mux.HandleFunc("GET /{$}", func(w http.ResponseWriter, r *http.Request) {
		b, err := renderPage(*a.current(r.Context()), a.now())
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		_, _ = w.Write(b)
	})
	return mux
}

// healthInput is what /livez and /readyz answer from, now.
func (a *Agent) healthInput() healthInput {
	return healthInput{
		now:        a.now(),
		lastBeat:   time.Unix(0, a.lastBeat.Load()),
		stallAfter: stallAfter(time.Duration(a.cfg.Heartbeat), time.Duration(a.cfg.Timeout)),
		apiDown:    a.apiDown.Load(),
		held:       a.held != nil && a.held(),
		nameLost:   a.nameLost.Load(),
	}
}

// current is the status page's snapshot, read on demand: the last one
// while younger than StatusRefresh, else read anew (one read at a time:
// requests that arrive meanwhile wait for it and share it), so a client
// that asks often costs the store one read per StatusRefresh. A failed
// read serves the last snapshot (its Taken says how old).
func (a *Agent) current(ctx context.Context) *Snapshot {
	fresh := func() *Snapshot {
		s := a.snapshot.Load()
		if s != nil && time.Since(time.Unix(0, a.snapRead.Load())) < time.Duration(a.cfg.StatusRefresh) {
			return s
		}
		return nil
	}
	return readShared(&a.snapMu, fresh, func() *Snapshot {
		a.refreshSnapshot(ctx)
		a.snapRead.Store(time.Now().UnixNano())
		if s := a.snapshot.Load(); s != nil {
			return s
		}
		return &Snapshot{Host: a.cfg.Host, Taken: a.now(), Problems: []string{"the store could not be read yet"}}
	})
}

// readShared is the on-demand read of the status page, of this host's own
// figures and of the leader's: fresh's value while it has one, else read's,
// one read at a time under mu (callers that arrive meanwhile wait, then
// find the new value fresh and share it).
func readShared[T any](mu *sync.Mutex, fresh, read func() *T) *T {
	if v := fresh(); v != nil {
		return v
	}
	mu.Lock()
	defer mu.Unlock()
	if v := fresh(); v != nil {
		return v
	}
	return read()
}

// handlers are the agent's handlers of both plugins, on its store, behind
// the name guard.
func (a *Agent) handlers() agentapi.Handlers {
	guard := func(h agentapi.Handler) agentapi.Handler {
		return nameGuard{inner: h, lost: a.nameLost.Load, host: a.cfg.Host}
	}
	return agentapi.Handlers{
		agentapi.PluginIPAM:    guard(ipam.AgentHandler{Store: a.st, Config: a.cfg.Store}),
		agentapi.PluginPortmap: guard(portmap.AgentHandler{Store: a.st, Config: a.cfg.Store, Locks: a.locks}),
	}
}

// drainAtStartTimeouts bounds the drain before the agent serves, in agent
// timeouts: with the store out of reach the agent serves anyway, and the
// periodic drains run what is left.
const drainAtStartTimeouts = 3

// drain runs the DELs queued in the store's DEL queue through hs (within
// limit, when not 0), and logs and counts what it did.
func (a *Agent) drain(ctx context.Context, hs agentapi.Handlers, limit time.Duration) {
	if limit > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, limit)
		defer cancel()
	}
	q := agentapi.DelQueue{Dir: a.cfg.Store.DelQueueDir()}
	rep, err := q.Drain(ctx, hs)
	if err != nil && ctx.Err() == nil {
		a.log.Warn("draining the DEL queue", "dir", q.Dir, "err", err)
	}
	a.metrics.delQueue.WithLabelValues("ok").Add(float64(rep.Done))
	a.metrics.delQueue.WithLabelValues("failed").Add(float64(rep.Failed))
	a.metrics.delQueue.WithLabelValues("dead").Add(float64(rep.Dead))
	if rep.Dead > 0 {
		a.log.Error("queued DELs that can never succeed were moved out of the queue; what they would have freed is left to the network's CNI GC or ringctl release",
			"dir", q.Dir, "dead", rep.Dead, "errs", errors.Join(rep.DeadErrs...))
	}
	if rep.Done > 0 || rep.TempRemoved > 0 {
		a.log.Info("ran the DELs queued while no agent answered", "dir", q.Dir, "done", rep.Done, "tempFilesRemoved", rep.TempRemoved)
	}
	// Failures are said when their number changes, not on every drain.
	if last := a.drainFailed.Swap(int64(rep.Failed)); rep.Failed > 0 && int64(rep.Failed) != last {
		a.log.Warn("queued DELs failed; they stay queued and are tried again every sync interval", "dir", q.Dir,
			"failed", rep.Failed, "errs", errors.Join(rep.Errs...))
	}
}
