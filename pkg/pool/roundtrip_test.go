package pool

import (
	"context"
	"testing"

	"github.com/ringipam/ringipam/pkg/store/memory"
)

// Round trips of the CNI verbs as a fresh plugin process makes them (a new
// Allocator per call, so the layout check rides on the first read): ADD 2,
// DEL 2 with the configured pools as hint (3 without), CHECK 1 (2 once a
// minute at most, refreshing the host's last-seen time).
func TestRoundTripsPerVerb(t *testing.T) {
	ctx := context.Background()
	st := &callLog{Store: memory.New()}
	def := v4Def("p", "198.18.0.0/24")
	proc := func() *Allocator { a, _ := New(st, "h1"); return a }
	for i := range 3 { // warm up: definition, first claim, first scan
		if _, err := proc().Allocate(ctx, Request{Owner: own(string(rune('a' + i))), Wants: ipWant("p"), Defs: []Def{def}}); err != nil {
			t.Fatal(err)
		}
	}
	st.take()
	if _, err := proc().Allocate(ctx, Request{Owner: own("x"), Reservation: "ns/x", Wants: ipWant("p"), Defs: []Def{def}}); err != nil {
		t.Fatal(err)
	}
	if n := len(st.take()); n != 2 {
		t.Errorf("ADD: %d round trips, want 2", n)
	}
	// The first CHECK of the minute also refreshes the host's last-seen
	// time: one write.
	if _, ok, err := proc().Lookup(ctx, own("x")); err != nil || !ok {
		t.Fatal(ok, err)
	}
	if n := len(st.take()); n != 2 {
		t.Errorf("first CHECK: %d round trips, want 2 (the read, the last-seen write)", n)
	}
	if _, ok, err := proc().Lookup(ctx, own("x")); err != nil || !ok {
		t.Fatal(ok, err)
	}
	if n := len(st.take()); n != 1 {
		t.Errorf("CHECK: %d round trips, want 1", n)
	}
	if _, ok, err := proc().ReleaseWith(ctx, own("x"), ReleaseHint{Pools: []string{"p"}, Reservation: "ns/x"}); err != nil || !ok {
		t.Fatal(ok, err)
	}
	if n := len(st.take()); n != 2 {
		t.Errorf("DEL with the hint: %d round trips, want 2", n)
	}
	if _, ok, err := proc().Release(ctx, own("a")); err != nil || !ok {
		t.Fatal(ok, err)
	}
	if n := len(st.take()); n != 3 {
		t.Errorf("DEL without a hint: %d round trips, want 3", n)
	}
	if _, ok, err := proc().Release(ctx, own("nobody")); err != nil || ok {
		t.Fatal(ok, err)
	}
	if n := len(st.take()); n != 1 {
		t.Errorf("DEL of an owner that holds nothing: %d round trips, want 1", n)
	}
}
