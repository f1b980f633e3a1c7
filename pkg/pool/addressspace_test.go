package pool

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/local"
	"github.com/ringipam/ringipam/pkg/store/memory"
)

// The tests of this file each show one way the cluster-wide promise broke
// before layout 2 ("one address space", issue 8) and holds now.

func dockerOwner(pool, mac string) Owner {
	return Owner{Kind: KindDocker, Network: pool, ContainerID: mac}
}

// Item 1: a CNI network named like a Docker pool: its GC must release
// nothing of Docker's on the same host.
func TestGCOfOneFrontEndNeverTouchesAnother(t *testing.T) {
	ctx := context.Background()
	a := newHosts(t, v4Def("198.18.7.0-24", "198.18.7.0/24"), "h1")[0]
	d := dockerOwner("198.18.7.0-24", "02:42:c6:12:07:02")
	if _, err := a.Allocate(ctx, Request{Owner: d, Wants: ipWant("198.18.7.0-24")}); err != nil {
		t.Fatal(err)
	}
	c := Owner{Kind: KindCNI, Network: "198.18.7.0-24", ContainerID: "ctr1", IfName: "eth0"}
	if _, err := a.Allocate(ctx, Request{Owner: c, Wants: ipWant("198.18.7.0-24")}); err != nil {
		t.Fatal(err)
	}
	released, err := a.GC(ctx, KindCNI, "198.18.7.0-24", nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(released) != 1 || released[0].Owner != c {
		t.Fatalf("CNI GC released %+v, want only the CNI owner", released)
	}
	if _, ok, err := a.Lookup(ctx, d); err != nil || !ok {
		t.Fatalf("the Docker endpoint after a CNI GC: held=%v err=%v", ok, err)
	}
	if got, _ := a.List(ctx, Filter{Kind: KindCNI}); len(got) != 0 {
		t.Fatalf("CNI listing shows %+v", got)
	}
	if got, _ := a.List(ctx, Filter{Kind: KindDocker}); len(got) != 1 {
		t.Fatalf("Docker listing shows %+v, want the endpoint", got)
	}
}

func TestOwnerValidation(t *testing.T) {
	for _, o := range []Owner{
		{Network: "n", ContainerID: "c"},                                       // no kind
		{Kind: "cnii", Network: "n", ContainerID: "c"},                         // unknown kind
		{Kind: KindCNI, Network: "n", ContainerID: "../x"},                     // a '/'
		{Kind: KindCNI, Network: "n", ContainerID: "c\nd"},                     // control character
		{Kind: KindCNI, Network: "n", ContainerID: strings.Repeat("x", 10000)}, // too long
	} {
		if err := o.Validate(); !errors.Is(err, ErrInvalid) {
			t.Errorf("owner %q: %v, want invalid", o.String(), err)
		}
	}
}

// Item 2: two pools over the same addresses are refused, whoever records
// first, with a message saying how to share; isolated pools opt out.
func TestOverlappingPoolsAreRefused(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	a, _ := New(st, "h1")
	if err := a.Define(ctx, v4Def("a-0", "198.18.7.0/24")); err != nil {
		t.Fatal(err)
	}
	// The Docker driver's pool for the same subnet, by Define and by an
	// allocation carrying its definition.
	err := a.Define(ctx, v4Def("198.18.7.0-24", "198.18.7.0/24"))
	var ov *OverlapError
	if !errors.As(err, &ov) || !errors.Is(err, ErrDefinitionMismatch) || ov.Other != "a-0" {
		t.Fatalf("overlapping Define: %v, want an overlap with a-0", err)
	}
	if !strings.Contains(err.Error(), "--ipam-opt pool=a-0") || !strings.Contains(err.Error(), `"isolated": true`) {
		t.Errorf("message does not say how to share or separate: %v", err)
	}
	b := Def{Name: "b-0", Ranges: []Range{{Subnet: mustPrefix("198.18.7.128/25")}}}
	if _, err := a.Allocate(ctx, Request{Owner: own("x"), Wants: ipWant("b-0"), Defs: []Def{b}}); !errors.As(err, &ov) {
		t.Fatalf("overlapping pool in an allocation: %v", err)
	}
	// Disjoint ranges of one subnet are separate address space.
	lo := Def{Name: "lo", Ranges: []Range{{Subnet: mustPrefix("198.18.9.0/24"), Start: mustAddr("198.18.9.1"), End: mustAddr("198.18.9.99")}}}
	hi := Def{Name: "hi", Ranges: []Range{{Subnet: mustPrefix("198.18.9.0/24"), Start: mustAddr("198.18.9.100"), End: mustAddr("198.18.9.200")}}}
	if err := a.Define(ctx, lo, hi); err != nil {
		t.Fatalf("disjoint ranges of one subnet: %v", err)
	}
	iso := v4Def("seg-b", "198.18.7.0/24")
	iso.Isolated = true
	if err := a.Define(ctx, iso); err != nil {
		t.Fatalf("an isolated pool over the same subnet: %v", err)
	}
	if bad, err := a.Check(ctx, "a-0"); err != nil || len(bad) != 0 {
		t.Fatalf("Check after the refusals: %v %v", bad, err)
	}
}

// Item 2: two hosts recording overlapping pools at the same moment: exactly
// one wins, every time.
func TestConcurrentOverlappingDefinitionsOneWins(t *testing.T) {
	ctx := context.Background()
	for round := range 30 {
		st := memory.New()
		var wg sync.WaitGroup
		errs := make([]error, 4)
		for i := range errs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				a, _ := New(st, fmt.Sprintf("h%d", i))
				name := fmt.Sprintf("net%d-0", i)
				_, errs[i] = a.Allocate(ctx, Request{Owner: own("c"), Wants: ipWant(name), Defs: []Def{v4Def(name, "198.18.7.0/24")}})
			}()
		}
		wg.Wait()
		won := 0
		for _, err := range errs {
			switch {
			case err == nil:
				won++
			case !errors.Is(err, ErrDefinitionMismatch):
				t.Fatalf("round %d: %v", round, err)
			}
		}
		if won != 1 {
			t.Fatalf("round %d: %d overlapping pools were recorded (%v)", round, won, errs)
		}
	}
}

