package portalloc

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/local"
	"github.com/ringipam/ringipam/pkg/store/memory"
)

func ep(c string) EndpointID { return EndpointID{Network: "net", ContainerID: c, IfName: "eth0"} }

// runAllocatorBasics: the store edge end to end on st.
func runAllocatorBasics(t *testing.T, st store.Store) {
	ctx := context.Background()
	a, err := New(st, "h1", WithDynamicRange(30000, 30009))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := New(st, "h2", WithDynamicRange(30000, 30009))
	web := []Port{{Mode: Ingress, Name: "80", Protocol: "tcp", Number: 8080}, {Mode: Ingress, Name: "53", Protocol: "udp"}, {Mode: Host, Name: "22", Protocol: "tcp"}}
	res, err := a.Allocate(ctx, ep("web"), web)
	if err != nil {
		t.Fatal(err)
	}
	if res.Ports[0].Number != 8080 || res.Ports[1].Number < 30000 || res.Ports[2].Number < 30000 {
		t.Fatalf("ports %+v", res.Ports)
	}
	again, err := a.Allocate(ctx, ep("web"), web)
	if err != nil || fmt.Sprint(again.Ports) != fmt.Sprint(res.Ports) {
		t.Fatalf("re-applying: %+v %v, want %+v", again.Ports, err, res.Ports)
	}
	// The ingress port is refused on the other host, naming the holder.
	_, err = b.Allocate(ctx, ep("other"), []Port{{Mode: Ingress, Name: "x", Protocol: "tcp", Number: 8080}})
	var inUse *InUseError
	if !errors.As(err, &inUse) || inUse.Holder != "port/net/web/eth0" || inUse.Host != "h1" {
		t.Fatalf("ingress 8080 on h2: %v", err)
	}
	// A host port of the same number on the other host is fine only if no
	// ingress holds it: 8080 is refused (hidden), 9090 works on both hosts.
	if _, err := b.Allocate(ctx, ep("hp"), []Port{{Mode: Host, Protocol: "tcp", Number: 8080}}); !errors.Is(err, ErrInUse) {
		t.Fatalf("host 8080 under an ingress 8080: %v", err)
	}
	for _, x := range []*Allocator{a, b} {
		if _, err := x.Allocate(ctx, ep("hp-"+x.host), []Port{{Mode: Host, Protocol: "tcp", Number: 9090}}); err != nil {
			t.Fatalf("host 9090 on %s: %v", x.host, err)
		}
	}
	if _, err := a.Allocate(ctx, ep("dup"), []Port{{Mode: Host, Protocol: "tcp", Number: 9090}}); !errors.Is(err, ErrInUse) {
		t.Fatalf("second host 9090 on h1: %v", err)
	}
	// Exhaustion names the protocol.
	var specs []Port
	for range 11 {
		specs = append(specs, Port{Mode: Ingress, Name: "e", Protocol: "sctp"})
	}
	if _, err := a.Allocate(ctx, ep("many"), specs); !errors.Is(err, ErrExhausted) {
		t.Fatalf("11 dynamic sctp ports in a range of 10: %v", err)
	}
	// Release gives everything back; releasing again is fine.
	if _, err := a.Release(ctx, ep("web")); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Release(ctx, ep("web")); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Allocate(ctx, ep("other"), []Port{{Mode: Ingress, Name: "x", Protocol: "tcp", Number: 8080}}); err != nil {
		t.Fatalf("8080 after release: %v", err)
	}
	list, err := a.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(list) != 2 { // 8080 (other), 9090 (two hosts)
		t.Fatalf("published: %+v", list)
	}
}

func TestAllocatorMemory(t *testing.T) { runAllocatorBasics(t, memory.New()) }

