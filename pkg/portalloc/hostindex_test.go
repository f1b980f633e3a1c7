package portalloc

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/memory"
)

// returning is a store whose n-th commit (counted from arm) first lets the
// gone host come back: its liveness key is written between the sweep's
// reads and its commit, as an agent starting again would write it.
type returning struct {
	store.Store
	mu      sync.Mutex
	armed   bool
	commits int
	at      int // the commit, from 1, before which the host returns
	key     string
	fired   bool
}

func (r *returning) Commit(ctx context.Context, conds []store.Cond, ops []store.Op) error {
	r.mu.Lock()
	fire := false
	if r.armed {
		r.commits++
		fire = r.commits == r.at && !r.fired
		r.fired = r.fired || fire
	}
	r.mu.Unlock()
	if fire {
		if err := r.Store.Commit(ctx, nil, []store.Op{store.Put(r.key, []byte(`{}`))}); err != nil {
			return err
		}
	}
	return r.Store.Commit(ctx, conds, ops)
}

// runHostReturnsMidSweep: host "gone" publishes 3 endpoints' ports and
// another host sweeps it with pool's reclaim guard; the host comes back
// (its liveness key appears) after the sweep read the guard, just before
// the sweep's k-th release commit. The sweep releases exactly the k-1
// endpoints it committed before, stops with ErrGuard, and the host keeps
// every other port.
func runHostReturnsMidSweep(t *testing.T, open func(t *testing.T) store.Store) {
	for _, at := range []int{1, 2} {
		t.Run(fmt.Sprintf("back before release %d", at), func(t *testing.T) {
			ctx := context.Background()
			st := &returning{Store: open(t), at: at, key: pool.LivenessKey("gone")}
			gone, _ := New(st, "gone")
			sweeper, _ := New(st, "sweeper")
			var ids []EndpointID
			for i := range 3 {
				id := ep(fmt.Sprint("c", i))
				ids = append(ids, id)
				if _, err := gone.Allocate(ctx, id, []Port{{Mode: Ingress, Protocol: "tcp", Number: uint16(8000 + i)}, {Mode: Host, Protocol: "udp", Number: uint16(9000 + i)}}); err != nil {
					t.Fatal(err)
				}
			}
			pa, err := pool.New(st, "sweeper")
			if err != nil {
				t.Fatal(err)
			}
			guard, err := pa.ReclaimGuard(ctx, "gone", false)
			if err != nil {
				t.Fatalf("guard of a host without a liveness key: %v", err)
			}
			// Read what the sweep will read before any commit of its own.
			if _, err := sweeper.HostEndpoints(ctx, "gone", ""); err != nil {
				t.Fatal(err)
			}
			st.mu.Lock()
			st.armed = true
			st.mu.Unlock()
			rel, err := sweeper.ReleaseHost(ctx, "gone", guard)
			if !st.fired {
				t.Fatalf("the host never came back: %d commits", st.commits)
			}
			if !errors.Is(err, ErrGuard) {
				t.Errorf("ReleaseHost after the host came back: %v, want ErrGuard", err)
			}
			if len(rel) != at-1 {
				t.Errorf("released %d endpoints (%+v) once the host was back before release %d; want %d", len(rel), rel, at, at-1)
			}
			for i, id := range ids {
				_, held, err := gone.Lookup(ctx, id)
				if err != nil {
					t.Fatal(err)
				}
				if want := i >= at-1; held != want {
					t.Errorf("endpoint %s held %v after the sweep, want %v", id, held, want)
				}
				if !held {
					continue
				}
				// Its ports are still its own: another host cannot take them.
				if _, err := sweeper.Allocate(ctx, ep("thief"), []Port{{Mode: Ingress, Protocol: "tcp", Number: uint16(8000 + i)}}); !errors.Is(err, ErrInUse) {
					t.Errorf("ingress %d of the returned host was free to take: %v", 8000+i, err)
				}
			}
			// And a guard is refused outright while the host is up.
			if _, err := pa.ReclaimGuard(ctx, "gone", false); !errors.Is(err, pool.ErrHostLive) {
				t.Errorf("guard of a live host: %v, want ErrHostLive", err)
			}
			assertIndexExact(t, sweeper)
		})
	}
}

