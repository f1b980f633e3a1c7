//go:build integration

package churn

import (
	"bytes"
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ringipam/ringipam/integration/netns"
	"github.com/ringipam/ringipam/internal/testenv"
)

// Every name this suite gives what it leaves on the machine starts with
// mark: its network namespaces (hosts, LAN, control plane, pods), its
// temporary directories (/tmp/rchurn-*) and its agents' store prefix, so
// that sweep finds what a killed run left, and nothing of anyone else's.
const mark = "rchurn"

// The LAN of the hosts and the control plane (a bridge in a namespace of
// its own): the control plane's addresses and the first host's.
var (
	apiserverIP = netip.MustParseAddr("198.18.250.1") // kube-apiserver (whereabouts)
	ringEtcdIP  = netip.MustParseAddr("198.18.250.2") // ringipam's etcd
	kubeEtcdIP  = netip.MustParseAddr("198.18.250.3") // kube-apiserver's own etcd
	firstHostIP = netip.MustParseAddr("198.18.250.10")
)

// world is the hosts and what they share: a LAN namespace with a bridge,
// a control-plane namespace on it (ringipam's etcd; kube-apiserver and its
// etcd when whereabouts runs), and the host namespaces on it. Everything
// is removed when the test ends (t.Cleanup), also on failure.
type world struct {
	t     *testing.T
	dir   string // /tmp/rchurn-...: short, for sockets
	lan   *netns.NS
	cp    *netns.NS
	hosts []*host
	links int
	// ringEtcd is ringipam's etcd, on the LAN at ringEtcdIP.
	ringEtcd *testenv.EtcdCluster
}

// host is one simulated machine: a network namespace on the LAN where the
// runtime's CNI calls run (and its ringipamd agent, when ringipam runs).
type host struct {
	name string
	ns   *netns.NS
	addr netip.Addr
}

