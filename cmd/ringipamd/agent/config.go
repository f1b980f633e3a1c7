package agent

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"net/netip"
	"strings"
	"time"

	"github.com/ringipam/ringipam/internal/conffile"
	"github.com/ringipam/ringipam/pkg/cni/portmap"
	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/routes"
	"github.com/ringipam/ringipam/pkg/storeconfig"
)

// EnvPrefix starts the environment variable of every flag:
// --orphan-after is RINGIPAMD_ORPHAN_AFTER.
const EnvPrefix = "RINGIPAMD_"

// Defaults of the configuration.
const (
	DefaultListen        = "127.0.0.1:9476"
	DefaultLeaseTTL      = 15 * time.Second
	DefaultHeartbeat     = 30 * time.Second
	DefaultSweepInterval = time.Minute
	DefaultSyncInterval  = 2 * time.Second
	DefaultResync        = 5 * time.Minute
	DefaultStatusRefresh = 10 * time.Second
	DefaultTimeout       = 20 * time.Second
	DefaultIngressTable  = "ringipam-ingress"
	DefaultVanishedGrace = 5 * time.Minute
	DefaultCRISocket     = "/run/containerd/containerd.sock"
)

// ErrConfig is wrapped by every configuration error.
var ErrConfig = errors.New("invalid ringipamd configuration")

// Config is the agent's whole configuration: defaults, then the JSON file
// named by --config (or RINGIPAMD_CONFIG), then RINGIPAMD_* variables, then
// flags, in increasing precedence.
type Config struct {
	// Host is this host's name in the ring: the same name its CNI plugins
	// and Docker driver use (default: the machine's host name).
	Host string `json:"host"`
	// Addr is where other hosts reach this host's published ingress
	// ports and route its ranges (--routes): this host's address on the
	// cluster network, or one per family separated by a comma
	// ("198.18.0.1,fd00::1") on a dual-stack cluster. Empty: no other
	// host forwards or routes here.
	Addr  string             `json:"addr"`
	Store storeconfig.Config `json:"store"`
	// Listen serves /metrics, the status page and /status.json; "off"
	// serves nothing.
	Listen        string               `json:"listen"`
	LeaseTTL      storeconfig.Duration `json:"leaseTTL"`
	Heartbeat     storeconfig.Duration `json:"heartbeat"`
	SweepInterval storeconfig.Duration `json:"sweepInterval"`
	// OrphanAfter is how long a host must be down before its space is
	// reclaimed (default 48h); "0s" turns the sweep off on this agent.
	OrphanAfter storeconfig.Duration `json:"orphanAfter"`
	Sweep       bool                 `json:"sweep"`
	// LeaveOnStop makes the host leave the ring when the agent stops
	// cleanly (a host being decommissioned; seed 002's weave reset).
	LeaveOnStop  bool   `json:"leaveOnStop,omitempty"`
	Ingress      bool   `json:"ingress"`
	IngressTable string `json:"ingressTable"`
	// PortmapTable is portmap-ingress's table on this host (its "table"):
	// with Ingress, the agent removes from it the forwards of endpoints
	// this host no longer holds in the store. "off": the agent leaves it
	// alone.
	PortmapTable string `json:"portmapTable"`
	// PortmapDataplane is portmap-ingress's "dataplane" on this host.
	PortmapDataplane string `json:"portmapDataplane"`
	// Routes makes the agent route every live range of another host (up
	// or down, not orphaned) to that host's addr, in a routing table of
	// its own (package routes). Off by default.
	Routes bool `json:"routes,omitempty"`
	// RoutesTable, RoutesProtocol and RoutesRulePriority are the routing
	// table, route protocol and policy rule priority of those routes (0:
	// routes.DefaultTable, DefaultProtocol, DefaultRulePriority).
	RoutesTable        int `json:"routesTable,omitempty"`
	RoutesProtocol     int `json:"routesProtocol,omitempty"`
	RoutesRulePriority int `json:"routesRulePriority,omitempty"`
	// SyncInterval is how often a local store (one host) is scanned for
	// what the routes and ingress loops follow, how often the kernel's own
	// changes are looked at (this host's on-link prefixes, new bridges
	// needing proxy ARP, a failed apply tried again: no store read), and
	// how often the DEL queue is drained. On etcd the loops never poll the
	// store: they follow watches (see Resync).
	SyncInterval storeconfig.Duration `json:"syncInterval"`
	// Resync is how often (jittered, up to a fifth more) the routes and
	// ingress loops re-apply the kernel and nftables tables from their
	// copies of the store although no watch said anything changed, to
	// repair hand edits: no store read (on a local store at least every
	// 30s).
	Resync storeconfig.Duration `json:"resync"`
	// StatusRefresh is how often the status page and pool metrics are
	// read from the store.
	StatusRefresh storeconfig.Duration `json:"statusRefresh"`
	// Timeout bounds each store operation of the agent's loops.
	Timeout  storeconfig.Duration `json:"timeout"`
	LogLevel string               `json:"logLevel"`
	// Kubernetes (kube.go). The host's name is its Node's name.
	//
	// Kubeconfig is the apiserver's client configuration file; empty:
	// the pod's in-cluster configuration.
	Kubeconfig string `json:"kubeconfig,omitempty"`
	// KubeReclaimNodes: this host is a Kubernetes node (its host record
	// says so), and the elected leader reclaims the host of a deleted
	// Node at once (fenced on its liveness key, as the sweep), and at its
	// start the Kubernetes nodes' hosts that have no Node any more.
	KubeReclaimNodes bool `json:"kubeReclaimNodes,omitempty"`
	// KubeVanishedPods: the agent releases this host's CNI owners whose
	// pod is gone from the apiserver and whose sandbox the runtime
	// (CRISocket) no longer has, VanishedGrace after both the allocation
	// and the pod's disappearance.
	KubeVanishedPods bool                 `json:"kubeVanishedPods,omitempty"`
	VanishedGrace    storeconfig.Duration `json:"vanishedGrace"`
	// CRISocket is the container runtime's CRI socket (ListPodSandbox).
	CRISocket string `json:"criSocket"`
}