func TestHostReturnsMidSweepKeepsItsPorts(t *testing.T) {
	runHostReturnsMidSweep(t, func(*testing.T) store.Store { return memory.New() })
}

// assertIndexExact fails unless every host's index of its endpoints matches
// the records.
func assertIndexExact(t *testing.T, a *Allocator) {
	t.Helper()
	entered, deleted, err := a.PlanReindex(context.Background())
	if err != nil || entered+deleted != 0 {
		t.Errorf("index of the hosts' endpoints: %d to enter, %d to delete (%v), want exact", entered, deleted, err)
	}
}

// keyCounter counts the keys reads return, and which prefixes they read.
type keyCounter struct {
	store.Store
	mu       sync.Mutex
	keysRead int
	scanned  []string
}

func (c *keyCounter) Get(ctx context.Context, keys ...string) ([]store.KV, error) {
	kvs, err := c.Store.Get(ctx, keys...)
	c.mu.Lock()
	c.keysRead += len(kvs)
	c.mu.Unlock()
	return kvs, err
}

func (c *keyCounter) Scan(ctx context.Context, from, to string, limit int) ([]store.KV, error) {
	kvs, err := c.Store.Scan(ctx, from, to, limit)
	c.mu.Lock()
	c.keysRead += len(kvs)
	c.scanned = append(c.scanned, from)
	c.mu.Unlock()
	return kvs, err
}

func (c *keyCounter) reset() {
	c.mu.Lock()
	c.keysRead, c.scanned = 0, nil
	c.mu.Unlock()
}

// The sweep of a gone host, and a host's GC listing, read only that host's
// endpoints: the same number of keys beside 0 and 300 endpoints of other
// hosts (before the index, ReleaseHost scanned every endpoint record).
func TestReleaseHostReadsOnlyTheGoneHostsEndpoints(t *testing.T) {
	ctx := context.Background()
	read := map[int][2]int{}
	for _, others := range []int{0, 300} {
		st := &keyCounter{Store: memory.New()}
		gone, _ := New(st, "gone")
		for i := range 4 {
			if _, err := gone.Allocate(ctx, ep(fmt.Sprint("g", i)), []Port{{Mode: Host, Protocol: "tcp", Number: uint16(7000 + i)}}); err != nil {
				t.Fatal(err)
			}
		}
		for i := range others {
			h, _ := New(st, fmt.Sprint("other-", i%3))
			if _, err := h.Allocate(ctx, ep(fmt.Sprint("o", i)), []Port{{Mode: Host, Protocol: "tcp", Number: uint16(20000 + i)}}); err != nil {
				t.Fatal(err)
			}
		}
		// The store's first reader of the index has built it (once per
		// store: the records were written with their index keys, and p/x
		// is written now). A fresh process then reads p/x once, like a
		// new agent.
		if _, err := gone.HostEndpoints(ctx, "nobody", ""); err != nil {
			t.Fatal(err)
		}
		sweeper, _ := New(st, "sweeper")
		st.reset()
		eps, err := sweeper.HostEndpoints(ctx, "gone", "net")
		if err != nil || len(eps) != 4 {
			t.Fatalf("with %d endpoints of other hosts: HostEndpoints %d %v, want 4", others, len(eps), err)
		}
		listed := st.keysRead
		st.reset()
		rel, err := sweeper.ReleaseHost(ctx, "gone", nil)
		if err != nil || len(rel) != 4 {
			t.Fatalf("with %d endpoints of other hosts: released %d %v, want 4", others, len(rel), err)
		}
		for _, p := range st.scanned {
			// The gone host's index, and the other hosts' bindings of its
			// ports (does another host keep the marker? a scan of a few keys).
			if !strings.HasPrefix(p, hostIndexPrefix("gone", "")) && !strings.HasPrefix(p, prefixHostBind+"tcp/0700") {
				t.Errorf("with %d endpoints of other hosts: the sweep scanned from %q, outside the gone host's index", others, p)
			}
		}
		read[others] = [2]int{listed, st.keysRead}
		assertIndexExact(t, sweeper)
	}
	if read[300] != read[0] {
		t.Errorf("keys read (HostEndpoints, ReleaseHost) beside 300 endpoints of other hosts %v, beside none %v: the sweep reads other hosts' endpoints", read[300], read[0])
	}
}

