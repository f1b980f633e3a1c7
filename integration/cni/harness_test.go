//go:build integration

// Package cni holds the end-to-end tests of the ipam-ring CNI plugin: the
// plugin binary built from this checkout, driven by the reference bridge
// plugin, cnitool and libcni, in real network namespaces, on the embedded
// local store and on a real etcd server.
//
// Topology: every test creates its own "host" namespaces (each with its own
// bridge, made by the bridge plugin) and one namespace per container, so
// nothing touches the machine's own interfaces. The bridge plugin runs in
// the host namespace; ipam-ring, which needs no namespace, is started
// through a wrapper that puts it back into the test's own namespace, where
// the test etcd listens on loopback.
package cni

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/invoke"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/ringipam/ringipam/integration/netns"
	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/storeconfig"
)

// opTimeout bounds every plugin invocation a test makes.
const opTimeout = 60 * time.Second

var (
	repoRoot  string // checkout root
	ipamBin   string // ipam-ring built from this checkout
	rootNSRef string // a path naming the test process's own network namespace
)

func TestMain(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	_, file, _, _ := runtime.Caller(0)
	repoRoot = filepath.Clean(filepath.Join(filepath.Dir(file), "..", ".."))
	tmp, err := os.MkdirTemp("", "ipamring-it-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(tmp)
	ipamBin = filepath.Join(tmp, "ipam-ring")
	goBin := filepath.Join(runtime.GOROOT(), "bin", "go")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	build := exec.CommandContext(ctx, goBin, "build", "-o", ipamBin, "./plugins/ipam-ring")
	build.Dir = repoRoot
	if out, err := build.CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "building ipam-ring: %v\n%s", err, out)
		return 1
	}
	// Keep a handle on our own namespace before any test switches a
	// thread: the nsenter wrapper enters it through /proc/PID/fd/N.
	self, err := os.Open("/proc/self/ns/net")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer self.Close()
	rootNSRef = fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), self.Fd())
	return m.Run()
}

