package pool

import (
	"context"
	"strings"
	"sync"
	"testing"

	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/memory"
)

// readCounter counts round trips by kind, and the keys reads return.
type readCounter struct {
	*memory.Store
	mu                   sync.Mutex
	gets, scans, commits int
	keysRead             int
}

func (c *readCounter) Get(ctx context.Context, keys ...string) ([]store.KV, error) {
	kvs, err := c.Store.Get(ctx, keys...)
	if len(keys) == 0 {
		return kvs, err // no round trip on any backend (store.StartGet)
	}
	c.mu.Lock()
	c.gets++
	c.keysRead += len(kvs)
	c.mu.Unlock()
	return kvs, err
}

func (c *readCounter) Scan(ctx context.Context, from, to string, limit int) ([]store.KV, error) {
	kvs, err := c.Store.Scan(ctx, from, to, limit)
	c.mu.Lock()
	c.scans++
	c.keysRead += len(kvs)
	c.mu.Unlock()
	return kvs, err
}

func (c *readCounter) Commit(ctx context.Context, conds []store.Cond, ops []store.Op) error {
	c.mu.Lock()
	c.commits++
	c.mu.Unlock()
	return c.Store.Commit(ctx, conds, ops)
}

func (c *readCounter) reset() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.gets, c.scans, c.commits, c.keysRead = 0, 0, 0, 0
}

// indexWorld is a store where host h2 holds others owners of network "net"
// and h1 holds mine, all in pool p (a /20).
func indexWorld(t *testing.T, mine, others int) (*readCounter, *Allocator, *Allocator) {
	t.Helper()
	ctx := context.Background()
	st := &readCounter{Store: memory.New()}
	h1, _ := New(st, "h1")
	h2, _ := New(st, "h2")
	if err := h1.Define(ctx, v4Def("p", "198.18.0.0/20")); err != nil {
		t.Fatal(err)
	}
	for i := range others {
		if _, err := h2.Allocate(ctx, Request{Owner: hostOwner("h2", i), Wants: ipWant("p")}); err != nil {
			t.Fatal(err)
		}
	}
	for i := range mine {
		req := Request{Owner: hostOwner("h1", i), Wants: ipWant("p")}
		if i == 0 {
			req.Reservation = "ns/web-0"
		}
		if _, err := h1.Allocate(ctx, req); err != nil {
			t.Fatal(err)
		}
	}
	return st, h1, h2
}

// A host's GC reads its own owners of the network only: what it reads does
// not grow with other hosts' owners, and its stale owners go in one commit.
func TestGCReadsOnlyThisHostsOwners(t *testing.T) {
	ctx := context.Background()
	read := map[int]int{}
	for _, others := range []int{0, 400} {
		st, h1, _ := indexWorld(t, 6, others)
		valid := []Owner{hostOwner("h1", 4), hostOwner("h1", 5)}
		st.reset()
		rel, err := h1.GC(ctx, KindCNI, "net", valid)
		if err != nil {
			t.Fatal(err)
		}
		if len(rel) != 4 {
			t.Fatalf("with %d owners of another host: released %d, want 4", others, len(rel))
		}
		// The scan of h1's index and the read of its records; the read of
		// the host state and the reservation, and one commit for all four.
		if st.scans != 1 || st.gets != 2 || st.commits != 1 {
			t.Errorf("with %d owners of another host: %d scans, %d gets, %d commits; want 1, 2, 1", others, st.scans, st.gets, st.commits)
		}
		read[others] = st.keysRead
		// Owner 0 had a reservation: its address is held for it.
		if info, ok, err := h1.Reservation(ctx, KindCNI, "net", "ns/web-0"); err != nil || !ok || info.Owner != "" || info.Until.IsZero() {
			t.Errorf("reservation after GC: %+v %v %v, want released and held", info, ok, err)
		}
		left, err := h1.List(ctx, Filter{Kind: KindCNI, Network: "net"})
		if err != nil || len(left) != others+2 {
			t.Fatalf("left %d owners (%v), want %d", len(left), err, others+2)
		}
		if v, err := h1.Audit(ctx); err != nil || len(v) != 0 {
			t.Fatalf("audit after GC: %v %v", v, err)
		}
	}
	if read[400] != read[0] {
		t.Errorf("GC read %d keys beside 400 owners of another host, %d beside none: it reads other hosts' owners", read[400], read[0])
	}
}

