package pool

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/memory"
	"github.com/ringipam/ringipam/pkg/store/storetest"
)

// errCrashed is what every call of a crashedStore returns.
var errCrashed = errors.New("the process died")

// crashingStore stands for a process that dies right after a commit
// matching crash succeeds: every later call of this handle fails, so
// nothing the process would have done next happens.
type crashingStore struct {
	store.Store
	crash   func(ops []store.Op) bool
	crashed atomic.Bool
}

func (s *crashingStore) Get(ctx context.Context, keys ...string) ([]store.KV, error) {
	if s.crashed.Load() {
		return nil, errCrashed
	}
	return s.Store.Get(ctx, keys...)
}

func (s *crashingStore) Scan(ctx context.Context, from, to string, limit int) ([]store.KV, error) {
	if s.crashed.Load() {
		return nil, errCrashed
	}
	return s.Store.Scan(ctx, from, to, limit)
}

func (s *crashingStore) Commit(ctx context.Context, conds []store.Cond, ops []store.Op) error {
	if s.crashed.Load() {
		return errCrashed
	}
	err := s.Store.Commit(ctx, conds, ops)
	if err == nil && s.crash(ops) {
		s.crashed.Store(true)
	}
	return err
}

// runClaimRace races a live donor's allocation into the space an asker's
// claim takes from it: both read the store before either commits
// (storetest.Barrier on the commits that write an address key), and the
// donor's commit lands first (the order in which, without a condition on
// the claimed addresses, both commits hold). The asker's process then dies
// right after its claim commits, so no step of its own after the commit
// runs. Every allocation must still lie in a range its host owns: Audit
// finds nothing.
//
// The donor's allocation is a static one (its dynamic ones go to the
// lower half of a hole, the claim takes the upper half). Two claims from a
// live donor: the upper half of its largest free hole, and a range of it
// that holds no address, given whole.
func runClaimRace(t *testing.T, open func(t *testing.T) store.Store) {
	for _, tc := range []struct {
		name   string
		setup  func(ctx context.Context, t *testing.T, st store.Store)
		asked  string // the donor's static address, in the space claimed
		claims string // the asker's address, claimed again after the race
	}{
		{
			// The donor holds .1 of .1-.14: the hole .2-.14, whose upper
			// half .8-.14 the asker claims. After the race the hole is
			// .2-.13, and its upper half starts at .8 again.
			name:   "upper half of a hole",
			setup:  func(context.Context, *testing.T, store.Store) {},
			asked:  "198.18.0.14",
			claims: "198.18.0.8",
		},
		{
			// Host x takes .8 statically: the donor keeps .1-.7 (holding
			// .1) and .9-.14, which holds no address and is given whole.
			// After the race no range is empty: the largest hole is
			// .2-.7, whose upper half starts at .5.
			name: "a range holding no address, whole",
			setup: func(ctx context.Context, t *testing.T, st store.Store) {
				x, err := New(st, "x")
				if err != nil {
					t.Fatal(err)
				}
				if _, err := x.Allocate(ctx, Request{Owner: own("x"), Wants: []Want{{Pool: "p", Role: RoleIP, Addr: mustAddr("198.18.0.8")}}}); err != nil {
					t.Fatal(err)
				}
			},
			asked:  "198.18.0.14",
			claims: "198.18.0.5",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			st := open(t)
			def := v4Def("p", "198.18.0.0/28") // .1-.14
			setup, err := New(st, "donor")
			if err != nil {
				t.Fatal(err)
			}
			if err := setup.Define(ctx, def); err != nil {
				t.Fatal(err)
			}
			// The donor's first allocation claims the whole ring.
			if got, err := setup.Allocate(ctx, Request{Owner: own("d0"), Wants: ipWant("p")}); err != nil || got.Addrs[0].Addr != mustAddr("198.18.0.1") {
				t.Fatalf("the donor's first allocation: %v, %v", got, err)
			}
			tc.setup(ctx, t, st)

			writesRing := func(ops []store.Op) bool {
				for _, o := range ops {
					if strings.HasPrefix(o.Key, rangePrefix("p")) {
						return true
					}
				}
				return false
			}
			b := storetest.NewBarrier(st, 2, storetest.Writing(prefixAddr)).InOrder(func(ops []store.Op) int {
				if writesRing(ops) {
					return 1 // the claim lands second
				}
				return 0
			})
			donor, err := New(b, "donor")
			if err != nil {
				t.Fatal(err)
			}
			asker, err := New(&crashingStore{Store: b, crash: writesRing}, "asker")
			if err != nil {
				t.Fatal(err)
			}
			var wg sync.WaitGroup
			var donorGot, askerGot Allocation
			var donorErr, askerErr error
			wg.Go(func() {
				donorGot, donorErr = donor.Allocate(ctx, Request{Owner: own("d1"), Wants: []Want{{Pool: "p", Role: RoleIP, Addr: mustAddr(tc.asked)}}})
			})
			wg.Go(func() { askerGot, askerErr = asker.Allocate(ctx, Request{Owner: own("a1"), Wants: ipWant("p")}) })
			wg.Wait()
			if n := b.Arrived(); n != 2 {
				t.Fatalf("%d commits reached the barrier, want 2 (donor: %v, asker: %v)", n, donorErr, askerErr)
			}
			if donorErr != nil || askerErr != nil {
				t.Fatalf("donor: %v, %v; asker: %v, %v", donorGot, donorErr, askerGot, askerErr)
			}
			if got := donorGot.Addrs[0].Addr; got != mustAddr(tc.asked) {
				t.Errorf("the donor got %s, want %s", got, tc.asked)
			}
			if got := askerGot.Addrs[0].Addr; got != mustAddr(tc.claims) {
				t.Errorf("the asker got %s, want %s", got, tc.claims)
			}
			checker, err := New(st, "checker")
			if err != nil {
				t.Fatal(err)
			}
			v, err := checker.Audit(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if len(v) != 0 {
				r, _ := checker.RingOf(ctx, "p")
				t.Errorf("after the race, with the asker's process dead after its commit: %v (ring %+v)", v, r)
			}
			// The asker's claim met the donor's allocation: its first
			// commit was refused, and it claimed again from what it read
			// then.
			if c := asker.Stats().Conflicts; c < 1 {
				t.Errorf("the asker saw %d conflicts, want at least 1: its claim was not refused after the donor's allocation", c)
			}
		})
	}
}

