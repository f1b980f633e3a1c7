//go:build integration

package k8s

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ringipam/ringipam/integration/pause"
)

// podTimeout bounds a workload's pods reaching the state waited for (25
// pods on a loaded 2-core machine: a few seconds each).
const podTimeout = 4 * time.Minute

// testNS is where the scenarios' workloads run.
const testNS = "default"

// podSpec is the scenarios' pod: the pause image (imported, never pulled),
// which answers TCP port 80 with "pod <hostname>".
func podSpec() corev1.PodSpec {
	no := false
	grace := int64(5)
	return corev1.PodSpec{
		AutomountServiceAccountToken:  &no,
		TerminationGracePeriodSeconds: &grace,
		Containers: []corev1.Container{{
			Name:            "pause",
			Image:           pause.Image,
			ImagePullPolicy: corev1.PullNever,
			Ports:           []corev1.ContainerPort{{Name: "http", ContainerPort: 80, Protocol: corev1.ProtocolTCP}},
		}},
	}
}

func labels(app string) map[string]string { return map[string]string{"app": app} }

// listPods lists the live (not deleting) pods of app.
func (c *cluster) listPods(ctx context.Context, app string) ([]corev1.Pod, error) {
	list, err := c.cs.CoreV1().Pods(testNS).List(ctx, metav1.ListOptions{LabelSelector: "app=" + app})
	if err != nil {
		return nil, err
	}
	return list.Items, nil
}

// waitPods waits until app has exactly n pods, all Running and ready with
// an address (n = 0: until every pod is gone), and returns them.
func (c *cluster) waitPods(t *testing.T, app string, n int) []corev1.Pod {
	t.Helper()
	var pods []corev1.Pod
	err := c.poll(podTimeout, func(ctx context.Context) (bool, error) {
		var err error
		pods, err = c.listPods(ctx, app)
		if err != nil || len(pods) != n {
			return false, nil
		}
		for _, p := range pods {
			if p.DeletionTimestamp != nil || p.Status.Phase != corev1.PodRunning || p.Status.PodIP == "" || !podReady(&p) {
				return false, nil
			}
		}
		return true, nil
	})
	if err != nil {
		var states []string
		for i := range pods {
			states = append(states, pods[i].Name+": "+describePod(&pods[i])+" events: "+strings.Join(c.events(testNS, pods[i].Name), " | "))
		}
		t.Fatalf("%s: want %d pods Running: %v; %d pods:\n%s", app, n, err, len(pods), strings.Join(states, "\n"))
	}
	return pods
}

func podReady(p *corev1.Pod) bool {
	for _, cond := range p.Status.Conditions {
		if cond.Type == corev1.PodReady {
			return cond.Status == corev1.ConditionTrue
		}
	}
	return false
}

// addrRow is one line of `ringctl --json ls`.
type addrRow struct {
	Addr        netip.Addr      `json:"addr"`
	Pool        string          `json:"pool"`
	Owner       json.RawMessage `json:"owner"`
	Reservation string          `json:"reservation"`
	Host        string          `json:"host"`
	HeldUntil   time.Time       `json:"heldUntil"`
}

// ringctl runs ringctl on the suite's etcd (from the test's namespace,
// with the same client certificate as the agent) and returns its stdout.
func (c *cluster) ringctl(t *testing.T, args ...string) []byte {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	argv := append([]string{"--etcd-endpoints=" + c.etcd.Endpoints()[0], "--etcd-ca=" + c.etcdTLS.CA,
		"--etcd-cert=" + c.etcdTLS.Cert, "--etcd-key=" + c.etcdTLS.Key, "--etcd-prefix=/ringipam/"}, args...)
	cmd := exec.CommandContext(ctx, ringctlBin, argv...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("ringctl %s: %v\n%s%s", strings.Join(args, " "), err, out, stderr.String())
	}
	return out
}

