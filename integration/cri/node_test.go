//go:build integration

package cri

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/ringipam/ringipam/integration/cnitest"
	"github.com/ringipam/ringipam/integration/crinode"
	"github.com/ringipam/ringipam/integration/netns"
	"github.com/ringipam/ringipam/integration/pause"
)

// startTimeout bounds a node's start: containerd answering CRI, the pause
// image imported, the CNI configuration loaded.
const startTimeout = 60 * time.Second

// stopTimeout bounds containerd's exit after SIGTERM, and the shims'
// after the last sandbox is removed.
const stopTimeout = 15 * time.Second

// requireContainerd skips the test without root or without containerd and
// its tools; under CI (the CI variable set) it fails instead.
func requireContainerd(t *testing.T) {
	t.Helper()
	netns.RequireRoot(t)
	for _, tool := range []string{"containerd", "ctr", "containerd-shim-runc-v2", "runc", "unshare", "nsenter", "mount"} {
		if _, err := exec.LookPath(tool); err != nil {
			if os.Getenv("CI") != "" {
				t.Fatalf("needs %s (Debian's containerd, from scripts/install-deps.sh); CI is set, so this fails instead of skipping", tool)
			}
			t.Skipf("needs %s (Debian's containerd, from scripts/install-deps.sh)", tool)
		}
	}
}

// node is one Kubernetes node as kubelet sees it: a private containerd
// serving CRI, in a network namespace of its own (the node's "host"
// namespace, where the bridge, the host veths and the packet filter rules
// of its pods live) and a mount namespace of its own, in which
// /run/containerd/s (shim sockets, fixed in containerd 1.6), /var/lib/cni
// (libcni's result cache) and /run/ringipam (ipam-ring's host locks) are
// private directories, so two nodes on one machine are as apart as two
// machines. Its root, state, sockets, configuration and CNI directories are
// in a temporary directory.
type node struct {
	name string // the node name: ipam-ring's "host"
	ns   *netns.NS
	dir  string
	cri  *criClient

	proc   *os.Process
	exited chan struct{} // closed when containerd has exited
}

func (n *node) sock() string { return filepath.Join(n.dir, "c.sock") }

