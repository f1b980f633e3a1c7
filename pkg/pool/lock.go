package pool

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
)

// keyedMutex serialises in-process work per key with a context deadline, so
// goroutines of one process allocating in one pool queue up instead of
// conflicting in the store. The zero value is ready to use.
type keyedMutex struct {
	mu    sync.Mutex
	slots map[string]chan struct{}
}

func (k *keyedMutex) slot(key string) chan struct{} {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.slots == nil {
		k.slots = map[string]chan struct{}{}
	}
	c, ok := k.slots[key]
	if !ok {
		c = make(chan struct{}, 1)
		k.slots[key] = c
	}
	return c
}

// lock takes every key in sorted order (no deadlock between callers) and
// returns the function that releases them all.
func (k *keyedMutex) lock(ctx context.Context, keys ...string) (func(), error) {
	keys = slices.Clone(keys)
	slices.Sort(keys)
	keys = slices.Compact(keys)
	var held []chan struct{}
	unlock := func() {
		for _, c := range held {
			<-c
		}
	}
	for _, key := range keys {
		c := k.slot(key)
		select {
		case c <- struct{}{}:
			held = append(held, c)
		case <-ctx.Done():
			unlock()
			return nil, fmt.Errorf("%w: waiting for in-process lock on %s: %w", ErrTryAgain, key, ctx.Err())
		}
	}
	return unlock, nil
}

// Stats counts what an Allocator did against the store.
type Stats struct {
	conflicts   atomic.Int64
	commits     atomic.Int64
	claims      atomic.Int64
	lastResort  atomic.Int64
	unavailable atomic.Int64
	onNotes     atomic.Int64
	notesWrong  atomic.Int64
}

// StatsSnapshot is a copy of Stats.
type StatsSnapshot struct {
	Conflicts int64 // commits refused because state changed since it was read
	Commits   int64 // commits that succeeded
	Claims    int64 // ring changes this allocator planned to get space
	// LastResort counts claims that the free-space indexes could not
	// serve and that read every range key and host state of their pool
	// (a full pool, or free space the indexes do not list).
	LastResort int64
	// Unavailable counts store calls that failed as unreachable or timed
	// out and were retried within the caller's deadline.
	Unavailable int64
	// OnNotes counts allocations committed in one round trip on this
	// host's notes (WithNotes); NotesWrong those whose notes no longer held
	// (the store's answer then served as their read).
	OnNotes, NotesWrong int64
}

func (s *Stats) conflict() { s.conflicts.Add(1) }

func (s *Stats) snapshot() StatsSnapshot {
	return StatsSnapshot{Conflicts: s.conflicts.Load(), Commits: s.commits.Load(), Claims: s.claims.Load(), LastResort: s.lastResort.Load(), Unavailable: s.unavailable.Load(), OnNotes: s.onNotes.Load(), NotesWrong: s.notesWrong.Load()}
}
