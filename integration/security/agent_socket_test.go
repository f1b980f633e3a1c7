//go:build integration

package security

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ringipam/ringipam/integration/cnitest"
	"github.com/ringipam/ringipam/integration/netns"
	"github.com/ringipam/ringipam/internal/testenv"
)

// agentProc is the ringipamd binary serving a TLS etcd. The plugins'
// configuration (conf) carries no TLS: an ipam-ring call succeeds only
// through the agent's socket, never by reaching etcd itself.
type agentProc struct {
	agent   *cnitest.Agent
	socket  string
	metrics string // base URL of /metrics
	prefix  string
	etcd    *testenv.Etcd
	files   testenv.TLSFiles
}

// startAgent starts ringipamd (cnitest.StartAgent) on a fresh TLS etcd,
// serving its metrics on a loopback port, and makes its socket's
// directory mode 0755, so that the socket's own mode is the first door.
func startAgent(t *testing.T) *agentProc {
	t.Helper()
	netns.RequireRoot(t)
	srv, files := testenv.StartEtcdTLS(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	listen := l.Addr().String()
	l.Close()
	a := &agentProc{metrics: "http://" + listen + "/metrics", prefix: "/" + netns.Unique("sec-") + "/", etcd: srv, files: files}
	a.agent = cnitest.StartAgent(t, cnitest.AgentOptions{Endpoints: srv.Endpoints(), Prefix: a.prefix, Host: "sec-agent",
		Args: []string{"--etcd-cacert", files.CA, "--etcd-cert", files.Cert, "--etcd-key", files.Key,
			"--listen", listen, "--sweep=true", "--status-refresh", "10s", "--log-level", "info"}})
	a.socket = a.agent.Socket
	if err := os.Chmod(filepath.Dir(a.socket), 0o755); err != nil {
		t.Fatal(err)
	}
	return a
}

// conf is an ipam-ring configuration that works only through the agent.
func (a *agentProc) conf(t *testing.T) []byte {
	t.Helper()
	b, err := json.Marshal(map[string]any{"cniVersion": "1.1.0", "name": "sec-agent", "type": "bridge",
		"ipam": map[string]any{"type": "ipam-ring", "host": "sec-agent", "timeout": "10s",
			"ranges": [][]map[string]string{{{"subnet": "198.18.124.0/24"}}},
			"store":  a.agent.Store(map[string]any{"type": "etcd", "endpoints": a.etcd.Endpoints(), "prefix": a.prefix})}})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// alive fails the test if the agent has exited.
func (a *agentProc) alive(t *testing.T) {
	t.Helper()
	if err := a.agent.Running(); err != nil {
		t.Fatal(err)
	}
}

// metric reads one sample (name with its exact label set) of the agent.
func (a *agentProc) metric(t *testing.T, series string) float64 {
	t.Helper()
	c := http.Client{Timeout: 10 * time.Second}
	r, err := c.Get(a.metrics)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Body.Close()
	sc := bufio.NewScanner(r.Body)
	for sc.Scan() {
		name, val, ok := strings.Cut(sc.Text(), " ")
		if ok && name == series {
			f, err := strconv.ParseFloat(val, 64)
			if err != nil {
				t.Fatal(err)
			}
			return f
		}
	}
	t.Fatalf("no %s in the agent's metrics", series)
	return 0
}

// add runs one ipam-ring ADD (through the agent: the configuration has no
// TLS) and fails the test unless it succeeds within cnitest.OpTimeout.
func (a *agentProc) add(t *testing.T, id string) {
	t.Helper()
	res, err := cnitest.ExecIPAM("ADD", a.conf(t), id, "")
	if err != nil {
		t.Fatalf("ADD %s through the agent: %v", id, err)
	}
	if len(res.IPs) != 1 {
		t.Fatalf("ADD %s: %+v", id, res)
	}
}

// ncAs sends line to the agent's socket with netcat running as uid/gid
// 65534 (with the given ambient capabilities), or as root when asRoot,
// and returns what came back and netcat's error output.
func ncAs(t *testing.T, socket, line string, asRoot bool, caps ...uintptr) (stdout, stderr string) {
	t.Helper()
	nc, err := exec.LookPath("nc")
	if err != nil {
		t.Fatalf("netcat (netcat-openbsd, scripts/install-deps.sh) is needed: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, nc, "-N", "-U", socket)
	if !asRoot {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}, AmbientCaps: caps}
	}
	cmd.Stdin = strings.NewReader(line + "\n")
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	_ = cmd.Run() // a refused or failed connection makes netcat exit 1
	if ctx.Err() != nil {
		t.Fatalf("netcat did not finish within 30s (out %q, err %q)", out.String(), errb.String())
	}
	return out.String(), errb.String()
}

// The agent's socket is mode 0600 and owned by root, and only root's
// processes are served: a process of another uid is stopped by the mode,
// and one that passes the mode (CAP_DAC_OVERRIDE) is refused by its peer
// credentials -- closed unanswered, logged and counted.
func TestAgentSocketServesRootOnly(t *testing.T) {
	a := startAgent(t)
	fi, err := os.Stat(a.socket)
	if err != nil {
		t.Fatal(err)
	}
	st := fi.Sys().(*syscall.Stat_t)
	if fi.Mode().Perm() != 0o600 || st.Uid != 0 {
		t.Fatalf("agent socket mode %v owner uid %d, want 0600 and 0", fi.Mode().Perm(), st.Uid)
	}
	const refusedPeers = `ringipam_agent_socket_refused_total{reason="peer"}`
	// Every peer sends this agent API request; the agent answers it (a
	// refusal: no such plugin) to any process it serves at all.
	const hello = `{"version":1,"plugin":"nobody","command":"STATUS","stdin":null}`

	// Root: served (the control: an answer comes back).
	if out, errOut := ncAs(t, a.socket, hello, true); !strings.Contains(out, `serves no plugin \"nobody\"`) {
		t.Fatalf("root was not answered: out %q, err %q", out, errOut)
	}
	// Another uid: the socket's mode stops it at connect.
	out, errOut := ncAs(t, a.socket, hello, false)
	if out != "" || !strings.Contains(errOut, "Permission denied") {
		t.Fatalf("uid 65534 on the agent socket: out %q, err %q; want permission denied", out, errOut)
	}
	if n := a.metric(t, refusedPeers); n != 0 {
		t.Fatalf("%s = %v after a client the mode stopped, want 0", refusedPeers, n)
	}
	// Another uid past the mode (CAP_DAC_OVERRIDE): connected, then closed
	// unanswered by the peer check.
	out, errOut = ncAs(t, a.socket, hello, false, unix.CAP_DAC_OVERRIDE)
	if out != "" || strings.Contains(errOut, "Permission denied") {
		t.Fatalf("uid 65534 with CAP_DAC_OVERRIDE: out %q, err %q; want connected and closed unanswered", out, errOut)
	}
	if n := a.metric(t, refusedPeers); n != 1 {
		t.Fatalf("%s = %v after one client of uid 65534, want 1", refusedPeers, n)
	}
	if logs := a.agent.Log(); !strings.Contains(logs, "uid 65534") {
		t.Fatalf("the agent logged no refusal of uid 65534:\n%s", logs)
	}
	// Root is still served.
	a.add(t, "after-refusal")
	a.alive(t)
}

// Hostile clients on the socket -- malformed lines, a line far over the
// request limit, clients that connect and never finish a request -- are
// closed without crashing the agent, and while they are connected an
// ipam-ring ADD through the agent still succeeds.
func TestAgentSocketSurvivesHostileClients(t *testing.T) {
	a := startAgent(t)
	dial := func() net.Conn {
		t.Helper()
		c, err := net.Dial("unix", a.socket)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}

	// Two clients that stall: one silent, one half-way through a request.
	dial()
	half := dial()
	if _, err := half.Write([]byte(`{"version":1,"plugin":"ipam-ring","command":"ADD","timeoutMs":10000,"stdin":"`)); err != nil {
		t.Fatal(err)
	}

	// A request line of 16 MiB, twice the limit and four times any real
	// request (a 4 MiB network configuration, base64 in the JSON): the
	// agent stops reading and closes the connection, so the write fails
	// before all of it went out (a unix socket buffers a few hundred KiB).
	huge := dial()
	const hugeLen = 16 << 20
	wrote := make(chan error, 1)
	var written int
	go func() {
		_ = huge.SetWriteDeadline(time.Now().Add(2 * time.Minute))
		chunk := bytes.Repeat([]byte("a"), 64<<10)
		for written < hugeLen {
			n, err := huge.Write(chunk)
			written += n
			if err != nil {
				wrote <- err
				return
			}
		}
		wrote <- nil
	}()

	// Malformed lines: each is logged, counted and its connection closed.
	malformed := []string{
		"not json at all",
		"\x00\x01\x02\xff\xfe\xfd",
		"12345",
		`{"version":1,"plugin":"ipam-ring","command":"ADD","stdin":"%%% not base64 %%%"}`,
		strings.Repeat("[", 20000) + strings.Repeat("]", 20000),
	}
	// Well-formed but wrong: answered with a refusal or a CNI error
	// (saying what), then closed.
	otherCluster := func() string {
		var c map[string]any
		if err := json.Unmarshal(a.conf(t), &c); err != nil {
			t.Fatal(err)
		}
		c["ipam"].(map[string]any)["store"].(map[string]any)["prefix"] = "/elsewhere/"
		b, _ := json.Marshal(c)
		line, _ := json.Marshal(map[string]any{"version": 1, "plugin": "ipam-ring", "command": "ADD", "containerId": "c1",
			"ifName": "eth0", "netns": cnitest.NoNetNS, "stdin": b})
		return string(line)
	}
	wrong := map[string]string{
		`{}`: "speaks agent API v1, the plugin sent v0",
		`{"version":2,"plugin":"ipam-ring","command":"ADD","stdin":null}`: "speaks agent API v1, the plugin sent v2",
		`{"version":1,"plugin":"dhcp","command":"ADD","stdin":null}`:      `serves no plugin \"dhcp\"`,
		`{"version":1,"plugin":"ipam-ring","command":"NOPE","stdin":""}`:  `has no command \"NOPE\"`,
		`{"version":1,"plugin":"ipam-ring","command":"ADD","stdin":null}`: `"code":7`,
		otherCluster(): "this host's agent serves",
	}
	exchange := func(line string) string {
		c := dial()
		if _, err := c.Write([]byte(line + "\n")); err != nil {
			t.Fatalf("%.40q: %v", line, err)
		}
		_ = c.SetReadDeadline(time.Now().Add(30 * time.Second))
		got, err := io.ReadAll(c)
		if err != nil {
			t.Fatalf("after %.40q the agent kept the connection open (read: %v, got %q)", line, err, got)
		}
		c.Close()
		return string(got)
	}
	for _, line := range malformed {
		if got := exchange(line); got != "" {
			t.Fatalf("malformed %.40q was answered %q, want the connection closed unanswered", line, got)
		}
	}
	for line, says := range wrong {
		if got := exchange(line); !strings.Contains(got, says) || !strings.Contains(got, `"version":1`) {
			t.Fatalf("%.60q was answered %q, want a v1 answer saying %s", line, got, says)
		}
	}

	// While the stalled clients (and perhaps the huge one) are connected,
	// a plugin call through the agent succeeds.
	a.add(t, "amid-hostile-1")

	select {
	case err := <-wrote:
		if err == nil {
			t.Fatalf("the agent read a %d-byte request line whole", hugeLen)
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("the agent neither read nor closed a huge request line within 2 minutes (%d bytes written)", written)
		}
		t.Logf("the huge line's write failed after %d of %d bytes: %v", written, hugeLen, err)
	case <-time.After(3 * time.Minute):
		t.Fatal("the huge line's writer did not finish within 3 minutes")
	}
	if n := a.metric(t, `ringipam_agent_socket_refused_total{reason="too-large"}`); n != 1 {
		t.Fatalf("too-large refusals %v, want 1", n)
	}
	if n := a.metric(t, `ringipam_agent_socket_refused_total{reason="malformed"}`); n != float64(len(malformed)) {
		t.Fatalf("malformed refusals %v, want %d", n, len(malformed))
	}
	if n := a.metric(t, `ringipam_agent_socket_refused_total{reason="version"}`); n != 2 {
		t.Fatalf("version refusals %v, want 2", n)
	}

	// The stalled clients are still connected; the agent is alive and
	// serves the next call too.
	a.alive(t)
	a.add(t, "amid-hostile-2")
	if _, err := cnitest.ExecIPAM("DEL", a.conf(t), "amid-hostile-1", ""); err != nil {
		t.Fatalf("DEL through the agent: %v", err)
	}
	a.alive(t)
}
