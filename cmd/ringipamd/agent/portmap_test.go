package agent

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/ringipam/ringipam/pkg/cni/portmap"
	"github.com/ringipam/ringipam/pkg/hostlock"
	"github.com/ringipam/ringipam/pkg/portalloc"
	"github.com/ringipam/ringipam/pkg/store/memory"
)

// fakePortmap is portmap-ingress's table: rules by mark.
type fakePortmap struct {
	mu      sync.Mutex
	marks   map[string][]portmap.Rule
	removed []string
}

func (f *fakePortmap) Add(_ context.Context, mark string, rules []portmap.Rule) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.marks[mark] = append(f.marks[mark], rules...)
	return nil
}

func (f *fakePortmap) Remove(_ context.Context, mark string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.marks[mark]; ok {
		f.removed = append(f.removed, mark)
	}
	delete(f.marks, mark)
	return nil
}

func (f *fakePortmap) Marks(context.Context) (map[string][]portmap.Rule, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return maps.Clone(f.marks), nil
}

func (f *fakePortmap) has() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Sorted(maps.Keys(f.marks))
}

// The agent removes from portmap-ingress's table the forwards of every
// attachment this host does not hold in the store (plain and hashed marks),
// on start and then on a sync after the store loses one, and keeps the
// others; each removal takes the attachment's lock.
func TestAgentRemovesForwardsOfEndpointsNoLongerHeld(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	ports, _ := portalloc.New(st, "host-a")
	other, _ := portalloc.New(st, "host-b")
	long := strings.Repeat("f", 200)
	id := func(c string) portalloc.EndpointID {
		return portalloc.EndpointID{Network: "net", ContainerID: c, IfName: "eth0"}
	}
	for i, c := range []string{"kept", "later", long} {
		if _, err := ports.Allocate(ctx, id(c), []portalloc.Port{{Mode: portalloc.Host, Protocol: "tcp", Number: uint16(7000 + i)}}); err != nil {
			t.Fatal(err)
		}
	}
	// The same attachment name on another host is not this host's.
	if _, err := other.Allocate(ctx, id("moved"), []portalloc.Port{{Mode: portalloc.Host, Protocol: "tcp", Number: 7100}}); err != nil {
		t.Fatal(err)
	}
	fp := &fakePortmap{marks: map[string][]portmap.Rule{}}
	for _, c := range []string{"kept", "later", long, "gone", "moved", long + "-gone"} {
		fp.marks[portmap.Mark(id(c))] = nil
	}
	fp.marks["not-a-port-mark"] = nil // not an attachment's: left alone
	locks := hostlock.Dir(t.TempDir())
	a := newTestAgent(t, st, "host-a", nil, withPortmap(fp, locks))
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- a.Run(runCtx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()
	want := func(cs ...string) []string {
		out := []string{"not-a-port-mark"}
		for _, c := range cs {
			out = append(out, portmap.Mark(id(c)))
		}
		slices.Sort(out)
		return out
	}
	waitFor(t, "the forwards of attachments not held removed on start", func() bool {
		return slices.Equal(fp.has(), want("kept", "later", long))
	})
	if _, err := ports.Release(ctx, id("later")); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the forwards of a released attachment removed on a sync", func() bool {
		return slices.Equal(fp.has(), want("kept", long))
	})
	fp.mu.Lock()
	removed, n := fmt.Sprint(fp.removed), len(fp.removed)
	fp.mu.Unlock()
	if n != 4 {
		t.Errorf("removed %s, want the 4 stale attachments once each", removed)
	}
}
