//go:build integration

// Package docker holds the end-to-end tests of ringipam-docker, the Docker
// remote IPAM driver: the driver binary built from this checkout serving
// Debian's dockerd (docker.io 20.10), with containers of a test image made
// by `docker import` from a static Go binary (no registry needed).
//
// Isolation: every dockerd a test starts runs in a network namespace of its
// own (netns.New, entered with nsenter so that /sys and the cgroup mounts
// stay the machine's), with its own --data-root, --exec-root, API socket
// and pidfile, --bridge none and --iptables=false, so its bridges, routes
// and containers never touch the machine's interfaces or another test's
// dockerd. The drivers run in the test's own namespace and listen in
// /run/docker/plugins under random names. Every process, container,
// network, socket, mount and directory is removed by t.Cleanup, also when a
// test fails. Every wait has a deadline.
package docker

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ringipam/ringipam/docker-driver/driver"
	"github.com/ringipam/ringipam/integration/cnitest"
	"github.com/ringipam/ringipam/integration/netns"
	"github.com/ringipam/ringipam/internal/testenv"
	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/store"
	etcdstore "github.com/ringipam/ringipam/pkg/store/etcd"
	"github.com/ringipam/ringipam/pkg/store/local"
)

const (
	dockerdBin = "/usr/sbin/dockerd"
	// cmdTimeout bounds one docker CLI command.
	cmdTimeout = 2 * time.Minute
	// startTimeout bounds the wait for a dockerd or a driver to serve.
	startTimeout = 60 * time.Second
	// stopTimeout bounds a graceful stop before the process is killed.
	stopTimeout = 60 * time.Second
	pluginDir   = "/run/docker/plugins"
	image       = "ringipam-it:sleeper"
)

var (
	driverBin string // ringipam-docker built from this checkout
	imageTar  string // rootfs tarball holding /sleeper
	dockerCLI string
)

func TestMain(m *testing.M) { os.Exit(cnitest.Main(m, setup)) }

// setup builds the driver and the test image into tmp (cnitest.Main has
// built ipam-ring) and finds the docker CLI.
func setup(ctx context.Context, tmp string) error {
	driverBin = filepath.Join(tmp, "ringipam-docker")
	if err := cnitest.Build(ctx, driverBin, "./docker-driver"); err != nil {
		return err
	}
	// The test image: one static binary that sleeps until SIGTERM.
	src := filepath.Join(tmp, "sleeper")
	rootfs := filepath.Join(tmp, "rootfs")
	for _, d := range []string{src, rootfs} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	prog := "package main\n\nimport (\n\t\"os\"\n\t\"os/signal\"\n\t\"syscall\"\n)\n\n" +
		"func main() {\n\tc := make(chan os.Signal, 1)\n\tsignal.Notify(c, syscall.SIGTERM, syscall.SIGINT)\n\t<-c\n}\n"
	if err := os.WriteFile(filepath.Join(src, "main.go"), []byte(prog), 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(src, "go.mod"), []byte("module sleeper\n\ngo 1.22\n"), 0o644); err != nil {
		return err
	}
	build := cnitest.GoCommand(ctx, src, "build", "-o", filepath.Join(rootfs, "sleeper"), ".")
	build.Env = append(os.Environ(), "CGO_ENABLED=0", "GOFLAGS=-buildvcs=false", "GOWORK=off")
	if out, err := build.CombinedOutput(); err != nil {
		return fmt.Errorf("building the test image binary: %v\n%s", err, out)
	}
	imageTar = filepath.Join(tmp, "image.tar")
	if out, err := exec.CommandContext(ctx, "tar", "-C", rootfs, "-cf", imageTar, ".").CombinedOutput(); err != nil {
		return fmt.Errorf("tar: %v\n%s", err, out)
	}
	// The CLI of the same release as the daemon (a newer one may sit
	// earlier in PATH).
	dockerCLI = "/usr/bin/docker"
	if _, err := os.Stat(dockerCLI); err != nil {
		if dockerCLI, err = exec.LookPath("docker"); err != nil {
			return errors.New("no docker CLI: install docker.io")
		}
	}
	return nil
}

func requireDocker(t *testing.T) {
	t.Helper()
	netns.RequireRoot(t)
	if _, err := os.Stat(dockerdBin); err != nil {
		t.Fatalf("%s missing (%v): apt-get install docker.io", dockerdBin, err)
	}
	if _, err := exec.LookPath("nsenter"); err != nil {
		t.Fatalf("nsenter (util-linux) missing: %v", err)
	}
}

