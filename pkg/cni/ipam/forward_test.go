package ipam

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/ringipam/ringipam/pkg/agentapi"
	"github.com/ringipam/ringipam/pkg/hostlock"
	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/memory"
	"github.com/ringipam/ringipam/pkg/storeconfig"
)

const agentEndpoint = "http://198.18.0.9:2379"

// countingHandler counts the invocations the agent ran.
type countingHandler struct {
	AgentHandler
	ran atomic.Int32
}

func (c *countingHandler) Serve(ctx context.Context, req *agentapi.Request) agentapi.Answer {
	c.ran.Add(1)
	return c.AgentHandler.Serve(ctx, req)
}

// startAgentSocket serves st (an etcd cluster at agentEndpoint, prefix
// /ringipam/, as far as invocations go) on a fresh socket.
func startAgentSocket(t *testing.T, st store.Store) (string, *countingHandler) {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "agent.sock")
	l, err := agentapi.Listen(sock)
	if err != nil {
		t.Fatal(err)
	}
	cfg := storeconfig.Config{Type: storeconfig.TypeEtcd, Endpoints: []string{agentEndpoint}}
	h := &countingHandler{AgentHandler: AgentHandler{Store: st, Config: cfg, HostLocks: hostlock.Dir(t.TempDir())}}
	srv := &agentapi.Server{Handlers: agentapi.Handlers{agentapi.PluginIPAM: h}, PeerUID: uint32(os.Geteuid()), Log: func(msg string, args ...any) { t.Log(append([]any{msg}, args...)...) }}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx, l) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Error("the agent's socket did not stop")
		}
	})
	return sock, h
}

// etcdConf is a network config on the etcd cluster at agentEndpoint with
// the given prefix, whose agent socket is sock.
func etcdConf(sock, prefix string) []byte {
	return conf(`{"host":"h1","ranges":[[{"subnet":"198.18.0.0/24"}]],"store":{"type":"etcd","endpoints":["` + agentEndpoint +
		`"],"prefix":"` + prefix + `","agentSocket":"` + sock + `"}}`)
}

// directOn is an Edge that runs calls itself on st and counts them.
func directOn(st store.Store, locks hostlock.Dir, out *bytes.Buffer, opened *atomic.Int32) Edge {
	return Edge{Stdout: out, Open: func(_ context.Context, c *Config) (Allocator, func() error, error) {
		opened.Add(1)
		a, err := newAllocator(st, c, locks)
		return a, func() error { return nil }, err
	}}
}

func callVerb(e Edge, verb string, args *skel.CmdArgs) error {
	return map[string]func(*skel.CmdArgs) error{"ADD": e.Add, "DEL": e.Del, "CHECK": e.Check, "GC": e.GC, "STATUS": e.Status}[verb](args)
}

// Every verb sent to the agent prints and fails as the same verb run by
// the plugin itself, and the agent's store holds what it did.
func TestForwardedVerbsMatchDirect(t *testing.T) {
	agentStore, ownStore := memory.New(), memory.New()
	sock, h := startAgentSocket(t, agentStore)
	var viaOut, ownOut bytes.Buffer
	var opened, ownOpened atomic.Int32
	via := directOn(memory.New(), hostlock.Dir(t.TempDir()), &viaOut, &opened) // must not be opened
	via.ToAgent = true
	own := directOn(ownStore, hostlock.Dir(t.TempDir()), &ownOut, &ownOpened)
	cfg := etcdConf(sock, "")

	type step struct {
		verb string
		id   string
		code uint
	}
	steps := []step{
		{"ADD", "c1", 0}, {"ADD", "c2", 0}, {"ADD", "c1", 0}, // repeated: the same address
		{"CHECK", "nobody", CodeCheckFailed},
		{"STATUS", "", 0},
		{"DEL", "c1", 0}, {"DEL", "c1", 0},
		{"GC", "", 0},
	}
	for _, s := range steps {
		viaOut.Reset()
		ownOut.Reset()
		args := &skel.CmdArgs{ContainerID: s.id, IfName: "eth0", Netns: "/x", StdinData: cfg}
		viaErr, ownErr := callVerb(via, s.verb, args), callVerb(own, s.verb, args)
		if codeOf(viaErr) != s.code || codeOf(ownErr) != s.code {
			t.Fatalf("%s %s: through the agent %v, here %v; want code %d", s.verb, s.id, viaErr, ownErr, s.code)
		}
		if viaErr != nil && viaErr.Error() != ownErr.Error() {
			t.Fatalf("%s %s: through the agent %q, here %q", s.verb, s.id, viaErr, ownErr)
		}
		if viaOut.String() != ownOut.String() {
			t.Fatalf("%s %s printed through the agent:\n%s\nhere:\n%s", s.verb, s.id, viaOut.String(), ownOut.String())
		}
	}
	if n := opened.Load(); n != 0 {
		t.Fatalf("the forwarding plugin opened its store %d times", n)
	}
	if n := h.ran.Load(); n != int32(len(steps)) {
		t.Fatalf("the agent ran %d of %d invocations", n, len(steps))
	}
	a, err := pool.New(agentStore, "h1")
	if err != nil {
		t.Fatal(err)
	}
	held, err := a.List(context.Background(), pool.Filter{})
	if err != nil {
		t.Fatal(err)
	}
	if len(held) != 1 || held[0].Owner.ContainerID != "c2" {
		t.Fatalf("the agent's store holds %+v, want c2's address only", held)
	}
}

