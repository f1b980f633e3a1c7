//go:build integration

// Package portmap holds the end-to-end tests of portmap-ingress: the real
// plugin chained after the reference bridge plugin and ipam-ring, run by
// libcni (and podman, in podman_test.go), in namespaces the test makes: a
// "host" (the runtime's namespace, where the bridge and the packet filter
// rules live), containers running a TCP and UDP echo server, and a client
// namespace wired to the host by a veth pair. Nothing touches the rules of
// the machine's own namespace.
//
// Two-host tests reach the test's etcd (on loopback of the test's own
// namespace) through a relay listening inside each host namespace.
package portmap

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"

	"github.com/ringipam/ringipam/integration/cnitest"
	"github.com/ringipam/ringipam/integration/netns"
	"github.com/ringipam/ringipam/internal/testenv"
	"github.com/ringipam/ringipam/pkg/portalloc"
)

var portmapBin, echoBin string

func TestMain(m *testing.M) {
	os.Exit(cnitest.Main(m, func(ctx context.Context, dir string) error {
		portmapBin = filepath.Join(dir, "portmap-ingress")
		if err := cnitest.Build(ctx, portmapBin, "./plugins/portmap-ingress"); err != nil {
			return err
		}
		// Static: podman_test.go packs it into an image of its own.
		echoBin = filepath.Join(dir, "echo")
		build := cnitest.GoCommand(ctx, cnitest.RepoRoot, "build", "-o", echoBin, "./integration/portmap/testdata/echo")
		build.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := build.CombinedOutput(); err != nil {
			return fmt.Errorf("building echo: %v: %s", err, out)
		}
		return nil
	}))
}

// host is one "host": a namespace with a bridge made by the bridge plugin,
// a client namespace wired to it (198.18.130.0/24), and a libcni runtime.
type host struct {
	name         string // the host's name in the store
	ns, client   *netns.NS
	cni          *libcni.CNIConfig
	store        map[string]any
	dataplane    string
	subnet       string // the containers' subnet
	hostAddr     string // the host's address towards the client
	network      string
	portmapExtra map[string]any
}

// pluginDirWith makes a CNI_PATH with bridge, loopback, ipam-ring and
// portmap-ingress.
func pluginDirWith(t *testing.T) string {
	dir := cnitest.PluginDir(t, cnitest.IPAMBin, "bridge", "loopback", "portmap")
	if err := os.Symlink(portmapBin, filepath.Join(dir, "portmap-ingress")); err != nil {
		t.Fatal(err)
	}
	return dir
}

func newHost(t *testing.T, name string, st map[string]any, subnet string) *host {
	netns.RequireRoot(t)
	h := &host{name: name, ns: netns.New(t, "pmh"), client: netns.New(t, "pmk"), store: st, subnet: subnet,
		hostAddr: "198.18.130.1", network: netns.Unique("pm-")}
	hv, kv := netns.Unique("pmv"), netns.Unique("pmv")
	if out, err := netns.Command("ip", "link", "add", hv, "netns", h.ns.Name, "type", "veth", "peer", "name", kv, "netns", h.client.Name); err != nil {
		t.Fatalf("veth: %v %s", err, out)
	}
	h.ns.MustRun(t, "ip", "addr", "add", h.hostAddr+"/24", "dev", hv)
	h.ns.MustRun(t, "ip", "link", "set", hv, "up")
	h.ns.MustRun(t, "sysctl", "-qw", "net.ipv4.ip_forward=1")
	h.client.MustRun(t, "ip", "addr", "add", "198.18.130.2/24", "dev", kv)
	h.client.MustRun(t, "ip", "link", "set", kv, "up")
	h.cni = cnitest.NewCNI(t, pluginDirWith(t))
	return h
}

// localStore is a fresh embedded store.
func localStore(t *testing.T) map[string]any {
	return map[string]any{"type": "local", "path": filepath.Join(t.TempDir(), "ringipam.db")}
}

