package portalloc

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/memory"
)

// oldAddrState is a p/a/ value as commit 082f606 (the last release before
// the per-host keys) encodes and decodes it: every host-mode user inside.
// The tests write and read it with this copy of the old encoding, not with
// the package's types.
type oldAddrState struct {
	Ingress     string       `json:"i,omitempty"`
	IngressHost string       `json:"ih,omitempty"`
	Hosts       []oldHostUse `json:"hs,omitempty"`
}

type oldHostUse struct {
	Host     string     `json:"h"`
	IP       netip.Addr `json:"ip,omitzero"`
	Endpoint string     `json:"e"`
}

// addrWrites counts the commits that write a p/a/ key, and their bytes.
type addrWrites struct {
	store.Store
	mu            sync.Mutex
	commits, size int
}

func (w *addrWrites) Commit(ctx context.Context, conds []store.Cond, ops []store.Op) error {
	err := w.Store.Commit(ctx, conds, ops)
	if err == nil {
		for _, o := range ops {
			if strings.HasPrefix(o.Key, prefixAddr) {
				w.mu.Lock()
				w.commits++
				w.size = max(w.size, len(o.Value))
				w.mu.Unlock()
				break
			}
		}
	}
	return err
}

// A hostPort DaemonSet on 60 hosts writes its address's p/a/ key once (the
// marker, with the first binding), whose value does not grow; every host's
// binding is its own key; an ingress port there is refused, a dynamic
// ingress search passes it; the last release removes the marker.
func TestDaemonSetWritesTheAddressOnce(t *testing.T) {
	ctx := context.Background()
	w := &addrWrites{Store: memory.New()}
	const hosts = 60
	addr := Address{"tcp", 9100}
	for i := range hosts {
		a, _ := New(w, fmt.Sprint("node-", i), WithDynamicRange(9100, 9101))
		if _, err := a.Allocate(ctx, ep(fmt.Sprint("exporter-", i)), []Port{{Mode: Host, Name: "metrics", Protocol: "tcp", Number: 9100}}); err != nil {
			t.Fatal(err)
		}
	}
	if w.commits != 1 {
		t.Errorf("%d commits wrote p/a/ for one DaemonSet on %d hosts, want 1 (the marker)", w.commits, hosts)
	}
	if w.size > 200 {
		t.Errorf("p/a/ value of %d bytes", w.size)
	}
	kvs, _ := w.Scan(ctx, hostBindPrefix(addr), store.PrefixEnd(hostBindPrefix(addr)), 0)
	if len(kvs) != hosts {
		t.Errorf("%d keys under %s, want one per host (%d)", len(kvs), hostBindPrefix(addr), hosts)
	}
	a, _ := New(w, "node-x", WithDynamicRange(9100, 9101))
	pubs, err := a.List(ctx)
	if err != nil || len(pubs) != 1 || len(pubs[0].State.Hosts) != hosts || slices.ContainsFunc(pubs[0].State.Hosts, isMarker) {
		t.Fatalf("List: %v %v, want tcp/9100 with %d host users and no marker", pubs, err, hosts)
	}
	if ing, err := a.Ingresses(ctx); err != nil || len(ing) != 0 {
		t.Errorf("Ingresses: %v %v, want none", ing, err)
	}
	_, err = a.Allocate(ctx, ep("ingress"), []Port{{Mode: Ingress, Protocol: "tcp", Number: 9100}})
	var inUse *InUseError
	if !errors.As(err, &inUse) || inUse.Mode != Host || !strings.HasPrefix(inUse.Host, "node-") {
		t.Fatalf("ingress on the DaemonSet's port: %v, want in use by a host binding", err)
	}
	res, err := a.Allocate(ctx, ep("ingress"), []Port{{Mode: Ingress, Protocol: "tcp"}})
	if err != nil || res.Ports[0].Number != 9101 {
		t.Fatalf("dynamic ingress: %v %v, want 9101", res.Ports, err)
	}
	if f, err := Audit(ctx, w, Holders{}); err != nil || f != nil {
		t.Fatalf("audit: %v %v", f, err)
	}
	for i := range hosts {
		a, _ := New(w, fmt.Sprint("node-", i))
		if _, err := a.Release(ctx, ep(fmt.Sprint("exporter-", i))); err != nil {
			t.Fatal(err)
		}
	}
	if got, _ := w.Get(ctx, addrKey(addr)); got[0].Exists() {
		t.Errorf("after the last release p/a/ still holds %s (the marker was to go with the last binding)", got[0].Value)
	}
	if w.commits != 3 {
		t.Errorf("%d commits wrote p/a/, want 3 (the marker, the ingress port 9101, the marker's removal)", w.commits)
	}
}

