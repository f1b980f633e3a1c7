//go:build integration

// Package cnitest is the harness the integration tests share: it builds the
// ipam-ring plugin from this checkout, finds the reference CNI binaries,
// makes CNI_PATH directories, drives libcni from inside a network namespace,
// starts the host agent (ringipamd) that plugins on an etcd store go
// through (StartAgent), and opens the store a plugin configuration names,
// for the test to inspect.
//
// Contract: only integration-tagged tests import it (it is built with the
// integration tag only). Main must be the body of the importing package's
// TestMain: it sets IPAMBin before any test runs, and nothing changes it
// afterwards, so every other function is safe for concurrent use by
// parallel tests. Functions that take a testing.TB fail the test on error
// and register their cleanups with it; the reference binaries come from
// scripts/install-deps.sh (.cache/bin) or RINGIPAM_CNI_BIN. Network
// namespaces themselves are package netns's business.
package cnitest

import (
	"bytes"
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
	_ "github.com/ringipam/ringipam/pkg/store/etcd" // storeconfig.Open's etcd backend
	"github.com/ringipam/ringipam/pkg/storeconfig"
)

// OpTimeout bounds every plugin invocation a test makes through this package.
const OpTimeout = 60 * time.Second

// BuildTimeout bounds Main's builds (and its setup).
const BuildTimeout = 5 * time.Minute

var (
	// RepoRoot is the root of this checkout.
	RepoRoot = repoRoot()
	// IPAMBin is the ipam-ring plugin Main built from this checkout.
	IPAMBin string
)

func repoRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Clean(filepath.Join(filepath.Dir(file), "..", ".."))
}

