package harness

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/skel"

	"github.com/ringipam/ringipam/cmd/ringctl/cli"
	"github.com/ringipam/ringipam/cmd/ringipamd/agent"
	"github.com/ringipam/ringipam/internal/testenv"
	"github.com/ringipam/ringipam/pkg/agentapi"
	"github.com/ringipam/ringipam/pkg/cni/ipam"
	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/portalloc"
	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/storeconfig"
)

// Options shape a run. Zero fields take the defaults of Defaults.
type Options struct {
	N int
	// PerHost is the allocations per host after fill (30; fewer when
	// N x PerHost would pass 80% of the pool's addresses).
	PerHost int
	// WidePool makes the pool Subnet and WideSubnet (98 304 addresses,
	// 1 536 blocks of 64) instead of Subnet alone (65 536, 1 024 blocks):
	// a pool sized as an operator sizes one for the cluster, with more
	// blocks than hosts (Calico's default /16 of /26 blocks, 1 024 of
	// them, is meant for fewer nodes). SCALE_POOL=wide|narrow; unset, the
	// harness's test makes it wide above 512 hosts, where Subnet alone
	// would be half claimed by the hosts' first blocks.
	WidePool bool
	// Members is the number of etcd members (3 for N >= 1000, else 1).
	Members int
	// Idle is the idle phase's length; Churn the churn phase's, at
	// ChurnRate pods created (and as many deleted) per second.
	Idle      time.Duration
	Churn     time.Duration
	ChurnRate float64
	// OrphanAfter and SweepInterval are the agents' (short, so that the
	// orphan phase ends; the sweep interval defaults to the shipped one).
	OrphanAfter   time.Duration
	SweepInterval time.Duration
	// StartConcurrency, when above 0, makes the start phase's first ADDs
	// at most that many at a time instead of all at once (SCALE_START).
	StartConcurrency int
	// Full, when above 0 and below N, runs the whole agent (--routes,
	// --ingress) on hosts 0 to Full-1 and on the hosts that join later,
	// and a hollow agent on the others, as Kubernetes' kubemark runs
	// hollow nodes (SCALE_FULL): the same agent code with --routes and
	// --ingress off, so with its lease, heartbeat, plugins' API, DEL
	// queue, claims and sweeps, but without the copies of the rings, host
	// records, liveness keys and ports that every full agent keeps. One
	// process then does not carry N full copies of the cluster, which
	// costs it O(N²) watch events when N hosts start at once; the phases
	// that wait for routes or forwards wait for the full agents only. What
	// etcd sends a full agent is the full agents' share of the watch
	// figures; an idle agent watches nothing either way. The fill
	// publishes its host-mode port on the whole hosts only:
	// portmap-ingress's tables of every simulated host share the
	// process's one network namespace, where each nft invocation reads
	// every table (a kernel each on real hosts), so a thousand publishes
	// cost the harness O(N²) (at 1 000 hosts, 60 publishes in 8 minutes;
	// `nft list tables` took 13 s with 127 tables on the loaded machine).
	Full int
	// Chaos adds the chaos phase (etcd leader killed, one agent
	// partitioned, during a churn; needs Members 3).
	Chaos bool
	// Agent changes every agent's configuration last (tests: shorter
	// heartbeat).
	Agent func(*agent.Config)
	// Log receives the progress lines; nil: discarded.
	Log io.Writer
}

// Defaults fills o's zero fields.
func (o Options) Defaults() Options {
	if o.PerHost == 0 {
		o.PerHost = 30
		addrs := 65536
		if o.WidePool {
			addrs += 32768
		}
		if max := addrs * 8 / 10 / max(o.N+2, 1); o.PerHost > max {
			o.PerHost = max
		}
	}
	if o.Members == 0 {
		o.Members = 1
		if o.N >= 1000 {
			o.Members = 3
		}
	}
	if o.Idle == 0 {
		o.Idle = 60 * time.Second
	}
	if o.Churn == 0 {
		o.Churn = 20 * time.Second
	}
	if o.ChurnRate == 0 {
		o.ChurnRate = 10
	}
	if o.OrphanAfter == 0 {
		o.OrphanAfter = 20 * time.Second
	}
	if o.SweepInterval == 0 {
		o.SweepInterval = agent.DefaultSweepInterval
	}
	return o
}

// Configure applies the options to one agent's configuration.
func (o Options) Configure(cfg *agent.Config) {
	cfg.OrphanAfter = storeconfig.Duration(o.OrphanAfter)
	cfg.SweepInterval = storeconfig.Duration(o.SweepInterval)
	if o.Agent != nil {
		o.Agent(cfg)
	}
}