// ls returns the pod pool's held addresses: owners' and holds.
func (c *cluster) ls(t *testing.T) (owned, held []addrRow) {
	t.Helper()
	var rows []addrRow
	if out := c.ringctl(t, "--json", "ls", "--pool", poolName); len(strings.TrimSpace(string(out))) > 0 {
		if err := json.Unmarshal(out, &rows); err != nil {
			t.Fatalf("ringctl --json ls: %v\n%s", err, out)
		}
	}
	for _, r := range rows {
		if len(r.Owner) > 0 && string(r.Owner) != "null" {
			owned = append(owned, r)
		} else {
			held = append(held, r)
		}
	}
	return owned, held
}

// dropHolds frees the addresses held for the reservations of deleted pods
// (reservationFromPod: a pod's namespace/name keeps its address for
// reservationHold), so that the next scenario has the /27 to itself.
func (c *cluster) dropHolds(t *testing.T, held []addrRow) {
	t.Helper()
	for _, r := range held {
		c.ringctl(t, "hold", "drop", r.Reservation, "--network", "k8s-pod-network")
	}
	if owned, held := c.ls(t); len(held) != 0 {
		t.Fatalf("holds left after hold drop: %+v (owned %+v)", held, owned)
	}
}

// checkNothingLeft checks that ringctl ls lists nothing for the network:
// no owner and no hold (pods without the ringipam.io/reservation
// annotation get no reservation under the shipped list).
func (c *cluster) checkNothingLeft(t *testing.T, when string) {
	t.Helper()
	if owned, held := c.ls(t); len(owned) != 0 || len(held) != 0 {
		t.Errorf("%s: ringctl ls lists owners %+v and holds %+v; want nothing", when, owned, held)
	}
}

// checkOwned checks that the pool's owners are exactly the addresses of
// pods (nothing leaked, nothing missing), all on the node.
func (c *cluster) checkOwned(t *testing.T, pods []corev1.Pod) {
	t.Helper()
	owned, _ := c.ls(t)
	var got, want []string
	for _, r := range owned {
		got = append(got, r.Addr.String())
		if r.Host != nodeName {
			t.Errorf("address %s held on host %q, want %q", r.Addr, r.Host, nodeName)
		}
	}
	for _, p := range pods {
		want = append(want, p.Status.PodIP)
	}
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Fatalf("ringctl ls owners %v, want the pods' addresses %v", got, want)
	}
}

func int32p(n int32) *int32 { return &n }

