package harness

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/containernetworking/cni/pkg/skel"

	"github.com/ringipam/ringipam/cmd/ringipamd/agent"
	"github.com/ringipam/ringipam/pkg/agentapi"
	"github.com/ringipam/ringipam/pkg/routes"
	"github.com/ringipam/ringipam/pkg/storeconfig"
)

// Network is the CNI network every simulated container is attached to;
// Subnet its pool (the test range; see Options.PerHost for its limit), and
// WideSubnet the second range of a wide pool (Options.WidePool). The
// hosts' own addresses lie in 198.19.128.0/17, outside both.
const (
	Network    = "scale"
	Subnet     = "198.18.0.0/16"
	WideSubnet = "198.19.0.0/17"
)

// poolRanges is the "ranges" of the network's IPAM configuration: one
// range set, of Subnet alone (1 024 blocks of 64) or, wide, of Subnet and
// WideSubnet (1 536 blocks).
func poolRanges(wide bool) [][]map[string]string {
	rs := []map[string]string{{"subnet": Subnet}}
	if wide {
		rs = append(rs, map[string]string{"subnet": WideSubnet})
	}
	return [][]map[string]string{rs}
}

// router is a fake routing table: it records what the agent installs.
type router struct {
	onLink  []netip.Prefix // the hosts' network (198.19.128.0/17)
	mu      sync.Mutex
	last    []routes.Route
	applies int
}

func (r *router) OnLink() ([]netip.Prefix, error) { return r.onLink, nil }
func (r *router) Apply(rs []routes.Route) (routes.Change, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.last, r.applies = slices.Clone(rs), r.applies+1
	return routes.Change{Added: len(rs)}, nil
}
func (r *router) ProxyARP([]netip.Prefix) ([]string, error) { return nil, nil }
func (r *router) Clear() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.last = nil
	return nil
}
func (r *router) Close() {}

// routesTo reports whether the last routes installed lead to host.
func (r *router) routesTo(host string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.ContainsFunc(r.last, func(x routes.Route) bool { return x.Host == host })
}

// forwarder is a fake ingress forwarder.
type forwarder struct {
	mu    sync.Mutex
	last  []agent.Forward
	syncs int
}

func (f *forwarder) Sync(_ context.Context, fs []agent.Forward) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.last, f.syncs = slices.Clone(fs), f.syncs+1
	return nil
}
func (f *forwarder) Remove(context.Context) error { return nil }

// forwards reports whether the last forwards installed include port.
func (f *forwarder) forwards(port uint16) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.ContainsFunc(f.last, func(x agent.Forward) bool { return x.Port == port })
}

// Host is one simulated host: its agent and what the harness made on it.
type Host struct {
	Name  string
	Addr  string
	Store storeconfig.Config // the agent's (and its plugins') store
	Proxy []*Proxy           // its etcd traffic's relays (probe hosts only)
	// Hollow: its agent runs without --routes and --ingress
	// (Options.Full).
	Hollow bool
	// wide: the network's pool is wide (Options.WidePool).
	wide   bool
	cfg    agent.Config
	rt     *router
	fwd    *forwarder
	cancel context.CancelFunc
	done   chan error
	// Containers are the attachments alive on the host: container ID to
	// its address.
	mu         sync.Mutex
	Containers map[string]netip.Addr
	next       int
	undeleted  []string // containers whose failed ADD no DEL could undo
	// table is portmap-ingress's nftables table of the host, unique in
	// the process (the clusters of one test share its namespace).
	table string
}

// hostAddr is host i's --addr: in 198.19.128.0/17 (outside the pool,
// wide or not; 32 768 hosts).
func hostAddr(i int) string {
	return netip.AddrFrom4([4]byte{198, 19, 128 | byte(i>>8), byte(i)}).String()
}

// newHost prepares host i (not started). Its socket and DEL queue live
// under dir.
func (c *Cluster) newHost(i int, proxied bool) (*Host, error) {
	name := fmt.Sprintf("h%05d", i)
	dir := filepath.Join(c.dir, name)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	h := &Host{Name: name, Addr: hostAddr(i), rt: &router{onLink: []netip.Prefix{netip.PrefixFrom(netip.MustParseAddr(hostAddr(i)), 17)}}, fwd: &forwarder{}, Containers: map[string]netip.Addr{}, wide: c.opt.WidePool}
	eps := c.Endpoints
	if proxied {
		eps = nil
		for _, ep := range c.Endpoints {
			p, err := NewProxy(ep)
			if err != nil {
				return nil, err
			}
			c.closers = append(c.closers, p.Close)
			h.Proxy = append(h.Proxy, p)
			eps = append(eps, p.Endpoint())
		}
	}
	h.Store = storeconfig.Config{Type: storeconfig.TypeEtcd, Endpoints: eps, Prefix: c.Prefix,
		AgentSocket: filepath.Join(dir, "agent.sock"), DelQueue: filepath.Join(dir, "del-queue")}
	cfg := agent.DefaultConfig()
	cfg.Host, cfg.Addr, cfg.Store = name, h.Addr, h.Store
	cfg.Listen = "off"
	h.Hollow = c.opt.Full > 0 && i >= c.opt.Full && i < c.opt.N
	cfg.Routes = !h.Hollow
	cfg.Ingress = !h.Hollow
	cfg.PortmapTable = "off"
	cfg.LogLevel = "warn"
	c.opt.Configure(&cfg)
	h.cfg = cfg
	h.table = fmt.Sprintf("rp%d-%s", c.seq, name)
	return h, nil
}

