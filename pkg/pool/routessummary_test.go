package pool

import (
	"context"
	"net/netip"
	"reflect"
	"testing"
	"time"

	"github.com/ringipam/ringipam/pkg/store/memory"
)

// TestRoutesSummaryInHostRecord: the routes summary a heartbeat carries is
// kept in the host record and reported by Hosts; a heartbeat without one
// keeps it, a verb's last-seen refresh (which rewrites the record) keeps
// it, and an empty one removes it.
func TestRoutesSummaryInHostRecord(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	clk := &clock{now: time.Unix(1_800_000_000, 0)}
	a, _ := New(st, "host-a", WithClock(clk.Now), WithLastSeen())
	admin, _ := New(st, "admin", WithClock(clk.Now))
	summary := func() *RoutesSummary {
		t.Helper()
		hs, err := admin.Hosts(ctx, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, h := range hs {
			if h.Name == "host-a" {
				return h.Routes
			}
		}
		t.Fatalf("host-a not in %+v", hs)
		return nil
	}
	if _, err := a.Heartbeat(ctx, "198.18.0.1", nil); err != nil {
		t.Fatal(err)
	}
	if got := summary(); got != nil {
		t.Fatalf("summary before any was written: %+v", got)
	}
	want := &RoutesSummary{Held: 3, Failed: 1, Refused: 2, Digest: "0123456789abcdef",
		OnLink: []netip.Prefix{netip.MustParsePrefix("198.18.0.1/24")}, At: clk.Now().Unix()}
	if _, err := a.Heartbeat(ctx, "198.18.0.1", want); err != nil {
		t.Fatal(err)
	}
	if got := summary(); !reflect.DeepEqual(got, want) {
		t.Fatalf("summary %+v, want %+v", got, want)
	}
	if _, err := a.Heartbeat(ctx, "198.18.0.1", nil); err != nil {
		t.Fatal(err)
	}
	clk.advance(2 * LastSeenEvery)
	if err := a.RefreshSeen(ctx); err != nil { // rewrites the record (Checked)
		t.Fatal(err)
	}
	if hs, _ := admin.Hosts(ctx, 0); len(hs) != 1 || !hs[0].LastSeen.Equal(clk.Now()) {
		t.Fatalf("the last-seen refresh did not rewrite the record: %+v", hs)
	}
	if got := summary(); !reflect.DeepEqual(got, want) {
		t.Fatalf("summary after a heartbeat without one and a last-seen refresh: %+v, want %+v", got, want)
	}
	if _, err := a.Heartbeat(ctx, "", &RoutesSummary{}); err != nil {
		t.Fatal(err)
	}
	if got := summary(); got != nil {
		t.Fatalf("summary after removal: %+v", got)
	}
}