// kube reports whether the agent talks to Kubernetes at all.
func (c Config) kube() bool { return c.KubeReclaimNodes || c.KubeVanishedPods }

// DefaultConfig is the configuration with nothing set.
func DefaultConfig() Config {
	return Config{
		Store:            storeconfig.Config{Type: storeconfig.TypeLocal},
		Listen:           DefaultListen,
		LeaseTTL:         storeconfig.Duration(DefaultLeaseTTL),
		Heartbeat:        storeconfig.Duration(DefaultHeartbeat),
		SweepInterval:    storeconfig.Duration(DefaultSweepInterval),
		OrphanAfter:      storeconfig.Duration(pool.DefaultOrphanAfter),
		Sweep:            true,
		Ingress:          true,
		IngressTable:     DefaultIngressTable,
		PortmapTable:     portmap.DefaultTable,
		PortmapDataplane: portmap.DataplaneAuto,
		SyncInterval:     storeconfig.Duration(DefaultSyncInterval),
		Resync:           storeconfig.Duration(DefaultResync),
		StatusRefresh:    storeconfig.Duration(DefaultStatusRefresh),
		Timeout:          storeconfig.Duration(DefaultTimeout),
		LogLevel:         "info",
		VanishedGrace:    storeconfig.Duration(DefaultVanishedGrace),
		CRISocket:        DefaultCRISocket,
	}
}