// A p/a/ record as today's main writes it (host users inside, no marker)
// is honoured by the new code as bindings of their hosts, and moved to
// p/h/ by the owning host's new code when it next touches the address;
// another host's old-format user stays in p/a/ (honoured) until its own
// host touches it. Nothing is lost or listed twice.
func TestOldFormatUsersAreHonouredAndMigrated(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	addr := Address{"tcp", 8080}
	ip4, ip5 := netip.MustParseAddr("198.18.0.4"), netip.MustParseAddr("198.18.0.5")
	// What today's main wrote: two endpoints' records and their address.
	old := oldAddrState{Hosts: []oldHostUse{{Host: "h1", IP: ip4, Endpoint: ep("o1").String()}, {Host: "h2", Endpoint: ep("o2").String()}}}
	b, _ := json.Marshal(old)
	rec1, _ := json.Marshal(Endpoint{Kind: Kind, Host: "h1", Spec: []Port{{Mode: Host, Protocol: "tcp", Number: 8080, HostIP: ip4}}, Ports: []Port{{Mode: Host, Protocol: "tcp", Number: 8080, HostIP: ip4}}})
	rec2, _ := json.Marshal(Endpoint{Kind: Kind, Host: "h2", Spec: []Port{{Mode: Host, Protocol: "tcp", Number: 8080}}, Ports: []Port{{Mode: Host, Protocol: "tcp", Number: 8080}}})
	if err := st.Commit(ctx, nil, []store.Op{store.Put(addrKey(addr), b), store.Put(endpointKey(ep("o1")), rec1), store.Put(endpointKey(ep("o2")), rec2),
		store.Put(hostIndexKey("h1", ep("o1")), nil), store.Put(hostIndexKey("h2", ep("o2")), nil)}); err != nil {
		t.Fatal(err)
	}
	h1, _ := New(st, "h1")
	h2, _ := New(st, "h2")
	h3, _ := New(st, "h3")
	var inUse *InUseError
	// Honoured: h1's overlapping binding and an ingress port are refused.
	if _, err := h1.Allocate(ctx, ep("n0"), []Port{{Mode: Host, Protocol: "tcp", Number: 8080}}); !errors.As(err, &inUse) || inUse.Holder != ep("o1").String() {
		t.Fatalf("h1 binding every address of 8080 beside old-format o1: %v, want in use by o1", err)
	}
	if _, err := h3.Allocate(ctx, ep("n9"), []Port{{Mode: Ingress, Protocol: "tcp", Number: 8080}}); !errors.As(err, &inUse) {
		t.Fatalf("ingress 8080 beside old-format host users: %v, want in use", err)
	}
	if _, _, f, err := h1.Verify(ctx, ep("o1")); err != nil || len(f) > 0 {
		t.Fatalf("verify o1 (old format): %v %v", f, err)
	}
	// h1's new code touches 8080: its user o1 moves to p/h/tcp/08080/h1.
	if _, err := h1.Allocate(ctx, ep("n1"), []Port{{Mode: Host, Protocol: "tcp", Number: 8080, HostIP: ip5}}); err != nil {
		t.Fatal(err)
	}
	kvs, _ := st.Get(ctx, addrKey(addr), hostBindKey(addr, "h1"), hostBindKey(addr, "h2"))
	var now oldAddrState
	_ = json.Unmarshal(kvs[0].Value, &now)
	if len(now.Hosts) != 2 || now.Hosts[0] != old.Hosts[1] || now.Hosts[1].Host != markerHost {
		t.Errorf("p/a/ after h1's touch: %s, want h2's old-format user and the marker", kvs[0].Value)
	}
	bs, _ := decodeBindings(kvs[1], "h1")
	if len(bs) != 2 || !slices.ContainsFunc(bs, func(u HostUse) bool { return u.Endpoint == ep("o1").String() && u.IP == ip4 }) {
		t.Errorf("h1's key: %s, want o1 (moved) and n1", kvs[1].Value)
	}
	if kvs[2].Exists() {
		t.Errorf("h2's key written by h1: %s", kvs[2].Value)
	}
	if f, err := Audit(ctx, st, Holders{}); err != nil || f != nil {
		t.Fatalf("audit after the move: %v %v", f, err)
	}
	// Moving again changes nothing: h1 repeats n1's request.
	rev := kvs[1].Revision
	if _, err := h1.Allocate(ctx, ep("n1"), []Port{{Mode: Host, Protocol: "tcp", Number: 8080, HostIP: ip5}}); err != nil {
		t.Fatal(err)
	}
	if kvs, _ := st.Get(ctx, hostBindKey(addr, "h1")); kvs[0].Revision != rev {
		t.Errorf("a repeated request rewrote h1's key")
	}
	// h2's new code releases o2 (written by the old code): gone from p/a/.
	if res, err := h2.Release(ctx, ep("o2")); err != nil || len(res.Previous) != 1 {
		t.Fatalf("release of old-format o2: %v %v", res.Previous, err)
	}
	// h1 releases both: nothing is left, marker included.
	for _, id := range []string{"o1", "n1"} {
		if res, err := h1.Release(ctx, ep(id)); err != nil || len(res.Previous) != 1 {
			t.Fatalf("release %s: %v %v", id, res.Previous, err)
		}
	}
	if left, _ := st.Scan(ctx, "p/a/", "p/i/", 0); len(left) > 0 {
		t.Errorf("left after every release: %v", left)
	}
	if left, _ := st.Scan(ctx, prefixHostBind, store.PrefixEnd(prefixHostBind), 0); len(left) > 0 {
		t.Errorf("left after every release: %v", left)
	}
}

