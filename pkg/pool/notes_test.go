package pool

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/memory"
)

// memNotes is a NoteKeeper in a map.
type memNotes struct {
	mu    sync.Mutex
	notes map[string][]byte
}

func (m *memNotes) ReadNote(name string) []byte {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.notes[name]
}

func (m *memNotes) WriteNote(name string, note []byte) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.notes == nil {
		m.notes = map[string][]byte{}
	}
	m.notes[name] = note
}

// callLog lists the round trips made to a memory store, by kind (Get,
// Scan, Commit, CommitOrGet).
type callLog struct {
	*memory.Store
	mu    sync.Mutex
	calls []string
}

func (c *callLog) count(what string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.calls = append(c.calls, what)
}

func (c *callLog) take() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := c.calls
	c.calls = nil
	return out
}

func (c *callLog) Get(ctx context.Context, keys ...string) ([]store.KV, error) {
	c.count("get")
	return c.Store.Get(ctx, keys...)
}

func (c *callLog) Scan(ctx context.Context, from, to string, limit int) ([]store.KV, error) {
	c.count("scan")
	return c.Store.Scan(ctx, from, to, limit)
}

func (c *callLog) Commit(ctx context.Context, conds []store.Cond, ops []store.Op) error {
	c.count("commit")
	return c.Store.Commit(ctx, conds, ops)
}

// CommitOrGet with nothing to read is a commit that tells its revision.
func (c *callLog) CommitOrGet(ctx context.Context, conds []store.Cond, same []store.KV, ops []store.Op, read []string) (int64, []store.KV, error) {
	if len(read) == 0 {
		c.count("commit")
	} else {
		c.count("commit-or-get")
	}
	return c.Store.CommitOrGet(ctx, conds, same, ops, read)
}

func TestNotesAllocateInOneRoundTrip(t *testing.T) {
	ctx := context.Background()
	st := &callLog{Store: memory.New()}
	notes := &memNotes{}
	a, err := New(st, "h1", WithNotes(notes))
	if err != nil {
		t.Fatal(err)
	}
	def := v4Def("p", "198.18.0.0/24")
	alloc := func(id string) netip.Addr {
		t.Helper()
		got, err := a.Allocate(ctx, Request{Owner: own(id), Wants: ipWant("p"), Defs: []Def{def}})
		if err != nil {
			t.Fatal(err)
		}
		return got.Addrs[0].Addr
	}
	// The first allocation has no note: read, then commit (the pool's
	// definition recorded, the registry read for it).
	alloc("c1")
	if calls := st.take(); calls[0] != "get" || calls[len(calls)-1] != "commit" {
		t.Fatalf("first allocation: %v, want a read first and a commit last", calls)
	}
	if notes.ReadNote("p@h1") == nil {
		t.Fatal("no note after the first allocation")
	}
	for i, want := range []string{"198.18.0.2", "198.18.0.3", "198.18.0.4"} {
		if got := alloc(fmt.Sprintf("c%d", i+2)); got != mustAddr(want) {
			t.Fatalf("allocation %d on the note: %s, want %s", i+2, got, want)
		}
		if diff := cmp.Diff([]string{"commit-or-get"}, st.take()); diff != "" {
			t.Fatalf("allocation %d on the note: round trips (-want +got):\n%s", i+2, diff)
		}
	}
	// A release here keeps the note true: the next allocation still needs
	// one round trip, and the round robin goes on.
	if _, ok, err := a.ReleaseWith(ctx, own("c2"), ReleaseHint{Pools: []string{"p"}}); err != nil || !ok {
		t.Fatalf("release: %v %v", ok, err)
	}
	st.take()
	if got := alloc("c5"); got != mustAddr("198.18.0.5") {
		t.Fatalf("after a release: %s, want 198.18.0.5", got)
	}
	if diff := cmp.Diff([]string{"commit-or-get"}, st.take()); diff != "" {
		t.Fatalf("after a release: round trips (-want +got):\n%s", diff)
	}
	// An owner that already holds its address: the belief that it is
	// absent fails, and the answer serves as the read (no commit).
	if got := alloc("c3"); got != mustAddr("198.18.0.3") {
		t.Fatalf("repeated allocation: %s, want 198.18.0.3", got)
	}
	if diff := cmp.Diff([]string{"commit-or-get"}, st.take()); diff != "" {
		t.Fatalf("repeated allocation: round trips (-want +got):\n%s", diff)
	}
	if s := a.Stats(); s.OnNotes != 4 || s.NotesWrong != 1 || s.Conflicts != 0 {
		t.Fatalf("stats %+v, want 4 on notes, 1 wrong, no conflict", s)
	}
}

