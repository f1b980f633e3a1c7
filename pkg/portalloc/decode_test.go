package portalloc_test

import (
	"context"
	"reflect"
	"testing"

	"github.com/ringipam/ringipam/pkg/portalloc"
	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/memory"
)

// DecodePublished over the raw p/a/ keys is what the agents forward: the
// ingress holders as Ingresses reads them, never the marker of the
// host-mode bindings kept per host under p/h/ (which List adds); the host
// index keys name the host's endpoints.
func TestDecodersAgreeWithList(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	for _, h := range []string{"host-a", "host-b"} {
		a, err := portalloc.New(st, h)
		if err != nil {
			t.Fatal(err)
		}
		ep := portalloc.EndpointID{Network: "n", ContainerID: h, IfName: "eth0"}
		if _, err := a.Allocate(ctx, ep, []portalloc.Port{{Mode: portalloc.Ingress, Protocol: "tcp", Name: "80"}, {Mode: portalloc.Host, Protocol: "udp", Number: 53}}); err != nil {
			t.Fatal(err)
		}
	}
	a, _ := portalloc.New(st, "host-a")
	list, err := a.Ingresses(ctx)
	if err != nil {
		t.Fatal(err)
	}
	kvs, err := st.Scan(ctx, portalloc.PublishedKeyPrefix, store.PrefixEnd(portalloc.PublishedKeyPrefix), 0)
	if err != nil {
		t.Fatal(err)
	}
	var got []portalloc.Published
	for _, kv := range kvs {
		p, ok, err := portalloc.DecodePublished(kv.Key, kv.Value)
		if err != nil {
			t.Fatal(err)
		}
		if len(p.State.Hosts) != 0 {
			t.Fatalf("%s decoded with host users %+v: the marker of udp/53's per-host bindings is not a user", kv.Key, p.State.Hosts)
		}
		if ok && p.State.Ingress != "" {
			got = append(got, p)
		}
	}
	if len(list) < 2 || !reflect.DeepEqual(got, list) {
		t.Fatalf("decoded %+v, Ingresses %+v", got, list)
	}
	if len(kvs) != 3 {
		t.Fatalf("p/a/ holds %d keys, want 3 (two ingress ports, one marker of udp/53): %v", len(kvs), kvs)
	}
	if _, ok, err := portalloc.DecodePublished(portalloc.PublishedKeyPrefix+"tcp/00080", []byte("{")); !ok || err == nil {
		t.Fatal("a corrupt value decoded")
	}
	if _, ok, _ := portalloc.DecodePublished("p/a/tcp/zero", nil); ok {
		t.Fatal("a key naming no address decoded")
	}
	if _, err := a.HostEndpoints(ctx, "host-a", ""); err != nil { // builds the index
		t.Fatal(err)
	}
	idx, err := st.Scan(ctx, portalloc.HostIndexPrefix("host-a"), store.PrefixEnd(portalloc.HostIndexPrefix("host-a")), 0)
	if err != nil || len(idx) != 1 {
		t.Fatalf("index %v, %v", idx, err)
	}
	host, id, ok := portalloc.DecodeHostIndexKey(idx[0].Key)
	if !ok || host != "host-a" || id != (portalloc.EndpointID{Network: "n", ContainerID: "host-a", IfName: "eth0"}) {
		t.Fatalf("DecodeHostIndexKey %q %+v %v", host, id, ok)
	}
}
