//go:build integration

package k8s

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/ringipam/ringipam/integration/crinode"
	"github.com/ringipam/ringipam/integration/netns"
	"github.com/ringipam/ringipam/integration/pause"
	"github.com/ringipam/ringipam/internal/testenv"
)

// Node A's addresses on the LAN (its InternalIP, where the apiserver
// listens and hostPorts are published) and the peer's (a client namespace
// standing for the rest of the network, the nodes' default gateway).
const (
	nodeIP   = "198.18.255.2"
	peerIP   = "198.18.255.1"
	nodeName = "node-a"
	// apiPort is the apiserver's port on nodeIP.
	apiPort = "6443"
)

// criSock is the node's containerd's socket under the cluster's dir: in a
// directory of its own, which the agent's pod mounts (as the manifest
// mounts the node's /run/containerd: a socket file mounted alone would be
// the old one after containerd restarts).
const criSock = "cri/containerd.sock"

// Deadlines of the control plane's start and stop.
const (
	apiserverTimeout = 3 * time.Minute // first answer of /readyz (etcd 3.4 on a loaded machine)
	nodeTimeout      = 2 * time.Minute // containerd answering, kubelet registering its node
	stopTimeout      = 20 * time.Second
)

// requireK8s skips the test without root or without the control plane's
// binaries (scripts/build-k8s.sh) and containerd's tools; under CI it fails.
func requireK8s(t *testing.T) {
	t.Helper()
	netns.RequireRoot(t)
	var missing []string
	for _, b := range k8sBinaries {
		if _, err := os.Stat(filepath.Join(k8sDir, b)); err != nil {
			missing = append(missing, filepath.Join(k8sDir, b)+" (scripts/build-k8s.sh, run by make deps)")
		}
	}
	for _, tool := range []string{"containerd", "ctr", "containerd-shim-runc-v2", "runc", "unshare", "nsenter", "mount", "umount", "mmdebstrap", "umoci", "ping", "conntrack"} {
		if _, err := exec.LookPath(tool); err != nil {
			missing = append(missing, tool+" (Debian package, scripts/install-deps.sh)")
		}
	}
	if len(missing) == 0 {
		return
	}
	if os.Getenv("CI") != "" {
		t.Fatalf("needs %s; CI is set, so this fails instead of skipping", strings.Join(missing, ", "))
	}
	t.Skipf("needs %s", strings.Join(missing, ", "))
}

var k8sBinaries = []string{"kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet"}

// cluster is a Kubernetes cluster of real components at one version:
// kube-apiserver (on the suite's etcd), kube-controller-manager,
// kube-scheduler, and on each node kubelet on a private containerd 1.6.
//
// Each node runs in a network namespace of its own (node), a port of a
// LAN in a peer namespace (peer) that stands for the rest of the network
// too; the control plane runs in node A's. The machine's
// own network, nftables and sysctls are untouched, and the test's ports
// cannot collide with anything else on the machine. kubelet and containerd
// share a mount namespace of their own in which the node's well-known
// directories (/opt/cni/bin, /etc/cni/net.d, /run/ringipam,
// /var/lib/ringipam, /var/lib/cni, /var/log, /run/containerd) are
// the suite's temporary directories: what the manifest's hostPath volumes
// write lands there, and the test reads it back (hostDir). Pods' cgroups
// live under a cgroup root of the suite's own, removed at the end.
//
// The cluster is node A (kubeNode, embedded: c.dir, c.node, c.procs are
// node A's; its dir is the cluster's, where the control plane's files
// are too), on which the control plane runs, and the nodes addNode joins
// to it (the flat-network scenario's B and C). The peer namespace holds
// the LAN: a bridge every node's eth0 is a port of, the peer's address on
// it.
type cluster struct {
	*kubeNode
	peer       *netns.NS
	etcd       *testenv.Etcd
	etcdTLS    testenv.TLSFiles
	etcdInNode string // the etcd endpoint as seen from every node ("https://127.0.0.1:port")
	token      string
	cs         *kubernetes.Clientset
}

// kubeNode is one node: its network namespace (a port of the LAN), its
// mount namespace's holder, its containerd and kubelet, its directories
// and cgroup root.
type kubeNode struct {
	name       string // the Node's name (kubelet's --hostname-override)
	ip         string // its address on the LAN, its InternalIP
	dir        string // short: socket paths
	node       *netns.NS
	cgroupRoot string // kubelet's cgroupRoot ("/rik8s-...")

	holder *proc // the mount namespace's holder (sleep)
	procs  map[string]*proc
	// args are the node's components' arguments (restartProc).
	args map[string][]string
	// down says the node was torn down (teardown runs once).
	down bool
}