// Main is the body of a TestMain: it makes a temporary directory, builds
// ipam-ring into it (IPAMBin), runs setup (when not nil) with a context
// bounded by BuildTimeout and the directory, runs the tests and removes the
// directory. It returns the exit code for os.Exit; a failed build or setup
// is reported on stderr and runs no test.
//
// Under CI (the CI variable set) a suite run without root fails at once,
// naming itself, instead of letting every test skip.
func Main(m *testing.M, setup func(ctx context.Context, dir string) error) int {
	if os.Getenv("CI") != "" && os.Geteuid() != 0 {
		fmt.Fprintf(os.Stderr, "FAIL: suite %s needs root (network namespaces, etcd, dockerd); CI is set, so it fails instead of skipping\n",
			strings.TrimSuffix(filepath.Base(os.Args[0]), ".test"))
		return 1
	}
	tmp, err := os.MkdirTemp("", "ringipam-it-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(tmp)
	ctx, cancel := context.WithTimeout(context.Background(), BuildTimeout)
	defer cancel()
	IPAMBin = filepath.Join(tmp, "ipam-ring")
	if err := Build(ctx, IPAMBin, "./plugins/ipam-ring"); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	if setup != nil {
		if err := setup(ctx, tmp); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
	}
	return m.Run()
}

// Build builds pkg (relative to RepoRoot: "./plugins/ipam-ring") into out
// with the toolchain running the tests, the way `make build` does: static
// (CGO_ENABLED=0) and -trimpath, so the tests and benchmarks run the binary
// an operator installs (a cgo build links libc dynamically and starts
// slower). The error carries the compiler's output.
func Build(ctx context.Context, out, pkg string) error {
	build := GoCommand(ctx, RepoRoot, "build", "-trimpath", "-o", out, pkg)
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := build.CombinedOutput(); err != nil {
		return fmt.Errorf("building %s: %v\n%s", pkg, err, b)
	}
	return nil
}

// GoCommand returns `go args...` to run in dir: the go on PATH (the
// Makefile puts /usr/local/go/bin first), else the Debian/upstream default.
func GoCommand(ctx context.Context, dir string, args ...string) *exec.Cmd {
	goBin, err := exec.LookPath("go")
	if err != nil {
		goBin = "/usr/local/go/bin/go"
	}
	cmd := exec.CommandContext(ctx, goBin, args...)
	cmd.Dir = dir
	return cmd
}

// RefBin returns the path of a reference CNI binary (a plugin or cnitool)
// installed by scripts/install-deps.sh (or found in RINGIPAM_CNI_BIN).
func RefBin(t testing.TB, name string) string {
	t.Helper()
	for _, dir := range []string{os.Getenv("RINGIPAM_CNI_BIN"), filepath.Join(RepoRoot, ".cache", "bin")} {
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

// PluginDir makes a CNI_PATH directory (removed when the test ends) with
// the reference plugins refs and an "ipam-ring" that links to ipam: IPAMBin,
// or a wrapper the test wrote that runs it.
func PluginDir(t testing.TB, ipam string, refs ...string) string {
	t.Helper()
	dir := t.TempDir()
	links := map[string]string{"ipam-ring": ipam}
	for _, name := range refs {
		links[name] = RefBin(t, name)
	}
	for name, target := range links {
		if err := os.Symlink(target, filepath.Join(dir, name)); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// NewCNI returns a libcni runtime on CNI_PATH path with its own result
// cache. The explicit exec keeps libcni from setting one lazily, which
// races when goroutines share the CNIConfig.
func NewCNI(t testing.TB, path string) *libcni.CNIConfig {
	exec := &invoke.DefaultExec{RawExec: &invoke.RawExec{Stderr: os.Stderr}, PluginDecoder: version.PluginDecoder{}}
	return libcni.NewCNIConfigWithCacheDir([]string{path}, t.TempDir(), exec)
}

// ConfList is the CNI 1.1.0 network configuration list name of plugins.
func ConfList(t testing.TB, name string, plugins ...map[string]any) *libcni.NetworkConfigList {
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

// InNS runs fn, with a context bounded by OpTimeout, on a thread inside
// namespace n, so that the plugins a libcni call in fn starts run there.
func InNS(n *netns.NS, fn func(ctx context.Context) error) error {
	return n.Do(func() error {
		ctx, cancel := context.WithTimeout(context.Background(), OpTimeout)
		defer cancel()
		return fn(ctx)
	})
}

// Add runs libcni's ADD of list for rt from inside namespace n and returns
// the result in the current CNI version.
func Add(cn *libcni.CNIConfig, n *netns.NS, list *libcni.NetworkConfigList, rt *libcni.RuntimeConf) (*current.Result, error) {
	var res types.Result
	err := InNS(n, func(ctx context.Context) error {
		var err error
		res, err = cn.AddNetworkList(ctx, list, rt)
		return err
	})
	if err != nil {
		return nil, err
	}
	return current.NewResultFromResult(res)
}

// CNICode returns the CNI error code carried by err, or 0.
func CNICode(err error) uint {
	var e *types.Error
	if errors.As(err, &e) {
		return e.Code
	}
	return 0
}

// OpenStore opens the store an ipam "store" object describes (the
// pkg/storeconfig format), for the test to inspect; it is closed when the
// test ends (or earlier by the caller).
func OpenStore(t testing.TB, obj map[string]any) store.Store {
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

// Inspect runs fn with an allocator for host on the store obj describes,
// closing the store afterwards: the local store admits one process at a
// time, so call it only between plugin invocations.
func Inspect(t testing.TB, obj map[string]any, host string, fn func(a *pool.Allocator)) {
	t.Helper()
	st := OpenStore(t, obj)
	defer st.Close()
	a, err := pool.New(st, host, pool.WithTimeout(OpTimeout))
	if err != nil {
		t.Fatal(err)
	}
	fn(a)
}

// Exec runs the ipam-ring binary once for command, as a runtime would,
// with stdin and CNI_CONTAINERID containerID, and returns its stdout; on
// failure the error carries stdout (the CNI error JSON) and stderr.
func Exec(command, containerID string, stdin []byte) ([]byte, error) {
	out, _, err := ExecFull(command, containerID, stdin)
	return out, err
}

// ExecFull is Exec that also returns what the plugin wrote on stderr.
func ExecFull(command, containerID string, stdin []byte) (stdout, stderr []byte, err error) {
	ctx, cancel := context.WithTimeout(context.Background(), OpTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, IPAMBin)
	cmd.Env = []string{"CNI_COMMAND=" + command, "CNI_CONTAINERID=" + containerID, "CNI_NETNS=/var/run/netns/unused",
		"CNI_IFNAME=eth0", "CNI_PATH=" + filepath.Dir(IPAMBin), "PATH=/usr/sbin:/usr/bin:/sbin:/bin"}
	cmd.Stdin = bytes.NewReader(stdin)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		return out.Bytes(), errb.Bytes(), fmt.Errorf("ipam-ring %s %s: %v: %s %s", command, containerID, err, out.Bytes(), errb.Bytes())
	}
	return out.Bytes(), errb.Bytes(), nil
}

// NoNetNS is the CNI_NETNS of IPAM-only invocations; ipam-ring never opens it.
const NoNetNS = "/var/run/netns/ipam-only-none"

// ExecIPAM invokes the ipam-ring binary directly, as a main plugin invokes
// its IPAM plugin. conf is the network configuration (with "ipam"). Only
// ADD and CHECK get a CNI_NETNS (the CNI dispatcher requires one); DEL runs without. ADD
// returns its result; the other verbs nil.
func ExecIPAM(cmd string, conf []byte, containerID, cniArgs string) (*current.Result, error) {
	ctx, cancel := context.WithTimeout(context.Background(), OpTimeout)
	defer cancel()
	args := &invoke.Args{Command: cmd, ContainerID: containerID, IfName: "eth0", PluginArgsStr: cniArgs, Path: filepath.Dir(IPAMBin)}
	if cmd == "ADD" || cmd == "CHECK" {
		args.NetNS = NoNetNS
	}
	if cmd == "ADD" {
		r, err := invoke.ExecPluginWithResult(ctx, IPAMBin, conf, args, nil)
		if err != nil {
			return nil, err
		}
		return current.NewResultFromResult(r)
	}
	return nil, invoke.ExecPluginWithoutResult(ctx, IPAMBin, conf, args, nil)
}

// Cnitool runs the reference cnitool inside host with the environment
// added to the test's (NETCONFPATH, CNI_PATH, CAP_ARGS, ...), bounded by
// OpTimeout, and returns what it printed.
func Cnitool(t testing.TB, host *netns.NS, env []string, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), OpTimeout)
	defer cancel()
	argv := append([]string{"netns", "exec", host.Name, RefBin(t, "cnitool")}, args...)
	cmd := exec.CommandContext(ctx, "ip", argv...)
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// CleanCNICache removes cnitool's cached results of network name when the
// test ends (cnitool keeps them in libcni's default /var/lib/cni).
func CleanCNICache(t testing.TB, name string) {
	t.Cleanup(func() {
		matches, _ := filepath.Glob(filepath.Join("/var/lib/cni/results", name+"-*"))
		for _, m := range matches {
			os.Remove(m)
		}
	})
}
