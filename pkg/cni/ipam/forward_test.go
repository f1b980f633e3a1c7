package ipam

import (
	"bytes"
	"context"
	"errors"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"

	"github.com/ringipam/ringipam/pkg/hostlock"
	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/memory"
	"github.com/ringipam/ringipam/pkg/store/relay"
	"github.com/ringipam/ringipam/pkg/storeconfig"
)

const agentEndpoint = "http://198.18.0.9:2379"

// countingInvoker counts the invocations the agent accepted.
type countingInvoker struct {
	AgentInvoker
	accepted atomic.Int32
}

func (c *countingInvoker) Accept(inv *relay.Invocation) (func(context.Context) relay.Outcome, time.Duration, bool) {
	run, timeout, ok := c.AgentInvoker.Accept(inv)
	if ok {
		c.accepted.Add(1)
	}
	return run, timeout, ok
}

// startAgentSocket serves st (an etcd cluster at agentEndpoint, prefix
// /ringipam/, as far as invocations go) on a fresh socket.
func startAgentSocket(t *testing.T, st store.Store) (string, *countingInvoker) {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "store.sock")
	l, err := relay.Listen(sock)
	if err != nil {
		t.Fatal(err)
	}
	cfg := storeconfig.Config{Type: storeconfig.TypeEtcd, Endpoints: []string{agentEndpoint}}
	inv := &countingInvoker{AgentInvoker: AgentInvoker{Store: st, Config: cfg, HostLocks: hostlock.Dir(t.TempDir())}}
	srv := relay.NewServer(st, cfg.Identity(), t.Logf)
	srv.Invoker = inv
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
	return sock, inv
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

// Every verb sent to the agent prints and fails as the same verb run by
// the plugin itself, and the agent's store holds what it did.
func TestForwardedVerbsMatchDirect(t *testing.T) {
	agentStore, ownStore := memory.New(), memory.New()
	sock, inv := startAgentSocket(t, agentStore)
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
	call := func(e Edge, verb string, args *skel.CmdArgs) error {
		return map[string]func(*skel.CmdArgs) error{"ADD": e.Add, "DEL": e.Del, "CHECK": e.Check, "GC": e.GC, "STATUS": e.Status}[verb](args)
	}
	for _, s := range steps {
		viaOut.Reset()
		ownOut.Reset()
		args := &skel.CmdArgs{ContainerID: s.id, IfName: "eth0", Netns: "/x", StdinData: cfg}
		viaErr, ownErr := call(via, s.verb, args), call(own, s.verb, args)
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
	if n := inv.accepted.Load(); n != int32(len(steps)) {
		t.Fatalf("the agent accepted %d of %d invocations", n, len(steps))
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

// The plugin runs the call itself when the agent serves another cluster,
// when the store is local (never asking the agent), when no agent answers
// on the socket, and when the configuration cannot be read (which it
// reports).
func TestForwardFallsBack(t *testing.T) {
	sock, inv := startAgentSocket(t, memory.New())
	locks := hostlock.Dir(t.TempDir())
	cases := []struct {
		name string
		conf []byte
		code uint
	}{
		{"another cluster", etcdConf(sock, "/other/"), 0},
		{"no agent at the socket", etcdConf(filepath.Join(t.TempDir(), "none.sock"), ""), 0},
		{"local store", conf(`{"host":"h1","ranges":[[{"subnet":"198.18.0.0/24"}]],"store":{"type":"local","path":"/nonexistent/s.db"}}`), 0},
		{"unreadable", conf(`{"host":"h1","ranges":[[{"subnet":"198.18.0.0/24"}]],"store":{"type":"etcd","endpoints":["` + agentEndpoint + `"],"agentSocket":"` + sock + `"},"bogus":1}`), types.ErrInvalidNetworkConfig},
	}
	for _, c := range cases {
		var out bytes.Buffer
		var opened atomic.Int32
		e := directOn(memory.New(), locks, &out, &opened)
		e.ToAgent = true
		err := e.Add(&skel.CmdArgs{ContainerID: "c", IfName: "eth0", Netns: "/x", StdinData: c.conf})
		if codeOf(err) != c.code {
			t.Fatalf("%s: ADD = %v, want code %d", c.name, err, c.code)
		}
		if c.code == 0 && opened.Load() != 1 {
			t.Fatalf("%s: the plugin opened its store %d times, want 1", c.name, opened.Load())
		}
	}
	if n := inv.accepted.Load(); n != 0 {
		t.Fatalf("the agent accepted %d invocations it does not serve", n)
	}
}

// A lost agent: the plugin runs the call itself (every verb may be run
// twice); an agent past the call's timeout fails it with code 11.
func TestForwardLostAgent(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "store.sock")
	l, err := relay.Listen(sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	// A socket that accepts and hangs up at once, as an agent stopping.
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			buf := make([]byte, 1<<16)
			_, _ = c.Read(buf)
			c.Close()
		}
	}()
	var out bytes.Buffer
	var opened atomic.Int32
	e := directOn(memory.New(), hostlock.Dir(t.TempDir()), &out, &opened)
	e.ToAgent = true
	if err := e.Add(&skel.CmdArgs{ContainerID: "c", IfName: "eth0", Netns: "/x", StdinData: etcdConf(sock, "")}); err != nil || opened.Load() != 1 {
		t.Fatalf("ADD with a lost agent: %v, store opened %d times", err, opened.Load())
	}

	// An agent that takes the call and never answers.
	hang := filepath.Join(t.TempDir(), "hang.sock")
	l2, err := relay.Listen(hang)
	if err != nil {
		t.Fatal(err)
	}
	defer l2.Close()
	go func() {
		c, err := l2.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		time.Sleep(20 * time.Second)
	}()
	slow := conf(`{"host":"h1","timeout":"100ms","ranges":[[{"subnet":"198.18.0.0/24"}]],"store":{"type":"etcd","endpoints":["` +
		agentEndpoint + `"],"agentSocket":"` + hang + `"}}`)
	err = e.Add(&skel.CmdArgs{ContainerID: "c2", IfName: "eth0", Netns: "/x", StdinData: slow})
	var te *types.Error
	if !errors.As(err, &te) || te.Code != types.ErrTryAgainLater || opened.Load() != 1 {
		t.Fatalf("ADD with a hung agent: %v (store opened %d times), want code 11 and no call here", err, opened.Load())
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

func (s *speculationCounter) CommitOrGet(ctx context.Context, conds []store.Cond, same []store.KV, ops []store.Op, read []string) ([]store.KV, error) {
	kvs, err := s.Store.CommitOrGet(ctx, conds, same, ops, read)
	if err == nil {
		s.speculated.Add(1)
	}
	return kvs, err
}
