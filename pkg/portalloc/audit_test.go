package portalloc

import (
	"context"
	"encoding/json"
	"net/netip"
	"strings"
	"testing"

	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/memory"
)

// Audit finds nothing on a store the allocators wrote, and names each kind
// of disagreement written into it by hand.
func TestAudit(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	h1, _ := New(st, "h1", WithDynamicRange(30000, 30009))
	h2, _ := New(st, "h2", WithDynamicRange(30000, 30009))
	mustAllocate := func(a *Allocator, id EndpointID, spec ...Port) {
		t.Helper()
		if _, err := a.Allocate(ctx, id, spec); err != nil {
			t.Fatal(err)
		}
	}
	mustAllocate(h1, ep("web"), Port{Mode: Ingress, Name: "80", Protocol: "tcp", Number: 8080}, Port{Mode: Host, Name: "22", Protocol: "tcp"})
	mustAllocate(h1, ep("dns"), Port{Mode: Host, Protocol: "udp", Number: 53, HostIP: netip.MustParseAddr("198.18.0.1")})
	mustAllocate(h2, ep("dns2"), Port{Mode: Host, Protocol: "udp", Number: 53})
	mustAllocate(h1, ep("gone"), Port{Mode: Ingress, Protocol: "tcp", Number: 7070})
	if _, err := h1.Release(ctx, ep("gone")); err != nil {
		t.Fatal(err)
	}
	if got, err := Audit(ctx, st); err != nil || got != nil {
		t.Fatalf("audit of what the allocators wrote: %q %v, want nothing", got, err)
	}

	put := func(key string, v any) {
		t.Helper()
		b, ok := v.([]byte)
		if !ok {
			var err error
			if b, err = json.Marshal(v); err != nil {
				t.Fatal(err)
			}
		}
		if err := st.Commit(ctx, nil, []store.Op{store.Put(key, b)}); err != nil {
			t.Fatal(err)
		}
	}
	// A record lost: its ports stay held with nobody to release them.
	if err := st.Commit(ctx, nil, []store.Op{store.Delete(endpointKey(ep("web")))}); err != nil {
		t.Fatal(err)
	}
	// A record claiming a port its address does not list.
	put(endpointKey(ep("ghost")), Endpoint{Kind: Kind, Host: "h2", Spec: []Port{{Mode: Host, Protocol: "tcp", Number: 6060}}, Ports: []Port{{Mode: Host, Protocol: "tcp", Number: 6060}}})
	// Ingress and host mode on one address; two overlapping bindings on
	// one host.
	put(addrKey(Address{"tcp", 5050}), AddrState{Ingress: "port/net/a/eth0", IngressHost: "h1", Hosts: []HostUse{{Host: "h2", Endpoint: "port/net/b/eth0"}}})
	put(addrKey(Address{"udp", 53}), AddrState{Hosts: []HostUse{
		{Host: "h1", IP: netip.MustParseAddr("198.18.0.1"), Endpoint: "port/net/dns/eth0"},
		{Host: "h2", Endpoint: "port/net/dns2/eth0"},
		{Host: "h2", IP: netip.MustParseAddr("198.18.0.2"), Endpoint: "port/net/dns3/eth0"},
	}})
	// Unreadable keys.
	put(addrKey(Address{"tcp", 4040}), []byte("{not json"))
	put("p/a/tcp/notanumber", AddrState{Ingress: "port/net/a/eth0"})

	got, err := Audit(ctx, st)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{
		"key p/a/tcp/notanumber names no address",
		"p/a/tcp/04040: corrupt",
		"endpoint port/net/ghost/eth0 claims host tcp/6060, which its address does not list",
		"tcp/8080 is held in ingress mode by port/net/web/eth0, whose record does not claim it (leaked)",
		"tcp/3000", // web's dynamic host port, leaked too
		"tcp/5050 is held in ingress mode by port/net/a/eth0 and in host mode by port/net/b/eth0",
		"tcp/5050 on host h2 is held in host mode by port/net/b/eth0, whose record does not claim it there (leaked)",
		"udp/53 on host h2 is bound by port/net/dns2/eth0 and port/net/dns3/eth0 on overlapping addresses",
		"udp/53 on host h2 is held in host mode by port/net/dns3/eth0, whose record does not claim it there (leaked)",
	}
	for _, w := range want {
		found := false
		for _, g := range got {
			if strings.Contains(g, w) {
				found = true
			}
		}
		if !found {
			t.Errorf("no finding containing %q", w)
		}
	}
	if len(got) != len(want)+1 { // and a's ingress 5050, leaked
		t.Errorf("%d findings, want %d:\n%s", len(got), len(want)+1, strings.Join(got, "\n"))
	}
	t.Logf("findings:\n%s", strings.Join(got, "\n"))
	for _, g := range got {
		if strings.Contains(g, "dns/eth0") || strings.Contains(g, "dns2/eth0 on host h2 is held") {
			t.Errorf("finding about a binding that is in order: %s", g)
		}
	}
}