// Wrong notes cost a round trip, never a wrong address: each case below
// leaves host h1 a note that no longer (or never did) describe the store.
func TestWrongNotesAreOnlyARoundTrip(t *testing.T) {
	ctx := context.Background()
	def := v4Def("p", "198.18.0.0/28")
	other := v4Def("p", "198.18.1.0/28") // the same name in another store
	cases := []struct {
		name      string
		spoil     func(t *testing.T, st *callLog, notes *memNotes)
		wantCalls []string
	}{
		{"another host claimed space", func(t *testing.T, st *callLog, _ *memNotes) {
			b, err := New(st, "h2")
			if err != nil {
				t.Fatal(err)
			}
			if _, err := b.Allocate(ctx, Request{Owner: own("b1"), Wants: ipWant("p")}); err != nil {
				t.Fatal(err)
			}
		}, []string{"commit-or-get", "commit"}},
		{"a note of another store", func(t *testing.T, _ *callLog, notes *memNotes) {
			x, err := New(memory.New(), "h1", WithNotes(notes))
			if err != nil {
				t.Fatal(err)
			}
			for i := range 5 {
				if _, err := x.Allocate(ctx, Request{Owner: own(fmt.Sprint("x", i)), Wants: ipWant("p"), Defs: []Def{def}}); err != nil {
					t.Fatal(err)
				}
			}
		}, []string{"commit-or-get", "commit"}},
		{"a note of another definition", func(t *testing.T, _ *callLog, notes *memNotes) {
			x, err := New(memory.New(), "h1", WithNotes(notes))
			if err != nil {
				t.Fatal(err)
			}
			if _, err := x.Allocate(ctx, Request{Owner: own("x"), Wants: ipWant("p"), Defs: []Def{other}}); err != nil {
				t.Fatal(err)
			}
		}, []string{"get", "commit"}},
		{"this host's state changed behind the note", func(t *testing.T, st *callLog, _ *memNotes) {
			b, err := New(st, "h1") // another process without notes
			if err != nil {
				t.Fatal(err)
			}
			if _, err := b.Allocate(ctx, Request{Owner: own("b1"), Wants: ipWant("p")}); err != nil {
				t.Fatal(err)
			}
		}, []string{"commit-or-get", "commit"}},
		{"a note of another history at the same revisions", func(t *testing.T, _ *callLog, notes *memNotes) {
			// As after a restore from a backup: the store's revisions are
			// the note's, the bytes this host wrote there are not.
			n := poolNote{def: store.KV{Key: defKey("p")}, host: store.KV{Key: hostKey("p", "h1")}}
			if err := decodeNote(notes.ReadNote("p@h1"), &n); err != nil {
				t.Fatal(err)
			}
			var hs hostState
			if err := decodeHostState(n.host.Value, &hs); err != nil {
				t.Fatal(err)
			}
			hs.Used += 7
			hs.Cursor = mustAddr("198.18.0.9")
			n.host.Value = encodeHostState(hs)
			notes.WriteNote("p@h1", n.encode())
		}, []string{"commit-or-get", "commit"}},
		{"a torn note", func(t *testing.T, _ *callLog, notes *memNotes) {
			n := notes.ReadNote("p@h1")
			notes.WriteNote("p@h1", n[:len(n)-3])
		}, []string{"get", "commit"}},
		{"garbage", func(t *testing.T, _ *callLog, notes *memNotes) {
			notes.WriteNote("p@h1", []byte("ringipam pool note 1\n3\nabc\n-\n-\nend\n"))
		}, []string{"get", "commit"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			st := &callLog{Store: memory.New()}
			notes := &memNotes{}
			a, err := New(st, "h1", WithNotes(notes))
			if err != nil {
				t.Fatal(err)
			}
			held := map[netip.Addr]string{}
			alloc := func(id string) {
				t.Helper()
				got, err := a.Allocate(ctx, Request{Owner: own(id), Wants: ipWant("p"), Defs: []Def{def}})
				if err != nil {
					t.Fatal(err)
				}
				addr := got.Addrs[0].Addr
				if !def.Ranges[0].Subnet.Contains(addr) || held[addr] != "" {
					t.Fatalf("%s got %s: outside the pool or already held by %q", id, addr, held[addr])
				}
				held[addr] = id
			}
			alloc("c1")
			alloc("c2")
			tc.spoil(t, st, notes)
			st.take()
			alloc("c3")
			if diff := cmp.Diff(tc.wantCalls, st.take()); diff != "" {
				t.Errorf("round trips (-want +got):\n%s", diff)
			}
			// The store is whole, and the next allocation is on the note again.
			alloc("c4")
			if diff := cmp.Diff([]string{"commit-or-get"}, st.take()); diff != "" {
				t.Errorf("next allocation: round trips (-want +got):\n%s", diff)
			}
			bad, err := a.Check(ctx, "p")
			if err != nil {
				t.Fatal(err)
			}
			for _, b := range bad {
				t.Errorf("invariant: %s", b)
			}
		})
	}
}