// newWorld sweeps what an earlier run left, then makes n hosts on a LAN
// with ringipam's etcd.
func newWorld(t *testing.T, n int) *world {
	t.Helper()
	netns.RequireRoot(t)
	lockRuns(t)
	sweep(t)
	dir, err := os.MkdirTemp("", mark+"-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	w := &world{t: t, dir: dir}
	w.lan = netns.New(t, mark+"l")
	w.lan.MustRun(t, "ip", "link", "add", "br0", "type", "bridge")
	w.lan.MustRun(t, "ip", "link", "set", "br0", "up")
	w.cp = netns.New(t, mark+"c")
	w.link(w.cp, apiserverIP, ringEtcdIP, kubeEtcdIP)
	for i := range n {
		h := &host{name: fmt.Sprintf("churn-h%d", i), ns: netns.New(t, mark+"h"), addr: addrAdd(firstHostIP, i)}
		w.link(h.ns, h.addr)
		w.hosts = append(w.hosts, h)
	}
	w.ringEtcd = testenv.StartEtcdCluster(t, testenv.ClusterOptions{Size: 1, Netns: w.cp.Name,
		Addrs: []netip.Addr{ringEtcdIP}, Dial: w.cp.DialContext})
	return w
}

// link puts ns on the LAN as eth0 with addrs (/24).
func (w *world) link(ns *netns.NS, addrs ...netip.Addr) {
	w.t.Helper()
	w.links++
	lanEnd := fmt.Sprintf("v%d", w.links)
	if out, err := netns.Command("ip", "link", "add", lanEnd, "netns", w.lan.Name, "type", "veth", "peer", "name", "eth0", "netns", ns.Name); err != nil {
		w.t.Fatalf("veth to %s: %v: %s", ns.Name, err, out)
	}
	w.lan.MustRun(w.t, "ip", "link", "set", lanEnd, "master", "br0", "up")
	for _, a := range addrs {
		ns.MustRun(w.t, "ip", "addr", "add", a.String()+"/24", "dev", "eth0")
	}
	ns.MustRun(w.t, "ip", "link", "set", "eth0", "up")
}

func addrAdd(a netip.Addr, n int) netip.Addr {
	for range n {
		a = a.Next()
	}
	return a
}

// lockPath is held (flock) by the run of this suite that owns the
// machine's rchurn* state: a second run (make integration's short form
// while make scale-churn runs) waits for it instead of sweeping away the
// first one's namespaces and processes. The kernel drops the lock of a
// killed run, so what the sweep then finds is stale.
const lockPath = "/run/" + mark + ".lock"

// lockWait bounds the wait for another run to end.
const lockWait = 15 * time.Minute

// lockRuns takes lockPath for the test (released when it ends), waiting
// at most lockWait for another run of the suite.
func lockRuns(t *testing.T) {
	t.Helper()
	f, err := os.OpenFile(lockPath, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(lockWait)
	for logged := false; ; {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			break
		}
		if err != syscall.EWOULDBLOCK {
			f.Close()
			t.Fatalf("flock %s: %v", lockPath, err)
		}
		if time.Now().After(deadline) {
			f.Close()
			t.Fatalf("another run of this suite has held %s for %v", lockPath, lockWait)
		}
		if !logged {
			t.Logf("waiting (at most %v) for another run of this suite to end (%s)", lockWait, lockPath)
			logged = true
		}
		time.Sleep(time.Second)
	}
	t.Cleanup(func() { f.Close() })
}

// sweep removes what a run of this suite that was killed left behind: its
// network namespaces (mark*), the processes it started that name its
// temporary directories or its store prefix (kube-apiserver, ringipamd),
// and those directories. Everything it touches carries mark.
func sweep(t *testing.T) {
	t.Helper()
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	self := os.Getpid()
	for _, p := range procs {
		pid, err := strconv.Atoi(strings.Split(p, "/")[2])
		if err != nil || pid == self {
			continue
		}
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		// Ours: kube-apiserver with its files under /tmp/rchurn-*, an agent
		// on the store prefix /rchurn/ (with its NUL-separated argv).
		if bytes.Contains(b, []byte("/tmp/"+mark+"-")) || bytes.Contains(b, []byte("\x00/"+mark+"/")) {
			t.Logf("sweep: killing pid %d left by an earlier run: %s", pid, bytes.ReplaceAll(b, []byte{0}, []byte{' '}))
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
	out, err := netns.Command("ip", "netns", "list")
	if err != nil {
		t.Fatalf("ip netns list: %v: %s", err, out)
	}
	for _, line := range strings.Split(out, "\n") {
		name, _, _ := strings.Cut(strings.TrimSpace(line), " ")
		if strings.HasPrefix(name, mark) {
			if out, err := netns.Command("ip", "netns", "delete", name); err != nil {
				t.Logf("sweep: ip netns delete %s: %v: %s", name, err, out)
			}
		}
	}
	dirs, _ := filepath.Glob("/tmp/" + mark + "-*")
	for _, d := range dirs {
		os.RemoveAll(d)
	}
}

// proc is a long-running process of the world (kube-apiserver), its
// output in a file.
type proc = testenv.Proc

// startIn starts bin in namespace ns (nsenter execs it: the process is bin
// itself) and registers its stop (SIGTERM, at most 20 s, then kill).
func (w *world) startIn(ns *netns.NS, name, bin string, args ...string) *proc {
	w.t.Helper()
	p, err := testenv.StartProc(name, filepath.Join(w.dir, name+".log"), exec.Command("nsenter", append([]string{"--net=" + ns.Path, "--", bin}, args...)...))
	if err != nil {
		w.t.Fatal(err)
	}
	w.t.Cleanup(func() { p.Stop(20 * time.Second) })
	return p
}

// poll calls fn every 200 ms until it returns true or an error, or until
// timeout.
func poll(timeout time.Duration, fn func(ctx context.Context) (bool, error)) error {
	deadline := time.Now().Add(timeout)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		ok, err := fn(ctx)
		cancel()
		if err != nil {
			return err
		}
		if ok {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not within %v", timeout)
		}
		time.Sleep(200 * time.Millisecond)
	}
}