// hostDir is where path of the node's file system (one of the directories
// the node's mount namespace redirects) is in the test's.
func (c *kubeNode) hostDir(path string) string {
	best := -1
	for i, m := range nodeMounts {
		if (path == m.target || strings.HasPrefix(path, m.target+"/")) && (best < 0 || len(m.target) > len(nodeMounts[best].target)) {
			best = i
		}
	}
	if best < 0 {
		panic("hostDir: " + path + " is the machine's, not the node's")
	}
	m := nodeMounts[best]
	return filepath.Join(c.dir, m.src, strings.TrimPrefix(path, m.target))
}

// nodeMounts are the node's private directories: src under the cluster's
// dir is bind-mounted onto target in the node's mount namespace, in this
// order.
var nodeMounts = []struct{ src, target string }{
	// The directory of the node's containerd's socket, at the path the
	// manifest mounts into the agent's pod (the same on every node), and
	// where containerd 1.6 keeps its runc state and shim sockets.
	{"cri", "/run/containerd"},
	{"shim", "/run/containerd/s"}, // containerd 1.6's shim sockets (fixed path)
	{"cnicache", "/var/lib/cni"},
	{"opt-cni-bin", "/opt/cni/bin"},
	{"etc-cni-net.d", "/etc/cni/net.d"},
	{"run-ringipam", "/run/ringipam"},
	{"var-lib-ringipam", "/var/lib/ringipam"},
	{"var-log", "/var/log"},
}