// Item 4: a released address stays held for its reservation name.
func TestReservationHoldsItsAddress(t *testing.T) {
	ctx := context.Background()
	now := time.Unix(1_800_000_000, 0)
	clock := func() time.Time { return now }
	st := memory.New()
	a, _ := New(st, "h1", WithClock(clock), WithReservationHold(5*time.Minute))
	if err := a.Define(ctx, v4Def("p", "198.18.0.0/29")); err != nil { // .1-.6
		t.Fatal(err)
	}
	first, err := a.Allocate(ctx, Request{Owner: own("web-0-a"), Reservation: "default/web-0", Wants: ipWant("p")})
	if err != nil {
		t.Fatal(err)
	}
	held := first.Addrs[0].Addr
	if _, _, err := a.Release(ctx, own("web-0-a")); err != nil {
		t.Fatal(err)
	}
	// Dynamic allocation skips it, all the way round the ring.
	for i := range 5 {
		al, err := a.Allocate(ctx, Request{Owner: own(fmt.Sprint("d", i)), Wants: ipWant("p")})
		if err != nil {
			t.Fatal(err)
		}
		if al.Addrs[0].Addr == held {
			t.Fatalf("dynamic allocation %d took %s, held for default/web-0", i, held)
		}
	}
	if _, err := a.Allocate(ctx, Request{Owner: own("d5"), Wants: ipWant("p")}); !errors.Is(err, ErrNoCapacity) {
		t.Fatalf("pool full but for the hold: %v, want no capacity", err)
	}
	// Another owner's static request is refused, naming the name and the end.
	_, err = a.Allocate(ctx, Request{Owner: own("thief"), Wants: []Want{{Pool: "p", Role: RoleIP, Addr: held}}})
	var inUse *InUseError
	if !errors.As(err, &inUse) || inUse.Name != "default/web-0" || !inUse.Until.Equal(now.Add(5*time.Minute)) {
		t.Fatalf("static request for a held address: %v", err)
	}
	if !strings.Contains(err.Error(), "default/web-0") || !strings.Contains(err.Error(), now.Add(5*time.Minute).UTC().Format(time.RFC3339)) {
		t.Errorf("message does not name the reservation and the end of the hold: %v", err)
	}
	if h, ok, err := a.HolderOf(ctx, "p", held); err != nil || !ok || h.Reservation != "default/web-0" {
		t.Fatalf("HolderOf a held address: %+v %v %v", h, ok, err)
	}
	// The same name gets it back.
	again, err := a.Allocate(ctx, Request{Owner: own("web-0-b"), Reservation: "default/web-0", Wants: ipWant("p")})
	if err != nil || again.Addrs[0].Addr != held {
		t.Fatalf("recreated owner got %v (%v), want %s", again.Addrs, err, held)
	}
	// Released again; once the hold ends, anyone may take it.
	if _, _, err := a.Release(ctx, own("web-0-b")); err != nil {
		t.Fatal(err)
	}
	now = now.Add(5*time.Minute + time.Second)
	got, err := a.Allocate(ctx, Request{Owner: own("d5"), Wants: ipWant("p")})
	if err != nil || got.Addrs[0].Addr != held {
		t.Fatalf("after the hold ended, a dynamic request got %v (%v), want %s", got.Addrs, err, held)
	}
	if bad, err := a.Check(ctx, "p"); err != nil || len(bad) != 0 {
		t.Fatalf("Check: %v %v", bad, err)
	}
}

