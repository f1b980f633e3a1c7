//go:build integration

package security

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ringipam/ringipam/integration/cnitest"
	"github.com/ringipam/ringipam/integration/netns"
	"github.com/ringipam/ringipam/internal/testenv"
)

// storeKeys lists every key under the store object's prefix.
func storeKeys(t *testing.T, obj map[string]any) []string {
	t.Helper()
	st := cnitest.OpenStore(t, obj)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	kvs, err := st.Scan(ctx, "", "\xff", 0)
	if err != nil {
		t.Fatal(err)
	}
	keys := make([]string, len(kvs))
	for i, kv := range kvs {
		keys[i] = kv.Key
	}
	return keys
}

// execIPAM runs the ipam-ring binary once with the CNI variables given
// (over defaults for an ADD) and stdin, and returns the CNI error it
// printed (code 0 when it succeeded).
func execIPAM(t *testing.T, env map[string]string, stdin []byte) (uint, string) {
	t.Helper()
	vars := map[string]string{"CNI_COMMAND": "ADD", "CNI_CONTAINERID": "c1", "CNI_NETNS": cnitest.NoNetNS,
		"CNI_IFNAME": "eth0", "CNI_PATH": filepath.Dir(cnitest.IPAMBin)}
	for k, v := range env {
		vars[k] = v
	}
	ctx, cancel := context.WithTimeout(context.Background(), cnitest.OpTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, cnitest.IPAMBin)
	for k, v := range vars {
		cmd.Env = append(cmd.Env, k+"="+v)
	}
	cmd.Stdin = bytes.NewReader(stdin)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err == nil {
		return 0, out.String()
	}
	return cniCode(t, result{stdout: out.Bytes(), stderr: errb.Bytes()})
}

// Every part of a CNI owner that breaks the rules is refused by the
// ipam-ring binary with one error naming the field -- code 7, or skel's
// code 4 for CNI_CONTAINERID and CNI_IFNAME values the CNI dispatcher
// itself refuses -- and nothing reaches the store.
func TestBadNamesRefusedByIPAMRing(t *testing.T) {
	netns.RequireRoot(t)
	etcd := testenv.StartEtcd(t)
	prefix := "/" + netns.Unique("names-") + "/"
	agent := cnitest.StartAgent(t, cnitest.AgentOptions{Endpoints: etcd.Endpoints(), Prefix: prefix, Host: "sechost"})
	obj := agent.Store(map[string]any{"type": "etcd", "endpoints": etcd.Endpoints(), "prefix": prefix})
	conf := func(network string) []byte {
		b, err := json.Marshal(map[string]any{"cniVersion": "1.1.0", "name": network, "type": "bridge",
			"ipam": map[string]any{"type": "ipam-ring", "host": "sechost", "timeout": "10s", "store": obj,
				"ranges": [][]map[string]string{{{"subnet": "198.18.125.0/24"}}}}})
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	for _, tc := range []struct {
		name    string
		network string
		env     map[string]string
		code    uint
		field   string
	}{
		{"network with a slash", "a/b", nil, 7, "network name"},
		{"network over 253 bytes", strings.Repeat("n", 254), nil, 7, "network name"},
		{"container ID with a slash", "sec", map[string]string{"CNI_CONTAINERID": "a/b"}, 4, "containerID"},
		{"container ID over 253 bytes", "sec", map[string]string{"CNI_CONTAINERID": strings.Repeat("c", 300)}, 7, "container ID"},
		{"interface name with a slash", "sec", map[string]string{"CNI_IFNAME": "e/th"}, 4, "interface name"},
		{"interface name with a control character", "sec", map[string]string{"CNI_IFNAME": "eth\x01"}, 7, "interface name"},
		{"interface name on DEL", "sec", map[string]string{"CNI_COMMAND": "DEL", "CNI_IFNAME": "eth\x7f"}, 7, "interface name"},
		{"reservation like a path", "sec", map[string]string{"CNI_ARGS": "RESERVATION=../x"}, 7, "reservation name"},
		{"reservation with an empty part", "sec", map[string]string{"CNI_ARGS": "RESERVATION=ns//x"}, 7, "reservation name"},
		{"reservation over 253 bytes", "sec", map[string]string{"CNI_ARGS": "RESERVATION=" + strings.Repeat("r", 254)}, 7, "reservation name"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, msg := execIPAM(t, tc.env, conf(tc.network))
			if code != tc.code || !strings.Contains(msg, tc.field) {
				t.Fatalf("code %d %q, want %d naming the %s", code, msg, tc.code, tc.field)
			}
		})
	}
	// The agent keeps records of its own (liveness, host, layout); none of
	// them names a CNI owner or the network's pool.
	for _, k := range storeKeys(t, obj) {
		if strings.Contains(k, "cni/") || strings.Contains(k, "198.18.125") {
			t.Fatalf("the refused calls wrote to the store: %q", k)
		}
	}
}