// ProxyBytes is the probe host's etcd traffic so far (0 without proxy).
func (h *Host) ProxyBytes() int64 {
	var t int64
	for _, p := range h.Proxy {
		t += p.Bytes()
	}
	return t
}

// start runs the host's agent until stop.
func (c *Cluster) start(h *Host, leaveOnStop bool) error {
	h.cfg.LeaveOnStop = leaveOnStop
	log := slog.New(slog.NewTextHandler(c.logOut(h.Name), &slog.HandlerOptions{Level: slog.LevelWarn}))
	a, err := agent.New(h.cfg, log, agent.WithHarnessRouter(h.rt), agent.WithHarnessForwarder(h.fwd))
	if err != nil {
		return fmt.Errorf("agent %s: %w", h.Name, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	h.cancel, h.done = cancel, make(chan error, 1)
	go func() { h.done <- a.Run(ctx) }()
	return nil
}

// waitSocket waits until the agent listens on its socket.
func (h *Host) waitSocket(ctx context.Context) error {
	for {
		if _, err := os.Stat(h.Store.AgentSocket); err == nil {
			return nil
		}
		select {
		case err := <-h.done:
			h.done <- err
			return fmt.Errorf("agent %s stopped: %v", h.Name, err)
		case <-ctx.Done():
			return fmt.Errorf("agent %s: no socket: %w", h.Name, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// stop stops the agent and waits for it (within d).
func (h *Host) stop(d time.Duration) error {
	if h.cancel == nil {
		return nil
	}
	h.cancel()
	h.cancel = nil
	select {
	case err := <-h.done:
		return err
	case <-time.After(d):
		return fmt.Errorf("agent %s did not stop within %s", h.Name, d)
	}
}

// storeJSON is the plugins' "store" object of the host.
func (h *Host) storeJSON() map[string]any {
	return map[string]any{"type": "etcd", "endpoints": h.Store.Endpoints, "prefix": h.Store.Prefix,
		"agentSocket": h.Store.AgentSocket, "delQueue": h.Store.DelQueue}
}

// ipamConf is the network configuration ipam-ring's invocation carries.
func (h *Host) ipamConf() []byte {
	b, _ := json.Marshal(map[string]any{"cniVersion": "1.1.0", "name": Network, "type": "bridge",
		"ipam": map[string]any{"type": "ipam-ring", "host": h.Name, "store": h.storeJSON(), "timeout": "30s",
			"ranges": poolRanges(h.wide)}})
	return b
}

// ErrCNI is wrapped by the error of an invocation the agent answered with
// a CNI error.
var ErrCNI = errors.New("CNI error")

// call sends one whole plugin invocation to the host's agent, as the
// plugins do (agentapi.NewRequest, then the socket).
func (h *Host) call(ctx context.Context, plugin, command, ctr string, stdin []byte) ([]byte, error) {
	args := &skel.CmdArgs{ContainerID: ctr, Netns: "/var/run/netns/" + ctr, IfName: "eth0", StdinData: stdin}
	req := agentapi.NewRequest(plugin, command, args, 30*time.Second)
	ans, err := agentapi.Call(ctx, h.Store.AgentSocket, req)
	if err != nil {
		return nil, fmt.Errorf("%s %s %s on %s: %w", plugin, command, ctr, h.Name, err)
	}
	if ans.CNIError != nil {
		return nil, fmt.Errorf("%w: %s %s %s on %s: code %d: %s", ErrCNI, plugin, command, ctr, h.Name, ans.CNIError.Code, ans.CNIError.Msg)
	}
	return ans.Stdout, nil
}

// newContainer names the host's next container.
func (h *Host) newContainer() string {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.next++
	return fmt.Sprintf("%s-c%05d", h.Name, h.next)
}

// Add allocates an address for a new container of the host through its
// agent; it returns the container, its result (stdout) and the address.
// A failed ADD is followed by a DEL, as a runtime follows one (the ADD
// may have committed before its answer was lost).
func (h *Host) Add(ctx context.Context) (string, []byte, netip.Addr, error) {
	ctr := h.newContainer()
	out, err := h.call(ctx, agentapi.PluginIPAM, "ADD", ctr, h.ipamConf())
	if err != nil {
		h.cleanup(ctr, false)
		return ctr, nil, netip.Addr{}, err
	}
	var res struct {
		IPs []struct {
			Address string `json:"address"`
		} `json:"ips"`
	}
	if err := json.Unmarshal(out, &res); err != nil || len(res.IPs) == 0 {
		return ctr, nil, netip.Addr{}, fmt.Errorf("ADD %s on %s: result %q: %v", ctr, h.Name, out, err)
	}
	p, err := netip.ParsePrefix(res.IPs[0].Address)
	if err != nil {
		return ctr, nil, netip.Addr{}, fmt.Errorf("ADD %s on %s: %w", ctr, h.Name, err)
	}
	h.mu.Lock()
	h.Containers[ctr] = p.Addr()
	h.mu.Unlock()
	return ctr, out, p.Addr(), nil
}

// Del releases container ctr's address (ipam-ring's DEL).
func (h *Host) Del(ctx context.Context, ctr string) error {
	if _, err := h.call(ctx, agentapi.PluginIPAM, "DEL", ctr, h.ipamConf()); err != nil {
		return err
	}
	h.mu.Lock()
	delete(h.Containers, ctr)
	h.mu.Unlock()
	return nil
}

// Publish publishes port (tcp) of container ctr, whose ADD result is
// prev, in mode "host" or "ingress" (portmap-ingress's ADD).
func (h *Host) Publish(ctx context.Context, ctr string, prev []byte, mode string, port int) error {
	var pr map[string]any
	if err := json.Unmarshal(prev, &pr); err != nil {
		return err
	}
	b, _ := json.Marshal(map[string]any{"cniVersion": "1.1.0", "name": Network, "type": "portmap-ingress",
		"host": h.Name, "store": h.storeJSON(), "mode": mode, "timeout": "30s", "table": h.table, "dataplane": "nftables",
		"runtimeConfig": map[string]any{"portMappings": []map[string]any{{"hostPort": port, "containerPort": 80, "protocol": "tcp"}}},
		"prevResult":    pr})
	_, err := h.call(ctx, agentapi.PluginPortmap, "ADD", ctr, b)
	if err != nil {
		// The runtime DELs the whole chain of a failed ADD.
		h.mu.Lock()
		delete(h.Containers, ctr)
		h.mu.Unlock()
		h.cleanup(ctr, true, b)
	}
	return err
}

// cleanup DELs a container whose ADD failed (its ports too when
// published; pm is portmap-ingress's configuration), retrying as a
// runtime retries a DEL; a DEL that never succeeds leaves the container in
// the ledger's graveyard, which Check reports.
func (h *Host) cleanup(ctr string, ports bool, pm ...[]byte) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	var err error
	for try := 0; try < 5; try++ {
		err = nil
		if ports && len(pm) > 0 {
			_, err = h.call(ctx, agentapi.PluginPortmap, "DEL", ctr, pm[0])
		}
		if err == nil {
			_, err = h.call(ctx, agentapi.PluginIPAM, "DEL", ctr, h.ipamConf())
		}
		if err == nil {
			return
		}
		time.Sleep(time.Second)
	}
	h.mu.Lock()
	h.undeleted = append(h.undeleted, ctr+": "+err.Error())
	h.mu.Unlock()
}

// live is a copy of the host's containers.
func (h *Host) live() map[string]netip.Addr {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := make(map[string]netip.Addr, len(h.Containers))
	for k, v := range h.Containers {
		out[k] = v
	}
	return out
}

// anyContainer is one of the host's containers ("" if none).
func (h *Host) anyContainer(skip int) string {
	h.mu.Lock()
	defer h.mu.Unlock()
	keys := make([]string, 0, len(h.Containers))
	for k := range h.Containers {
		keys = append(keys, k)
	}
	if len(keys) == 0 {
		return ""
	}
	slices.Sort(keys)
	return keys[skip%len(keys)]
}

var _ io.Writer = (*logSink)(nil)

// logSink keeps the agents' warnings (counted, the first few kept).
type logSink struct {
	mu    sync.Mutex
	n     int
	first []string
}

func (s *logSink) Write(b []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.n++
	if len(s.first) < 20 {
		s.first = append(s.first, string(b))
	}
	return len(b), nil
}