// LoadConfig builds the configuration from args and the environment.
func LoadConfig(args []string, getenv func(string) string, usage io.Writer) (Config, error) {
	cfg := DefaultConfig()
	path := conffile.Path(args, getenv(EnvPrefix+"CONFIG"))
	if err := conffile.Decode(path, &cfg); err != nil {
		return Config{}, fmt.Errorf("%w: %w", ErrConfig, err)
	}
	fs := flag.NewFlagSet("ringipamd", flag.ContinueOnError)
	fs.SetOutput(usage)
	fs.String("config", path, "JSON configuration file (see conf/ringipamd.json)")
	fs.StringVar(&cfg.Host, "host", cfg.Host, "this host's name in the ring, as its plugins use it (default: the machine's hostname)")
	addr := &addrFlag{p: &cfg.Addr}
	fs.Var(addr, "addr", "this host's address on the cluster network, where other hosts forward its ingress ports and route its ranges; "+
		"dual-stack: one per family, comma-separated or the flag repeated (198.18.0.1,fd00::1)")
	var storeFlags storeconfig.Flags
	storeFlags.Register(fs)
	fs.StringVar(&cfg.Listen, "listen", cfg.Listen, `serve /metrics and the status page here ("off": nothing)`)
	fs.Var(storeconfig.DurationValue(&cfg.LeaseTTL), "lease-ttl", "etcd: TTL of the liveness lease (the host is down this long after the agent dies)")
	fs.Var(storeconfig.DurationValue(&cfg.Heartbeat), "heartbeat", "how often the host record's last-seen time is written")
	fs.Var(storeconfig.DurationValue(&cfg.SweepInterval), "sweep-interval", "how often orphaned hosts are looked for")
	fs.Var(storeconfig.DurationValue(&cfg.OrphanAfter), "orphan-after", "how long a host is down before its space is reclaimed")
	fs.BoolVar(&cfg.Sweep, "sweep", cfg.Sweep, "reclaim orphaned hosts from this agent")
	fs.BoolVar(&cfg.LeaveOnStop, "leave-on-stop", cfg.LeaveOnStop, "on a clean stop, leave the ring: release this host's owners and ports, its ranges go to the owners of the ranges before them (decommissioning)")
	fs.BoolVar(&cfg.Ingress, "ingress", cfg.Ingress, "forward ingress ports published on other hosts (nftables)")
	fs.StringVar(&cfg.IngressTable, "ingress-table", cfg.IngressTable, "nftables table (inet family) of the ingress forwards")
	fs.StringVar(&cfg.PortmapTable, "portmap-table", cfg.PortmapTable, `portmap-ingress's table on this host: with --ingress, forwards of endpoints this host no longer holds in the store are removed from it ("off": left alone)`)
	fs.StringVar(&cfg.PortmapDataplane, "portmap-dataplane", cfg.PortmapDataplane, "portmap-ingress's dataplane on this host: auto, nftables or iptables")
	fs.BoolVar(&cfg.Routes, "routes", cfg.Routes, "route every live range of other hosts to their --addr (netlink, a routing table of its own; off by default)")
	fs.IntVar(&cfg.RoutesTable, "routes-table", cfg.RoutesTable, "with --routes: the routing table (default 4212)")
	fs.IntVar(&cfg.RoutesProtocol, "routes-protocol", cfg.RoutesProtocol, "with --routes: the route protocol number marking the agent's routes, 5-255 (default 212)")
	fs.IntVar(&cfg.RoutesRulePriority, "routes-rule-priority", cfg.RoutesRulePriority, "with --routes: priority of the rule to the table, below main's 32766 (default 32000)")
	fs.Var(storeconfig.DurationValue(&cfg.SyncInterval), "sync-interval", "local store: how often it is scanned for the routes and ingress forwards; "+
		"any store: how often this host's addresses, new bridges (proxy ARP) and failed applies are looked at (no store read), and the DEL queue drained. "+
		"On etcd the routes and forwards follow watches, not this poll")
	fs.Var(storeconfig.DurationValue(&cfg.Resync), "resync", "how often (jittered) the routes and ingress tables are re-applied from the agent's copy of the store "+
		"although no watch reported a change, repairing hand edits (no store read)")
	fs.Var(storeconfig.DurationValue(&cfg.StatusRefresh), "status-refresh", "how often pool usage is read for the status page and metrics")
	fs.Var(storeconfig.DurationValue(&cfg.Timeout), "timeout", "deadline of one store operation of the agent")
	// The DEL queue is a store key the store flags do not carry: applied
	// after them (a --store that changes the type starts the store over).
	var delQueue string
	fs.StringVar(&delQueue, "del-queue", "", "etcd: directory of the DELs this host's plugins queued while no agent answered; the agent runs them when it starts and every sync interval (default /var/lib/ringipam/del-queue)")
	fs.StringVar(&cfg.LogLevel, "log-level", cfg.LogLevel, "debug, info, warn or error")
	fs.StringVar(&cfg.Kubeconfig, "kubeconfig", cfg.Kubeconfig, "with --kube-reclaim-nodes or --kube-vanished-pods: the apiserver's client configuration (default: the pod's in-cluster configuration)")
	fs.BoolVar(&cfg.KubeReclaimNodes, "kube-reclaim-nodes", cfg.KubeReclaimNodes, "this host is the Kubernetes node of its name: when a Node is deleted, the elected leader reclaims its host at once (once its liveness key is gone); "+
		"at its start, also the hosts of Kubernetes nodes that have no Node any more (etcd only)")
	fs.BoolVar(&cfg.KubeVanishedPods, "kube-vanished-pods", cfg.KubeVanishedPods, "release this host's pod addresses whose pod is gone from the apiserver and whose sandbox the runtime (--cri-socket) no longer has, after --vanished-grace")
	fs.Var(storeconfig.DurationValue(&cfg.VanishedGrace), "vanished-grace", "with --kube-vanished-pods: how long after both its allocation and its pod's disappearance an address of a vanished pod is released")
	fs.StringVar(&cfg.CRISocket, "cri-socket", cfg.CRISocket, "with --kube-vanished-pods: the container runtime's CRI socket, asked which pod sandboxes exist")
	var envErr error
	fs.VisitAll(func(f *flag.Flag) {
		key := EnvPrefix + strings.ToUpper(strings.ReplaceAll(f.Name, "-", "_"))
		if v := getenv(key); v != "" && f.Name != "config" {
			if err := f.Value.Set(v); err != nil {
				envErr = errors.Join(envErr, fmt.Errorf("%s: %w", key, err))
			}
		}
	})
	if envErr != nil {
		return Config{}, fmt.Errorf("%w: %w", ErrConfig, envErr)
	}
	addr.fresh = false // a repeated --addr adds to the flags' own, not to RINGIPAMD_ADDR's
	if err := fs.Parse(args); err != nil {
		return Config{}, fmt.Errorf("%w: %w", ErrConfig, err)
	}
	if fs.NArg() > 0 {
		return Config{}, fmt.Errorf("%w: unexpected arguments %q", ErrConfig, fs.Args())
	}
	if err := storeFlags.Apply(&cfg.Store); err != nil {
		return Config{}, fmt.Errorf("%w: %w", ErrConfig, err)
	}
	if delQueue != "" {
		cfg.Store.DelQueue = delQueue
	}
	for _, d := range storeFlags.Deprecated() {
		fmt.Fprintf(usage, "%s: warning: %s\n", fs.Name(), d)
	}
	return cfg, cfg.complete()
}