// tempDir is a short temporary directory (unix socket paths are limited
// to 108 bytes), removed at cleanup after unmounting anything left in it.
func tempDir(t *testing.T, prefix string) string {
	t.Helper()
	dir, err := os.MkdirTemp("", prefix)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		unmountUnder(t, dir)
		if err := os.RemoveAll(dir); err != nil {
			t.Errorf("remove %s: %v", dir, err)
		}
	})
	return dir
}

// unmountUnder lazily unmounts every mount point below dir, deepest first.
func unmountUnder(t *testing.T, dir string) {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Errorf("mountinfo: %v", err)
		return
	}
	var mps []string
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) > 4 && strings.HasPrefix(f[4], dir+"/") {
			mps = append(mps, f[4])
		}
	}
	slices.SortFunc(mps, func(a, b string) int { return len(b) - len(a) })
	for _, mp := range mps {
		if err := syscall.Unmount(mp, syscall.MNT_DETACH); err != nil {
			t.Logf("unmount %s: %v", mp, err)
		}
	}
}

// startProc starts argv, its output appended to logPath, as a process
// that dies with the test binary (parent-death signal); stop it with
// Stop(stopTimeout) (SIGTERM, then SIGKILL).
func startProc(t *testing.T, logPath string, argv ...string) *testenv.Proc {
	t.Helper()
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	p, err := testenv.StartProc(filepath.Base(argv[0]), logPath, cmd)
	if err != nil {
		t.Fatalf("start %v: %v", argv, err)
	}
	return p
}

