package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/portalloc"
	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/memory"
	"github.com/ringipam/ringipam/pkg/storeconfig"
)

var addrCmp = cmpopts.EquateComparable(netip.Addr{})

type clock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *clock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.now }
func (c *clock) advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

// world is a memory store with three hosts' allocations on one dual-stack
// network, and a Ctl acting as host "admin".
type world struct {
	ctl   *Ctl
	hosts map[string]*pool.Allocator
	clk   *clock
	defs  []pool.Def
}

func newWorld(t *testing.T) *world {
	t.Helper()
	st := memory.New()
	clk := &clock{now: time.Unix(1_800_000_000, 0)}
	w := &world{hosts: map[string]*pool.Allocator{}, clk: clk, defs: []pool.Def{
		{Name: "net-0", Ranges: []pool.Range{{Subnet: netip.MustParsePrefix("198.18.0.0/24"), Gateway: netip.MustParseAddr("198.18.0.1")}}},
		{Name: "net-1", Ranges: []pool.Range{{Subnet: netip.MustParsePrefix("2001:db8:1::/64"), Gateway: netip.MustParseAddr("2001:db8:1::1")}}},
	}}
	newPool := func(h string) (*pool.Allocator, error) { return pool.New(st, h, pool.WithClock(clk.Now)) }
	for _, h := range []string{"node-a", "node-b", "node-c"} {
		a, _ := newPool(h)
		w.hosts[h] = a
		for i := range 3 {
			req := pool.Request{Owner: owner(h, i), Wants: []pool.Want{{Pool: "net-0", Role: pool.RoleIP}, {Pool: "net-1", Role: pool.RoleIP}}, Defs: w.defs}
			if i == 0 {
				req.Reservation = "ns/" + h
			}
			if _, err := a.Allocate(context.Background(), req); err != nil {
				t.Fatal(err)
			}
		}
	}
	admin, _ := newPool("admin")
	ports, _ := portalloc.New(st, "node-c")
	w.ctl = &Ctl{Pool: admin, Ports: ports, Store: st, StoreDesc: "memory", OrphanAfter: pool.DefaultOrphanAfter, Now: clk.Now, NewPool: newPool}
	return w
}

func owner(host string, i int) pool.Owner {
	return pool.Owner{Kind: pool.KindCNI, Network: "net", ContainerID: fmt.Sprintf("%s-%d", host, i), IfName: "eth0"}
}

func checkWidth(t *testing.T, out string) {
	t.Helper()
	for _, l := range strings.Split(out, "\n") {
		if n := len([]rune(l)); n > MaxColumns {
			t.Errorf("line of %d columns: %q", n, l)
		}
	}
}

func TestStatusAndLs(t *testing.T) {
	ctx := context.Background()
	w := newWorld(t)
	s, err := w.ctl.Status(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	if len(s.Pools) != 2 || len(s.Hosts) != 3 {
		t.Fatalf("status: %d pools, %d hosts", len(s.Pools), len(s.Hosts))
	}
	p4 := s.Pools[0]
	if p4.Name != "net-0" || p4.Family != "IPv4" || p4.Size != "253" || p4.Used != 9 || p4.Free != "244" || p4.Held != 0 {
		t.Errorf("pool net-0: %+v", p4)
	}
	if p6 := s.Pools[1]; p6.Family != "IPv6" || p6.Size != "18446744073709551614" || p6.Used != 9 {
		t.Errorf("pool net-1: %+v", p6)
	}
	var rangeUse uint64
	for _, r := range p4.Ranges {
		rangeUse += r.Used
	}
	if rangeUse != 9 {
		t.Errorf("ranges of net-0 account for %d used addresses, want 9", rangeUse)
	}
	for _, h := range s.Hosts {
		if h.State != "down" || h.Used != 6 || h.Ranges != 2 || !h.LastSeen.Equal(w.clk.Now()) {
			t.Errorf("host %+v", h)
		}
	}
	var out bytes.Buffer
	RenderStatus(&out, s)
	checkWidth(t, out.String())
	// Layout 4: three hosts' blocks of 64 and the unowned space between
	// them (in layout 3, three ranges covering the pool).
	for _, want := range []string{"net-0", "IPv4", "253", "244", "A  node-a  down", "ring net-0: 198.18.0.2 - 198.18.0.254, 4 ranges"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("status text lacks %q:\n%s", want, out.String())
		}
	}

	// A released reservation is a hold: counted as held, listed as such.
	if _, _, err := w.hosts["node-a"].Release(ctx, owner("node-a", 0)); err != nil {
		t.Fatal(err)
	}
	s, _ = w.ctl.Status(ctx, "net-0")
	if len(s.Pools) != 1 || s.Pools[0].Used != 8 || s.Pools[0].Held != 1 || s.Pools[0].Free != "244" {
		t.Fatalf("after release: %+v", s.Pools)
	}
	rows, err := w.ctl.Ls(ctx, LsFilter{Pool: "net-0"})
	if err != nil || len(rows) != 9 {
		t.Fatalf("ls: %d rows, %v", len(rows), err)
	}
	holds := slices.DeleteFunc(slices.Clone(rows), func(r AddrRow) bool { return r.Owner != nil })
	if len(holds) != 1 || holds[0].Reservation != "ns/node-a" || holds[0].HeldUntil.IsZero() || holds[0].Host != "node-a" {
		t.Fatalf("holds in ls: %+v", holds)
	}
	m, _ := ParseOwnerMatch("cni/net/node-b")
	rows, _ = w.ctl.Ls(ctx, LsFilter{Owner: &m})
	if len(rows) != 6 {
		t.Fatalf("ls --owner cni/net/node-b: %d rows, want 6 (3 owners, 2 families)", len(rows))
	}
	for _, r := range rows {
		if r.Host != "node-b" || r.Owner == nil || r.Role != pool.RoleIP || !r.Since.Equal(w.clk.Now()) {
			t.Errorf("row %+v", r)
		}
	}
	out.Reset()
	RenderLs(&out, rows, w.clk.Now())
	checkWidth(t, out.String())
	if _, err := w.ctl.Ls(ctx, LsFilter{Pool: "nope"}); ExitCode(err) != ExitFailed {
		t.Errorf("ls of an unknown pool: %v", err)
	}
}

