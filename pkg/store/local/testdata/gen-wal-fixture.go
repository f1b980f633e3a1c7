//go:build ignore

// gen-wal-fixture writes wal-store.db and wal-store.db-wal, a local store as
// the code of the write-ahead log wrote it (commit 6d6cf88 on main, the last
// one with pkg/store/local/wal.go), and wal-store.json, every key the store
// held then with its value and revision, and which of them were only in the
// log (not yet checkpointed into the bbolt file). TestStoreWithOldLog and
// TestPoolOnStoreWithOldLog (fixture_test.go) open copies with the code
// that replaced the log.
//
// It does not build on later commits (it needs the log's code); to make the
// fixture again, check that commit out and run, from the repository root:
//
//	go run pkg/store/local/testdata/gen-wal-fixture.go pkg/store/local/testdata
package main

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"log"
	"net/netip"
	"os"
	"path/filepath"
	"sort"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/store/local"
)

// row is one key of the fixture as the store read it.
type row struct {
	Key      string `json:"key"`
	Value    string `json:"value"`
	Revision int64  `json:"revision"`
	// InLog: the bbolt file does not hold this value (the key is absent
	// there, or holds an older one); only the log's chain does.
	InLog bool `json:"inLog,omitempty"`
}

type fixture struct {
	// Revision is the store's last revision (the log's last record).
	Revision int64 `json:"revision"`
	// Checkpoint is the revision the bbolt file was checkpointed at.
	Checkpoint int64 `json:"checkpoint"`
	// DeletedInLog are keys the bbolt file holds that the log deletes.
	DeletedInLog []string `json:"deletedInLog"`
	Rows         []row    `json:"rows"`
}

func main() {
	if len(os.Args) != 2 {
		log.Fatal("usage: gen-wal-fixture <dir>")
	}
	dir := os.Args[1]
	path := filepath.Join(dir, "wal-store.db")
	for _, p := range []string{path, path + "-wal", path + "-wal.new"} {
		if err := os.Remove(p); err != nil && !os.IsNotExist(err) {
			log.Fatal(err)
		}
	}
	ctx := context.Background()
	st, err := local.New(local.Config{Path: path, OpenTimeout: 10 * time.Second})
	if err != nil {
		log.Fatal(err)
	}
	tick := time.Unix(1795000000, 0).UTC()
	clock := func() time.Time { tick = tick.Add(time.Second); return tick }
	a, _ := pool.New(st, "host-a", pool.WithClock(clock))
	b, _ := pool.New(st, "host-b", pool.WithClock(clock))
	v4 := pool.Def{Name: "net1-0", Ranges: []pool.Range{{Subnet: netip.MustParsePrefix("198.18.0.0/20"), Gateway: netip.MustParseAddr("198.18.0.1")}}}
	v6 := pool.Def{Name: "net1-1", Ranges: []pool.Range{{Subnet: netip.MustParsePrefix("2001:db8:7::/64")}}}
	owner := func(i int) pool.Owner {
		return pool.Owner{Kind: pool.KindCNI, Network: "net1", ContainerID: fmt.Sprintf("c0ffee%03d", i), IfName: "eth0"}
	}
	alloc := func(al *pool.Allocator, i int) {
		req := pool.Request{Owner: owner(i), Reservation: fmt.Sprintf("default/pod-%d", i),
			Wants: []pool.Want{{Pool: "net1-0", Role: pool.RoleIP}, {Pool: "net1-1", Role: pool.RoleIP}}, Defs: []pool.Def{v4, v6}}
		if _, err := al.Allocate(ctx, req); err != nil {
			log.Fatalf("allocate %d: %v", i, err)
		}
	}
	release := func(al *pool.Allocator, i int) {
		if _, ok, err := al.Release(ctx, owner(i)); err != nil || !ok {
			log.Fatalf("release %d: %v %v", i, ok, err)
		}
	}
	// Allocations until a commit is a checkpoint (the log full) after at
	// least 30 of them: those are in the bbolt file.
	i := 0
	for ; ; i++ {
		al := a
		if i%3 == 2 {
			al = b
		}
		alloc(al, i)
		if i >= 30 && pending(path, st) == 0 {
			break
		}
	}
	checkpointed := i + 1
	// Then commits that stay in the log: releases of owners the bbolt file
	// holds (deletes of its keys, and a reservation turned into a hold),
	// new owners on both hosts, one of which is released again.
	release(a, 0)
	release(b, 2)
	for j := checkpointed; j < checkpointed+6; j++ {
		al := a
		if j%2 == 1 {
			al = b
		}
		alloc(al, j)
	}
	release(b, checkpointed+1)
	fx := dump(path, st)
	if fx.Revision-fx.Checkpoint != 9 {
		log.Fatalf("the log holds %d commits, want the last 9 (a checkpoint in between?)", fx.Revision-fx.Checkpoint)
	}
	raw, err := json.MarshalIndent(fx, "", "  ")
	if err != nil {
		log.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "wal-store.json"), append(raw, '\n'), 0o644); err != nil {
		log.Fatal(err)
	}
	n := 0
	for _, r := range fx.Rows {
		if r.InLog {
			n++
		}
	}
	fmt.Printf("%d keys, %d only in the log, %d deleted by it; revision %d, checkpoint %d\n",
		len(fx.Rows), n, len(fx.DeletedInLog), fx.Revision, fx.Checkpoint)
}

// pending is the number of commits in the log: the store's revision less
// the checkpoint's.
func pending(path string, st *local.Store) int64 {
	fx := dump(path, st)
	return fx.Revision - fx.Checkpoint
}

// dump reads every key through the store, and the bbolt file as it is.
func dump(path string, st *local.Store) fixture {
	kvs, err := st.Scan(context.Background(), "", "\xff", 0)
	if err != nil {
		log.Fatal(err)
	}
	file := map[string][]byte{}
	var fx fixture
	db, err := bolt.Open(path, 0o600, &bolt.Options{ReadOnly: true})
	if err != nil {
		log.Fatal(err)
	}
	err = db.View(func(tx *bolt.Tx) error {
		rev := tx.Bucket([]byte("meta")).Get([]byte("rev"))
		if len(rev) != 16 {
			return fmt.Errorf("revision counter of %d bytes, want 16 (with the log's anchor)", len(rev))
		}
		fx.Checkpoint = int64(binary.BigEndian.Uint64(rev))
		return tx.Bucket([]byte("kv")).ForEach(func(k, v []byte) error {
			file[string(k)] = append([]byte(nil), v...)
			return nil
		})
	})
	if cerr := db.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		log.Fatal(err)
	}
	fx.Revision = fx.Checkpoint
	seen := map[string]bool{}
	for _, kv := range kvs {
		// The file's value: 8 bytes of revision, then the value.
		v, ok := file[kv.Key]
		inLog := !ok || int64(binary.BigEndian.Uint64(v)) != kv.Revision || string(v[8:]) != string(kv.Value)
		fx.Rows = append(fx.Rows, row{Key: kv.Key, Value: string(kv.Value), Revision: kv.Revision, InLog: inLog})
		fx.Revision = max(fx.Revision, kv.Revision)
		seen[kv.Key] = true
	}
	fx.DeletedInLog = []string{}
	for k := range file {
		if !seen[k] {
			fx.DeletedInLog = append(fx.DeletedInLog, k)
		}
	}
	sort.Strings(fx.DeletedInLog)
	return fx
}
