//go:build integration

// Package cri holds the end-to-end tests of the kubelet path: pods asked
// for over the CRI v1 API (as kubelet asks) from a private containerd
// (Debian's 1.6), whose CRI plugin runs the conflist with the reference
// bridge plugin, ipam-ring and portmap-ingress. Each "node" is a containerd
// in a network namespace and a mount namespace of its own (node_test.go);
// the pause image is a static binary the suite builds and imports
// (package integration/pause); the CRI client is the suite's own on
// k8s.io/cri-api (client_test.go). What the plugins see is what containerd
// really sends: K8S_POD_* in CNI_ARGS, DEL twice per pod (at stop with the
// netns, at remove without), a DEL right after a failed ADD, portMappings
// in Go field case, no "ips" capability.
//
// Under CI (the CI variable set) a missing containerd or privilege fails
// the suite instead of skipping it.
package cri

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/ringipam/ringipam/integration/cnitest"
	"github.com/ringipam/ringipam/integration/netns"
	"github.com/ringipam/ringipam/integration/pause"
	"github.com/ringipam/ringipam/internal/testenv"
	"github.com/ringipam/ringipam/pkg/pool"
)

var portmapBin, pauseArchive string

func TestMain(m *testing.M) {
	os.Exit(cnitest.Main(m, func(ctx context.Context, dir string) error {
		portmapBin = filepath.Join(dir, "portmap-ingress")
		if err := cnitest.Build(ctx, portmapBin, "./plugins/portmap-ingress"); err != nil {
			return err
		}
		var err error
		pauseArchive, err = pause.Build(ctx, dir)
		return err
	}))
}

// network describes the conflist a node runs: bridge with ipam-ring, then
// optionally portmap-ingress, then ipam-ring chained (for GC, as the
// README recommends).
type network struct {
	name    string
	bridge  string         // the bridge's name on the node
	subnet  string         // the pool's one range
	store   map[string]any // the plugins' store, unless etcd is set
	etcd    string         // the test's etcd ("host:port"), reached through a relay in the node
	prefix  string         // the etcd key prefix
	ipam    map[string]any // further ipam keys (reservationFromPod, ...)
	portmap bool
	version string // the conflist's cniVersion; default 1.0.0
}

// on returns, for startNode, net's configuration list on node host, as an
// operator would write it for containerd 1.6 (CNI 1.0.0: its libcni knows
// no 1.1.0).
func (net network) on(t *testing.T, host string) func(ns *netns.NS) map[string]any {
	return func(ns *netns.NS) map[string]any {
		st := net.store
		if net.etcd != "" {
			// The node's host agent, in the node's namespace beside its
			// plugins, reaching etcd through the same relay.
			endpoints := []string{"http://" + ns.Relay(t, net.etcd)}
			agent := cnitest.StartAgent(t, cnitest.AgentOptions{Endpoints: endpoints, Prefix: net.prefix, Host: host, NS: ns})
			st = agent.Store(map[string]any{"type": "etcd", "endpoints": endpoints, "prefix": net.prefix})
		}
		ipam := map[string]any{"type": "ipam-ring", "host": host, "store": st, "timeout": "50s",
			"ranges": [][]map[string]string{{{"subnet": net.subnet}}}, "routes": []map[string]string{{"dst": "0.0.0.0/0"}}}
		for k, v := range net.ipam {
			ipam[k] = v
		}
		plugins := []map[string]any{{"type": "bridge", "bridge": net.bridge, "isGateway": true, "ipMasq": false, "hairpinMode": true,
			"capabilities": map[string]bool{"io.kubernetes.cri.pod-annotations": true}, "ipam": ipam}}
		if net.portmap {
			plugins = append(plugins, map[string]any{"type": "portmap-ingress", "host": host, "store": st, "timeout": "50s",
				"capabilities": map[string]bool{"portMappings": true, "io.kubernetes.cri.pod-annotations": true}})
		}
		plugins = append(plugins, map[string]any{"type": "ipam-ring", "chained": true, "ipam": ipam})
		version := net.version
		if version == "" {
			version = "1.0.0"
		}
		return map[string]any{"cniVersion": version, "name": net.name, "plugins": plugins}
	}
}