func TestOwnerMatch(t *testing.T) {
	o := pool.Owner{Kind: pool.KindCNI, Network: "net1", ContainerID: "3f2a9c", IfName: "eth0"}
	for _, c := range []struct {
		in   string
		want bool
	}{
		{"cni", true}, {"cni/net1", true}, {"net1", true}, {"cni/net1/3f2a", true}, {"net1/3f2a9c/eth0", true},
		{"docker", false}, {"cni/net2", false}, {"cni/net1/3f2a9c/eth1", false}, {"cni/net1/x", false}, {"cni/net", false},
	} {
		m, err := ParseOwnerMatch(c.in)
		if err != nil {
			t.Fatalf("%s: %v", c.in, err)
		}
		if got := m.Matches(o); got != c.want {
			t.Errorf("%s matches %s: %v, want %v", c.in, o, got, c.want)
		}
	}
	for _, bad := range []string{"", "cni//x", "a/b/c/d/e"} {
		if _, err := ParseOwnerMatch(bad); ExitCode(err) != ExitUsage {
			t.Errorf("ParseOwnerMatch(%q): %v, want a usage error", bad, err)
		}
	}
}

func TestRingBar(t *testing.T) {
	letters := func(h string) byte { return map[string]byte{"a": 'A', "b": 'B'}[h] }
	rs := []RangeStatus{
		{Host: "a", Size: "1000"},
		{Host: "", Size: "1"}, // tiny: still one character
		{Host: "b", Size: "3000", Tombstone: true},
	}
	bar := ringBar(rs, letters, 40)
	if len(bar) != 40 || !strings.HasPrefix(bar, "AAAAAAAAA") || strings.Count(bar, ".") != 1 || !strings.HasSuffix(bar, "bbbbbbbbbbbbbbbbbbbbbbbbbbbbb") {
		t.Fatalf("bar %q", bar)
	}
	// More ranges than characters: proportional, still exactly width.
	var many []RangeStatus
	for i := range 100 {
		many = append(many, RangeStatus{Host: []string{"a", "b"}[i%2], Size: "7"})
	}
	if bar := ringBar(many, letters, 30); len(bar) != 30 {
		t.Fatalf("bar of 100 ranges: %q", bar)
	}
	// An IPv6 ring far beyond 64 bits.
	huge := []RangeStatus{{Host: "a", Size: "1208925819614629174706176"}, {Host: "b", Size: "1208925819614629174706176"}}
	if bar := ringBar(huge, letters, 10); bar != "AAAAABBBBB" {
		t.Fatalf("bar of a /48: %q", bar)
	}
}