// An invocation naming another cluster than the agent's fails with code
// 11 naming both; a local store never asks the agent; a configuration
// that does not load fails with 7 before the agent is asked.
func TestForwardRefusals(t *testing.T) {
	sock, h := startAgentSocket(t, memory.New())
	locks := hostlock.Dir(t.TempDir())
	cases := []struct {
		name   string
		conf   []byte
		code   uint
		says   string
		opened int32
	}{
		{"another cluster", etcdConf(sock, "/other/"), types.ErrTryAgainLater, "this host's agent serves etcd " + agentEndpoint + " prefix /ringipam/", 0},
		{"local store", conf(`{"host":"h1","ranges":[[{"subnet":"198.18.0.0/24"}]],"store":{"type":"local","path":"/nonexistent/s.db"}}`), 0, "", 1},
		{"unreadable", conf(`{"host":"h1","ranges":[[{"subnet":"198.18.0.0/24"}]],"store":{"type":"etcd","endpoints":["` + agentEndpoint + `"],"agentSocket":"` + sock + `"},"bogus":1}`), types.ErrInvalidNetworkConfig, "bogus", 0},
	}
	for _, c := range cases {
		var out bytes.Buffer
		var opened atomic.Int32
		e := directOn(memory.New(), locks, &out, &opened)
		e.ToAgent = true
		err := e.Add(&skel.CmdArgs{ContainerID: "c", IfName: "eth0", Netns: "/x", StdinData: c.conf})
		if codeOf(err) != c.code || (err != nil && !strings.Contains(err.Error(), c.says)) {
			t.Fatalf("%s: ADD = %v, want code %d saying %q", c.name, err, c.code, c.says)
		}
		if opened.Load() != c.opened {
			t.Fatalf("%s: the plugin opened its store %d times, want %d", c.name, opened.Load(), c.opened)
		}
	}
	if n := h.ran.Load(); n != 1 {
		t.Fatalf("the agent ran %d invocations, want 1 (the other cluster's, refused)", n)
	}
}

