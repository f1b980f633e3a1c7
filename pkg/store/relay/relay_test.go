package relay_test

import (
	"context"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/memory"
	"github.com/ringipam/ringipam/pkg/store/relay"
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