// complete fills the host name and validates.
func (c *Config) complete() error {
	if c.Host == "" {
		h, err := storeconfig.HostName("")
		if err != nil {
			return fmt.Errorf("%w: %w", ErrConfig, err)
		}
		c.Host = h
	}
	if c.Store.Type == "" {
		c.Store.Type = storeconfig.TypeLocal
	}
	if err := c.Store.Validate(); err != nil {
		return fmt.Errorf("%w: store: %w", ErrConfig, err)
	}
	if _, err := c.addrs(); err != nil {
		return err
	}
	for name, d := range map[string]storeconfig.Duration{"heartbeat": c.Heartbeat, "sweep-interval": c.SweepInterval,
		"sync-interval": c.SyncInterval, "resync": c.Resync, "status-refresh": c.StatusRefresh, "timeout": c.Timeout} {
		if d <= 0 {
			return fmt.Errorf("%w: %s must be positive", ErrConfig, name)
		}
	}
	if c.KubeVanishedPods && (c.VanishedGrace <= 0 || c.CRISocket == "") {
		return fmt.Errorf("%w: kube-vanished-pods needs a positive vanished-grace and a cri-socket", ErrConfig)
	}
	if time.Duration(c.LeaseTTL) < 2*time.Second {
		return fmt.Errorf("%w: lease-ttl %s is below etcd's useful minimum of 2s", ErrConfig, time.Duration(c.LeaseTTL))
	}
	if c.IngressTable == "" || strings.ContainsAny(c.IngressTable, " \t\n/;") {
		return fmt.Errorf("%w: ingress-table %q is not a table name", ErrConfig, c.IngressTable)
	}
	if c.PortmapTable == "" || strings.ContainsAny(c.PortmapTable, " \t\n/;") {
		return fmt.Errorf("%w: portmap-table %q is not a table name (\"off\": none)", ErrConfig, c.PortmapTable)
	}
	switch c.PortmapDataplane {
	case portmap.DataplaneAuto, portmap.DataplaneNFTables, portmap.DataplaneIPTables:
	default:
		return fmt.Errorf("%w: portmap-dataplane %q is not auto, nftables or iptables", ErrConfig, c.PortmapDataplane)
	}
	if c.Routes {
		if _, err := c.routesTable().Complete(); err != nil {
			return fmt.Errorf("%w: %w", ErrConfig, err)
		}
	}
	if _, err := ParseLevel(c.LogLevel); err != nil {
		return fmt.Errorf("%w: %w", ErrConfig, err)
	}
	return nil
}

