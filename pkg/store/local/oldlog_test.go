package local_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"io/fs"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/store"
)

// The fixture: a store written by the code of the write-ahead log (commit
// 6d6cf88, testdata/gen-wal-fixture.go), 9 commits of it still only in
// its log, and what that code read from it.
type walFixture struct {
	Revision     int64    `json:"revision"`
	Checkpoint   int64    `json:"checkpoint"`
	DeletedInLog []string `json:"deletedInLog"`
	Rows         []struct {
		Key      string `json:"key"`
		Value    string `json:"value"`
		Revision int64  `json:"revision"`
		InLog    bool   `json:"inLog"`
	} `json:"rows"`
}

const oldLog = "-wal"

// copyWALFixture copies the fixture's two files into a new directory and
// returns the store's path there, and what the fixture held.
func copyWALFixture(t *testing.T) (string, walFixture) {
	t.Helper()
	var fx walFixture
	raw, err := os.ReadFile("testdata/wal-store.json")
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(raw, &fx); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "store.db")
	for _, suffix := range []string{"", oldLog} {
		b, err := os.ReadFile("testdata/wal-store.db" + suffix)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path+suffix, b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return path, fx
}

// rawFile reads the bbolt file directly: its revision counter and its keys.
func rawFile(t *testing.T, path string) ([]byte, map[string][]byte) {
	t.Helper()
	db, err := bolt.Open(path, 0o600, &bolt.Options{ReadOnly: true, Timeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	var counter []byte
	kv := map[string][]byte{}
	err = db.View(func(tx *bolt.Tx) error {
		counter = bytes.Clone(tx.Bucket([]byte("meta")).Get([]byte("rev")))
		return tx.Bucket([]byte("kv")).ForEach(func(k, v []byte) error {
			kv[string(k)] = bytes.Clone(v)
			return nil
		})
	})
	if err != nil {
		t.Fatal(err)
	}
	return counter, kv
}

// checkRows fails unless s holds exactly the fixture's keys, values and
// revisions.
func checkRows(t *testing.T, s store.Store, fx walFixture) {
	t.Helper()
	kvs, err := s.Scan(context.Background(), "", "\xff", 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(kvs) != len(fx.Rows) {
		t.Errorf("%d keys, want the fixture's %d", len(kvs), len(fx.Rows))
	}
	for i := range min(len(kvs), len(fx.Rows)) {
		got, want := kvs[i], fx.Rows[i]
		if got.Key != want.Key || string(got.Value) != want.Value || got.Revision != want.Revision {
			t.Fatalf("key %d: %q=%q@%d, want %q=%q@%d (only in the log: %v)",
				i, got.Key, got.Value, got.Revision, want.Key, want.Value, want.Revision, want.InLog)
		}
	}
}

func checkNoLog(t *testing.T, path string) {
	t.Helper()
	for _, p := range []string{path + oldLog, path + oldLog + ".new"} {
		if _, err := os.Lstat(p); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s after the checkpoint: %v, want it gone", filepath.Base(p), err)
		}
	}
}

// Item 4 of issue 34: a local store written by the code of the write-ahead
// log opens and keeps every allocation. The first call (a read) reads the
// log once and checkpoints it into the bbolt file, which then holds every
// key, value and revision that code read, those only in the log included,
// without the keys the log deleted; the log is gone. A second open finds
// no log and the same data, and commits after the log's last revision.
func TestStoreWithOldLog(t *testing.T) {
	path, fx := copyWALFixture(t)
	// The fixture's premise, read from the file itself.
	counter, file := rawFile(t, path)
	if len(counter) != 16 || int64(binary.BigEndian.Uint64(counter)) != fx.Checkpoint {
		t.Fatalf("fixture's counter %x, want 16 bytes at revision %d", counter, fx.Checkpoint)
	}
	inLog := 0
	for _, r := range fx.Rows {
		v, ok := file[r.Key]
		if ok && int64(binary.BigEndian.Uint64(v)) == r.Revision && string(v[8:]) == r.Value {
			continue
		}
		if !r.InLog {
			t.Fatalf("fixture: %s is not in the file as its rows say", r.Key)
		}
		inLog++
	}
	if inLog < 20 || len(fx.DeletedInLog) == 0 {
		t.Fatalf("fixture: %d values only in the log, %d keys it deletes: not the premise", inLog, len(fx.DeletedInLog))
	}
	for _, k := range fx.DeletedInLog {
		if _, ok := file[k]; !ok {
			t.Fatalf("fixture: %s, deleted by the log, is not in the file", k)
		}
	}

	checkRows(t, newAt(t, path), fx)
	checkNoLog(t, path)
	counter, file = rawFile(t, path)
	if len(counter) != 8 || int64(binary.BigEndian.Uint64(counter)) != fx.Revision {
		t.Fatalf("counter after the checkpoint %x, want 8 bytes at revision %d", counter, fx.Revision)
	}
	if len(file) != len(fx.Rows) {
		t.Fatalf("the file holds %d keys after the checkpoint, want %d", len(file), len(fx.Rows))
	}

	s := newAt(t, path)
	checkRows(t, s, fx)
	checkNoLog(t, path)
	if err := s.Commit(context.Background(), []store.Cond{{Key: "after"}}, []store.Op{store.Put("after", []byte("x"))}); err != nil {
		t.Fatal(err)
	}
	if kvs, err := s.Get(context.Background(), "after"); err != nil || kvs[0].Revision != fx.Revision+1 {
		t.Fatalf("a commit after the checkpoint: %v %v, want revision %d", kvs, err, fx.Revision+1)
	}
}

// The checkpoint is idempotent: a log applied again over a file that
// already holds its chain (the counter and the log as they were before it)
// changes nothing. A log left beside a checkpointed file (a crash before
// its removal) is not read, and is removed.
func TestOldLogCheckpointIdempotent(t *testing.T) {
	path, fx := copyWALFixture(t)
	oldCounter, _ := rawFile(t, path)
	log, err := os.ReadFile(path + oldLog)
	if err != nil {
		t.Fatal(err)
	}
	checkRows(t, newAt(t, path), fx)

	// A log left after its checkpoint.
	if err := os.WriteFile(path+oldLog, log, 0o600); err != nil {
		t.Fatal(err)
	}
	checkRows(t, newAt(t, path), fx)
	checkNoLog(t, path)

	// The counter of before, with its anchor, and the log again.
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	err = db.Update(func(tx *bolt.Tx) error { return tx.Bucket([]byte("meta")).Put([]byte("rev"), oldCounter) })
	if cerr := db.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path+oldLog, log, 0o600); err != nil {
		t.Fatal(err)
	}
	s := newAt(t, path)
	if _, err := s.Get(context.Background(), "v"); err != nil {
		t.Fatal(err)
	}
	checkRows(t, s, fx)
	checkNoLog(t, path)
	if counter, _ := rawFile(t, path); int64(binary.BigEndian.Uint64(counter)) != fx.Revision || len(counter) != 8 {
		t.Fatalf("counter %x after the second checkpoint, want revision %d", counter, fx.Revision)
	}
}

// A log whose last record was torn by a crash (its commit never returned)
// is read up to the record before it; the first commit after the
// checkpoint (here the first call) gets the torn record's revision.
func TestOldLogTornRecord(t *testing.T) {
	path, fx := copyWALFixture(t)
	log, err := os.ReadFile(path + oldLog)
	if err != nil {
		t.Fatal(err)
	}
	// The chain's records, from the log's start (the first 4 bytes of
	// each are its length, little endian); older ones may follow.
	var last, end int
	for range fx.Revision - fx.Checkpoint {
		if end+28 > len(log) {
			t.Fatalf("fixture: the log ends at %d, inside its chain", end)
		}
		n := int(binary.LittleEndian.Uint32(log[end:]))
		if n < 28 || end+n > len(log) {
			t.Fatalf("fixture: record of length %d at offset %d", n, end)
		}
		last, end = end, end+n
	}
	log[end-1] ^= 0xff
	if err := os.WriteFile(path+oldLog, log, 0o600); err != nil {
		t.Fatal(err)
	}
	t.Logf("tore the record at offset %d", last)
	s := newAt(t, path)
	ctx := context.Background()
	if err := s.Commit(ctx, nil, []store.Op{store.Put("after", []byte("x"))}); err != nil {
		t.Fatal(err)
	}
	checkNoLog(t, path)
	kvs, err := s.Scan(ctx, "", "\xff", 0)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]store.KV{}
	for _, kv := range kvs {
		got[kv.Key] = kv
		if kv.Revision == fx.Revision && kv.Key != "after" {
			t.Errorf("%s at the torn record's revision %d", kv.Key, kv.Revision)
		}
	}
	if got["after"].Revision != fx.Revision {
		t.Errorf("the first commit after a torn last record: revision %d, want %d", got["after"].Revision, fx.Revision)
	}
	kept := 0
	for _, r := range fx.Rows {
		if r.Revision == fx.Revision {
			continue
		}
		if kv, ok := got[r.Key]; !ok || string(kv.Value) != r.Value || kv.Revision != r.Revision {
			t.Errorf("%s: %q@%d, want %q@%d (the records before the torn one)", r.Key, kv.Value, kv.Revision, r.Value, r.Revision)
		}
		if r.InLog {
			kept++
		}
	}
	if kept == 0 {
		t.Fatal("no value of the log's records before the torn one checked")
	}
}

