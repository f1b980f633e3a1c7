//go:build integration

package k8s

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ringipam/ringipam/integration/netns"
)

// The flat network's two more nodes, on the LAN beside node A.
const (
	nodeBName = "lan-b"
	nodeBIP   = "198.18.255.3"
	nodeCName = "lan-c"
	nodeCIP   = "198.18.255.4"
	// ingressPort is the port the ingress pod on node C publishes on every
	// node (ringipam.io/publish: "80/tcp:<port>=ingress").
	ingressPort = 39190
)

// flatTimeout bounds each wait for a connection to succeed: the agents'
// routes and forwards follow the ring through their etcd watches.
const flatTimeout = 2 * time.Minute

// testFlatNetwork: two more nodes, B and C, join node A's LAN (each its
// network and mount namespace, containerd, kubelet); the DaemonSet runs
// on all three (the shipped manifest: ringipamd --routes). A Deployment of
// 3 with a required pod anti-affinity on the node's hostname puts one pod
// on each node; every pod reaches every other by pod IP (TCP to the pause
// image's port 80, and ping), and the node of the pod reached keeps the
// connection under the client pod's address (its conntrack entry: no
// masquerade between pods). A pod on node C with hostPort 38080 answers a
// pod on node A at node C's address; a pod on node C publishing port 80
// in ingress mode (the annotation ringipam.io/publish) answers a pod on
// node A at every node's address. Then node C goes as a machine that
// loses power (NodeGone). B leaves at the end (stopped, its Node deleted).
func testFlatNetwork(t *testing.T, c *cluster) {
	ctx := context.Background()
	// The DaemonSet's image as it runs now (a rolling update may have
	// moved it): exported from node A's containerd for B and C.
	ds, err := c.cs.AppsV1().DaemonSets(installNS).Get(ctx, "ringipam", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	image := ds.Spec.Template.Spec.Containers[0].Image
	archive := filepath.Join(c.dir, "agent-image.tar")
	if out, err := c.ctr(t, "images", "export", archive, image); err != nil {
		t.Fatalf("ctr images export %s: %v: %s", image, err, out)
	}
	start := time.Now()
	nb := c.addNode(t, nodeBName, nodeBIP, archive)
	nc := c.addNode(t, nodeCName, nodeCIP, archive)
	os.Remove(archive)
	nodes := []*kubeNode{c.kubeNode, nb, nc}
	for _, n := range nodes[1:] {
		c.waitNodeReady(t, n.name)
	}
	if err := c.poll(installTimeout, func(ctx context.Context) (bool, error) {
		ds, err = c.cs.AppsV1().DaemonSets(installNS).Get(ctx, "ringipam", metav1.GetOptions{})
		return err == nil && ds.Status.DesiredNumberScheduled == 3 && ds.Status.NumberReady == 3, nil
	}); err != nil {
		t.Fatalf("DaemonSet not ready on 3 nodes: %v; status %+v", err, ds.Status)
	}
	t.Logf("nodes %s and %s joined, the DaemonSet ready on 3 nodes in %v", nb.name, nc.name, time.Since(start).Round(100*time.Millisecond))

	// One pod of the Deployment on each node.
	spec := podSpec()
	spec.Affinity = &corev1.Affinity{PodAntiAffinity: &corev1.PodAntiAffinity{
		RequiredDuringSchedulingIgnoredDuringExecution: []corev1.PodAffinityTerm{{
			LabelSelector: &metav1.LabelSelector{MatchLabels: labels("flat")},
			TopologyKey:   corev1.LabelHostname,
		}},
	}}
	d := &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: "flat", Namespace: testNS},
		Spec: appsv1.DeploymentSpec{
			Replicas: int32p(3),
			Selector: &metav1.LabelSelector{MatchLabels: labels("flat")},
			Template: corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: labels("flat")}, Spec: spec},
		},
	}
	if _, err := c.cs.AppsV1().Deployments(testNS).Create(ctx, d, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pods := c.waitPods(t, "flat", 3)
	byNode := map[string]corev1.Pod{}
	for _, p := range pods {
		byNode[p.Spec.NodeName] = p
	}
	for _, n := range nodes {
		if _, ok := byNode[n.name]; !ok {
			t.Fatalf("no pod of the Deployment on %s: %v", n.name, byNode)
		}
	}
	nodeOf := map[string]*kubeNode{}
	for _, n := range nodes {
		nodeOf[n.name] = n
	}
	for _, from := range nodes {
		src := byNode[from.name]
		srcNS := from.podNetNS(t, src)
		for _, to := range nodes {
			if to == from {
				continue
			}
			dst := byNode[to.name]
			what := fmt.Sprintf("pod %s on %s (%s) to reach pod %s on %s at %s", src.Name, from.name, src.Status.PodIP, dst.Name, to.name, dst.Status.PodIP)
			c.waitGet(t, srcNS, net.JoinHostPort(dst.Status.PodIP, "80"), "pod "+dst.Name, what, from, to)
			if out, err := exec.Command("nsenter", "--net="+srcNS.Path, "ping", "-c", "1", "-W", "2", dst.Status.PodIP).CombinedOutput(); err != nil {
				t.Errorf("%s by ping: %v: %s", what, err, out)
			}
			// The node reached saw the client pod's own address.
			out, err := to.node.Run("conntrack", "-L", "-p", "tcp", "--orig-src", src.Status.PodIP, "--orig-dst", dst.Status.PodIP, "--dport", "80")
			if err != nil || !strings.Contains(out, "src="+src.Status.PodIP) {
				t.Errorf("%s: no connection from %s in %s's conntrack (masqueraded?): %v: %s", what, src.Status.PodIP, to.name, err, out)
			}
		}
	}
	t.Logf("3 pods on 3 nodes reach each other by pod IP: %s", podsByNode(byNode, nodes))

	// A hostPort and an ingress port of pods on node C, from the pod on
	// node A.
	hp := hostPortPod("flat-hp")
	hp.Labels = labels("flat-ports")
	hp.Spec.NodeName = nc.name
	in := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "flat-ingress", Namespace: testNS, Labels: labels("flat-ports"),
		Annotations: map[string]string{"ringipam.io/publish": fmt.Sprintf("80/tcp:%d=ingress", ingressPort)}}, Spec: podSpec()}
	in.Spec.NodeName = nc.name
	for _, p := range []*corev1.Pod{hp, in} {
		if _, err := c.cs.CoreV1().Pods(testNS).Create(ctx, p, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	c.waitPods(t, "flat-ports", 2)
	aNS := c.kubeNode.podNetNS(t, byNode[c.name])
	c.waitGet(t, aNS, net.JoinHostPort(nc.ip, strconv.Itoa(hostPort)), "pod flat-hp",
		fmt.Sprintf("the pod on %s to reach hostPort %d of %s at %s", c.name, hostPort, nc.name, nc.ip), c.kubeNode, nc)
	for _, via := range nodes {
		c.waitGet(t, aNS, net.JoinHostPort(via.ip, strconv.Itoa(ingressPort)), "pod flat-ingress",
			fmt.Sprintf("the pod on %s to reach ingress port %d of a pod on %s through %s's address %s", c.name, ingressPort, nc.name, via.name, via.ip), c.kubeNode, via)
	}
	t.Logf("from %s: hostPort %d of %s at %s, ingress port %d of %s at %s, %s and %s", c.name, hostPort, nc.name, nc.ip, ingressPort, nc.name, c.ip, nb.ip, nc.ip)

	// Node C goes, with its three pods' addresses and its two ports.
	cPods := []corev1.Pod{byNode[nc.name]}
	for _, name := range []string{hp.Name, in.Name} {
		p, err := c.cs.CoreV1().Pods(testNS).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		cPods = append(cPods, *p)
	}
	if !t.Run("NodeGone", func(t *testing.T) { testNodeGone(t, c, nc, []*kubeNode{c.kubeNode, nb}, cPods) }) {
		t.FailNow()
	}

	for _, p := range []string{hp.Name, in.Name} {
		if err := c.cs.CoreV1().Pods(testNS).Delete(ctx, p, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			t.Fatal(err)
		}
	}
	if err := c.cs.AppsV1().Deployments(testNS).Delete(ctx, "flat", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	c.waitPods(t, "flat", 0)
	c.waitPods(t, "flat-ports", 0)
	c.checkNothingLeft(t, "the flat network's pods gone")
	if ports := strings.TrimSpace(string(c.ringctl(t, "ports"))); strings.Contains(ports, strconv.Itoa(ingressPort)) || strings.Contains(ports, strconv.Itoa(hostPort)) {
		t.Errorf("ports still published after their pods are gone:\n%s", ports)
	}
}

func podsByNode(byNode map[string]corev1.Pod, nodes []*kubeNode) string {
	var s []string
	for _, n := range nodes {
		s = append(s, n.name+": "+byNode[n.name].Status.PodIP)
	}
	return strings.Join(s, ", ")
}

// waitNodeReady waits until the Node name is Ready and without the
// not-ready taint (its CNI list installed by the DaemonSet).
func (c *cluster) waitNodeReady(t *testing.T, name string) {
	t.Helper()
	if err := c.poll(installTimeout, func(ctx context.Context) (bool, error) {
		n, err := c.cs.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		ready := false
		for _, cond := range n.Status.Conditions {
			if cond.Type == corev1.NodeReady && cond.Status == corev1.ConditionTrue {
				ready = true
			}
		}
		for _, taint := range n.Spec.Taints {
			if taint.Key == corev1.TaintNodeNotReady {
				ready = false
			}
		}
		return ready, nil
	}); err != nil {
		t.Fatalf("node %s not Ready: %v", name, err)
	}
}

// podNetNS is the network namespace of pod p on n, through one of its
// processes (the pod's cgroup under n's cgroup root).
func (n *kubeNode) podNetNS(t *testing.T, p corev1.Pod) *netns.NS {
	t.Helper()
	want := "pod" + string(p.UID)
	for _, d := range n.cgroupDirs() {
		if !strings.Contains(d, "/"+want+"/") {
			continue
		}
		b, _ := os.ReadFile(filepath.Join(d, "cgroup.procs"))
		if f := strings.Fields(string(b)); len(f) > 0 {
			return &netns.NS{Name: "pod " + p.Name, Path: "/proc/" + f[0] + "/ns/net"}
		}
	}
	t.Fatalf("no process of pod %s (%s) under %s's cgroup root", p.Name, want, n.name)
	return nil
}

// waitGet waits until a connection from ns to addr answers want (the
// pause image's first line); on the deadline it fails with the routing
// state and nftables rules of the nodes involved.
func (c *cluster) waitGet(t *testing.T, ns *netns.NS, addr, want, what string, nodes ...*kubeNode) {
	t.Helper()
	var got string
	var gerr error
	err := c.poll(flatTimeout, func(context.Context) (bool, error) {
		got, gerr = getFrom(ns, addr)
		return gerr == nil && got == want, nil
	})
	if err != nil {
		var state strings.Builder
		for _, n := range nodes {
			fmt.Fprintf(&state, "--- %s\n%s", n.name, n.node.RoutingState(t))
			out, _ := n.node.Run("nft", "list", "ruleset")
			state.WriteString(out)
		}
		t.Fatalf("%s: want %q: %v; last answer %q, %v\n%s", what, want, err, got, gerr, state.String())
	}
}

// getFrom connects to addr from ns and returns the first line answered.
func getFrom(ns *netns.NS, addr string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	conn, err := ns.DialContext(ctx, "tcp", addr)
	if err != nil {
		return "", err
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(3 * time.Second))
	line, err := bufio.NewReader(conn).ReadString('\n')
	return strings.TrimSpace(line), err
}

// portRow is one published port of `ringctl --json ports`.
type portRow struct {
	Mode string `json:"mode"`
	Port uint16 `json:"port"`
	Host string `json:"host"`
}

// portsOf lists the ports published on host (host ports bound there,
// ingress ports it serves).
func (c *cluster) portsOf(t *testing.T, host string) []portRow {
	t.Helper()
	var rows, out []portRow
	b := c.ringctl(t, "--json", "ports")
	if err := json.Unmarshal(b, &rows); err != nil {
		t.Fatalf("ringctl --json ports: %v\n%s", err, b)
	}
	for _, r := range rows {
		if r.Host == host {
			out = append(out, r)
		}
	}
	return out
}

// routesVia lists the routes of n's routing table of the agent's
// (--routes, routesTable) whose gateway is via.
func (n *kubeNode) routesVia(t *testing.T, via string) []string {
	t.Helper()
	out, err := n.node.Run("ip", "-4", "route", "show", "table", strconv.Itoa(routesTable))
	if err != nil {
		t.Fatalf("ip route show table %d on %s: %v: %s", routesTable, n.name, err, out)
	}
	var rs []string
	for _, l := range strings.Split(out, "\n") {
		if strings.Contains(l, " via "+via+" ") {
			rs = append(rs, strings.TrimSpace(l))
		}
	}
	return rs
}

// routesTable is the agent's routing table (ringipamd --routes-table's
// default, which the manifest keeps).
const routesTable = 4212

// nodeGoneState is what the store and the other nodes hold of a node.
type nodeGoneState struct {
	host   hostStatus
	owners []addrRow
	ports  []portRow
	routes map[string][]string // by the other node's name: its routes via the node
}

func (c *cluster) stateOf(t *testing.T, n *kubeNode, others []*kubeNode) nodeGoneState {
	t.Helper()
	h, ok := c.hostState(t, n.name)
	if !ok {
		t.Fatalf("ringctl status does not list host %s", n.name)
	}
	s := nodeGoneState{host: h, owners: c.ownedBy(t, n.name), ports: c.portsOf(t, n.name), routes: map[string][]string{}}
	for _, o := range others {
		s.routes[o.name] = o.routesVia(t, n.ip)
	}
	return s
}

// testNodeGone: node C (a kubelet node with three pods: one of the flat
// Deployment, the hostPort pod, the ingress pod) stops as a machine that
// loses power (kubelet, its pods, the agent's pod with them, containerd:
// no DEL is sent). While its Node exists it keeps everything (its host
// down in the store once the agent's lease expires, a node NotReady
// until orphanAfter): its ranges, its three owners, its two ports, the
// other nodes' routes to its ranges. Its Node is deleted: the leader
// reclaims its host at once, without the orphanAfter wait: its ranges
// tombstoned (ringctl status: orphaned, no range), its owners and ports
// released, the other nodes' routes via its address gone.
func testNodeGone(t *testing.T, c *cluster, gone *kubeNode, others []*kubeNode, pods []corev1.Pod) {
	ctx := context.Background()
	before := c.stateOf(t, gone, others)
	// Positive controls: what must go is there first.
	held := map[string]bool{}
	for _, r := range before.owners {
		held[r.Addr.String()] = true
	}
	for _, p := range pods {
		if !held[p.Status.PodIP] {
			t.Fatalf("pod %s's address %s not an owner on host %s: %+v", p.Name, p.Status.PodIP, gone.name, before.owners)
		}
	}
	published := map[uint16]string{}
	for _, p := range before.ports {
		published[p.Port] = p.Mode
	}
	if published[hostPort] != "host" || published[ingressPort] != "ingress" {
		t.Fatalf("%s publishes %+v; want host port %d and ingress port %d", gone.name, before.ports, hostPort, ingressPort)
	}
	if before.host.State != "up" || before.host.Ranges == 0 {
		t.Fatalf("host %s before: %+v; want up with ranges", gone.name, before.host)
	}
	for _, o := range others {
		if len(before.routes[o.name]) == 0 {
			t.Fatalf("%s has no route via %s's address %s in table %d", o.name, gone.name, gone.ip, routesTable)
		}
	}
	t.Logf("%s before: %d ranges, owners %d, ports %+v, routes via %s: %v", gone.name, before.host.Ranges, len(before.owners), before.ports, gone.ip, before.routes)

	// Power lost: its agent's liveness lease expires, its host is down.
	gone.teardown(t)
	if err := c.poll(reclaimTimeout, func(context.Context) (bool, error) {
		h, _ := c.hostState(t, gone.name)
		return h.State != "up", nil
	}); err != nil {
		t.Fatalf("host %s still up after its node stopped: %v", gone.name, err)
	}
	down := c.stateOf(t, gone, others)
	if down.host.Ranges != before.host.Ranges || !down.host.OrphanedAt.IsZero() || len(down.owners) != len(before.owners) || len(down.ports) != len(before.ports) {
		t.Errorf("%s down, its Node still there: %+v, %d owners, ports %+v; want everything kept: %+v, %d owners, ports %+v",
			gone.name, down.host, len(down.owners), down.ports, before.host, len(before.owners), before.ports)
	}
	for _, o := range others {
		if !slices.Equal(down.routes[o.name], before.routes[o.name]) {
			t.Errorf("%s's routes via %s changed while it is only down: %v, were %v", o.name, gone.ip, down.routes[o.name], before.routes[o.name])
		}
	}
	t.Logf("%s down (%s), its Node there: everything kept", gone.name, down.host.State)

	// Its Node deleted: reclaimed at once.
	start := time.Now()
	c.deleteNode(t, gone.name)
	var after nodeGoneState
	if err := c.poll(reclaimTimeout, func(context.Context) (bool, error) {
		after = c.stateOf(t, gone, others)
		for _, rs := range after.routes {
			if len(rs) > 0 {
				return false, nil
			}
		}
		return !after.host.OrphanedAt.IsZero() && after.host.Ranges == 0 && len(after.owners) == 0 && len(after.ports) == 0, nil
	}); err != nil {
		t.Fatalf("%s not reclaimed after its Node's deletion: %v; status %+v, owners %+v, ports %+v, routes via %s %v\n%s",
			gone.name, err, after.host, after.owners, after.ports, gone.ip, after.routes, lastLines(others[0].agentLog(), 30))
	}
	logged := false
	for _, o := range others {
		log := o.agentLog()
		logged = logged || strings.Contains(log, "reclaimed the host of a deleted Node") && strings.Contains(log, "node="+gone.name)
	}
	if !logged {
		t.Errorf("no agent logged the reclaim of %s:\n%s", gone.name, lastLines(others[0].agentLog(), 30))
	}
	t.Logf("%s reclaimed %v after its Node's deletion: state %s, orphaned at %s, no range, owner, port or route left",
		gone.name, time.Since(start).Round(100*time.Millisecond), after.host.State, after.host.OrphanedAt.UTC().Format(time.TimeOnly))

	// Its pods' objects: deleted at once (no kubelet confirms them).
	c.deletePodsOf(ctx, t, gone.name)
}
