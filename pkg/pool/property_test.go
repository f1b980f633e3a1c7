package pool

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/ringipam/ringipam/pkg/hostlock"
	"github.com/ringipam/ringipam/pkg/retry"
	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/memory"
)

var propSeed = flag.Uint64("pool.seed", 0, "replay the property tests with this seed (0: a new random seed)")

// propertySeed is -pool.seed, or a new random seed.
func propertySeed() uint64 {
	if *propSeed != 0 {
		return *propSeed
	}
	return uint64(time.Now().UnixNano())
}

// propertyConfig sizes a random concurrent run.
type propertyConfig struct {
	hosts, workers, steps int
	seed                  uint64
	// notes gives each host's workers the notes of its lock directory
	// (WithNotes), as ipam-ring's processes share them.
	notes bool
}

// liveSet mirrors which owner holds which address, as seen by the workers.
// An address is removed before its release is sent, so the set is always a
// subset of what the store holds and a double hand-out is always caught.
type liveSet struct {
	mu   sync.Mutex
	held map[netip.Addr]string
}

func (l *liveSet) add(addr netip.Addr, owner string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if prev, ok := l.held[addr]; ok && prev != owner {
		return fmt.Errorf("%s handed to %s while %s holds it", addr, owner, prev)
	}
	l.held[addr] = owner
	return nil
}

func (l *liveSet) drop(addr netip.Addr) {
	l.mu.Lock()
	defer l.mu.Unlock()
	delete(l.held, addr)
}

// runProperty drives random allocate / release / static-request sequences
// from cfg.hosts simulated hosts with cfg.workers goroutines each, then
// checks the pool's invariants.
func runProperty(t *testing.T, st store.Store, def Def, cfg propertyConfig) {
	t.Helper()
	t.Logf("seed %d (replay with -pool.seed=%d): %d hosts x %d workers x %d steps on %s", cfg.seed, cfg.seed, cfg.hosts, cfg.workers, cfg.steps, def.Ranges[0].Subnet)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	// Every worker has its own Allocator, as separate CNI processes on one
	// host would: they coordinate only through the store.
	var hosts [][]*Allocator
	for h := range cfg.hosts {
		var workers []*Allocator
		lockDir := hostlock.Dir(t.TempDir())
		for range cfg.workers {
			// The plugin's contention policy: 32 workers starting at once
			// on a fresh ring all claim in their first step.
			opts := []Option{WithHostLock(lockDir),
				WithRetry(retry.Policy{Attempts: 50, BaseDelay: time.Millisecond, MaxDelay: 80 * time.Millisecond})}
			if cfg.notes {
				opts = append(opts, WithNotes(lockDir))
			}
			a, err := New(st, fmt.Sprintf("host-%d", h), opts...)
			if err != nil {
				t.Fatal(err)
			}
			if err := a.Define(ctx, def); err != nil {
				t.Fatal(err)
			}
			workers = append(workers, a)
		}
		hosts = append(hosts, workers)
	}
	norm, _ := def.Normalize()
	segs := segmentsOf(norm)
	live := &liveSet{held: map[netip.Addr]string{}}
	errs := make(chan error, cfg.hosts*cfg.workers)
	var wg sync.WaitGroup
	for h, workers := range hosts {
		for w, a := range workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				rng := rand.New(rand.NewPCG(cfg.seed, uint64(h*1000+w)))
				var mine []Owner
				for step := range cfg.steps {
					if err := propertyStep(ctx, a, rng, live, segs, norm, &mine, fmt.Sprintf("h%dw%ds%d", h, w, step)); err != nil {
						errs <- fmt.Errorf("host %s worker %d step %d: %w", a.Host(), w, step, err)
						return
					}
				}
			}()
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	var conflicts, onNotes, notesWrong int64
	for _, workers := range hosts {
		for _, a := range workers {
			conflicts += a.Stats().Conflicts
			onNotes += a.Stats().OnNotes
			notesWrong += a.Stats().NotesWrong
		}
	}
	t.Logf("store conflicts retried: %d; allocations on notes: %d, on wrong notes: %d", conflicts, onNotes, notesWrong)
	if cfg.notes && (onNotes == 0 || notesWrong == 0) {
		t.Errorf("with notes: %d allocations on notes and %d on wrong ones; the run exercised neither or only one", onNotes, notesWrong)
	}
	bad, err := hosts[0][0].Check(ctx, def.Name)
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range bad {
		t.Errorf("invariant: %s", b)
	}
	r, err := hosts[0][0].RingOf(ctx, def.Name)
	if err != nil {
		t.Fatal(err)
	}
	if err := checkCoverage(r, segs, norm.is4()); err != nil {
		t.Error(err)
	}
}