// invokeRaw sends one whole invocation to the agent's socket as a plugin
// would (an agent API request of ipam-ring), bypassing the plugin's own checks of CNI_CONTAINERID and
// CNI_IFNAME, and returns the answer line.
func invokeRaw(t *testing.T, socket string, inv map[string]any) string {
	t.Helper()
	c, err := net.Dial("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	req := map[string]any{"version": 1, "plugin": "ipam-ring", "timeoutMs": 10000}
	for k, v := range inv {
		req[k] = v
	}
	b, err := json.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	_ = c.SetDeadline(time.Now().Add(60 * time.Second))
	if _, err := c.Write(append(b, '\n')); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		t.Fatalf("no answer from the agent: %v", err)
	}
	return line
}

// Invocations sent straight to the agent's socket with bad names get the
// same refusal as the plugin gives (code 7 naming the field); nothing
// reaches the store.
func TestBadNamesRefusedByTheAgent(t *testing.T) {
	a := startAgent(t)
	stdin := func(network string) string {
		c := map[string]any{}
		if err := json.Unmarshal(a.conf(t), &c); err != nil {
			t.Fatal(err)
		}
		c["name"] = network
		b, _ := json.Marshal(c)
		return base64.StdEncoding.EncodeToString(b)
	}
	inv := func(network, id, ifName, args string) map[string]any {
		return map[string]any{"command": "ADD", "containerId": id, "ifName": ifName, "netns": cnitest.NoNetNS,
			"args": args, "path": filepath.Dir(cnitest.IPAMBin), "stdin": stdin(network)}
	}
	for _, tc := range []struct {
		name  string
		inv   map[string]any
		field string
	}{
		{"container ID with a slash", inv("sec-agent", "../victim", "eth0", ""), "container ID"},
		{"container ID empty", inv("sec-agent", "", "eth0", ""), "container ID"},
		{"interface name with a colon", inv("sec-agent", "c1", "eth:0", ""), "interface name"},
		{"interface name over 15 bytes", inv("sec-agent", "c1", "eth0123456789abc", ""), "interface name"},
		{"network with a slash", inv("a/b", "c1", "eth0", ""), "network name"},
		{"reservation like a path", inv("sec-agent", "c1", "eth0", "RESERVATION=../x"), "reservation name"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			line := invokeRaw(t, a.socket, tc.inv)
			var ans struct {
				CNIError json.RawMessage `json:"cniError"`
			}
			if err := json.Unmarshal([]byte(line), &ans); err != nil {
				t.Fatalf("answer %q: %v", line, err)
			}
			if len(ans.CNIError) == 0 {
				t.Fatalf("answer %s, want a CNI error", line)
			}
			code, msg := cniCode(t, result{stdout: ans.CNIError})
			if code != 7 || !strings.Contains(msg, tc.field) {
				t.Fatalf("code %d %q, want 7 naming the %s", code, msg, tc.field)
			}
		})
	}
	// Read with etcd's own client, over TLS.
	obj := map[string]any{"type": "etcd", "endpoints": a.etcd.Endpoints(), "prefix": a.prefix, "agentSocket": a.socket,
		"tls": map[string]string{"ca": a.files.CA, "cert": a.files.Cert, "key": a.files.Key}}
	// The agent keeps records of its own (liveness, host, layout); none of
	// them names a CNI owner or the network's pool.
	for _, k := range storeKeys(t, obj) {
		if strings.Contains(k, "cni/") || strings.Contains(k, "198.18.124") {
			t.Fatalf("the refused invocations wrote to the store: %q", k)
		}
	}
	a.alive(t)
}

// driverProc is the Docker driver on an etcd, reached through its socket.
type driverProc struct {
	client *http.Client
	obj    map[string]any
}

