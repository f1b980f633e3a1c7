//go:build integration

// Package agent_test runs ringipamd, the host agent, on real parts: a real
// etcd, the real ipam-ring and portmap-ingress binaries, network namespaces
// as hosts, nftables, and a real browser for the status page.
package agent_test

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	current "github.com/containernetworking/cni/pkg/types/100"

	"github.com/ringipam/ringipam/cmd/ringipamd/agent"
	"github.com/ringipam/ringipam/integration/cnitest"
	"github.com/ringipam/ringipam/integration/netns"
	"github.com/ringipam/ringipam/internal/testenv"
	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/storeconfig"
)

var agentBin, portmapBin, ringctlBin string

func TestMain(m *testing.M) {
	os.Exit(cnitest.Main(m, func(ctx context.Context, dir string) error {
		agentBin = filepath.Join(dir, "ringipamd")
		if err := cnitest.Build(ctx, agentBin, "./cmd/ringipamd"); err != nil {
			return err
		}
		ringctlBin = filepath.Join(dir, "ringctl")
		if err := cnitest.Build(ctx, ringctlBin, "./cmd/ringctl"); err != nil {
			return err
		}
		portmapBin = filepath.Join(dir, "portmap-ingress")
		return cnitest.Build(ctx, portmapBin, "./plugins/portmap-ingress")
	}))
}

// cluster is one real etcd under a key prefix of the test's own.
type cluster struct {
	etcd   *testenv.Etcd
	prefix string
}

func newCluster(t *testing.T) *cluster {
	netns.RequireRoot(t)
	return &cluster{etcd: testenv.StartEtcd(t), prefix: "/" + netns.Unique("ag-") + "/"}
}

// storeObj is the plugins' "store" object, reaching etcd at endpoint
// (default: the test's loopback endpoint).
func (c *cluster) storeObj(endpoint string) map[string]any {
	if endpoint == "" {
		endpoint = c.etcd.Endpoints()[0]
	}
	return map[string]any{"type": "etcd", "endpoints": []string{endpoint}, "prefix": c.prefix}
}

// allocator inspects the store as host, with a clock.
func (c *cluster) allocator(t *testing.T, host string, now func() time.Time) *pool.Allocator {
	t.Helper()
	st := cnitest.OpenStore(t, c.storeObj(""))
	opts := []pool.Option{pool.WithTimeout(cnitest.OpTimeout)}
	if now != nil {
		opts = append(opts, pool.WithClock(now))
	}
	a, err := pool.New(st, host, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

func (c *cluster) openStore(t *testing.T) store.Store { return cnitest.OpenStore(t, c.storeObj("")) }

// agentConfig is an in-process agent's configuration for host.
func (c *cluster) agentConfig(host string) agent.Config {
	cfg := agent.DefaultConfig()
	cfg.Host = host
	cfg.Store = storeconfig.Config{Type: storeconfig.TypeEtcd, Endpoints: c.etcd.Endpoints(), Prefix: c.prefix}
	cfg.LeaseTTL = storeconfig.Duration(2 * time.Second)
	cfg.Heartbeat = storeconfig.Duration(200 * time.Millisecond)
	cfg.SweepInterval = storeconfig.Duration(100 * time.Millisecond)
	cfg.StatusRefresh = storeconfig.Duration(200 * time.Millisecond)
	cfg.Ingress = false
	cfg.Timeout = storeconfig.Duration(10 * time.Second)
	return cfg
}

// inProcess is an agent running in the test process.
type inProcess struct {
	url    string
	socket string // its agent socket (etcd)
	stop   func()
}

// store is a copy of the store object st whose plugins go through this
// agent.
func (p *inProcess) store(st map[string]any) map[string]any { return throughAgent(st, p.socket) }

// startAgent runs an agent in the test process until stop (or the test's
// end), serving HTTP on a loopback port.
func startAgent(t *testing.T, cfg agent.Config, opts ...agent.Option) *inProcess {
	t.Helper()
	if cfg.Store.Type == storeconfig.TypeEtcd && cfg.Store.AgentSocket == "" {
		cfg.Store.AgentSocket = socketPath(t)
		cfg.Store.DelQueue = delQueueOf(cfg.Store.AgentSocket)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.NewTextHandler(testWriter{t, cfg.Host}, &slog.HandlerOptions{Level: slog.LevelWarn}))
	a, err := agent.New(cfg, log, append(opts, agent.WithListener(l))...)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	stopped := false
	p := &inProcess{url: "http://" + l.Addr().String(), socket: cfg.Store.AgentSocket}
	p.stop = func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("agent %s: %v", cfg.Host, err)
			}
		case <-time.After(30 * time.Second):
			t.Errorf("agent %s did not stop within 30s", cfg.Host)
		}
	}
	t.Cleanup(p.stop)
	return p
}

type testWriter struct {
	t    *testing.T
	host string
}

func (w testWriter) Write(b []byte) (int, error) {
	w.t.Logf("[%s] %s", w.host, strings.TrimSpace(string(b)))
	return len(b), nil
}

