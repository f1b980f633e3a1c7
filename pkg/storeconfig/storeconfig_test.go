package storeconfig_test

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/etcd"
	"github.com/ringipam/ringipam/pkg/store/local"
	"github.com/ringipam/ringipam/pkg/storeconfig"
)

func TestParse(t *testing.T) {
	tests := []struct {
		name string
		json string
		want storeconfig.Config
	}{
		{"empty is local", `{}`, storeconfig.Config{}},
		{"local with duration string", `{"type":"local","path":"/tmp/x.db","openTimeout":"1.5s"}`,
			storeconfig.Config{Type: "local", Path: "/tmp/x.db", OpenTimeout: storeconfig.Duration(1500 * time.Millisecond)}},
		{"integer seconds", `{"openTimeout":7}`, storeconfig.Config{OpenTimeout: storeconfig.Duration(7 * time.Second)}},
		{"quoted integer seconds", `{"openTimeout":"7"}`, storeconfig.Config{OpenTimeout: storeconfig.Duration(7 * time.Second)}},
		{"null duration", `{"openTimeout":null}`, storeconfig.Config{}},
		{"etcd full", `{"type":"etcd","endpoints":["https://198.18.0.1:2379","198.18.0.2:2379","https://[fd00::1]:2379"],"prefix":"/x/",
			"tls":{"ca":"/ca.pem","cert":"/c.pem","key":"/k.pem"},"username":"u","password":"p","dialTimeout":"2s","requestTimeout":3}`,
			storeconfig.Config{Type: "etcd", Endpoints: []string{"https://198.18.0.1:2379", "198.18.0.2:2379", "https://[fd00::1]:2379"}, Prefix: "/x/",
				TLS: &storeconfig.TLS{CA: "/ca.pem", Cert: "/c.pem", Key: "/k.pem"}, Username: "u", Password: "p",
				DialTimeout: storeconfig.Duration(2 * time.Second), RequestTimeout: storeconfig.Duration(3 * time.Second)}},
		{"etcd agent socket and del queue", `{"type":"etcd","endpoints":["h:1"],"agentSocket":"/run/a.sock","delQueue":"/var/q"}`,
			storeconfig.Config{Type: "etcd", Endpoints: []string{"h:1"}, AgentSocket: "/run/a.sock", DelQueue: "/var/q"}},
		{"etcd unix socket", `{"type":"etcd","endpoints":["unix:///run/etcd.sock"]}`,
			storeconfig.Config{Type: "etcd", Endpoints: []string{"unix:///run/etcd.sock"}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := storeconfig.Parse([]byte(tc.json))
			if err != nil {
				t.Fatalf("Parse: %v", err)
			}
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Errorf("Parse (-want +got):\n%s", diff)
			}
			// Round trip through Marshal.
			b, err := json.Marshal(got)
			if err != nil {
				t.Fatal(err)
			}
			again, err := storeconfig.Parse(b)
			if err != nil {
				t.Fatalf("re-Parse of %s: %v", b, err)
			}
			if diff := cmp.Diff(got, again); diff != "" {
				t.Errorf("round trip (-first +second):\n%s", diff)
			}
		})
	}
}