func TestClaimRaceMemory(t *testing.T) {
	runClaimRace(t, func(*testing.T) store.Store { return memory.New() })
}

// commitLog records a store's calls, and the conditions of its commits.
type commitLog struct {
	store.Store
	mu    sync.Mutex
	calls []string
	conds [][]store.Cond
}

func (c *commitLog) log(what string, conds []store.Cond) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.calls = append(c.calls, what)
	if what == "commit" {
		c.conds = append(c.conds, conds)
	}
}

func (c *commitLog) Get(ctx context.Context, keys ...string) ([]store.KV, error) {
	c.log("get", nil)
	return c.Store.Get(ctx, keys...)
}

func (c *commitLog) Scan(ctx context.Context, from, to string, limit int) ([]store.KV, error) {
	c.log("scan", nil)
	return c.Store.Scan(ctx, from, to, limit)
}

func (c *commitLog) Commit(ctx context.Context, conds []store.Cond, ops []store.Op) error {
	c.log("commit", conds)
	return c.Store.Commit(ctx, conds, ops)
}

// A claim from a live donor is the allocation's one commit, and its last
// store call: no step follows it (there is nothing left to hand back), and
// the condition that the space given holds no address rides that commit.
func TestClaimFromALiveDonorIsOneCommit(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	st := memory.New()
	donor, err := New(st, "donor")
	if err != nil {
		t.Fatal(err)
	}
	def := v4Def("p", "198.18.0.0/28") // .1-.14
	if _, err := donor.Allocate(ctx, Request{Owner: own("d0"), Wants: ipWant("p"), Defs: []Def{def}}); err != nil {
		t.Fatal(err)
	}
	log := &commitLog{Store: st}
	asker, err := New(log, "asker")
	if err != nil {
		t.Fatal(err)
	}
	got, err := asker.Allocate(ctx, Request{Owner: own("a0"), Wants: ipWant("p"), Defs: []Def{def}})
	if err != nil || got.Addrs[0].Addr != mustAddr("198.18.0.8") {
		t.Fatalf("the asker's allocation: %v, %v; want 198.18.0.8 (the upper half of the donor's hole)", got, err)
	}
	if n := len(log.calls); n == 0 || log.calls[n-1] != "commit" || len(log.conds) != 1 {
		t.Fatalf("the asker's store calls: %v; want one commit, the last call", log.calls)
	}
	want := store.AbsentRange(addrKey("p", toU128(mustAddr("198.18.0.8")), true), addrKey("p", toU128(mustAddr("198.18.0.14")), true)+"\x00")
	if !slices.Contains(log.conds[0], want) {
		t.Errorf("the claim's commit requires %v; want among them %+v (no address of .8-.14 held)", log.conds[0], want)
	}
}