func TestDropHoldFreesTheAddressAtOnce(t *testing.T) {
	ctx := context.Background()
	a := newHosts(t, v4Def("p", "198.18.0.0/30"), "h1")[0] // .1-.2
	first, err := a.Allocate(ctx, Request{Owner: own("x"), Reservation: "ns/x", Wants: ipWant("p")})
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := a.Release(ctx, own("x")); err != nil {
		t.Fatal(err)
	}
	dropped, err := a.DropHold(ctx, KindCNI, "net", "ns/x")
	if err != nil || len(dropped) != 1 || dropped[0].Addr != first.Addrs[0].Addr {
		t.Fatalf("DropHold: %+v %v", dropped, err)
	}
	if _, err := a.Allocate(ctx, Request{Owner: own("y"), Wants: []Want{{Pool: "p", Role: RoleIP, Addr: first.Addrs[0].Addr}}}); err != nil {
		t.Fatalf("static request after the hold was dropped: %v", err)
	}
	if again, err := a.DropHold(ctx, KindCNI, "net", "ns/x"); err != nil || len(again) != 0 {
		t.Fatalf("second DropHold: %+v %v", again, err)
	}
}

// Item 5: a tombstoned range with one held address gives its free
// addresses to a host that needs space, at once.
func TestTombstonedRangeDonatesItsFreeHoles(t *testing.T) {
	ctx := context.Background()
	hosts := newHosts(t, v4Def("p", "198.18.0.0/29"), "gone", "h2") // .1-.6
	old, err := hosts[0].Allocate(ctx, Request{Owner: own("old"), Wants: ipWant("p")})
	if err != nil {
		t.Fatal(err) // "gone" owns the whole pool and holds .1
	}
	tombstone(t, hosts[0].Store(), "p", "gone")
	seen := map[netip.Addr]bool{}
	for i := range 5 {
		al, err := hosts[1].Allocate(ctx, Request{Owner: own(fmt.Sprint("new", i)), Wants: ipWant("p")})
		if err != nil {
			t.Fatalf("allocation %d while the tombstoned range holds one address: %v", i, err)
		}
		seen[al.Addrs[0].Addr] = true
	}
	if len(seen) != 5 || seen[old.Addrs[0].Addr] {
		t.Fatalf("h2 got %v; want the 5 free addresses", seen)
	}
	r, _ := hosts[1].RingOf(ctx, "p")
	if o, _ := r.Owner(old.Addrs[0].Addr); !o.Tombstone {
		t.Fatalf("the held address's range %+v, want still tombstoned", o)
	}
	if bad, err := hosts[1].Check(ctx, "p"); err != nil || len(bad) != 0 {
		t.Fatalf("Check: %v %v", bad, err)
	}
}

