package agent

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/portalloc"
	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/memory"
)

func TestDesiredForwards(t *testing.T) {
	ports := []portalloc.Published{
		{Address: portalloc.Address{Protocol: "tcp", Number: 8080}, State: portalloc.AddrState{Ingress: "port/n/a/eth0", IngressHost: "a"}},
		{Address: portalloc.Address{Protocol: "udp", Number: 53}, State: portalloc.AddrState{Ingress: "port/n/b/eth0", IngressHost: "b"}},
		{Address: portalloc.Address{Protocol: "tcp", Number: 9000}, State: portalloc.AddrState{Ingress: "port/n/me/eth0", IngressHost: "me"}},
		{Address: portalloc.Address{Protocol: "tcp", Number: 9001}, State: portalloc.AddrState{Hosts: []portalloc.HostUse{{Host: "a", Endpoint: "port/n/h/eth0"}}}},
		{Address: portalloc.Address{Protocol: "tcp", Number: 9002}, State: portalloc.AddrState{Ingress: "port/n/o/eth0", IngressHost: "gone"}},
		{Address: portalloc.Address{Protocol: "tcp", Number: 9003}, State: portalloc.AddrState{Ingress: "port/n/x/eth0", IngressHost: "noaddr"}},
		{Address: portalloc.Address{Protocol: "tcp", Number: 9004}, State: portalloc.AddrState{Ingress: "port/n/y/eth0", IngressHost: "stranger"}},
		{Address: portalloc.Address{Protocol: "tcp", Number: 9005}, State: portalloc.AddrState{Ingress: "port/n/z/eth0", IngressHost: "v6"}},
		{Address: portalloc.Address{Protocol: "tcp", Number: 9006}, State: portalloc.AddrState{Ingress: "port/n/d/eth0", IngressHost: "dual"}},
		{Address: portalloc.Address{Protocol: "tcp", Number: 9007}, State: portalloc.AddrState{Ingress: "port/n/e/eth0", IngressHost: "halfbad"}},
	}
	hosts := []pool.HostInfo{
		{Name: "a", State: pool.HostUp, Addr: "198.18.0.1"},
		{Name: "b", State: pool.HostDown, Addr: "198.18.0.2"},
		{Name: "me", State: pool.HostUp, Addr: "198.18.0.3"},
		{Name: "gone", State: pool.HostOrphaned, Addr: "198.18.0.4"},
		{Name: "noaddr", State: pool.HostUp},
		{Name: "v6", State: pool.HostUp, Addr: "2001:db8::6"},
		{Name: "dual", State: pool.HostUp, Addr: "2001:db8::7,198.18.0.7"},
		{Name: "halfbad", State: pool.HostUp, Addr: "198.18.0.8,nohost"},
	}
	got, problems := DesiredForwards("me", ports, hosts)
	want := []Forward{
		{Protocol: "tcp", Port: 8080, To: netip.MustParseAddr("198.18.0.1"), Host: "a", Endpoint: "port/n/a/eth0"},
		{Protocol: "tcp", Port: 9005, To: netip.MustParseAddr("2001:db8::6"), Host: "v6", Endpoint: "port/n/z/eth0"},
		// A dual-stack holder: each family's packets to its address of
		// that family.
		{Protocol: "tcp", Port: 9006, To: netip.MustParseAddr("198.18.0.7"), Host: "dual", Endpoint: "port/n/d/eth0"},
		{Protocol: "tcp", Port: 9006, To: netip.MustParseAddr("2001:db8::7"), Host: "dual", Endpoint: "port/n/d/eth0"},
		{Protocol: "tcp", Port: 9007, To: netip.MustParseAddr("198.18.0.8"), Host: "halfbad", Endpoint: "port/n/e/eth0"},
		{Protocol: "udp", Port: 53, To: netip.MustParseAddr("198.18.0.2"), Host: "b", Endpoint: "port/n/b/eth0"},
	}
	if len(got) != len(want) {
		t.Fatalf("forwards %v, want %v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("forward %d: %v, want %v", i, got[i], want[i])
		}
	}
	if len(problems) != 3 || !strings.Contains(problems[0], "no recorded address") || !strings.Contains(problems[1], "unknown host stranger") ||
		!strings.Contains(problems[2], `recorded address "nohost" is not an IP`) {
		t.Errorf("problems %q", problems)
	}
}

func v4Def(name, cidr string) pool.Def {
	return pool.Def{Name: name, Ranges: []pool.Range{{Subnet: netip.MustParsePrefix(cidr)}}}
}

