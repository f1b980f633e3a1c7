package relay_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/memory"
	"github.com/ringipam/ringipam/pkg/store/relay"
	"github.com/ringipam/ringipam/pkg/store/storetest"
)

var served = relay.Identity{Prefix: "/ringipam/", Endpoints: []string{"http://198.18.0.1:2379", "198.18.0.2:2379"}}

// startServer serves backend on a fresh socket until the test ends.
func startServer(t *testing.T, backend store.Store) (socket string, stop func()) {
	t.Helper()
	socket = filepath.Join(t.TempDir(), "store.sock")
	l, err := relay.Listen(socket)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- relay.NewServer(backend, served, t.Logf).Serve(ctx, l) }()
	var once sync.Once
	stop = func() { once.Do(func() { stopServer(t, cancel, done) }) }
	t.Cleanup(stop)
	return socket, stop
}

func stopServer(t *testing.T, cancel func(), done chan error) {
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Serve: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Error("Serve did not return after its context ended")
	}
}

// noDirect fails the test if the client ever goes direct.
func noDirect(t *testing.T) func() (store.Store, error) {
	return func() (store.Store, error) {
		t.Error("the client went direct although the agent serves its cluster")
		return nil, errors.New("no direct store in this test")
	}
}

// The one store contract, through the relay (the memory store behind it).
func TestContract(t *testing.T) {
	storetest.Run(t, func(t *testing.T) store.Store {
		socket, _ := startServer(t, memory.New())
		c := relay.NewClient(socket, relay.Identity{Prefix: "/ringipam/", Endpoints: []string{"198.18.0.2:2379"}}, noDirect(t))
		t.Cleanup(func() { c.Close() })
		return c
	}, storetest.Persistent(func(t *testing.T) func(t *testing.T) store.Store {
		backend := memory.New()
		return func(t *testing.T) store.Store {
			socket, _ := startServer(t, backend)
			c := relay.NewClient(socket, served, noDirect(t))
			t.Cleanup(func() { c.Close() })
			return c
		}
	}))
}

// The same contract when no agent answers: the client's direct store
// (where a speculating commit is the direct store's own).
func TestContractWithoutAgent(t *testing.T) {
	storetest.Run(t, func(t *testing.T) store.Store {
		direct := memory.New()
		c := relay.NewClient(filepath.Join(t.TempDir(), "none.sock"), served, func() (store.Store, error) { return direct, nil })
		t.Cleanup(func() { c.Close() })
		return c
	})
}

type countingStore struct {
	store.Store
	calls atomic.Int64
}

func (c *countingStore) Get(ctx context.Context, keys ...string) ([]store.KV, error) {
	c.calls.Add(1)
	return c.Store.Get(ctx, keys...)
}

// Without an agent, or with an agent of another cluster, the client uses
// its direct store; it says why.
func TestFallsBackToTheDirectStore(t *testing.T) {
	ctx := context.Background()
	for name, tc := range map[string]struct {
		id      relay.Identity
		noAgent bool
		why     string
	}{
		"no agent":        {id: served, noAgent: true, why: "no ringipamd"},
		"other prefix":    {id: relay.Identity{Prefix: "/other/", Endpoints: served.Endpoints}, why: "serves prefix"},
		"other endpoints": {id: relay.Identity{Prefix: served.Prefix, Endpoints: []string{"198.18.9.9:2379"}}, why: "serves prefix"},
	} {
		t.Run(name, func(t *testing.T) {
			agentSide := &countingStore{Store: memory.New()}
			socket, _ := startServer(t, agentSide)
			if tc.noAgent {
				socket = filepath.Join(t.TempDir(), "nobody.sock")
			}
			direct := &countingStore{Store: memory.New()}
			c := relay.NewClient(socket, tc.id, func() (store.Store, error) { return direct, nil })
			defer c.Close()
			if err := c.Commit(ctx, nil, []store.Op{store.Put("k", []byte("v"))}); err != nil {
				t.Fatal(err)
			}
			kvs, err := c.Get(ctx, "k")
			if err != nil || string(kvs[0].Value) != "v" {
				t.Fatalf("get: %v %v", kvs, err)
			}
			if direct.calls.Load() != 1 || agentSide.calls.Load() != 0 {
				t.Fatalf("direct calls %d, agent calls %d", direct.calls.Load(), agentSide.calls.Load())
			}
			if !strings.Contains(c.Via(), tc.why) {
				t.Fatalf("Via %q does not say %q", c.Via(), tc.why)
			}
		})
	}
}