func TestReleaseDryRunIsTheRun(t *testing.T) {
	ctx := context.Background()
	w := newWorld(t)
	m, _ := ParseOwnerMatch("cni/net/node-b")
	dry, err := w.ctl.Release(ctx, ReleaseArgs{Owner: &m}, true)
	if err != nil || len(dry.Actions) != 3 {
		t.Fatalf("dry run: %+v %v", dry, err)
	}
	if again, _ := w.ctl.Release(ctx, ReleaseArgs{Owner: &m}, true); !cmp.Equal(again.Actions, dry.Actions, addrCmp) {
		t.Fatal("a dry run changed something")
	}
	real, err := w.ctl.Release(ctx, ReleaseArgs{Owner: &m}, false)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(dry.Actions, real.Actions, addrCmp); diff != "" {
		t.Fatalf("real run differs from the dry run:\n%s", diff)
	}
	if !strings.Contains(ActionLine(real.Actions[0]), "then held for reservation ns/node-b for 10m0s") {
		t.Errorf("release of a reservation holder: %q", ActionLine(real.Actions[0]))
	}
	if left, _ := w.ctl.Pool.List(ctx, pool.Filter{Host: "node-b"}); len(left) != 0 {
		t.Fatalf("node-b still holds %+v", left)
	}
	// By address; then the address is free and a second release is a no-op.
	rec, _, _ := w.ctl.Pool.Lookup(ctx, owner("node-a", 1))
	addr := rec.Addrs[0].Addr
	if a, err := w.ctl.Release(ctx, ReleaseArgs{Addr: addr}, false); err != nil || len(a.Actions) != 1 || a.Actions[0].Target != owner("node-a", 1).String() {
		t.Fatalf("release %s: %+v %v", addr, a, err)
	}
	if a, err := w.ctl.Release(ctx, ReleaseArgs{Addr: addr}, false); err != nil || len(a.Actions) != 0 {
		t.Fatalf("second release %s: %+v %v", addr, a, err)
	}
	// A held address is refused, naming the hold drop to run.
	rec, _, _ = w.ctl.Pool.Lookup(ctx, owner("node-b", 0))
	held, _ := w.ctl.Pool.Held(ctx, "net-0")
	var hold netip.Addr
	for _, h := range held {
		if h.Hold != nil && h.Hold.Reservation == "ns/node-b" {
			hold = h.Addr
		}
	}
	_, err = w.ctl.Release(ctx, ReleaseArgs{Addr: hold}, false)
	if ExitCode(err) != ExitFailed || !strings.Contains(fmt.Sprint(err), "ringctl hold drop ns/node-b --kind cni --network net") {
		t.Fatalf("release of a hold: %v", err)
	}
	// hold drop: dry run, then the same for real.
	hd, err := w.ctl.HoldDrop(ctx, pool.KindCNI, "net", "ns/node-b", true)
	if err != nil || len(hd.Actions) != 2 {
		t.Fatalf("hold drop dry run: %+v %v", hd, err)
	}
	hr, err := w.ctl.HoldDrop(ctx, pool.KindCNI, "net", "ns/node-b", false)
	if err != nil || !cmp.Equal(hd.Actions, hr.Actions, addrCmp) {
		t.Fatalf("hold drop: %+v %v, dry run said %+v", hr, err, hd)
	}
	if v, err := w.ctl.Pool.Audit(ctx); err != nil || len(v) != 0 {
		t.Fatalf("audit after releases: %v %v", v, err)
	}
}