func tail(path string, n int) string {
	b, _ := os.ReadFile(path)
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// ---------------------------------------------------------------- dockerd

// dockerd is one test-owned Docker daemon in its own network namespace.
type dockerd struct {
	t    *testing.T
	name string
	dir  string
	ns   *netns.NS
	p    *testenv.Proc
	cfg  string // DOCKER_CONFIG of the CLI
	// liveRestore is passed on the next start.
	liveRestore bool
}

func startDockerd(t *testing.T, name string, liveRestore bool) *dockerd {
	t.Helper()
	d := &dockerd{t: t, name: name, ns: netns.New(t, "dkr"), liveRestore: liveRestore}
	d.dir = tempDir(t, "rid-")
	d.cfg = filepath.Join(d.dir, "cli")
	if err := os.MkdirAll(d.cfg, 0o700); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(d.cleanup)
	d.start()
	if out, err := d.docker("import", "-c", `ENTRYPOINT ["/sleeper"]`, imageTar, image); err != nil {
		t.Fatalf("docker import: %v\n%s", err, out)
	}
	return d
}

func (d *dockerd) sock() string { return filepath.Join(d.dir, "docker.sock") }

func (d *dockerd) start() {
	d.t.Helper()
	args := []string{"nsenter", "--net=" + d.ns.Path, "--", dockerdBin,
		"--data-root", filepath.Join(d.dir, "data"),
		"--exec-root", filepath.Join(d.dir, "exec"),
		"-H", "unix://" + d.sock(),
		"--pidfile", filepath.Join(d.dir, "docker.pid"),
		"--bridge", "none", "--iptables=false", "--ip6tables=false", "--ip-masq=false",
		"--default-address-pool", "base=198.19.192.0/18,size=24",
	}
	if d.liveRestore {
		args = append(args, "--live-restore")
	}
	d.p = startProc(d.t, filepath.Join(d.dir, "dockerd.log"), args...)
	deadline := time.Now().Add(startTimeout)
	for {
		if _, err := d.docker("version", "--format", "{{.Server.Version}}"); err == nil {
			return
		}
		if d.p.ExitErr() != nil || time.Now().After(deadline) {
			d.t.Fatalf("dockerd %s did not come up within %s; log:\n%s", d.name, startTimeout, tail(d.p.Log, 30))
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// restart stops dockerd gracefully and starts it again with liveRestore.
func (d *dockerd) restart(liveRestore bool) {
	d.t.Helper()
	if !d.p.Stop(stopTimeout) {
		d.t.Fatalf("dockerd %s had to be killed; log:\n%s", d.name, tail(d.p.Log, 30))
	}
	d.liveRestore = liveRestore
	d.start()
}

func (d *dockerd) cleanup() {
	if d.p == nil {
		return
	}
	if d.p.ExitErr() == nil {
		if ids, err := d.docker("ps", "-aq"); err == nil && strings.TrimSpace(ids) != "" {
			if out, err := d.docker(append([]string{"rm", "-f"}, strings.Fields(ids)...)...); err != nil {
				d.t.Errorf("removing containers: %v\n%s", err, out)
			}
		}
		if out, err := d.docker("network", "prune", "-f"); err != nil {
			d.t.Errorf("removing networks: %v\n%s", err, out)
		}
	}
	if !d.p.Stop(stopTimeout) {
		d.t.Errorf("dockerd %s had to be killed", d.name)
	}
	if d.t.Failed() {
		d.t.Logf("dockerd %s log tail:\n%s", d.name, tail(d.p.Log, 40))
	}
}

// docker runs the CLI against this daemon.
func (d *dockerd) docker(args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), cmdTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, dockerCLI, args...)
	cmd.Env = append(os.Environ(), "DOCKER_HOST=unix://"+d.sock(), "DOCKER_CONFIG="+d.cfg)
	out, err := cmd.CombinedOutput()
	return strings.TrimSpace(string(out)), err
}

func (d *dockerd) must(args ...string) string {
	d.t.Helper()
	out, err := d.docker(args...)
	if err != nil {
		d.t.Fatalf("docker %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return out
}

// ip returns a container's address on network.
func (d *dockerd) ip(container, network string) netip.Addr {
	d.t.Helper()
	out := d.must("inspect", "-f", fmt.Sprintf(`{{(index .NetworkSettings.Networks %q).IPAddress}}`, network), container)
	a, err := netip.ParseAddr(out)
	if err != nil {
		d.t.Fatalf("container %s has no address on %s: %q", container, network, out)
	}
	return a
}

// running lists the names of running containers.
func (d *dockerd) running() []string {
	d.t.Helper()
	out := d.must("ps", "--format", "{{.Names}}")
	names := strings.Fields(out)
	slices.Sort(names)
	return names
}

// waitRunning waits (with a deadline) until exactly want are running.
func (d *dockerd) waitRunning(want []string) {
	d.t.Helper()
	want = slices.Clone(want)
	slices.Sort(want)
	deadline := time.Now().Add(startTimeout)
	for {
		got := d.running()
		if slices.Equal(got, want) {
			return
		}
		if time.Now().After(deadline) {
			d.t.Fatalf("running containers %v, want %v (waited %s)", got, want, startTimeout)
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// ---------------------------------------------------------------- driver

// drv is one ringipam-docker process.
type drv struct {
	t     *testing.T
	name  string
	host  string
	args  []string
	log   string
	p     *testenv.Proc
	store storeSpec
}

// storeSpec says which store a driver uses, so the test can read it too.
type storeSpec struct {
	path      string   // local
	endpoints []string // etcd
	prefix    string
}

func (s storeSpec) flags() []string {
	if s.path != "" {
		return []string{"--store", "local", "--store-path", s.path}
	}
	return []string{"--store", "etcd", "--etcd-endpoints", strings.Join(s.endpoints, ","), "--store-prefix", s.prefix,
		"--etcd-dial-timeout", "2s", "--etcd-request-timeout", "5s"}
}

// open opens the store for inspection; closed at cleanup.
func (s storeSpec) open(t *testing.T) store.Store {
	t.Helper()
	var (
		st  store.Store
		err error
	)
	if s.path != "" {
		st, err = local.New(local.Config{Path: s.path})
	} else {
		st, err = etcdstore.New(etcdstore.Config{Endpoints: s.endpoints, Prefix: s.prefix})
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	return st
}

func startDriver(t *testing.T, host string, st storeSpec, extra ...string) *drv {
	t.Helper()
	d := &drv{t: t, name: netns.Unique("ringipam-it-"), host: host, store: st}
	logDir := tempDir(t, "ridrv-")
	d.args = append([]string{driverBin, "--name", d.name, "--host", host, "--plugin-dir", pluginDir, "--log-level", "debug",
		"--default-pool", "base=198.18.200.0/22,size=24"}, st.flags()...)
	d.args = append(d.args, extra...)
	t.Cleanup(func() {
		if d.p != nil && !d.p.Stop(stopTimeout) {
			t.Errorf("driver %s had to be killed", d.name)
		}
		if err := os.Remove(driver.SocketPath(pluginDir, d.name)); err != nil && !os.IsNotExist(err) {
			t.Errorf("driver socket: %v", err)
		}
		if t.Failed() && d.p != nil {
			t.Logf("driver %s (%s) log tail:\n%s", d.name, host, tail(d.p.Log, 40))
		}
	})
	d.log = filepath.Join(logDir, "driver.log")
	d.start()
	return d
}

func (d *drv) start() {
	d.t.Helper()
	d.p = startProc(d.t, d.log, d.args...)
	sock := driver.SocketPath(pluginDir, d.name)
	c := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", sock)
		},
	}}
	deadline := time.Now().Add(startTimeout)
	for {
		res, err := c.Post("http://plugin/Plugin.Activate", "application/json", strings.NewReader("{}"))
		if err == nil {
			res.Body.Close()
			if res.StatusCode == 200 {
				return
			}
		}
		if d.p.ExitErr() != nil || time.Now().After(deadline) {
			d.t.Fatalf("driver %s did not serve within %s; log:\n%s", d.name, startTimeout, tail(d.p.Log, 30))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func (d *drv) restart() {
	d.t.Helper()
	if !d.p.Stop(stopTimeout) {
		d.t.Fatalf("driver %s had to be killed", d.name)
	}
	d.start()
}

// served counts the driver's successfully served requests of a method, from
// its debug log.
func (d *drv) served(method string) int {
	b, _ := os.ReadFile(d.log)
	return strings.Count(string(b), `msg="request served" method=`+method+" ")
}

// held returns the addresses the store records for host on the pool.
func held(t *testing.T, st store.Store, poolName, host string) map[netip.Addr]pool.Owner {
	t.Helper()
	a, err := pool.New(st, "inspector", pool.WithTimeout(30*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	allocs, err := a.List(context.Background(), pool.Filter{Pool: poolName, Host: host})
	if err != nil {
		t.Fatal(err)
	}
	out := map[netip.Addr]pool.Owner{}
	for _, al := range allocs {
		for _, x := range al.Addrs {
			if x.Pool != poolName {
				continue
			}
			if prev, dup := out[x.Addr]; dup {
				t.Fatalf("store records %s for %s and %s", x.Addr, prev, al.Owner)
			}
			out[x.Addr] = al.Owner
		}
	}
	return out
}

// checkPool runs the pool library's consistency check.
func checkPool(t *testing.T, st store.Store, poolName string) {
	t.Helper()
	a, err := pool.New(st, "inspector", pool.WithTimeout(30*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	problems, err := a.Check(context.Background(), poolName)
	if err != nil {
		t.Fatal(err)
	}
	if len(problems) > 0 {
		t.Fatalf("pool %s is inconsistent:\n%s", poolName, strings.Join(problems, "\n"))
	}
}

func keys[K comparable, V any](m map[K]V) map[K]bool {
	out := map[K]bool{}
	for k := range m {
		out[k] = true
	}
	return out
}

// cniAdd runs the ipam-ring plugin's ADD for containerID as a runtime's
// main plugin would, and returns the address and gateway it handed out.
// A plugin error comes back as an error holding the CNI error JSON.
func cniAdd(conf []byte, containerID string) (addr, gw netip.Addr, err error) {
	out, err := cnitest.Exec("ADD", containerID, conf)
	if err != nil {
		return netip.Addr{}, netip.Addr{}, err
	}
	var res struct {
		IPs []struct {
			Address string `json:"address"`
			Gateway string `json:"gateway"`
		} `json:"ips"`
	}
	if err := json.Unmarshal(out, &res); err != nil || len(res.IPs) != 1 {
		return netip.Addr{}, netip.Addr{}, fmt.Errorf("ipam-ring ADD %s: result %s: %v", containerID, out, err)
	}
	p, err := netip.ParsePrefix(res.IPs[0].Address)
	if err != nil {
		return netip.Addr{}, netip.Addr{}, err
	}
	gw, _ = netip.ParseAddr(res.IPs[0].Gateway)
	return p.Addr(), gw, nil
}

// freeLoopbackAddr returns a loopback TCP address that was free a moment ago.
func freeLoopbackAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// scrape fetches the driver's Prometheus metrics.
func scrape(t *testing.T, addr string) string {
	t.Helper()
	c := &http.Client{Timeout: 10 * time.Second}
	res, err := c.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	var b bytes.Buffer
	if _, err := b.ReadFrom(res.Body); err != nil {
		t.Fatal(err)
	}
	return b.String()
}
