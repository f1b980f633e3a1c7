// Package storetest is the one conformance suite every store.Store backend
// must pass, plus a small commit benchmark, plus Barrier: a store wrapper
// for the race tests of the store's users (several requests read before
// any of them commits).
//
// Run executes table-driven subtests against fresh stores obtained from the
// caller's open function (each subtest gets its own, empty store). Backends
// that persist, or that several handles (processes) may share, pass the
// Persistent option so that Run also checks reopening and cross-handle
// consistency. The suite uses only the store contract; it never sleeps to
// wait for something and bounds every loop.
package storetest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	"github.com/ringipam/ringipam/pkg/retry"
	"github.com/ringipam/ringipam/pkg/store"
)

// Option adjusts Run.
type Option func(*options)

type options struct {
	location func(t *testing.T) func(t *testing.T) store.Store
	workers  int
	perWork  int
}

// Persistent enables the persistence and multi-handle subtests. location is
// called once per subtest to create a fresh durable location (a temp file, a
// fresh key prefix) and returns a function that opens a new, independent
// handle on that location each time it is called. Handles are closed by the
// suite.
func Persistent(location func(t *testing.T) func(t *testing.T) store.Store) Option {
	return func(o *options) { o.location = location }
}

// Concurrency sets the goroutines and increments per goroutine of the
// concurrent compare-and-swap subtests (default 8 x 25).
func Concurrency(workers, each int) Option {
	return func(o *options) { o.workers, o.perWork = workers, each }
}

// testTimeout bounds every subtest's store calls.
const testTimeout = 2 * time.Minute

func ctxFor(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	t.Cleanup(cancel)
	return ctx
}

// Run runs the conformance suite. open must return a new, empty store each
// time it is called; Run closes it.
func Run(t *testing.T, open func(t *testing.T) store.Store, opts ...Option) {
	o := options{workers: 8, perWork: 25}
	for _, f := range opts {
		f(&o)
	}
	fresh := func(t *testing.T) store.Store {
		s := open(t)
		t.Cleanup(func() {
			if err := s.Close(); err != nil {
				t.Errorf("Close: %v", err)
			}
		})
		return s
	}
	tests := []struct {
		name string
		fn   func(t *testing.T, s store.Store)
	}{
		{"AbsentKeysHaveRevisionZero", testAbsent},
		{"PutThenGet", testPutGet},
		{"ValuesAreCopied", testCopies},
		{"RevisionsGrow", testRevisions},
		{"CreateIfAbsent", testCreateIfAbsent},
		{"StaleConditionWritesNothing", testStaleAtomic},
		{"RangeAbsent", testRangeAbsent},
		{"Delete", testDelete},
		{"EmptyCommit", testEmptyCommit},
		{"MultiGetIsConsistent", testMultiGetConsistent},
		{"ScanOrderBoundsLimit", testScan},
		{"ScanBinaryKeysAndPrefixEnd", testScanBinary},
		{"ScanAcrossPages", testScanAcrossPages},
		{"CommitLimits", testLimits},
		{"CanceledContext", testCanceled},
		{"LargeValue", testLargeValue},
		{"ConcurrentCASIncrements", func(t *testing.T, s store.Store) {
			counterRace(t, []store.Store{s}, o.workers, o.perWork)
		}},
	}
	// A backend that can speculate (store.Speculator) keeps that promise too.
	if _, ok := fresh(t).(store.Speculator); ok {
		tests = append(tests, struct {
			name string
			fn   func(t *testing.T, s store.Store)
		}{"CommitOrGet", testCommitOrGet})
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) { tc.fn(t, fresh(t)) })
	}
	if o.location == nil {
		return
	}
	handle := func(t *testing.T, openAt func(t *testing.T) store.Store) store.Store {
		s := openAt(t)
		t.Cleanup(func() { s.Close() })
		return s
	}
	t.Run("ReopenKeepsData", func(t *testing.T) {
		openAt := o.location(t)
		testReopen(t, openAt)
	})
	t.Run("HandlesSeeEachOther", func(t *testing.T) {
		openAt := o.location(t)
		testHandles(t, handle(t, openAt), handle(t, openAt))
	})
	t.Run("ConcurrentCASAcrossHandles", func(t *testing.T) {
		openAt := o.location(t)
		var ss []store.Store
		for range 4 {
			ss = append(ss, handle(t, openAt))
		}
		counterRace(t, ss, o.workers, o.perWork)
	})
}

func mustCommit(t *testing.T, s store.Store, conds []store.Cond, ops ...store.Op) {
	t.Helper()
	if err := s.Commit(ctxFor(t), conds, ops); err != nil {
		t.Fatalf("Commit(%v, %v): %v", conds, ops, err)
	}
}

func mustGet(t *testing.T, s store.Store, keys ...string) []store.KV {
	t.Helper()
	kvs, err := s.Get(ctxFor(t), keys...)
	if err != nil {
		t.Fatalf("Get(%q): %v", keys, err)
	}
	if len(kvs) != len(keys) {
		t.Fatalf("Get(%q) returned %d entries", keys, len(kvs))
	}
	for i, kv := range kvs {
		if kv.Key != keys[i] {
			t.Fatalf("Get(%q)[%d].Key = %q, want %q", keys, i, kv.Key, keys[i])
		}
	}
	return kvs
}

