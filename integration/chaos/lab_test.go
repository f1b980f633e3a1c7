//go:build integration

package chaos

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ringipam/ringipam/docker-driver/driver"
	"github.com/ringipam/ringipam/integration/netns"
	"github.com/ringipam/ringipam/internal/testenv"
)

// The lab is a LAN of network namespaces, all on 198.18.0.0/24: a "lan"
// namespace holds a bridge with the three etcd members' addresses
// (198.18.0.11-13, each member its own process serving on port 2379), and
// every host (and the Docker driver's host) is a namespace with one veth
// on that bridge. Nothing touches the machine's own interfaces; the test
// process reaches the members through loopback relays (netns.Forward).
type lab struct {
	t       *testing.T
	lan     *netns.NS
	etcd    *testenv.EtcdCluster
	etcdIPs []netip.Addr
	hosts   []*host
	docker  *host
	// relays are loopback endpoints of the test process relaying to the
	// members, for the suite's own store reads.
	relays []string
}

// host is one namespace on the LAN.
type host struct {
	name string // host name (UTS) of its agent, or the driver's --host
	ns   *netns.NS
	ip   netip.Addr
}

// lanPrefix is the LAN's prefix length.
const lanPrefix = 24

func mustAddr(s string) netip.Addr { return netip.MustParseAddr(s) }

// newLab builds the LAN with n hosts and a Docker host, and starts the etcd
// cluster on it. Everything is removed when the test ends.
func newLab(t *testing.T, n int) *lab {
	t.Helper()
	l := &lab{t: t, etcdIPs: []netip.Addr{mustAddr("198.18.0.11"), mustAddr("198.18.0.12"), mustAddr("198.18.0.13")}}
	l.lan = netns.New(t, "chlan")
	l.lan.MustRun(t, "ip", "link", "add", "br0", "type", "bridge")
	l.lan.MustRun(t, "ip", "link", "set", "br0", "up")
	for _, ip := range l.etcdIPs {
		l.lan.MustRun(t, "ip", "addr", "add", fmt.Sprintf("%s/%d", ip, lanPrefix), "dev", "br0")
	}
	run := netns.Unique("")
	for i := range n {
		l.hosts = append(l.hosts, l.addHost(fmt.Sprintf("vh%d", i), fmt.Sprintf("chaos-%s-h%d", run, i), mustAddr(fmt.Sprintf("198.18.0.%d", 101+i))))
	}
	l.docker = l.addHost("vhd", fmt.Sprintf("chaos-%s-docker", run), mustAddr("198.18.0.100"))
	l.etcd = testenv.StartEtcdCluster(t, testenv.ClusterOptions{Netns: l.lan.Name, Addrs: l.etcdIPs, Dial: l.lan.DialContext})
	for _, ip := range l.etcdIPs {
		l.relays = append(l.relays, "http://"+l.lan.Forward(t, netip.AddrPortFrom(ip, 2379).String()))
	}
	return l
}

// addHost makes a namespace with a veth "eth0" at ip on the LAN bridge.
func (l *lab) addHost(port, name string, ip netip.Addr) *host {
	t := l.t
	h := &host{name: name, ns: netns.New(t, "chh"), ip: ip}
	l.lan.MustRun(t, "ip", "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", h.ns.Name)
	l.lan.MustRun(t, "ip", "link", "set", port, "master", "br0", "up")
	h.ns.MustRun(t, "ip", "addr", "add", fmt.Sprintf("%s/%d", ip, lanPrefix), "dev", "eth0")
	h.ns.MustRun(t, "ip", "link", "set", "eth0", "up")
	return h
}

// endpoints are the members' client URLs as the hosts reach them.
func (l *lab) endpoints() []string { return l.etcd.Endpoints() }

// partitionTable is the nftables table a partition adds in a host's namespace.
const partitionTable = "ringipam_chaos"