// httpGet fetches url with a deadline.
func httpGet(url string) (string, int, error) {
	c := http.Client{Timeout: 5 * time.Second}
	r, err := c.Get(url)
	if err != nil {
		return "", 0, err
	}
	defer r.Body.Close()
	b, err := io.ReadAll(r.Body)
	return string(b), r.StatusCode, err
}

// metric reads one sample (name with its exact label set, "" for none)
// from a Prometheus text page.
func metric(t *testing.T, url, series string) float64 {
	t.Helper()
	body, code, err := httpGet(url + "/metrics")
	if err != nil || code != 200 {
		t.Fatalf("metrics of %s: %d %v", url, code, err)
	}
	sc := bufio.NewScanner(strings.NewReader(body))
	for sc.Scan() {
		name, val, ok := strings.Cut(sc.Text(), " ")
		if ok && name == series {
			f, err := strconv.ParseFloat(val, 64)
			if err != nil {
				t.Fatalf("%s: %v", sc.Text(), err)
			}
			return f
		}
	}
	t.Fatalf("no %s in the metrics of %s", series, url)
	return 0
}

// waitFor polls ok every 50ms until it holds, failing the test after
// patience.
func waitFor(t *testing.T, patience time.Duration, what string, ok func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(patience)
	for {
		done, state := ok()
		if done {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("after %s still waiting for %s; last seen: %s", patience, what, state)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// stateOf is host's state as a with orphanAfter judges it.
func stateOf(t *testing.T, a *pool.Allocator, host string, orphanAfter time.Duration) (pool.HostInfo, bool) {
	t.Helper()
	hosts, err := a.Hosts(context.Background(), orphanAfter)
	if err != nil {
		t.Fatal(err)
	}
	for _, h := range hosts {
		if h.Name == host {
			return h, true
		}
	}
	return pool.HostInfo{}, false
}

// ipamConf is an ipam-ring network configuration for host on pool subnet.
func ipamConf(t *testing.T, network, host, subnet string, st map[string]any, prev *current.Result) []byte {
	t.Helper()
	m := map[string]any{"cniVersion": "1.1.0", "name": network, "type": "bridge",
		"ipam": map[string]any{"type": "ipam-ring", "host": host, "store": st, "timeout": "30s",
			"ranges": [][]map[string]string{{{"subnet": subnet}}}}}
	if prev != nil {
		m["prevResult"] = prev
	}
	b, err := json.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// binaryAgent is ringipamd running as its own process.
type binaryAgent struct {
	cmd    *exec.Cmd
	done   chan struct{}
	log    *strings.Builder
	socket string // its agent socket
}

// store is a copy of the store object st whose plugins go through this
// agent.
func (b *binaryAgent) store(st map[string]any) map[string]any { return throughAgent(st, b.socket) }

// throughAgent is a copy of the store object st whose plugins go through
// the agent at sock (and queue their DELs beside it).
func throughAgent(st map[string]any, sock string) map[string]any {
	c := maps.Clone(st)
	c["agentSocket"], c["delQueue"] = sock, delQueueOf(sock)
	return c
}

// delQueueOf is the DEL queue the tests give the agent of socket sock.
func delQueueOf(sock string) string { return filepath.Join(filepath.Dir(sock), "del-queue") }

// startBinary starts bin/ringipamd with args (inside namespace ns when not
// nil); it is killed when the test ends.
func startBinary(t *testing.T, ns *netns.NS, args ...string) *binaryAgent {
	t.Helper()
	if !slices.Contains(args, "--store-socket") {
		// Each agent its own socket: several run on this machine.
		args = append(args, "--store-socket", socketPath(t))
	}
	sock := args[slices.Index(args, "--store-socket")+1]
	if !slices.Contains(args, "--del-queue") {
		// And its own DEL queue, beside its socket.
		args = append(args, "--del-queue", delQueueOf(sock))
	}
	argv := append([]string{agentBin}, args...)
	if ns != nil {
		argv = append([]string{"ip", "netns", "exec", ns.Name}, argv...)
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	b := &binaryAgent{cmd: cmd, done: make(chan struct{}), log: &strings.Builder{}, socket: sock}
	pr, pw := io.Pipe()
	cmd.Stdout, cmd.Stderr = pw, pw
	logged := make(chan struct{})
	go func() {
		defer close(logged)
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			b.log.WriteString(sc.Text() + "\n")
		}
	}()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { _ = cmd.Wait(); pw.Close(); <-logged; close(b.done) }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		select {
		case <-b.done:
		case <-time.After(10 * time.Second):
		}
		if t.Failed() {
			t.Logf("ringipamd %v output:\n%s", args, b.log.String())
		}
	})
	return b
}

// socketPath is a fresh path for an agent's store socket, short enough
// for a unix socket address.
func socketPath(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "rs")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return filepath.Join(dir, "store.sock")
}

func freePort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

func symlink(target, link string) error { return os.Symlink(target, link) }