// The marker new code writes makes the old decoding see the address as
// used in host mode: today's main's Plan (unchanged in this package) over
// the p/a/ record decoded as today's main decodes it refuses an ingress
// port there, and finds no collision for a host binding on any real host
// (the marker's host contains '/', which no host name may).
func TestMarkerMakesOldCodeSeeAHostPort(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	a, _ := New(st, "h1")
	addr := Address{"tcp", 7070}
	if _, err := a.Allocate(ctx, ep("n1"), []Port{{Mode: Host, Protocol: "tcp", Number: 7070}}); err != nil {
		t.Fatal(err)
	}
	kvs, _ := st.Get(ctx, addrKey(addr))
	var old oldAddrState
	if err := json.Unmarshal(kvs[0].Value, &old); err != nil || len(old.Hosts) == 0 {
		t.Fatalf("old decoding of %s: %+v %v, want a host-mode user", kvs[0].Value, old, err)
	}
	seen := AddrState{Ingress: old.Ingress, IngressHost: old.IngressHost}
	for _, u := range old.Hosts {
		seen.Hosts = append(seen.Hosts, HostUse(u))
	}
	v := memView{addr: seen}
	_, err := Plan(v, Request{Endpoint: "port/net/old/eth0", Host: "h2", Spec: []Port{{Mode: Ingress, Protocol: "tcp", Number: 7070}}, Lo: DefaultLo, Hi: DefaultHi, Rules: AllRules})
	if !errors.Is(err, ErrInUse) {
		t.Fatalf("old code's ingress 7070 over the marker: %v, want in use", err)
	}
	// A dynamic ingress search of the old code passes it too.
	res, err := Plan(v, Request{Endpoint: "port/net/old/eth0", Host: "h2", Spec: []Port{{Mode: Ingress, Protocol: "tcp"}}, Lo: 7070, Hi: 7071, Rules: AllRules})
	if err != nil || res.Ports[0].Number != 7071 {
		t.Fatalf("old code's dynamic ingress: %v %v, want 7071", res.Ports, err)
	}
	// Old code on another host binds 7070 beside it and keeps the marker.
	res, err = Plan(v, Request{Endpoint: "port/net/old/eth0", Host: "h2", Spec: []Port{{Mode: Host, Protocol: "tcp", Number: 7070}}, Lo: DefaultLo, Hi: DefaultHi, Rules: AllRules})
	if err != nil || !slices.Contains(res.Changes[addr].Hosts, marker) {
		t.Fatalf("old code's host binding on h2: %v %v, want it, the marker kept", res.Changes, err)
	}
	if _, err := New(st, markerHost); err == nil {
		t.Fatalf("New accepts the marker's host name %q", markerHost)
	}
}

