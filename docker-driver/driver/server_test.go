package driver

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/store/memory"
	"github.com/ringipam/ringipam/pkg/storeconfig"
)

// call posts body to path over a unix socket, as dockerd does.
func call(t *testing.T, c *http.Client, path string, body any) (int, map[string]any) {
	t.Helper()
	return callURL(t, c, "http://plugin"+path, body)
}

func TestServeProtocol(t *testing.T) {
	dir := t.TempDir()
	sock := SocketPath(dir, "ringipam-test")
	l, err := Listen(sock)
	if err != nil {
		t.Fatal(err)
	}
	m := NewMetrics()
	d, err := New(mustAlloc(t), Options{Metrics: m, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Serve(ctx, l, Handler(d, m, quiet()), 5*time.Second) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("serve: %v", err)
		}
		if _, err := os.Stat(sock); !os.IsNotExist(err) {
			t.Errorf("socket left behind: %v", err)
		}
	})
	// A second driver may not take over a live socket.
	if _, err := Listen(sock); err == nil {
		t.Fatal("second Listen on a live socket succeeded")
	}
	c := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", sock)
		},
	}}

	code, got := call(t, c, pathActivate, struct{}{})
	if diff := cmp.Diff(map[string]any{"Implements": []any{"IpamDriver"}}, got); code != 200 || diff != "" {
		t.Fatalf("activate: %d %s", code, diff)
	}
	code, got = call(t, c, pathCapabilities, struct{}{})
	if diff := cmp.Diff(map[string]any{"RequiresMACAddress": true, "RequiresRequestReplay": true}, got); code != 200 || diff != "" {
		t.Fatalf("capabilities: %d %s", code, diff)
	}
	code, got = call(t, c, pathRequestPool, map[string]any{"AddressSpace": LocalAddressSpace, "Pool": "198.18.70.0/24", "Options": map[string]string{}})
	if code != 200 || got["Pool"] != "198.18.70.0/24" {
		t.Fatalf("request pool: %d %v", code, got)
	}
	pid := got["PoolID"].(string)
	code, got = call(t, c, pathRequestAddress, map[string]any{"PoolID": pid, "Options": map[string]string{OptAddressType: AddressTypeGateway}})
	if code != 200 || got["Address"] != "198.18.70.1/24" {
		t.Fatalf("gateway: %d %v", code, got)
	}
	code, got = call(t, c, pathRequestAddress, map[string]any{"PoolID": pid, "Address": "198.18.70.7", "Options": map[string]string{OptMAC: mac(1)}})
	if code != 200 || got["Address"] != "198.18.70.7/24" {
		t.Fatalf("static: %d %v", code, got)
	}
	code, got = call(t, c, pathRequestAddress, map[string]any{"PoolID": pid, "Address": "198.18.70.7", "Options": map[string]string{OptMAC: mac(2)}})
	if msg, _ := got["Err"].(string); code != 500 || !strings.Contains(msg, "198.18.70.7 is already in use") {
		t.Fatalf("taken: %d %v", code, got)
	}
	code, got = call(t, c, pathReleaseAddress, map[string]any{"PoolID": pid, "Address": "198.18.70.99"})
	if code != 200 || len(got) != 0 {
		t.Fatalf("release unknown: %d %v", code, got)
	}
	code, got = call(t, c, pathReleasePool, map[string]any{"PoolID": pid})
	if code != 200 || len(got) != 0 {
		t.Fatalf("release pool: %d %v", code, got)
	}
	// Metrics saw the calls.
	mfs, err := m.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var inUse float64
	for _, mf := range mfs {
		if mf.GetName() != "ringipam_docker_requests_total" {
			continue
		}
		for _, mt := range mf.GetMetric() {
			lbl := map[string]string{}
			for _, lp := range mt.GetLabel() {
				lbl[lp.GetName()] = lp.GetValue()
			}
			if lbl["method"] == "RequestAddress" && lbl["result"] == "in_use" {
				inUse = mt.GetCounter().GetValue()
			}
		}
	}
	if inUse != 1 {
		t.Fatalf("requests_total{RequestAddress,in_use} = %v, want 1", inUse)
	}
}

func TestListenReplacesStaleSocket(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "x.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	l.Close() // leaves the file behind, like a killed driver
	l2, err := Listen(sock)
	if err != nil {
		t.Fatalf("stale socket not replaced: %v", err)
	}
	l2.Close()
}