func propertyStep(ctx context.Context, a *Allocator, rng *rand.Rand, live *liveSet, segs []span, def Def, mine *[]Owner, id string) error {
	switch op := rng.IntN(10); {
	case op < 5 || len(*mine) == 0: // dynamic allocation
		o := Owner{Kind: KindCNI, Network: "prop", ContainerID: id, IfName: "eth0"}
		al, err := a.Allocate(ctx, Request{Owner: o, Wants: []Want{{Pool: def.Name, Role: RoleIP}}})
		if errors.Is(err, ErrNoCapacity) {
			return nil
		}
		if err != nil {
			return err
		}
		*mine = append(*mine, o)
		return live.add(al.Addrs[0].Addr, o.String())
	case op < 7: // static request for a random address of the pool
		s := segs[rng.IntN(len(segs))]
		off := s.size()
		if off.hi != 0 || off.lo > 1<<20 {
			off = u128{lo: 1 << 20}
		}
		addr := s.lo.add(u128{lo: rng.Uint64N(off.lo)}).addr(def.is4())
		o := Owner{Kind: KindCNI, Network: "prop", ContainerID: id, IfName: "eth0"}
		al, err := a.Allocate(ctx, Request{Owner: o, Wants: []Want{{Pool: def.Name, Role: RoleIP, Addr: addr}}})
		var inUse *InUseError
		if errors.As(err, &inUse) {
			return nil
		}
		if err != nil {
			return err
		}
		if al.Addrs[0].Addr != addr {
			return fmt.Errorf("asked for %s, got %s", addr, al.Addrs[0].Addr)
		}
		*mine = append(*mine, o)
		return live.add(addr, o.String())
	default: // release one of mine
		i := rng.IntN(len(*mine))
		o := (*mine)[i]
		*mine = append((*mine)[:i], (*mine)[i+1:]...)
		cur, ok, err := a.Lookup(ctx, o)
		if err != nil {
			return err
		}
		if !ok {
			return fmt.Errorf("owner %s lost its allocation", o)
		}
		live.drop(cur.Addrs[0].Addr)
		_, ok, err = a.Release(ctx, o)
		if err == nil && !ok {
			return fmt.Errorf("release of %s found nothing", o)
		}
		return err
	}
}

// checkCoverage verifies the ranges as exported: contiguous, from the first
// to the last allocatable address, no overlap, no gap.
func checkCoverage(r Ring, segs []span, is4 bool) error {
	if len(r.Ranges) == 0 {
		return fmt.Errorf("ring has no ranges")
	}
	if r.Ranges[0].Start != segs[0].lo.addr(is4) {
		return fmt.Errorf("first range starts at %s, pool at %s", r.Ranges[0].Start, segs[0].lo.addr(is4))
	}
	if last := r.Ranges[len(r.Ranges)-1].End; last != segs[len(segs)-1].hi.addr(is4) {
		return fmt.Errorf("last range ends at %s, pool at %s", last, segs[len(segs)-1].hi.addr(is4))
	}
	for i := 1; i < len(r.Ranges); i++ {
		if r.Ranges[i-1].End.Next() != r.Ranges[i].Start {
			return fmt.Errorf("gap or overlap between %+v and %+v", r.Ranges[i-1], r.Ranges[i])
		}
	}
	return nil
}

func TestPropertyMemory(t *testing.T) {
	seed := propertySeed()
	for _, tc := range []struct {
		name  string
		def   Def
		notes bool
	}{
		{"small-v4", v4Def("small", "198.18.0.0/26"), false},
		{"v4", v4Def("v4", "198.18.0.0/22"), false},
		{"v6", Def{Name: "v6", Ranges: []Range{{Subnet: mustPrefix("2001:db8::/120")}}}, false},
		{"small-v4-notes", v4Def("small", "198.18.0.0/26"), true},
		{"v4-notes", v4Def("v4", "198.18.0.0/22"), true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			runProperty(t, memory.New(), tc.def, propertyConfig{hosts: 4, workers: 8, steps: 60, seed: seed, notes: tc.notes})
		})
	}
}

// TestCheckCatchesBrokenState proves the invariant checker can fail: each
// case corrupts a consistent state in one way the property test guards.
func TestCheckCatchesBrokenState(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name    string
		corrupt func(st *memory.Store, a *Allocator)
	}{
		{"address held by two owners", func(st *memory.Store, a *Allocator) {
			kv, _ := st.Get(ctx, ownerKey(own("c1")))
			var rec Allocation
			_ = json.Unmarshal(kv[0].Value, &rec)
			rec.Owner = own("intruder")
			b, _ := json.Marshal(rec)
			_ = st.Commit(ctx, nil, []store.Op{store.Put(ownerKey(own("intruder")), b)})
		}},
		{"allocation outside its host's ranges", func(st *memory.Store, a *Allocator) {
			def, r := readTestRing(t, st, "p")
			r.tokens = []token{{Start: mustAddr("198.18.0.1"), Host: "someone-else"}}
			putRing(t, st, def, r, nil)
		}},
		{"overlapping ranges", func(st *memory.Store, a *Allocator) {
			// A range of h2 inside h1's.
			s := span{toU128(mustAddr("198.18.0.1")), toU128(mustAddr("198.18.0.2"))}
			_ = st.Commit(ctx, nil, []store.Op{store.Put(rangeKey("p", s.hi, true), rangeKV{span: s, host: "h2"}.encode(true))})
		}},
		{"used count drift", func(st *memory.Store, a *Allocator) {
			_ = st.Commit(ctx, nil, []store.Op{store.Delete(addrKey("p", toU128(mustAddr("198.18.0.1")), true))})
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st := memory.New()
			a, _ := New(st, "h1")
			if err := a.Define(ctx, v4Def("p", "198.18.0.0/24")); err != nil {
				t.Fatal(err)
			}
			if _, err := a.Allocate(ctx, Request{Owner: own("c1"), Wants: ipWant("p")}); err != nil {
				t.Fatal(err)
			}
			if bad, err := a.Check(ctx, "p"); err != nil || len(bad) != 0 {
				t.Fatalf("consistent state reported %v %v", bad, err)
			}
			tc.corrupt(st, a)
			bad, err := a.Check(ctx, "p")
			if err != nil {
				t.Fatal(err)
			}
			if len(bad) == 0 {
				t.Fatal("checker found nothing wrong")
			}
			t.Logf("checker said: %v", bad)
		})
	}
}
