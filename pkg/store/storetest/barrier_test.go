package storetest_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/memory"
	"github.com/ringipam/ringipam/pkg/store/storetest"
)

// Three create-if-absent commits of one key held at the barrier: all three
// read the key absent, so exactly one commits and two conflict. A commit
// that does not match passes at once; a lone waiter gives up with its
// context.
func TestBarrier(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	b := storetest.NewBarrier(memory.New(), 3, storetest.Writing("k"))
	if err := b.Commit(ctx, nil, []store.Op{store.Put("other", []byte("x"))}); err != nil || b.Arrived() != 0 {
		t.Fatalf("a commit that does not match: %v, %d arrived", err, b.Arrived())
	}
	errs := make([]error, 3)
	var wg sync.WaitGroup
	for i := range errs {
		wg.Go(func() {
			kvs, err := b.Get(ctx, "k")
			if err == nil {
				err = b.Commit(ctx, []store.Cond{store.Unchanged(kvs[0])}, []store.Op{store.Put("k", []byte{byte(i)})})
			}
			errs[i] = err
		})
	}
	wg.Wait()
	won := 0
	for _, err := range errs {
		switch {
		case err == nil:
			won++
		case !errors.Is(err, store.ErrConflict):
			t.Errorf("commit: %v", err)
		}
	}
	if won != 1 {
		t.Fatalf("%d of 3 commits won (%v), want 1", won, errs)
	}
	lone := storetest.NewBarrier(memory.New(), 2, nil)
	short, stop := context.WithCancel(ctx)
	stop()
	if err := lone.Commit(short, nil, []store.Op{store.Put("k", nil)}); !errors.Is(err, context.Canceled) {
		t.Fatalf("a lone commit at a barrier of 2 with its context ended: %v", err)
	}
}

// InOrder: three commits that all read first go on in rank order, whatever
// order they arrived in; each sees the one before it as written.
func TestBarrierInOrder(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	st := memory.New()
	b := storetest.NewBarrier(st, 3, nil).InOrder(func(ops []store.Op) int { return int(ops[0].Value[0]) })
	errs := make([]error, 3)
	var wg sync.WaitGroup
	for i, rank := range []byte{2, 0, 1} {
		wg.Go(func() {
			errs[i] = b.Commit(ctx, nil, []store.Op{store.Put("k", []byte{rank}), store.Put(fmt.Sprint("at/", rank), nil)})
		})
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	kvs, err := st.Scan(ctx, "at/", "at0", 0)
	if err != nil || len(kvs) != 3 {
		t.Fatalf("scan: %v, %v", kvs, err)
	}
	for i := 1; i < 3; i++ {
		if kvs[i-1].Revision >= kvs[i].Revision {
			t.Errorf("rank %s committed at revision %d, rank %s at %d: want rank order", kvs[i-1].Key, kvs[i-1].Revision, kvs[i].Key, kvs[i].Revision)
		}
	}
}