func (h *host) portmapConf() map[string]any {
	pm := map[string]any{"type": "portmap-ingress", "host": h.name, "store": h.store, "timeout": "50s",
		"capabilities": map[string]bool{"portMappings": true, "io.kubernetes.cri.pod-annotations": true}}
	if h.dataplane != "" {
		pm["dataplane"] = h.dataplane
	}
	for k, v := range h.portmapExtra {
		pm[k] = v
	}
	return pm
}

func (h *host) list(t *testing.T) *libcni.NetworkConfigList {
	return cnitest.ConfList(t, h.network,
		map[string]any{"type": "bridge", "bridge": "pmbr0", "isGateway": true, "hairpinMode": true, "ipMasq": false,
			"ipam": map[string]any{"type": "ipam-ring", "host": h.name, "store": h.store, "timeout": "50s",
				"ranges": [][]map[string]string{{{"subnet": h.subnet}}}, "routes": []map[string]string{{"dst": "0.0.0.0/0"}}}},
		h.portmapConf(),
	)
}

// container makes a container namespace.
func (h *host) container(t *testing.T) *netns.NS { return netns.New(t, "pmc") }

// rt is a runtime configuration asking for mappings.
func rt(ctr *netns.NS, id string, mappings ...map[string]any) *libcni.RuntimeConf {
	r := &libcni.RuntimeConf{ContainerID: id, NetNS: ctr.Path, IfName: "eth0", CapabilityArgs: map[string]any{}}
	if len(mappings) > 0 {
		r.CapabilityArgs["portMappings"] = mappings
	}
	return r
}

func (h *host) add(t *testing.T, r *libcni.RuntimeConf) (string, error) {
	res, err := cnitest.Add(h.cni, h.ns, h.list(t), r)
	if err != nil {
		return "", err
	}
	return strings.Split(res.IPs[0].Address.String(), "/")[0], nil
}

func (h *host) del(t *testing.T, r *libcni.RuntimeConf) error {
	return cnitest.InNS(h.ns, func(ctx context.Context) error { return h.cni.DelNetworkList(ctx, h.list(t), r) })
}

func startEcho(t *testing.T, c *netns.NS) {
	cmd := exec.Command("ip", "netns", "exec", c.Name, echoBin, "-tcp", ":80", "-udp", ":53")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
}