func TestParseErrors(t *testing.T) {
	tests := []struct {
		name string
		json string
		want []string // substrings of the error
	}{
		{"unknown type", `{"type":"consul"}`, []string{`unknown type "consul"`}},
		{"unknown field", `{"type":"local","paht":"/x"}`, []string{"paht"}},
		{"bad duration", `{"openTimeout":"5 sec"}`, []string{`"5 sec"`}},
		{"fractional seconds", `{"openTimeout":1.5}`, []string{"1.5"}},
		{"negative duration", `{"openTimeout":"-1s"}`, []string{"openTimeout -1s is negative"}},
		{"relative path", `{"path":"store.db"}`, []string{"absolute"}},
		{"etcd without endpoints", `{"type":"etcd"}`, []string{"at least one endpoint"}},
		{"etcd bad endpoints", `{"type":"etcd","endpoints":["ftp://x:1","198.18.0.1","h:99999"," h:1"]}`,
			[]string{`"ftp://x:1"`, `"198.18.0.1": want host:port`, `bad port "99999"`, "spaces"}},
		{"etcd cert without key", `{"type":"etcd","endpoints":["h:1"],"tls":{"cert":"/c"}}`, []string{"cert and key"}},
		{"etcd http endpoint with tls", `{"type":"etcd","endpoints":["http://h:1"],"tls":{"ca":"/ca"}}`, []string{"plain http but tls is set"}},
		{"etcd password without user", `{"type":"etcd","endpoints":["h:1"],"password":"p"}`, []string{"without username"}},
		{"etcd with path", `{"type":"etcd","endpoints":["h:1"],"path":"/x"}`, []string{`path belongs to type "local"`}},
		{"local with endpoints", `{"endpoints":["h:1"]}`, []string{`belong to type "etcd"`}},
		{"local with agent socket", `{"agentSocket":"/run/x.sock"}`, []string{`belong to type "etcd"`}},
		{"local with del queue", `{"delQueue":"/var/q"}`, []string{`delQueue belong to type "etcd"`}},
		{"etcd relative del queue", `{"type":"etcd","endpoints":["h:1"],"delQueue":"q"}`, []string{`delQueue "q" must be an absolute path`}},
		{"etcd relative agent socket", `{"type":"etcd","endpoints":["h:1"],"agentSocket":"x.sock"}`, []string{`agentSocket "x.sock" must be an absolute path`}},
		{"etcd agent socket off", `{"type":"etcd","endpoints":["h:1"],"agentSocket":"off"}`, []string{`agentSocket "off" is no longer accepted`, "only through the host agent"}},
		{"trailing data", `{"type":"local"} {}`, []string{"data after the store object"}},
		{"all problems at once", `{"type":"etcd","dialTimeout":"-1s","tls":{"key":"/k"}}`,
			[]string{"dialTimeout", "endpoint", "cert and key"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := storeconfig.Parse([]byte(tc.json))
			if !errors.Is(err, storeconfig.ErrInvalid) {
				t.Fatalf("Parse(%s): err = %v, want ErrInvalid", tc.json, err)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not mention %q", err, w)
				}
			}
		})
	}
}