func TestGCDryRunIsTheRun(t *testing.T) {
	ctx := context.Background()
	w := newWorld(t)
	// node-c published ports; node-a released a reservation (a hold).
	id := portalloc.EndpointID{Network: "net", ContainerID: "node-c-1", IfName: "eth0"}
	if _, err := w.ctl.Ports.Allocate(ctx, id, []portalloc.Port{{Mode: portalloc.Ingress, Protocol: "tcp", Number: 30080}}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := w.hosts["node-a"].Release(ctx, owner("node-a", 0)); err != nil {
		t.Fatal(err)
	}
	if a, err := w.ctl.GC(ctx, true); err != nil || len(a.Actions) != 0 {
		t.Fatalf("gc with nothing to do: %+v %v", a, err)
	}
	// node-a and node-b stay alive; node-c is gone for longer than orphanAfter.
	w.clk.advance(pool.DefaultOrphanAfter / 2)
	for _, h := range []string{"node-a", "node-b"} {
		if _, err := w.hosts[h].Heartbeat(ctx, "", nil); err != nil {
			t.Fatal(err)
		}
	}
	w.clk.advance(pool.DefaultOrphanAfter/2 + time.Minute)
	dry, err := w.ctl.GC(ctx, true)
	if err != nil {
		t.Fatal(err)
	}
	var lines []string
	for _, a := range dry.Actions {
		lines = append(lines, a.Do+" "+a.Target)
	}
	want := []string{
		"reclaim node-c",
		"release " + owner("node-c", 0).String(), "release " + owner("node-c", 1).String(), "release " + owner("node-c", 2).String(),
		"release-ports port/net/node-c-1/eth0",
		"drop-ended-hold reservation ns/node-a (cni network net)", // its IPv4 address
		"drop-ended-hold reservation ns/node-a (cni network net)", // and its IPv6 one
	}
	if diff := cmp.Diff(want, lines); diff != "" {
		t.Fatalf("gc dry run:\n%s", diff)
	}
	real, err := w.ctl.GC(ctx, false)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(dry.Actions, real.Actions, addrCmp); diff != "" {
		t.Fatalf("gc did other than its dry run said:\n%s", diff)
	}
	if rows, _ := w.ctl.PortsList(ctx, PortFilter{}); len(rows) != 0 {
		t.Fatalf("ports left after gc: %+v", rows)
	}
	if again, err := w.ctl.GC(ctx, true); err != nil || len(again.Actions) != 0 {
		t.Fatalf("gc after gc: %+v %v", again, err)
	}
	// The orphaned host acknowledges.
	ack, err := w.ctl.HostAck(ctx, "node-c")
	if err != nil || len(ack.Actions) != 1 {
		t.Fatalf("host ack: %+v %v", ack, err)
	}
	if v, err := w.ctl.Pool.Audit(ctx); err != nil || len(v) != 0 {
		t.Fatalf("audit after gc: %v %v", v, err)
	}
}

func TestRmpeer(t *testing.T) {
	ctx := context.Background()
	w := newWorld(t)
	// A live host is refused unless forced.
	if err := w.ctl.Store.Commit(ctx, nil, []store.Op{store.Put(pool.LivenessKey("node-a"), []byte("lease"))}); err != nil {
		t.Fatal(err)
	}
	if _, err := w.ctl.Rmpeer(ctx, RmpeerArgs{Host: "node-a"}, true); ExitCode(err) != ExitFailed || !errors.Is(err, pool.ErrHostLive) {
		t.Fatalf("rmpeer of a live host: %v", err)
	}
	if a, err := w.ctl.Rmpeer(ctx, RmpeerArgs{Host: "node-a", Force: true, Tombstone: true}, true); err != nil || len(a.Actions) != 4 {
		t.Fatalf("forced rmpeer dry run: %+v %v", a, err)
	}
	dry, err := w.ctl.Rmpeer(ctx, RmpeerArgs{Host: "node-b"}, true)
	if err != nil {
		t.Fatal(err)
	}
	real, err := w.ctl.Rmpeer(ctx, RmpeerArgs{Host: "node-b"}, false)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(dry.Actions, real.Actions, addrCmp); diff != "" {
		t.Fatalf("rmpeer did other than its dry run said:\n%s", diff)
	}
	if got := real.Actions[len(real.Actions)-1]; got.Do != "hand-over" || got.Host != "admin" {
		t.Fatalf("last action %+v, want the hand-over to admin", got)
	}
	r, _ := w.ctl.Pool.RingOf(ctx, "net-0")
	for _, x := range r.Ranges {
		if x.Host == "node-b" && !x.Tombstone {
			t.Fatalf("node-b still owns %+v", x)
		}
	}
	if _, err := w.ctl.Rmpeer(ctx, RmpeerArgs{Host: "admin"}, true); ExitCode(err) != ExitUsage && ExitCode(err) != ExitFailed {
		t.Fatalf("rmpeer of itself: %v", err)
	}
}

func TestExplain(t *testing.T) {
	ctx := context.Background()
	w := newWorld(t)
	tiny := pool.Def{Name: "tiny", Ranges: []pool.Range{{Subnet: netip.MustParsePrefix("198.19.0.0/30"), Gateway: netip.MustParseAddr("198.19.0.1")}}} // .1 is the gateway: one address (.2)
	a := w.hosts["node-a"]
	if _, err := a.Allocate(ctx, pool.Request{Owner: owner("node-a", 9), Reservation: "ns/tiny", Wants: []pool.Want{{Pool: "tiny", Role: pool.RoleIP}}, Defs: []pool.Def{tiny}}); err != nil {
		t.Fatal(err)
	}
	ex, err := w.ctl.Explain(ctx, ExplainArgs{Pools: []string{"tiny"}, Host: "node-b"})
	if err != nil || ex.WouldSucceed || !hasFinding(ex, "capacity", VerdictFail, "tiny has no free address: 1 of 1") {
		t.Fatalf("explain of a full pool: %+v %v", ex, err)
	}
	if _, _, err := a.Release(ctx, owner("node-a", 9)); err != nil {
		t.Fatal(err)
	}
	ex, _ = w.ctl.Explain(ctx, ExplainArgs{Pools: []string{"tiny"}, Host: "node-b"})
	if ex.WouldSucceed || !hasFinding(ex, "capacity", VerdictFail, "full but for 1 addresses held for released reservations (ns/tiny") {
		t.Fatalf("explain of a pool full of holds: %+v", ex)
	}
	rec, _, _ := w.ctl.Pool.Lookup(ctx, owner("node-b", 1))
	o := owner("node-c", 7)
	ex, _ = w.ctl.Explain(ctx, ExplainArgs{Pools: []string{"net-0"}, IP: rec.Addrs[0].Addr, Owner: &o, Host: "node-c"})
	if ex.WouldSucceed || !hasFinding(ex, "static", VerdictFail, "already in use by "+owner("node-b", 1).String()) {
		t.Fatalf("explain of a static address in use: %+v", ex)
	}
	// A definition that disagrees with the recorded one.
	conf := []byte(`{"cniVersion":"1.1.0","name":"net","ipam":{"type":"ipam-ring","host":"node-c","pools":["net-0"],"ranges":[[{"subnet":"198.18.0.0/25"}]]}}`)
	ex, err = w.ctl.Explain(ctx, ExplainArgs{NetConf: conf, Host: "node-c"})
	if err != nil || ex.WouldSucceed || !hasFinding(ex, "definition", VerdictFail, "recorded as") {
		t.Fatalf("explain of a mismatched definition: %+v %v", ex, err)
	}
	// A healthy case.
	ex, _ = w.ctl.Explain(ctx, ExplainArgs{Pools: []string{"net-0", "net-1"}, Host: "node-a"})
	if !ex.WouldSucceed {
		t.Fatalf("explain of a healthy network: %+v", ex)
	}
	var out bytes.Buffer
	RenderExplain(&out, ex)
	checkWidth(t, out.String())
}

func hasFinding(ex Explanation, check, verdict, detail string) bool {
	return slices.ContainsFunc(ex.Findings, func(f Finding) bool {
		return f.Check == check && f.Verdict == verdict && strings.Contains(f.Detail, detail)
	})
}

func TestImportHostLocal(t *testing.T) {
	ctx := context.Background()
	w := newWorld(t)
	dir := t.TempDir()
	files := map[string]string{
		"198.18.0.200":       "ctr1\r\neth0",
		"2001:db8:1::c8":     "ctr1\r\neth0",
		"198.18.0.201":       "ctr2\r\nnet1",
		"198.18.0.202":       "ctr-old", // host-local before v0.8: no interface
		"lock":               "",
		"last_reserved_ip.0": "198.18.0.202",
		"garbage":            "x",
	}
	for name, body := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	conf := []byte(`{"cniVersion":"1.1.0","name":"net","type":"bridge","ipam":{"type":"host-local","dataDir":"/x","resolvConf":"/etc/resolv.conf",
		"ranges":[[{"subnet":"198.18.0.0/24","gateway":"198.18.0.1"}],[{"subnet":"2001:db8:1::/64"}]]}}`)
	args := ImportArgs{Dir: dir, Network: "net", Host: "node-b", NetConf: conf, DryRun: true}
	dry, err := w.ctl.ImportHostLocal(ctx, args)
	if err != nil {
		t.Fatal(err)
	}
	results := func(r ImportReport) []string {
		var s []string
		for _, o := range r.Owners {
			s = append(s, o.Owner.ContainerID+"/"+o.Owner.IfName+" "+o.Result)
		}
		return s
	}
	want := []string{"ctr-old/eth0 adopted", "ctr1/eth0 adopted", "ctr2/net1 adopted"}
	if diff := cmp.Diff(want, results(dry)); diff != "" || len(dry.Ignored) != 1 || !slices.Equal(dry.Pools, []string{"net-0", "net-1"}) {
		t.Fatalf("import dry run: %s %+v", diff, dry)
	}
	args.DryRun = false
	rep, err := w.ctl.ImportHostLocal(ctx, args)
	if err != nil || !cmp.Equal(results(rep), want) {
		t.Fatalf("import: %+v %v", rep, err)
	}
	al, ok, _ := w.ctl.Pool.Lookup(ctx, pool.Owner{Kind: pool.KindCNI, Network: "net", ContainerID: "ctr1", IfName: "eth0"})
	if !ok || al.Host != "node-b" || !sameAddrs(addrsOf(al), []netip.Addr{netip.MustParseAddr("198.18.0.200"), netip.MustParseAddr("2001:db8:1::c8")}) {
		t.Fatalf("ctr1 holds %+v", al)
	}
	if !strings.Contains(rep.Owners[0].Detail, "no address in pool net-1") {
		t.Errorf("single-stack owner of a dual-stack network not flagged: %+v", rep.Owners[0])
	}
	// Twice: no change.
	again, err := w.ctl.ImportHostLocal(ctx, args)
	if err != nil || !cmp.Equal(results(again), []string{"ctr-old/eth0 unchanged", "ctr1/eth0 unchanged", "ctr2/net1 unchanged"}) {
		t.Fatalf("second import: %+v %v", again, err)
	}
	// An address another owner holds is refused, and nothing is taken.
	taken, _, _ := w.ctl.Pool.Lookup(ctx, owner("node-a", 1))
	os.WriteFile(filepath.Join(dir, taken.Addrs[0].Addr.String()), []byte("ctr3\r\neth0"), 0o644)
	rep, err = w.ctl.ImportHostLocal(ctx, args)
	if err != nil || rep.Refused() != 1 || !strings.Contains(rep.Owners[3].Detail, "already in use by "+owner("node-a", 1).String()) {
		t.Fatalf("import over another owner: %+v %v", rep, err)
	}
	if still, _, _ := w.ctl.Pool.Lookup(ctx, owner("node-a", 1)); !cmp.Equal(still, taken, addrCmp) {
		t.Fatalf("node-a-1 changed: %+v", still)
	}
	if v, err := w.ctl.Pool.Audit(ctx); err != nil || len(v) != 0 {
		t.Fatalf("audit after import: %v %v", v, err)
	}
	// A network name that is not the configuration's is refused.
	args.Network = "other"
	if _, err := w.ctl.ImportHostLocal(ctx, args); ExitCode(err) != ExitUsage {
		t.Fatalf("import under another network name: %v", err)
	}
}

func TestResolve(t *testing.T) {
	conflist := []byte(`{"cniVersion":"1.1.0","name":"n1","plugins":[{"type":"bridge","ipam":{"type":"ipam-ring","host":"h1",
		"store":{"type":"etcd","endpoints":["http://127.0.0.1:2379"],"prefix":"/p/"},"ranges":[[{"subnet":"198.18.0.0/24"}]]}}]}`)
	driver := []byte(`{"name":"ringipam","host":"node-a","store":{"type":"local","path":"/var/lib/x/store.db"}}`)
	// flags parses args as ringctl's store flags.
	flags := func(args ...string) *StoreFlags {
		var f StoreFlags
		fs := flag.NewFlagSet("t", flag.ContinueOnError)
		fs.StringVar(&f.DataDir, "data-dir", "", "")
		fs.StringVar(&f.Host, "host", "", "")
		f.Store.Register(fs)
		if err := fs.Parse(args); err != nil {
			t.Fatal(err)
		}
		return &f
	}
	for _, c := range []struct {
		name string
		args []string
		file []byte
		want storeconfig.Config
		host string
		err  bool
	}{
		{name: "defaults", want: storeconfig.Config{}},
		{name: "data dir", args: []string{"--data-dir", "/d"}, want: storeconfig.Config{Path: "/d/store.db"}},
		{name: "etcd by endpoints", args: []string{"--etcd-endpoints", "http://a:1, http://b:2"}, want: storeconfig.Config{Type: "etcd", Endpoints: []string{"http://a:1", "http://b:2"}}},
		{name: "conflist", file: conflist, want: storeconfig.Config{Type: "etcd", Endpoints: []string{"http://127.0.0.1:2379"}, Prefix: "/p/"}, host: "h1"},
		{name: "conflist, flags win", file: conflist, args: []string{"--etcd-prefix", "/q/", "--host", "h2", "--etcd-ca", "/ca.pem", "--etcd-endpoints", "https://c:3"},
			want: storeconfig.Config{Type: "etcd", Endpoints: []string{"https://c:3"}, Prefix: "/q/", TLS: &storeconfig.TLS{CA: "/ca.pem"}}, host: "h2"},
		{name: "conflist, deprecated names", file: conflist, args: []string{"--store-prefix", "/q/", "--etcd-cacert", "/ca.pem", "--etcd-endpoints", "https://c:3", "--store-socket", "/run/s.sock"},
			want: storeconfig.Config{Type: "etcd", Endpoints: []string{"https://c:3"}, Prefix: "/q/", TLS: &storeconfig.TLS{CA: "/ca.pem"}, AgentSocket: "/run/s.sock"}, host: "h1"},
		{name: "conflist, --store local starts afresh", file: conflist, args: []string{"--store", "local", "--store-path", "/s.db"}, want: storeconfig.Config{Type: "local", Path: "/s.db"}, host: "h1"},
		{name: "driver config", file: driver, want: storeconfig.Config{Type: "local", Path: "/var/lib/x/store.db"}, host: "node-a"},
		{name: "bare store object", file: []byte(`{"type":"etcd","endpoints":["127.0.0.1:2379"]}`), want: storeconfig.Config{Type: "etcd", Endpoints: []string{"127.0.0.1:2379"}}},
		{name: "relative path", args: []string{"--store-path", "x.db"}, err: true},
		{name: "agent socket off", args: []string{"--etcd-endpoints", "h:1", "--agent-socket", "off"}, err: true},
		{name: "not JSON", file: []byte("{"), err: true},
		{name: "conflist without our ipam", file: []byte(`{"name":"n","plugins":[{"type":"bridge","ipam":{"type":"dhcp"}}]}`), err: true},
	} {
		t.Run(c.name, func(t *testing.T) {
			s, err := Resolve(flags(c.args...), c.file)
			if c.err {
				if ExitCode(err) != ExitUsage {
					t.Fatalf("want a usage error, got %v", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(c.want, s.Store); diff != "" || s.Host != c.host {
				t.Fatalf("store (-want +got):\n%s host %q", diff, s.Host)
			}
		})
	}
	// The environment fills what the flags did not give; the password
	// comes from RINGIPAM_ETCD_PASSWORD.
	env := map[string]string{"RINGIPAM_ETCD_ENDPOINTS": "http://e:1", "RINGIPAM_ETCD_PREFIX": "/env/", "RINGIPAM_HOST": "envhost",
		"RINGIPAM_ETCD_USERNAME": "u", "RINGIPAM_ETCD_PASSWORD": "pw"}
	f, err := flags("--host", "flaghost", "--etcd-prefix", "/flag/").withEnv(func(k string) string { return env[k] })
	if err != nil {
		t.Fatal(err)
	}
	s, err := Resolve(f, nil)
	if err != nil {
		t.Fatal(err)
	}
	want := storeconfig.Config{Type: "etcd", Endpoints: []string{"http://e:1"}, Prefix: "/flag/", Username: "u", Password: "pw"}
	if diff := cmp.Diff(want, s.Store); diff != "" || s.Host != "flaghost" {
		t.Fatalf("env merge (-want +got):\n%s host %q", diff, s.Host)
	}
	if _, err := flags().withEnv(func(k string) string { return map[string]string{"RINGIPAM_ETCD_DIAL_TIMEOUT": "soon"}[k] }); ExitCode(err) != ExitUsage {
		t.Fatalf("bad duration in the environment: %v", err)
	}
}

func TestMainUsageErrors(t *testing.T) {
	for _, c := range []struct {
		args []string
		code int
	}{
		{nil, ExitUsage},
		{[]string{"help"}, ExitOK},
		{[]string{"frobnicate"}, ExitUsage},
		{[]string{"--store", "zk", "status"}, ExitUsage},
		{[]string{"status", "--no-such-flag"}, ExitUsage},
		{[]string{"release", "not-an-ip", "--store-path", "/nonexistent/x.db"}, ExitUsage},
		{[]string{"release", "--store-path", "/nonexistent/x.db"}, ExitUsage},
		{[]string{"ports", "--mode", "both", "--store-path", "/nonexistent/x.db"}, ExitUsage},
	} {
		var out, errb bytes.Buffer
		env := Env{Stdout: &out, Stderr: &errb, Getenv: func(string) string { return "" }, ReadFile: os.ReadFile, Now: time.Now}
		if got := Main(c.args, env); got != c.code {
			t.Errorf("ringctl %v: exit %d, want %d\nstdout %s\nstderr %s", c.args, got, c.code, out.String(), errb.String())
		}
	}
}

func TestMainOnLocalStore(t *testing.T) {
	path := filepath.Join(t.TempDir(), "store.db")
	var out, errb bytes.Buffer
	env := Env{Stdout: &out, Stderr: &errb, Getenv: func(k string) string {
		return map[string]string{"RINGIPAM_STORE_PATH": path, "RINGIPAM_HOST": "node-x"}[k]
	}, ReadFile: os.ReadFile, Now: time.Now}
	if code := Main([]string{"check", "--json"}, env); code != ExitOK || !strings.Contains(out.String(), `"violations": []`) {
		t.Fatalf("check on an empty store: %d %s %s", code, out.String(), errb.String())
	}
	out.Reset()
	if code := Main([]string{"history", "198.18.0.1"}, env); code != ExitFailed || !strings.Contains(errb.String(), "no recorded pool hands out 198.18.0.1") {
		t.Fatalf("history of an unknown address: %d %s", code, errb.String())
	}
}

// gc compacts the address history to the newest pool.HistoryKeep events per
// address, and its dry run counts exactly what the run deletes.
func TestGCCompactsHistory(t *testing.T) {
	ctx := context.Background()
	w := newWorld(t)
	a := w.hosts["node-a"]
	addr := netip.MustParseAddr("198.18.0.200")
	for i := range 12 { // 24 events on one address
		o := pool.Owner{Kind: pool.KindCNI, Network: "net", ContainerID: fmt.Sprint("churn-", i), IfName: "eth0"}
		if _, err := a.Allocate(ctx, pool.Request{Owner: o, Wants: []pool.Want{{Pool: "net-0", Role: pool.RoleIP, Addr: addr}}, Defs: w.defs[:1]}); err != nil {
			t.Fatal(err)
		}
		w.clk.advance(time.Second)
		if _, _, err := a.Release(ctx, o); err != nil {
			t.Fatal(err)
		}
		w.clk.advance(time.Second)
	}
	if evs, err := w.ctl.Pool.History(ctx, "net-0", addr); err != nil || len(evs) != 24 {
		t.Fatalf("history before gc: %d events (want 24), %v", len(evs), err)
	}
	dry, err := w.ctl.GC(ctx, true)
	if err != nil {
		t.Fatal(err)
	}
	want := []Action{{Do: "compact-history", Target: "address history", Detail: fmt.Sprintf("%d events beyond the newest %d per address", 24-pool.HistoryKeep, pool.HistoryKeep)}}
	if diff := cmp.Diff(want, dry.Actions, addrCmp); diff != "" {
		t.Fatalf("gc dry run:\n%s", diff)
	}
	real, err := w.ctl.GC(ctx, false)
	if err != nil || !cmp.Equal(dry.Actions, real.Actions, addrCmp) {
		t.Fatalf("gc: %+v %v, dry run said %+v", real, err, dry)
	}
	evs, err := w.ctl.Pool.History(ctx, "net-0", addr)
	if err != nil || len(evs) != pool.HistoryKeep {
		t.Fatalf("history after gc: %d events (want %d), %v", len(evs), pool.HistoryKeep, err)
	}
	if last := evs[len(evs)-1]; last.What != pool.EventRelease || !strings.Contains(last.Owner, "churn-11") {
		t.Fatalf("newest event after gc: %+v", last)
	}
	if again, err := w.ctl.GC(ctx, true); err != nil || len(again.Actions) != 0 {
		t.Fatalf("gc after gc: %+v %v", again, err)
	}
}

// gc repairs the hosts' index of their owners (what an older ringipam may
// leave while the store is migrated), and its dry run says so first.
func TestGCRepairsTheHostIndex(t *testing.T) {
	ctx := context.Background()
	w := newWorld(t)
	// node-b's owner 1 is missing from its index; node-a's index names an
	// owner that is gone.
	if err := w.ctl.Store.Commit(ctx, nil, []store.Op{
		store.Delete("i/node-b/" + owner("node-b", 1).String()),
		store.Put("i/node-a/"+owner("node-a", 7).String(), []byte{}),
	}); err != nil {
		t.Fatal(err)
	}
	v, err := w.ctl.Pool.Audit(ctx)
	if err != nil || len(v) != 2 || v[0].Invariant != pool.InvHostIndex || v[1].Invariant != pool.InvHostIndex {
		t.Fatalf("audit of the broken index: %v %v", v, err)
	}
	want := []Action{{Do: "reindex", Target: "hosts' owner index", Detail: "1 owners entered in their host's index, 1 index keys of owners gone deleted"}}
	dry, err := w.ctl.GC(ctx, true)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(want, dry.Actions, addrCmp); diff != "" {
		t.Fatalf("gc dry run:\n%s", diff)
	}
	if v, _ := w.ctl.Pool.Audit(ctx); len(v) != 2 {
		t.Fatalf("the dry run changed the index: %v", v)
	}
	real, err := w.ctl.GC(ctx, false)
	if err != nil || !cmp.Equal(want, real.Actions, addrCmp) {
		t.Fatalf("gc: %+v %v", real, err)
	}
	if v, err := w.ctl.Pool.Audit(ctx); err != nil || len(v) != 0 {
		t.Fatalf("audit after gc: %v %v", v, err)
	}
	// node-b's GC now sees its owner 1 again: it is released as stale.
	rel, err := w.hosts["node-b"].GC(ctx, pool.KindCNI, "net", []pool.Owner{owner("node-b", 0), owner("node-b", 2)})
	if err != nil || len(rel) != 1 || rel[0].Owner != owner("node-b", 1) {
		t.Fatalf("node-b's GC after the repair: %v %v", rel, err)
	}
}

// check audits the published ports too: a port whose endpoint record is
// gone (nothing will release it) is a finding, exit 1.
func TestCheckAuditsPublishedPorts(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "store.db")
	st, err := storeconfig.Open(storeconfig.Config{Path: path})
	if err != nil {
		t.Fatal(err)
	}
	pa, err := portalloc.New(st, "node-x")
	if err != nil {
		t.Fatal(err)
	}
	web := portalloc.EndpointID{Network: "net", ContainerID: "web", IfName: "eth0"}
	if _, err := pa.Allocate(ctx, web, []portalloc.Port{{Mode: portalloc.Ingress, Protocol: "tcp", Number: 8080}}); err != nil {
		t.Fatal(err)
	}
	var out, errb bytes.Buffer
	env := Env{Stdout: &out, Stderr: &errb, Getenv: func(k string) string {
		return map[string]string{"RINGIPAM_STORE_PATH": path, "RINGIPAM_HOST": "node-x"}[k]
	}, ReadFile: os.ReadFile, Now: time.Now}
	if code := Main([]string{"check"}, env); code != ExitOK {
		t.Fatalf("check with one port published: %d\n%s%s", code, out.String(), errb.String())
	}
	// The endpoint's record lost, its address still held.
	if err := st.Commit(ctx, nil, []store.Op{store.Delete("p/e/net/web/eth0")}); err != nil {
		t.Fatal(err)
	}
	st.Close()
	out.Reset()
	want := "port-records: tcp/8080 is held in ingress mode by port/net/web/eth0, whose" // wrapped after
	if code := Main([]string{"check"}, env); code != ExitFindings || !strings.Contains(out.String(), want) {
		t.Fatalf("check with a leaked port: exit %d, want %d and %q in\n%s%s", code, ExitFindings, want, out.String(), errb.String())
	}
}

// gc tidies the host-mode ports a store written by an older ringipam holds
// (their users inside p/a/): moved to their host's key, the dry run first
// saying so; the ports listing shows the same holders before and after.
func TestGCTidiesOldFormatHostPorts(t *testing.T) {
	ctx := context.Background()
	w := newWorld(t)
	// As today's main (082f606) writes a host port of node-a and one of
	// node-b on tcp/8080: both users inside p/a/tcp/08080.
	var ops []store.Op
	for _, h := range []string{"node-a", "node-b"} {
		p := []portalloc.Port{{Mode: portalloc.Host, Protocol: "tcp", Number: 8080}}
		b, _ := json.Marshal(portalloc.Endpoint{Kind: portalloc.Kind, Host: h, Spec: p, Ports: p})
		ops = append(ops, store.Put("p/e/net/ds-"+h+"/eth0", b), store.Put("p/i/"+h+"/net/ds-"+h+"/eth0", nil))
	}
	ops = append(ops, store.Put("p/a/tcp/08080", []byte(`{"hs":[{"h":"node-a","e":"port/net/ds-node-a/eth0"},{"h":"node-b","e":"port/net/ds-node-b/eth0"}]}`)))
	if err := w.ctl.Store.Commit(ctx, nil, ops); err != nil {
		t.Fatal(err)
	}
	before, err := w.ctl.PortsList(ctx, PortFilter{})
	if err != nil || len(before) != 2 {
		t.Fatalf("ports before gc: %v %v", before, err)
	}
	dry, err := w.ctl.GC(ctx, true)
	if err != nil {
		t.Fatal(err)
	}
	want := []Action{{Do: "tidy-ports", Target: "host-mode ports", Detail: "2 old-format host users moved to their host's key, 1 markers written, 0 stale markers removed, 0 leaked bindings released"}}
	if diff := cmp.Diff(want, dry.Actions, addrCmp); diff != "" {
		t.Fatalf("gc dry run:\n%s", diff)
	}
	real, err := w.ctl.GC(ctx, false)
	if err != nil || !cmp.Equal(dry.Actions, real.Actions, addrCmp) {
		t.Fatalf("gc: %+v %v, dry run said %+v", real, err, dry)
	}
	kvs, _ := w.ctl.Store.Get(ctx, "p/h/tcp/08080/node-a", "p/h/tcp/08080/node-b")
	if !kvs[0].Exists() || !kvs[1].Exists() {
		t.Fatalf("after gc the hosts' keys are %v", kvs)
	}
	after, err := w.ctl.PortsList(ctx, PortFilter{})
	if err != nil || !cmp.Equal(before, after, addrCmp) {
		t.Fatalf("ports after gc %v %v, before %v", after, err, before)
	}
	if again, err := w.ctl.GC(ctx, true); err != nil || len(again.Actions) != 0 {
		t.Fatalf("gc after gc: %+v %v", again, err)
	}
}
