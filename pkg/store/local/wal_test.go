package local

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/ringipam/ringipam/pkg/store"
)

func newStore(t *testing.T, path string) *Store {
	t.Helper()
	s, err := New(Config{Path: path, OpenTimeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func put(t *testing.T, s *Store, key, value string) {
	t.Helper()
	if err := s.Commit(context.Background(), nil, []store.Op{store.Put(key, []byte(value))}); err != nil {
		t.Fatalf("put %s: %v", key, err)
	}
}

// state reads every key of s, as "key=value@rev" lines.
func state(t *testing.T, s *Store) string {
	t.Helper()
	kvs, err := s.Scan(context.Background(), "", "\xff", 0)
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	for _, kv := range kvs {
		fmt.Fprintf(&b, "%s=%s@%d\n", kv.Key, kv.Value, kv.Revision)
	}
	return b.String()
}

// readLog returns the bytes of the store's log file.
func readLog(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path + logSuffix)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// records returns the offsets and lengths of the records at the log's
// start, as far as their length fields go (valid or not).
func records(t *testing.T, log []byte) (offs, lens []int) {
	t.Helper()
	for off := 0; off+logHeader <= len(log); {
		n := int(binary.LittleEndian.Uint32(log[off:]))
		if n < logHeader {
			break
		}
		offs, lens = append(offs, off), append(lens, n)
		off += n
	}
	return offs, lens
}

// A record torn by a crash ends the chain: neither it nor the records
// written after it are read, whole as they are, and the next commit
// continues from the last record before it. A record written in its place
// does not revive the ones that followed the torn one, even when it has
// their predecessor's length and revision.
func TestTornRecordEndsTheChain(t *testing.T) {
	path := filepath.Join(t.TempDir(), "store.db")
	s := newStore(t, path)
	put(t, s, "a", "1") // the first commit: a checkpoint, with the anchor
	put(t, s, "b", "2")
	put(t, s, "c", "3")
	put(t, s, "d", "4")
	before := state(t, s)
	if want := "a=1@1\nb=2@2\nc=3@3\nd=4@4\n"; before != want {
		t.Fatalf("state before the tear:\n%swant\n%s", before, want)
	}
	log := readLog(t, path)
	offs, lens := records(t, log)
	if len(offs) != 3 {
		t.Fatalf("the log holds %d records, want 3 (b, c, d)", len(offs))
	}
	// Tear c: its last byte never reached the disk.
	torn := bytes.Clone(log)
	torn[offs[1]+lens[1]-1] ^= 0xff
	if err := os.WriteFile(path+logSuffix, torn, 0o600); err != nil {
		t.Fatal(err)
	}
	if got, want := state(t, newStore(t, path)), "a=1@1\nb=2@2\n"; got != want {
		t.Fatalf("state after the tear:\n%swant\n%s", got, want)
	}
	// e takes c's place: same length, same revision.
	put(t, s, "e", "5")
	log = readLog(t, path)
	if !bytes.Equal(log[offs[2]:offs[2]+lens[2]], torn[offs[2]:offs[2]+lens[2]]) {
		t.Fatal("test premise: d's record is no longer right after e's")
	}
	if got, want := state(t, newStore(t, path)), "a=1@1\nb=2@2\ne=5@3\n"; got != want {
		t.Fatalf("state after a commit in the torn record's place:\n%swant\n%s", got, want)
	}
}

// A checkpoint ends the chain: the records it took in stay in the log
// until they are overwritten, and are never read again.
func TestCheckpointEndsTheChain(t *testing.T) {
	path := filepath.Join(t.TempDir(), "store.db")
	s := newStore(t, path)
	put(t, s, "a", "1")
	for i := range 5 {
		put(t, s, fmt.Sprintf("k%d", i), "x")
	}
	oldLog := readLog(t, path)
	// A value too large for what is left of the log: a checkpoint.
	big := strings.Repeat("v", logCapacity)
	put(t, s, "big", big)
	put(t, s, "k0", "y") // the first record after the checkpoint
	want := state(t, s)
	if !strings.Contains(want, "k0=y@8\n") || !strings.Contains(want, "k4=x@6\n") {
		t.Fatalf("state after the checkpoint:\n%s", want)
	}
	// The log as it was before the checkpoint: a chain that no longer
	// follows it.
	if err := os.WriteFile(path+logSuffix, oldLog, 0o600); err != nil {
		t.Fatal(err)
	}
	got := state(t, newStore(t, path))
	if !strings.Contains(got, "k0=x@2\n") || strings.Contains(got, "k0=y") {
		t.Fatalf("state with the old log back:\n%s", got)
	}
	if got != strings.Replace(want, "k0=y@8", "k0=x@2", 1) {
		t.Fatalf("state with the old log back:\n%swant the checkpoint's\n%s", got, want)
	}
	put(t, s, "z", "1")
	if got := state(t, newStore(t, path)); !strings.Contains(got, "z=1@8\n") {
		t.Fatalf("a commit after the old log came back:\n%s", got)
	}
}

// A file written before the log (an 8-byte revision counter, no anchor)
// is read as it is, and its first commit is a checkpoint that starts the
// log. The counter then carries the anchor: a ringipam from before the log
// refuses to commit to the file (it reports a corrupt counter) rather than
// write past records it cannot read.
func TestFileFromBeforeTheLog(t *testing.T) {
	path := filepath.Join(t.TempDir(), "store.db")
	db, err := bolt.Open(path, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	err = db.Update(func(tx *bolt.Tx) error {
		kv, err := tx.CreateBucket(bucketKV)
		if err != nil {
			return err
		}
		meta, err := tx.CreateBucket(bucketMeta)
		if err != nil {
			return err
		}
		if err := kv.Put([]byte("a"), encode(7, []byte("old"))); err != nil {
			return err
		}
		return meta.Put(keyRev, binary.BigEndian.AppendUint64(nil, 7))
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := db.Close(); err != nil {
		t.Fatal(err)
	}
	s := newStore(t, path)
	if got := state(t, s); got != "a=old@7\n" {
		t.Fatalf("old file read as:\n%s", got)
	}
	put(t, s, "b", "1")
	put(t, s, "c", "2")
	if got, want := state(t, newStore(t, path)), "a=old@7\nb=1@8\nc=2@9\n"; got != want {
		t.Fatalf("after two commits:\n%swant\n%s", got, want)
	}
	if _, err := os.Stat(path + logSuffix); err != nil {
		t.Fatalf("the second commit did not start the log: %v", err)
	}
	db, err = bolt.Open(path, 0o600, &bolt.Options{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	_ = db.View(func(tx *bolt.Tx) error {
		if n := len(tx.Bucket(bucketMeta).Get(keyRev)); n != 16 {
			t.Errorf("revision counter of %d bytes, want 16 (revision and anchor)", n)
		}
		return nil
	})
}

// Deletes and puts in the log hide and replace the checkpoint's keys, for
// Get and Scan alike, and a checkpoint keeps what they did.
func TestLogOverCheckpoint(t *testing.T) {
	path := filepath.Join(t.TempDir(), "store.db")
	s := newStore(t, path)
	ctx := context.Background()
	ops := []store.Op{}
	for i := range 6 {
		ops = append(ops, store.Put(fmt.Sprintf("k%d", i), []byte("file")))
	}
	if err := s.Commit(ctx, nil, ops); err != nil { // a checkpoint
		t.Fatal(err)
	}
	if err := s.Commit(ctx, nil, []store.Op{store.Delete("k1"), store.Put("k2", []byte("log")), store.Put("k25", []byte("new")), store.Delete("k5")}); err != nil {
		t.Fatal(err)
	}
	want := "k0=file@1\nk2=log@2\nk25=new@2\nk3=file@1\nk4=file@1\n"
	if got := state(t, s); got != want {
		t.Fatalf("scan over the log:\n%swant\n%s", got, want)
	}
	kvs, err := s.Scan(ctx, "k1", "k4", 2)
	if err != nil || len(kvs) != 2 || kvs[0].Key != "k2" || kvs[1].Key != "k25" {
		t.Fatalf("scan [k1, k4) limit 2: %v %v", kvs, err)
	}
	kvs, err = s.Get(ctx, "k1", "k2", "k3", "k5")
	if err != nil || kvs[0].Exists() || string(kvs[1].Value) != "log" || kvs[2].Revision != 1 || kvs[3].Exists() {
		t.Fatalf("get over the log: %v %v", kvs, err)
	}
	put(t, s, "big", strings.Repeat("v", logCapacity)) // a checkpoint
	if got := state(t, newStore(t, path)); got != "big="+strings.Repeat("v", logCapacity)+"@3\n"+want {
		t.Fatalf("after the checkpoint:\n%.300s", got)
	}
}

// A record that follows the chain's last one but carries a revision other
// than the next does not belong to the chain.
func TestRecordOutOfSequence(t *testing.T) {
	path := filepath.Join(t.TempDir(), "store.db")
	s := newStore(t, path)
	put(t, s, "a", "1")
	put(t, s, "b", "2")
	log := readLog(t, path)
	offs, lens := records(t, log)
	if len(offs) != 1 {
		t.Fatalf("the log holds %d records, want 1", len(offs))
	}
	prev := binary.LittleEndian.Uint64(log[offs[0]+20:])
	for _, seq := range []int64{3, 4} {
		rec := encodeRecord(seq, prev, "", []store.Op{store.Put("c", []byte("3"))})
		copy(log[offs[0]+lens[0]:], rec)
		if err := os.WriteFile(path+logSuffix, log, 0o600); err != nil {
			t.Fatal(err)
		}
		got, want := state(t, newStore(t, path)), "a=1@1\nb=2@2\n"
		if seq == 3 {
			want += "c=3@3\n"
		}
		if got != want {
			t.Fatalf("with a record of revision %d after revision 2:\n%swant\n%s", seq, got, want)
		}
	}
}

// A store whose log is gone (a crash between a checkpoint and the log's
// creation, or a log removed by hand) commits by checkpoints, the first of
// which creates the log again; a log cut short by a crash while it was
// being created never had its name.
func TestMissingLogIsCreatedAgain(t *testing.T) {
	path := filepath.Join(t.TempDir(), "store.db")
	s := newStore(t, path)
	put(t, s, "a", "1")
	if err := os.Remove(path + logSuffix); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path+logSuffix+".new", []byte("half"), 0o600); err != nil {
		t.Fatal(err)
	}
	put(t, s, "b", "2")
	fi, err := os.Stat(path + logSuffix)
	if err != nil || fi.Size() != logCapacity {
		t.Fatalf("log after a commit without one: %v %v", fi, err)
	}
	if _, err := os.Stat(path + logSuffix + ".new"); !os.IsNotExist(err) {
		t.Fatalf("temporary log left behind: %v", err)
	}
	put(t, s, "c", "3")
	log := readLog(t, path)
	if offs, _ := records(t, log); len(offs) != 1 {
		t.Fatalf("%d records after one commit to the new log, want 1", len(offs))
	}
	if got, want := state(t, newStore(t, path)), "a=1@1\nb=2@2\nc=3@3\n"; got != want {
		t.Fatalf("state:\n%swant\n%s", got, want)
	}
}