func mustScan(t *testing.T, s store.Store, from, to string, limit int) []store.KV {
	t.Helper()
	kvs, err := s.Scan(ctxFor(t), from, to, limit)
	if err != nil {
		t.Fatalf("Scan(%q, %q, %d): %v", from, to, limit, err)
	}
	return kvs
}

// view is a KV without its revision, compared with go-cmp.
type view struct {
	Key   string
	Value string
}

func views(kvs []store.KV) []view {
	out := make([]view, 0, len(kvs))
	for _, kv := range kvs {
		out = append(out, view{kv.Key, string(kv.Value)})
	}
	return out
}

func keysOf(kvs []store.KV) []string {
	out := make([]string, 0, len(kvs))
	for _, kv := range kvs {
		out = append(out, kv.Key)
	}
	return out
}

func testAbsent(t *testing.T, s store.Store) {
	kvs := mustGet(t, s, "a", "b/c", "a")
	for _, kv := range kvs {
		if kv.Revision != 0 || kv.Value != nil || kv.Exists() {
			t.Errorf("absent key %q read as %+v", kv.Key, kv)
		}
	}
	if kvs := mustGet(t, s); len(kvs) != 0 {
		t.Errorf("Get() with no keys = %v, want empty", kvs)
	}
	if kvs := mustScan(t, s, "", "\xff", 0); len(kvs) != 0 {
		t.Errorf("Scan of empty store = %v", kvs)
	}
}

func testPutGet(t *testing.T, s store.Store) {
	mustCommit(t, s, nil, store.Put("a", []byte("1")), store.Put("b", []byte{}), store.Put("c", nil))
	kvs := mustGet(t, s, "c", "missing", "a", "b")
	if diff := cmp.Diff([]view{{"c", ""}, {"missing", ""}, {"a", "1"}, {"b", ""}}, views(kvs)); diff != "" {
		t.Errorf("Get after Put (-want +got):\n%s", diff)
	}
	for _, i := range []int{0, 2, 3} {
		if !kvs[i].Exists() || kvs[i].Revision <= 0 {
			t.Errorf("written key %q reads as absent: %+v", kvs[i].Key, kvs[i])
		}
	}
	if kvs[1].Exists() {
		t.Errorf("missing key exists: %+v", kvs[1])
	}
	// Overwrite.
	mustCommit(t, s, []store.Cond{store.Unchanged(kvs[2])}, store.Put("a", []byte("2")))
	if got := mustGet(t, s, "a")[0]; string(got.Value) != "2" || got.Revision <= kvs[2].Revision {
		t.Errorf("after overwrite a = %+v (was revision %d)", got, kvs[2].Revision)
	}
}

func testCopies(t *testing.T, s store.Store) {
	in := []byte("original")
	mustCommit(t, s, nil, store.Put("k", in))
	copy(in, "CHANGED!")
	got := mustGet(t, s, "k")[0]
	if string(got.Value) != "original" {
		t.Fatalf("store kept the caller's slice: %q", got.Value)
	}
	copy(got.Value, "MUTATED!")
	if again := mustGet(t, s, "k")[0]; string(again.Value) != "original" {
		t.Fatalf("Get returned the store's own slice: %q", again.Value)
	}
	sc := mustScan(t, s, "", "\xff", 0)
	copy(sc[0].Value, "MUTATED!")
	if again := mustGet(t, s, "k")[0]; string(again.Value) != "original" {
		t.Fatalf("Scan returned the store's own slice: %q", again.Value)
	}
}

func testRevisions(t *testing.T, s store.Store) {
	mustCommit(t, s, nil, store.Put("a", []byte("1")), store.Put("b", []byte("1")))
	first := mustGet(t, s, "a", "b")
	if first[0].Revision != first[1].Revision {
		t.Errorf("keys of one commit have revisions %d and %d", first[0].Revision, first[1].Revision)
	}
	prev := first[0].Revision
	for i := range 5 {
		mustCommit(t, s, nil, store.Put("a", []byte(strconv.Itoa(i))))
		got := mustGet(t, s, "a", "b")
		if got[0].Revision <= prev {
			t.Fatalf("commit %d: revision %d did not grow past %d", i, got[0].Revision, prev)
		}
		if got[1].Revision != first[1].Revision {
			t.Fatalf("untouched key b moved from revision %d to %d", first[1].Revision, got[1].Revision)
		}
		prev = got[0].Revision
	}
	// A commit to another key still moves the store past every earlier revision.
	mustCommit(t, s, nil, store.Put("c", []byte("x")))
	if c := mustGet(t, s, "c")[0]; c.Revision <= prev {
		t.Errorf("new key revision %d not above earlier %d", c.Revision, prev)
	}
}

func testCreateIfAbsent(t *testing.T, s store.Store) {
	ctx := ctxFor(t)
	create := []store.Cond{{Key: "lock", Revision: 0}}
	mustCommit(t, s, create, store.Put("lock", []byte("first")))
	err := s.Commit(ctx, create, []store.Op{store.Put("lock", []byte("second"))})
	if !errors.Is(err, store.ErrConflict) {
		t.Fatalf("second create-if-absent: err = %v, want ErrConflict", err)
	}
	if got := mustGet(t, s, "lock")[0]; string(got.Value) != "first" {
		t.Errorf("lock = %q after failed create, want first", got.Value)
	}
	// A condition on a revision that never existed also fails.
	err = s.Commit(ctx, []store.Cond{{Key: "nothing", Revision: 1 << 40}}, []store.Op{store.Put("nothing", []byte("x"))})
	if !errors.Is(err, store.ErrConflict) {
		t.Fatalf("condition on a made-up revision: err = %v, want ErrConflict", err)
	}
	if got := mustGet(t, s, "nothing")[0]; got.Exists() {
		t.Errorf("failed commit wrote %+v", got)
	}
}