// Every commit keeps the index exact: publish, republish, move to another
// host, release.
func TestHostIndexFollowsTheRecords(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	a, _ := New(st, "h1")
	b, _ := New(st, "h2")
	spec := []Port{{Mode: Host, Protocol: "tcp", Number: 7000}}
	steps := []struct {
		name string
		do   func() error
		h1   int
		h2   int
	}{
		{"publish", func() error { _, err := a.Allocate(ctx, ep("x"), spec); return err }, 1, 0},
		{"republish", func() error {
			_, err := a.Allocate(ctx, ep("x"), append(spec, Port{Mode: Host, Protocol: "udp"}))
			return err
		}, 1, 0},
		{"another host takes the endpoint", func() error { _, err := b.Allocate(ctx, ep("x"), spec); return err }, 0, 1},
		{"release", func() error { _, err := b.Release(ctx, ep("x")); return err }, 0, 0},
	}
	for _, s := range steps {
		if err := s.do(); err != nil {
			t.Fatalf("%s: %v", s.name, err)
		}
		for host, want := range map[string]int{"h1": s.h1, "h2": s.h2} {
			got, err := a.HostEndpoints(ctx, host, "")
			if err != nil || len(got) != want {
				t.Errorf("after %s: %s has %d endpoints (%v), want %d", s.name, host, len(got), err, want)
			}
		}
		assertIndexExact(t, a)
	}
}

// A store written before the index existed (no p/i/, no p/x) gains it on
// first use: the sweep still finds the gone host's endpoints; and what an
// older writer adds after that is repaired by Reindex (ringctl gc).
func TestHostIndexIsBuiltOnFirstUse(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	gone, _ := New(st, "gone")
	other, _ := New(st, "other")
	for i, a := range []*Allocator{gone, gone, other} {
		if _, err := a.Allocate(ctx, ep(fmt.Sprint("e", i)), []Port{{Mode: Host, Protocol: "tcp", Number: uint16(7000 + i)}}); err != nil {
			t.Fatal(err)
		}
	}
	// Forget the index, as a store of the previous version has none.
	dropIndex := func() {
		kvs, err := st.Scan(ctx, "p/", store.PrefixEnd("p/"), 0)
		if err != nil {
			t.Fatal(err)
		}
		var ops []store.Op
		for _, kv := range kvs {
			if strings.HasPrefix(kv.Key, prefixHostIndex) || kv.Key == indexedKey {
				ops = append(ops, store.Delete(kv.Key))
			}
		}
		if err := st.Commit(ctx, nil, ops); err != nil {
			t.Fatal(err)
		}
	}
	dropIndex()
	fresh, _ := New(st, "sweeper")
	rel, err := fresh.ReleaseHost(ctx, "gone", nil)
	if err != nil || len(rel) != 2 {
		t.Fatalf("ReleaseHost on a store without the index: %+v %v, want 2 endpoints", rel, err)
	}
	if eps, err := fresh.HostEndpoints(ctx, "other", ""); err != nil || len(eps) != 1 {
		t.Fatalf("the other host's endpoints after the index was built: %v %v", eps, err)
	}
	assertIndexExact(t, fresh)
	// An older writer adds a record without its index key.
	if err := st.Commit(ctx, nil, []store.Op{store.Put(endpointKey(ep("old")), []byte(`{"kind":"port","host":"other"}`)),
		store.Put(hostIndexKey("other", ep("ghost")), []byte{})}); err != nil {
		t.Fatal(err)
	}
	if entered, deleted, err := fresh.PlanReindex(ctx); err != nil || entered != 1 || deleted != 1 {
		t.Fatalf("PlanReindex: %d %d %v, want 1 1", entered, deleted, err)
	}
	if entered, deleted, err := fresh.Reindex(ctx); err != nil || entered != 1 || deleted != 1 {
		t.Fatalf("Reindex: %d %d %v, want 1 1", entered, deleted, err)
	}
	assertIndexExact(t, fresh)
}
