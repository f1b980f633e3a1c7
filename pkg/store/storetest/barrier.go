package storetest

import (
	"context"
	"fmt"
	"strings"
	"sync"

	"github.com/ringipam/ringipam/pkg/store"
)

// Barrier is a store whose first n matching commits wait for one another:
// none is passed on to the store until all n have arrived. n requests that
// read and then commit once per attempt have thus all read the store before
// any of them writes: the race their commit conditions must settle happens
// every time, with no sleep. Later matching commits (retries) and commits
// that do not match pass at once. A waiting commit gives up when its
// context ends. With InOrder the held commits go on in a chosen order
// rather than together.
type Barrier struct {
	store.Store
	n       int
	match   func(ops []store.Op) bool
	rank    func(ops []store.Op) int
	mu      sync.Mutex
	arrived int
	held    []heldCommit
	all     chan struct{}
}

// heldCommit is a commit held at the barrier: its rank, and done, closed
// when it has returned.
type heldCommit struct {
	rank int
	done chan struct{}
}

// NewBarrier wraps st; match selects the commits that count (nil: every
// commit).
func NewBarrier(st store.Store, n int, match func(ops []store.Op) bool) *Barrier {
	return &Barrier{Store: st, n: n, match: match, all: make(chan struct{})}
}

// Writing matches the commits that write or delete a key starting with
// prefix.
func Writing(prefix string) func(ops []store.Op) bool {
	return func(ops []store.Op) bool {
		for _, o := range ops {
			if strings.HasPrefix(o.Key, prefix) {
				return true
			}
		}
		return false
	}
}

// InOrder makes the held commits go on, once all n have arrived, in the
// order of rank (lowest first): each waits until every held commit of a
// lower rank has returned; those of one rank go on together. Call it
// before the first commit. It returns b.
func (b *Barrier) InOrder(rank func(ops []store.Op) int) *Barrier {
	b.rank = rank
	return b
}

// Arrived is how many matching commits have reached the barrier so far (at
// most n).
func (b *Barrier) Arrived() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.arrived
}

// Commit waits at the barrier if it is one of the first n matching commits,
// then commits.
func (b *Barrier) Commit(ctx context.Context, conds []store.Cond, ops []store.Op) error {
	b.mu.Lock()
	wait := b.arrived < b.n && (b.match == nil || b.match(ops))
	var me heldCommit
	if wait {
		b.arrived++
		if b.rank != nil {
			me = heldCommit{rank: b.rank(ops), done: make(chan struct{})}
			b.held = append(b.held, me)
			defer close(me.done)
		}
		if b.arrived == b.n {
			close(b.all)
		}
	}
	b.mu.Unlock()
	if wait {
		select {
		case <-b.all:
		case <-ctx.Done():
			return fmt.Errorf("storetest: barrier: %d of %d commits arrived: %w", b.Arrived(), b.n, ctx.Err())
		}
		// All have arrived: b.held no longer changes.
		for _, h := range b.held {
			if h.rank >= me.rank || b.rank == nil {
				continue
			}
			select {
			case <-h.done:
			case <-ctx.Done():
				return fmt.Errorf("storetest: barrier: waiting for the commits before this one: %w", ctx.Err())
			}
		}
	}
	return b.Store.Commit(ctx, conds, ops)
}