func alloc(t *testing.T, st store.Store, host, pl, ctr string) netip.Addr {
	t.Helper()
	a, err := pool.New(st, host)
	if err != nil {
		t.Fatal(err)
	}
	got, err := a.Allocate(context.Background(), pool.Request{
		Owner: pool.Owner{Kind: pool.KindCNI, Network: "net", ContainerID: ctr, IfName: "eth0"},
		Defs:  []pool.Def{v4Def(pl, "198.18.8.0/24")},
		Wants: []pool.Want{{Pool: pl, Role: pool.RoleIP}},
	})
	if err != nil {
		t.Fatal(err)
	}
	return got.Addrs[0].Addr
}

func TestStatusPageDrawsOneBandPerHost(t *testing.T) {
	st := memory.New()
	for i, h := range []string{"host-a", "host-b", "host-c"} {
		for j := range i + 1 {
			alloc(t, st, h, "p", h+"-"+string(rune('0'+j)))
		}
	}
	a := newTestAgent(t, st, "host-a", nil)
	a.refreshSnapshot(context.Background())
	s := a.snapshot.Load()
	if s == nil || len(s.Pools) != 1 {
		t.Fatalf("snapshot %+v", s)
	}
	var used uint64
	for _, u := range s.Pools[0].Used {
		used += u
	}
	if used != 6 || s.Pools[0].Usage.Used != 6 {
		t.Fatalf("per-range use %v (usage %d), want 6 in all", s.Pools[0].Used, s.Pools[0].Usage.Used)
	}
	page, err := renderPage(*s, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	html := string(page)
	for _, h := range []string{"host-a", "host-b", "host-c"} {
		if n := strings.Count(html, `class="band" data-host="`+h+`"`); n != 1 {
			t.Errorf("%d bands for %s", n, h)
		}
		if !strings.Contains(html, `class="range" data-host="`+h+`"`) {
			t.Errorf("no range arc of %s", h)
		}
	}
	if strings.Count(html, `class="fill"`) < 3 {
		t.Errorf("fill arcs missing:\n%s", html)
	}
}

// fakeForwarder records what the agent installs.
type fakeForwarder struct {
	mu      sync.Mutex
	last    []Forward
	syncs   int
	removed bool
}

func (f *fakeForwarder) Sync(_ context.Context, fs []Forward) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.last, f.syncs = fs, f.syncs+1
	return nil
}

func (f *fakeForwarder) Remove(context.Context) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.removed = true
	return nil
}

func newTestAgent(t *testing.T, st store.Store, host string, fwd forwarder, opts ...Option) *Agent {
	t.Helper()
	cfg := DefaultConfig()
	cfg.Host, cfg.Addr = host, "198.18.0.9"
	cfg.SyncInterval = 20 * 1e6
	cfg.Heartbeat = 20 * 1e6
	cfg.SweepInterval = 20 * 1e6
	cfg.StatusRefresh = 20 * 1e6
	cfg.Ingress = fwd != nil
	cfg.PortmapTable = "off" // never the machine's own table; withPortmap for a fake
	opts = append(opts, withStore(st))
	if fwd != nil {
		opts = append(opts, withForwarder(fwd))
	}
	a, err := New(cfg, slog.New(slog.NewTextHandler(io.Discard, nil)), opts...)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// TestAgentServesAndForwards runs the whole agent on the memory store: it
// records its liveness, forwards another host's ingress port, drops the
// forward when the port is released, and serves its pages.
func TestAgentServesAndForwards(t *testing.T) {
	st := memory.New()
	alloc(t, st, "host-b", "p", "b-web")
	// host-b's agent recorded its address.
	b, _ := pool.New(st, "host-b")
	if _, err := b.Heartbeat(context.Background(), "198.18.0.2", nil); err != nil {
		t.Fatal(err)
	}
	ports, _ := portalloc.New(st, "host-b")
	ep := portalloc.EndpointID{Network: "net", ContainerID: "b-web", IfName: "eth0"}
	if _, err := ports.Allocate(context.Background(), ep, []portalloc.Port{{Mode: portalloc.Ingress, Protocol: "tcp", Number: 8443, Name: "80"}}); err != nil {
		t.Fatal(err)
	}
	fwd := &fakeForwarder{}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	a := newTestAgent(t, st, "host-a", fwd, WithListener(l))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
		if !fwd.removed {
			t.Error("forwards not removed on stop")
		}
	}()
	waitFor(t, "the forward of 8443", func() bool {
		fwd.mu.Lock()
		defer fwd.mu.Unlock()
		return len(fwd.last) == 1 && fwd.last[0].Port == 8443 && fwd.last[0].To.String() == "198.18.0.2"
	})
	hosts, err := a.alloc.Hosts(context.Background(), 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, h := range hosts {
		if h.Name == "host-a" && h.State != pool.HostUp {
			t.Errorf("host-a is %s with its agent running", h.State)
		}
	}
	base := "http://" + l.Addr().String()
	for path, want := range map[string]string{"/": `class="band" data-host="host-b"`, "/metrics": `ringipam_ingress_forwards`, "/status.json": `"forwards"`, "/healthz": "ok", "/livez": "ok", "/readyz": "ok"} {
		waitFor(t, path, func() bool {
			body, code := get(base + path)
			return code == 200 && strings.Contains(body, want)
		})
	}
	if _, err := ports.Release(context.Background(), ep); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the forward's removal", func() bool {
		fwd.mu.Lock()
		defer fwd.mu.Unlock()
		return len(fwd.last) == 0
	})
}