func testStaleAtomic(t *testing.T, s store.Store) {
	ctx := ctxFor(t)
	mustCommit(t, s, nil, store.Put("a", []byte("a0")), store.Put("b", []byte("b0")), store.Put("x", []byte("x0")))
	read := mustGet(t, s, "a", "b", "x", "new")
	// Someone else moves a.
	mustCommit(t, s, []store.Cond{store.Unchanged(read[0])}, store.Put("a", []byte("a1")))
	before := mustScan(t, s, "", "\xff", 0)

	err := s.Commit(ctx,
		[]store.Cond{store.Unchanged(read[1]), store.Unchanged(read[0]), store.Unchanged(read[3])},
		[]store.Op{store.Put("b", []byte("b1")), store.Put("new", []byte("n")), store.Delete("x"), store.Put("a", []byte("a2"))})
	if !errors.Is(err, store.ErrConflict) {
		t.Fatalf("commit with one stale condition: err = %v, want ErrConflict", err)
	}
	after := mustScan(t, s, "", "\xff", 0)
	if diff := cmp.Diff(before, after); diff != "" {
		t.Errorf("failed commit changed the store (-before +after):\n%s", diff)
	}
	// The same commit with fresh reads succeeds and applies every op.
	fresh := mustGet(t, s, "a", "b", "new")
	mustCommit(t, s, []store.Cond{store.Unchanged(fresh[0]), store.Unchanged(fresh[1]), store.Unchanged(fresh[2])},
		store.Put("b", []byte("b1")), store.Put("new", []byte("n")), store.Delete("x"), store.Put("a", []byte("a2")))
	want := []view{{"a", "a2"}, {"b", "b1"}, {"new", "n"}}
	if diff := cmp.Diff(want, views(mustScan(t, s, "", "\xff", 0))); diff != "" {
		t.Errorf("after fresh commit (-want +got):\n%s", diff)
	}
}

// testRangeAbsent: a range condition holds while no key k with
// Key <= k < End exists, whatever the history of the keys around it
// (written long ago or just now, deleted), and fails, writing nothing, when
// one does: at the range's start, inside it, as its last key. A key at End
// lies outside. Range conditions of another form are refused.
func testRangeAbsent(t *testing.T, s store.Store) {
	ctx := ctxFor(t)
	// On an empty store every range is empty.
	mustCommit(t, s, []store.Cond{store.AbsentRange("r/", "r0")}, store.Put("first", []byte("1")))
	// r/2 and r/5 stay; r/3 is deleted later. Then a large value (40
	// KiB: a backend that keeps recent commits apart from its main file
	// would move them there), so that the keys written before and after
	// it, and the deletes, may live in different places.
	mustCommit(t, s, nil, store.Put("r/2", []byte("2")), store.Put("r/3", []byte("3")), store.Put("r/5", []byte("5")))
	mustCommit(t, s, nil, store.Put("big", bytes.Repeat([]byte("x"), 40<<10)))
	mustCommit(t, s, nil, store.Put("r/8", []byte("8")), store.Put("r/6x", []byte("6")), store.Delete("r/3"))
	mustCommit(t, s, nil, store.Delete("r/6x"))
	for i, c := range []struct{ from, to string }{
		{"r/0", "r/2"},         // a key at End is outside
		{"r/2\x00", "r/3\x00"}, // between two keys, r/3 deleted
		{"r/3", "r/5"},         // r/3 deleted, r/5 at End
		{"r/5\x00", "r/8"},     // r/6x written and deleted, r/8 at End
		{"r/8\x00", "r/~"},     // after the last key
	} {
		before := mustGet(t, s, "r/2", "r/5", "r/8")
		cond := store.AbsentRange(c.from, c.to)
		key := fmt.Sprintf("ok/%d", i)
		if err := s.Commit(ctx, []store.Cond{cond, store.Unchanged(before[1])}, []store.Op{store.Put(key, []byte("y"))}); err != nil {
			t.Fatalf("range [%q, %q) holds no key: Commit: %v", c.from, c.to, err)
		}
		if got := mustGet(t, s, key)[0]; string(got.Value) != "y" {
			t.Fatalf("range [%q, %q): the commit did not write: %+v", c.from, c.to, got)
		}
	}
	for _, c := range []struct{ from, to, why string }{
		{"r/2", "r/3", "r/2 is the range's first key"},
		{"r/1", "r/6", "r/2 and r/5 lie inside"},
		{"r/4", "r/5\x00", "r/5 is the range's last key"},
		{"r/7", "r/9", "r/8, written after the large value, lies inside"},
		{"r/8", "r/8\x00", "the range is r/8 alone"},
		{"r/", "r0", "the range holds every r/ key"},
	} {
		before := mustScan(t, s, "", "\xff", 0)
		err := s.Commit(ctx, []store.Cond{store.Unchanged(before[0]), store.AbsentRange(c.from, c.to)},
			[]store.Op{store.Put("no", []byte("n")), store.Delete("r/2")})
		if !errors.Is(err, store.ErrConflict) {
			t.Fatalf("range [%q, %q), where %s: err = %v, want ErrConflict", c.from, c.to, c.why, err)
		}
		if diff := cmp.Diff(before, mustScan(t, s, "", "\xff", 0)); diff != "" {
			t.Fatalf("range [%q, %q): a failed commit changed the store (-before +after):\n%s", c.from, c.to, diff)
		}
	}
	if sp, ok := s.(store.Speculator); ok {
		_, kvs, err := sp.CommitOrGet(ctx, []store.Cond{store.AbsentRange("r/4", "r/6")}, []store.KV{{Key: "first", Value: []byte("1")}},
			[]store.Op{store.Put("no", []byte("n"))}, []string{"r/5"})
		if !errors.Is(err, store.ErrConflict) || len(kvs) != 1 || string(kvs[0].Value) != "5" {
			t.Fatalf("CommitOrGet with r/5 in the range required empty = %v, %v; want ErrConflict and r/5", kvs, err)
		}
		if _, kvs, err := sp.CommitOrGet(ctx, []store.Cond{store.AbsentRange("r/6", "r/8")}, []store.KV{{Key: "first", Value: []byte("1")}},
			[]store.Op{store.Put("spec", []byte("s"))}, []string{"r/5"}); err != nil || kvs != nil {
			t.Fatalf("CommitOrGet with an empty range = %v, %v; want nil, nil", kvs, err)
		}
	}
	for _, bad := range []store.Cond{
		{Key: "r/0", End: "r/9", Revision: mustGet(t, s, "r/2")[0].Revision},
		{Key: "r/5", End: "r/5"},
		{Key: "r/6", End: "r/5"},
	} {
		err := s.Commit(ctx, []store.Cond{bad}, []store.Op{store.Put("no", []byte("n"))})
		if err == nil || errors.Is(err, store.ErrConflict) || errors.Is(err, store.ErrUnavailable) {
			t.Errorf("range condition %+v: err = %v, want a validation error", bad, err)
		}
	}
	if got := mustGet(t, s, "no")[0]; got.Exists() {
		t.Errorf("a failed or refused commit wrote %+v", got)
	}
}