// Without an agent the plugin runs nothing itself: ADD fails with 11
// naming the socket, DEL is queued in the store's delQueue (one with a bad
// name is refused, 7, not queued).
func TestForwardWithoutAgent(t *testing.T) {
	dir := t.TempDir()
	sock, queue := filepath.Join(dir, "none.sock"), filepath.Join(dir, "q")
	cfg := conf(`{"host":"h1","ranges":[[{"subnet":"198.18.0.0/24"}]],"store":{"type":"etcd","endpoints":["` + agentEndpoint +
		`"],"agentSocket":"` + sock + `","delQueue":"` + queue + `"}}`)
	var out bytes.Buffer
	var opened atomic.Int32
	e := directOn(memory.New(), hostlock.Dir(t.TempDir()), &out, &opened)
	e.ToAgent = true
	err := e.Add(&skel.CmdArgs{ContainerID: "c", IfName: "eth0", Netns: "/x", StdinData: cfg})
	if codeOf(err) != types.ErrTryAgainLater || !strings.Contains(err.Error(), sock) {
		t.Fatalf("ADD without agent: %v, want code 11 naming %s", err, sock)
	}
	// A DEL with a bad name is refused here (7), not queued.
	if err := e.Del(&skel.CmdArgs{ContainerID: "c", IfName: "eth:0", StdinData: cfg}); codeOf(err) != types.ErrInvalidNetworkConfig {
		t.Fatalf("DEL of interface eth:0 without agent: %v, want code 7", err)
	}
	if err := e.Del(&skel.CmdArgs{ContainerID: "c", IfName: "eth0", StdinData: cfg}); err != nil {
		t.Fatalf("DEL without agent: %v, want it queued", err)
	}
	if n, err := (agentapi.DelQueue{Dir: queue}).Len(); err != nil || n != 1 || opened.Load() != 0 {
		t.Fatalf("queued %d (%v), store opened %d times; want 1 queued and nothing run here", n, err, opened.Load())
	}
}

// On etcd the plugin keeps a note per pool beside the pool's host lock,
// tagged with the cluster, and its next ADD commits in one round trip on
// it; on the local store it keeps none.
func TestEtcdADDsKeepNotes(t *testing.T) {
	noAgent := filepath.Join(t.TempDir(), "none.sock")
	for _, tc := range []struct {
		name  string
		conf  []byte
		notes int
	}{
		{"etcd", etcdConf(noAgent, ""), 1},
		{"another etcd prefix", etcdConf(noAgent, "/other/"), 1},
		{"local", conf(`{"host":"h1","ranges":[[{"subnet":"198.18.0.0/24"}]],"store":{"type":"local","path":"/nonexistent/s.db"}}`), 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			locks := hostlock.Dir(t.TempDir())
			st := &speculationCounter{Store: memory.New()}
			var out bytes.Buffer
			var opened atomic.Int32
			e := directOn(st, locks, &out, &opened)
			for _, id := range []string{"c1", "c2", "c3"} {
				if err := e.Add(&skel.CmdArgs{ContainerID: id, IfName: "eth0", Netns: "/x", StdinData: tc.conf}); err != nil {
					t.Fatal(err)
				}
			}
			notes, _ := filepath.Glob(filepath.Join(string(locks), "*.note"))
			if len(notes) != tc.notes {
				t.Fatalf("notes %v, want %d", notes, tc.notes)
			}
			if want := int32(2 * tc.notes); st.speculated.Load() != want {
				t.Fatalf("%d ADDs committed on notes, want %d", st.speculated.Load(), want)
			}
			if tc.notes == 1 && !strings.Contains(notes[0], "@h1.") {
				t.Fatalf("note %s is not named after the pool and host, with a cluster tag", notes[0])
			}
		})
	}
	a, b := clusterTag(storeconfig.Config{Type: "etcd", Endpoints: []string{"http://a:2379", "http://b:2379"}}),
		clusterTag(storeconfig.Config{Type: "etcd", Endpoints: []string{"http://b:2379", "http://a:2379"}})
	if c := clusterTag(storeconfig.Config{Type: "etcd", Endpoints: []string{"http://a:2379"}, Prefix: "/x/"}); a != b || a == c {
		t.Fatalf("cluster tags %s %s %s: want the first two equal (endpoints in any order), the third different", a, b, c)
	}
}

// speculationCounter counts the commits made on notes.
type speculationCounter struct {
	*memory.Store
	speculated atomic.Int32
}

// A CommitOrGet with nothing to read is an ordinary commit (that tells
// its revision), not one on notes.
func (s *speculationCounter) CommitOrGet(ctx context.Context, conds []store.Cond, same []store.KV, ops []store.Op, read []string) (int64, []store.KV, error) {
	rev, kvs, err := s.Store.CommitOrGet(ctx, conds, same, ops, read)
	if err == nil && len(read) > 0 {
		s.speculated.Add(1)
	}
	return rev, kvs, err
}