// On the same sequence of allocations and releases by two hosts, an
// allocator with notes leaves the store exactly as one without: notes
// change the round trips, never the decisions.
func TestNotesDecideAsReads(t *testing.T) {
	ctx := context.Background()
	clock := func() time.Time { return time.Date(2026, 11, 24, 12, 0, 0, 0, time.UTC) }
	def := v4Def("p", "198.18.0.0/25")
	var refused int
	run := func(withNotes bool) ([]store.KV, []string, StatsSnapshot) {
		var outcomes []string
		refused = 0
		st := memory.New()
		var hosts []*Allocator
		for _, h := range []string{"h1", "h2"} {
			opts := []Option{WithClock(clock)}
			if withNotes {
				opts = append(opts, WithNotes(&memNotes{}))
			}
			a, err := New(st, h, opts...)
			if err != nil {
				t.Fatal(err)
			}
			hosts = append(hosts, a)
		}
		rng := rand.New(rand.NewPCG(7, 11))
		var live [2][]Owner
		for step := range 400 {
			h := rng.IntN(2)
			a := hosts[h]
			if len(live[h]) > 0 && rng.IntN(3) == 0 {
				i := rng.IntN(len(live[h]))
				hint := ReleaseHint{}
				if rng.IntN(2) == 0 {
					hint.Pools = []string{"p"}
				}
				if _, _, err := a.ReleaseWith(ctx, live[h][i], hint); err != nil {
					t.Fatal(err)
				}
				live[h] = append(live[h][:i], live[h][i+1:]...)
				continue
			}
			o := own(fmt.Sprintf("s%d", step))
			repeated := len(live[h]) > 0 && rng.IntN(5) == 0
			if repeated {
				o = live[h][rng.IntN(len(live[h]))] // a repeated ADD
			}
			wants := ipWant("p")
			if rng.IntN(6) == 0 {
				// A static address, often in the other host's ranges:
				// the plan then needs the whole ring, not the note's
				// ranges of this host.
				wants[0].Addr = netip.AddrFrom4([4]byte{198, 18, 0, byte(1 + rng.IntN(126))})
			}
			got, err := a.Allocate(ctx, Request{Owner: o, Wants: wants, Defs: []Def{def}})
			var inUse *InUseError
			var exists *ExistsError
			switch {
			case errors.As(err, &inUse) || errors.As(err, &exists):
				outcomes = append(outcomes, err.Error())
				refused++
			case err != nil:
				t.Fatalf("step %d: %v", step, err)
			default:
				outcomes = append(outcomes, fmt.Sprint(got.Addrs))
				if !repeated {
					live[h] = append(live[h], o)
				}
			}
		}
		all, err := st.Scan(ctx, "", "\xff", 0)
		if err != nil {
			t.Fatal(err)
		}
		for i := range all {
			all[i].Revision = 0 // a failed speculation does not write, so only values compare
		}
		s := hosts[0].Stats()
		s2 := hosts[1].Stats()
		s.OnNotes += s2.OnNotes
		s.NotesWrong += s2.NotesWrong
		return all, outcomes, s
	}
	plain, plainOut, _ := run(false)
	noted, notedOut, stats := run(true)
	if diff := cmp.Diff(plainOut, notedOut); diff != "" {
		t.Fatalf("allocations with notes differ from those without (-without +with):\n%s", diff)
	}
	if diff := cmp.Diff(plain, noted); diff != "" {
		t.Fatalf("the store with notes differs from the store without (-without +with):\n%s", diff)
	}

	if stats.OnNotes < 50 || stats.NotesWrong < 10 {
		t.Fatalf("stats %+v: the sequence did not exercise notes both held and wrong", stats)
	}
	t.Logf("%d allocations on notes, %d on wrong notes, %d static requests refused", stats.OnNotes, stats.NotesWrong, refused)
}