// Through the agent the direct store is never opened; sentinels survive
// the trip; a read whose agent went away is answered directly, a commit
// whose agent went away is unavailable.
func TestAgentCallsAndLostAgent(t *testing.T) {
	ctx := context.Background()
	backend := memory.New()
	socket, stop := startServer(t, backend)
	var opened atomic.Int64
	direct := memory.New()
	c := relay.NewClient(socket, served, func() (store.Store, error) { opened.Add(1); return direct, nil })
	defer c.Close()
	if err := c.Commit(ctx, []store.Cond{{Key: "k", Revision: 0}}, []store.Op{store.Put("k", []byte("v"))}); err != nil {
		t.Fatal(err)
	}
	err := c.Commit(ctx, []store.Cond{{Key: "k", Revision: 0}}, []store.Op{store.Put("k", []byte("w"))})
	if !errors.Is(err, store.ErrConflict) {
		t.Fatalf("a failed condition through the agent: %v", err)
	}
	dctx, cancel := context.WithDeadline(ctx, time.Now().Add(-time.Second))
	defer cancel()
	if _, err := c.Get(dctx, "k"); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a passed deadline: %v", err)
	}
	if !strings.HasPrefix(c.Via(), "ringipamd at ") && c.Via() != "" {
		t.Fatalf("Via %q", c.Via())
	}
	if kvs, err := c.Get(ctx, "k"); err != nil || string(kvs[0].Value) != "v" {
		t.Fatalf("get through the agent: %v %v", kvs, err)
	}
	if opened.Load() != 0 {
		t.Fatal("the direct store was opened although the agent answers")
	}
	stop() // the agent goes away with the client connected
	if _, err := c.Get(ctx, "k"); err != nil {
		t.Fatalf("a read after the agent went away: %v", err)
	}
	if opened.Load() != 1 {
		t.Fatalf("the direct store was opened %d times", opened.Load())
	}

	// A commit in flight when the agent goes away: unavailable.
	backend2 := &blockingStore{Store: memory.New(), entered: make(chan struct{})}
	socket2, stop2 := startServer(t, backend2)
	c2 := relay.NewClient(socket2, served, noDirect(t))
	defer c2.Close()
	go func() { <-backend2.entered; stop2() }()
	err = c2.Commit(ctx, nil, []store.Op{store.Put("k", []byte("v"))})
	if !errors.Is(err, store.ErrUnavailable) || !strings.Contains(err.Error(), "may or may not") {
		t.Fatalf("a commit whose agent went away: %v", err)
	}
}

// blockingStore's Commit waits for its context.
type blockingStore struct {
	store.Store
	entered chan struct{}
}

func (b *blockingStore) Commit(ctx context.Context, _ []store.Cond, _ []store.Op) error {
	close(b.entered)
	<-ctx.Done()
	return ctx.Err()
}

// A socket another server still serves is not taken over; a stale one is.
func TestListen(t *testing.T) {
	socket, _ := startServer(t, memory.New())
	if _, err := relay.Listen(socket); err == nil || !strings.Contains(err.Error(), "another process") {
		t.Fatalf("second Listen on a served socket: %v", err)
	}
	stale := filepath.Join(t.TempDir(), "stale.sock")
	l, err := relay.Listen(stale)
	if err != nil {
		t.Fatal(err)
	}
	// Leave the file behind as a killed agent would.
	if ul, ok := l.(interface{ SetUnlinkOnClose(bool) }); ok {
		ul.SetUnlinkOnClose(false)
	}
	l.Close()
	l, err = relay.Listen(stale)
	if err != nil {
		t.Fatalf("Listen over a stale socket: %v", err)
	}
	l.Close()
}

func TestIdentityMatches(t *testing.T) {
	for _, tc := range []struct {
		c    relay.Identity
		want bool
	}{
		{relay.Identity{Prefix: "/ringipam/", Endpoints: []string{"198.18.0.1:2379/"}}, true},
		{relay.Identity{Prefix: "/ringipam/", Endpoints: []string{"https://198.18.0.2:2379"}}, true},
		{relay.Identity{Prefix: "/ringipam/", Endpoints: []string{"198.18.0.3:2379"}}, false},
		{relay.Identity{Prefix: "/other/", Endpoints: []string{"198.18.0.1:2379"}}, false},
		{relay.Identity{Prefix: "/ringipam/"}, false},
	} {
		if got := served.Matches(tc.c); got != tc.want {
			t.Errorf("%+v: %v, want %v", tc.c, got, tc.want)
		}
	}
}