func localStore(t *testing.T) map[string]any {
	return map[string]any{"type": "local", "path": filepath.Join(t.TempDir(), "ringipam.db")}
}

// checkPods checks that every pod has a distinct address in subnet, that
// the sandbox status shows it, and that it is on the pod's eth0 (inside its
// own network namespace).
func checkPods(t *testing.T, n *node, subnet string, pods []pod) {
	t.Helper()
	sub := netip.MustParsePrefix(subnet)
	seen := map[string]string{}
	for _, p := range pods {
		a, err := netip.ParseAddr(p.IP)
		if err != nil || !sub.Contains(a) {
			t.Errorf("pod %s/%s: address %q not in %s", p.Namespace, p.Name, p.IP, subnet)
			continue
		}
		if other, dup := seen[p.IP]; dup {
			t.Errorf("pods %s and %s/%s share %s", other, p.Namespace, p.Name, p.IP)
		}
		seen[p.IP] = p.Namespace + "/" + p.Name
		addrs, err := n.eth0(p)
		if err != nil {
			t.Error(err)
			continue
		}
		want := fmt.Sprintf("%s/%d", p.IP, sub.Bits())
		if !slices.Equal(addrs, []string{want}) {
			t.Errorf("pod %s/%s: eth0 has %v, want [%s]", p.Namespace, p.Name, addrs, want)
		}
	}
}

// held returns the addresses ipam-ring's owners hold on network in the
// store st describes (pool.List), by container ID.
func held(t *testing.T, st map[string]any, network string) map[string][]string {
	t.Helper()
	out := map[string][]string{}
	for id, al := range allocations(t, st, network) {
		for _, x := range al.Addrs {
			out[id] = append(out[id], x.Addr.String())
		}
	}
	return out
}

// Must-show 1: 20 pods, 4 at a time, on a /27 through containerd get
// distinct addresses, each on its eth0; stopping and removing them all
// leaves nothing held in the store; 20 more pods fit the same /27 (29
// usable addresses: a leak of 10 would show).
func TestPodsOnSmallPool(t *testing.T) {
	requireContainerd(t)
	net := network{name: netns.Unique("cri-"), bridge: "cri0", subnet: "198.18.60.0/27", store: localStore(t)}
	n := startNode(t, "node-a", net.on(t, "node-a"))
	for round := range 2 {
		var cfgs []*runtimeapi.PodSandboxConfig
		for i := range 20 {
			cfgs = append(cfgs, podConfig("default", fmt.Sprintf("web-%d-%d", round, i)))
		}
		pods := n.runMany(t, 4, cfgs)
		checkPods(t, n, net.subnet, pods)
		h := held(t, net.store, net.name)
		for _, p := range pods {
			if !slices.Equal(h[p.ID], []string{p.IP}) {
				t.Errorf("round %d: store holds %v for %s/%s (sandbox %s), containerd says %s", round, h[p.ID], p.Namespace, p.Name, p.ID, p.IP)
			}
		}
		if len(h) != len(pods) {
			t.Errorf("round %d: store holds %d owners for %d pods: %v", round, len(h), len(pods), h)
		}
		n.removeMany(t, 4, pods)
		if h := held(t, net.store, net.name); len(h) != 0 {
			t.Fatalf("round %d: after stop and remove the store still holds %v", round, h)
		}
	}
}

// podCalls returns the recorded calls for sandbox id: of ipam-ring
// delegated by bridge, and of portmap-ingress.
func podCalls(calls []pluginCall, id string) (ipam, portmap []pluginCall) {
	for _, c := range calls {
		switch {
		case c.ContainerID != id:
		case c.Delegated():
			ipam = append(ipam, c)
		case c.Plugin == "portmap-ingress":
			portmap = append(portmap, c)
		}
	}
	return ipam, portmap
}

