// Package testenv starts real servers for integration tests and benchmarks.
//
// StartEtcd runs Debian's /usr/bin/etcd as a one-member cluster on free
// loopback ports with a temporary data directory, waits (with a deadline)
// until it serves requests, and registers a cleanup that kills it; the data
// directory is removed with the test's temp dirs. A missing binary fails the
// test with the command that installs it: integration tests never skip
// silently.
//
// StartEtcdTLS does the same with TLS on the client port and client
// certificate authentication (--client-cert-auth): it makes a fresh test CA
// with NewTLSFiles and returns the files a client needs next to the server.
// Peer traffic stays plain http on loopback.
//
// StartEtcdCluster runs a cluster of several members (three by default),
// each its own /usr/bin/etcd process with its own data directory, on free
// loopback ports or, with ClusterOptions.Netns, on fixed ports of given
// addresses inside a network namespace the test made. It waits (with a
// deadline) until every member is healthy; Leader asks the members' status
// API which one leads, and each member can be stopped (SIGKILL) and started
// again on its data.
//
// An *Etcd is safe for use by one test goroutine at a time (Stop and Start
// are not meant to race with each other); the server itself serves any
// number of clients. An *EtcdCluster's Leader may be called from any
// goroutine. If the test binary dies, the kernel kills the server
// too (parent-death signal), so no etcd outlives its test.
package testenv

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"
)

// EtcdBinary is where scripts/install-deps.sh puts the etcd server.
const EtcdBinary = "/usr/bin/etcd"

// startTimeout bounds the wait for a started etcd to become healthy.
const startTimeout = 60 * time.Second

// Etcd is one running (or stopped) etcd server of a test: a single-member
// cluster of its own, or a member of an EtcdCluster.
type Etcd struct {
	tb      testing.TB
	dataDir string
	logPath string
	client  string // http://127.0.0.1:port, or https:// with TLS
	peer    string
	name    string
	cluster string // --initial-cluster: every member's name=peerURL
	netns   string // ip netns name the server runs in; "" for the test's own
	// dial reaches client from the test process (nil: a plain dialer).
	dial   func(ctx context.Context, network, addr string) (net.Conn, error)
	tls    *TLSFiles   // nil: plain http
	probe  *tls.Config // client side of tls, for the health probe
	mu     sync.Mutex
	cmd    *exec.Cmd
	exited chan struct{}
	closed bool
}

// StartEtcd starts a fresh single-member etcd for tb and waits until it is
// healthy. It fails tb (never skips) if /usr/bin/etcd is missing.
func StartEtcd(tb testing.TB) *Etcd {
	tb.Helper()
	return startEtcd(tb, false, true)
}

// StartEtcdOnDisk is StartEtcd with the data directory on the test's temp
// dir (the disk) instead of tmpfs: every commit pays etcd's WAL fsync, as in
// production. For benchmarks that compare the two.
func StartEtcdOnDisk(tb testing.TB) *Etcd {
	tb.Helper()
	return startEtcd(tb, false, false)
}

// StartEtcdTLS starts a fresh single-member etcd that serves clients only
// over TLS (https:// endpoints) and requires a client certificate signed by
// its CA. The returned files are a new CA, the server's certificate and a
// client certificate and key (see TLSFiles); they live in tb's temp dir.
// Health checks, Stop and Start work as with StartEtcd.
func StartEtcdTLS(tb testing.TB) (*Etcd, TLSFiles) {
	tb.Helper()
	e := startEtcd(tb, true, true)
	return e, *e.tls
}

