package pool

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ringipam/ringipam/pkg/store/memory"
)

func TestHistoryShowsEveryHolder(t *testing.T) {
	ctx := context.Background()
	clk := &clock{now: time.Unix(1_800_000_000, 0)}
	a, _ := New(memory.New(), "h1", WithClock(clk.Now), WithReservationHold(time.Minute))
	if err := a.Define(ctx, v4Def("p", "198.18.5.0/24")); err != nil {
		t.Fatal(err)
	}
	addr := mustAddr("198.18.5.7")
	static := []Want{{Pool: "p", Role: RoleIP, Addr: addr}}
	step := func(f func() error) {
		t.Helper()
		if err := f(); err != nil {
			t.Fatal(err)
		}
		// A real clock's microseconds differ between events, which
		// spreads them over the history slots; this one does too.
		clk.advance(time.Second + time.Microsecond)
	}
	step(func() error { _, err := a.Allocate(ctx, Request{Owner: own("first"), Wants: static}); return err })
	step(func() error { _, _, err := a.Release(ctx, own("first")); return err })
	step(func() error {
		_, err := a.Allocate(ctx, Request{Owner: own("second"), Reservation: "ns/s", Wants: static})
		return err
	})
	step(func() error { _, _, err := a.Release(ctx, own("second")); return err })
	evs, err := a.History(ctx, "p", addr)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, e := range evs {
		got = append(got, e.What+" "+e.Owner)
	}
	want := []string{"alloc cni/net/first/eth0", "release cni/net/first/eth0", "alloc cni/net/second/eth0", "hold cni/net/second/eth0"}
	if len(got) != len(want) {
		t.Fatalf("history %v, want %v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("history %v, want %v", got, want)
		}
	}
	if n, err := a.CompactHistory(ctx, 2, 0); err != nil || n != 2 {
		t.Fatalf("CompactHistory kept 2 of 4: deleted %d, %v", n, err)
	}
	if evs, _ := a.History(ctx, "p", addr); len(evs) != 2 || evs[0].What != "alloc" || evs[1].What != "hold" {
		t.Fatalf("after compaction: %+v", evs)
	}
	clk.advance(time.Hour)
	if n, err := a.CompactHistory(ctx, 10, time.Minute); err != nil || n != 2 {
		t.Fatalf("CompactHistory by age: %d %v", n, err)
	}
}

// Quick changes of hands lose no event (they are keyed by time, never
// sharing a key), and compaction bounds the history however often an
// address changes hands, keeping the newest.
func TestHistoryKeepsEveryEventUntilCompacted(t *testing.T) {
	ctx := context.Background()
	a, _ := New(memory.New(), "h1")
	if err := a.Define(ctx, v4Def("p", "198.18.6.0/30")); err != nil { // .1, .2
		t.Fatal(err)
	}
	addr := mustAddr("198.18.6.1")
	for i := range 200 {
		if _, err := a.Allocate(ctx, Request{Owner: own(fmt.Sprint("c", i)), Wants: []Want{{Pool: "p", Role: RoleIP, Addr: addr}}}); err != nil {
			t.Fatal(err)
		}
		if _, _, err := a.Release(ctx, own(fmt.Sprint("c", i))); err != nil {
			t.Fatal(err)
		}
	}
	evs, err := a.History(ctx, "p", addr)
	if err != nil || len(evs) != 400 {
		t.Fatalf("%d events after 400 changes, want all 400: %v", len(evs), err)
	}
	for i, e := range evs {
		want := EventAlloc
		if i%2 == 1 {
			want = EventRelease
		}
		if e.What != want || e.Owner != own(fmt.Sprint("c", i/2)).String() {
			t.Fatalf("event %d is %s %s, want %s of c%d", i, e.What, e.Owner, want, i/2)
		}
	}
	if n, err := a.PlanCompactHistory(ctx, HistoryKeep, 0); err != nil || n != 400-HistoryKeep {
		t.Fatalf("plan: %d %v, want %d", n, err, 400-HistoryKeep)
	}
	if n, err := a.CompactHistory(ctx, HistoryKeep, 0); err != nil || n != 400-HistoryKeep {
		t.Fatalf("compaction deleted %d (%v), want %d", n, err, 400-HistoryKeep)
	}
	evs, err = a.History(ctx, "p", addr)
	if err != nil || len(evs) != HistoryKeep {
		t.Fatalf("%d events after compaction, want %d: %v", len(evs), HistoryKeep, err)
	}
	if last := evs[len(evs)-1]; last.What != EventRelease || last.Owner != own("c199").String() {
		t.Fatalf("newest event %+v, want the last release", last)
	}
}