func TestOpen(t *testing.T) {
	path := filepath.Join(t.TempDir(), "s", "store.db")
	s, err := storeconfig.Open(storeconfig.Config{Path: path})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ls, ok := s.(*local.Store)
	if !ok || ls.Path() != path {
		t.Fatalf("Open(local) = %T %v", s, s)
	}
	ctx := context.Background()
	if err := s.Commit(ctx, nil, []store.Op{store.Put("k", []byte("v"))}); err != nil {
		t.Fatal(err)
	}
	if err := store.Ping(ctx, s); err != nil {
		t.Fatal(err)
	}

	// etcd: etcd's own client, opened without waiting for the network
	// (nothing listens at port 1; the first call fails, unavailable,
	// within the request timeout).
	etcdCfg := storeconfig.Config{Type: "etcd", Endpoints: []string{"127.0.0.1:1"},
		DialTimeout: storeconfig.Duration(100 * time.Millisecond), RequestTimeout: storeconfig.Duration(200 * time.Millisecond)}
	e, err := storeconfig.Open(etcdCfg)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	es, ok := e.(*etcd.Store)
	if !ok || es.Prefix() != etcd.DefaultPrefix {
		t.Fatalf("Open(etcd) = %T", e)
	}
	if err := store.Ping(ctx, e); !errors.Is(err, store.ErrUnavailable) || !strings.Contains(err.Error(), "127.0.0.1:1") {
		t.Fatalf("Ping of nothing: %v", err)
	}
	if got := (storeconfig.Config{Type: "etcd"}).Socket(); got != "/run/ringipam/agent.sock" {
		t.Fatalf("default socket %q", got)
	}
	if got := (storeconfig.Config{}).Socket(); got != "" {
		t.Fatalf("a local store's socket %q, want none", got)
	}

	// etcd.Open: the concrete store, for etcd configs only.
	oe, err := etcd.Open(storeconfig.Config{Type: "etcd", Endpoints: []string{"127.0.0.1:1"}, Prefix: "/p/"})
	if err != nil {
		t.Fatal(err)
	}
	oe.Close()
	if oe.Prefix() != "/p/" {
		t.Errorf("etcd.Open prefix %q", oe.Prefix())
	}
	if _, err := etcd.Open(storeconfig.Config{Path: path}); !errors.Is(err, storeconfig.ErrInvalid) {
		t.Errorf("etcd.Open(local) err = %v, want ErrInvalid", err)
	}
	if _, err := etcd.Open(storeconfig.Config{Type: "etcd"}); !errors.Is(err, storeconfig.ErrInvalid) {
		t.Errorf("etcd.Open(no endpoints) err = %v, want ErrInvalid", err)
	}
	// A TLS file that cannot be read is an error of Open, naming it.
	bad := etcdCfg
	bad.Endpoints = []string{"https://127.0.0.1:1"}
	bad.TLS = &storeconfig.TLS{CA: filepath.Join(t.TempDir(), "missing-ca.pem")}
	if _, err := storeconfig.Open(bad); err == nil || !strings.Contains(err.Error(), "missing-ca.pem") {
		t.Errorf("Open with a missing CA file: %v", err)
	}

	if _, err := storeconfig.Open(storeconfig.Config{Type: "nope"}); !errors.Is(err, storeconfig.ErrInvalid) {
		t.Fatalf("Open(bad type) err = %v", err)
	}
}

func TestDescribe(t *testing.T) {
	for _, tc := range []struct {
		c    storeconfig.Config
		want string
	}{
		{storeconfig.Config{}, "local /var/lib/ringipam/store.db"},
		{storeconfig.Config{Type: "etcd", Endpoints: []string{"a:1", "b:2"}, Password: "secret"}, "etcd a:1,b:2 prefix /ringipam/"},
	} {
		if got := tc.c.Describe(); got != tc.want {
			t.Errorf("Describe(%+v) = %q, want %q", tc.c, got, tc.want)
		}
	}
}

func FuzzDuration(f *testing.F) {
	for _, s := range []string{`"5s"`, `5`, `"7"`, `null`, `"-1ms"`, `1e3`, `"1h2m"`, `99999999999999999999`} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		var d storeconfig.Duration
		if err := json.Unmarshal([]byte(s), &d); err != nil {
			return
		}
		b, err := json.Marshal(d)
		if err != nil {
			t.Fatal(err)
		}
		var back storeconfig.Duration
		if err := json.Unmarshal(b, &back); err != nil || back != d {
			t.Fatalf("%s -> %v -> %s -> %v, %v", s, d, b, back, err)
		}
	})
}

