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

// countingLocker is a HostLocker that counts the locks taken.
type countingLocker struct{ locks []string }

func (l *countingLocker) Lock(_ context.Context, name string) (func(), error) {
	l.locks = append(l.locks, name)
	return func() {}, nil
}

// A store that can be held is the cross-process lock itself: no host lock
// is taken on top of the hold. Any other store takes the host lock of each
// pool.
func TestHostLockOnlyForStoresThatCannotBeHeld(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name      string
		st        store.Store
		wantLocks int
	}{
		{"holdable", &holdingStore{Store: memory.New()}, 0},
		{"not holdable", memory.New(), 2}, // the allocation's and the release's
	} {
		t.Run(tc.name, func(t *testing.T) {
			lk := &countingLocker{}
			a, err := New(tc.st, "h1", WithHostLock(lk))
			if err != nil {
				t.Fatal(err)
			}
			if err := a.Define(ctx, v4Def("p", "198.18.0.0/29")); err != nil {
				t.Fatal(err)
			}
			lk.locks = nil
			if _, err := a.Allocate(ctx, Request{Owner: own("c1"), Wants: ipWant("p")}); err != nil {
				t.Fatal(err)
			}
			if _, ok, err := a.ReleaseWith(ctx, own("c1"), ReleaseHint{Pools: []string{"p"}}); err != nil || !ok {
				t.Fatalf("release: %v %v", ok, err)
			}
			if len(lk.locks) != tc.wantLocks {
				t.Fatalf("host locks taken: %v, want %d", lk.locks, tc.wantLocks)
			}
			for _, n := range lk.locks {
				if n != "p@h1" {
					t.Fatalf("host lock %q, want p@h1", n)
				}
			}
		})
	}
}