// Cluster is one etcd (one or three members) and the simulated hosts on
// it.
type Cluster struct {
	TB        testing.TB
	Endpoints []string
	Members   *testenv.EtcdCluster // nil with one member
	Single    *testenv.Etcd        // the one member, or nil
	Prefix    string
	Hosts     []*Host
	opt       Options
	dir       string
	closers   []func()
	logs      logSink
	seq       int64 // this cluster's number in the process
	// Pool and Ports read the store for the checks (their own client:
	// its traffic is kept out of the phases' figures).
	Pool  *pool.Allocator
	Ports *portalloc.Allocator
	st    store.Store
}

// NewCluster starts etcd for tb and raises the file limit. Run it in a
// network namespace of its own (Main).
func NewCluster(tb testing.TB, opt Options) *Cluster {
	tb.Helper()
	opt = opt.Defaults()
	raiseNoFile()
	c := &Cluster{TB: tb, opt: opt, Prefix: "/scale/", seq: clusters.Add(1)}
	dir, err := os.MkdirTemp("", "scale")
	if err != nil {
		tb.Fatal(err)
	}
	c.dir = dir
	tb.Cleanup(func() { os.RemoveAll(dir) })
	if opt.Members == 1 {
		c.Single = testenv.StartEtcd(tb)
		c.Endpoints = c.Single.Endpoints()
	} else {
		c.Members = testenv.StartEtcdCluster(tb, testenv.ClusterOptions{Size: opt.Members})
		c.Endpoints = c.Members.Endpoints()
	}
	// Registered after etcd's start, so run before etcd stops (cleanups
	// run last first): the agents stop cleanly, all at once, while etcd
	// still answers (one after the other against a stopped etcd, each
	// waits out its revocation's deadline).
	tb.Cleanup(func() {
		var wg sync.WaitGroup
		for _, h := range c.Hosts {
			wg.Go(func() { _ = h.stop(30 * time.Second) })
		}
		wg.Wait()
		for _, f := range c.closers {
			f()
		}
	})
	c.st, err = storeconfig.Open(storeconfig.Config{Type: storeconfig.TypeEtcd, Endpoints: c.Endpoints, Prefix: c.Prefix})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { c.st.Close() })
	if c.Pool, err = pool.New(c.st, "scale-harness", pool.WithTimeout(2*time.Minute)); err != nil {
		tb.Fatal(err)
	}
	if c.Ports, err = portalloc.New(c.st, "scale-harness"); err != nil {
		tb.Fatal(err)
	}
	return c
}

// clusters numbers the clusters of the process.
var clusters atomic.Int64

// raiseNoFile raises RLIMIT_NOFILE to its hard limit: each agent holds
// an etcd connection, a listening socket and its calls' connections.
func raiseNoFile() {
	var r syscall.Rlimit
	if syscall.Getrlimit(syscall.RLIMIT_NOFILE, &r) == nil && r.Cur < r.Max {
		r.Cur = r.Max
		_ = syscall.Setrlimit(syscall.RLIMIT_NOFILE, &r)
	}
}

func (c *Cluster) logOut(string) io.Writer { return &c.logs }

// Logf prints a progress line.
func (c *Cluster) Logf(format string, args ...any) {
	if c.opt.Log != nil {
		fmt.Fprintf(c.opt.Log, time.Now().UTC().Format("15:04:05 ")+format+"\n", args...)
	}
}

// Take snapshots the members' metrics. A member busy past the scrape's
// deadline (a thousand agents starting on two cores) is asked again, for
// up to five minutes: the counters lose nothing meanwhile.
func (c *Cluster) Take() Snapshot {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	for {
		s, err := Take(ctx, c.Endpoints)
		if err == nil {
			return s
		}
		if ctx.Err() != nil {
			c.TB.Fatalf("scale: %v", err)
		}
		c.Logf("scale: %v; asking again", err)
		select {
		case <-ctx.Done():
		case <-time.After(5 * time.Second):
		}
	}
}