// ambiguousStore applies a commit and then reports the store unavailable,
// as an etcd client does when its request times out after the server
// committed.
type ambiguousStore struct {
	store.Store
	mu    sync.Mutex
	fails int  // commits still to apply and then report unavailable
	down  bool // every commit fails unapplied
	downs int  // commits refused while down
}

func (s *ambiguousStore) Commit(ctx context.Context, conds []store.Cond, ops []store.Op) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.down {
		s.downs++
		return fmt.Errorf("%w: etcd: connection refused", store.ErrUnavailable)
	}
	err := s.Store.Commit(ctx, conds, ops)
	if s.fails > 0 {
		s.fails--
		return fmt.Errorf("%w: etcd: request timed out (%v)", store.ErrUnavailable, err)
	}
	return err
}

// Item 7: a commit whose outcome is unknown is retried within the
// deadline; allocation being idempotent per owner, the retry reports what
// the first commit did.
func TestAmbiguousCommitIsRetriedWithinTheDeadline(t *testing.T) {
	ctx := context.Background()
	st := &ambiguousStore{Store: memory.New()}
	a, _ := New(st, "h1")
	if err := a.Define(ctx, v4Def("p", "198.18.0.0/24")); err != nil {
		t.Fatal(err)
	}
	st.fails = 1
	al, err := a.Allocate(ctx, Request{Owner: own("c"), Wants: ipWant("p")})
	if err != nil {
		t.Fatalf("allocation whose commit timed out after applying: %v", err)
	}
	if again, _, _ := a.Lookup(ctx, own("c")); again.Addrs[0] != al.Addrs[0] {
		t.Fatalf("stored %v, returned %v", again.Addrs, al.Addrs)
	}
	st.fails = 1
	if _, _, err := a.Release(ctx, own("c")); err != nil {
		t.Fatalf("release whose commit timed out after applying: %v", err)
	}
	if _, ok, _ := a.Lookup(ctx, own("c")); ok {
		t.Fatal("owner still holds after release")
	}
	// With the deadline spent, the error says unavailable (the store's last
	// answer), and the call counts as try-again-later either way. (A
	// machine so loaded that the deadline passed before the first commit
	// gets the deadline itself: the store was never asked.)
	st.down = true
	short, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	_, err = a.Allocate(short, Request{Owner: own("d"), Wants: ipWant("p")})
	st.mu.Lock()
	asked := st.downs
	st.mu.Unlock()
	switch {
	case asked > 0 && !errors.Is(err, store.ErrUnavailable):
		t.Fatalf("store unavailable until the deadline (%d commits refused): %v", asked, err)
	case asked == 0 && !errors.Is(err, context.DeadlineExceeded):
		t.Fatalf("deadline passed before any commit: %v", err)
	case !Classify(err).Retryable():
		t.Fatalf("%v is not try-again-later (class %v)", err, Classify(err))
	}
}

