//go:build integration

package etcd_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ringipam/ringipam/internal/testenv"
	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/etcd"
	"github.com/ringipam/ringipam/pkg/store/storetest"
)

var prefixSeq atomic.Int64

// uniquePrefix gives every subtest its own empty key space on one server.
func uniquePrefix() string { return fmt.Sprintf("/t%d/", prefixSeq.Add(1)) }

func open(t testing.TB, srv *testenv.Etcd, prefix string) *etcd.Store {
	t.Helper()
	s, err := etcd.New(etcd.Config{Endpoints: srv.Endpoints(), Prefix: prefix, DialTimeout: 5 * time.Second, RequestTimeout: 30 * time.Second})
	if err != nil {
		t.Fatalf("etcd.New: %v", err)
	}
	return s
}

func TestContract(t *testing.T) {
	srv := testenv.StartEtcd(t)
	storetest.Run(t,
		func(t *testing.T) store.Store { return open(t, srv, uniquePrefix()) },
		storetest.Persistent(func(t *testing.T) func(t *testing.T) store.Store {
			p := uniquePrefix()
			return func(t *testing.T) store.Store { return open(t, srv, p) }
		}))
}

// Keys live under the prefix and nowhere else; two prefixes never meet.
func TestPrefixIsolation(t *testing.T) {
	srv := testenv.StartEtcd(t)
	ctx := context.Background()
	a, b := open(t, srv, "/a/"), open(t, srv, "/a/b/")
	defer a.Close()
	defer b.Close()
	if err := b.Commit(ctx, nil, []store.Op{store.Put("k", []byte("in b"))}); err != nil {
		t.Fatal(err)
	}
	if err := a.Commit(ctx, nil, []store.Op{store.Put("k", []byte("in a"))}); err != nil {
		t.Fatal(err)
	}
	kvs, err := b.Scan(ctx, "", "\xff", 0)
	if err != nil || len(kvs) != 1 || kvs[0].Key != "k" || string(kvs[0].Value) != "in b" {
		t.Fatalf("b sees %+v, %v", kvs, err)
	}
	resp, err := a.Client().Get(ctx, "/a/", clientv3.WithPrefix(), clientv3.WithKeysOnly())
	if err != nil {
		t.Fatal(err)
	}
	var raw []string
	for _, kv := range resp.Kvs {
		raw = append(raw, string(kv.Key))
	}
	if strings.Join(raw, ",") != "/a/b/k,/a/k" {
		t.Errorf("raw keys %v", raw)
	}
	def, err := etcd.New(etcd.Config{Endpoints: srv.Endpoints()})
	if err != nil {
		t.Fatal(err)
	}
	defer def.Close()
	if def.Prefix() != "/ringipam/" {
		t.Errorf("default prefix %q", def.Prefix())
	}
}

// A server that goes away is ErrUnavailable naming the endpoints, not
// "absent"; when it comes back, the data and the client work again.
func TestServerDownAndBack(t *testing.T) {
	srv := testenv.StartEtcd(t)
	ctx := context.Background()
	s, err := etcd.New(etcd.Config{Endpoints: srv.Endpoints(), Prefix: "/down/", DialTimeout: time.Second, RequestTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := s.Commit(ctx, []store.Cond{{Key: "k"}}, []store.Op{store.Put("k", []byte("v"))}); err != nil {
		t.Fatal(err)
	}
	srv.Stop()
	calls := map[string]func() error{
		"Get":    func() error { _, err := s.Get(ctx, "k"); return err },
		"Scan":   func() error { _, err := s.Scan(ctx, "", "\xff", 0); return err },
		"Commit": func() error { return s.Commit(ctx, nil, []store.Op{store.Put("x", nil)}) },
		"Ping":   func() error { return s.Ping(ctx) },
	}
	for name, call := range calls {
		err := call()
		if !errors.Is(err, store.ErrUnavailable) {
			t.Errorf("%s with server down: err = %v, want ErrUnavailable", name, err)
		} else if !strings.Contains(err.Error(), srv.Endpoints()[0]) {
			t.Errorf("%s: error %q does not name the endpoint", name, err)
		}
	}
	srv.Start()
	// The client reconnects on its own; give it a bounded number of tries.
	var kvs []store.KV
	for attempt := 0; attempt < 30; attempt++ {
		if kvs, err = s.Get(ctx, "k", "x"); err == nil {
			break
		}
	}
	if err != nil {
		t.Fatalf("Get after restart: %v", err)
	}
	if string(kvs[0].Value) != "v" || kvs[1].Exists() {
		t.Fatalf("after restart: %+v", kvs)
	}
	if err := s.Ping(ctx); err != nil {
		t.Fatalf("Ping after restart: %v", err)
	}
}

// Scans larger than one page come back whole and in order.
func TestLargeScan(t *testing.T) {
	srv := testenv.StartEtcd(t)
	s := open(t, srv, "/big/")
	defer s.Close()
	ctx := context.Background()
	const n = 2500
	for i := 0; i < n; i += store.MaxOps {
		var ops []store.Op
		for j := i; j < min(i+store.MaxOps, n); j++ {
			ops = append(ops, store.Put(fmt.Sprintf("k%05d", j), []byte("v")))
		}
		if err := s.Commit(ctx, nil, ops); err != nil {
			t.Fatal(err)
		}
	}
	for _, limit := range []int{0, 1, 999, 1000, 1001, 2499, 2500, 5000} {
		kvs, err := s.Scan(ctx, "", "\xff", limit)
		if err != nil {
			t.Fatal(err)
		}
		want := n
		if limit > 0 && limit < n {
			want = limit
		}
		if len(kvs) != want {
			t.Fatalf("Scan limit %d: %d keys, want %d", limit, len(kvs), want)
		}
		for i, kv := range kvs {
			if kv.Key != fmt.Sprintf("k%05d", i) {
				t.Fatalf("Scan limit %d: key %d is %q", limit, i, kv.Key)
			}
		}
	}
}

func BenchmarkCommit(b *testing.B) {
	srv := testenv.StartEtcd(b)
	s := open(b, srv, "/bench/")
	defer s.Close()
	storetest.BenchmarkCommit(b, s)
}

func BenchmarkGetCommit(b *testing.B) {
	srv := testenv.StartEtcd(b)
	s := open(b, srv, "/bench/")
	defer s.Close()
	storetest.BenchmarkGetCommit(b, s)
}