func startDriver(t *testing.T) *driverProc {
	t.Helper()
	netns.RequireRoot(t)
	etcd := testenv.StartEtcd(t)
	prefix := "/" + netns.Unique("dnames-") + "/"
	dir := t.TempDir()
	name := netns.Unique("rsec-")
	ctx, cancel := context.WithCancel(context.Background())
	cmd := exec.CommandContext(ctx, driverBin, "--name", name, "--plugin-dir", dir, "--host", "sechost", "--store", "etcd",
		"--etcd-endpoints", etcd.Endpoints()[0], "--etcd-prefix", prefix)
	var logs cnitest.SyncBuffer
	cmd.Stdout, cmd.Stderr = &logs, &logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cancel()
		_ = cmd.Wait()
		if t.Failed() {
			t.Logf("driver output:\n%s", logs.String())
		}
	})
	sock := filepath.Join(dir, name+".sock")
	c := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", sock)
	}}}
	deadline := time.Now().Add(30 * time.Second)
	for {
		if resp, err := c.Post("http://plugin/IpamDriver.GetCapabilities", "application/json", strings.NewReader("{}")); err == nil {
			resp.Body.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the driver did not answer within 30s:\n%s", logs.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
	return &driverProc{client: c, obj: map[string]any{"type": "etcd", "endpoints": etcd.Endpoints(), "prefix": prefix}}
}

// call posts body to the driver's method and returns the decoded answer.
func (d *driverProc) call(t *testing.T, method string, body any) map[string]any {
	t.Helper()
	b, err := json.Marshal(body)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := d.client.Post("http://plugin/IpamDriver."+method, "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]any{}
	if err := json.Unmarshal(raw, &out); err != nil {
		t.Fatalf("%s answered %q: %v", method, raw, err)
	}
	return out
}

// The Docker driver refuses bad pool names and endpoint MACs with an
// error naming the field, and writes nothing for them.
func TestBadNamesRefusedByTheDockerDriver(t *testing.T) {
	d := startDriver(t)
	// A network whose pool is recorded (its gateway request), so that a
	// MAC the driver wrongly accepted would get an address.
	pid, _ := d.call(t, "RequestPool", map[string]any{"Pool": "198.18.126.0/24", "AddressSpace": "global"})["PoolID"].(string)
	if pid == "" {
		t.Fatal("RequestPool gave no pool ID")
	}
	if gw := d.call(t, "RequestAddress", map[string]any{"PoolID": pid, "Options": map[string]string{"RequestAddressType": "com.docker.network.gateway"}}); gw["Err"] != nil && gw["Err"] != "" {
		t.Fatalf("gateway: %v", gw["Err"])
	}
	before := storeKeys(t, d.obj)
	const macOpt = "com.docker.network.endpoint.macaddress"
	for _, tc := range []struct {
		name, method string
		body         map[string]any
		field        string
	}{
		{"pool name with a slash", "RequestPool", map[string]any{"Pool": "198.18.127.0/24", "AddressSpace": "global", "Options": map[string]string{"pool": "a/b"}}, "pool name"},
		{"pool name over 200 bytes", "RequestPool", map[string]any{"Pool": "198.18.127.0/24", "AddressSpace": "global", "Options": map[string]string{"pool": strings.Repeat("p", 201)}}, "pool name"},
		{"pool ID with a slash", "RequestAddress", map[string]any{"PoolID": "a/b;198.18.126.0/24;198.18.126.1-198.18.126.254", "Options": map[string]string{macOpt: "02:42:c6:12:7e:05"}}, "pool name"},
		{"MAC not a MAC", "RequestAddress", map[string]any{"PoolID": pid, "Options": map[string]string{macOpt: "zz:zz"}}, "endpoint MAC address"},
		{"MAC of 8 bytes", "RequestAddress", map[string]any{"PoolID": pid, "Options": map[string]string{macOpt: "02:42:c6:12:7e:05:00:01"}}, "endpoint MAC address"},
		{"MAC of 20 bytes", "RequestAddress", map[string]any{"PoolID": pid, "Options": map[string]string{macOpt: "00:00:00:00:fe:80:00:00:00:00:00:00:02:00:5e:10:00:00:00:01"}}, "endpoint MAC address"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out := d.call(t, tc.method, tc.body)
			msg, _ := out["Err"].(string)
			if !strings.HasPrefix(msg, "ringipam: ") || !strings.Contains(msg, tc.field) {
				t.Fatalf("%s answered %v, want an error naming the %s", tc.method, out, tc.field)
			}
		})
	}
	if after := storeKeys(t, d.obj); fmt.Sprint(after) != fmt.Sprint(before) {
		t.Fatalf("the refused requests changed the store:\n before %q\n after  %q", before, after)
	}
}
