package relay_test

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/ringipam/ringipam/pkg/store/memory"
	"github.com/ringipam/ringipam/pkg/store/relay"
)

// fakeInvoker serves invocations of one command, running fn for them.
type fakeInvoker struct {
	command string
	timeout time.Duration
	fn      func(ctx context.Context, inv *relay.Invocation) relay.Outcome

	mu   sync.Mutex
	seen []relay.Invocation
}

func (f *fakeInvoker) Accept(inv *relay.Invocation) (func(context.Context) relay.Outcome, time.Duration, bool) {
	if inv.Command != f.command {
		return nil, 0, false
	}
	f.mu.Lock()
	f.seen = append(f.seen, *inv)
	f.mu.Unlock()
	return func(ctx context.Context) relay.Outcome { return f.fn(ctx, inv) }, f.timeout, true
}

func (f *fakeInvoker) calls() []relay.Invocation {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]relay.Invocation(nil), f.seen...)
}

// serveInvoker serves inv (and an empty store) on a fresh socket until the
// test ends or stop is called; ops receives the OnCall reports.
func serveInvoker(t *testing.T, inv relay.Invoker) (socket string, stop func(), ops func() []string) {
	t.Helper()
	socket = filepath.Join(t.TempDir(), "store.sock")
	l, err := relay.Listen(socket)
	if err != nil {
		t.Fatal(err)
	}
	srv := relay.NewServer(memory.New(), served, t.Logf)
	srv.Invoker = inv
	var mu sync.Mutex
	var reported []string
	srv.OnCall = func(op string, err error) {
		mu.Lock()
		defer mu.Unlock()
		if err != nil {
			op += " failed"
		}
		reported = append(reported, op)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx, l) }()
	var once sync.Once
	stop = func() { once.Do(func() { stopServer(t, cancel, done) }) }
	t.Cleanup(stop)
	return socket, stop, func() []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), reported...)
	}
}

func TestInvokeServedRefusedAndAbsent(t *testing.T) {
	inv := &fakeInvoker{command: "ADD", timeout: 5 * time.Second, fn: func(_ context.Context, inv *relay.Invocation) relay.Outcome {
		if inv.ContainerID == "bad" {
			return relay.Outcome{Error: json.RawMessage(`{"code":102,"msg":"full"}`)}
		}
		return relay.Outcome{Stdout: append([]byte("result for "), inv.ContainerID...)}
	}}
	sock, _, ops := serveInvoker(t, inv)
	sent := relay.Invocation{Command: "ADD", ContainerID: "c1", Netns: "/run/netns/x", IfName: "eth0",
		Args: "K8S_POD_NAME=p", Path: "/opt/cni/bin", Hostname: "node-1", Stdin: []byte(`{"name":"n"}` + "\n\x00\xff")}

	out, served, err := relay.Invoke(sock, time.Second, &sent)
	if err != nil || !served {
		t.Fatalf("served invocation: served %v, err %v", served, err)
	}
	if string(out.Stdout) != "result for c1" || len(out.Error) != 0 {
		t.Fatalf("outcome %+v", out)
	}
	got := inv.calls()
	if len(got) != 1 {
		t.Fatalf("the invoker saw %d invocations, want 1", len(got))
	}
	if g := got[0]; g.Command != sent.Command || g.ContainerID != sent.ContainerID || g.Netns != sent.Netns || g.IfName != sent.IfName ||
		g.Args != sent.Args || g.Path != sent.Path || g.Hostname != sent.Hostname || string(g.Stdin) != string(sent.Stdin) {
		t.Fatalf("the invoker saw %+v, the plugin sent %+v", g, sent)
	}

	// A CNI error comes back as the plugin would print it.
	bad := sent
	bad.ContainerID = "bad"
	out, served, err = relay.Invoke(sock, time.Second, &bad)
	if err != nil || !served || string(out.Error) != `{"code":102,"msg":"full"}` {
		t.Fatalf("failed invocation: %+v served %v err %v", out, served, err)
	}

	// Refused: the plugin runs the call itself.
	del := sent
	del.Command = "DEL"
	if _, served, err := relay.Invoke(sock, time.Second, &del); served || err != nil {
		t.Fatalf("refused invocation: served %v, err %v", served, err)
	}
	// Nothing on the socket: the same.
	if _, served, err := relay.Invoke(filepath.Join(t.TempDir(), "none.sock"), time.Second, &sent); served || err != nil {
		t.Fatalf("no agent: served %v, err %v", served, err)
	}
	if got, want := ops(), []string{"invoke-ADD", "invoke-ADD failed"}; len(got) != 2 || got[0] != want[0] || got[1] != want[1] {
		t.Fatalf("OnCall saw %q, want %q", got, want)
	}
}

// A plugin that goes away (the runtime killed it) cancels its call.
func TestInvocationCancelledWhenThePluginGoes(t *testing.T) {
	started := make(chan struct{})
	ended := make(chan error, 1)
	inv := &fakeInvoker{command: "ADD", timeout: time.Minute, fn: func(ctx context.Context, _ *relay.Invocation) relay.Outcome {
		close(started)
		select {
		case <-ctx.Done():
			ended <- ctx.Err()
		case <-time.After(30 * time.Second):
			ended <- errors.New("not cancelled within 30s")
		}
		return relay.Outcome{}
	}}
	sock, _, _ := serveInvoker(t, inv)
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	req, _ := json.Marshal(map[string]any{"op": "invoke", "timeoutMs": 60000, "invocation": relay.Invocation{Command: "ADD", ContainerID: "c"}})
	if _, err := c.Write(append(req, '\n')); err != nil {
		t.Fatal(err)
	}
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("the invocation did not start")
	}
	c.Close()
	if err := <-ended; !errors.Is(err, context.Canceled) {
		t.Fatalf("the call's context after the plugin went: %v, want canceled", err)
	}
}

// An agent that does not answer in time fails the call (its outcome is
// unknown); an agent that stops mid-call loses it the same way, without
// waiting for the deadline.
func TestInvokeNoOutcome(t *testing.T) {
	release := make(chan struct{})
	t.Cleanup(func() { close(release) })
	inv := &fakeInvoker{command: "ADD", timeout: time.Minute, fn: func(ctx context.Context, _ *relay.Invocation) relay.Outcome {
		select {
		case <-release:
		case <-ctx.Done():
		}
		return relay.Outcome{}
	}}
	sock, stop, _ := serveInvoker(t, inv)

	start := time.Now()
	_, served, err := relay.Invoke(sock, 100*time.Millisecond, &relay.Invocation{Command: "ADD"})
	if !served || !errors.Is(err, relay.ErrNoOutcome) || !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("an agent past the deadline: served %v, err %v", served, err)
	}
	if took := time.Since(start); took > 20*time.Second {
		t.Fatalf("the wait took %s", took)
	}

	go func() {
		time.Sleep(200 * time.Millisecond)
		stop()
	}()
	_, served, err = relay.Invoke(sock, time.Minute, &relay.Invocation{Command: "ADD"})
	if !served || !errors.Is(err, relay.ErrNoOutcome) || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("an agent that stopped mid-call: served %v, err %v", served, err)
	}
}