// Many stale owners go several to a commit, each commit within the store's
// limit, and none is left behind.
func TestGCBatchesCommits(t *testing.T) {
	ctx := context.Background()
	st, h1, _ := indexWorld(t, 100, 3)
	st.reset()
	rel, err := h1.GC(ctx, KindCNI, "net", nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(rel) != 100 {
		t.Fatalf("released %d, want 100", len(rel))
	}
	// 5 entries per owner and 2 for the host state: 18 owners a commit.
	if st.commits != 6 || st.scans != 1 || st.gets != 1+6 {
		t.Errorf("%d commits, %d scans, %d gets; want 6, 1, 7", st.commits, st.scans, st.gets)
	}
	u, err := h1.Usage(ctx, "p")
	if err != nil {
		t.Fatal(err)
	}
	for _, h := range u.Hosts {
		if h.Host == "h1" && h.Used != 0 {
			t.Errorf("h1 still counts %d used addresses", h.Used)
		}
	}
	if v, err := h1.Audit(ctx); err != nil || len(v) != 0 {
		t.Fatalf("audit after GC: %v %v", v, err)
	}
}

// An index key whose owner is gone (left by an older ringipam) is skipped by
// GC and deleted; an owner missing from the index is entered by Reindex.
func TestReindexRepairsTheIndex(t *testing.T) {
	ctx := context.Background()
	st, h1, h2 := indexWorld(t, 3, 3)
	// h2's owner 0 loses its index key; h1's index names an owner that is gone.
	if err := st.Commit(ctx, nil, []store.Op{
		store.Delete(hostOwnerKey("h2", hostOwner("h2", 0))),
		store.Put(hostOwnerKey("h1", hostOwner("h1", 9)), []byte{}),
		store.Put(hostOwnerKey("h1", hostOwner("h2", 1)), []byte{}),
	}); err != nil {
		t.Fatal(err)
	}
	v, err := h1.Audit(ctx)
	if err != nil || len(v) != 3 {
		t.Fatalf("audit of the broken index: %v %v, want 3 host-index violations", v, err)
	}
	for _, x := range v {
		if x.Invariant != InvHostIndex {
			t.Errorf("violation %v, want %s", x, InvHostIndex)
		}
	}
	held, err := h1.List(ctx, Filter{Host: "h1"})
	if err != nil || len(held) != 3 {
		t.Fatalf("h1's owners through its index: %d (%v), want 3", len(held), err)
	}
	entered, deleted, err := h2.Reindex(ctx)
	if err != nil || entered != 1 || deleted != 2 {
		t.Fatalf("Reindex = %d entered, %d deleted (%v); want 1, 2", entered, deleted, err)
	}
	if v, err := h1.Audit(ctx); err != nil || len(v) != 0 {
		t.Fatalf("audit after Reindex: %v %v", v, err)
	}
	// GC deletes a dangling key of its own host too, and releases nothing else.
	if err := st.Commit(ctx, nil, []store.Op{store.Put(hostOwnerKey("h1", hostOwner("h1", 9)), []byte{})}); err != nil {
		t.Fatal(err)
	}
	all := []Owner{hostOwner("h1", 0), hostOwner("h1", 1), hostOwner("h1", 2)}
	if rel, err := h1.GC(ctx, KindCNI, "net", all); err != nil || len(rel) != 0 {
		t.Fatalf("GC with every owner valid: %v %v", rel, err)
	}
	if v, err := h1.Audit(ctx); err != nil || len(v) != 0 {
		t.Fatalf("audit after GC dropped the dangling key: %v %v", v, err)
	}
}

// A store of layout 2 (no host index) is migrated on first use: every
// owner is entered in its host's index, once.
func TestLayoutV2StoreGainsTheHostIndex(t *testing.T) {
	ctx := context.Background()
	st, _, _ := indexWorld(t, 5, 7)
	// Make it what layout 2 wrote: no index, version 2.
	index, err := st.Scan(ctx, prefixHostOwner, store.PrefixEnd(prefixHostOwner), 0)
	if err != nil || len(index) != 12 {
		t.Fatalf("index before: %d keys (%v), want 12", len(index), err)
	}
	ops := []store.Op{store.Put(layoutKey, []byte("2"))}
	for _, kv := range index {
		ops = append(ops, store.Delete(kv.Key))
	}
	if err := st.Commit(ctx, nil, ops); err != nil {
		t.Fatal(err)
	}
	h3, _ := New(st, "h3")
	if _, _, err := h3.Lookup(ctx, hostOwner("h1", 0)); err != nil {
		t.Fatal(err)
	}
	after, err := st.Scan(ctx, prefixHostOwner, store.PrefixEnd(prefixHostOwner), 0)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, kv := range after {
		got = append(got, kv.Key)
	}
	var want []string
	for _, kv := range index {
		want = append(want, kv.Key)
	}
	if strings.Join(got, " ") != strings.Join(want, " ") {
		t.Fatalf("index after migration:\n got %v\nwant %v", got, want)
	}
	if v, _ := st.Get(ctx, layoutKey); string(v[0].Value) != layoutVersion {
		t.Fatalf("layout after migration %q, want %q", v[0].Value, layoutVersion)
	}
	if v, err := h3.Audit(ctx); err != nil || len(v) != 0 {
		t.Fatalf("audit after migration: %v %v", v, err)
	}
	// A layout newer than this code's is refused.
	if err := st.Commit(ctx, nil, []store.Op{store.Put(layoutKey, []byte("5"))}); err != nil {
		t.Fatal(err)
	}
	h4, _ := New(st, "h4")
	if _, _, err := h4.Lookup(ctx, hostOwner("h1", 0)); err == nil || !strings.Contains(err.Error(), `"5"`) {
		t.Fatalf("layout 5: %v, want ErrLayout", err)
	}
}

// Reclaim finds a gone host's owners through its index.
func TestReclaimReadsTheGoneHostsIndex(t *testing.T) {
	ctx := context.Background()
	st, h1, _ := indexWorld(t, 2, 30)
	st.reset()
	rep, err := h1.Reclaim(ctx, "h2", ReclaimOptions{})
	if err != nil || rep.Released != 30 {
		t.Fatalf("reclaim: %+v %v, want 30 released", rep, err)
	}
	if v, err := h1.Audit(ctx); err != nil || len(v) != 0 {
		t.Fatalf("audit after reclaim: %v %v", v, err)
	}
	if left, err := h1.List(ctx, Filter{Host: "h2"}); err != nil || len(left) != 0 {
		t.Fatalf("h2 still holds %d (%v)", len(left), err)
	}
	if left, err := h1.List(ctx, Filter{Host: "h1"}); err != nil || len(left) != 2 {
		t.Fatalf("h1 holds %d (%v), want 2", len(left), err)
	}
}