// memDir returns a fresh directory on tmpfs (/dev/shm) when there is one,
// else a temp dir, removed when tb ends. The test etcd keeps its data there:
// on a shared virtual disk a burst of WAL fsyncs can stall raft past etcd's
// own request timeout ("etcdserver: request timed out"), and these tests
// check ringipam's correctness, not the disk's durability.
func memDir(tb testing.TB) string {
	dir, err := os.MkdirTemp("/dev/shm", "ringipam-etcd-")
	if err != nil {
		return tb.TempDir()
	}
	tb.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

func startEtcd(tb testing.TB, withTLS, onTmpfs bool) *Etcd {
	tb.Helper()
	if _, err := os.Stat(EtcdBinary); err != nil {
		tb.Fatalf("testenv: %s not found (%v): run scripts/install-deps.sh as root", EtcdBinary, err)
	}
	dir := tb.TempDir()
	dataParent := dir
	if onTmpfs {
		dataParent = memDir(tb)
	}
	e := &Etcd{
		tb:      tb,
		dataDir: filepath.Join(dataParent, "data"),
		logPath: filepath.Join(dir, "etcd.log"),
		name:    "test",
	}
	scheme := "http://"
	if withTLS {
		tlsDir := filepath.Join(dir, "tls")
		if err := os.Mkdir(tlsDir, 0o700); err != nil {
			tb.Fatalf("testenv: %v", err)
		}
		files := NewTLSFiles(tb, tlsDir)
		probe, err := files.ClientConfig()
		if err != nil {
			tb.Fatalf("testenv: TLS client config: %v", err)
		}
		e.tls, e.probe, scheme = &files, probe, "https://"
	}
	tb.Cleanup(e.Close)
	// Free ports can be taken by someone else between probing and binding:
	// try a few pairs.
	var err error
	for attempt := 0; attempt < 3; attempt++ {
		cp, pp, perr := freePorts()
		if perr != nil {
			tb.Fatalf("testenv: %v", perr)
		}
		e.client = scheme + "127.0.0.1:" + strconv.Itoa(cp)
		e.peer = "http://127.0.0.1:" + strconv.Itoa(pp)
		e.cluster = e.name + "=" + e.peer
		if err = e.start(); err == nil {
			return e
		}
		e.kill()
		os.RemoveAll(e.dataDir)
	}
	tb.Fatalf("testenv: etcd did not start: %v", err)
	return nil
}

// Endpoints returns the client URLs, for clientv3.Config.Endpoints.
func (e *Etcd) Endpoints() []string { return []string{e.client} }

// Name returns the member's name in its cluster.
func (e *Etcd) Name() string { return e.name }

// DataDir returns the server's data directory.
func (e *Etcd) DataDir() string { return e.dataDir }

// Stop kills the server (SIGKILL, as a crash would) and waits for it to
// exit. The data directory is kept for Start.
func (e *Etcd) Stop() {
	e.tb.Helper()
	e.kill()
}

// Start restarts a stopped server on the same ports and data and waits until
// it is healthy. It fails the test if it cannot.
func (e *Etcd) Start() {
	e.tb.Helper()
	if err := e.Restart(); err != nil {
		e.tb.Fatalf("testenv: %v", err)
	}
}

// Restart is Start returning its error instead of failing the test, for
// goroutines other than the test's own (a fault injector).
func (e *Etcd) Restart() error {
	e.mu.Lock()
	running := e.cmd != nil
	e.mu.Unlock()
	if running {
		return fmt.Errorf("etcd at %s is already running", e.client)
	}
	if err := e.start(); err != nil {
		e.kill()
		return fmt.Errorf("etcd restart: %w", err)
	}
	return nil
}

// Running reports whether the server process was started and not stopped.
func (e *Etcd) Running() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.cmd != nil
}

// Close kills the server for good. It is registered as a cleanup by
// StartEtcd and may be called more than once.
func (e *Etcd) Close() {
	e.kill()
	e.mu.Lock()
	e.closed = true
	e.mu.Unlock()
}

func (e *Etcd) start() error {
	exited, err := e.spawn()
	if err != nil {
		return err
	}
	return e.waitStarted(exited)
}

// waitStarted waits until the server spawn started is healthy, and adds the
// log's tail to the error when it is not.
func (e *Etcd) waitStarted(exited <-chan struct{}) error {
	if err := e.waitHealthy(exited); err != nil {
		return fmt.Errorf("%w\n--- etcd log (%s) ---\n%s", err, e.logPath, tail(e.logPath, 4000))
	}
	return nil
}