// testDeployment: 25 pods of a Deployment on the /27 get 25 distinct
// addresses of it and all run; scaled to 0, every address is freed:
// ringctl ls lists nothing for the network (the shipped list's
// "reservationFromPod": "annotated" gives a reservation only to pods
// annotated ringipam.io/reservation, which these are not).
func testDeployment(t *testing.T, c *cluster) {
	ctx := context.Background()
	const n = 25
	d := &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: "web", Namespace: testNS},
		Spec: appsv1.DeploymentSpec{
			Replicas: int32p(n),
			Selector: &metav1.LabelSelector{MatchLabels: labels("web")},
			Template: corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: labels("web")}, Spec: podSpec()},
		},
	}
	if _, err := c.cs.AppsV1().Deployments(testNS).Create(ctx, d, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pods := c.waitPods(t, "web", n)
	prefix := netip.MustParsePrefix(podCIDR)
	seen := map[string]string{}
	var names []string
	for _, p := range pods {
		a, err := netip.ParseAddr(p.Status.PodIP)
		if err != nil || !prefix.Contains(a) {
			t.Errorf("pod %s has address %q, not in %s", p.Name, p.Status.PodIP, podCIDR)
		}
		if other, dup := seen[p.Status.PodIP]; dup {
			t.Errorf("pods %s and %s share %s", other, p.Name, p.Status.PodIP)
		}
		seen[p.Status.PodIP] = p.Name
		names = append(names, testNS+"/"+p.Name)
	}
	c.checkOwned(t, pods)

	scale, err := c.cs.AppsV1().Deployments(testNS).GetScale(ctx, "web", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	scale.Spec.Replicas = 0
	if _, err := c.cs.AppsV1().Deployments(testNS).UpdateScale(ctx, "web", scale, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	c.waitPods(t, "web", 0)
	if owned, held := c.ls(t); len(owned) != 0 || len(held) != 0 {
		t.Fatalf("scaled to 0, ringctl ls still lists owners %+v and holds %+v; want nothing", owned, held)
	}
	t.Logf("scaled to 0: ringctl ls lists nothing for the network (%d pods' addresses freed)", len(names))
	if err := c.cs.AppsV1().Deployments(testNS).Delete(ctx, "web", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
}

// testStatefulSet: a StatefulSet of 3 whose template carries the
// annotation ringipam.io/reservation: "true" (the shipped list's
// "reservationFromPod": "annotated"); a deleted pod comes back (same name,
// new UID, new sandbox) with its address.
func testStatefulSet(t *testing.T, c *cluster) {
	ctx := context.Background()
	ss := &appsv1.StatefulSet{
		ObjectMeta: metav1.ObjectMeta{Name: "db", Namespace: testNS},
		Spec: appsv1.StatefulSetSpec{
			Replicas:            int32p(3),
			ServiceName:         "db",
			PodManagementPolicy: appsv1.ParallelPodManagement,
			Selector:            &metav1.LabelSelector{MatchLabels: labels("db")},
			Template: corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: labels("db"),
				Annotations: map[string]string{"ringipam.io/reservation": "true"}}, Spec: podSpec()},
		},
	}
	if _, err := c.cs.AppsV1().StatefulSets(testNS).Create(ctx, ss, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pods := c.waitPods(t, "db", 3)
	c.checkOwned(t, pods)
	before := map[string]corev1.Pod{}
	for _, p := range pods {
		before[p.Name] = p
	}
	old := before["db-1"]
	if err := c.cs.CoreV1().Pods(testNS).Delete(ctx, "db-1", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	back := c.waitPod(t, testNS, "db-1", podTimeout, "recreated and Running", func(p *corev1.Pod) bool {
		return p != nil && p.UID != old.UID && p.Status.Phase == corev1.PodRunning && p.Status.PodIP != "" && podReady(p)
	})
	if back.Status.PodIP != old.Status.PodIP {
		t.Errorf("db-1 came back with %s, had %s", back.Status.PodIP, old.Status.PodIP)
	} else {
		t.Logf("db-1 deleted and recreated (uid %s -> %s): same address %s", old.UID, back.UID, back.Status.PodIP)
	}
	pods = c.waitPods(t, "db", 3)
	for _, p := range pods {
		if p.Name != "db-1" && p.Status.PodIP != before[p.Name].Status.PodIP {
			t.Errorf("%s moved from %s to %s", p.Name, before[p.Name].Status.PodIP, p.Status.PodIP)
		}
	}
	c.checkOwned(t, pods)

	if err := c.cs.AppsV1().StatefulSets(testNS).Delete(ctx, "db", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	c.waitPods(t, "db", 0)
	owned, held := c.ls(t)
	if len(owned) != 0 || len(held) != 3 {
		t.Errorf("StatefulSet deleted: owners %+v, holds %+v; want no owner, the 3 pods' holds", owned, held)
	}
	c.dropHolds(t, held)
}

// hostPort is the port the hostPort scenario publishes on the node.
const hostPort = 38080

func hostPortPod(name string) *corev1.Pod {
	spec := podSpec()
	spec.Containers[0].Ports[0].HostPort = hostPort
	return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: testNS, Labels: labels("hostport")}, Spec: spec}
}

// get asks the node's address on hostPort from the peer namespace (the
// rest of the network) and returns the first line of the answer: the pause
// image answers "pod <hostname>".
func (c *cluster) get(t *testing.T, port int) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	conn, err := c.peer.DialContext(ctx, "tcp", net.JoinHostPort(nodeIP, strconv.Itoa(port)))
	if err != nil {
		return "", err
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(5 * time.Second))
	line, err := bufio.NewReader(conn).ReadString('\n')
	return strings.TrimSpace(line), err
}

// waitAnswer waits until the node's hostPort answers want.
func (c *cluster) waitAnswer(t *testing.T, want string) {
	t.Helper()
	var got string
	var gerr error
	err := c.poll(podTimeout, func(context.Context) (bool, error) {
		got, gerr = c.get(t, hostPort)
		return gerr == nil && got == want, nil
	})
	if err != nil {
		t.Fatalf("%s:%d from the peer: want %q: %v; last answer %q, %v; nft: %s", nodeIP, hostPort, want, err, got, gerr, c.nft(t))
	}
}

func (c *cluster) nft(t *testing.T) string {
	out, _ := c.node.Run("nft", "list", "ruleset")
	return out
}

// testHostPort: a pod with a hostPort is reachable on the node's address
// from the network; a second pod asking for the same hostPort stays
// Pending (the scheduler's NodePorts filter: FailedScheduling, "didn't
// have free ports"; the holder is not named), and runs once the first is
// deleted.
func testHostPort(t *testing.T, c *cluster) {
	ctx := context.Background()
	if _, err := c.cs.CoreV1().Pods(testNS).Create(ctx, hostPortPod("hp-a"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	c.waitPod(t, testNS, "hp-a", podTimeout, "Running", func(p *corev1.Pod) bool {
		return p != nil && p.Status.Phase == corev1.PodRunning && podReady(p)
	})
	c.waitAnswer(t, "pod hp-a")
	// The positive control of the check after the pods are gone: while
	// hp-a runs, ringctl ports lists its port.
	if ports := string(c.ringctl(t, "ports")); !strings.Contains(ports, strconv.Itoa(hostPort)) {
		t.Errorf("port %d of the running hp-a is not listed by ringctl ports:\n%s", hostPort, ports)
	}

	if _, err := c.cs.CoreV1().Pods(testNS).Create(ctx, hostPortPod("hp-b"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	var events []string
	p := c.waitPod(t, testNS, "hp-b", podTimeout, "refused by the scheduler", func(p *corev1.Pod) bool {
		if p == nil {
			return false
		}
		events = c.events(testNS, "hp-b")
		return slices.ContainsFunc(events, func(e string) bool {
			return strings.HasPrefix(e, "FailedScheduling: ") && strings.Contains(e, "free ports")
		})
	})
	if p.Status.Phase != corev1.PodPending || p.Spec.NodeName != "" {
		t.Errorf("hp-b: want Pending, unscheduled; %s (node %q)", describePod(p), p.Spec.NodeName)
	}
	t.Logf("second pod on hostPort %d: Pending, %s", hostPort, strings.Join(events, " | "))
	if got, err := c.get(t, hostPort); err != nil || got != "pod hp-a" {
		t.Errorf("with hp-b pending, the hostPort answers %q, %v; want pod hp-a", got, err)
	}

	if err := c.cs.CoreV1().Pods(testNS).Delete(ctx, "hp-a", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	c.waitPod(t, testNS, "hp-b", podTimeout, "Running after hp-a is gone", func(p *corev1.Pod) bool {
		return p != nil && p.Status.Phase == corev1.PodRunning && podReady(p)
	})
	c.waitAnswer(t, "pod hp-b")
	if err := c.cs.CoreV1().Pods(testNS).Delete(ctx, "hp-b", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	c.waitPods(t, "hostport", 0)
	if ports := strings.TrimSpace(string(c.ringctl(t, "ports"))); strings.Contains(ports, strconv.Itoa(hostPort)) {
		t.Errorf("port %d still published after its pods are gone:\n%s", hostPort, ports)
	}
	c.checkNothingLeft(t, "the pods gone")
}

// agentPID returns the PID of the agent's process on the node (its
// container's main process: /usr/local/bin/ringipamd), 0 if none.
func (c *cluster) agentPID() int {
	pids := processes(func(pid int, cmdline []byte) bool {
		if !strings.HasPrefix(string(cmdline), "/usr/local/bin/ringipamd\x00") {
			return false
		}
		cg, _ := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "cgroup"))
		return strings.Contains(string(cg), c.cgroupRoot+"/")
	})
	if len(pids) == 0 {
		return 0
	}
	return pids[0]
}

// agentAnswers reports whether the agent's socket on the node accepts.
func (c *cluster) agentAnswers() bool {
	conn, err := net.DialTimeout("unix", c.hostDir("/run/ringipam/agent.sock"), time.Second)
	if err != nil {
		return false
	}
	conn.Close()
	return true
}

// testAgentRestart: the DaemonSet's agent is killed; kubelet restarts it.
// Pods created while it is down wait (their ADDs fail with code 11 naming
// the agent's socket, kubelet retries) and then start; no address or port
// leaks.
//
// The first restart of a container is immediate and every later one waits
// twice as long as the one before (10 s, 20 s, 40 s): the agent is killed
// agentKills times, so that after the last kill kubelet holds it back for
// 20 s, and the pods are created then (kubelet tries their sandboxes
// within a second or two of their creation; the test fails, naming the
// pod, if one was not refused while the agent was down). Every kill is
// one restart: the restart count ends exactly agentKills above where it
// started.
func testAgentRestart(t *testing.T, c *cluster) {
	ctx := context.Background()
	agent, err := c.agentPod(ctx)
	if err != nil || agent == nil {
		t.Fatalf("no agent pod: %v", err)
	}
	restarts := func(p *corev1.Pod) int32 {
		for _, s := range p.Status.ContainerStatuses {
			if s.Name == "ringipamd" {
				return s.RestartCount
			}
		}
		return -1
	}
	const agentKills = 3
	base := restarts(agent)
	for kill := 1; kill <= agentKills; kill++ {
		var pid int
		if err := c.poll(podTimeout, func(context.Context) (bool, error) {
			pid = c.agentPID()
			return pid != 0 && c.agentAnswers(), nil
		}); err != nil {
			t.Fatalf("agent not running before kill %d: %v; %s", kill, err, c.agentPodState())
		}
		if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
			t.Fatalf("kill %d: %v", kill, err)
		}
		if err := c.poll(podTimeout, func(context.Context) (bool, error) { return !c.agentAnswers(), nil }); err != nil {
			t.Fatalf("agent socket still answers after kill %d: %v", kill, err)
		}
		if kill < agentKills {
			c.waitPod(t, installNS, agent.Name, podTimeout, fmt.Sprintf("restarted %d times", kill), func(p *corev1.Pod) bool {
				return p != nil && restarts(p) >= base+int32(kill) && podReady(p)
			})
		}
	}
	// The agent is down for 20 s: create the pods now.
	const n = 3
	for i := range n {
		p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("meanwhile-%d", i), Namespace: testNS, Labels: labels("meanwhile")}, Spec: podSpec()}
		if _, err := c.cs.CoreV1().Pods(testNS).Create(ctx, p, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	// Each pod's first sandbox fails through ipam-ring with code 11, naming
	// the socket the agent is not answering on.
	const socket = "/run/ringipam/agent.sock"
	refusedBy := func(e string) bool {
		return strings.HasPrefix(e, "FailedCreatePodSandBox: ") && strings.Contains(e, "no host agent answers at "+socket) &&
			strings.Contains(e, "(CNI code 11: try again later)")
	}
	for i := range n {
		name := fmt.Sprintf("meanwhile-%d", i)
		var events []string
		if err := c.poll(podTimeout, func(context.Context) (bool, error) {
			events = c.events(testNS, name)
			return slices.ContainsFunc(events, refusedBy), nil
		}); err != nil {
			t.Fatalf("%s: no sandbox refused with code 11 naming %s while the agent was down: %v; events: %s; %s",
				name, socket, err, strings.Join(events, " | "), c.agentPodState())
		}
		t.Logf("%s waited: %s", name, events[slices.IndexFunc(events, refusedBy)])
	}
	pods := c.waitPods(t, "meanwhile", n)
	final := c.waitPod(t, installNS, agent.Name, podTimeout, fmt.Sprintf("restarted %d times and ready", agentKills), func(p *corev1.Pod) bool {
		return p != nil && restarts(p) >= base+agentKills && podReady(p)
	})
	t.Logf("agent pod after the kills: %s", describePod(final))
	if got := restarts(final); got != base+agentKills {
		t.Errorf("agent restarted %d times, want exactly %d (one per kill: nothing else may restart it)", got-base, agentKills)
	}
	c.checkOwned(t, pods)
	for _, p := range pods {
		if err := c.cs.CoreV1().Pods(testNS).Delete(ctx, p.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			t.Fatal(err)
		}
	}
	c.waitPods(t, "meanwhile", 0)
	c.checkNothingLeft(t, "the pods gone")
}

// testAgentReplaced: the agent's pod is deleted (as a rolling update or a
// drain does): its preStop hook runs, finds the DaemonSet still there and
// keeps the node's list and plugins; the DaemonSet's new pod takes over.
// The list is checked every 50 ms from the deletion until the new pod is
// ready: it is never missing.
func testAgentReplaced(t *testing.T, c *cluster) {
	ctx := context.Background()
	old, err := c.agentPod(ctx)
	if err != nil || old == nil {
		t.Fatalf("no agent pod: %v", err)
	}
	files := append([]string{"/etc/cni/net.d/10-ringipam.conflist"}, installedBinaries...)
	missing := make(chan string, 1)
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			for _, p := range files {
				if _, err := os.Stat(c.hostDir(p)); err != nil {
					select {
					case missing <- p:
					default:
					}
				}
			}
			select {
			case <-stop:
				return
			case <-time.After(50 * time.Millisecond):
			}
		}
	}()
	if err := c.cs.CoreV1().Pods(installNS).Delete(ctx, old.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	var repl *corev1.Pod
	err = c.poll(podTimeout, func(ctx context.Context) (bool, error) {
		repl, err = c.agentPod(ctx)
		return err == nil && repl != nil && repl.UID != old.UID && podReady(repl), nil
	})
	close(stop)
	<-done
	if err != nil {
		t.Fatalf("no new agent pod ready: %v; %s", err, c.agentPodState())
	}
	select {
	case p := <-missing:
		t.Errorf("%s went missing while the agent's pod was replaced (the preStop hook uninstalled on a mere restart)", p)
	default:
	}
	for _, e := range c.events(installNS, old.Name) {
		if strings.HasPrefix(e, "FailedPreStopHook") {
			t.Errorf("old agent pod: %s", e)
		}
	}
	t.Logf("agent pod %s replaced by %s; the list and plugins stayed", old.Name, repl.Name)
	// The new agent serves: a pod gets an address.
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "after-replace", Namespace: testNS, Labels: labels("after-replace")}, Spec: podSpec()}
	if _, err := c.cs.CoreV1().Pods(testNS).Create(ctx, p, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pods := c.waitPods(t, "after-replace", 1)
	c.checkOwned(t, pods)
	if err := c.cs.CoreV1().Pods(testNS).Delete(ctx, p.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	c.waitPods(t, "after-replace", 0)
	c.checkNothingLeft(t, "the pods gone")
}

// testUninstall deletes the manifest's objects as `kubectl delete -f`
// does (in file order, background propagation, then waits until they are
// gone). The agent's preStop hook finds its DaemonSet going away and
// removes what the installer wrote on the node: the list, the binaries and
// its record. (That the hook keeps them on a mere restart is what the
// other scenarios show: the agent pod is restarted under them.)
func testUninstall(t *testing.T, c *cluster, m *manifest) {
	ctx := context.Background()
	agent, err := c.agentPod(ctx)
	if err != nil || agent == nil {
		t.Fatalf("no agent pod: %v", err)
	}
	for _, obj := range m.objs {
		if err := c.remove(ctx, obj); err != nil {
			t.Fatalf("deleting %T %s: %v", obj, obj.(metav1.Object).GetName(), err)
		}
	}
	if err := c.poll(installTimeout, func(ctx context.Context) (bool, error) {
		for _, obj := range m.objs {
			if ok, err := c.exists(ctx, obj); err != nil || ok {
				return false, nil
			}
		}
		return true, nil
	}); err != nil {
		t.Fatalf("manifest's objects not gone: %v", err)
	}
	if err := c.poll(installTimeout, func(context.Context) (bool, error) { return c.agentPID() == 0, nil }); err != nil {
		t.Fatalf("agent still running after uninstall: %v", err)
	}
	for _, p := range append(installedBinaries, "/etc/cni/net.d/10-ringipam.conflist", "/var/lib/ringipam/installed") {
		if _, err := os.Stat(c.hostDir(p)); !os.IsNotExist(err) {
			t.Errorf("%s still on the node after uninstall (%v); agent pod events: %s", p, err, strings.Join(c.events(installNS, agent.Name), " | "))
		}
	}
}
