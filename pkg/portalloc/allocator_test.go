package portalloc

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"sync"
	"testing"
	"time"

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
	if !errors.As(err, &inUse) || inUse.Holder != "net/web/eth0" || inUse.Host != "h1" {
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
	if err := st.Commit(ctx, nil, []store.Op{store.Put(endpointKey("net/y/eth0"), []byte(`{"host":"h1","spec":[{"mode":"ingress","protocol":"tcp","published":7000}],"ports":[{"mode":"ingress","protocol":"tcp","published":7000}]}`))}); err != nil {
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
	n, err := live.ReleaseHost(ctx, "gone")
	if err != nil || n != 1 {
		t.Fatalf("ReleaseHost: %d %v", n, err)
	}
	if _, err := live.Allocate(ctx, ep("new"), []Port{{Mode: Ingress, Protocol: "tcp", Number: 8000}}); err != nil {
		t.Fatalf("8000 after its host was released: %v", err)
	}
	if _, ok, _ := live.Lookup(ctx, ep("e1")); !ok {
		t.Fatal("the live host's endpoint was released")
	}
	if n, err := live.ReleaseHost(ctx, "gone"); err != nil || n != 0 {
		t.Fatalf("second ReleaseHost: %d %v", n, err)
	}
}