// A stale marker (no binding left: two last releases at once) is harmless:
// a static ingress port takes the address, a dynamic search passes it, and
// Tidy removes it.
func TestStaleMarker(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	b, _ := json.Marshal(AddrState{Hosts: []HostUse{marker}})
	for _, n := range []uint16{6000, 6001, 30000} {
		if err := st.Commit(ctx, nil, []store.Op{store.Put(addrKey(Address{"tcp", n}), b)}); err != nil {
			t.Fatal(err)
		}
	}
	a, _ := New(st, "h1", WithDynamicRange(30000, 30001))
	if res, err := a.Allocate(ctx, ep("i1"), []Port{{Mode: Ingress, Protocol: "tcp", Number: 6000}}); err != nil || res.Ports[0].Number != 6000 {
		t.Fatalf("static ingress over a stale marker: %v %v", res.Ports, err)
	}
	if res, err := a.Allocate(ctx, ep("i2"), []Port{{Mode: Ingress, Protocol: "tcp"}}); err != nil || res.Ports[0].Number != 30001 {
		t.Fatalf("dynamic ingress beside a stale marker: %v %v, want 30001", res.Ports, err)
	}
	if f, err := Audit(ctx, st, Holders{}); err != nil || f != nil {
		t.Fatalf("audit: %v %v, a stale marker is no finding", f, err)
	}
	if got, err := a.PlanTidy(ctx); err != nil || got != (Tidied{Unmarked: 2}) {
		t.Fatalf("PlanTidy: %+v %v, want the two stale markers left", got, err)
	}
	if got, err := a.Tidy(ctx); err != nil || got != (Tidied{Unmarked: 2}) {
		t.Fatalf("Tidy: %+v %v", got, err)
	}
	if kvs, _ := st.Get(ctx, addrKey(Address{"tcp", 6001}), addrKey(Address{"tcp", 30000})); kvs[0].Exists() || kvs[1].Exists() {
		t.Errorf("stale markers left: %v", kvs)
	}
}

// Tidy, the one-off pass: old-format users of several hosts moved, a
// binding without marker marked, a leaked binding (its record gone)
// released; the store then audits clean and a second pass does nothing.
func TestTidy(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	put := func(k string, v any) {
		t.Helper()
		b, _ := json.Marshal(v)
		if err := st.Commit(ctx, nil, []store.Op{store.Put(k, b)}); err != nil {
			t.Fatal(err)
		}
	}
	var old oldAddrState
	for i := range 45 { // more hosts than one commit settles
		h, id := fmt.Sprint("h", i), ep(fmt.Sprint("o", i))
		old.Hosts = append(old.Hosts, oldHostUse{Host: h, Endpoint: id.String()})
		p := []Port{{Mode: Host, Protocol: "tcp", Number: 8080}}
		put(endpointKey(id), Endpoint{Kind: Kind, Host: h, Spec: p, Ports: p})
	}
	put(addrKey(Address{"tcp", 8080}), old)
	// A binding whose marker is missing, and a leaked one.
	p := []Port{{Mode: Host, Protocol: "udp", Number: 53}}
	put(endpointKey(ep("dns")), Endpoint{Kind: Kind, Host: "h1", Spec: p, Ports: p})
	put(hostBindKey(Address{"udp", 53}, "h1"), []binding{{Endpoint: ep("dns").String()}})
	put(hostBindKey(Address{"udp", 53}, "h2"), []binding{{Endpoint: ep("gone").String()}})
	a, _ := New(st, "ctl")
	want := Tidied{Moved: 45, Marked: 2, Released: 1}
	if got, err := a.PlanTidy(ctx); err != nil || got != want {
		t.Fatalf("PlanTidy: %+v %v, want %+v", got, err, want)
	}
	if got, err := a.Tidy(ctx); err != nil || got != want {
		t.Fatalf("Tidy: %+v %v, want %+v", got, err, want)
	}
	if f, err := Audit(ctx, st, Holders{}); err != nil || f != nil {
		t.Fatalf("audit after Tidy: %v %v", f, err)
	}
	if got, err := a.Tidy(ctx); err != nil || got != (Tidied{}) {
		t.Fatalf("second Tidy: %+v %v, want nothing", got, err)
	}
	pubs, _ := a.List(ctx)
	n := 0
	for _, p := range pubs {
		n += len(p.State.Hosts)
	}
	if n != 46 {
		t.Errorf("%d host users listed after Tidy, want 46: %v", n, pubs)
	}
}