// The same fixture through the pool: every owner the old code recorded,
// those only in the log included, is listed with its addresses; the pools
// check clean; a new allocation gets an address no one holds.
func TestPoolOnStoreWithOldLog(t *testing.T) {
	path, fx := copyWALFixture(t)
	ctx := context.Background()
	st := newAt(t, path)
	a, err := pool.New(st, "host-a", pool.WithClock(func() time.Time { return time.Unix(1795001000, 0).UTC() }))
	if err != nil {
		t.Fatal(err)
	}
	all, err := a.List(ctx, pool.Filter{Kind: pool.KindCNI})
	if err != nil {
		t.Fatal(err)
	}
	var want, got []string
	fromLog := 0
	for _, r := range fx.Rows {
		if owner, ok := strings.CutPrefix(r.Key, "o/"); ok {
			want = append(want, owner)
			if r.InLog {
				fromLog++
			}
		}
	}
	held := map[netip.Addr]bool{}
	for _, al := range all {
		got = append(got, al.Owner.String())
		if len(al.Addrs) != 2 {
			t.Errorf("%s holds %v, want an IPv4 and an IPv6 address", al.Owner, al.Addrs)
		}
		for _, x := range al.Addrs {
			held[x.Addr] = true
		}
	}
	slices.Sort(want)
	slices.Sort(got)
	if !slices.Equal(got, want) {
		t.Fatalf("owners listed:\n%v\nwant the fixture's\n%v", got, want)
	}
	if fromLog < 4 {
		t.Fatalf("fixture: %d owners only in the log, want at least 4", fromLog)
	}
	for _, p := range []string{"net1-0", "net1-1"} {
		if bad, err := a.Check(ctx, p); err != nil || len(bad) != 0 {
			t.Fatalf("Check %s: %v %v", p, bad, err)
		}
	}
	al, err := a.Allocate(ctx, pool.Request{Owner: pool.Owner{Kind: pool.KindCNI, Network: "net1", ContainerID: "new", IfName: "eth0"},
		Wants: []pool.Want{{Pool: "net1-0", Role: pool.RoleIP}, {Pool: "net1-1", Role: pool.RoleIP}}})
	if err != nil {
		t.Fatal(err)
	}
	for _, x := range al.Addrs {
		if held[x.Addr] {
			t.Fatalf("new allocation got %s, held by another owner", x.Addr)
		}
	}
}