// spawn starts the server process and returns a channel closed when it
// exits; it does not wait for the server to serve.
func (e *Etcd) spawn() (<-chan struct{}, error) {
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return nil, errors.New("closed")
	}
	e.mu.Unlock()
	logf, err := os.OpenFile(e.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, err
	}
	args := []string{
		"--name", e.name,
		"--data-dir", e.dataDir,
		"--listen-client-urls", e.client,
		"--advertise-client-urls", e.client,
		"--listen-peer-urls", e.peer,
		"--initial-advertise-peer-urls", e.peer,
		"--initial-cluster", e.cluster,
		"--initial-cluster-state", "new",
		"--initial-cluster-token", "ringipam-test",
		"--logger", "zap",
		"--log-outputs", "stderr",
		"--log-level", "warn",
	}
	if e.tls != nil {
		args = append(args,
			"--cert-file", e.tls.ServerCert,
			"--key-file", e.tls.ServerKey,
			"--trusted-ca-file", e.tls.CA,
			"--client-cert-auth",
		)
	}
	argv := append([]string{EtcdBinary}, args...)
	if e.netns != "" {
		// ip netns exec execs etcd in place (same pid), so the kill and
		// the parent-death signal below reach etcd itself.
		argv = append([]string{"ip", "netns", "exec", e.netns}, argv...)
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
	exited := make(chan struct{})
	started := make(chan error, 1)
	// The parent-death signal fires when the *thread* that forked exits, so
	// fork from a goroutine locked to its thread that lives until etcd exits.
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		defer logf.Close()
		if err := cmd.Start(); err != nil {
			started <- err
			close(exited)
			return
		}
		started <- nil
		_ = cmd.Wait()
		close(exited)
	}()
	if err := <-started; err != nil {
		return nil, fmt.Errorf("start %s: %w", EtcdBinary, err)
	}
	e.mu.Lock()
	e.cmd, e.exited = cmd, exited
	e.mu.Unlock()
	return exited, nil
}

// httpClient returns a client for the server's client URL: through e.dial,
// with the test CA when TLS is on. Call CloseIdleConnections when done.
func (e *Etcd) httpClient(timeout time.Duration) *http.Client {
	tr := &http.Transport{TLSClientConfig: e.probe, DialContext: e.dial, DisableKeepAlives: true}
	return &http.Client{Timeout: timeout, Transport: tr}
}

// waitHealthy polls the client URL's /health until etcd reports a leader,
// the process exits, or startTimeout passes.
func (e *Etcd) waitHealthy(exited <-chan struct{}) error {
	ctx, cancel := context.WithTimeout(context.Background(), startTimeout)
	defer cancel()
	hc := e.httpClient(2 * time.Second)
	defer hc.CloseIdleConnections()
	backoff := 10 * time.Millisecond
	var last error
	for {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, e.client+"/health", nil)
		if err != nil {
			return err
		}
		resp, err := hc.Do(req)
		if err == nil {
			body, _ := io.ReadAll(io.LimitReader(resp.Body, 1024))
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK && bytes.Contains(body, []byte(`"health":"true"`)) {
				return nil
			}
			err = fmt.Errorf("health: %s %s", resp.Status, body)
		}
		last = err
		select {
		case <-exited:
			return fmt.Errorf("etcd exited before becoming healthy (last probe: %v)", last)
		case <-ctx.Done():
			return fmt.Errorf("etcd at %s not healthy after %s: %v", e.client, startTimeout, last)
		case <-time.After(backoff):
		}
		if backoff < 200*time.Millisecond {
			backoff *= 2
		}
	}
}

// kill sends SIGKILL and waits (bounded) for the process to exit.
func (e *Etcd) kill() {
	e.mu.Lock()
	cmd, exited := e.cmd, e.exited
	e.cmd = nil
	e.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Kill()
	select {
	case <-exited:
	case <-time.After(30 * time.Second):
		e.tb.Errorf("testenv: etcd pid %d did not exit 30s after SIGKILL", cmd.Process.Pid)
	}
}

// freePorts returns two distinct loopback ports that were free a moment ago.
func freePorts() (int, int, error) {
	var ports []int
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	for range 2 {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return 0, 0, fmt.Errorf("free port: %w", err)
		}
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports[0], ports[1], nil
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
