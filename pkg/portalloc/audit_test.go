package portalloc

import (
	"context"
	"encoding/json"
	"net/netip"
	"strings"
	"testing"

	"github.com/ringipam/ringipam/pkg/pool"
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
	if got, err := Audit(ctx, st, Holders{}); err != nil || got != nil {
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
	// (Host-mode bindings are kept per host: h2's key of udp/53.)
	put(hostBindKey(Address{"udp", 53}, "h2"), []binding{
		{Endpoint: "port/net/dns2/eth0"},
		{IP: netip.MustParseAddr("198.18.0.2"), Endpoint: "port/net/dns3/eth0"},
	})
	// Unreadable keys.
	put(addrKey(Address{"tcp", 4040}), []byte("{not json"))
	put("p/a/tcp/notanumber", AddrState{Ingress: "port/net/a/eth0"})

	findings, err := Audit(ctx, st, Holders{})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, f := range findings {
		got = append(got, f.String())
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

// Each invariant of Audit, on a store the allocators wrote and one record
// then corrupted by hand: the finding names the invariant, and the clean
// store has none (with the holders known).
func TestAuditInvariants(t *testing.T) {
	ctx := context.Background()
	web, dns := ep("web"), ep("dns")
	known := Holders{
		Hosts:       map[string]bool{"h1": true, "h2": true},
		Attachments: map[EndpointID]string{web: "h1", dns: "h2", ep("idle"): "h2"},
	}
	setup := func(t *testing.T) store.Store {
		t.Helper()
		st := memory.New()
		h1, _ := New(st, "h1", WithDynamicRange(30000, 30009))
		h2, _ := New(st, "h2", WithDynamicRange(30000, 30009))
		if _, err := h1.Allocate(ctx, web, []Port{{Mode: Ingress, Protocol: "tcp", Number: 8080}}); err != nil {
			t.Fatal(err)
		}
		if _, err := h2.Allocate(ctx, dns, []Port{{Mode: Host, Protocol: "udp", Number: 53}}); err != nil {
			t.Fatal(err)
		}
		if got, err := Audit(ctx, st, known); err != nil || got != nil {
			t.Fatalf("audit of what the allocators wrote: %q %v, want nothing", got, err)
		}
		return st
	}
	put := func(t *testing.T, st store.Store, key string, v any) {
		t.Helper()
		b, _ := json.Marshal(v)
		if err := st.Commit(ctx, nil, []store.Op{store.Put(key, b)}); err != nil {
			t.Fatal(err)
		}
	}
	for _, tc := range []struct {
		name, inv, want string
		holders         Holders
		corrupt         func(t *testing.T, st store.Store)
	}{
		{"second ingress record", InvClash, "tcp/8080 is held in ingress mode by both port/net/idle/eth0 (host h2) and port/net/web/eth0 (host h1)", known,
			func(t *testing.T, st store.Store) {
				p := Port{Mode: Ingress, Protocol: "tcp", Number: 8080}
				put(t, st, endpointKey(ep("idle")), Endpoint{Kind: Kind, Host: "h2", Spec: []Port{p}, Ports: []Port{p}})
			}},
		{"ingress shadows a host port", InvClash, "udp/53 is held in ingress mode by port/net/idle/eth0 and in host mode by port/net/dns/eth0 on host h2", known,
			func(t *testing.T, st store.Store) {
				p := Port{Mode: Ingress, Protocol: "udp", Number: 53}
				// Only the record says so: the address lists dns alone.
				put(t, st, endpointKey(ep("idle")), Endpoint{Kind: Kind, Host: "h1", Spec: []Port{p}, Ports: []Port{p}})
			}},
		{"one record claims an address twice", InvClash, "endpoint port/net/web/eth0 claims tcp/8080 twice", known,
			func(t *testing.T, st store.Store) {
				p := Port{Mode: Ingress, Protocol: "tcp", Number: 8080}
				put(t, st, endpointKey(web), Endpoint{Kind: Kind, Host: "h1", Spec: []Port{p, p}, Ports: []Port{p, p}})
			}},
		{"address lost", InvRecords, "endpoint port/net/web/eth0 claims ingress tcp/8080, which its address does not list", known,
			func(t *testing.T, st store.Store) {
				if err := st.Commit(ctx, nil, []store.Op{store.Delete(addrKey(Address{"tcp", 8080}))}); err != nil {
					t.Fatal(err)
				}
			}},
		{"unknown host", InvHolder, "endpoint port/net/dns/eth0 is published on host h2, which the store does not know", Holders{Hosts: map[string]bool{"h1": true}},
			func(t *testing.T, st store.Store) {}},
		{"attachment on another host", InvHolder, "endpoint port/net/dns/eth0 is published on host h2, but its attachment's addresses are held on host h1",
			Holders{Hosts: known.Hosts, Attachments: map[EndpointID]string{web: "h1", dns: "h1"}},
			func(t *testing.T, st store.Store) {}},
		{"attachment gone", InvHolder, "endpoint port/net/dns/eth0 holds ports, but network net has no attachment dns/eth0", Holders{Hosts: known.Hosts, Attachments: map[EndpointID]string{web: "h1"}},
			func(t *testing.T, st store.Store) {}},
		{"unreadable record", InvCorrupt, "endpoint port/net/web/eth0: stored record is corrupt", known,
			func(t *testing.T, st store.Store) {
				if err := st.Commit(ctx, nil, []store.Op{store.Put(endpointKey(web), []byte("{"))}); err != nil {
					t.Fatal(err)
				}
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st := setup(t)
			tc.corrupt(t, st)
			got, err := Audit(ctx, st, tc.holders)
			if err != nil {
				t.Fatal(err)
			}
			found := false
			for _, f := range got {
				found = found || f.Invariant == tc.inv && strings.Contains(f.Detail, tc.want)
			}
			if !found {
				t.Fatalf("no %s finding containing %q in %q", tc.inv, tc.want, got)
			}
			t.Logf("%q", got)
		})
	}
}

// The invariant that every record can be read has one name in the whole
// of ringctl check.
func TestAuditCorruptIsThePoolsName(t *testing.T) {
	if InvCorrupt != pool.InvCorrupt {
		t.Fatalf("portalloc.InvCorrupt %q, pool.InvCorrupt %q", InvCorrupt, pool.InvCorrupt)
	}
}