// testCommitOrGet: a commit on believed values and revisions applies when
// the beliefs hold, and tells the revision its keys now carry, which a
// later speculation may require; when any belief fails it writes nothing
// and answers the keys to read as Get answers them.
func testCommitOrGet(t *testing.T, s store.Store) {
	ctx := ctxFor(t)
	sp := s.(store.Speculator)
	mustCommit(t, s, nil, store.Put("a", []byte("a0")), store.Put("b", []byte("b0")))
	read := []string{"a", "b", "c"}
	before := mustGet(t, s, "a")[0].Revision
	// Right beliefs, c absent as required: applied, nothing returned.
	rev, kvs, err := sp.CommitOrGet(ctx, []store.Cond{{Key: "c"}},
		[]store.KV{{Key: "a", Value: []byte("a0")}, {Key: "b", Value: []byte("b0"), Revision: 12345}},
		[]store.Op{store.Put("a", []byte("a1")), store.Put("c", []byte("c1"))}, read)
	if err != nil || kvs != nil {
		t.Fatalf("CommitOrGet on right beliefs = %v, %v; want nil, nil", kvs, err)
	}
	want := []view{{"a", "a1"}, {"b", "b0"}, {"c", "c1"}}
	if diff := cmp.Diff(want, views(mustScan(t, s, "", "\xff", 0))); diff != "" {
		t.Fatalf("after a speculative commit (-want +got):\n%s", diff)
	}
	got := mustGet(t, s, "a", "c")
	if rev <= before || got[0].Revision != rev || got[1].Revision != rev {
		t.Fatalf("CommitOrGet told revision %d; the keys it wrote are at %d and %d (before it: %d)", rev, got[0].Revision, got[1].Revision, before)
	}
	// The revision told is a belief a later speculation can rest on, and
	// so is that of a commit with nothing to read.
	rev, kvs, err = sp.CommitOrGet(ctx, []store.Cond{{Key: "a", Revision: rev}, {Key: "c", Revision: rev}}, nil,
		[]store.Op{store.Put("c", []byte("c2"))}, nil)
	if err != nil || kvs != nil || rev != mustGet(t, s, "c")[0].Revision {
		t.Fatalf("CommitOrGet on the revision told = %d, %v, %v; want the revision c is at now, nil, nil", rev, kvs, err)
	}
	if rev2, kvs, err := sp.CommitOrGet(ctx, []store.Cond{{Key: "c", Revision: rev}}, nil,
		[]store.Op{store.Put("c", []byte("c1"))}, read); err != nil || kvs != nil || rev2 <= rev {
		t.Fatalf("CommitOrGet on the revision a commit without reads told = %d, %v, %v; want a later revision, nil, nil", rev2, kvs, err)
	}
	fails := []struct {
		name  string
		conds []store.Cond
		same  []store.KV
	}{
		{"a stale value", nil, []store.KV{{Key: "b", Value: []byte("b0")}, {Key: "a", Value: []byte("a0")}}},
		{"a value of an absent key", nil, []store.KV{{Key: "zz", Value: []byte("")}}},
		{"a value believed of a key that exists", []store.Cond{{Key: "c"}}, []store.KV{{Key: "a", Value: []byte("a1")}}},
		{"a stale revision with right values", []store.Cond{{Key: "a", Revision: mustGet(t, s, "a")[0].Revision + 1000}}, []store.KV{{Key: "a", Value: []byte("a1")}}},
	}
	for _, f := range fails {
		before := mustScan(t, s, "", "\xff", 0)
		rev, kvs, err := sp.CommitOrGet(ctx, f.conds, f.same, []store.Op{store.Put("a", []byte("wrong")), store.Delete("b"), store.Put("d", []byte("d"))}, append(read, "zz"))
		if !errors.Is(err, store.ErrConflict) || rev != 0 {
			t.Fatalf("%s: revision %d, err = %v, want 0 and ErrConflict", f.name, rev, err)
		}
		if diff := cmp.Diff(before, mustScan(t, s, "", "\xff", 0)); diff != "" {
			t.Fatalf("%s: a failed speculation changed the store (-before +after):\n%s", f.name, diff)
		}
		if diff := cmp.Diff(mustGet(t, s, append(read, "zz")...), kvs, cmpopts.EquateEmpty()); diff != "" {
			t.Fatalf("%s: answered keys differ from Get's (-get +answered):\n%s", f.name, diff)
		}
	}
	// The limits of a commit apply, the keys to read included.
	many := make([]string, store.MaxOps+1)
	for i := range many {
		many[i] = fmt.Sprintf("r%03d", i)
	}
	if _, _, err := sp.CommitOrGet(ctx, nil, nil, []store.Op{store.Put("e", nil)}, many); !errors.Is(err, store.ErrTooLarge) {
		t.Errorf("reading %d keys: err = %v, want ErrTooLarge", len(many), err)
	}
	if _, _, err := sp.CommitOrGet(ctx, nil, []store.KV{{Key: ""}}, nil, nil); err == nil || errors.Is(err, store.ErrConflict) {
		t.Errorf("a belief about the empty key: err = %v, want a refusal", err)
	}
}

