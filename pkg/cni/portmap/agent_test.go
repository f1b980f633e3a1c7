package portmap

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/ringipam/ringipam/pkg/agentapi"
	"github.com/ringipam/ringipam/pkg/portalloc"
	"github.com/ringipam/ringipam/pkg/store/memory"
	"github.com/ringipam/ringipam/pkg/storeconfig"
)

const agentEndpoint = "http://198.18.0.9:2379"

// etcdStore is the "store" key of a configuration on the etcd at
// agentEndpoint under prefix, with the agent's socket and DEL queue.
func etcdStore(prefix, sock, queue string) string {
	return `,"store":{"type":"etcd","endpoints":["` + agentEndpoint + `"],"prefix":"` + prefix + `","agentSocket":"` + sock + `","delQueue":"` + queue + `"}`
}

// The plugin on etcd sends its verbs to the agent, which runs them on its
// store and its data path (here a fake) and answers what the plugin
// prints and logs; a configuration of another cluster is refused with 11;
// with no agent, ADD fails with 11 and DEL is queued.
func TestVerbsThroughTheAgent(t *testing.T) {
	st, dp := memory.New(), newFake()
	dir := t.TempDir()
	sock, queue := filepath.Join(dir, "agent.sock"), filepath.Join(dir, "q")
	l, err := agentapi.Listen(sock)
	if err != nil {
		t.Fatal(err)
	}
	h := AgentHandler{Store: st, Config: storeconfig.Config{Type: storeconfig.TypeEtcd, Endpoints: []string{agentEndpoint}},
		Locks: testLocks, Dataplane: func(*Config) (Dataplane, error) { return dp, nil }}
	srv := &agentapi.Server{Handlers: agentapi.Handlers{agentapi.PluginPortmap: h}, PeerUID: uint32(os.Geteuid())}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx, l) }()
	defer func() {
		cancel()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Error("the agent's socket did not stop")
		}
	}()
	var out, log bytes.Buffer
	e := Edge{Stdout: &out, Stderr: &log, ToAgent: true, Open: func(context.Context, *Config) (Opened, error) {
		t.Fatal("the plugin opened a store of its own")
		return Opened{}, nil
	}}
	funcs := e.Funcs()
	cfg := conf("h1", `{"hostPort":8080,"containerPort":80,"protocol":"tcp"}`, etcdStore("", sock, queue))
	if err := funcs.Add(args("c1", cfg)); err != nil {
		t.Fatalf("ADD through the agent: %v", err)
	}
	if !strings.Contains(out.String(), `"hostPort": 8080`) || !strings.Contains(log.String(), "published host tcp 8080->80") {
		t.Fatalf("ADD printed %s and logged %q, want the published port in both", out.String(), log.String())
	}
	pa, err := portalloc.New(st, "h1")
	if err != nil {
		t.Fatal(err)
	}
	ep := portalloc.EndpointID{Network: "web", ContainerID: "c1", IfName: "eth0"}
	if _, ok, err := pa.Lookup(context.Background(), ep); err != nil || !ok {
		t.Fatalf("the agent's store does not hold c1's ports: %v %v", ok, err)
	}
	if len(dp.marks) != 1 {
		t.Fatalf("the agent's data path has %d attachments, want 1", len(dp.marks))
	}
	if err := funcs.Del(args("c1", cfg)); err != nil {
		t.Fatalf("DEL through the agent: %v", err)
	}
	if _, ok, _ := pa.Lookup(context.Background(), ep); ok || len(dp.marks) != 0 {
		t.Fatalf("after DEL: ports held %v, %d attachments in the data path", ok, len(dp.marks))
	}

	other := conf("h1", `{"hostPort":8081,"containerPort":80,"protocol":"tcp"}`, etcdStore("/other/", sock, queue))
	if err := funcs.Add(args("c2", other)); code(err) != types.ErrTryAgainLater || !strings.Contains(err.Error(), "this host's agent serves") {
		t.Fatalf("ADD of another cluster: %v, want 11 naming the agent's store", err)
	}

	none := conf("h1", `{"hostPort":8082,"containerPort":80,"protocol":"tcp"}`, etcdStore("", filepath.Join(dir, "none.sock"), queue))
	if err := funcs.Add(args("c3", none)); code(err) != types.ErrTryAgainLater || !strings.Contains(err.Error(), "none.sock") {
		t.Fatalf("ADD with no agent: %v, want 11 naming the socket", err)
	}
	if err := funcs.Del(args("c3", none)); err != nil {
		t.Fatalf("DEL with no agent: %v, want it queued", err)
	}
	if n, err := (agentapi.DelQueue{Dir: queue}).Len(); err != nil || n != 1 {
		t.Fatalf("queued %d (%v), want 1", n, err)
	}
}