// The long-lived programs reach etcd through etcd's own client
// (storeconfig.Open -> package etcd -> clientv3), and nothing links the
// deleted wire clients of our own.
func TestOneEtcdClient(t *testing.T) {
	for _, pkg := range []string{"../../cmd/ringctl", "../../docker-driver", "../../cmd/ringipamd"} {
		out, err := exec.Command("go", "list", "-deps", pkg).CombinedOutput()
		if err != nil {
			t.Fatalf("go list %s: %v\n%s", pkg, err, out)
		}
		deps := strings.Fields(string(out))
		for _, want := range []string{"go.etcd.io/etcd/client/v3", "github.com/ringipam/ringipam/pkg/store/etcd", "github.com/ringipam/ringipam/pkg/storeconfig"} {
			if !slices.Contains(deps, want) {
				t.Errorf("%s does not link %s", pkg, want)
			}
		}
		checkGone(t, pkg, deps)
	}
	// The plugins never open etcd (the agent does it for them): they link
	// neither etcd's client nor gRPC, whose initialisation every call
	// would pay.
	for _, pkg := range []string{"../../plugins/ipam-ring", "../../plugins/portmap-ingress"} {
		out, err := exec.Command("go", "list", "-deps", pkg).CombinedOutput()
		if err != nil {
			t.Fatalf("go list %s: %v\n%s", pkg, err, out)
		}
		deps := strings.Fields(string(out))
		for _, dep := range deps {
			if strings.HasPrefix(dep, "go.etcd.io/etcd/client") || strings.HasPrefix(dep, "google.golang.org/grpc") || dep == "github.com/ringipam/ringipam/pkg/store/etcd" {
				t.Errorf("%s links %s", pkg, dep)
			}
		}
		if !slices.Contains(deps, "github.com/containernetworking/cni/pkg/skel") {
			t.Errorf("%s does not link the CNI library's skel", pkg)
		}
		checkGone(t, pkg, deps)
	}
}

// checkGone fails t for every package of deps named after a deleted one.
func checkGone(t *testing.T, pkg string, deps []string) {
	t.Helper()
	for _, dep := range deps {
		if !strings.HasPrefix(dep, "github.com/ringipam/") {
			continue
		}
		for _, gone := range []string{"etcdjson", "etcdtls", "connctx", "relay", "jsonscan", "cnimain", "oneproc"} {
			if strings.Contains(dep, gone) {
				t.Errorf("%s links %s", pkg, dep)
			}
		}
	}
}

func TestHostName(t *testing.T) {
	if h, err := storeconfig.HostName("node-1"); err != nil || h != "node-1" {
		t.Fatalf("configured: %q %v", h, err)
	}
	want, _ := os.Hostname()
	if h, err := storeconfig.HostName(""); err != nil || h != want {
		t.Fatalf("default: %q %v, want %q", h, err, want)
	}
}

var served = storeconfig.Identity{Prefix: "/ringipam/", Endpoints: []string{"http://198.18.0.1:2379", "198.18.0.2:2379"}}

func TestIdentityMatches(t *testing.T) {
	for _, tc := range []struct {
		c    storeconfig.Identity
		want bool
	}{
		{storeconfig.Identity{Prefix: "/ringipam/", Endpoints: []string{"198.18.0.1:2379/"}}, true},
		{storeconfig.Identity{Prefix: "/ringipam/", Endpoints: []string{"https://198.18.0.2:2379"}}, true},
		{storeconfig.Identity{Prefix: "/ringipam/", Endpoints: []string{"198.18.0.3:2379"}}, false},
		{storeconfig.Identity{Prefix: "/other/", Endpoints: []string{"198.18.0.1:2379"}}, false},
		{storeconfig.Identity{Prefix: "/ringipam/"}, false},
	} {
		if got := served.Matches(tc.c); got != tc.want {
			t.Errorf("%+v: %v, want %v", tc.c, got, tc.want)
		}
	}
}

func TestIdentityKey(t *testing.T) {
	a := storeconfig.Identity{Prefix: "/r/", Endpoints: []string{"http://a:2379", "b:2379/"}}
	b := storeconfig.Identity{Prefix: "/r/", Endpoints: []string{"https://b:2379", "a:2379"}}
	if a.Key() != b.Key() || !a.Matches(b) {
		t.Errorf("the same endpoints in another order and spelling: keys %q and %q", a.Key(), b.Key())
	}
	for _, c := range []storeconfig.Identity{
		{Prefix: "/s/", Endpoints: a.Endpoints},
		{Prefix: "/r/", Endpoints: []string{"a:2379"}},
		{Prefix: "/r/", Endpoints: []string{"a:2379", "b:2380"}},
	} {
		if c.Key() == a.Key() {
			t.Errorf("%+v has the key of %+v", c, a)
		}
	}
}