func testDelete(t *testing.T, s store.Store) {
	mustCommit(t, s, nil, store.Put("d", []byte("1")), store.Put("e", []byte("1")))
	d := mustGet(t, s, "d")[0]
	mustCommit(t, s, []store.Cond{store.Unchanged(d)}, store.Delete("d"), store.Delete("never-there"))
	if got := mustGet(t, s, "d", "never-there"); got[0].Exists() || got[1].Exists() {
		t.Fatalf("deleted keys still read: %+v", got)
	}
	if diff := cmp.Diff([]string{"e"}, keysOf(mustScan(t, s, "", "\xff", 0))); diff != "" {
		t.Errorf("Scan after delete (-want +got):\n%s", diff)
	}
	// A stale condition on the deleted key fails; create-if-absent succeeds.
	err := s.Commit(ctxFor(t), []store.Cond{store.Unchanged(d)}, []store.Op{store.Put("d", []byte("2"))})
	if !errors.Is(err, store.ErrConflict) {
		t.Fatalf("condition on deleted key's old revision: err = %v, want ErrConflict", err)
	}
	mustCommit(t, s, []store.Cond{{Key: "d", Revision: 0}}, store.Put("d", []byte("3")))
	if got := mustGet(t, s, "d")[0]; string(got.Value) != "3" || got.Revision <= d.Revision {
		t.Errorf("recreated d = %+v, old revision %d", got, d.Revision)
	}
}

func testEmptyCommit(t *testing.T, s store.Store) {
	mustCommit(t, s, nil)
	mustCommit(t, s, []store.Cond{{Key: "k", Revision: 0}})
	if got := mustScan(t, s, "", "\xff", 0); len(got) != 0 {
		t.Errorf("empty commits wrote %v", got)
	}
}

// testMultiGetConsistent has a writer move two keys together while readers
// check that one Get never sees them apart.
func testMultiGetConsistent(t *testing.T, s store.Store) {
	ctx := ctxFor(t)
	const writes = 150
	mustCommit(t, s, nil, store.Put("pair/a", []byte("0")), store.Put("pair/b", []byte("0")))
	done := make(chan struct{})
	errc := make(chan error, 1)
	go func() {
		defer close(done)
		for i := 1; i <= writes; i++ {
			v := []byte(strconv.Itoa(i))
			if err := s.Commit(ctx, nil, []store.Op{store.Put("pair/a", v), store.Put("pair/b", v)}); err != nil {
				errc <- err
				return
			}
		}
	}()
	reads := 0
	for stop := false; !stop; reads++ {
		select {
		case <-done:
			stop = true // one more read after the last write
		default:
		}
		kvs, err := s.Get(ctx, "pair/a", "unrelated", "pair/b")
		if err != nil {
			t.Fatalf("Get: %v", err)
		}
		if !bytes.Equal(kvs[0].Value, kvs[2].Value) || kvs[0].Revision != kvs[2].Revision {
			t.Fatalf("read %d saw a torn pair: a=%q@%d b=%q@%d", reads, kvs[0].Value, kvs[0].Revision, kvs[2].Value, kvs[2].Revision)
		}
	}
	select {
	case err := <-errc:
		t.Fatalf("writer: %v", err)
	default:
	}
	if got := mustGet(t, s, "pair/a")[0]; string(got.Value) != strconv.Itoa(writes) {
		t.Errorf("final pair/a = %q, want %d", got.Value, writes)
	}
}