// commands is the commands of calls with "+netns" or "-netns" and the
// CNI error code when it failed: "ADD+netns", "DEL-netns", "ADD+netns=100".
func commands(calls []pluginCall) []string {
	var out []string
	for _, c := range calls {
		s := c.Command + "+netns"
		if c.Netns == "" {
			s = c.Command + "-netns"
		}
		if c.RC != 0 {
			s += fmt.Sprintf("=%d", c.Code)
		}
		out = append(out, s)
	}
	return out
}

// Must-show 2: with reservationFromPod, a pod deleted and recreated with
// the same namespace/name gets its address back, while another pod asking
// for that address (annotation ringipam.io/ip) is refused naming the
// reservation; a second sandbox of the live pod is refused too, and the
// DEL containerd sends right after each refused ADD leaves the holder
// alone. The recorder shows what containerd sent.
func TestPodKeepsAddress(t *testing.T) {
	requireContainerd(t)
	net := network{name: netns.Unique("crr-"), bridge: "cri1", subnet: "198.18.61.0/27", store: localStore(t),
		ipam: map[string]any{"reservationFromPod": true}}
	n := startNode(t, "node-a", net.on(t, "node-a"))

	db, err := n.run(podConfig("db", "db-0"))
	if err != nil {
		t.Fatal(err)
	}
	checkPods(t, n, net.subnet, []pod{db})

	// The same pod again (a new UID, as a kubelet retry or a StatefulSet
	// racing its own deletion would make) while the first sandbox lives.
	_, err = n.run(podConfig("db", "db-0"))
	if err == nil || !strings.Contains(err.Error(), "already in use") || !strings.Contains(err.Error(), "db/db-0") {
		t.Fatalf("second sandbox of live db/db-0: %v, want already in use naming the reservation", err)
	}
	t.Logf("second sandbox of db/db-0 refused: %v", err)
	if h := held(t, net.store, net.name); len(h) != 1 || !slices.Equal(h[db.ID], []string{db.IP}) {
		t.Fatalf("after the refused sandbox the store holds %v, want %s for %s only", h, db.IP, db.ID)
	}
	checkPods(t, n, net.subnet, []pod{db})

	if err := n.remove(db); err != nil {
		t.Fatal(err)
	}
	if h := held(t, net.store, net.name); len(h) != 0 {
		t.Fatalf("after stop and remove the store holds %v", h)
	}

	// Another pod asking for db-0's address is refused while it is held.
	_, err = n.run(podConfigAnnotated("default", "thief", map[string]string{"ringipam.io/ip": db.IP}))
	if err == nil || !strings.Contains(err.Error(), db.IP+" in pool "+net.name+"-0 is held for reservation db/db-0") {
		t.Fatalf("pod asking for %s held for db/db-0: %v, want it refused naming the reservation", db.IP, err)
	}
	t.Logf("pod asking for the held address refused: %v", err)
	// A pod asking for a free address gets it; one asking for nothing gets
	// another than the held one.
	want := "198.18.61.20"
	fixed, err := n.run(podConfigAnnotated("default", "fixed", map[string]string{"ringipam.io/ip": want}))
	if err != nil || fixed.IP != want {
		t.Fatalf("pod asking for free %s: %+v, %v", want, fixed, err)
	}
	other, err := n.run(podConfig("default", "other"))
	if err != nil || other.IP == db.IP {
		t.Fatalf("pod asking for nothing: %+v, %v (db-0's held address is %s)", other, err, db.IP)
	}

	// The recreated pod gets its address back.
	again, err := n.run(podConfig("db", "db-0"))
	if err != nil {
		t.Fatal(err)
	}
	if again.IP != db.IP {
		t.Fatalf("recreated db/db-0 got %s, had %s", again.IP, db.IP)
	}
	checkPods(t, n, net.subnet, []pod{again, fixed, other})

	// What containerd sent: K8S_* in CNI_ARGS, no "ips" capability; for the
	// first db-0 an ADD, a DEL at stop with the netns and a DEL at remove
	// without; for every refused sandbox a DEL right after the failed ADD.
	calls := n.calls(t)
	ipam, _ := podCalls(calls, db.ID)
	if got := commands(ipam); !slices.Equal(got, []string{"ADD+netns", "DEL+netns", "DEL-netns"}) {
		t.Errorf("ipam-ring calls for db-0's first sandbox: %v, want ADD with netns, DEL with netns (stop), DEL without (remove)", got)
	}
	for _, c := range ipam {
		for _, kv := range []string{"K8S_POD_NAMESPACE=db", "K8S_POD_NAME=db-0", "IgnoreUnknown=1"} {
			if !slices.Contains(strings.Split(c.Args, ";"), kv) {
				t.Errorf("%s of db-0: CNI_ARGS %q lacks %s", c.Command, c.Args, kv)
			}
		}
		if _, ok := c.RuntimeConfig()["ips"]; ok {
			t.Errorf("%s of db-0: containerd sent an ips capability: %v", c.Command, c.RuntimeConfig())
		}
	}
	failed := 0
	for i, c := range calls {
		if !c.Delegated() || c.Command != "ADD" || c.RC == 0 {
			continue
		}
		failed++
		if c.Code != 100 {
			t.Errorf("failed ADD of %s: CNI code %d, want 100 (already in use)", c.ContainerID, c.Code)
		}
		var next []string
		for _, d := range calls[i+1:] {
			if d.ContainerID == c.ContainerID && d.Delegated() {
				next = append(next, d.Command)
			}
		}
		if len(next) == 0 || next[0] != "DEL" {
			t.Errorf("failed ADD of %s (code %d) was followed by %v, want a DEL", c.ContainerID, c.RC, next)
		}
	}
	if failed != 2 {
		t.Errorf("recorded %d failed ADDs, want 2 (second db-0 sandbox, thief)", failed)
	}
}