// refBin returns the path of a reference CNI binary installed by
// scripts/install-deps.sh (or RINGIPAM_CNI_BIN).
func refBin(t testing.TB, name string) string {
	t.Helper()
	for _, dir := range []string{os.Getenv("RINGIPAM_CNI_BIN"), filepath.Join(repoRoot, ".cache", "bin")} {
		if dir == "" {
			continue
		}
		p := filepath.Join(dir, name)
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	t.Fatalf("%s not found in .cache/bin: run scripts/install-deps.sh (or set RINGIPAM_CNI_BIN)", name)
	return ""
}

// pluginDir makes a CNI_PATH directory with the reference plugins and
// ipam-ring. With wrapIPAM, ipam-ring is a wrapper that runs the real
// binary in the test's own network namespace (so it reaches the test etcd
// on loopback even when the main plugin runs in a host namespace).
func pluginDir(t testing.TB, wrapIPAM bool) string {
	t.Helper()
	dir := t.TempDir()
	for _, name := range []string{"bridge", "ptp", "loopback", "host-local"} {
		if err := os.Symlink(refBin(t, name), filepath.Join(dir, name)); err != nil {
			t.Fatal(err)
		}
	}
	if !wrapIPAM {
		if err := os.Symlink(ipamBin, filepath.Join(dir, "ipam-ring")); err != nil {
			t.Fatal(err)
		}
		return dir
	}
	nsenter, err := exec.LookPath("nsenter")
	if err != nil {
		t.Fatalf("nsenter (util-linux) is needed: %v", err)
	}
	script := fmt.Sprintf("#!/bin/sh\nexec %s --net=%s -- %s \"$@\"\n", nsenter, rootNSRef, ipamBin)
	if err := os.WriteFile(filepath.Join(dir, "ipam-ring"), []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

// localStore is the ipam "store" object of a fresh local store.
func localStore(t testing.TB) map[string]any {
	return map[string]any{"type": "local", "path": filepath.Join(t.TempDir(), "ringipam.db")}
}

// etcdStore is the ipam "store" object for endpoints under a fresh prefix.
func etcdStore(endpoints []string, prefix string) map[string]any {
	return map[string]any{
		"type": "etcd", "endpoints": endpoints, "prefix": prefix,
		"dialTimeout": "1s", "requestTimeout": "2s",
	}
}

// openStore opens the store an ipam "store" object describes, for the test
// to inspect; it is closed when the test ends (or earlier by the caller).
func openStore(t testing.TB, obj map[string]any) store.Store {
	t.Helper()
	b, err := json.Marshal(obj)
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := storeconfig.Parse(b)
	if err != nil {
		t.Fatal(err)
	}
	st, err := storeconfig.Open(cfg)
	if err != nil {
		t.Fatalf("opening store %s: %v", b, err)
	}
	t.Cleanup(func() { st.Close() })
	return st
}

// inspect runs fn with an allocator on the store, closing the store
// afterwards (the local store admits one process at a time).
func inspect(t testing.TB, obj map[string]any, host string, fn func(a *pool.Allocator)) {
	t.Helper()
	st := openStore(t, obj)
	defer st.Close()
	a, err := pool.New(st, host, pool.WithTimeout(opTimeout))
	if err != nil {
		t.Fatal(err)
	}
	fn(a)
}

// ipamSection is an ipam-ring "ipam" object.
func ipamSection(host string, st map[string]any, rangeSets ...[]map[string]string) map[string]any {
	return map[string]any{"type": "ipam-ring", "host": host, "store": st, "ranges": rangeSets, "timeout": "20s"}
}

func subnet(cidr string) []map[string]string { return []map[string]string{{"subnet": cidr}} }

// bridgeList is a conflist with the bridge plugin delegating to ipam-ring
// (plus any extra plugins).
func bridgeList(t testing.TB, name, bridge string, ipam map[string]any, extra ...map[string]any) *libcni.NetworkConfigList {
	t.Helper()
	plugins := []map[string]any{{
		"type": "bridge", "bridge": bridge, "isGateway": true, "ipMasq": false,
		"capabilities": map[string]bool{"ips": true}, "ipam": ipam,
	}}
	plugins = append(plugins, extra...)
	return confList(t, name, plugins...)
}

func confList(t testing.TB, name string, plugins ...map[string]any) *libcni.NetworkConfigList {
	t.Helper()
	b, err := json.Marshal(map[string]any{"cniVersion": "1.1.0", "name": name, "plugins": plugins})
	if err != nil {
		t.Fatal(err)
	}
	l, err := libcni.ConfListFromBytes(b)
	if err != nil {
		t.Fatalf("conflist %s: %v", b, err)
	}
	return l
}

// newCNI returns a libcni runtime with its own result cache. The explicit
// exec keeps libcni from setting one lazily, which races when goroutines
// share the CNIConfig.
func newCNI(t testing.TB, path string) *libcni.CNIConfig {
	exec := &invoke.DefaultExec{RawExec: &invoke.RawExec{Stderr: os.Stderr}, PluginDecoder: version.PluginDecoder{}}
	return libcni.NewCNIConfigWithCacheDir([]string{path}, t.TempDir(), exec)
}

// inHost runs fn on a thread inside host (plugins fn execs start there).
func inHost(t testing.TB, host *netns.NS, fn func() error) error {
	t.Helper()
	return host.Do(fn)
}

// addIn adds container c to list from inside host and returns the result.
func addIn(t testing.TB, cn *libcni.CNIConfig, host *netns.NS, list *libcni.NetworkConfigList, rt *libcni.RuntimeConf) (*current.Result, error) {
	t.Helper()
	var res types.Result
	err := inHost(t, host, func() error {
		ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
		defer cancel()
		var err error
		res, err = cn.AddNetworkList(ctx, list, rt)
		return err
	})
	if err != nil {
		return nil, err
	}
	return current.NewResultFromResult(res)
}

// rt is the runtime configuration of one container attachment.
func rt(c *netns.NS, id string) *libcni.RuntimeConf {
	return &libcni.RuntimeConf{ContainerID: id, NetNS: c.Path, IfName: "eth0"}
}

// noNetNS is the CNI_NETNS of IPAM-only invocations; ipam-ring never opens it.
const noNetNS = "/var/run/netns/ipam-only-none"

// execIPAM invokes the ipam-ring binary directly, as a main plugin invokes
// its IPAM plugin. conf is the network configuration (with "ipam"). Only
// ADD and CHECK get a CNI_NETNS (skel requires one); DEL runs without.
func execIPAM(cmd string, conf []byte, containerID, cniArgs string) (*current.Result, error) {
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	args := &invoke.Args{Command: cmd, ContainerID: containerID, IfName: "eth0", PluginArgsStr: cniArgs, Path: filepath.Dir(ipamBin)}
	if cmd == "ADD" || cmd == "CHECK" {
		args.NetNS = noNetNS
	}
	if cmd == "ADD" {
		r, err := invoke.ExecPluginWithResult(ctx, ipamBin, conf, args, nil)
		if err != nil {
			return nil, err
		}
		return current.NewResultFromResult(r)
	}
	return nil, invoke.ExecPluginWithoutResult(ctx, ipamBin, conf, args, nil)
}

// netConf is a single-plugin network configuration carrying ipam.
func netConf(t testing.TB, name string, ipam map[string]any, extra map[string]any) []byte {
	t.Helper()
	m := map[string]any{"cniVersion": "1.1.0", "name": name, "type": "bridge", "ipam": ipam}
	for k, v := range extra {
		m[k] = v
	}
	b, err := json.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// cniCode returns the CNI error code carried by err, or 0.
func cniCode(err error) uint {
	var e *types.Error
	if errors.As(err, &e) {
		return e.Code
	}
	return 0
}

// ipsOf returns the addresses (CIDR form) of a result.
func ipsOf(r *current.Result) []string {
	var s []string
	for _, ip := range r.IPs {
		s = append(s, ip.Address.String())
	}
	return s
}

// cnitool runs cnitool inside host with the given environment.
func cnitool(t testing.TB, host *netns.NS, env []string, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	argv := append([]string{"netns", "exec", host.Name, refBin(t, "cnitool")}, args...)
	cmd := exec.CommandContext(ctx, "ip", argv...)
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// cleanCNICache removes cnitool's cached results of network name (cnitool
// keeps them in the default /var/lib/cni).
func cleanCNICache(t testing.TB, name string) {
	t.Cleanup(func() {
		for _, dir := range []string{"/var/lib/cni/results"} {
			matches, _ := filepath.Glob(filepath.Join(dir, name+"-*"))
			for _, m := range matches {
				os.Remove(m)
			}
		}
	})
}

func joinErrs(errs []error) error { return errors.Join(errs...) }

func contains(list []string, s string) bool {
	for _, x := range list {
		if strings.EqualFold(x, s) {
			return true
		}
	}
	return false
}
