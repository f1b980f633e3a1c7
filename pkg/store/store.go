// Package store defines the one transactional contract that every ringipam
// state backend implements, and nothing else.
//
// The contract is deliberately small: read one or more keys at one consistent
// revision, scan an ordered key range, and commit a set of writes only if the
// keys the caller read are unchanged (optimistic concurrency). Higher layers
// (pkg/pool) build every allocation as one such commit.
//
// Revisions: every key carries the revision of the commit that last wrote it.
// A revision of 0 means "absent". Revisions only grow. A Cond with Revision 0
// therefore means "this key must not exist".
//
// Range conditions: a Cond with End set means "no key k with Key <= k < End
// exists" (byte order, as Scan). A caller that scanned a range and found it
// empty commits under it, so that a key created there meanwhile, by anyone,
// fails the commit. It is the only range form: other revisions with End are
// invalid, and so is an End that does not sort after Key (CheckCommit
// refuses both; nothing is written).
//
// Errors: Commit returns an error wrapping ErrConflict when a condition failed
// and nothing was written. Any error wrapping ErrUnavailable means the backend
// could not be reached (server down, file lock not obtained in time); callers
// must treat it as "try again later", never as "absent". Implementations are
// safe for concurrent use by several goroutines and, where the backend allows
// it, by several processes.
//
// Keys are plain strings; each backend adds its own configured prefix, so
// callers never see it.
package store

import (
	"context"
	"errors"
	"fmt"
)

// ErrConflict is returned (wrapped) by Commit when a condition did not hold.
var ErrConflict = errors.New("store: conflict: state changed since it was read")

// ErrUnavailable is returned (wrapped) when the backend cannot be reached in time.
var ErrUnavailable = errors.New("store: unavailable")

// ErrTooLarge is returned (wrapped) when a commit holds more operations than a
// backend accepts in one transaction.
var ErrTooLarge = errors.New("store: transaction too large")

// MaxOps is the largest number of conditions plus operations one Commit may
// carry. It stays far below etcd's default limit of 128.
const MaxOps = 96

// KV is one key as read. Revision 0 means the key is absent (Value is nil).
type KV struct {
	Key      string
	Value    []byte
	Revision int64
}

// Exists reports whether the key was present when read.
func (kv KV) Exists() bool { return kv.Revision != 0 }

// Cond is one condition of a commit. With End empty it requires that Key's
// revision is exactly Revision at commit time (0: the key must be absent).
// With End set it covers every key k with Key <= k < End and requires that
// none of them exists; Revision must then be 0 (see AbsentRange).
type Cond struct {
	Key      string
	Revision int64
	End      string
}

// AbsentRange returns the Cond that holds while no key k with
// from <= k < to exists (to must sort after from).
func AbsentRange(from, to string) Cond { return Cond{Key: from, End: to} }

// IsRange reports whether c is a range condition.
func (c Cond) IsRange() bool { return c.End != "" }

// Op is one write of a commit: a put of Value, or a delete.
type Op struct {
	Key    string
	Value  []byte
	Delete bool
}

// Put returns an Op that writes value at key.
func Put(key string, value []byte) Op { return Op{Key: key, Value: value} }

// Delete returns an Op that removes key (a no-op if it is absent).
func Delete(key string) Op { return Op{Key: key, Delete: true} }

// Unchanged returns the Cond that holds while kv is as it was read.
func Unchanged(kv KV) Cond { return Cond{Key: kv.Key, Revision: kv.Revision} }

// Store is the transactional key-value contract shared by all backends.
type Store interface {
	// Get reads keys at one consistent revision and returns them in the
	// order asked; absent keys come back with Revision 0.
	Get(ctx context.Context, keys ...string) ([]KV, error)
	// Scan returns the keys k with from <= k < to in byte order, at most
	// limit of them (limit <= 0: all).
	Scan(ctx context.Context, from, to string, limit int) ([]KV, error)
	// Commit applies ops atomically if every cond holds, else writes nothing
	// and returns an error wrapping ErrConflict.
	Commit(ctx context.Context, conds []Cond, ops []Op) error
	// Close releases the backend's resources.
	Close() error
}