// startNode starts a node named name whose CNI configuration is the
// conflist conf returns (containerd's conf_dir holds only it); conf is
// called once the node's network namespace exists. The node is stopped
// when the test ends: every sandbox is stopped and removed through CRI
// first, so that a teardown failure shows as a test error.
func startNode(t *testing.T, name string, conf func(ns *netns.NS) map[string]any) *node {
	t.Helper()
	requireContainerd(t)
	n := &node{name: name, ns: netns.New(t, "crin"), exited: make(chan struct{})}
	// Socket paths must stay short (108 bytes): not under t.TempDir().
	dir, err := os.MkdirTemp("", "ricri-")
	if err != nil {
		t.Fatal(err)
	}
	n.dir = dir
	t.Cleanup(func() { os.RemoveAll(dir) })
	for _, d := range []string{"root", "state", "shim", "cnicache", "locks", "calls", "cni/bin", "cni/conf"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	links := map[string]string{"bridge": cnitest.RefBin(t, "bridge"), "loopback": cnitest.RefBin(t, "loopback")}
	for name, target := range links {
		if err := os.Symlink(target, filepath.Join(dir, "cni/bin", name)); err != nil {
			t.Fatal(err)
		}
	}
	// Our plugins run behind a recorder (see calls).
	for name, target := range map[string]string{"ipam-ring": cnitest.IPAMBin, "portmap-ingress": portmapBin} {
		script := fmt.Sprintf(recorderScript, filepath.Join(dir, "calls"), name, target)
		if err := os.WriteFile(filepath.Join(dir, "cni/bin", name), []byte(script), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	b, err := json.MarshalIndent(conf(n.ns), "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "cni/conf/10-ringipam.conflist"), b, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "config.toml"), []byte(containerdConfig(dir)), 0o644); err != nil {
		t.Fatal(err)
	}
	// The mount points of the private directories.
	for _, d := range []string{"/run/containerd/s", "/var/lib/cni", "/run/ringipam"} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	n.ns.MustRun(t, "sysctl", "-qw", "net.ipv4.ip_forward=1")
	n.start(t)
	t.Cleanup(func() { n.stop(t) })
	if err := n.waitReady(); err != nil {
		t.Fatalf("node %s: %v\n%s", name, err, n.logTail())
	}
	return n
}

// containerdConfig is a containerd 1.6 configuration that keeps everything
// under dir.
func containerdConfig(dir string) string {
	return crinode.ContainerdConfig(crinode.Paths{
		Root: filepath.Join(dir, "root"), State: filepath.Join(dir, "state"),
		Socket: filepath.Join(dir, "c.sock"), SandboxImage: pause.Image,
		CNIBin: filepath.Join(dir, "cni/bin"), CNIConf: filepath.Join(dir, "cni/conf"),
	})
}

// startScript runs in the node's namespaces: it mounts a sysfs of the
// node's network namespace (as ip netns exec does) while keeping the
// machine's cgroup mounts under it (which ip netns exec loses, and runc
// needs), puts the private directories in place and becomes containerd.
const startScript = `set -e
mkdir -p "$1/cgroup"
mount --rbind /sys/fs/cgroup "$1/cgroup"
mount -t sysfs sysfs /sys
mount --move "$1/cgroup" /sys/fs/cgroup
mount --bind "$1/shim" /run/containerd/s
mount --bind "$1/cnicache" /var/lib/cni
mount --bind "$1/locks" /run/ringipam
exec containerd --config "$1/config.toml"`

func (n *node) start(t *testing.T) {
	t.Helper()
	logf, err := os.Create(filepath.Join(n.dir, "containerd.log"))
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	// nsenter and unshare (without --fork) exec what they run: the process
	// is containerd itself.
	cmd := exec.Command("nsenter", "--net="+n.ns.Path, "unshare", "--mount", "--propagation", "slave",
		"sh", "-c", startScript, "sh", n.dir)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting containerd: %v", err)
	}
	n.proc = cmd.Process
	go func() { cmd.Wait(); close(n.exited) }()
	c, err := dialCRI(n.sock())
	if err != nil {
		t.Fatal(err)
	}
	n.cri = c
}

// waitReady waits until containerd answers CRI, imports the pause image and
// waits until the CNI configuration is loaded.
func (n *node) waitReady() error {
	deadline := time.Now().Add(startTimeout)
	for {
		_, err := os.Stat(n.sock())
		if err == nil {
			_, err = n.cri.version()
		}
		if err == nil {
			break
		}
		select {
		case <-n.exited:
			return errors.New("containerd exited")
		default:
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("containerd not answering after %v: %v", startTimeout, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	out, err := exec.CommandContext(ctx, "ctr", "-a", n.sock(), "-n", "k8s.io", "images", "import", pauseArchive).CombinedOutput()
	if err != nil {
		return fmt.Errorf("ctr images import: %v: %s", err, out)
	}
	for {
		ok, msg, err := n.cri.networkReady()
		if err != nil {
			return err
		}
		if ok {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("network not ready after %v: %s", startTimeout, msg)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// stop removes every sandbox through CRI (errors fail the test: a DEL that
// fails leaves a sandbox kubelet cannot remove), stops containerd, and
// makes sure no shim of this node is left.
func (n *node) stop(t *testing.T) {
	if ids, err := n.cri.pods(); err != nil {
		t.Errorf("node %s: listing sandboxes: %v", n.name, err)
	} else {
		for _, id := range ids {
			if err := n.cri.stopPod(id); err != nil {
				t.Errorf("node %s: stop sandbox %s: %v", n.name, id, err)
			}
			if err := n.cri.removePod(id); err != nil {
				t.Errorf("node %s: remove sandbox %s: %v", n.name, id, err)
			}
		}
	}
	n.cri.Close()
	n.proc.Signal(syscall.SIGTERM)
	select {
	case <-n.exited:
	case <-time.After(stopTimeout):
		t.Errorf("node %s: containerd ignored SIGTERM for %v; killed", n.name, stopTimeout)
		n.proc.Kill()
		<-n.exited
	}
	// Shims exit by themselves once their sandbox is removed; one that is
	// still there after stopTimeout is killed (and reported).
	deadline := time.Now().Add(stopTimeout)
	for {
		pids := n.shims()
		if len(pids) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Errorf("node %s: shims %v still running after %v; killed", n.name, pids, stopTimeout)
			for _, pid := range pids {
				syscall.Kill(pid, syscall.SIGKILL)
			}
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if t.Failed() {
		t.Logf("node %s containerd log (tail):\n%s", n.name, n.logTail())
	}
}

// shims returns the PIDs of the shims this node's containerd started: they
// name its socket in their command line.
func (n *node) shims() []int {
	entries, _ := os.ReadDir("/proc")
	want := []byte(n.sock() + "\x00")
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		cmdline, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err == nil && bytes.Contains(cmdline, []byte("containerd-shim")) && bytes.Contains(cmdline, want) {
			pids = append(pids, pid)
		}
	}
	return pids
}

func (n *node) logTail() string {
	b, _ := os.ReadFile(filepath.Join(n.dir, "containerd.log"))
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > 40 {
		lines = lines[len(lines)-40:]
	}
	return strings.Join(lines, "\n")
}

// recorderScript stands in for a plugin (%[3]s) in the node's CNI bin
// directory: it writes what the runtime passed (command, container ID,
// netns, CNI_ARGS, stdin), the plugin's stdout and its exit code to files
// in %[1]s, named so that they sort by time, and passes stdin, stdout and
// the exit code through.
const recorderScript = `#!/bin/sh
f="%[1]s/$(date +%%s%%N).$$.%[2]s"
in=$(cat)
printf '%%s\n%%s\n%%s\n%%s\n%%s\n' "$CNI_COMMAND" "$CNI_CONTAINERID" "$CNI_NETNS" "$CNI_ARGS" "$in" > "$f.call"
printf '%%s' "$in" | %[3]q > "$f.out"
rc=$?
echo $rc > "$f.rc"
cat "$f.out"
exit $rc
`

// pluginCall is one recorded plugin invocation.
type pluginCall struct {
	Plugin      string // ipam-ring or portmap-ingress
	Command     string // ADD, DEL, CHECK, ...
	ContainerID string
	Netns       string
	Args        string // CNI_ARGS
	Stdin       map[string]any
	RC          int // exit code; -1 while it runs
	Code        int // the CNI error code the plugin printed, 0 if none
}

// Delegated reports a call of ipam-ring by the main plugin (its stdin is
// the main plugin's) rather than as a chained plugin of the list.
func (c pluginCall) Delegated() bool {
	return c.Plugin == "ipam-ring" && c.Stdin["type"] != "ipam-ring"
}

// RuntimeConfig is the call's runtimeConfig object (nil if none).
func (c pluginCall) RuntimeConfig() map[string]any {
	rc, _ := c.Stdin["runtimeConfig"].(map[string]any)
	return rc
}

// calls returns the plugin calls recorded so far, oldest first.
func (n *node) calls(t *testing.T) []pluginCall {
	t.Helper()
	dir := filepath.Join(n.dir, "calls")
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []pluginCall
	for _, e := range entries {
		base, ok := strings.CutSuffix(e.Name(), ".call")
		if !ok {
			continue
		}
		b, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		f := strings.SplitN(string(b), "\n", 5)
		if len(f) < 5 {
			t.Fatalf("recorded call %s: %q", e.Name(), b)
		}
		c := pluginCall{Plugin: strings.SplitN(base, ".", 3)[2], Command: f[0], ContainerID: f[1], Netns: f[2], Args: f[3], RC: -1}
		if err := json.Unmarshal([]byte(f[4]), &c.Stdin); err != nil {
			t.Fatalf("recorded call %s: stdin: %v", e.Name(), err)
		}
		if rc, err := os.ReadFile(filepath.Join(dir, base+".rc")); err == nil {
			c.RC, _ = strconv.Atoi(strings.TrimSpace(string(rc)))
		}
		if c.RC > 0 {
			var e struct {
				Code int `json:"code"`
			}
			b, _ := os.ReadFile(filepath.Join(dir, base+".out"))
			if json.Unmarshal(b, &e) != nil || e.Code == 0 {
				t.Errorf("recorded call %s failed (exit %d) without a CNI error: %q", base, c.RC, b)
			}
			c.Code = e.Code
		}
		out = append(out, c)
	}
	return out
}

// pod is one sandbox the test ran.
type pod struct {
	ID        string
	Namespace string
	Name      string
	IP        string // from the sandbox status
}

// podConfig is the sandbox configuration kubelet would send for pod
// namespace/name (a fresh UID each time, like a recreated pod), with the
// node's network (not the host's).
func podConfig(namespace, name string, ports ...*runtimeapi.PortMapping) *runtimeapi.PodSandboxConfig {
	return &runtimeapi.PodSandboxConfig{
		Metadata:     &runtimeapi.PodSandboxMetadata{Name: name, Namespace: namespace, Uid: netns.Unique("uid-")},
		Hostname:     name,
		PortMappings: ports,
		Linux: &runtimeapi.LinuxPodSandboxConfig{SecurityContext: &runtimeapi.LinuxSandboxSecurityContext{
			NamespaceOptions: &runtimeapi.NamespaceOption{Network: runtimeapi.NamespaceMode_POD, Pid: runtimeapi.NamespaceMode_POD, Ipc: runtimeapi.NamespaceMode_POD},
		}},
	}
}

// podConfigAnnotated is podConfig with pod annotations.
func podConfigAnnotated(namespace, name string, annotations map[string]string, ports ...*runtimeapi.PortMapping) *runtimeapi.PodSandboxConfig {
	cfg := podConfig(namespace, name, ports...)
	cfg.Annotations = annotations
	return cfg
}

// run runs a sandbox of cfg and returns it with its IP.
func (n *node) run(cfg *runtimeapi.PodSandboxConfig) (pod, error) {
	id, err := n.cri.runPod(cfg)
	if err != nil {
		return pod{}, fmt.Errorf("node %s: RunPodSandbox %s/%s: %w", n.name, cfg.Metadata.Namespace, cfg.Metadata.Name, err)
	}
	p := pod{ID: id, Namespace: cfg.Metadata.Namespace, Name: cfg.Metadata.Name}
	st, err := n.cri.status(id)
	if err != nil {
		return p, fmt.Errorf("node %s: status of %s/%s: %w", n.name, p.Namespace, p.Name, err)
	}
	p.IP = st.IP
	return p, nil
}

// remove stops and removes sandbox p as kubelet does: StopPodSandbox (CNI
// DEL with the pod's netns), then RemovePodSandbox (CNI DEL again, the
// netns gone).
func (n *node) remove(p pod) error {
	if err := n.cri.stopPod(p.ID); err != nil {
		return fmt.Errorf("node %s: StopPodSandbox %s/%s: %w", n.name, p.Namespace, p.Name, err)
	}
	if err := n.cri.removePod(p.ID); err != nil {
		return fmt.Errorf("node %s: RemovePodSandbox %s/%s: %w", n.name, p.Namespace, p.Name, err)
	}
	return nil
}

// eth0 returns the global addresses on eth0 inside the pod's network
// namespace (entered through the sandbox process), in CIDR form.
func (n *node) eth0(p pod) ([]string, error) {
	st, err := n.cri.status(p.ID)
	if err != nil {
		return nil, err
	}
	if st.Pid <= 0 {
		return nil, fmt.Errorf("sandbox %s/%s has no process (state %v)", p.Namespace, p.Name, st.State)
	}
	out, err := netns.Command("nsenter", "-t", strconv.Itoa(st.Pid), "-n", "ip", "-o", "addr", "show", "dev", "eth0", "scope", "global")
	if err != nil {
		return nil, fmt.Errorf("pod %s/%s eth0: %v: %s", p.Namespace, p.Name, err, out)
	}
	var addrs []string
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		for i := 0; i+1 < len(f); i++ {
			if f[i] == "inet" || f[i] == "inet6" {
				addrs = append(addrs, f[i+1])
			}
		}
	}
	return addrs, nil
}

// runMany runs the sandboxes of cfgs, at most par at a time, and returns
// them in the order of cfgs; it fails the test on any error.
func (n *node) runMany(t *testing.T, par int, cfgs []*runtimeapi.PodSandboxConfig) []pod {
	t.Helper()
	pods, err := n.runAll(par, cfgs)
	if err != nil {
		t.Fatal(err)
	}
	return pods
}

// runAll is runMany returning the joined errors (for use off the test's
// goroutine).
func (n *node) runAll(par int, cfgs []*runtimeapi.PodSandboxConfig) ([]pod, error) {
	pods := make([]pod, len(cfgs))
	err := parallel(par, len(cfgs), func(i int) error {
		var err error
		pods[i], err = n.run(cfgs[i])
		return err
	})
	return pods, err
}

// removeMany stops and removes pods, at most par at a time; it fails the
// test on any error.
func (n *node) removeMany(t *testing.T, par int, pods []pod) {
	t.Helper()
	if err := n.removeAll(par, pods); err != nil {
		t.Fatal(err)
	}
}

// removeAll is removeMany returning the joined errors.
func (n *node) removeAll(par int, pods []pod) error {
	return parallel(par, len(pods), func(i int) error { return n.remove(pods[i]) })
}

// parallel runs fn(0..count-1), at most par at a time, and joins the errors.
func parallel(par, count int, fn func(i int) error) error {
	errs := make([]error, count)
	sem := make(chan struct{}, par)
	var wg sync.WaitGroup
	for i := range count {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			errs[i] = fn(i)
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}