func TestNoteEncoding(t *testing.T) {
	a, err := New(memory.New(), "h1")
	if err != nil {
		t.Fatal(err)
	}
	n := a.newNote("p")
	n.def.Value, n.def.Revision = []byte(`{"name":"p"}`), 3
	n.host.Value, n.host.Revision = []byte("\n3 4\nend\n"), 1234567890123
	n.host.Value = []byte(`{"u":3,"g":[{"s":"198.18.0.1","e":"198.18.0.8"}],"v":4}`)
	b := n.encode()
	got := a.newNote("p")
	if err := decodeNote(b, &got); err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(n, got, cmp.AllowUnexported(poolNote{})); diff != "" {
		t.Fatalf("round trip (-want +got):\n%s", diff)
	}
	for i := range len(b) {
		if decodeNote(b[:i], &got) == nil {
			t.Fatalf("a note cut at %d of %d bytes decodes", i, len(b))
		}
	}
	if decodeNote(append(b, 'x'), &got) == nil {
		t.Fatal("a note with trailing bytes decodes")
	}
	// A note written over its predecessor of the same length and cut
	// short by a crash: the new note's head, the old one's tail. Its
	// frames all parse (the state is as long in both), so only the sum
	// tells.
	m := n
	m.host.Value = []byte(`{"u":3,"g":[{"s":"198.18.0.1","e":"198.18.0.7"}],"v":4}`)
	newer := m.encode()
	if len(newer) != len(b) {
		t.Fatalf("notes of %d and %d bytes: the case needs equal lengths", len(newer), len(b))
	}
	for i := 1; i < len(b); i++ {
		mixed := append(bytes.Clone(newer[:i]), b[i:]...)
		if !bytes.Equal(mixed, b) && !bytes.Equal(mixed, newer) && decodeNote(mixed, &got) == nil {
			t.Fatalf("a note mixed with its predecessor at byte %d decodes: %q", i, mixed)
		}
	}
}