// clientOf makes a client namespace wired to node n by a veth pair
// (198.18.63.2 -> the node's 198.18.63.1) and returns it with the node's
// address.
func clientOf(t *testing.T, n *node) (*netns.NS, string) {
	t.Helper()
	c := netns.New(t, "cric")
	nv, cv := netns.Unique("criv"), netns.Unique("criv")
	if out, err := netns.Command("ip", "link", "add", nv, "netns", n.ns.Name, "type", "veth", "peer", "name", cv, "netns", c.Name); err != nil {
		t.Fatalf("veth: %v: %s", err, out)
	}
	n.ns.MustRun(t, "ip", "addr", "add", "198.18.63.1/24", "dev", nv)
	n.ns.MustRun(t, "ip", "link", "set", nv, "up")
	c.MustRun(t, "ip", "addr", "add", "198.18.63.2/24", "dev", cv)
	c.MustRun(t, "ip", "link", "set", cv, "up")
	return c, "198.18.63.1"
}

// ask connects from namespace from to addr and returns the line the pod's
// pause process answers ("pod <hostname>").
func ask(from *netns.NS, addr string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	c, err := from.DialContext(ctx, "tcp", addr)
	if err != nil {
		return "", err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(3 * time.Second))
	line, err := bufio.NewReader(c).ReadString('\n')
	return strings.TrimSpace(line), err
}

