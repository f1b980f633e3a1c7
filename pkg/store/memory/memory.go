// Package memory is an in-process store.Store kept in a map. It honours the
// whole store contract (revisions, atomic conditional commits, range
// conditions, ordered scans) and is meant for unit tests and model checks;
// it persists nothing. It is safe for concurrent use. The zero value is not
// usable: call New.
package memory

import (
	"bytes"
	"context"
	"fmt"
	"sort"
	"sync"

	"github.com/ringipam/ringipam/pkg/store"
)

type entry struct {
	value []byte
	rev   int64
}

// Store is an in-memory store.Store.
type Store struct {
	mu      sync.RWMutex
	data    map[string]entry
	keys    []string // sorted keys of data
	rev     int64
	commits int64
}

// New returns an empty store.
func New() *Store { return &Store{data: map[string]entry{}} }

// Get implements store.Store.
func (s *Store) Get(ctx context.Context, keys ...string) ([]store.KV, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.getLocked(keys), nil
}

// Scan implements store.Store.
func (s *Store) Scan(ctx context.Context, from, to string, limit int) ([]store.KV, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	s.mu.RLock()
	defer s.mu.RUnlock()
	lo := sort.SearchStrings(s.keys, from)
	hi := sort.SearchStrings(s.keys, to)
	if hi < lo {
		hi = lo
	}
	keys := s.keys[lo:hi]
	if limit > 0 && len(keys) > limit {
		keys = keys[:limit]
	}
	out := make([]store.KV, len(keys))
	for i, k := range keys {
		e := s.data[k]
		out[i] = store.KV{Key: k, Value: clone(e.value), Revision: e.rev}
	}
	return out, nil
}

// Commit implements store.Store.
func (s *Store) Commit(ctx context.Context, conds []store.Cond, ops []store.Op) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := store.CheckCommit(conds, ops); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.checkLocked(conds); err != nil {
		return err
	}
	s.applyLocked(ops)
	return nil
}

// checkLocked verifies conds: a key's revision, or that no key of a range
// exists.
func (s *Store) checkLocked(conds []store.Cond) error {
	for _, c := range conds {
		if c.IsRange() {
			if i := sort.SearchStrings(s.keys, c.Key); i < len(s.keys) && s.keys[i] < c.End {
				return fmt.Errorf("%w: key %q exists in [%q, %q)", store.ErrConflict, s.keys[i], c.Key, c.End)
			}
			continue
		}
		if s.data[c.Key].rev != c.Revision {
			return fmt.Errorf("%w: key %q", store.ErrConflict, c.Key)
		}
	}
	return nil
}

func (s *Store) applyLocked(ops []store.Op) {
	s.rev++
	s.commits++
	for _, o := range ops {
		i := sort.SearchStrings(s.keys, o.Key)
		present := i < len(s.keys) && s.keys[i] == o.Key
		if o.Delete {
			if present {
				delete(s.data, o.Key)
				s.keys = append(s.keys[:i], s.keys[i+1:]...)
			}
			continue
		}
		if !present {
			s.keys = append(s.keys, "")
			copy(s.keys[i+1:], s.keys[i:])
			s.keys[i] = o.Key
		}
		s.data[o.Key] = entry{value: clone(o.Value), rev: s.rev}
	}
}

// CommitOrGet implements store.Speculator.
func (s *Store) CommitOrGet(ctx context.Context, conds []store.Cond, same []store.KV, ops []store.Op, read []string) (int64, []store.KV, error) {
	if err := ctx.Err(); err != nil {
		return 0, nil, err
	}
	if err := store.CheckSpeculation(conds, same, ops, read); err != nil {
		return 0, nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, kv := range same {
		if e, ok := s.data[kv.Key]; !ok || !bytes.Equal(e.value, kv.Value) {
			return 0, s.getLocked(read), fmt.Errorf("%w: key %q", store.ErrConflict, kv.Key)
		}
	}
	if err := s.checkLocked(conds); err != nil {
		return 0, s.getLocked(read), err
	}
	s.applyLocked(ops)
	return s.rev, nil, nil
}

func (s *Store) getLocked(keys []string) []store.KV {
	out := make([]store.KV, len(keys))
	for i, k := range keys {
		e := s.data[k]
		out[i] = store.KV{Key: k, Value: clone(e.value), Revision: e.rev}
	}
	return out
}

// Close implements store.Store.
func (s *Store) Close() error { return nil }

func clone(b []byte) []byte {
	if b == nil {
		return nil
	}
	return append([]byte(nil), b...)
}

// Snapshot reads every key of src in one Scan, which every backend answers
// at one revision (etcd pins the first page's revision for the rest; the
// local store reads in one transaction), and returns them as a new Store
// keeping their revisions. Readers that look at many prefixes of a live
// store (ringctl check) read the snapshot instead, so that a commit made
// between two of their reads cannot look like a broken invariant. Commits
// to the snapshot change only the snapshot.
func Snapshot(ctx context.Context, src store.Store) (*Store, error) {
	kvs, err := src.Scan(ctx, "", store.PrefixEnd(""), 0)
	if err != nil {
		return nil, fmt.Errorf("snapshot: %w", err)
	}
	s := New()
	s.keys = make([]string, 0, len(kvs))
	for _, kv := range kvs {
		if !kv.Exists() {
			continue
		}
		if _, dup := s.data[kv.Key]; !dup {
			s.keys = append(s.keys, kv.Key)
		}
		s.data[kv.Key] = entry{value: clone(kv.Value), rev: kv.Revision}
		s.rev = max(s.rev, kv.Revision)
	}
	sort.Strings(s.keys)
	return s, nil
}