func testScan(t *testing.T, s store.Store) {
	var ops []store.Op
	for _, k := range []string{"b/2", "a", "b/10", "b/1", "b", "c", "b/3/x", "ba"} {
		ops = append(ops, store.Put(k, []byte("v"+k)))
	}
	mustCommit(t, s, nil, ops...)
	tests := []struct {
		name     string
		from, to string
		limit    int
		want     []string
	}{
		{"everything", "", "\xff", 0, []string{"a", "b", "b/1", "b/10", "b/2", "b/3/x", "ba", "c"}},
		{"negative limit means all", "", "\xff", -1, []string{"a", "b", "b/1", "b/10", "b/2", "b/3/x", "ba", "c"}},
		{"from is inclusive, to exclusive", "b", "ba", 0, []string{"b", "b/1", "b/10", "b/2", "b/3/x"}},
		{"prefix", "b/", store.PrefixEnd("b/"), 0, []string{"b/1", "b/10", "b/2", "b/3/x"}},
		{"limit", "b/", store.PrefixEnd("b/"), 2, []string{"b/1", "b/10"}},
		{"limit larger than result", "b/", store.PrefixEnd("b/"), 100, []string{"b/1", "b/10", "b/2", "b/3/x"}},
		{"bounds between keys", "b/11", "b/3", 0, []string{"b/2"}},
		{"empty range", "b/2", "b/2", 0, nil},
		{"inverted range", "c", "a", 0, nil},
		{"past the end", "d", "\xff", 0, nil},
		{"limit 1", "", "\xff", 1, []string{"a"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got := mustScan(t, s, tc.from, tc.to, tc.limit)
			if diff := cmp.Diff(tc.want, keysOf(got), cmpopts.EquateEmpty()); diff != "" {
				t.Errorf("Scan(%q, %q, %d) keys (-want +got):\n%s", tc.from, tc.to, tc.limit, diff)
			}
			for _, kv := range got {
				if string(kv.Value) != "v"+kv.Key || kv.Revision <= 0 {
					t.Errorf("Scan returned %+v", kv)
				}
			}
		})
	}
	// Scan reports the revision each key was last written at.
	b1 := mustGet(t, s, "b/1")[0]
	mustCommit(t, s, nil, store.Put("b/2", []byte("vb/2")))
	sc := mustScan(t, s, "b/1", "b/20", 0)
	if sc[0].Revision != b1.Revision || sc[2].Revision <= b1.Revision {
		t.Errorf("Scan revisions: %+v, b/1 was written at %d", sc, b1.Revision)
	}
}

func testScanBinary(t *testing.T, s store.Store) {
	keys := []string{"\x00", "\x00\x00", "\x01", "p", "p/", "p/\x00", "p/\x7f", "p/\x80", "p/\xfe", "p/\xff", "p/\xff\xff", "p0", "\x7f", "\x80", "\xfe", "\xff", "\xff\x00", "\xff\xff\x01"}
	var ops []store.Op
	for _, k := range keys {
		ops = append(ops, store.Put(k, []byte(k)))
	}
	mustCommit(t, s, nil, ops...)
	sorted := slices.Clone(keys)
	slices.Sort(sorted) // Go orders strings bytewise, as the contract does
	tests := []struct {
		name     string
		from, to string
		limit    int
		want     []string
	}{
		{"all in byte order", "", "\xff\xff\xff\xff", 0, sorted},
		{"high bytes sort after low", "\x7f", "\xff", 0, []string{"\x7f", "\x80", "\xfe"}},
		{"PrefixEnd of p/ keeps p/\\xff", "p/", store.PrefixEnd("p/"), 0, []string{"p/", "p/\x00", "p/\x7f", "p/\x80", "p/\xfe", "p/\xff", "p/\xff\xff"}},
		{"PrefixEnd of p/\\xff", "p/\xff", store.PrefixEnd("p/\xff"), 0, []string{"p/\xff", "p/\xff\xff"}},
		{"PrefixEnd of \\xff", "\xff", store.PrefixEnd("\xff"), 0, []string{"\xff", "\xff\x00", "\xff\xff\x01"}},
		{"limit over binary keys", "p/", store.PrefixEnd("p/"), 3, []string{"p/", "p/\x00", "p/\x7f"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got := mustScan(t, s, tc.from, tc.to, tc.limit)
			if diff := cmp.Diff(tc.want, keysOf(got)); diff != "" {
				t.Errorf("Scan(%q, %q, %d) (-want +got):\n%s", tc.from, tc.to, tc.limit, diff)
			}
			for _, kv := range got {
				if string(kv.Value) != kv.Key {
					t.Errorf("key %q has value %q", kv.Key, kv.Value)
				}
			}
		})
	}
}

// testScanAcrossPages: a scan larger than a backend's page (the etcd
// stores read 1 000 keys a request) is whole and in byte order, written in
// no order at all, with and without a limit that ends inside a page.
func testScanAcrossPages(t *testing.T, s store.Store) {
	const n = 2600
	var keys []string
	for i := range n {
		// Digits of varying width, so byte order is not numeric order.
		keys = append(keys, fmt.Sprintf("pg/%d/%x", i%7, i*7919))
	}
	order := slices.Clone(keys)
	for i := range order { // a fixed shuffle: the write order says nothing
		j := (i*104729 + 17) % len(order)
		order[i], order[j] = order[j], order[i]
	}
	for len(order) > 0 {
		k := min(store.MaxOps, len(order))
		var ops []store.Op
		for _, key := range order[:k] {
			ops = append(ops, store.Put(key, []byte(key)))
		}
		mustCommit(t, s, nil, ops...)
		order = order[k:]
	}
	sorted := slices.Clone(keys)
	slices.Sort(sorted)
	for _, limit := range []int{0, 1500, n} {
		got := keysOf(mustScan(t, s, "pg/", store.PrefixEnd("pg/"), limit))
		want := sorted
		if limit > 0 && limit < n {
			want = sorted[:limit]
		}
		if len(got) != len(want) {
			t.Fatalf("Scan with limit %d returned %d keys, want %d", limit, len(got), len(want))
		}
		if diff := cmp.Diff(want, got); diff != "" {
			t.Errorf("Scan with limit %d (-want +got):\n%s", limit, diff)
		}
	}
}