// AddHosts prepares hosts from index len(c.Hosts) on (proxied: their etcd
// traffic goes through counting relays) and starts their agents together.
func (c *Cluster) AddHosts(n int, proxied func(i int) bool, leaveOnStop func(i int) bool) ([]*Host, error) {
	var hs []*Host
	for k := 0; k < n; k++ {
		i := len(c.Hosts)
		h, err := c.newHost(i, proxied != nil && proxied(i))
		if err != nil {
			return nil, err
		}
		h.cfg.LeaveOnStop = leaveOnStop != nil && leaveOnStop(i)
		c.Hosts = append(c.Hosts, h)
		hs = append(hs, h)
	}
	for _, h := range hs {
		if err := c.start(h, h.cfg.LeaveOnStop); err != nil {
			return nil, err
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	for _, h := range hs {
		if err := h.waitSocket(ctx); err != nil {
			return nil, err
		}
	}
	return hs, nil
}

// Running are the hosts whose agent runs.
func (c *Cluster) Running() []*Host {
	var out []*Host
	for _, h := range c.Hosts {
		if h.cancel != nil {
			out = append(out, h)
		}
	}
	return out
}

// Stop stops host h's agent (LeaveOnStop as it was started with).
func (c *Cluster) Stop(h *Host) error { return h.stop(5 * time.Minute) }

// WaitAll waits (within d) until cond holds for every running host with
// a full agent but skip; it returns how many did not get there.
func (c *Cluster) WaitAll(d time.Duration, skip *Host, cond func(h *Host) bool) int {
	deadline := time.Now().Add(d)
	for {
		missing := 0
		for _, h := range c.Running() {
			if h != skip && !h.Hollow && !cond(h) {
				missing++
			}
		}
		if missing == 0 || time.Now().After(deadline) {
			return missing
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// RoutesTo reports whether h's agent installed a route to host's ranges.
func (h *Host) RoutesTo(host string) bool { return h.rt.routesTo(host) }

// Forwards reports whether h's agent forwards ingress port.
func (h *Host) Forwards(port uint16) bool { return h.fwd.forwards(port) }

// Findings are what the end checks found.
type Findings struct {
	Duplicates []string `json:"duplicates,omitempty"`
	Leaked     []string `json:"leaked,omitempty"`
	Lost       []string `json:"lost,omitempty"`
	Violations []string `json:"violations,omitempty"`
	// Undeleted are containers whose ADD failed and whose DEL (retried
	// as a runtime retries it) failed too.
	Undeleted []string `json:"undeleted,omitempty"`
	Allocated int      `json:"allocated"`
	Live      int      `json:"live"`
}

// OK is true when nothing was found.
func (f Findings) OK() bool {
	return len(f.Duplicates)+len(f.Leaked)+len(f.Lost)+len(f.Violations)+len(f.Undeleted) == 0
}

func (f Findings) String() string {
	if f.OK() {
		return fmt.Sprintf("%d addresses allocated, all live: no duplicate, no leak, ringctl check clean", f.Allocated)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%d allocated, %d live", f.Allocated, f.Live)
	for _, l := range [][]string{f.Duplicates, f.Leaked, f.Lost, f.Violations, f.Undeleted} {
		for i, s := range l {
			if i == 10 {
				fmt.Fprintf(&b, "\n  ... %d more", len(l)-10)
				break
			}
			b.WriteString("\n  " + s)
		}
	}
	return b.String()
}

// Check compares the store with the harness's ledger (every container it
// believes alive holds its address, no other CNI allocation exists, no
// address twice) and runs ringctl check's library.
func (c *Cluster) Check(ctx context.Context) (Findings, error) {
	var f Findings
	live := map[string]netip.Addr{} // container -> address
	byAddr := map[netip.Addr]string{}
	undeleted := map[string]bool{}
	for _, h := range c.Hosts {
		h.mu.Lock()
		for _, u := range h.undeleted {
			ctr, _, _ := strings.Cut(u, ": ")
			undeleted[ctr] = true
			f.Undeleted = append(f.Undeleted, u)
		}
		h.mu.Unlock()
		for ctr, a := range h.live() {
			live[ctr] = a
			if o, dup := byAddr[a]; dup {
				f.Duplicates = append(f.Duplicates, fmt.Sprintf("duplicate: %s given to %s and %s", a, o, ctr))
			}
			byAddr[a] = ctr
		}
	}
	f.Live = len(live)
	allocs, err := c.Pool.List(ctx, pool.Filter{Kind: pool.KindCNI, Network: Network})
	if err != nil {
		return f, fmt.Errorf("listing the allocations: %w", err)
	}
	f.Allocated = len(allocs)
	inStore := map[string]bool{}
	for _, a := range allocs {
		inStore[a.Owner.ContainerID] = true
		want, ok := live[a.Owner.ContainerID]
		switch {
		case !ok && undeleted[a.Owner.ContainerID]:
			// Its failed ADD's DEL never succeeded: reported as such.
		case !ok:
			f.Leaked = append(f.Leaked, fmt.Sprintf("leak: %s holds %v but was deleted (or never added)", a.Owner.ContainerID, a.Addrs))
		case len(a.Addrs) != 1 || a.Addrs[0].Addr != want:
			f.Duplicates = append(f.Duplicates, fmt.Sprintf("mismatch: %s holds %v in the store, %s was answered", a.Owner.ContainerID, a.Addrs, want))
		}
	}
	for ctr := range live {
		if !inStore[ctr] {
			f.Lost = append(f.Lost, "lost: "+ctr+" was answered "+live[ctr].String()+" but holds nothing")
		}
	}
	ctl := &cli.Ctl{Pool: c.Pool, Ports: c.Ports, Store: c.st, OrphanAfter: c.opt.OrphanAfter}
	v, err := ctl.Check(ctx)
	if err != nil {
		return f, fmt.Errorf("ringctl check: %w", err)
	}
	for _, x := range v {
		f.Violations = append(f.Violations, fmt.Sprintf("%s: %s: %s", x.Invariant, x.Pool, x.Detail))
	}
	return f, nil
}

// Forget drops host h's containers from the ledger (it left, or was
// reclaimed: the store must hold none of them).
func (h *Host) Forget() {
	h.mu.Lock()
	h.Containers = map[string]netip.Addr{}
	h.mu.Unlock()
}

// Warnings are the agents' warnings so far (count, first few).
func (c *Cluster) Warnings() (int, []string) {
	c.logs.mu.Lock()
	defer c.logs.mu.Unlock()
	return c.logs.n, append([]string(nil), c.logs.first...)
}

// errJoin collects errors from goroutines.
type errJoin struct {
	mu   sync.Mutex
	errs []error
}

func (e *errJoin) add(err error) {
	if err == nil {
		return
	}
	e.mu.Lock()
	e.errs = append(e.errs, err)
	e.mu.Unlock()
}

func (e *errJoin) err() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	return errors.Join(e.errs...)
}

var _ = filepath.Join

// Filter is the pool filter of host's CNI owners.
func Filter(host string) pool.Filter { return pool.Filter{Kind: pool.KindCNI, Host: host} }

// ProbeADDs makes k steady-state ADDs of host h (after 3 to warm its
// notes) through ipam-ring's agent handler, the code h's agent runs for
// its socket, on a store of their own whose connection goes through a
// counting relay: nothing else travels there, so the bytes per ADD are
// exact (both ways, gRPC framing included).
func (c *Cluster) ProbeADDs(ctx context.Context, h *Host, k int) (float64, error) {
	p, err := NewProxy(c.Endpoints[0])
	if err != nil {
		return 0, err
	}
	defer p.Close()
	cfg := storeconfig.Config{Type: storeconfig.TypeEtcd, Endpoints: []string{p.Endpoint()}, Prefix: c.Prefix}
	st, err := storeconfig.Open(cfg)
	if err != nil {
		return 0, err
	}
	defer st.Close()
	hd := ipam.AgentHandler{Store: st, Config: cfg}
	conf, _ := json.Marshal(map[string]any{"cniVersion": "1.1.0", "name": Network, "type": "bridge",
		"ipam": map[string]any{"type": "ipam-ring", "host": h.Name, "timeout": "60s",
			"store":  map[string]any{"type": "etcd", "endpoints": cfg.Endpoints, "prefix": c.Prefix},
			"ranges": poolRanges(c.opt.WidePool)}})
	add := func() error {
		ctr := h.newContainer()
		req := agentapi.NewRequest(agentapi.PluginIPAM, "ADD", &skel.CmdArgs{ContainerID: ctr, Netns: "/var/run/netns/" + ctr, IfName: "eth0", StdinData: conf}, time.Minute)
		ans := hd.Serve(ctx, req)
		if ans.CNIError != nil || ans.Error != "" {
			h.cleanup(ctr, false)
			return fmt.Errorf("probe ADD %s on %s: %v %s", ctr, h.Name, ans.CNIError, ans.Error)
		}
		var res struct {
			IPs []struct {
				Address string `json:"address"`
			} `json:"ips"`
		}
		if err := json.Unmarshal(ans.Stdout, &res); err != nil || len(res.IPs) == 0 {
			return fmt.Errorf("probe ADD %s: result %q: %v", ctr, ans.Stdout, err)
		}
		a, err := netip.ParsePrefix(res.IPs[0].Address)
		if err != nil {
			return err
		}
		h.mu.Lock()
		h.Containers[ctr] = a.Addr()
		h.mu.Unlock()
		return nil
	}
	for range 3 {
		if err := add(); err != nil {
			return 0, err
		}
	}
	b0 := p.Bytes()
	for range k {
		if err := add(); err != nil {
			return 0, err
		}
	}
	return float64(p.Bytes()-b0) / float64(k), nil
}
