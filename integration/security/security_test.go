//go:build integration

// Package security checks, through the real binaries, what an attacker or a
// runaway caller on the node could try: store files and the driver socket
// open to other users, a huge stdin, container IDs that look like paths or
// carry control characters, and credentials leaking into output (issue 14);
// the host agent's store socket against other users and hostile clients,
// and every part of an owner's name at every front end (issue 32).
// README.md lists each attack tried.
package security

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ringipam/ringipam/integration/cnitest"
	"github.com/ringipam/ringipam/integration/netns"
	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/store/local"
)

var driverBin, agentBin string

func TestMain(m *testing.M) {
	os.Exit(cnitest.Main(m, func(ctx context.Context, dir string) error {
		driverBin = filepath.Join(dir, "ringipam-docker")
		if err := cnitest.Build(ctx, driverBin, "./docker-driver"); err != nil {
			return err
		}
		agentBin = filepath.Join(dir, "ringipamd")
		return cnitest.Build(ctx, agentBin, "./cmd/ringipamd")
	}))
}

type result struct {
	stdout, stderr []byte
	err            error
}

// plugin runs ipam-ring once with the CNI variables and stdin.
func plugin(t *testing.T, command, containerID string, stdin []byte) result {
	t.Helper()
	out, errOut, err := cnitest.ExecFull(command, containerID, stdin)
	return result{stdout: out, stderr: errOut, err: err}
}

func cniCode(t *testing.T, r result) (uint, string) {
	t.Helper()
	var e struct {
		Code uint   `json:"code"`
		Msg  string `json:"msg"`
	}
	if err := json.Unmarshal(r.stdout, &e); err != nil {
		t.Fatalf("output %q (stderr %q) is not a CNI error: %v", r.stdout, r.stderr, err)
	}
	return e.Code, e.Msg
}