func testLimits(t *testing.T, s store.Store) {
	ctx := ctxFor(t)
	many := func(n int) []store.Op {
		ops := make([]store.Op, n)
		for i := range ops {
			ops[i] = store.Put(fmt.Sprintf("op/%03d", i), []byte("x"))
		}
		return ops
	}
	err := s.Commit(ctx, nil, many(store.MaxOps+1))
	if !errors.Is(err, store.ErrTooLarge) {
		t.Fatalf("Commit of MaxOps+1 ops: err = %v, want ErrTooLarge", err)
	}
	conds := []store.Cond{{Key: "c", Revision: 0}}
	if err := s.Commit(ctx, conds, many(store.MaxOps)); !errors.Is(err, store.ErrTooLarge) {
		t.Fatalf("Commit of 1 cond + MaxOps ops: err = %v, want ErrTooLarge", err)
	}
	if got := mustScan(t, s, "", "\xff", 0); len(got) != 0 {
		t.Fatalf("oversized commits wrote %d keys", len(got))
	}
	mustCommit(t, s, conds, many(store.MaxOps-1)...)
	if got := mustScan(t, s, "op/", store.PrefixEnd("op/"), 0); len(got) != store.MaxOps-1 {
		t.Fatalf("commit of exactly MaxOps entries wrote %d keys, want %d", len(got), store.MaxOps-1)
	}
	for _, bad := range []struct {
		name  string
		conds []store.Cond
		ops   []store.Op
	}{
		{"empty op key", nil, []store.Op{store.Put("", []byte("x"))}},
		{"empty delete key", nil, []store.Op{store.Delete("")}},
		{"empty cond key", []store.Cond{{Key: ""}}, []store.Op{store.Put("ok", []byte("x"))}},
	} {
		err := s.Commit(ctx, bad.conds, bad.ops)
		if err == nil || errors.Is(err, store.ErrConflict) || errors.Is(err, store.ErrUnavailable) {
			t.Errorf("%s: err = %v, want a validation error", bad.name, err)
		}
	}
	if got := mustGet(t, s, "ok")[0]; got.Exists() {
		t.Errorf("invalid commit wrote %+v", got)
	}
	// A multi-get larger than MaxOps still reads at one revision.
	keys := make([]string, 0, 2*store.MaxOps+3)
	for i := range cap(keys) {
		keys = append(keys, fmt.Sprintf("op/%03d", i))
	}
	kvs := mustGet(t, s, keys...)
	for i, kv := range kvs {
		if want := i < store.MaxOps-1; kv.Exists() != want {
			t.Fatalf("big Get: %q exists=%v, want %v", kv.Key, kv.Exists(), want)
		}
	}
}

func testCanceled(t *testing.T, s store.Store) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := s.Commit(ctx, nil, []store.Op{store.Put("k", []byte("v"))}); !errors.Is(err, context.Canceled) {
		t.Errorf("Commit with canceled ctx: err = %v, want context.Canceled", err)
	}
	if _, err := s.Get(ctx, "k"); !errors.Is(err, context.Canceled) {
		t.Errorf("Get with canceled ctx: err = %v, want context.Canceled", err)
	}
	if _, err := s.Scan(ctx, "", "\xff", 0); !errors.Is(err, context.Canceled) {
		t.Errorf("Scan with canceled ctx: err = %v, want context.Canceled", err)
	}
	if got := mustGet(t, s, "k")[0]; got.Exists() {
		t.Errorf("canceled commit wrote %+v", got)
	}
}

func testLargeValue(t *testing.T, s store.Store) {
	big := bytes.Repeat([]byte("0123456789abcdef"), 64<<10/16)
	mustCommit(t, s, nil, store.Put("big", big), store.Put("small", []byte("s")))
	if got := mustGet(t, s, "big")[0]; !bytes.Equal(got.Value, big) {
		t.Errorf("64 KiB value came back with %d bytes", len(got.Value))
	}
}

// counterRace runs workers goroutines, spread over the given handles, that
// each add perWorker to one counter by read-compare-swap, retrying on
// conflict. No update may be lost.
func counterRace(t *testing.T, handles []store.Store, workers, perWorker int) {
	ctx := ctxFor(t)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var errs []error
	successes, conflicts := 0, 0
	for w := range workers {
		s := handles[w%len(handles)]
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range perWorker {
				c, err := Increment(ctx, s, "counter")
				mu.Lock()
				conflicts += c
				if err != nil {
					errs = append(errs, err)
				} else {
					successes++
				}
				mu.Unlock()
				if err != nil {
					return
				}
			}
		}()
	}
	wg.Wait()
	if len(errs) > 0 {
		t.Fatalf("%d increments failed, first: %v", len(errs), errs[0])
	}
	got := mustGet(t, handles[0], "counter")[0]
	n, err := strconv.Atoi(string(got.Value))
	if err != nil {
		t.Fatalf("counter value %q: %v", got.Value, err)
	}
	if n != successes || n != workers*perWorker {
		t.Fatalf("counter = %d after %d successful increments, want %d (lost updates)", n, successes, workers*perWorker)
	}
	t.Logf("%d increments from %d goroutines on %d handles, %d conflicts retried", n, workers, len(handles), conflicts)
}

