package pool

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/memory"
)

// raw reads one key of st (nil: absent).
func raw(t *testing.T, st store.Store, key string) []byte {
	t.Helper()
	kvs, err := st.Get(context.Background(), key)
	if err != nil {
		t.Fatal(err)
	}
	if !kvs[0].Exists() {
		return nil
	}
	return kvs[0].Value
}

// TestHeartbeatWritesOnlyWhatChanged: the host record is written when it
// is absent or the address changes, never on a timer; the status record's
// last-seen time once per SeenEvery; an idle heartbeat is one read.
func TestHeartbeatWritesOnlyWhatChanged(t *testing.T) {
	ctx := context.Background()
	st := &readCounter{Store: memory.New()}
	clk := &clock{now: time.Date(2026, 11, 1, 0, 0, 0, 0, time.UTC)}
	a, _ := New(st, "h", WithClock(clk.Now), WithSeenEvery(time.Hour))
	if _, err := a.Heartbeat(ctx, "198.18.0.1", nil); err != nil {
		t.Fatal(err)
	}
	rec0, stat0 := raw(t, st, "n/h"), raw(t, st, "s/h")
	if rec0 == nil || stat0 == nil {
		t.Fatalf("first heartbeat: host record %q, status %q", rec0, stat0)
	}
	for range 10 {
		clk.advance(5 * time.Minute)
		before := st.commits
		reads := st.gets + st.scans
		if _, err := a.Heartbeat(ctx, "198.18.0.1", &RoutesSummary{}); err != nil {
			t.Fatal(err)
		}
		if st.commits != before || st.gets+st.scans != reads+1 {
			t.Fatalf("an idle heartbeat within SeenEvery: %d commits, %d reads", st.commits-before, st.gets+st.scans-reads)
		}
	}
	clk.advance(11 * time.Minute) // 61 minutes since the last write
	if _, err := a.Heartbeat(ctx, "198.18.0.1", nil); err != nil {
		t.Fatal(err)
	}
	if string(raw(t, st, "n/h")) != string(rec0) {
		t.Fatalf("host record rewritten on a timer: %s, was %s", raw(t, st, "n/h"), rec0)
	}
	var s hostStatus
	_ = json.Unmarshal(raw(t, st, "s/h"), &s)
	if s.Seen != clk.Now().Unix() {
		t.Fatalf("status record's last seen %d, want %d (SeenEvery passed)", s.Seen, clk.Now().Unix())
	}
	// A new address is a change of the host record.
	if _, err := a.Heartbeat(ctx, "198.18.0.2", nil); err != nil {
		t.Fatal(err)
	}
	var r hostRecord
	_ = json.Unmarshal(raw(t, st, "n/h"), &r)
	if r.Addr != "198.18.0.2" {
		t.Fatalf("host record after an address change: %+v", r)
	}
	// The routes summary goes to the status record, written on change only.
	sum := RoutesSummary{Held: 2, Digest: "d1", At: 1}
	if err := a.ReportRoutes(ctx, sum); err != nil {
		t.Fatal(err)
	}
	before := st.commits
	sum.At = 2
	if err := a.ReportRoutes(ctx, sum); err != nil {
		t.Fatal(err)
	}
	if st.commits != before {
		t.Fatal("an unchanged routes summary (but its time) was written again")
	}
	hosts, err := a.Hosts(ctx, 0)
	if err != nil || len(hosts) != 1 || hosts[0].Routes == nil || hosts[0].Routes.Digest != "d1" {
		t.Fatalf("hosts: %+v %v", hosts, err)
	}
	if raw(t, st, "n/h") == nil || json.Unmarshal(raw(t, st, "n/h"), &r) != nil || r.Routes != nil {
		t.Fatalf("routes summary in the watched host record: %+v", r)
	}
}