// addrs parses Addr: its addresses, at most one per family, in the order
// given; it also puts Addr in canonical form (spaces out, addresses as
// netip prints them).
func (c *Config) addrs() ([]netip.Addr, error) {
	var out []netip.Addr
	var canon []string
	for _, s := range pool.SplitAddrs(c.Addr) {
		a, err := netip.ParseAddr(s)
		if err != nil || a.Zone() != "" {
			return nil, fmt.Errorf("%w: addr %q is not an IP address (one address, or one per family separated by a comma)", ErrConfig, s)
		}
		a = a.Unmap()
		for _, b := range out {
			if b.Is4() == a.Is4() {
				return nil, fmt.Errorf("%w: addr %q gives two addresses of one family (%s and %s): give at most one IPv4 and one IPv6 address", ErrConfig, c.Addr, b, a)
			}
		}
		out = append(out, a)
		canon = append(canon, a.String())
	}
	c.Addr = strings.Join(canon, ",")
	return out, nil
}

// addrFlag is --addr: given once, it replaces the value of the file or the
// environment; repeated, the addresses add up (--addr 198.18.0.1 --addr
// fd00::1 is --addr 198.18.0.1,fd00::1).
type addrFlag struct {
	p     *string
	fresh bool // set once already in this pass
}

func (f *addrFlag) String() string {
	if f == nil || f.p == nil {
		return ""
	}
	return *f.p
}

func (f *addrFlag) Set(v string) error {
	if f.fresh && *f.p != "" {
		*f.p += "," + v
	} else {
		*f.p = v
	}
	f.fresh = true
	return nil
}

// routesTable is the routes' table configuration.
func (c Config) routesTable() routes.TableConfig {
	return routes.TableConfig{Table: c.RoutesTable, Protocol: c.RoutesProtocol, RulePriority: c.RoutesRulePriority}
}
