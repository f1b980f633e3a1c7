//go:build integration

package k8s

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
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
// node A at every node's address. B and C leave at the end (stopped, their
// Nodes deleted).
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

	for _, p := range []string{hp.Name, in.Name} {
		if err := c.cs.CoreV1().Pods(testNS).Delete(ctx, p, metav1.DeleteOptions{}); err != nil {
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