// TestLastSeenReadsBothRecords: a host record written by an older agent
// (last seen in n/) still counts, and so does the status record.
func TestLastSeenReadsBothRecords(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	clk := &clock{now: time.Date(2026, 11, 1, 0, 0, 0, 0, time.UTC)}
	old := time.Date(2026, 10, 1, 0, 0, 0, 0, time.UTC).Unix()
	newer := clk.Now().Add(-time.Hour).Unix()
	b, _ := json.Marshal(hostRecord{Addr: "198.18.0.1", Seen: newer})
	s, _ := json.Marshal(hostStatus{Seen: old})
	if err := st.Commit(ctx, nil, []store.Op{store.Put("n/old", b), store.Put("s/old", s)}); err != nil {
		t.Fatal(err)
	}
	b, _ = json.Marshal(hostRecord{Addr: "198.18.0.2", Seen: old})
	s, _ = json.Marshal(hostStatus{Checked: newer})
	if err := st.Commit(ctx, nil, []store.Op{store.Put("n/new", b), store.Put("s/new", s)}); err != nil {
		t.Fatal(err)
	}
	a, _ := New(st, "judge", WithClock(clk.Now))
	hosts, err := a.Hosts(ctx, 48*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	for _, h := range hosts {
		if h.LastSeen.Unix() != newer || h.State != HostDown {
			t.Errorf("%s: last seen %s (%s), want %s and down", h.Name, h.LastSeen, h.State, time.Unix(newer, 0))
		}
	}
}

// TestSweeperSkipsReclaimedHostsAndRemovesThemAfterTheRetention: a host
// reclaimed with nothing left is not read again; its records go after the
// retention; a host that came back keeps its records.
func TestSweeperSkipsReclaimedHostsAndRemovesThemAfterTheRetention(t *testing.T) {
	ctx := context.Background()
	st := &readCounter{Store: memory.New()}
	clk := &clock{now: time.Date(2026, 11, 1, 0, 0, 0, 0, time.UTC)}
	for _, h := range []string{"gone", "back"} {
		a, _ := New(st, h, WithClock(clk.Now))
		if _, err := a.Allocate(ctx, Request{Owner: hostOwner(h, 1), Wants: ipWant("p"), Defs: []Def{v4Def("p", "198.18.5.0/28")}}); err != nil {
			t.Fatal(err)
		}
		if _, err := a.Heartbeat(ctx, "198.18.0.1", nil); err != nil {
			t.Fatal(err)
		}
	}
	leader, _ := New(st, "leader", WithClock(clk.Now))
	markLive(t, st, "leader")
	sw := &Sweeper[struct{}]{Alloc: leader, Options: SweepOptions{OrphanAfter: time.Hour}}
	clk.advance(2 * time.Hour)
	rep, err := sw.Sweep(ctx)
	if err != nil || len(rep.Reclaims) != 2 {
		t.Fatalf("first sweep: %+v %v", rep, err)
	}
	if rep, err = sw.Sweep(ctx); err != nil || len(rep.Reclaims) != 0 || rep.Skipped != 0 {
		t.Fatalf("second sweep (finds nothing left): %+v %v", rep, err)
	}
	reads := st.gets + st.scans
	rep, err = sw.Sweep(ctx)
	if err != nil || rep.Skipped != 2 {
		t.Fatalf("third sweep: %+v %v", rep, err)
	}
	// Hosts is five scans (n/, s/, l/, h/, g/) and the layout read; nothing per host.
	if n := st.gets + st.scans - reads; n > 6 {
		t.Fatalf("a sweep of reclaimed hosts read %d times", n)
	}
	markLive(t, st, "back")
	clk.advance(DefaultRetention(time.Hour))
	if rep, err = sw.Sweep(ctx); err != nil || len(rep.Removed) != 0 {
		t.Fatalf("sweep at the end of the retention: %+v %v", rep, err)
	}
	clk.advance(time.Minute)
	if rep, err = sw.Sweep(ctx); err != nil || len(rep.Removed) != 1 || rep.Removed[0] != "gone" {
		t.Fatalf("sweep after the retention: %+v %v", rep, err)
	}
	for key, want := range map[string]bool{"n/gone": false, "s/gone": false, "n/back": true, "s/back": true} {
		if got := raw(t, st, key) != nil; got != want {
			t.Errorf("%s present %v, want %v", key, got, want)
		}
	}
	// A removed host known only by its tombstones is not marked again.
	if rep, err = sw.Sweep(ctx); err != nil || len(rep.Reclaims) != 0 {
		t.Fatalf("sweep after the removal: %+v %v", rep, err)
	}
	fresh := &Sweeper[struct{}]{Alloc: leader, Options: SweepOptions{OrphanAfter: time.Hour}}
	if rep, err = fresh.Sweep(ctx); err != nil || len(rep.Reclaims) != 0 {
		t.Fatalf("a new leader's sweep after the removal: %+v %v", rep, err)
	}
	if raw(t, st, "n/gone") != nil {
		t.Fatal("the removed host's record written again")
	}
}

// TestOwnUsageReadsOwnKeys: a host's own figures, from its own state in
// each pool only.
func TestOwnUsageReadsOwnKeys(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	for i, h := range []string{"a", "b", "b"} {
		x, _ := New(st, h)
		if _, err := x.Allocate(ctx, Request{Owner: hostOwner(h, i), Wants: ipWant("p"), Defs: []Def{v4Def("p", "198.18.5.0/28")}}); err != nil {
			t.Fatal(err)
		}
	}
	b, _ := New(st, "b")
	use, err := b.OwnUsage(ctx)
	if err != nil || len(use) != 1 || use[0].Pool != "p" || use[0].Used != 2 {
		t.Fatalf("b's own usage: %+v %v", use, err)
	}
}