// Item 1: a store written in layout 1 (testdata/layout-v1.db, made by the
// code of commit 43832dc, see testdata/layout-v1-generator.go.txt) opens,
// migrates once, keeps every allocation and owner, and a second open does
// nothing.
func TestLayoutV1StoreMigratesOnce(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "store.db")
	copyFile(t, "testdata/layout-v1.db", path)
	st, err := local.New(local.Config{Path: path, OpenTimeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	checkMigrated(t, st)
	before := dump(t, st)
	// (Read by another host: a lookup by the owner's own host would
	// refresh that host's last-seen time, a change of its own.)
	b, _ := New(st, "inspector")
	if _, ok, err := b.Lookup(ctx, Owner{Kind: KindCNI, Network: "net1", ContainerID: "c0ffee02", IfName: "eth0"}); err != nil || !ok {
		t.Fatalf("second open: %v %v", ok, err)
	}
	if after := dump(t, st); after != before {
		t.Fatalf("a second open changed the store:\nbefore %s\nafter  %s", before, after)
	}
}

// The same fixture as key/value rows, on the memory store.
func TestLayoutV1RowsMigrate(t *testing.T) {
	raw, err := os.ReadFile("testdata/layout-v1.json")
	if err != nil {
		t.Fatal(err)
	}
	var rows []struct{ Key, Value string }
	if err := json.Unmarshal(raw, &rows); err != nil {
		t.Fatal(err)
	}
	st := memory.New()
	var ops []store.Op
	for _, r := range rows {
		ops = append(ops, store.Put(r.Key, []byte(r.Value)))
	}
	if err := st.Commit(context.Background(), nil, ops); err != nil {
		t.Fatal(err)
	}
	checkMigrated(t, st)
}

func checkMigrated(t *testing.T, st store.Store) {
	t.Helper()
	ctx := context.Background()
	a, _ := New(st, "host-a", WithClock(func() time.Time { return time.Unix(1795000000, 0) }))
	all, err := a.List(ctx, Filter{})
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{ // owner -> addresses
		"cni/net1/c0ffee01/eth0":                  "198.18.7.2 2001:db8:7::1",
		"cni/net1/c0ffee02/eth0":                  "198.18.7.129 2001:db8:7:0:8000::1",
		"cni/pc/c0ffee04/eth0":                    "198.18.8.1 198.18.8.2",
		"docker/198.18.9.0-24/02:42:c6:12:09:02/": "198.18.9.2",
		"docker/198.18.9.0-24/02:42:c6:12:09:03/": "198.18.9.129",
		"docker/198.18.9.0-24/aux-198.18.9.200/":  "198.18.9.200",
	}
	got := map[string]string{}
	for _, al := range all {
		var s []string
		for _, x := range al.Addrs {
			s = append(s, x.Addr.String())
		}
		got[al.Owner.String()] = strings.Join(s, " ")
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("after migration:\n got %v\nwant %v", got, want)
	}
	for _, p := range []string{"net1-0", "net1-1", "pc-0", "198.18.9.0-24"} {
		if bad, err := a.Check(ctx, p); err != nil || len(bad) != 0 {
			t.Fatalf("Check %s after migration: %v %v", p, bad, err)
		}
	}
	// The docker endpoint is found by its new owner; CNI GC of a network
	// named like the Docker pool leaves it alone.
	if rel, err := a.GC(ctx, KindCNI, "198.18.9.0-24", nil); err != nil || len(rel) != 0 {
		t.Fatalf("CNI GC on the Docker pool's name released %v (%v)", rel, err)
	}
	// The reservation of the live owner still protects it, and the
	// released one still gives its address back.
	if _, err := a.Allocate(ctx, Request{Owner: Owner{Kind: KindCNI, Network: "net1", ContainerID: "other", IfName: "eth0"}, Reservation: "default/web-0", Wants: ipWant("net1-0")}); !errors.Is(err, ErrAlreadyInUse) {
		t.Fatalf("reservation of a live owner after migration: %v", err)
	}
	db, err := a.Allocate(ctx, Request{Owner: Owner{Kind: KindCNI, Network: "net1", ContainerID: "new", IfName: "eth0"}, Reservation: "default/db-0", Wants: ipWant("net1-0")})
	if err != nil || db.Addrs[0].Addr != mustAddr("198.18.7.50") {
		t.Fatalf("released reservation after migration gave %v (%v), want 198.18.7.50", db.Addrs, err)
	}
	// The registry knows the old pools: an overlapping one is refused.
	if err := a.Define(ctx, v4Def("dup", "198.18.7.0/24")); !errors.Is(err, ErrDefinitionMismatch) {
		t.Fatalf("pool overlapping a migrated one: %v", err)
	}
}

func dump(t *testing.T, st store.Store) string {
	t.Helper()
	kvs, err := st.Scan(context.Background(), "", store.PrefixEnd(""), 0)
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	for _, kv := range kvs {
		fmt.Fprintf(&b, "%s@%d=%s\n", kv.Key, kv.Revision, kv.Value)
	}
	return b.String()
}

func copyFile(t *testing.T, from, to string) {
	t.Helper()
	in, err := os.Open(from)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	out, err := os.OpenFile(to, os.O_CREATE|os.O_WRONLY, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(out, in); err != nil {
		t.Fatal(err)
	}
	if err := out.Close(); err != nil {
		t.Fatal(err)
	}
}