// askUntil is ask retried while the pod's server starts (the sandbox
// process may not listen yet when RunPodSandbox returns).
func askUntil(from *netns.NS, addr string) (string, error) {
	deadline := time.Now().Add(15 * time.Second)
	for {
		got, err := ask(from, addr)
		if err == nil || time.Now().After(deadline) {
			return got, err
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// Must-show 3: a pod's hostPort through portmap-ingress: a client
// namespace reaches the pod through the node's port; a rival pod asking for
// the same port is refused and the DEL after its failed ADD leaves the
// forward alone; after the pod's removal the port is free again, for the
// next pod. containerd sends the mappings in Go field case.
func TestHostPort(t *testing.T) {
	requireContainerd(t)
	net := network{name: netns.Unique("crp-"), bridge: "cri2", subnet: "198.18.62.0/27", store: localStore(t), portmap: true}
	n := startNode(t, "node-a", net.on(t, "node-a"))
	client, nodeAddr := clientOf(t, n)
	port := &runtimeapi.PortMapping{Protocol: runtimeapi.Protocol_TCP, ContainerPort: 80, HostPort: 38080}
	target := nodeAddr + ":38080"

	web, err := n.run(podConfig("default", "web", port))
	if err != nil {
		t.Fatal(err)
	}
	if got, err := askUntil(client, target); err != nil || got != "pod web" {
		t.Fatalf("client -> %s: %q, %v; want the answer of pod web", target, got, err)
	}

	_, err = n.run(podConfig("default", "rival", port))
	if err == nil || !strings.Contains(err.Error(), "38080") {
		t.Fatalf("rival pod on host port 38080: %v, want refused naming the port", err)
	}
	t.Logf("rival refused: %v", err)
	if got, err := ask(client, target); err != nil || got != "pod web" {
		t.Fatalf("after the rival's DEL, client -> %s: %q, %v; want pod web still", target, got, err)
	}
	if h := held(t, net.store, net.name); len(h) != 1 || !slices.Equal(h[web.ID], []string{web.IP}) {
		t.Errorf("after the rival the store holds %v, want web's %s only", h, web.IP)
	}

	if err := n.remove(web); err != nil {
		t.Fatal(err)
	}
	if got, err := ask(client, target); err == nil {
		t.Fatalf("after web's removal client -> %s still answered %q", target, got)
	}
	next, err := n.run(podConfig("default", "next", port))
	if err != nil {
		t.Fatalf("host port 38080 after web's removal: %v", err)
	}
	if got, err := askUntil(client, target); err != nil || got != "pod next" {
		t.Fatalf("client -> %s: %q, %v; want the answer of pod next", target, got, err)
	}

	// What portmap-ingress got from containerd: the mapping in Go field
	// case, at ADD; DEL at stop and at remove.
	_, pm := podCalls(n.calls(t), web.ID)
	if got := commands(pm); !slices.Equal(got, []string{"ADD+netns", "DEL+netns", "DEL-netns"}) {
		t.Errorf("portmap-ingress calls for web: %v", got)
	}
	if len(pm) > 0 {
		b, _ := json.Marshal(pm[0].RuntimeConfig()["portMappings"])
		if string(b) != `[{"ContainerPort":80,"HostIP":"","HostPort":38080,"Protocol":"tcp"}]` {
			t.Errorf("portMappings at ADD: %s", b)
		}
	}
	if err := n.remove(next); err != nil {
		t.Fatal(err)
	}
	if h := held(t, net.store, net.name); len(h) != 0 {
		t.Errorf("at the end the store holds %v", h)
	}
}

// Must-show 4: two nodes (two containerd instances, node names node-a and
// node-b) on one real etcd run pods at the same time on one /26: no two
// pods share an address, each address is on its pod's eth0, the store
// names the node of each, and after removal nothing is held. Two rounds,
// so the second allocates in a ring the first has split between the nodes.
func TestTwoNodesOneEtcd(t *testing.T) {
	requireContainerd(t)
	etcd := testenv.StartEtcd(t)
	net := network{name: netns.Unique("cr2-"), bridge: "cri3", subnet: "198.18.64.0/26",
		etcd: strings.TrimPrefix(etcd.Endpoints()[0], "http://"), prefix: "/" + netns.Unique("cr2-") + "/"}
	nodes := []*node{startNode(t, "node-a", net.on(t, "node-a")), startNode(t, "node-b", net.on(t, "node-b"))}
	direct := map[string]any{"type": "etcd", "endpoints": etcd.Endpoints(), "prefix": net.prefix}
	const perNode = 12
	for round := range 2 {
		pods := make([][]pod, len(nodes))
		errs := make([]error, len(nodes))
		var wg sync.WaitGroup
		for i, n := range nodes {
			var cfgs []*runtimeapi.PodSandboxConfig
			for j := range perNode {
				cfgs = append(cfgs, podConfig("default", fmt.Sprintf("%s-%d-%d", n.name, round, j)))
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				pods[i], errs[i] = n.runAll(4, cfgs)
			}()
		}
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			t.Fatal(err)
		}
		// Distinct across nodes, and each on its own pod's eth0.
		owner := map[string]string{}
		for i, n := range nodes {
			checkPods(t, n, net.subnet, pods[i])
			for _, p := range pods[i] {
				if other, dup := owner[p.IP]; dup {
					t.Errorf("round %d: %s and %s:%s share %s", round, other, n.name, p.Name, p.IP)
				}
				owner[p.IP] = n.name + ":" + p.Name
			}
		}
		allocs := allocations(t, direct, net.name)
		if len(allocs) != len(nodes)*perNode {
			t.Errorf("round %d: store holds %d owners, want %d", round, len(allocs), len(nodes)*perNode)
		}
		for i, n := range nodes {
			for _, p := range pods[i] {
				al, ok := allocs[p.ID]
				if !ok || al.Host != n.name || len(al.Addrs) != 1 || al.Addrs[0].Addr.String() != p.IP {
					t.Errorf("round %d: pod %s on %s (%s): store has %+v", round, p.Name, n.name, p.IP, al)
				}
			}
		}
		byNode := map[string][]string{}
		for _, al := range allocs {
			byNode[al.Host] = append(byNode[al.Host], al.Addrs[0].Addr.String())
		}
		for _, ips := range byNode {
			slices.SortFunc(ips, func(a, b string) int { return netip.MustParseAddr(a).Compare(netip.MustParseAddr(b)) })
		}
		t.Logf("round %d: %d pods, %d distinct addresses; by node: %v", round, len(allocs), len(owner), byNode)
		for i, n := range nodes {
			wg.Add(1)
			go func() {
				defer wg.Done()
				errs[i] = n.removeAll(4, pods[i])
			}()
		}
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			t.Fatal(err)
		}
		if allocs := allocations(t, direct, net.name); len(allocs) != 0 {
			t.Fatalf("round %d: after removal the store holds %v", round, allocs)
		}
	}
}

// allocations returns ipam-ring's allocations on network in the store st
// describes, by container ID.
func allocations(t *testing.T, st map[string]any, network string) map[string]pool.Allocation {
	t.Helper()
	out := map[string]pool.Allocation{}
	cnitest.Inspect(t, st, "inspector", func(a *pool.Allocator) {
		allocs, err := a.List(context.Background(), pool.Filter{Kind: pool.KindCNI, Network: network})
		if err != nil {
			t.Fatal(err)
		}
		for _, al := range allocs {
			out[al.Owner.ContainerID] = al
		}
	})
	return out
}

// A conflist at CNI 1.1.0 fails every pod on containerd 1.6 (its libcni
// cannot read a 1.1.0 result) after ipam-ring has allocated: the DEL that
// follows the failed ADD must release it, or each kubelet retry would leak
// an address.
func TestUnsupportedVersionLeaksNothing(t *testing.T) {
	requireContainerd(t)
	net := network{name: netns.Unique("crv-"), bridge: "cri4", subnet: "198.18.65.0/28", store: localStore(t), version: "1.1.0"}
	n := startNode(t, "node-a", net.on(t, "node-a"))
	for i := range 3 {
		_, err := n.run(podConfig("default", fmt.Sprintf("web-%d", i)))
		if err == nil || !strings.Contains(err.Error(), `unsupported CNI result version "1.1.0"`) {
			t.Fatalf("pod on a 1.1.0 conflist: %v, want containerd's unsupported result version", err)
		}
	}
	if h := held(t, net.store, net.name); len(h) != 0 {
		t.Fatalf("after 3 failed pods the store holds %v", h)
	}
	var delegated []pluginCall
	for _, c := range n.calls(t) {
		if c.Delegated() {
			delegated = append(delegated, c)
		}
	}
	got := commands(delegated)
	if want := slices.Repeat([]string{"ADD+netns", "DEL+netns"}, 3); !slices.Equal(got, want) {
		t.Errorf("ipam-ring calls %v, want %v: each ADD succeeded (an address was allocated) and a DEL followed", got, want)
	}
}
