package pool

import (
	"context"
	"testing"
	"time"

	"github.com/ringipam/ringipam/pkg/store/memory"
)

// TestVerbsThatChangeNothingKeepTheHostSeen: a host without an agent whose
// only activity, day after day, is a replayed ADD, a DEL of nothing, a GC
// that keeps everything, a STATUS, a CHECK or a Docker driver's call (a
// definition read) stays seen and is never orphaned; each such verb costs
// no extra round trip while the host's last-seen time is fresh, and one
// conditional write when it is older than LastSeenEvery. A fresh Allocator
// per verb, as a plugin process has.
func TestVerbsThatChangeNothingKeepTheHostSeen(t *testing.T) {
	ctx := context.Background()
	st := &readCounter{Store: memory.New()}
	clk := &clock{now: time.Date(2026, 11, 1, 0, 0, 0, 0, time.UTC)}
	proc := func() *Allocator {
		a, err := New(st, "quiet", WithClock(clk.Now), WithLastSeen())
		if err != nil {
			t.Fatal(err)
		}
		return a
	}
	owner := hostOwner("quiet", 1)
	add := Request{Owner: owner, Wants: ipWant("p"), Defs: []Def{v4Def("p", "198.18.5.0/28")}}
	if _, err := proc().Allocate(ctx, add); err != nil {
		t.Fatal(err)
	}
	judge, _ := New(st, "judge", WithClock(clk.Now))
	verbs := []struct {
		name string
		run  func(a *Allocator) error
	}{
		{"replayed ADD", func(a *Allocator) error { _, err := a.Allocate(ctx, add); return err }},
		{"DEL of nothing", func(a *Allocator) error { _, _, err := a.Release(ctx, hostOwner("quiet", 2)); return err }},
		{"GC keeping everything", func(a *Allocator) error {
			_, err := a.GC(ctx, KindCNI, "net", []Owner{owner})
			return err
		}},
		{"STATUS", func(a *Allocator) error { _, err := a.Orphaned(ctx); return err }},
		{"CHECK of nothing", func(a *Allocator) error { _, _, err := a.Lookup(ctx, hostOwner("quiet", 3)); return err }},
		{"driver's definition read", func(a *Allocator) error { _, err := a.Definition(ctx, "p"); return err }},
		{"GC without a list", func(a *Allocator) error { return a.RefreshSeen(ctx) }},
	}
	for _, v := range verbs {
		// Stale: a day of silence, then the verb refreshes with one write.
		clk.advance(24 * time.Hour)
		st.reset()
		if err := v.run(proc()); err != nil {
			t.Fatalf("%s: %v", v.name, err)
		}
		if st.commits != 1 {
			t.Errorf("%s with a stale last-seen: %d commits, want 1 (the last-seen write)", v.name, st.commits)
		}
		hosts, err := judge.Hosts(ctx, 48*time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		for _, h := range hosts {
			if h.Name == "quiet" && !h.LastSeen.Equal(clk.Now()) {
				t.Errorf("%s did not refresh the host's last-seen time: %s, now %s", v.name, h.LastSeen, clk.Now())
			}
		}
		// Fresh: the same verb within the minute writes nothing and reads
		// what it read anyway.
		clk.advance(LastSeenEvery - time.Second)
		fresh := proc()
		st.reset()
		if err := v.run(fresh); err != nil {
			t.Fatal(err)
		}
		if st.commits != 0 {
			t.Errorf("%s with a fresh last-seen: %d commits, want 0", v.name, st.commits)
		}
		// Two days later the judge's sweep finds the host seen.
		clk.advance(24*time.Hour + time.Second - LastSeenEvery)
		if _, err := judge.Sweep(ctx, 48*time.Hour); err != nil {
			t.Fatal(err)
		}
		if _, ok, _ := judge.Lookup(ctx, owner); !ok {
			t.Fatalf("after %s the quiet host's owner was reclaimed", v.name)
		}
	}
}

// TestLastSeenRidesOnTheVerbsRead: with WithLastSeen the read of each verb
// carries the host record, so no verb makes an extra round trip while the
// last-seen time is fresh (counted per request kind).
func TestLastSeenRidesOnTheVerbsRead(t *testing.T) {
	ctx := context.Background()
	st := &readCounter{Store: memory.New()}
	clk := &clock{now: time.Date(2026, 11, 1, 0, 0, 0, 0, time.UTC)}
	a, _ := New(st, "h", WithClock(clk.Now), WithLastSeen())
	owner := hostOwner("h", 1)
	add := Request{Owner: owner, Wants: ipWant("p"), Defs: []Def{v4Def("p", "198.18.6.0/28")}}
	if _, err := a.Allocate(ctx, add); err != nil {
		t.Fatal(err)
	}
	if err := a.RefreshSeen(ctx); err != nil { // the record is fresh from here
		t.Fatal(err)
	}
	for _, v := range []struct {
		name                 string
		run                  func() error
		gets, scans, commits int
	}{
		{"replayed ADD", func() error { _, err := a.Allocate(ctx, add); return err }, 1, 0, 0},
		{"DEL of nothing", func() error { _, _, err := a.Release(ctx, hostOwner("h", 2)); return err }, 1, 0, 0},
		{"GC keeping everything", func() error { _, err := a.GC(ctx, KindCNI, "net", []Owner{owner}); return err }, 1, 1, 0},
		{"STATUS", func() error { _, err := a.Orphaned(ctx); return err }, 1, 0, 0},
		{"CHECK", func() error { _, _, err := a.Lookup(ctx, owner); return err }, 1, 0, 0},
		{"definition", func() error { _, err := a.Definition(ctx, "p"); return err }, 1, 0, 0},
	} {
		st.reset()
		if err := v.run(); err != nil {
			t.Fatal(err)
		}
		if st.gets != v.gets || st.scans != v.scans || st.commits != v.commits {
			t.Errorf("%s: %d gets, %d scans, %d commits; want %d, %d, %d", v.name, st.gets, st.scans, st.commits, v.gets, v.scans, v.commits)
		}
	}
}