// incrementPolicy retries conflicts patiently: the suite wants every
// increment to land, not to measure contention.
var incrementPolicy = retry.Policy{Attempts: 500, BaseDelay: 100 * time.Microsecond, MaxDelay: 5 * time.Millisecond}

// Increment adds one to the decimal counter at key with a conditional
// commit, retrying conflicts a bounded number of times. It returns how many
// conflicts it met. Exported for multi-process tests of backends.
func Increment(ctx context.Context, s store.Store, key string) (conflicts int, err error) {
	_, conflicts, err = IncrementPadded(ctx, s, key, 0)
	return conflicts, err
}

// IncrementPadded is Increment for a counter stored with padding bytes
// after it ("<n>|ppp...", just "<n>" without padding), so that a test can
// make every commit as large as it needs; it also returns the new count.
func IncrementPadded(ctx context.Context, s store.Store, key string, padding int) (count, conflicts int, err error) {
	err = retry.Do(ctx, incrementPolicy, func(err error) bool { return errors.Is(err, store.ErrConflict) }, func(int) error {
		kvs, err := s.Get(ctx, key)
		if err != nil {
			return err
		}
		n := 0
		if kvs[0].Exists() {
			head, _, _ := strings.Cut(string(kvs[0].Value), "|")
			if n, err = strconv.Atoi(head); err != nil {
				return fmt.Errorf("counter %.40q: %w", kvs[0].Value, err)
			}
		}
		v := strconv.Itoa(n + 1)
		if padding > 0 {
			v += "|" + strings.Repeat("p", padding)
		}
		// Let other goroutines in between read and write: a store that loses
		// updates must get the chance to show it.
		runtime.Gosched()
		err = s.Commit(ctx, []store.Cond{store.Unchanged(kvs[0])}, []store.Op{store.Put(key, []byte(v))})
		switch {
		case errors.Is(err, store.ErrConflict):
			conflicts++
		case err == nil:
			count = n + 1
		}
		return err
	})
	return count, conflicts, err
}

func testReopen(t *testing.T, openAt func(t *testing.T) store.Store) {
	s := openAt(t)
	mustCommit(t, s, nil, store.Put("keep", []byte("me")), store.Put("gone", []byte("x")))
	mustCommit(t, s, nil, store.Delete("gone"))
	before := mustGet(t, s, "keep")[0]
	if err := s.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	s2 := openAt(t)
	t.Cleanup(func() { s2.Close() })
	got := mustGet(t, s2, "keep", "gone")
	if got[0].Revision != before.Revision || string(got[0].Value) != "me" || got[1].Exists() {
		t.Fatalf("after reopen: %+v, before: %+v", got, before)
	}
	mustCommit(t, s2, []store.Cond{store.Unchanged(got[0])}, store.Put("keep", []byte("again")))
	if after := mustGet(t, s2, "keep")[0]; after.Revision <= before.Revision {
		t.Fatalf("revision after reopen %d not above %d: the counter was not persisted", after.Revision, before.Revision)
	}
}

func testHandles(t *testing.T, a, b store.Store) {
	mustCommit(t, a, nil, store.Put("k", []byte("from a")))
	got := mustGet(t, b, "k")[0]
	if string(got.Value) != "from a" {
		t.Fatalf("handle b reads %q", got.Value)
	}
	mustCommit(t, b, []store.Cond{store.Unchanged(got)}, store.Put("k", []byte("from b")))
	err := a.Commit(ctxFor(t), []store.Cond{store.Unchanged(got)}, []store.Op{store.Put("k", []byte("stale a"))})
	if !errors.Is(err, store.ErrConflict) {
		t.Fatalf("stale commit through the other handle: err = %v, want ErrConflict", err)
	}
	if diff := cmp.Diff([]view{{"k", "from b"}}, views(mustScan(t, a, "", "\xff", 0))); diff != "" {
		t.Errorf("handle a scan (-want +got):\n%s", diff)
	}
}

// BenchmarkCommit measures one create-if-absent commit of a small value that
// also deletes the key written 1024 commits earlier: the shape of one
// allocation plus one release, on a store of bounded size. Run it from a
// backend's benchmark with a fresh store.
func BenchmarkCommit(b *testing.B, s store.Store) {
	const live = 1024
	ctx := context.Background()
	val := bytes.Repeat([]byte("x"), 64)
	key := func(i int) string { return fmt.Sprintf("bench/%010d", i) }
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		k := key(i)
		ops := []store.Op{store.Put(k, val)}
		if i >= live {
			ops = append(ops, store.Delete(key(i-live)))
		}
		if err := s.Commit(ctx, []store.Cond{{Key: k}}, ops); err != nil {
			b.Fatalf("Commit: %v", err)
		}
	}
}

// BenchmarkGetCommit measures the read-then-conditional-write cycle of one
// update on a hot key from one goroutine.
func BenchmarkGetCommit(b *testing.B, s store.Store) {
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Increment(ctx, s, "bench/counter"); err != nil {
			b.Fatalf("Increment: %v", err)
		}
	}
}