// A direct store that cannot be opened now (a TLS etcd in a plugin) is
// unavailable, names the missing agent, and the next call finds an agent
// that started meanwhile.
func TestAgentAwaitedWhenNoDirectWay(t *testing.T) {
	ctx := context.Background()
	socket := filepath.Join(t.TempDir(), "store.sock")
	c := relay.NewClient(socket, served, func() (store.Store, error) {
		return nil, fmt.Errorf("%w: no TLS here", store.ErrUnavailable)
	})
	defer c.Close()
	_, err := c.Get(ctx, "k")
	if !errors.Is(err, store.ErrUnavailable) || !strings.Contains(err.Error(), "no ringipamd at "+socket) {
		t.Fatalf("without an agent: %v", err)
	}
	backend := memory.New()
	if err := backend.Commit(ctx, nil, []store.Op{store.Put("k", []byte("v"))}); err != nil {
		t.Fatal(err)
	}
	l, err := relay.Listen(socket)
	if err != nil {
		t.Fatal(err)
	}
	sctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- relay.NewServer(backend, served, t.Logf).Serve(sctx, l) }()
	defer func() { cancel(); <-done }()
	kvs, err := c.Get(ctx, "k")
	if err != nil || string(kvs[0].Value) != "v" {
		t.Fatalf("once the agent runs: %v %v", kvs, err)
	}
}

func TestIdentityKey(t *testing.T) {
	a := relay.Identity{Prefix: "/r/", Endpoints: []string{"http://a:2379", "b:2379/"}}
	b := relay.Identity{Prefix: "/r/", Endpoints: []string{"https://b:2379", "a:2379"}}
	if a.Key() != b.Key() || !a.Matches(b) {
		t.Errorf("the same endpoints in another order and spelling: keys %q and %q", a.Key(), b.Key())
	}
	for _, c := range []relay.Identity{
		{Prefix: "/s/", Endpoints: a.Endpoints},
		{Prefix: "/r/", Endpoints: []string{"a:2379"}},
		{Prefix: "/r/", Endpoints: []string{"a:2379", "b:2380"}},
	} {
		if c.Key() == a.Key() {
			t.Errorf("%+v has the key of %+v", c, a)
		}
	}
}

// An agent from before range conditions answers its hello with no
// features and would decode a range condition as a condition on its first
// key alone. The client sends it no commit with a range condition (a
// refusal that names the cause, nothing written); other commits go on.
func TestRangeConditionNotSentToAnOldAgent(t *testing.T) {
	socket := filepath.Join(t.TempDir(), "store.sock")
	l, err := net.Listen("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	lines := make(chan string, 16)
	go func() {
		c, err := l.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		r := bufio.NewReader(c)
		for {
			line, err := r.ReadString('\n')
			if err != nil {
				return
			}
			lines <- line
			if _, err := c.Write([]byte("{}\n")); err != nil {
				return
			}
		}
	}()
	c := relay.NewClient(socket, served, noDirect(t))
	t.Cleanup(func() { c.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := c.Commit(ctx, []store.Cond{{Key: "k"}}, []store.Op{store.Put("k", []byte("v"))}); err != nil {
		t.Fatalf("a commit on one key through the old agent: %v", err)
	}
	err = c.Commit(ctx, []store.Cond{store.AbsentRange("a/", "a0")}, []store.Op{store.Put("a/1", []byte("v"))})
	if err == nil || !strings.Contains(err.Error(), "older than this plugin") || errors.Is(err, store.ErrConflict) {
		t.Fatalf("a commit with a range condition through an old agent: %v, want a refusal naming the old agent", err)
	}
	if via := c.Via(); !strings.HasPrefix(via, "ringipamd at ") {
		t.Errorf("after the refusal the calls go %q, want still to the agent", via)
	}
	close(lines) // the agent's goroutine writes no more: nothing is in flight
	var got []string
	for line := range lines {
		got = append(got, line)
	}
	if len(got) != 2 || !strings.Contains(got[0], `"op":"hello"`) || !strings.Contains(got[1], `"op":"commit"`) || strings.Contains(got[1], `"e":`) {
		t.Fatalf("the old agent received %q, want the hello and the one-key commit only", got)
	}
}