// dial sends "ping" to target (tcp/ADDR:PORT or udp/...) from namespace
// from, retrying while the server starts, and returns the answer.
func dial(from *netns.NS, target string, patience time.Duration) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	var last string
	var err error
	for {
		var out []byte
		out, err = exec.CommandContext(ctx, "ip", "netns", "exec", from.Name, echoBin, "-dial", target, "-msg", "ping").CombinedOutput()
		last = strings.TrimSpace(string(out))
		if err == nil || ctx.Err() != nil {
			return last, err
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// settled makes the data path's skeleton exist (the table and chains the
// first ADD creates, which stay) by adding and deleting a throwaway
// attachment, and returns the rule count then: what every DEL must bring
// the count back to.
func (h *host) settled(t *testing.T) int {
	c := h.container(t)
	r := rt(c, "warm-up", map[string]any{"hostPort": 1, "containerPort": 1})
	if _, err := h.add(t, r); err != nil {
		t.Fatalf("warm-up ADD: %v", err)
	}
	if err := h.del(t, r); err != nil {
		t.Fatalf("warm-up DEL: %v", err)
	}
	return h.ruleCount(t)
}

// ruleCount counts the forwards (and other rules) of the plugin's data
// path in the host namespace: nftables elements and rules, or iptables
// rules of the plugin's chains.
func (h *host) ruleCount(t *testing.T) int {
	if h.dataplane == "iptables" {
		n := 0
		for _, bin := range []string{"iptables", "ip6tables"} {
			out, _ := h.ns.Run(bin, "-t", "nat", "-S")
			n += strings.Count(out, "RINGIPAM-PM")
		}
		return n
	}
	out, err := h.ns.Run("nft", "-j", "list", "table", "inet", "ringipam-portmap")
	if err != nil {
		return 0 // no table yet
	}
	return strings.Count(out, `"elem"`) + strings.Count(out, `"comment"`) + strings.Count(out, `"rule"`)
}

func (h *host) dump() string {
	if h.dataplane == "iptables" {
		out, _ := h.ns.Run("iptables", "-t", "nat", "-S")
		return out
	}
	out, _ := h.ns.Run("nft", "list", "table", "inet", "ringipam-portmap")
	return out
}

// publishEndToEnd: TCP and UDP reach the container through published ports
// from a client, from the host itself and from the container itself; a
// second ADD of a taken host port is refused naming the holder; CHECK
// passes and then finds a forward deleted by hand; DEL without any mapping
// in its configuration brings the rules back to what they were.
func publishEndToEnd(t *testing.T, dataplane string) {
	h := newHost(t, "pmhost", localStore(t), "198.18.131.0/24")
	h.dataplane = dataplane
	ctr := h.container(t)
	before := h.settled(t)
	web := rt(ctr, "web",
		map[string]any{"hostPort": 8080, "containerPort": 80, "protocol": "tcp"},
		map[string]any{"HostPort": 5353, "ContainerPort": 53, "Protocol": "udp"}, // containerd's spelling
	)
	ip, err := h.add(t, web)
	if err != nil {
		t.Fatalf("ADD: %v", err)
	}
	startEcho(t, ctr)
	for _, c := range []struct{ what, from, target string }{
		{"TCP from a client", "client", "tcp/198.18.130.1:8080"},
		{"UDP from a client", "client", "udp/198.18.130.1:5353"},
		{"TCP from the host itself (localhost)", "host", "tcp/127.0.0.1:8080"},
		{"UDP from the host itself (localhost)", "host", "udp/127.0.0.1:5353"},
		{"TCP from the host to its own address", "host", "tcp/198.18.130.1:8080"},
		{"TCP from the container itself (hairpin)", "ctr", "tcp/198.18.130.1:8080"},
		{"UDP from the container itself (hairpin)", "ctr", "udp/198.18.130.1:5353"},
	} {
		from := map[string]*netns.NS{"client": h.client, "host": h.ns, "ctr": ctr}[c.from]
		out, err := dial(from, c.target, 20*time.Second)
		if err != nil || out != "echo ping" {
			t.Fatalf("%s: %q %v\n%s", c.what, out, err, h.dump())
		}
	}
	if err := cnitest.InNS(h.ns, func(ctx context.Context) error { return h.cni.CheckNetworkList(ctx, h.list(t), web) }); err != nil {
		t.Fatalf("CHECK: %v", err)
	}
	// A second ADD for the taken host port names the holder.
	other := h.container(t)
	api := rt(other, "api", map[string]any{"hostPort": 8080, "containerPort": 80, "protocol": "tcp"})
	_, err = h.add(t, api)
	if err == nil || !strings.Contains(err.Error(), "port/"+h.network+"/web/eth0") || !strings.Contains(err.Error(), "host pmhost") || cnitest.CNICode(err) != 100 {
		t.Fatalf("second ADD of host port 8080: %v (code %d), want code 100 naming the holder", err, cnitest.CNICode(err))
	}
	// As a runtime does after a failed ADD: DEL, which must not touch
	// web's port.
	if err := h.del(t, api); err != nil {
		t.Fatalf("DEL after the failed ADD: %v", err)
	}
	if out, err := dial(h.client, "tcp/198.18.130.1:8080", 20*time.Second); err != nil || out != "echo ping" {
		t.Fatalf("web after api's DEL: %q %v", out, err)
	}
	if n := h.ruleCount(t); n <= before {
		t.Fatalf("rules: %d with the container, %d before", n, before)
	}
	// CHECK finds a forward removed behind the plugin's back.
	removeOneForward(t, h, ip)
	err = cnitest.InNS(h.ns, func(ctx context.Context) error { return h.cni.CheckNetworkList(ctx, h.list(t), web) })
	if cnitest.CNICode(err) != 104 {
		t.Fatalf("CHECK after a forward was deleted: %v (code %d), want 104", err, cnitest.CNICode(err))
	}
	// DEL with no portMappings in the runtime configuration.
	if err := h.del(t, rt(ctr, "web")); err != nil {
		t.Fatalf("DEL: %v", err)
	}
	if after := h.ruleCount(t); after != before {
		t.Fatalf("rules after DEL: %d, before ADD: %d\n%s", after, before, h.dump())
	}
	if out, err := dial(h.client, "tcp/198.18.130.1:8080", 2*time.Second); err == nil {
		t.Fatalf("port 8080 still answers after DEL: %q", out)
	}
	// The port is free again.
	if _, err := h.add(t, api); err != nil {
		t.Fatalf("8080 after DEL: %v", err)
	}
}

// removeOneForward deletes the TCP forward of container ip by hand.
func removeOneForward(t *testing.T, h *host, ip string) {
	if h.dataplane == "iptables" {
		out := h.ns.MustRun(t, "iptables", "-t", "nat", "-S", "RINGIPAM-PM-DNAT")
		for _, line := range strings.Split(out, "\n") {
			if strings.Contains(line, ip+":80") {
				args := append([]string{"iptables", "-t", "nat", "-D"}, strings.Fields(strings.ReplaceAll(strings.TrimPrefix(line, "-A "), `"`, ""))...)
				h.ns.MustRun(t, args...)
				return
			}
		}
		t.Fatalf("no forward to %s:80 in\n%s", ip, out)
	}
	h.ns.MustRun(t, "nft", "delete", "element", "inet", "ringipam-portmap", "any4", "{", "tcp", ".", "8080", "}")
}

func TestPublishedPortsReachTheContainer(t *testing.T) { publishEndToEnd(t, "") }

// The same through the iptables data path (as on a host without nft).
func TestPublishedPortsIPTables(t *testing.T) { publishEndToEnd(t, "iptables") }

// execPlugin runs the portmap-ingress binary inside the host namespace for
// a verb the libcni helpers do not cover as the test needs (GC without
// libcni's own DELs first).
func execPlugin(t *testing.T, h *host, verb string, conf map[string]any) error {
	ctx, cancel := context.WithTimeout(context.Background(), cnitest.OpTimeout)
	defer cancel()
	b, _ := json.Marshal(conf)
	cmd := exec.CommandContext(ctx, "ip", "netns", "exec", h.ns.Name, portmapBin)
	cmd.Env = []string{"CNI_COMMAND=" + verb, "CNI_CONTAINERID=gc", "CNI_IFNAME=eth0", "CNI_PATH=/nonexistent", "PATH=/usr/sbin:/usr/bin:/sbin:/bin"}
	cmd.Stdin = bytes.NewReader(b)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s: %v: %s", verb, err, out)
	}
	return nil
}

// GC (CNI 1.1) of the plugin itself: an attachment missing from the valid
// list loses its forwards and its ports; the listed one keeps them; a
// dynamic port asked for through CNI_ARGS PUBLISH (the way that survives
// runtimes dropping hostPort 0) and the pod annotation are published.
func TestGCAndDynamicPorts(t *testing.T) {
	h := newHost(t, "pmhost", localStore(t), "198.18.132.0/24")
	before := h.settled(t)
	keep, gone := h.container(t), h.container(t)
	rk := rt(keep, "keep")
	rk.Args = [][2]string{{"IgnoreUnknown", "1"}, {"PUBLISH", "80/tcp"}}
	if _, err := h.add(t, rk); err != nil {
		t.Fatal(err)
	}
	rg := rt(gone, "gone")
	rg.CapabilityArgs["io.kubernetes.cri.pod-annotations"] = map[string]string{portmapAnnotation: "80/tcp, 53/udp"}
	ipGone, err := h.add(t, rg)
	if err != nil {
		t.Fatal(err)
	}
	st := cnitest.OpenStore(t, h.store)
	a, _ := portalloc.New(st, "inspector")
	ctx := context.Background()
	e, ok, err := a.Lookup(ctx, portalloc.EndpointID{Network: h.network, ContainerID: "gone", IfName: "eth0"})
	if err != nil || !ok || len(e.Ports) != 2 || e.Ports[0].Number < portalloc.DefaultLo || e.Ports[1].Protocol != "udp" {
		t.Fatalf("gone's record: %+v %v %v", e, ok, err)
	}
	ek, ok, err := a.Lookup(ctx, portalloc.EndpointID{Network: h.network, ContainerID: "keep", IfName: "eth0"})
	if err != nil || !ok || len(ek.Ports) != 1 || ek.Ports[0].Number < portalloc.DefaultLo {
		t.Fatalf("keep's record: %+v %v %v", ek, ok, err)
	}
	st.Close() // the local store admits one process at a time
	startEcho(t, gone)
	if out, err := dial(h.client, fmt.Sprintf("tcp/198.18.130.1:%d", e.Ports[0].Number), 20*time.Second); err != nil || out != "echo ping" {
		t.Fatalf("dynamic port %d: %q %v\n%s", e.Ports[0].Number, out, err, h.dump())
	}
	conf := map[string]any{"cniVersion": "1.1.0", "name": h.network}
	for k, v := range h.portmapConf() {
		conf[k] = v
	}
	conf["cni.dev/valid-attachments"] = []map[string]string{{"containerID": "keep", "ifname": "eth0"}}
	if err := execPlugin(t, h, "GC", conf); err != nil {
		t.Fatal(err)
	}
	dump := h.dump()
	if strings.Contains(dump, ipGone) || strings.Contains(dump, "/gone/") || !strings.Contains(dump, "/keep/") {
		t.Fatalf("after GC:\n%s", dump)
	}
	st = cnitest.OpenStore(t, h.store)
	a, _ = portalloc.New(st, "inspector")
	if _, ok, _ := a.Lookup(ctx, portalloc.EndpointID{Network: h.network, ContainerID: "gone", IfName: "eth0"}); ok {
		t.Fatal("GC left gone's ports held")
	}
	if _, ok, _ := a.Lookup(ctx, portalloc.EndpointID{Network: h.network, ContainerID: "keep", IfName: "eth0"}); !ok {
		t.Fatal("GC released keep's ports")
	}
	st.Close()
	if err := h.del(t, rk); err != nil {
		t.Fatal(err)
	}
	if after := h.ruleCount(t); after != before {
		t.Fatalf("rules after DEL: %d, before: %d\n%s", after, before, h.dump())
	}
}

const portmapAnnotation = "ringipam.io/publish"

// Two hosts on one real etcd: an ingress port taken on A is refused on B,
// naming A's holder and host; dynamic ingress ports chosen 8 at a time on
// each host never collide, and each host forwards exactly its own.
func TestTwoHostsIngress(t *testing.T) {
	netns.RequireRoot(t)
	etcd := testenv.StartEtcd(t)
	target := strings.TrimPrefix(etcd.Endpoints()[0], "http://")
	prefix := "/" + netns.Unique("pm2-") + "/"
	network := netns.Unique("pm2-")
	hosts := map[string]*host{}
	for i, name := range []string{"hostA", "hostB"} {
		h := newHost(t, name, nil, fmt.Sprintf("198.18.%d.0/24", 140+i))
		h.network = network
		endpoints := []string{"http://" + h.ns.Relay(t, target)}
		// Each host's agent, beside its plugins in the host's namespace.
		agent := cnitest.StartAgent(t, cnitest.AgentOptions{Endpoints: endpoints, Prefix: prefix, Host: name, NS: h.ns})
		h.store = agent.Store(map[string]any{"type": "etcd", "endpoints": endpoints, "prefix": prefix})
		h.portmapExtra = map[string]any{"mode": "ingress"}
		hosts[name] = h
	}
	a, b := hosts["hostA"], hosts["hostB"]
	// Both hosts use one pool: different subnets would be two pools of one
	// network. The pool is ipam-ring's business; one subnet for both.
	b.subnet = a.subnet
	ctrA := a.container(t)
	if _, err := a.add(t, rt(ctrA, "a-web", map[string]any{"hostPort": 8443, "containerPort": 80})); err != nil {
		t.Fatalf("ingress 8443 on A: %v", err)
	}
	_, err := b.add(t, rt(b.container(t), "b-web", map[string]any{"hostPort": 8443, "containerPort": 80}))
	if cnitest.CNICode(err) != 100 || !strings.Contains(err.Error(), "port/"+network+"/a-web/eth0") || !strings.Contains(err.Error(), "hostA") {
		t.Fatalf("ingress 8443 on B: %v (code %d), want 100 naming a-web on hostA", err, cnitest.CNICode(err))
	}
	// A host-mode port on B is refused too: A's ingress port hides it.
	_, err = b.add(t, rt(b.container(t), "b-host", map[string]any{"hostPort": 8443, "containerPort": 80, "mode": "host"}))
	if cnitest.CNICode(err) != 100 {
		t.Fatalf("host 8443 on B under A's ingress 8443: %v", err)
	}

	const perHost, atOnce = 16, 8
	type got struct{ host, id string }
	var mu sync.Mutex
	var errs []error
	var wg sync.WaitGroup
	ids := map[string][]string{}
	for _, h := range []*host{a, b} {
		sem := make(chan struct{}, atOnce)
		for i := range perHost {
			ctr := h.container(t)
			id := fmt.Sprintf("%s-dyn%02d", h.name, i)
			ids[h.name] = append(ids[h.name], id)
			wg.Add(1)
			go func() {
				defer wg.Done()
				sem <- struct{}{}
				defer func() { <-sem }()
				if _, err := h.add(t, rt(ctr, id, map[string]any{"hostPort": 0, "containerPort": 80})); err != nil {
					mu.Lock()
					errs = append(errs, fmt.Errorf("ADD %s: %w", id, err))
					mu.Unlock()
				}
			}()
		}
	}
	wg.Wait()
	for _, err := range errs {
		t.Error(err)
	}
	if len(errs) > 0 {
		t.FailNow()
	}
	st := cnitest.OpenStore(t, map[string]any{"type": "etcd", "endpoints": etcd.Endpoints(), "prefix": prefix})
	alloc, _ := portalloc.New(st, "inspector")
	seen := map[uint16]string{}
	for _, h := range []*host{a, b} {
		dump := h.dump()
		for _, id := range ids[h.name] {
			e, ok, err := alloc.Lookup(context.Background(), portalloc.EndpointID{Network: network, ContainerID: id, IfName: "eth0"})
			if err != nil || !ok || len(e.Ports) != 1 || e.Host != h.name || e.Ports[0].Mode != portalloc.Ingress {
				t.Fatalf("%s: %+v %v %v", id, e, ok, err)
			}
			n := e.Ports[0].Number
			if other, dup := seen[n]; dup {
				t.Errorf("ingress port %d given to %s and %s", n, other, id)
			}
			seen[n] = id
			if !strings.Contains(dump, fmt.Sprintf("tcp . %d comment \"port/%s/%s/eth0\"", n, network, id)) {
				t.Errorf("%s does not forward %s's port %d:\n%s", h.name, id, n, dump)
			}
		}
	}
	if len(seen) != 2*perHost {
		t.Fatalf("%d distinct ports for %d containers", len(seen), 2*perHost)
	}
}