// partition cuts h off from every etcd member with nftables rules in h's
// namespace (both directions dropped, as a failed link or firewall would)
// and returns the function that heals it. The rules are removed when the
// test ends in any case (and vanish with the namespace).
func (l *lab) partition(h *host) (heal func() error, err error) {
	var members []string
	for _, ip := range l.etcdIPs {
		members = append(members, ip.String())
	}
	set := "{ " + strings.Join(members, ", ") + " }"
	heal = func() error {
		out, err := h.ns.Run("nft", "delete", "table", "inet", partitionTable)
		if err != nil && !strings.Contains(out, "No such file") {
			return fmt.Errorf("heal %s: %v: %s", h.name, err, out)
		}
		return nil
	}
	l.t.Cleanup(func() { _ = heal() })
	for _, rule := range []string{
		"add table inet " + partitionTable,
		"add chain inet " + partitionTable + " out { type filter hook output priority 0 ; policy accept ; }",
		"add chain inet " + partitionTable + " in { type filter hook input priority 0 ; policy accept ; }",
		"add rule inet " + partitionTable + " out ip daddr " + set + " drop",
		"add rule inet " + partitionTable + " in ip saddr " + set + " drop",
	} {
		if out, err := h.ns.Run("nft", rule); err != nil {
			return heal, errors.Join(fmt.Errorf("partition %s: nft %s: %v: %s", h.name, rule, err, out), heal())
		}
	}
	return heal, nil
}

// spawn starts cmd with a parent-death SIGKILL, forking from a goroutine
// locked to its OS thread until the child exits (the signal follows the
// forking thread, not the process), and returns a channel closed when the
// child has exited.
func spawn(cmd *exec.Cmd) (<-chan struct{}, error) {
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Pdeathsig = syscall.SIGKILL
	exited := make(chan struct{})
	started := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		defer close(exited)
		if err := cmd.Start(); err != nil {
			started <- err
			return
		}
		started <- nil
		_ = cmd.Wait()
	}()
	return exited, <-started
}

// driverProc is the Docker driver (bin/ringipam-docker) running in the
// Docker host's namespace, with its plugin socket in a temporary directory.
type driverProc struct {
	argv   []string
	sock   string
	log    string
	mu     sync.Mutex
	cmd    *exec.Cmd
	exited <-chan struct{}
}

// driverStartTimeout bounds the wait for a (re)started driver to answer.
const driverStartTimeout = 30 * time.Second

// startDriver starts the driver for h on the cluster under prefix.
func (l *lab) startDriver(bin, prefix string) (*driverProc, error) {
	dir := l.t.TempDir()
	name := "chaos"
	d := &driverProc{
		sock: driver.SocketPath(dir, name),
		log:  filepath.Join(dir, "driver.log"),
		argv: []string{"ip", "netns", "exec", l.docker.ns.Name, bin, "--name", name, "--plugin-dir", dir,
			"--host", l.docker.name, "--store", "etcd", "--etcd-endpoints", strings.Join(l.endpoints(), ","),
			"--store-prefix", prefix, "--etcd-dial-timeout", "1s", "--etcd-request-timeout", "2s",
			"--timeout", "6s", "--log-level", "warn"},
	}
	l.t.Cleanup(func() { d.kill() })
	return d, d.start()
}

// start starts the driver and waits until its socket answers Activate.
func (d *driverProc) start() error {
	logf, err := os.OpenFile(d.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	defer logf.Close()
	cmd := exec.Command(d.argv[0], d.argv[1:]...)
	cmd.Stdout, cmd.Stderr = logf, logf
	exited, err := spawn(cmd)
	if err != nil {
		return fmt.Errorf("driver: %w", err)
	}
	d.mu.Lock()
	d.cmd, d.exited = cmd, exited
	d.mu.Unlock()
	hc := &http.Client{Timeout: time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", d.sock)
		},
		DisableKeepAlives: true,
	}}
	deadline := time.Now().Add(driverStartTimeout)
	for {
		resp, err := hc.Post("http://driver/Plugin.Activate", "application/json", strings.NewReader("{}"))
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case <-exited:
			return fmt.Errorf("driver exited before serving; log:\n%s", tail(d.log, 3000))
		default:
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("driver did not serve within %s; log:\n%s", driverStartTimeout, tail(d.log, 3000))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// kill SIGKILLs the driver (a crash) and waits, bounded, for it to exit.
func (d *driverProc) kill() error {
	d.mu.Lock()
	cmd, exited := d.cmd, d.exited
	d.cmd = nil
	d.mu.Unlock()
	if cmd == nil {
		return nil
	}
	_ = cmd.Process.Kill()
	select {
	case <-exited:
		return nil
	case <-time.After(30 * time.Second):
		return fmt.Errorf("driver pid %d did not exit 30s after SIGKILL", cmd.Process.Pid)
	}
}

func tail(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}