func get(url string) (string, int) {
	c := http.Client{Timeout: 2 * time.Second}
	r, err := c.Get(url)
	if err != nil {
		return err.Error(), 0
	}
	defer r.Body.Close()
	b, _ := io.ReadAll(r.Body)
	return string(b), r.StatusCode
}

func waitFor(t *testing.T, what string, ok func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !ok() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestLoadConfig(t *testing.T) {
	env := map[string]string{"RINGIPAMD_ORPHAN_AFTER": "72h"}
	// --del-queue before --store: the store flags start the store over
	// when --store changes its type, the DEL queue stays.
	cfg, err := LoadConfig([]string{"--host", "n1", "--addr", "198.18.0.5", "--del-queue", "/var/q", "--store", "etcd", "--etcd-endpoints", "http://127.0.0.1:2379"},
		func(k string) string { return env[k] }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Host != "n1" || time.Duration(cfg.OrphanAfter) != 72*time.Hour || cfg.Store.Endpoints[0] != "http://127.0.0.1:2379" ||
		cfg.Store.DelQueue != "/var/q" {
		t.Fatalf("%+v", cfg)
	}
	// Dual-stack: one address per family, comma-separated or repeated;
	// the flag replaces RINGIPAMD_ADDR, repeated flags add up.
	for _, c := range []struct {
		args []string
		env  string
		want string
	}{
		{[]string{"--addr", " 198.18.0.5, fd00::5 "}, "", "198.18.0.5,fd00::5"},
		{[]string{"--addr", "fd00::5", "--addr", "198.18.0.5"}, "", "fd00::5,198.18.0.5"},
		{[]string{"--addr", "198.18.0.5"}, "fd00::9", "198.18.0.5"},
		{nil, "198.18.0.9,fd00::9", "198.18.0.9,fd00::9"},
	} {
		cfg, err := LoadConfig(append([]string{"--host", "n1"}, c.args...), func(k string) string {
			if k == "RINGIPAMD_ADDR" {
				return c.env
			}
			return ""
		}, io.Discard)
		if err != nil || cfg.Addr != c.want {
			t.Errorf("%q with RINGIPAMD_ADDR=%q: addr %q, %v; want %q", c.args, c.env, cfg.Addr, err, c.want)
		}
	}
	for _, bad := range [][]string{
		{"--addr", "not-an-ip"},
		{"--addr", "198.18.0.5,198.18.0.6"},
		{"--addr", "fd00::5", "--addr", "fd00::6"},
		{"--addr", "198.18.0.5,fd00::5,nohost"},
		{"--lease-ttl", "1s"},
		{"--store", "etcd"},
		{"--log-level", "loud"},
		{"--ingress-table", "a b"},
		{"--del-queue", "/var/q"}, // a local store has no DEL queue
		{"--store", "etcd", "--etcd-endpoints", "http://127.0.0.1:2379", "--del-queue", "q"},
		{"extra"},
	} {
		if _, err := LoadConfig(append([]string{"--host", "n1"}, bad...), func(string) string { return "" }, io.Discard); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

// The example configuration in conf/ loads as it is.
func TestExampleConfigLoads(t *testing.T) {
	cfg, err := LoadConfig([]string{"--config", "../../../conf/ringipamd.json"}, func(string) string { return "" }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Host != "node-1" || cfg.Addr != "198.18.0.11" || cfg.Store.Type != "etcd" || cfg.Store.TLS == nil {
		t.Fatalf("%+v", cfg)
	}
}