// startCluster brings the cluster up and registers its teardown; it
// returns once the node is registered (not yet Ready: that needs a CNI
// list, which the manifest's installer writes) and the default
// ServiceAccount exists.
func startCluster(t *testing.T) *cluster {
	t.Helper()
	requireK8s(t)
	dir, err := os.MkdirTemp("", "rik8s-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	c := &cluster{kubeNode: newKubeNode(nodeName, nodeIP, dir, "/"+filepath.Base(dir))}

	// The LAN: a bridge in the peer namespace, the peer's address on it;
	// node A a port of it.
	c.peer = netns.New(t, "k8sp")
	c.peer.MustRun(t, "ip", "link", "add", "br0", "type", "bridge")
	c.peer.MustRun(t, "ip", "addr", "add", peerIP+"/24", "dev", "br0")
	c.peer.MustRun(t, "ip", "link", "set", "br0", "up")
	c.attach(t, c.kubeNode)

	// The suite's etcd (TLS: the manifest's Secret carries its client
	// certificate), reached from the node through a relay on the node's
	// loopback (the server certificate names 127.0.0.1).
	c.etcd, c.etcdTLS = testenv.StartEtcdTLS(t)
	target := strings.TrimPrefix(c.etcd.Endpoints()[0], "https://")
	c.etcdInNode = "https://" + c.node.Relay(t, target)

	t.Cleanup(func() { c.teardown(t) })
	c.writeCredentials(t)
	c.startControlPlane(t)
	c.startNode(t, c.kubeNode)
	return c
}

func newKubeNode(name, ip, dir, cgroupRoot string) *kubeNode {
	return &kubeNode{name: name, ip: ip, dir: dir, cgroupRoot: cgroupRoot, procs: map[string]*proc{}, args: map[string][]string{}}
}

// attach makes n's network namespace, a port of the LAN: its eth0 with
// its address, a default route through the peer.
func (c *cluster) attach(t *testing.T, n *kubeNode) {
	t.Helper()
	n.node = netns.New(t, "k8sn")
	veth, port := netns.Unique("k8v"), netns.Unique("k8p")
	if out, err := netns.Command("ip", "link", "add", veth, "netns", n.node.Name, "type", "veth", "peer", "name", port, "netns", c.peer.Name); err != nil {
		t.Fatalf("veth: %v: %s", err, out)
	}
	c.peer.MustRun(t, "ip", "link", "set", port, "master", "br0", "up")
	n.node.MustRun(t, "ip", "link", "set", veth, "name", "eth0")
	n.node.MustRun(t, "ip", "addr", "add", n.ip+"/24", "dev", "eth0")
	n.node.MustRun(t, "ip", "link", "set", "eth0", "up")
	n.node.MustRun(t, "ip", "route", "add", "default", "via", peerIP)
}

// addNode joins a node to the cluster: on the LAN at ip, the suite's etcd
// relayed on its loopback at the address every node's list names, the
// pause image and images (archives) imported; it returns once its Node is
// registered. Its teardown runs when t ends (before its namespace goes):
// the node stopped as the cluster's own, then its Node object deleted and
// its pods with it.
func (c *cluster) addNode(t *testing.T, name, ip string, images ...string) *kubeNode {
	t.Helper()
	if !slices.Contains(kubeletNodes, name) {
		t.Fatalf("addNode %s: not one of kubeletNodes %v, which have their kubelet's token in the apiserver's token file", name, kubeletNodes)
	}
	dir := filepath.Join(c.dir, name)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	n := newKubeNode(name, ip, dir, c.cgroupRoot+"-"+name)
	c.attach(t, n)
	target := strings.TrimPrefix(c.etcd.Endpoints()[0], "https://")
	n.node.RelayOn(t, strings.TrimPrefix(c.etcdInNode, "https://"), target)
	t.Cleanup(func() {
		if t.Failed() {
			for _, name := range []string{"kubelet", "containerd"} {
				if p := n.procs[name]; p != nil {
					t.Log(n.name + " " + p.Tail(40))
				}
			}
		}
		n.teardown(t)
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := c.cs.CoreV1().Nodes().Delete(ctx, name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("deleting Node %s: %v", name, err)
		}
		// Its pods (the DaemonSet's) are gone with it: deleted at once,
		// not left to the pod GC's quarantine.
		c.deletePodsOf(ctx, t, name)
	})
	c.startNode(t, n, images...)
	return n
}

// kubeletNodes are the names of every node a kubelet of the suite runs
// (node A, the flat network's B and C): each has its token in the
// apiserver's token file, which is read once, at its start.
var kubeletNodes = []string{nodeName, nodeBName, nodeCName}

// The identities of the control plane's components, as a real cluster's
// (kubeadm's): the names the apiserver's bootstrap RBAC policy binds
// system:kube-controller-manager and system:kube-scheduler (and their
// volume and authentication-reader roles) to.
const (
	controllerManagerUser = "system:kube-controller-manager"
	schedulerUser         = "system:kube-scheduler"
	adminUser             = "admin"
)

// kubeconfigOf is the kubeconfig file of a component's identity in the
// cluster's dir: "kubeconfig" is the test's own (admin), the others are
// "kubeconfig-<name>".
func (c *cluster) kubeconfigOf(name string) string {
	if name == adminUser {
		return filepath.Join(c.dir, "kubeconfig")
	}
	return filepath.Join(c.dir, "kubeconfig-"+name)
}

// kubeletUser is the user kubelet of node runs as: what the Node
// authorizer and the NodeRestriction admission plugin recognise.
func kubeletUser(node string) string { return "system:node:" + node }

// deletePodsOf deletes the pod objects of node at once (grace 0): no
// kubelet of a gone node confirms their deletion.
func (c *cluster) deletePodsOf(ctx context.Context, t *testing.T, node string) {
	t.Helper()
	pods, err := c.cs.CoreV1().Pods("").List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + node})
	if err != nil {
		t.Errorf("pods of %s: %v", node, err)
		return
	}
	zero := int64(0)
	for _, p := range pods.Items {
		if err := c.cs.CoreV1().Pods(p.Namespace).Delete(ctx, p.Name, metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("deleting pod %s/%s of %s: %v", p.Namespace, p.Name, node, err)
		}
	}
}

// writeCredentials writes the apiserver's token file, the service-account
// signing key and one kubeconfig per identity: each kubelet as
// system:node:<its node> in system:nodes (the Node authorizer limits it to
// its node and its pods' objects), the controller manager and the
// scheduler under their bootstrap names, the test as an admin
// (system:masters; also ringctl's and the stand-in agent's setup). The
// DaemonSet's pods run with the manifest's ServiceAccount, its tokens
// issued by the apiserver.
func (c *cluster) writeCredentials(t *testing.T) {
	t.Helper()
	users := []testenv.KubeUser{
		{Name: adminUser, Groups: []string{"system:masters"}, Kubeconfig: filepath.Base(c.kubeconfigOf(adminUser))},
		{Name: controllerManagerUser, Kubeconfig: filepath.Base(c.kubeconfigOf("kube-controller-manager"))},
		{Name: schedulerUser, Kubeconfig: filepath.Base(c.kubeconfigOf("kube-scheduler"))},
	}
	for _, n := range kubeletNodes {
		users = append(users, testenv.KubeUser{Name: kubeletUser(n), Groups: []string{"system:nodes"}, Kubeconfig: filepath.Base(c.kubeconfigOf("kubelet-" + n))})
	}
	c.token = testenv.WriteKubeUsers(t, c.dir, c.apiServer(), users...)[adminUser]
}