func TestAllocatorLocal(t *testing.T) {
	st, err := local.New(local.Config{Path: filepath.Join(t.TempDir(), "s.db"), OpenTimeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	runAllocatorBasics(t, st)
}

// runConcurrentDynamicIngress: two hosts, 8 at a time each, asking for
// dynamic ingress ports: no number is handed out twice.
func runConcurrentDynamicIngress(t *testing.T, st store.Store) {
	ctx := context.Background()
	var mu sync.Mutex
	got := map[uint16]string{}
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for _, host := range []string{"A", "B"} {
		a, _ := New(st, host)
		for w := range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := range 4 {
					id := ep(fmt.Sprintf("%s-%d-%d", host, w, i))
					res, err := a.Allocate(ctx, id, []Port{{Mode: Ingress, Name: "80", Protocol: "tcp"}})
					if err != nil {
						errs <- err
						return
					}
					mu.Lock()
					if other, dup := got[res.Ports[0].Number]; dup {
						errs <- fmt.Errorf("port %d handed to %s and %s", res.Ports[0].Number, other, id)
					}
					got[res.Ports[0].Number] = id.String()
					mu.Unlock()
				}
			}()
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if len(got) != 64 {
		t.Fatalf("%d distinct ports for 64 endpoints", len(got))
	}
}

func TestConcurrentDynamicIngressMemory(t *testing.T) { runConcurrentDynamicIngress(t, memory.New()) }

// A stored port its address does not list is reported and left alone.
func TestStoredAllocationsAreRevalidated(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	a, _ := New(st, "h1")
	if _, err := a.Allocate(ctx, ep("x"), []Port{{Mode: Ingress, Protocol: "tcp", Number: 7000}}); err != nil {
		t.Fatal(err)
	}
	// Someone else's record claims 7000 too (a corrupted store).
	if err := st.Commit(ctx, nil, []store.Op{store.Put(endpointKey(ep("y")), []byte(`{"kind":"port","host":"h1","spec":[{"mode":"ingress","protocol":"tcp","published":7000}],"ports":[{"mode":"ingress","protocol":"tcp","published":7000}]}`))}); err != nil {
		t.Fatal(err)
	}
	res, err := a.Release(ctx, ep("y"))
	if err != nil || len(res.Findings) != 1 {
		t.Fatalf("release of the inconsistent endpoint: %+v %v", res, err)
	}
	if _, err := a.Allocate(ctx, ep("z"), []Port{{Mode: Ingress, Protocol: "tcp", Number: 7000}}); !errors.Is(err, ErrInUse) {
		t.Fatalf("7000 was freed by the inconsistent record: %v", err)
	}
}

// A host that is gone gives its ports back; other hosts keep theirs.
func TestReleaseHost(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	gone, _ := New(st, "gone")
	live, _ := New(st, "live")
	for i, a := range []*Allocator{gone, live} {
		if _, err := a.Allocate(ctx, ep(fmt.Sprint("e", i)), []Port{{Mode: Ingress, Protocol: "tcp", Number: uint16(8000 + i)}, {Mode: Host, Protocol: "udp"}}); err != nil {
			t.Fatal(err)
		}
	}
	rel, err := live.ReleaseHost(ctx, "gone", nil)
	if err != nil || len(rel) != 1 || rel[0].ID != ep("e0") || len(rel[0].Ports) != 2 {
		t.Fatalf("ReleaseHost: %+v %v", rel, err)
	}
	if _, err := live.Allocate(ctx, ep("new"), []Port{{Mode: Ingress, Protocol: "tcp", Number: 8000}}); err != nil {
		t.Fatalf("8000 after its host was released: %v", err)
	}
	if _, ok, _ := live.Lookup(ctx, ep("e1")); !ok {
		t.Fatal("the live host's endpoint was released")
	}
	if rel, err := live.ReleaseHost(ctx, "gone", nil); err != nil || len(rel) != 0 {
		t.Fatalf("second ReleaseHost: %+v %v", rel, err)
	}
}

// countingStore counts commits.
type countingStore struct {
	store.Store
	mu      sync.Mutex
	commits int
}

func (c *countingStore) Commit(ctx context.Context, conds []store.Cond, ops []store.Op) error {
	c.mu.Lock()
	c.commits++
	c.mu.Unlock()
	return c.Store.Commit(ctx, conds, ops)
}

// A repeated request (a runtime retrying ADD) reads and writes nothing new.
func TestRepeatedAllocateCommitsNothing(t *testing.T) {
	ctx := context.Background()
	st := &countingStore{Store: memory.New()}
	a, _ := New(st, "h1")
	spec := []Port{{Mode: Ingress, Protocol: "tcp"}, {Mode: Host, Protocol: "udp", Number: 53}}
	first, err := a.Allocate(ctx, ep("x"), spec)
	if err != nil || st.commits != 1 {
		t.Fatalf("first: %v, %d commits", err, st.commits)
	}
	again, err := a.Allocate(ctx, ep("x"), spec)
	if err != nil || st.commits != 1 || fmt.Sprint(again.Ports) != fmt.Sprint(first.Ports) {
		t.Fatalf("repeated: %+v %v, %d commits", again.Ports, err, st.commits)
	}
	if _, err := a.Release(ctx, ep("x")); err != nil || st.commits != 2 {
		t.Fatalf("release: %v, %d commits", err, st.commits)
	}
	if _, err := a.Release(ctx, ep("x")); err != nil || st.commits != 2 {
		t.Fatalf("release of nothing: %v, %d commits", err, st.commits)
	}
}

// Host mode is unique per (host, host IP, address): a binding to every
// address ("" host IP) collides with any host IP of that host; two host IPs
// of one host, or two hosts, do not collide.
func TestHostIPRules(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	h1, _ := New(st, "h1")
	h2, _ := New(st, "h2")
	ipA, ipB := netip.MustParseAddr("198.18.0.1"), netip.MustParseAddr("198.18.0.2")
	hp := func(ip netip.Addr) []Port { return []Port{{Mode: Host, Protocol: "tcp", Number: 8080, HostIP: ip}} }
	for _, tc := range []struct {
		a    *Allocator
		id   string
		ip   netip.Addr
		want error
	}{
		{h1, "a", ipA, nil},
		{h1, "b", ipB, nil},               // another host IP of h1
		{h1, "c", netip.Addr{}, ErrInUse}, // every address of h1 includes ipA
		{h1, "d", ipA, ErrInUse},
		{h2, "e", netip.Addr{}, nil}, // another host
		{h2, "f", ipA, ErrInUse},     // h2's every-address binding covers ipA
	} {
		_, err := tc.a.Allocate(ctx, ep(tc.id), hp(tc.ip))
		if !errors.Is(err, tc.want) && (err != nil || tc.want != nil) {
			t.Fatalf("%s on %s ip %v: %v, want %v", tc.id, tc.a.host, tc.ip, err, tc.want)
		}
	}
	var inUse *InUseError
	_, err := h1.Allocate(ctx, ep("g"), hp(netip.Addr{}))
	if !errors.As(err, &inUse) || inUse.Host != "h1" || inUse.Mode != Host || !strings.HasPrefix(inUse.Holder, "port/net/") {
		t.Fatalf("in use: %v", err)
	}
	// An ingress port on 8080 is refused: host ports use it.
	if _, err := h1.Allocate(ctx, ep("i"), []Port{{Mode: Ingress, Protocol: "tcp", Number: 8080}}); !errors.Is(err, ErrInUse) {
		t.Fatalf("ingress over host ports: %v", err)
	}
	// An ingress port with a host IP is a bad spec.
	if _, err := h1.Allocate(ctx, ep("j"), []Port{{Mode: Ingress, Protocol: "tcp", Number: 9000, HostIP: ipA}}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("ingress with host IP: %v", err)
	}
}

// A stored record whose ports do not fit its spec is reported and nothing
// is recovered from it; a record of another kind is an error, never used.
func TestInconsistentRecordsAreReported(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	a, _ := New(st, "h1")
	spec := []Port{{Mode: Ingress, Protocol: "tcp"}}
	first, err := a.Allocate(ctx, ep("x"), spec)
	if err != nil {
		t.Fatal(err)
	}
	// Tamper: the record says its dynamic entry was given a port of udp.
	kvs, _ := st.Get(ctx, endpointKey(ep("x")))
	bad := strings.Replace(string(kvs[0].Value), `"ports":[{"mode":"ingress","protocol":"tcp"`, `"ports":[{"mode":"ingress","protocol":"udp"`, 1)
	if bad == string(kvs[0].Value) {
		t.Fatalf("tampering failed: %s", kvs[0].Value)
	}
	if err := st.Commit(ctx, nil, []store.Op{store.Put(kvs[0].Key, []byte(bad))}); err != nil {
		t.Fatal(err)
	}
	res, err := a.Allocate(ctx, ep("x"), spec)
	if err != nil || len(res.Findings) == 0 {
		t.Fatalf("re-applying over the bad record: %+v %v, want findings", res, err)
	}
	t.Logf("findings: %v (first port %v, now %v)", res.Findings, first.Ports, res.Ports)
	// Another kind under p/e/ is refused.
	if err := st.Commit(ctx, nil, []store.Op{store.Put(endpointKey(ep("y")), []byte(`{"kind":"cni","host":"h1","spec":[],"ports":[]}`))}); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Allocate(ctx, ep("y"), spec); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("record of kind cni: %v", err)
	}
	if _, _, err := a.Lookup(ctx, ep("y")); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("lookup of kind cni: %v", err)
	}
}

