//go:build integration

package k8s

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ringipam/ringipam/integration/netns"
	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/portalloc"
	"github.com/ringipam/ringipam/pkg/store/etcd"
	"github.com/ringipam/ringipam/pkg/storeconfig"
)

// vanishedGrace is the agent's --vanished-grace in the suite (5m shipped).
const vanishedGrace = 15 * time.Second

// reclaimTimeout bounds the waits for what the agents do on their own.
const reclaimTimeout = 3 * time.Minute

// agentBin is ringipamd built from this checkout (the second host of
// NodeDeleted runs it outside the cluster).
var agentBin string

// agentLog is the DaemonSet's agents' logs on the node, as kubelet keeps them (every
// pod the DaemonSet had).
func (c *kubeNode) agentLog() string {
	files, _ := filepath.Glob(filepath.Join(c.hostDir("/var/log/pods"), installNS+"_*", "ringipamd", "*.log"))
	var b strings.Builder
	for _, f := range files {
		if s, err := os.ReadFile(f); err == nil {
			b.Write(s)
		}
	}
	return b.String()
}

// metric reads the node's agent's counter name from its /metrics (its
// loopback listener, in the node's network namespace).
func (c *cluster) metric(t *testing.T, name string) float64 {
	t.Helper()
	cl := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DialContext: c.node.DialContext}}
	resp, err := cl.Get("http://127.0.0.1:9476/metrics")
	if err != nil {
		t.Fatalf("agent /metrics: %v", err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	sc := bufio.NewScanner(strings.NewReader(string(b)))
	for sc.Scan() {
		if f := strings.Fields(sc.Text()); len(f) == 2 && f[0] == name {
			v, err := strconv.ParseFloat(f[1], 64)
			if err != nil {
				t.Fatalf("metric %s: %v", name, err)
			}
			return v
		}
	}
	t.Fatalf("metric %s not served by the agent", name)
	return 0
}

// hostStatus is one host of `ringctl --json status`.
type hostStatus struct {
	Name       string    `json:"name"`
	State      string    `json:"state"`
	OrphanedAt time.Time `json:"orphanedAt"`
	Ranges     int       `json:"ranges"`
	Used       uint64    `json:"used"`
	KubeNode   bool      `json:"kubeNode"`
}

func (c *cluster) hostState(t *testing.T, name string) (hostStatus, bool) {
	t.Helper()
	var s struct {
		Hosts []hostStatus `json:"hosts"`
	}
	out := c.ringctl(t, "--json", "status")
	if err := json.Unmarshal(out, &s); err != nil {
		t.Fatalf("ringctl --json status: %v\n%s", err, out)
	}
	for _, h := range s.Hosts {
		if h.Name == name {
			return h, true
		}
	}
	return hostStatus{}, false
}

// storeAs opens the suite's etcd as host (the test allocating for a host
// whose pods are stand-ins: the second host has no kubelet).
func (c *cluster) storeAs(t *testing.T, host string) (*pool.Allocator, *portalloc.Allocator) {
	t.Helper()
	st, err := etcd.Open(storeconfig.Config{Type: storeconfig.TypeEtcd, Endpoints: c.etcd.Endpoints(), Prefix: "/ringipam/",
		TLS: &storeconfig.TLS{CA: c.etcdTLS.CA, Cert: c.etcdTLS.Cert, Key: c.etcdTLS.Key}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	a, err := pool.New(st, host)
	if err != nil {
		t.Fatal(err)
	}
	p, err := portalloc.New(st, host)
	if err != nil {
		t.Fatal(err)
	}
	return a, p
}

// startAgentB runs ringipamd for host name outside the cluster (in the
// node's network namespace): it holds the host's liveness and marks it a
// Kubernetes node, and neither leads nor forwards. Its apiserver account
// is the DaemonSet's (a token of the manifest's ServiceAccount).
func (c *cluster) startAgentB(t *testing.T, name string) *proc {
	t.Helper()
	d := filepath.Join(c.dir, name)
	os.MkdirAll(d, 0o755)
	p := c.spawn(t, "ringipamd-"+name, "nsenter", "--net="+c.node.Path, "--", agentBin,
		"--host="+name, "--store=etcd", "--etcd-endpoints="+c.etcdInNode, "--etcd-prefix=/ringipam/",
		"--etcd-ca="+c.etcdTLS.CA, "--etcd-cert="+c.etcdTLS.Cert, "--etcd-key="+c.etcdTLS.Key,
		"--agent-socket="+filepath.Join(d, "a.sock"), "--del-queue="+filepath.Join(d, "delq"),
		"--listen=off", "--ingress=false", "--sweep=false", "--heartbeat=2s",
		"--kube-reclaim-nodes", "--kubeconfig="+c.agentKubeconfig(t))
	t.Cleanup(func() { p.Stop(stopTimeout) })
	if err := c.poll(reclaimTimeout, func(context.Context) (bool, error) {
		if err := p.ExitErr(); err != nil {
			return false, err
		}
		h, ok := c.hostState(t, name)
		return ok && h.State == "up" && h.KubeNode, nil
	}); err != nil {
		t.Fatalf("host %s not up and marked a Kubernetes node: %v\n%s", name, err, p.Tail(30))
	}
	return p
}

func (c *cluster) createNode(t *testing.T, name string) {
	t.Helper()
	n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}}
	if _, err := c.cs.CoreV1().Nodes().Create(context.Background(), n, metav1.CreateOptions{}); err != nil {
		t.Fatalf("creating Node %s: %v", name, err)
	}
}

func (c *cluster) deleteNode(t *testing.T, name string) {
	t.Helper()
	if err := c.cs.CoreV1().Nodes().Delete(context.Background(), name, metav1.DeleteOptions{}); err != nil {
		t.Fatalf("deleting Node %s: %v", name, err)
	}
}

// ownedBy lists the pool's owners on host.
func (c *cluster) ownedBy(t *testing.T, host string) []addrRow {
	owned, _ := c.ls(t)
	var out []addrRow
	for _, r := range owned {
		if r.Host == host {
			out = append(out, r)
		}
	}
	return out
}

// testNodeDeleted: a second host, node-b, is a Kubernetes node (its Node
// object, its agent marking it) with two pods' addresses and a published
// ingress port (allocated by the test as node-b: it has no kubelet). Its
// Node is deleted while its agent runs: the leader (node-a's agent) waits
// and node-b keeps everything. Its agent stops: the leader reclaims it at
// once (no orphanAfter wait): no owner and no port of node-b is left, its
// ranges are tombstoned, ringctl status shows it orphaned. It rejoins
// under the same name: its Node and agent back, it allocates again from
// fresh space.
func testNodeDeleted(t *testing.T, c *cluster) {
	ctx := context.Background()
	const b = "node-b"
	c.createNode(t, b)
	agent := c.startAgentB(t, b)
	alloc, ports := c.storeAs(t, b)
	for i := range 2 {
		owner := pool.Owner{Kind: pool.KindCNI, Network: "k8s-pod-network", ContainerID: fmt.Sprintf("sandbox-b%d", i), IfName: "eth0"}
		got, err := alloc.Allocate(ctx, pool.Request{Owner: owner, Wants: []pool.Want{{Pool: poolName, Role: pool.RoleIP}},
			Pod: &pool.PodRef{Namespace: testNS, Name: fmt.Sprintf("pod-b%d", i), UID: fmt.Sprintf("uid-b%d", i)}})
		if err != nil {
			t.Fatalf("allocating for %s on %s: %v", owner, b, err)
		}
		t.Logf("%s holds %v on %s", owner, got.Addrs, b)
	}
	const ingressPort = 39090
	id := portalloc.EndpointID{Network: "k8s-pod-network", ContainerID: "sandbox-b0", IfName: "eth0"}
	if _, err := ports.Allocate(ctx, id, []portalloc.Port{{Mode: portalloc.Ingress, Name: "80/tcp", Protocol: "tcp", Number: ingressPort}}); err != nil {
		t.Fatalf("publishing %d on %s: %v", ingressPort, b, err)
	}
	if got := c.ownedBy(t, b); len(got) != 2 {
		t.Fatalf("%s's owners before: %+v, want 2", b, got)
	}
	if p := string(c.ringctl(t, "ports")); !strings.Contains(p, strconv.Itoa(ingressPort)) {
		t.Fatalf("port %d of %s not listed by ringctl ports:\n%s", ingressPort, b, p)
	}

	// The Node goes while its agent still holds its liveness key: the
	// leader waits, nothing of node-b is touched.
	c.deleteNode(t, b)
	if err := c.poll(reclaimTimeout, func(context.Context) (bool, error) {
		return strings.Contains(c.agentLog(), "waiting for the key to go before reclaiming it") && strings.Contains(c.agentLog(), "node="+b), nil
	}); err != nil {
		t.Fatalf("the leader did not say it waits for %s's liveness key: %v\n%s", b, err, lastLines(c.agentLog(), 30))
	}
	if got := c.ownedBy(t, b); len(got) != 2 {
		t.Fatalf("%s reclaimed while its agent held its liveness key: owners %+v", b, got)
	}

	// Its agent stops (its lease revoked): reclaimed at once.
	if !agent.Stop(stopTimeout) {
		t.Errorf("%s's agent ignored SIGTERM", b)
	}
	if err := c.poll(reclaimTimeout, func(context.Context) (bool, error) {
		h, ok := c.hostState(t, b)
		return ok && !h.OrphanedAt.IsZero() && h.Ranges == 0 && len(c.ownedBy(t, b)) == 0, nil
	}); err != nil {
		h, _ := c.hostState(t, b)
		t.Fatalf("%s not reclaimed after its Node and agent went: %v; status %+v, owners %+v\n%s", b, err, h, c.ownedBy(t, b), lastLines(c.agentLog(), 30))
	}
	if p := string(c.ringctl(t, "ports")); strings.Contains(p, strconv.Itoa(ingressPort)) {
		t.Errorf("port %d of the reclaimed %s still published:\n%s", ingressPort, b, p)
	}
	if log := c.agentLog(); !strings.Contains(log, "reclaimed the host of a deleted Node") {
		t.Errorf("the leader did not log the reclaim:\n%s", lastLines(log, 30))
	}
	h, _ := c.hostState(t, b)
	t.Logf("%s reclaimed on its Node's deletion: state %s, orphaned at %s, %d ranges", b, h.State, h.OrphanedAt.UTC().Format(time.TimeOnly), h.Ranges)

	// It rejoins under the same name: fresh space.
	c.createNode(t, b)
	agent = c.startAgentB(t, b)
	alloc, _ = c.storeAs(t, b)
	owner := pool.Owner{Kind: pool.KindCNI, Network: "k8s-pod-network", ContainerID: "sandbox-b9", IfName: "eth0"}
	got, err := alloc.Allocate(ctx, pool.Request{Owner: owner, Wants: []pool.Want{{Pool: poolName, Role: pool.RoleIP}}})
	if err != nil {
		t.Fatalf("%s back: allocating: %v", b, err)
	}
	h, _ = c.hostState(t, b)
	if h.State != "up" || h.Ranges == 0 || h.OrphanedAt.IsZero() {
		t.Errorf("%s back: status %+v; want up, a range of its own, the orphaned mark shown", b, h)
	}
	// Fresh space: it had no live range after the reclaim, it claimed one
	// now (the address may be one it had: its old owners are released).
	t.Logf("%s back under its name: %v from fresh space (%d ranges), ringctl status shows it %s, orphaned at %s", b, got.Addrs, h.Ranges, h.State, h.OrphanedAt.UTC().Format(time.TimeOnly))

	// Gone again, for the scenarios after: its Node, its agent, its space.
	if _, _, err := alloc.Release(ctx, owner); err != nil {
		t.Fatal(err)
	}
	agent.Stop(stopTimeout)
	c.deleteNode(t, b)
	if err := c.poll(reclaimTimeout, func(context.Context) (bool, error) {
		h, ok := c.hostState(t, b)
		return ok && h.Ranges == 0 && len(c.ownedBy(t, b)) == 0, nil
	}); err != nil {
		t.Fatalf("%s not reclaimed the second time: %v", b, err)
	}
	c.checkNothingLeft(t, "node-b gone")
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// ctr runs ctr on the node's containerd (CRI's namespace k8s.io).
func (c *cluster) ctr(t *testing.T, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, "ctr", append([]string{"-a", filepath.Join(c.dir, criSock), "-n", "k8s.io"}, args...)...).CombinedOutput()
	return string(out), err
}

// testVanishedPods: pod "vanish" runs; behind the kubelet's back (kubelet
// stopped) its containers and sandbox are killed and removed from
// containerd, containerd restarts without them, the pod is force-deleted
// (grace 0), kubelet comes back: nobody sends its DEL. The agent releases
// its address after the grace, with its log line and
// ringipam_vanished_pods_released_total counting it. Pod "creating"
// (its container's image does not exist: it never leaves creation, its
// sandbox holds an address) keeps its address throughout (the positive
// control).
func testVanishedPods(t *testing.T, c *cluster) {
	ctx := context.Background()
	const metric = "ringipam_vanished_pods_released_total"
	before := c.metric(t, metric)
	mk := func(name string) *corev1.Pod {
		return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: testNS, Labels: labels("vanished")}, Spec: podSpec()}
	}
	stuck := mk("creating")
	stuck.Spec.Containers[0].Image = "ringipam.invalid/no-such-image:1"
	for _, p := range []*corev1.Pod{mk("vanish"), stuck} {
		if _, err := c.cs.CoreV1().Pods(testNS).Create(ctx, p, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	vanish := c.waitPod(t, testNS, "vanish", podTimeout, "Running", func(p *corev1.Pod) bool {
		return p != nil && p.Status.Phase == corev1.PodRunning && podReady(p)
	})
	creating := c.waitPod(t, testNS, "creating", podTimeout, "with an address, its container waiting", func(p *corev1.Pod) bool {
		return p != nil && p.Status.PodIP != ""
	})
	addr := vanish.Status.PodIP
	t.Logf("vanish holds %s, creating holds %s", addr, creating.Status.PodIP)
	// The node's end of vanish's veth: removed with the sandbox below, as
	// when the sandbox's network namespace is gone (a reboot). Left on the
	// pods' bridge, it would keep answering ARP for the released address,
	// which another node may be given next (FlatNetwork), and refuse its
	// connections.
	vanishVeth := c.nodeVeth(t, c.podNetNS(t, *vanish))

	// Behind the kubelet's back.
	if !c.procs["kubelet"].Stop(stopTimeout) {
		t.Errorf("kubelet ignored SIGTERM")
	}
	ids, err := c.ctr(t, "containers", "ls", "-q", `labels."io.kubernetes.pod.uid"==`+string(vanish.UID))
	if err != nil || len(strings.Fields(ids)) == 0 {
		t.Fatalf("vanish's containers in containerd: %v: %q", err, ids)
	}
	for _, id := range strings.Fields(ids) {
		c.ctr(t, "tasks", "kill", "-s", "SIGKILL", id)
		c.ctr(t, "tasks", "delete", "--force", id)
		if out, err := c.ctr(t, "containers", "delete", id); err != nil {
			t.Fatalf("ctr containers delete %s: %v: %s", id, err, out)
		}
	}
	if out, err := c.node.Run("ip", "link", "del", vanishVeth); err != nil && !strings.Contains(out, "Cannot find device") {
		t.Fatalf("removing vanish's veth %s: %v: %s", vanishVeth, err, out)
	}
	if !c.procs["containerd"].Stop(stopTimeout) {
		t.Errorf("containerd ignored SIGTERM")
	}
	c.restartProc(t, "containerd")
	c.waitContainerd(t)
	zero := int64(0)
	if err := c.cs.CoreV1().Pods(testNS).Delete(ctx, "vanish", metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil {
		t.Fatal(err)
	}
	c.restartProc(t, "kubelet")
	// kubelet serves again (it exits at once when it cannot use the
	// runtime).
	c.waitKubelet(t)

	// The agent releases it (no DEL came: the address is held until then).
	if err := c.poll(reclaimTimeout, func(context.Context) (bool, error) {
		owned, _ := c.ls(t)
		for _, r := range owned {
			if r.Addr.String() == addr {
				return false, nil
			}
		}
		return true, nil
	}); err != nil {
		t.Fatalf("the address %s of the vanished pod is still held: %v\n%s", addr, err, lastLines(c.agentLog(), 30))
	}
	if log := c.agentLog(); !strings.Contains(log, "released the address of a pod that vanished without a DEL") || !strings.Contains(log, "pod="+testNS+"/vanish") {
		t.Errorf("no log line of the release:\n%s", lastLines(log, 30))
	}
	if after := c.metric(t, metric); after != before+1 {
		t.Errorf("%s went from %v to %v, want one more", metric, before, after)
	}
	// The positive control: the pod being created kept its address,
	// older than the grace by now.
	owned, _ := c.ls(t)
	kept := false
	for _, r := range owned {
		kept = kept || r.Addr == netip.MustParseAddr(creating.Status.PodIP)
	}
	if !kept {
		t.Errorf("the address %s of pod creating (being created, present in the apiserver) was released; owners %+v", creating.Status.PodIP, owned)
	}
	t.Logf("vanish's %s released by the agent; creating keeps %s", addr, creating.Status.PodIP)

	if err := c.cs.CoreV1().Pods(testNS).Delete(ctx, "creating", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	c.waitPods(t, "vanished", 0)
	c.checkNothingLeft(t, "the pods gone")
}

// waitKubelet waits until the restarted kubelet answers its /healthz (on
// the node's loopback: healthzBindAddress) and its node is Ready.
func (c *cluster) waitKubelet(t *testing.T) {
	t.Helper()
	cl := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DialContext: c.node.DialContext}}
	if err := c.poll(installTimeout, func(ctx context.Context) (bool, error) {
		if err := c.procs["kubelet"].ExitErr(); err != nil {
			return false, err
		}
		resp, err := cl.Get("http://127.0.0.1:10248/healthz")
		if err != nil {
			return false, nil
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return false, nil
		}
		n, err := c.cs.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		for _, cond := range n.Status.Conditions {
			if cond.Type == corev1.NodeReady {
				return cond.Status == corev1.ConditionTrue, nil
			}
		}
		return false, nil
	}); err != nil {
		t.Fatalf("kubelet not serving, node %s not Ready after kubelet's restart: %v\n%s", nodeName, err, c.procs["kubelet"].Tail(20))
	}
}

// nodeVeth is the name of the node's end of the veth whose other end is
// eth0 of the pod's network namespace ns.
func (c *kubeNode) nodeVeth(t *testing.T, ns *netns.NS) string {
	t.Helper()
	out, err := exec.Command("nsenter", "--net="+ns.Path, "ip", "-o", "link", "show", "eth0").CombinedOutput()
	m := regexp.MustCompile(`eth0@if(\d+):`).FindSubmatch(out)
	if err != nil || m == nil {
		t.Fatalf("eth0 of %s: %v: %s", ns.Name, err, out)
	}
	links, err := c.node.Run("ip", "-o", "link", "show")
	if err != nil {
		t.Fatalf("links of %s: %v: %s", c.name, err, links)
	}
	for _, l := range strings.Split(links, "\n") {
		if f := strings.Fields(l); len(f) > 1 && f[0] == string(m[1])+":" {
			return strings.TrimSuffix(strings.SplitN(f[1], "@", 2)[0], ":")
		}
	}
	t.Fatalf("no link %s on %s (the peer of %s's eth0):\n%s", m[1], c.name, ns.Name, links)
	return ""
}