// apiServer is the apiserver's URL, on node A's address.
func (c *cluster) apiServer() string { return "https://" + net.JoinHostPort(nodeIP, apiPort) }

// restConfig is the test's client configuration: the admin token, the
// apiserver's self-signed certificate not verified, connections made from
// inside the node's namespace.
func (c *cluster) restConfig() *rest.Config {
	return &rest.Config{
		Host:            c.apiServer(),
		BearerToken:     c.token,
		TLSClientConfig: rest.TLSClientConfig{Insecure: true},
		Dial:            c.node.DialContext,
		QPS:             50,
		Burst:           100,
		Timeout:         30 * time.Second,
	}
}

func (c *cluster) startControlPlane(t *testing.T) {
	t.Helper()
	d := c.dir
	c.startProc(t, "kube-apiserver", false,
		"--etcd-servers="+c.etcdInNode,
		"--etcd-cafile="+c.etcdTLS.CA, "--etcd-certfile="+c.etcdTLS.Cert, "--etcd-keyfile="+c.etcdTLS.Key,
		"--bind-address=0.0.0.0", "--secure-port="+apiPort, "--advertise-address="+nodeIP,
		"--cert-dir="+filepath.Join(d, "apiserver"),
		"--token-auth-file="+filepath.Join(d, "tokens.csv"),
		// As a real cluster: kubelets authorized by the Node authorizer
		// (and kept to their own Node and pods by NodeRestriction),
		// everyone else, the DaemonSet's service account too, by RBAC.
		"--authorization-mode=Node,RBAC",
		"--enable-admission-plugins=NodeRestriction",
		"--service-account-issuer=https://kubernetes.default.svc",
		"--service-account-key-file="+filepath.Join(d, "sa.pub"),
		"--service-account-signing-key-file="+filepath.Join(d, "sa.key"),
		"--service-cluster-ip-range=198.18.254.0/24",
		"--allow-privileged=true",
	)
	cs, err := kubernetes.NewForConfig(c.restConfig())
	if err != nil {
		t.Fatal(err)
	}
	c.cs = cs
	err = c.poll(apiserverTimeout, func(ctx context.Context) (bool, error) {
		if err := c.procs["kube-apiserver"].ExitErr(); err != nil {
			return false, err
		}
		_, err := cs.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
		return err == nil, nil
	})
	if err != nil {
		t.Fatalf("kube-apiserver not ready: %v\n%s", err, c.procs["kube-apiserver"].Tail(30))
	}
	// The controller manager's controllers each under a service account
	// of their own (kube-system's, bound by the bootstrap policy), as
	// kubeadm runs it: its own identity alone may not create pods.
	c.startProc(t, "kube-controller-manager", false, "--kubeconfig="+c.kubeconfigOf("kube-controller-manager"), "--leader-elect=false",
		"--use-service-account-credentials",
		"--root-ca-file="+filepath.Join(d, "apiserver", "apiserver.crt"),
		"--service-account-private-key-file="+filepath.Join(d, "sa.key"),
		"--cert-dir="+filepath.Join(d, "kcm"))
	c.startProc(t, "kube-scheduler", false, "--kubeconfig="+c.kubeconfigOf("kube-scheduler"), "--leader-elect=false",
		"--cert-dir="+filepath.Join(d, "scheduler"))
}

// holderScript makes the node's mount namespace: a sysfs of the node's
// network namespace (keeping the machine's cgroup mounts under it, which
// runc and kubelet need), the node's private directories, then waits.
const holderScript = `set -e
d=$1; shift
mkdir -p "$d/cgroup"
mount --rbind /sys/fs/cgroup "$d/cgroup"
mount -t sysfs sysfs /sys
mount --move "$d/cgroup" /sys/fs/cgroup
while [ $# -gt 0 ]; do mount --bind "$d/$1" "$2"; shift 2; done
touch "$d/mounted"
exec sleep infinity`