// PrefixEnd returns the smallest key greater than every key starting with
// prefix, for use as Scan's upper bound.
func PrefixEnd(prefix string) string {
	b := []byte(prefix)
	for i := len(b) - 1; i >= 0; i-- {
		if b[i] < 0xff {
			b[i]++
			return string(b[:i+1])
		}
	}
	return "\xff\xff\xff\xff"
}

// StartGet begins a backend's Get of keys: out holds one absent KV per key,
// in the order asked, for the backend to fill in. done reports that no
// backend read is needed (no keys); the Get then answers out, or ctx's
// error (with out nil), so that a cancelled context fails every Get alike.
func StartGet(ctx context.Context, keys []string) (out []KV, done bool, err error) {
	if len(keys) == 0 {
		if err := ctx.Err(); err != nil {
			return nil, true, err
		}
		return []KV{}, true, nil
	}
	out = make([]KV, len(keys))
	for i, k := range keys {
		out[i].Key = k
	}
	return out, false, nil
}

// CheckCommit validates the shape of a commit before a backend runs it: no
// empty keys, range conditions only of the one form the contract knows
// (revision 0, End after Key), and no more than MaxOps entries.
func CheckCommit(conds []Cond, ops []Op) error {
	if len(conds)+len(ops) > MaxOps {
		return errors.Join(ErrTooLarge, errors.New("store: more than MaxOps conditions and operations"))
	}
	for _, c := range conds {
		if c.Key == "" {
			return errors.New("store: condition on an empty key")
		}
		if !c.IsRange() {
			continue
		}
		if c.Revision != 0 {
			return fmt.Errorf("store: range condition [%q, %q) on revision %d: a range condition can only require that no key in the range exists (revision 0)", c.Key, c.End, c.Revision)
		}
		if c.End <= c.Key {
			return fmt.Errorf("store: range condition [%q, %q): the end does not sort after the start", c.Key, c.End)
		}
	}
	for _, o := range ops {
		if o.Key == "" {
			return errors.New("store: write to an empty key")
		}
	}
	return nil
}

// Speculator is implemented by backends for which a round trip is dear
// (etcd). A caller that believes it knows some keys' state (from a note
// kept by an earlier call) commits on that belief in one round trip, and
// when the belief is wrong gets those keys' current state back from the
// same round trip instead of reading them in another.
//
// Beliefs are conditions: revisions (conds, as Commit's) and values
// (same). A revision is eight bytes whatever the value's size, so a
// belief about a large value is best a revision; but a revision names a
// value only within one history: a note may outlive the history its
// revisions came from (a store restored from a backup, or another cluster
// under the same pool names), while equal bytes are equal whatever the
// history. pkg/pool conditions its small host state by value as well as
// by revision, which anchors the note's revisions to the history that
// wrote that state.
type Speculator interface {
	// CommitOrGet applies ops atomically if every cond holds and every key
	// of same exists and holds exactly its Value (their Revision is not
	// looked at), and returns the commit's revision: the Revision every
	// key it wrote now carries. Otherwise it writes nothing and returns
	// the keys of read as Get would return them (one consistent revision,
	// in the order asked) with an error wrapping ErrConflict. On success
	// the KVs are nil; with read empty it is a Commit that also tells the
	// revision it wrote at.
	CommitOrGet(ctx context.Context, conds []Cond, same []KV, ops []Op, read []string) (int64, []KV, error)
}

// CheckSpeculation validates the shape of a CommitOrGet: that of a commit
// whose conditions include same, and no more than MaxOps keys to read.
func CheckSpeculation(conds []Cond, same []KV, ops []Op, read []string) error {
	if len(conds)+len(same)+len(ops) > MaxOps || len(read) > MaxOps {
		return errors.Join(ErrTooLarge, errors.New("store: more than MaxOps conditions and operations, or keys to read"))
	}
	for _, kv := range same {
		if kv.Key == "" {
			return errors.New("store: condition on an empty key")
		}
	}
	for _, k := range read {
		if k == "" {
			return errors.New("store: read of an empty key")
		}
	}
	return CheckCommit(conds, ops)
}