func TestEndpointIDs(t *testing.T) {
	if Kind != string(pool.KindPort) {
		t.Fatalf("Kind %q differs from pool.KindPort %q", Kind, pool.KindPort)
	}
	id := ep("c1")
	if s := id.String(); s != "port/net/c1/eth0" {
		t.Fatalf("String: %q", s)
	}
	if got, ok := ParseEndpointID(id.String()); !ok || got != id {
		t.Fatalf("Parse: %+v %v", got, ok)
	}
	for _, bad := range []string{"net/c1/eth0", "cni/net/c1/eth0", "port/net/c1", "port//c1/eth0"} {
		if _, ok := ParseEndpointID(bad); ok {
			t.Fatalf("Parse(%q) accepted", bad)
		}
	}
	if got, ok := endpointOfKey(endpointKey(id)); !ok || got != id {
		t.Fatalf("key round trip: %+v %v", got, ok)
	}
	// Every key of the package is under p/.
	for _, k := range []string{endpointKey(id), addrKey(Address{"udp", 53})} {
		if !strings.HasPrefix(k, "p/") {
			t.Fatalf("key %q outside p/", k)
		}
	}
}

// A request too large for one store transaction is refused as invalid,
// not retried as a conflict.
func TestTooManyPorts(t *testing.T) {
	a, _ := New(memory.New(), "h1")
	var spec []Port
	for i := range store.MaxOps {
		spec = append(spec, Port{Mode: Host, Protocol: "tcp", Number: uint16(1000 + i)})
	}
	if _, err := a.Allocate(context.Background(), ep("big"), spec); !errors.Is(err, ErrInvalid) {
		t.Fatalf("%d ports: %v", len(spec), err)
	}
}

// Verify reports a port whose address no longer lists the endpoint.
func TestVerify(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	a, _ := New(st, "h1")
	if _, ok, f, err := a.Verify(ctx, ep("x")); ok || f != nil || err != nil {
		t.Fatalf("nothing held: %v %v %v", ok, f, err)
	}
	if _, err := a.Allocate(ctx, ep("x"), []Port{{Mode: Ingress, Protocol: "tcp", Number: 7000}, {Mode: Host, Protocol: "udp"}}); err != nil {
		t.Fatal(err)
	}
	if _, ok, f, err := a.Verify(ctx, ep("x")); !ok || len(f) != 0 || err != nil {
		t.Fatalf("consistent: %v %v %v", ok, f, err)
	}
	if err := st.Commit(ctx, nil, []store.Op{store.Delete(addrKey(Address{"tcp", 7000}))}); err != nil {
		t.Fatal(err)
	}
	if _, ok, f, err := a.Verify(ctx, ep("x")); !ok || len(f) != 1 || err != nil || !strings.Contains(f[0], "tcp/7000") {
		t.Fatalf("address gone: %v %v %v", ok, f, err)
	}
}