// startNode starts n's mount namespace, containerd (the pause and
// ringipam images imported, and images: archives of ctr images export)
// and kubelet, and waits for its Node.
func (c *cluster) startNode(t *testing.T, n *kubeNode, images ...string) {
	t.Helper()
	d := n.dir
	// The mount point of containerd's shim sockets, inside its socket's
	// directory (both mounted on the node).
	if err := os.MkdirAll(filepath.Join(d, "cri", "s"), 0o755); err != nil {
		t.Fatal(err)
	}
	args := []string{"--net=" + n.node.Path, "unshare", "--mount", "--propagation", "slave", "sh", "-c", holderScript, "sh", d}
	for _, m := range nodeMounts {
		for _, p := range []string{filepath.Join(d, m.src), m.target} {
			if err := os.MkdirAll(p, 0o755); err != nil {
				t.Fatal(err)
			}
		}
		args = append(args, m.src, m.target)
	}
	n.holder = n.spawn(t, "holder", "nsenter", args...)
	if err := poll(nodeTimeout, func(context.Context) (bool, error) {
		if err := n.holder.ExitErr(); err != nil {
			return false, err
		}
		_, err := os.Stat(filepath.Join(d, "mounted"))
		return err == nil, nil
	}); err != nil {
		t.Fatalf("node %s mount namespace: %v\n%s", n.name, err, n.holder.Tail(20))
	}

	if err := os.MkdirAll(filepath.Dir(filepath.Join(d, criSock)), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(d, "containerd.toml"), []byte(containerdConfig(d)), 0o644); err != nil {
		t.Fatal(err)
	}
	n.startProc(t, "containerd", true, "--config", filepath.Join(d, "containerd.toml"))
	sock := filepath.Join(d, criSock)
	if err := poll(nodeTimeout, func(ctx context.Context) (bool, error) {
		if err := n.procs["containerd"].ExitErr(); err != nil {
			return false, err
		}
		return exec.CommandContext(ctx, "ctr", "-a", sock, "version").Run() == nil, nil
	}); err != nil {
		t.Fatalf("containerd of %s: %v\n%s", n.name, err, n.procs["containerd"].Tail(30))
	}
	n.importImage(t, pauseArchive, "")
	n.importImage(t, imageArchive, "docker.io/ringipam/ringipam")
	for _, a := range images {
		n.importImage(t, a, "")
	}

	n.makeCgroupRoot(t)
	kubeletConf := fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
containerRuntimeEndpoint: unix://%s
cgroupDriver: cgroupfs
cgroupRoot: %s
failCgroupV1: false
failSwapOn: false
address: %s
healthzBindAddress: 127.0.0.1
readOnlyPort: 0
authentication:
  anonymous: {enabled: true}
  webhook: {enabled: false}
authorization: {mode: AlwaysAllow}
# The imported images must stay: no image GC, no eviction for the
# machine's disk or memory.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "1Mi", nodefs.available: "1%%", nodefs.inodesFree: "1%%", imagefs.available: "1%%"}
`, sock, n.cgroupRoot, n.ip)
	if err := os.WriteFile(filepath.Join(d, "kubelet.yaml"), []byte(kubeletConf), 0o644); err != nil {
		t.Fatal(err)
	}
	n.startProc(t, "kubelet", true,
		"--config="+filepath.Join(d, "kubelet.yaml"),
		"--kubeconfig="+c.kubeconfigOf("kubelet-"+n.name),
		"--root-dir="+filepath.Join(d, "kubelet"),
		"--cert-dir="+filepath.Join(d, "kubelet-pki"),
		"--hostname-override="+n.name,
		"--node-ip="+n.ip,
	)
	if err := poll(nodeTimeout, func(ctx context.Context) (bool, error) {
		if err := n.procs["kubelet"].ExitErr(); err != nil {
			return false, err
		}
		_, err := c.cs.CoreV1().Nodes().Get(ctx, n.name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return false, nil
		}
		return err == nil, err
	}); err != nil {
		t.Fatalf("kubelet did not register node %s: %v\n%s", n.name, err, n.procs["kubelet"].Tail(40))
	}
	// The ServiceAccount admission refuses pods until the controller
	// manager made the namespace's default account.
	if err := c.poll(nodeTimeout, func(ctx context.Context) (bool, error) {
		_, err := c.cs.CoreV1().ServiceAccounts("default").Get(ctx, "default", metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return false, nil
		}
		return err == nil, err
	}); err != nil {
		t.Fatalf("no default ServiceAccount: %v\n%s", err, c.procs["kube-controller-manager"].Tail(30))
	}
}

// containerdConfig is containerd 1.6's configuration: root, state and
// sockets under dir; the CNI directories are the node's well-known ones
// (its private mounts); the sandbox image is the suite's.
func containerdConfig(dir string) string {
	return crinode.ContainerdConfig(crinode.Paths{
		Root: filepath.Join(dir, "containerd-root"), State: filepath.Join(dir, "containerd-state"),
		Socket: filepath.Join(dir, criSock), SandboxImage: pause.Image,
		CNIBin: "/opt/cni/bin", CNIConf: "/etc/cni/net.d",
	})
}

// importImage imports an image archive into the node's containerd (CRI's
// namespace k8s.io), under baseName when given (an OCI archive's
// references are tags only).
func (c *kubeNode) importImage(t *testing.T, archive, baseName string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), nodeTimeout)
	defer cancel()
	args := []string{"-a", filepath.Join(c.dir, criSock), "-n", "k8s.io", "images", "import"}
	if baseName != "" {
		args = append(args, "--base-name", baseName)
	}
	out, err := exec.CommandContext(ctx, "ctr", append(args, archive)...).CombinedOutput()
	if err != nil {
		t.Fatalf("ctr images import %s: %v: %s", archive, err, out)
	}
}

// proc is one process of the cluster, its output in a log file.
type proc = testenv.Proc

// startProc starts the component name from the suite's Kubernetes
// binaries (or containerd from PATH) in the node's network namespace, and
// with inNode in the node's mount namespace too.
func (c *kubeNode) startProc(t *testing.T, name string, inNode bool, args ...string) *proc {
	t.Helper()
	bin := name
	if name != "containerd" {
		bin = filepath.Join(k8sDir, name)
	}
	var nsArgs []string
	if inNode {
		nsArgs = []string{"-t", strconv.Itoa(c.holder.Cmd.Process.Pid), "-m", "-n", "--"}
	} else {
		nsArgs = []string{"--net=" + c.node.Path, "--"}
	}
	p := c.spawn(t, name, "nsenter", append(append(nsArgs, bin), args...)...)
	c.procs[name] = p
	if inNode {
		c.args[name] = args
	}
	return p
}

// restartProc starts the node's component name again with the arguments
// it was first started with (after stopping it).
func (c *kubeNode) restartProc(t *testing.T, name string) *proc {
	t.Helper()
	return c.startProc(t, name, true, c.args[name]...)
}

// waitContainerd waits until the node's containerd answers over CRI (its
// CRI plugin initialised: kubelet, started before, exits with "server is
// not initialized yet").
func (c *kubeNode) waitContainerd(t *testing.T) {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+filepath.Join(c.dir, criSock), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	rt := runtimeapi.NewRuntimeServiceClient(conn)
	if err := c.poll(nodeTimeout, func(ctx context.Context) (bool, error) {
		if err := c.procs["containerd"].ExitErr(); err != nil {
			return false, err
		}
		_, err := rt.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{})
		return err == nil, nil
	}); err != nil {
		t.Fatalf("containerd's CRI: %v\n%s", err, c.procs["containerd"].Tail(30))
	}
}

func (c *kubeNode) spawn(t *testing.T, name, bin string, args ...string) *proc {
	t.Helper()
	// nsenter and unshare exec what they run (no --fork): the process is
	// the component itself, and signals reach it.
	p, err := testenv.StartProc(name, filepath.Join(c.dir, name+".log"), exec.Command(bin, args...))
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// poll calls cond every 200 ms until it returns true or an error, or
// timeout passes (an error naming the timeout). Each call gets a context
// bounded by the remaining time.
func (c *kubeNode) poll(timeout time.Duration, cond func(ctx context.Context) (bool, error)) error {
	return poll(timeout, cond)
}

// poll is kubeNode.poll, for any caller.
func poll(timeout time.Duration, cond func(ctx context.Context) (bool, error)) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	for {
		ok, err := cond(ctx)
		if err != nil {
			return err
		}
		if ok {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("not after %v", timeout)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// teardown stops the node and the control plane: kubelet first, then
// every process left in the pods' cgroups, containerd and its shims, the
// kubelet's root-dir mounts, the mount namespace; the control plane last.
// What does not end on SIGTERM is killed and reported.
func (c *cluster) teardown(t *testing.T) {
	defer c.keepLogs(t)
	if t.Failed() {
		for _, name := range []string{"kubelet", "containerd", "kube-controller-manager", "kube-scheduler", "kube-apiserver"} {
			if p := c.procs[name]; p != nil {
				t.Log(p.Tail(40))
			}
		}
	}
	c.kubeNode.teardown(t)
	for _, name := range []string{"kube-scheduler", "kube-controller-manager", "kube-apiserver"} {
		if !c.procs[name].Stop(stopTimeout) {
			t.Errorf("%s ignored SIGTERM for %v; killed", name, stopTimeout)
		}
	}
}

// teardown stops the node: kubelet first, then every process left in the
// pods' cgroups, containerd and its shims, the kubelet's root-dir mounts,
// the mount namespace, the pods' cgroups. What does not end on SIGTERM is
// killed and reported. Its processes are gone as when the machine loses
// power: the pods' containers are killed, nobody sends their DELs. Once
// down, the node stays down: a second call does nothing.
func (c *kubeNode) teardown(t *testing.T) {
	if c.down {
		return
	}
	c.down = true
	if !c.procs["kubelet"].Stop(stopTimeout) {
		t.Errorf("kubelet of %s ignored SIGTERM for %v; killed", c.name, stopTimeout)
	}
	c.killCgroup(t)
	if !c.procs["containerd"].Stop(stopTimeout) {
		t.Errorf("containerd of %s ignored SIGTERM for %v; killed", c.name, stopTimeout)
	}
	c.killShims(t)
	if c.holder != nil {
		// kubelet bind-mounts its root-dir onto itself (and mounts the
		// pods' volumes under it): unmount before the directory goes.
		root := filepath.Join(c.dir, "kubelet")
		if out, err := exec.Command("nsenter", "-t", strconv.Itoa(c.holder.Cmd.Process.Pid), "-m", "umount", "-R", root).CombinedOutput(); err != nil &&
			!bytes.Contains(out, []byte("not mounted")) {
			t.Errorf("umount -R %s: %v: %s", root, err, out)
		}
		c.holder.Cmd.Process.Kill()
		<-c.holder.Exited
	}
	c.removeCgroups(t)
}

// keepLogs copies the components' logs into the directory
// RINGIPAM_K8S_LOGS names, when it is set (a CI artifact, a debugging aid).
func (c *cluster) keepLogs(t *testing.T) {
	dst := os.Getenv("RINGIPAM_K8S_LOGS")
	if dst == "" {
		return
	}
	if err := os.MkdirAll(dst, 0o755); err != nil {
		t.Errorf("RINGIPAM_K8S_LOGS: %v", err)
		return
	}
	logs, _ := filepath.Glob(filepath.Join(c.dir, "*.log"))
	// The DaemonSet's containers' logs, as kubelet keeps them.
	pods, _ := filepath.Glob(filepath.Join(c.hostDir("/var/log/pods"), installNS+"_*", "*", "*.log"))
	for _, l := range append(logs, pods...) {
		name := filepath.Base(l)
		if rel, err := filepath.Rel(c.hostDir("/var/log/pods"), l); err == nil && !strings.HasPrefix(rel, "..") {
			name = "pod_" + strings.ReplaceAll(rel, "/", "_")
		}
		if b, err := os.ReadFile(l); err == nil {
			os.WriteFile(filepath.Join(dst, name), b, 0o644)
		}
	}
	t.Logf("component logs copied to %s", dst)
}

// makeCgroupRoot creates kubelet's cgroupRoot in every cgroup v1
// hierarchy (kubelet refuses a root missing in one); the cpuset one gets
// its parent's CPUs and memory nodes, without which nothing can join it.
func (c *kubeNode) makeCgroupRoot(t *testing.T) {
	t.Helper()
	hier, _ := filepath.Glob("/sys/fs/cgroup/*")
	for _, h := range hier {
		if filepath.Base(h) == "unified" {
			continue // cgroup v2's, which kubelet on cgroup v1 does not use
		}
		d := filepath.Join(h, c.cgroupRoot)
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatalf("cgroup root: %v", err)
		}
		if filepath.Base(h) == "cpuset" {
			for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
				b, err := os.ReadFile(filepath.Join(h, f))
				if err == nil {
					err = os.WriteFile(filepath.Join(d, f), b, 0o644)
				}
				if err != nil {
					t.Fatalf("cgroup root: %s: %v", f, err)
				}
			}
		}
	}
}

// cgroupDirs lists the pods' cgroup directories of every hierarchy
// (cgroup v1: one per controller), deepest first.
func (c *kubeNode) cgroupDirs() []string {
	var dirs []string
	hier, _ := filepath.Glob("/sys/fs/cgroup/*")
	for _, h := range hier {
		filepath.WalkDir(filepath.Join(h, c.cgroupRoot), func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
	}
	for i, j := 0, len(dirs)-1; i < j; i, j = i+1, j-1 {
		dirs[i], dirs[j] = dirs[j], dirs[i]
	}
	return dirs
}

// killCgroup kills every process in the pods' cgroups (containers kubelet
// did not stop, the node being torn down) and waits until they are gone.
func (c *kubeNode) killCgroup(t *testing.T) {
	err := c.poll(stopTimeout, func(context.Context) (bool, error) {
		n := 0
		for _, d := range c.cgroupDirs() {
			b, _ := os.ReadFile(filepath.Join(d, "cgroup.procs"))
			for _, f := range strings.Fields(string(b)) {
				if pid, err := strconv.Atoi(f); err == nil {
					syscall.Kill(pid, syscall.SIGKILL)
					n++
				}
			}
		}
		return n == 0, nil
	})
	if err != nil {
		t.Errorf("processes left in %s: %v", c.cgroupRoot, err)
	}
}

func (c *kubeNode) removeCgroups(t *testing.T) {
	var errs []error
	for _, d := range c.cgroupDirs() {
		if err := os.Remove(d); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		t.Errorf("removing the pods' cgroups: %v", err)
	}
}

// killShims kills the shims of the node's containerd (they name its socket
// in their command line) that did not exit with their sandboxes.
func (c *kubeNode) killShims(t *testing.T) {
	want := []byte(filepath.Join(c.dir, criSock) + "\x00")
	for _, pid := range processes(func(_ int, cmdline []byte) bool {
		return bytes.Contains(cmdline, []byte("containerd-shim")) && bytes.Contains(cmdline, want)
	}) {
		syscall.Kill(pid, syscall.SIGKILL)
	}
}

// processes lists the PIDs of the machine's processes whose command line
// (NUL-separated, as in /proc/PID/cmdline) match accepts.
func processes(match func(pid int, cmdline []byte) bool) []int {
	var pids []int
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		cmdline, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err == nil && match(pid, cmdline) {
			pids = append(pids, pid)
		}
	}
	return pids
}

// waitPod waits until the pod satisfies cond (given the pod, or nil when
// it does not exist) and returns it.
func (c *cluster) waitPod(t *testing.T, ns, name string, timeout time.Duration, what string, cond func(p *corev1.Pod) bool) *corev1.Pod {
	t.Helper()
	var last *corev1.Pod
	err := c.poll(timeout, func(ctx context.Context) (bool, error) {
		p, err := c.cs.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			last = nil
			return cond(nil), nil
		}
		if err != nil {
			return false, nil // the apiserver may be slow: retried until the deadline
		}
		last = p
		return cond(p), nil
	})
	if err != nil {
		t.Fatalf("pod %s/%s %s: %v; last seen: %s", ns, name, what, err, describePod(last))
	}
	return last
}

func describePod(p *corev1.Pod) string {
	if p == nil {
		return "none"
	}
	s := fmt.Sprintf("phase %s, ip %q", p.Status.Phase, p.Status.PodIP)
	for _, cs := range append(p.Status.InitContainerStatuses, p.Status.ContainerStatuses...) {
		s += fmt.Sprintf("; %s ready=%v restarts=%d", cs.Name, cs.Ready, cs.RestartCount)
		if w := cs.State.Waiting; w != nil {
			s += fmt.Sprintf(" waiting %s: %s", w.Reason, w.Message)
		}
		if x := cs.State.Terminated; x != nil {
			s += fmt.Sprintf(" terminated %s (%d): %s", x.Reason, x.ExitCode, x.Message)
		}
		if x := cs.LastTerminationState.Terminated; x != nil {
			s += fmt.Sprintf(" (last: %s, exit %d, signal %d, at %s)", x.Reason, x.ExitCode, x.Signal, x.FinishedAt.UTC().Format("15:04:05"))
		}
	}
	for _, cond := range p.Status.Conditions {
		if cond.Status != corev1.ConditionTrue && cond.Message != "" {
			s += fmt.Sprintf("; %s: %s", cond.Type, cond.Message)
		}
	}
	return s
}

// events returns the events of the object named name in ns, as
// "reason: message" lines.
func (c *cluster) events(ns, name string) []string {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	list, err := c.cs.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=" + name})
	if err != nil {
		return []string{"listing events: " + err.Error()}
	}
	var out []string
	for _, e := range list.Items {
		out = append(out, e.Reason+": "+e.Message)
	}
	return out
}