func localConf(t *testing.T, storePath string) []byte {
	t.Helper()
	b, err := json.Marshal(map[string]any{
		"cniVersion": "1.0.0", "name": "sec", "type": "bridge",
		"ipam": map[string]any{
			"type": "ipam-ring", "host": "sechost",
			"ranges": [][]map[string]string{{{"subnet": "198.18.120.0/24"}}},
			"store":  map[string]any{"type": "local", "path": storePath},
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func mode(t *testing.T, path string) os.FileMode {
	t.Helper()
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return fi.Mode().Perm()
}

func TestLocalStoreFileIsRootOnly(t *testing.T) {
	netns.RequireRoot(t)
	dir := filepath.Join(t.TempDir(), "var-lib-ringipam")
	path := filepath.Join(dir, "store.db")
	if r := plugin(t, "ADD", "c1", localConf(t, path)); r.err != nil {
		t.Fatalf("ADD: %v %s %s", r.err, r.stdout, r.stderr)
	}
	if r := plugin(t, "ADD", "c2", localConf(t, path)); r.err != nil {
		t.Fatalf("second ADD: %v %s %s", r.err, r.stdout, r.stderr)
	}
	// The store file (a bbolt file alone: no log beside it).
	if m := mode(t, path); m != 0o600 {
		t.Fatalf("%s mode %v, want 0600", path, m)
	}
	if m := mode(t, dir); m&0o077 != 0 {
		t.Fatalf("store directory mode %v: readable by others", m)
	}
}

func TestDriverSocketIsRootOnly(t *testing.T) {
	netns.RequireRoot(t)
	dir := t.TempDir()
	name := netns.Unique("rsec-")
	storePath := filepath.Join(dir, "store", "store.db")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	cmd := exec.CommandContext(ctx, driverBin, "--name", name, "--plugin-dir", dir, "--host", "sechost", "--store", "local", "--store-path", storePath)
	var logs bytes.Buffer
	cmd.Stdout, cmd.Stderr = &logs, &logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cancel(); _ = cmd.Wait() }()
	sock := filepath.Join(dir, name+".sock")
	deadline := time.Now().Add(30 * time.Second)
	for {
		if fi, err := os.Stat(sock); err == nil && fi.Mode()&os.ModeSocket != 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("driver socket %s did not appear: %s", sock, logs.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
	if m := mode(t, sock); m != 0o600 {
		t.Fatalf("driver socket mode %v, want 0600", m)
	}
	// It serves root: one request through the socket.
	c := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", sock)
	}}}
	resp, err := c.Post("http://plugin/IpamDriver.GetCapabilities", "application/json", strings.NewReader("{}"))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("capabilities: %s", resp.Status)
	}
	// An oversized request body is refused, not parsed: a valid
	// RequestPool (it would be served whole) whose options carry 3 MiB.
	big, err := json.Marshal(map[string]any{"Pool": "198.18.123.0/24", "AddressSpace": "global",
		"Options": map[string]string{"com.example.pad": strings.Repeat("x", 3<<20)}})
	if err != nil {
		t.Fatal(err)
	}
	resp, err = c.Post("http://plugin/IpamDriver.RequestPool", "application/json", bytes.NewReader(big))
	if err != nil {
		t.Fatal(err)
	}
	var answer struct{ Err, PoolID string }
	if err := json.NewDecoder(resp.Body).Decode(&answer); err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if answer.PoolID != "" || !strings.Contains(answer.Err, "too large") {
		t.Fatalf("a valid %d-byte RequestPool: %+v, want refused as too large", len(big), answer)
	}
	// A request that touches the store creates it, root-only.
	resp, err = c.Post("http://plugin/IpamDriver.RequestPool", "application/json", strings.NewReader(`{"Pool":"198.18.122.0/24","AddressSpace":"global"}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if m := mode(t, storePath); m != 0o600 {
		t.Fatalf("driver's store file mode %v, want 0600", m)
	}
}

// A 60 MB stdin is refused (code 7) before the configuration is served:
// the store is never opened. The CNI library's skel reads stdin whole
// before it calls the verb, so the plugin does hold the 60 MB for a moment
// (README); its own bound is ipam.MaxConfig, 4 MiB.
func TestHugeStdinIsRefused(t *testing.T) {
	netns.RequireRoot(t)
	storePath := filepath.Join(t.TempDir(), "store.db")
	conf := localConf(t, storePath)
	huge := make([]byte, 0, 60<<20)
	huge = append(huge, conf[:len(conf)-1]...)
	huge = append(huge, []byte(`,"pad":"`)...)
	huge = append(huge, bytes.Repeat([]byte("a"), 60<<20-len(huge)-2)...)
	huge = append(huge, '"', '}')
	ctx, cancel := context.WithTimeout(context.Background(), cnitest.OpTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, cnitest.IPAMBin)
	cmd.Env = []string{"CNI_COMMAND=ADD", "CNI_CONTAINERID=c1", "CNI_NETNS=/var/run/netns/unused",
		"CNI_IFNAME=eth0", "CNI_PATH=" + filepath.Dir(cnitest.IPAMBin)}
	cmd.Stdin = bytes.NewReader(huge)
	var out bytes.Buffer
	cmd.Stdout = &out
	if err := cmd.Run(); err == nil {
		t.Fatal("ADD with a 60 MB configuration succeeded")
	}
	code, msg := cniCode(t, result{stdout: out.Bytes()})
	if code != 7 || !strings.Contains(msg, "larger than") {
		t.Fatalf("code %d %q, want 7 saying it is too large", code, msg)
	}
	if _, err := os.Stat(storePath); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("the refused call reached the store: stat %s: %v", storePath, err)
	}
}

// Container IDs that look like paths, carry control characters or are
// huge are refused (code 7) or stored as one opaque key that reaches no other
// owner.
func TestHostileContainerIDs(t *testing.T) {
	netns.RequireRoot(t)
	path := filepath.Join(t.TempDir(), "store.db")
	conf := localConf(t, path)
	if r := plugin(t, "ADD", "victim", conf); r.err != nil {
		t.Fatalf("ADD victim: %v %s", r.err, r.stdout)
	}
	for _, id := range []string{"../victim", "victim/../victim", "a/b", "x\x01y", "x\ny", strings.Repeat("a", 10000)} {
		r := plugin(t, "ADD", id, conf)
		if r.err == nil {
			t.Errorf("ADD with container ID %q succeeded", id)
			continue
		}
		// 4: skel's own check of CNI_CONTAINERID; 7: ringipam's owner rules.
		if code, msg := cniCode(t, r); code != 4 && code != 7 {
			t.Errorf("container ID %q: code %d %q, want 4 or 7", id, code, msg)
		}
		if r := plugin(t, "DEL", id, conf); r.err == nil {
			continue // nothing to release, refused or not
		}
	}
	// ".." alone is a name, not a path: stored as an opaque owner.
	if r := plugin(t, "ADD", "..", conf); r.err == nil {
		if r := plugin(t, "DEL", "..", conf); r.err != nil {
			t.Fatalf("DEL ..: %v %s", r.err, r.stdout)
		}
	} else if code, _ := cniCode(t, r); code != 4 && code != 7 {
		t.Fatalf("ADD ..: %s", r.stdout)
	}
	st, err := local.New(local.Config{Path: path, OpenTimeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	a, _ := pool.New(st, "sechost")
	left, err := a.List(context.Background(), pool.Filter{})
	if err != nil {
		t.Fatal(err)
	}
	if len(left) != 1 || left[0].Owner.ContainerID != "victim" {
		t.Fatalf("owners after the hostile IDs: %+v, want only the victim", left)
	}
}

// etcd credentials never reach the output, whatever fails.
func TestEtcdCredentialsNeverLogged(t *testing.T) {
	netns.RequireRoot(t)
	const secret = "s3cr3t-Pa55word-7f1e"
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := l.Addr().String()
	l.Close()
	// The plugins' calls go to the host agent of that etcd, which cannot
	// reach it either; neither prints the password.
	agent := cnitest.StartAgent(t, cnitest.AgentOptions{Endpoints: []string{"http://" + closed}, Host: "sechost",
		Args: []string{"--etcd-dial-timeout", "1s", "--etcd-request-timeout", "1s"}})
	conf, _ := json.Marshal(map[string]any{
		"cniVersion": "1.1.0", "name": "sec", "type": "bridge",
		"ipam": map[string]any{
			"type": "ipam-ring", "host": "sechost", "timeout": "3s",
			"ranges": [][]map[string]string{{{"subnet": "198.18.121.0/24"}}},
			"store": agent.Store(map[string]any{"type": "etcd", "endpoints": []string{"http://" + closed},
				"username": "ringipam", "password": secret, "dialTimeout": "1s", "requestTimeout": "1s"}),
		},
	})
	for _, verb := range []string{"ADD", "DEL", "CHECK", "STATUS"} {
		r := plugin(t, verb, "c1", conf)
		if r.err == nil && verb != "DEL" {
			t.Errorf("%s against a closed etcd succeeded", verb)
		}
		if bytes.Contains(r.stdout, []byte(secret)) || bytes.Contains(r.stderr, []byte(secret)) {
			t.Fatalf("%s printed the etcd password: %s %s", verb, r.stdout, r.stderr)
		}
	}
	if strings.Contains(agent.Log(), secret) {
		t.Fatalf("the agent printed the etcd password:\n%s", agent.Log())
	}
	// The driver, configured by file, logs its configuration and its failure.
	dir := t.TempDir()
	cfg := filepath.Join(dir, "driver.json")
	b, _ := json.Marshal(map[string]any{"name": netns.Unique("rsec-"), "pluginDir": dir, "host": "sechost", "logLevel": "debug",
		"store": map[string]any{"type": "etcd", "endpoints": []string{"http://" + closed}, "username": "ringipam", "password": secret,
			"dialTimeout": "1s", "requestTimeout": "1s"}})
	if err := os.WriteFile(cfg, b, 0o600); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	out, _ := exec.CommandContext(ctx, driverBin, "--config", cfg).CombinedOutput()
	if bytes.Contains(out, []byte(secret)) {
		t.Fatalf("the driver printed the etcd password:\n%s", out)
	}
	if len(out) == 0 {
		t.Fatal(fmt.Errorf("the driver printed nothing; the check would prove nothing"))
	}
}
