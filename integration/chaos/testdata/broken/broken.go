// Package broken is the store of the chaos suite's broken plugins: every
// commit drops its revision conditions, so a decision made on state that
// changed meanwhile is written anyway (the "commit without the revision
// condition" allocator of issue 14).
//
// With BarrierEnv set to a unix socket, the first commit of the process
// that writes a key starting with the plugin's gated prefix first waits
// there until the suite lets it go: the suite holds the commits of two
// plugin processes until both have read the store, so that a race the
// conditions would have settled happens every time, not by chance.
//
// It lives under testdata so that `go build ./...`, `make build` and every
// production binary never contain it: only the chaos suite builds the
// broken plugins, by their explicit paths.
package broken

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"

	"github.com/ringipam/ringipam/pkg/store"
)

// BarrierEnv names the unix socket of the suite's barrier.
const BarrierEnv = "RINGIPAM_CHAOS_BARRIER"

// Store is a store whose Commit ignores its conditions.
type Store struct {
	store.Store
	gate   string // commits writing a key with this prefix wait at the barrier
	waited sync.Once
}

// New wraps st; gate is the key prefix of the commits the barrier holds.
func New(st store.Store, gate string) *Store { return &Store{Store: st, gate: gate} }

// Commit commits ops without conds, after the barrier for a gated commit.
func (s *Store) Commit(ctx context.Context, _ []store.Cond, ops []store.Op) error {
	if sock := os.Getenv(BarrierEnv); sock != "" && s.gated(ops) {
		var err error
		s.waited.Do(func() { err = wait(ctx, sock) })
		if err != nil {
			return err
		}
	}
	return s.Store.Commit(ctx, nil, ops)
}

func (s *Store) gated(ops []store.Op) bool {
	for _, o := range ops {
		if strings.HasPrefix(o.Key, s.gate) {
			return true
		}
	}
	return false
}

// wait arrives at the barrier on sock (by connecting: it writes nothing,
// the suite may answer and close before a write would land) and waits for
// "go" (bounded by ctx).
func wait(ctx context.Context, sock string) error {
	c, err := (&net.Dialer{}).DialContext(ctx, "unix", sock)
	if err != nil {
		return fmt.Errorf("chaos barrier: %w", err)
	}
	defer c.Close()
	if dl, ok := ctx.Deadline(); ok {
		_ = c.SetDeadline(dl)
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil || line != "go\n" {
		return fmt.Errorf("chaos barrier: answer %q: %v", line, err)
	}
	return nil
}