func TestLoadConfig(t *testing.T) {
	file := filepath.Join(t.TempDir(), "c.json")
	if err := os.WriteFile(file, []byte(`{"name":"fromfile","host":"h-file","store":{"type":"etcd","endpoints":["127.0.0.1:1"],"dialTimeout":"2s"},
		"defaultPools":[{"base":"198.18.0.0/20","size":26}],"metricsAddr":"127.0.0.1:0"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	pwFile := filepath.Join(t.TempDir(), "pw")
	if err := os.WriteFile(pwFile, []byte("pw\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	env := func(m map[string]string) func(string) string { return func(k string) string { return m[k] } }
	for _, tc := range []struct {
		name string
		args []string
		env  map[string]string
		want func(*Config)
		bad  bool
	}{
		{name: "defaults", args: []string{"--host", "h"}, want: func(c *Config) {}},
		{name: "file", args: []string{"--config", file}, want: func(c *Config) {
			c.Name, c.Host, c.MetricsAddr = "fromfile", "h-file", "127.0.0.1:0"
			c.Store = storeconfig.Config{Type: "etcd", Endpoints: []string{"127.0.0.1:1"}, DialTimeout: storeconfig.Duration(2 * time.Second)}
			c.DefaultPools = []DefaultPool{{Base: netip.MustParsePrefix("198.18.0.0/20"), Size: 26}}
		}},
		{name: "env over file", args: []string{"--config=" + file}, env: map[string]string{"RINGIPAM_DOCKER_NAME": "fromenv", "RINGIPAM_DOCKER_DEFAULT_POOL": "base=198.19.0.0/16,size=24 base=fd00:9::/48,size=64"}, want: func(c *Config) {
			c.Name, c.Host, c.MetricsAddr = "fromenv", "h-file", "127.0.0.1:0"
			c.Store = storeconfig.Config{Type: "etcd", Endpoints: []string{"127.0.0.1:1"}, DialTimeout: storeconfig.Duration(2 * time.Second)}
			c.DefaultPools = []DefaultPool{{Base: netip.MustParsePrefix("198.19.0.0/16"), Size: 24}, {Base: netip.MustParsePrefix("fd00:9::/48"), Size: 64}}
		}},
		{name: "flags over env", args: []string{"--host", "h", "--name", "fromflag", "--default-pool", "base=198.18.4.0/22,size=24", "--timeout", "3s"}, env: map[string]string{"RINGIPAM_DOCKER_NAME": "fromenv", "RINGIPAM_DOCKER_DEFAULT_POOL": "base=198.19.0.0/16,size=24"}, want: func(c *Config) {
			c.Name, c.Timeout = "fromflag", storeconfig.Duration(3*time.Second)
			c.DefaultPools = []DefaultPool{{Base: netip.MustParsePrefix("198.18.4.0/22"), Size: 24}}
		}},
		{name: "etcd without endpoints", args: []string{"--host", "h", "--store", "etcd"}, bad: true},
		{name: "unknown store", args: []string{"--host", "h", "--store", "zk"}, bad: true},
		{name: "tls flags", args: []string{"--host", "h", "--store", "etcd", "--etcd-endpoints", "https://127.0.0.1:2379", "--etcd-cacert", "/ca.pem", "--etcd-cert", "/c.pem", "--etcd-key", "/k.pem"}, want: func(c *Config) {
			c.Store = storeconfig.Config{Type: "etcd", Endpoints: []string{"https://127.0.0.1:2379"}, TLS: &storeconfig.TLS{CA: "/ca.pem", Cert: "/c.pem", Key: "/k.pem"}}
		}},
		{name: "the shared store flags", args: []string{"--host", "h", "--store", "etcd", "--etcd-endpoints", "https://127.0.0.1:2379,https://127.0.0.2:2379",
			"--etcd-prefix", "/p/", "--etcd-ca", "/ca.pem", "--etcd-username", "u", "--etcd-password-file", pwFile,
			"--etcd-dial-timeout", "2s", "--etcd-request-timeout", "3s", "--agent-socket", "/run/a.sock"}, want: func(c *Config) {
			c.Store = storeconfig.Config{Type: "etcd", Endpoints: []string{"https://127.0.0.1:2379", "https://127.0.0.2:2379"}, Prefix: "/p/",
				TLS: &storeconfig.TLS{CA: "/ca.pem"}, Username: "u", Password: "pw", DialTimeout: storeconfig.Duration(2 * time.Second),
				RequestTimeout: storeconfig.Duration(3 * time.Second), AgentSocket: "/run/a.sock"}
		}},
		{name: "store flags from the environment, flags over them", args: []string{"--host", "h", "--etcd-prefix", "/flag/"},
			env: map[string]string{"RINGIPAM_DOCKER_STORE": "etcd", "RINGIPAM_DOCKER_ETCD_ENDPOINTS": "127.0.0.1:2379", "RINGIPAM_DOCKER_ETCD_PREFIX": "/env/"},
			want: func(c *Config) {
				c.Store = storeconfig.Config{Type: "etcd", Endpoints: []string{"127.0.0.1:2379"}, Prefix: "/flag/"}
			}},
		{name: "--store local over an etcd file starts afresh", args: []string{"--config", file, "--store", "local", "--store-path", "/s.db"}, want: func(c *Config) {
			c.Name, c.Host, c.MetricsAddr = "fromfile", "h-file", "127.0.0.1:0"
			c.Store = storeconfig.Config{Type: "local", Path: "/s.db"}
			c.DefaultPools = []DefaultPool{{Base: netip.MustParsePrefix("198.18.0.0/20"), Size: 26}}
		}},
		{name: "agent socket off", args: []string{"--host", "h", "--store", "etcd", "--etcd-endpoints", "127.0.0.1:2379", "--agent-socket", "off"}, bad: true},
		{name: "missing password file", args: []string{"--host", "h", "--store", "etcd", "--etcd-endpoints", "127.0.0.1:2379", "--etcd-username", "u", "--etcd-password-file", "/nonexistent/pw"}, bad: true},
		{name: "cert without key", args: []string{"--host", "h", "--store", "etcd", "--etcd-endpoints", "127.0.0.1:2379", "--etcd-cert", "/c.pem"}, bad: true},
		{name: "bad pool", args: []string{"--host", "h", "--default-pool", "base=198.18.0.0/24,size=16"}, bad: true},
		{name: "bad env", args: []string{"--host", "h"}, env: map[string]string{"RINGIPAM_DOCKER_TIMEOUT": "soon"}, bad: true},
		{name: "stray argument", args: []string{"--host", "h", "extra"}, bad: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := LoadConfig(tc.args, env(tc.env), io.Discard)
			if tc.bad {
				if err == nil {
					t.Fatalf("accepted: %+v", got)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			want := DefaultConfig()
			want.Host = "h"
			tc.want(&want)
			if diff := cmp.Diff(want, got, cmp.Comparer(func(a, b netip.Prefix) bool { return a == b })); diff != "" {
				t.Fatalf("config (-want +got):\n%s", diff)
			}
		})
	}
}

// Today's flag names stay accepted, with a warning naming the new one.
func TestLoadConfigDeprecatedStoreFlags(t *testing.T) {
	var warn strings.Builder
	got, err := LoadConfig([]string{"--host", "h", "--store", "etcd", "--etcd-endpoints", "https://127.0.0.1:2379",
		"--store-prefix", "/old/", "--etcd-cacert", "/ca.pem", "--store-socket", "/run/old.sock"}, func(string) string { return "" }, &warn)
	if err != nil {
		t.Fatal(err)
	}
	want := storeconfig.Config{Type: "etcd", Endpoints: []string{"https://127.0.0.1:2379"}, Prefix: "/old/", TLS: &storeconfig.TLS{CA: "/ca.pem"}, AgentSocket: "/run/old.sock"}
	if diff := cmp.Diff(want, got.Store); diff != "" {
		t.Errorf("store (-want +got):\n%s", diff)
	}
	for _, w := range []string{"--store-prefix is deprecated: use --etcd-prefix", "--etcd-cacert is deprecated: use --etcd-ca", "--store-socket is deprecated: use --agent-socket"} {
		if !strings.Contains(warn.String(), w) {
			t.Errorf("warnings %q lack %q", warn.String(), w)
		}
	}
}

func mustAlloc(t *testing.T) *pool.Allocator {
	t.Helper()
	return newDriver(t, memory.New(), "h1").alloc
}

// TestConfigExamples loads the shipped example configurations.
func TestConfigExamples(t *testing.T) {
	files, err := filepath.Glob("../../conf/ringipam-docker*.json")
	if err != nil || len(files) < 2 {
		t.Fatalf("example configs: %v %v", files, err)
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			cfg, err := LoadConfig([]string{"--config", f}, func(string) string { return "" }, io.Discard)
			if err != nil {
				t.Fatal(err)
			}
			if cfg.Name != DefaultName || cfg.Host == "" || len(cfg.DefaultPools) == 0 {
				t.Fatalf("unexpected config %+v", cfg)
			}
		})
	}
}

func TestListenRefusesNonSocket(t *testing.T) {
	p := filepath.Join(t.TempDir(), "x.sock")
	if err := os.WriteFile(p, []byte("not a socket"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Listen(p); err == nil {
		t.Fatal("Listen replaced a regular file")
	}
	if _, err := os.Stat(p); err != nil {
		t.Fatalf("the file is gone: %v", err)
	}
}