// A dual-stack request (two pools, one note each) and one with a
// reservation name commit on the notes too; a second host's claim in one
// of the pools spoils neither note, and the allocation still lands in
// this host's ranges.
func TestNotesWithTwoPoolsAndReservations(t *testing.T) {
	ctx := context.Background()
	st := &callLog{Store: memory.New()}
	a, err := New(st, "h1", WithNotes(&memNotes{}))
	if err != nil {
		t.Fatal(err)
	}
	defs := []Def{v4Def("p4", "198.18.0.0/24"), {Name: "p6", Ranges: []Range{{Subnet: mustPrefix("2001:db8::/120")}}}}
	wants := []Want{{Pool: "p4", Role: RoleIP}, {Pool: "p6", Role: RoleIP}}
	seen := map[netip.Addr]bool{}
	alloc := func(id, resv string, wantCalls []string) {
		t.Helper()
		got, err := a.Allocate(ctx, Request{Owner: own(id), Reservation: resv, Wants: wants, Defs: defs})
		if err != nil {
			t.Fatal(err)
		}
		if len(got.Addrs) != 2 || !got.Addrs[0].Addr.Is4() || !got.Addrs[1].Addr.Is6() {
			t.Fatalf("%s got %+v", id, got.Addrs)
		}
		for _, x := range got.Addrs {
			if seen[x.Addr] {
				t.Fatalf("%s got %s twice", id, x.Addr)
			}
			seen[x.Addr] = true
		}
		calls := st.take()
		if wantCalls != nil {
			if diff := cmp.Diff(wantCalls, calls); diff != "" {
				t.Fatalf("%s: round trips (-want +got):\n%s", id, diff)
			}
		}
	}
	alloc("c1", "", nil)
	alloc("c2", "", []string{"commit-or-get"})
	alloc("c3", "ns/c3", []string{"commit-or-get"})
	b, err := New(st, "h2")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.Allocate(ctx, Request{Owner: own("b1"), Wants: wants[1:], Defs: defs[1:]}); err != nil {
		t.Fatal(err)
	}
	st.take()
	// Layout 4: h2's claim takes an unowned block of p6 and changes
	// nothing h1's notes hold (in layout 3 it rewrote the ring, which
	// cost c4 a second round trip).
	alloc("c4", "", []string{"commit-or-get"})
	alloc("c5", "", []string{"commit-or-get"})
	for _, p := range []string{"p4", "p6"} {
		bad, err := a.Check(ctx, p)
		if err != nil {
			t.Fatal(err)
		}
		for _, x := range bad {
			t.Errorf("invariant in %s: %s", p, x)
		}
	}
}

// A host that fills its ranges while its note holds claims on the note:
// the plan then reads the whole noted ring, not the note's ranges of
// this host alone, and the ring it commits names real hosts only.
func TestNotesClaimOnTheWholeRing(t *testing.T) {
	ctx := context.Background()
	st := &callLog{Store: memory.New()}
	def := v4Def("p", "198.18.0.0/27")
	a, err := New(st, "h1", WithNotes(&memNotes{}))
	if err != nil {
		t.Fatal(err)
	}
	b, err := New(st, "h2")
	if err != nil {
		t.Fatal(err)
	}
	alloc := func(x *Allocator, id string) {
		t.Helper()
		if _, err := x.Allocate(ctx, Request{Owner: own(id), Wants: ipWant("p"), Defs: []Def{def}}); err != nil {
			t.Fatalf("%s: %v", id, err)
		}
	}
	alloc(a, "a0")
	alloc(b, "b0") // takes the upper half of h1's space
	claimsBefore, claimOnNote := a.Stats().Claims, false
	for i := 1; a.Stats().Claims == claimsBefore; i++ {
		if i > 40 {
			t.Fatal("h1 never claimed space")
		}
		before := a.Stats()
		alloc(a, fmt.Sprint("a", i))
		after := a.Stats()
		claimOnNote = after.OnNotes > before.OnNotes && after.NotesWrong == before.NotesWrong
	}
	if !claimOnNote {
		t.Fatalf("stats %+v: the claim was not made on the note", a.Stats())
	}
	r, err := a.RingOf(ctx, "p")
	if err != nil {
		t.Fatal(err)
	}
	for _, x := range r.Ranges {
		if x.Host != "" && x.Host != "h1" && x.Host != "h2" {
			t.Errorf("the ring names host %q: %+v", x.Host, r.Ranges)
		}
	}
	bad, err := a.Check(ctx, "p")
	if err != nil {
		t.Fatal(err)
	}
	for _, x := range bad {
		t.Errorf("invariant: %s", x)
	}
}
