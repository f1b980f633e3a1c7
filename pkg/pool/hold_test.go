package pool

import (
	"context"
	"errors"
	"testing"

	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/memory"
)

// holdingStore is a store that can be held (storeHolder); it records
// whether each call came while held, and can refuse to be held.
type holdingStore struct {
	store.Store
	held, holds int
	outside     []string // calls made while not held
	refuse      error
}

func (s *holdingStore) Hold(ctx context.Context) (func(), error) {
	if s.refuse != nil {
		return nil, s.refuse
	}
	s.held++
	s.holds++
	return func() { s.held-- }, nil
}

func (s *holdingStore) note(op string) {
	if s.held == 0 {
		s.outside = append(s.outside, op)
	}
}

func (s *holdingStore) Get(ctx context.Context, keys ...string) ([]store.KV, error) {
	s.note("Get")
	return s.Store.Get(ctx, keys...)
}

func (s *holdingStore) Scan(ctx context.Context, from, to string, limit int) ([]store.KV, error) {
	s.note("Scan")
	return s.Store.Scan(ctx, from, to, limit)
}

func (s *holdingStore) Commit(ctx context.Context, conds []store.Cond, ops []store.Op) error {
	s.note("Commit")
	return s.Store.Commit(ctx, conds, ops)
}

// An allocation and a release told its pools (as the plugins' DEL is) hold
// the store around all their calls (one open of the local store's file
// instead of one per call), and let go of it when done; a store that cannot
// be held fails the call, nothing written.
func TestAllocateAndReleaseHoldTheStore(t *testing.T) {
	ctx := context.Background()
	st := &holdingStore{Store: memory.New()}
	a, err := New(st, "h1")
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Define(ctx, v4Def("p", "198.18.0.0/29")); err != nil {
		t.Fatal(err)
	}
	st.outside, st.holds = nil, 0
	if _, err := a.Allocate(ctx, Request{Owner: own("c1"), Wants: ipWant("p")}); err != nil {
		t.Fatal(err)
	}
	if _, ok, err := a.ReleaseWith(ctx, own("c1"), ReleaseHint{Pools: []string{"p"}}); err != nil || !ok {
		t.Fatalf("release: %v %v", ok, err)
	}
	if st.holds != 2 || st.held != 0 || len(st.outside) != 0 {
		t.Fatalf("holds %d, still held %d, calls outside a hold %v; want 2, 0, none", st.holds, st.held, st.outside)
	}

	st.refuse = errors.Join(store.ErrUnavailable, errors.New("file locked elsewhere"))
	if _, err := a.Allocate(ctx, Request{Owner: own("c2"), Wants: ipWant("p")}); !errors.Is(err, store.ErrUnavailable) {
		t.Fatalf("allocate on a store that cannot be held: %v, want ErrUnavailable", err)
	}
	st.refuse = nil
	if got, ok, err := a.Lookup(ctx, own("c2")); err != nil || ok {
		t.Fatalf("after a refused allocation: %v %v %v, want nothing held", got, ok, err)
	}
}
