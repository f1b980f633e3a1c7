package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"net/netip"
	"strings"
	"testing"

	"github.com/ringipam/ringipam/pkg/containernet"
	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/portalloc"
	"github.com/ringipam/ringipam/pkg/store"
)

// checkWorld is newWorld with published ports and container networks:
// node-a-1 publishes ingress tcp/8080 and node-b-1 host udp/5353 (network
// "net", whose attachments the pool holds on those hosts), and pool "cn"
// has three container networks made by pkg/containernet on node-c: cn-0
// from the pool, cn-1 and cn-2 in special subnet 10.99.0.0/24.
func checkWorld(t *testing.T) *world {
	t.Helper()
	ctx := context.Background()
	w := newWorld(t)
	st := w.ctl.Store
	publish := func(host, ctr string, p portalloc.Port) {
		a, err := portalloc.New(st, host)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := a.Allocate(ctx, portalloc.EndpointID{Network: "net", ContainerID: ctr, IfName: "eth0"}, []portalloc.Port{p}); err != nil {
			t.Fatal(err)
		}
	}
	publish("node-a", "node-a-1", portalloc.Port{Mode: portalloc.Ingress, Protocol: "tcp", Number: 8080})
	publish("node-b", "node-b-1", portalloc.Port{Mode: portalloc.Host, Protocol: "udp", Number: 5353})
	nc := w.hosts["node-c"]
	if err := nc.Define(ctx, pool.Def{Name: "cn", Ranges: []pool.Range{{Subnet: netip.MustParsePrefix("198.19.0.0/24")}}}); err != nil {
		t.Fatal(err)
	}
	m := containernet.NewManager(nc)
	if _, err := m.CreateFromPool(ctx, cnOwner(0), "cn"); err != nil {
		t.Fatal(err)
	}
	special := netip.MustParsePrefix("10.99.0.0/24")
	for i, ip := range []string{"10.99.0.5", "10.99.0.6"} {
		if _, err := m.CreateInSubnet(ctx, cnOwner(i+1), "cn", special, netip.MustParseAddr(ip)); err != nil {
			t.Fatal(err)
		}
	}
	if v, err := w.ctl.Check(ctx); err != nil || len(v) != 0 {
		t.Fatalf("check of a healthy store with ports and container networks: %v %v", v, err)
	}
	return w
}

func cnOwner(i int) pool.Owner {
	return pool.Owner{Kind: pool.KindCNI, Network: "cn", ContainerID: "cn-" + string(rune('0'+i)), IfName: "eth0"}
}

// editKey rewrites a JSON record of the store, as a bug or a hand edit
// would.
func editKey(t *testing.T, st store.Store, key string, edit func(map[string]any)) {
	t.Helper()
	ctx := context.Background()
	kvs, err := st.Get(ctx, key)
	if err != nil || !kvs[0].Exists() {
		t.Fatalf("get %s: %v", key, err)
	}
	var m map[string]any
	if err := json.Unmarshal(kvs[0].Value, &m); err != nil {
		t.Fatal(err)
	}
	edit(m)
	b, _ := json.Marshal(m)
	if err := st.Commit(ctx, nil, []store.Op{store.Put(key, b)}); err != nil {
		t.Fatal(err)
	}
}

// addrOfRole returns the address of role in pool of an owner record.
func addrOfRole(t *testing.T, st store.Store, key, poolName string, role pool.Role) string {
	t.Helper()
	var got string
	editKey(t, st, key, func(m map[string]any) {
		for _, x := range m["addrs"].([]any) {
			x := x.(map[string]any)
			if x["pool"] == poolName && x["role"] == string(role) {
				got = x["addr"].(string)
			}
		}
	})
	if got == "" {
		t.Fatalf("%s holds no %s in %s", key, role, poolName)
	}
	return got
}

func setRole(t *testing.T, st store.Store, key, poolName string, role pool.Role, addr string) {
	t.Helper()
	editKey(t, st, key, func(m map[string]any) {
		for _, x := range m["addrs"].([]any) {
			x := x.(map[string]any)
			if x["pool"] == poolName && x["role"] == string(role) {
				x["addr"] = addr
			}
		}
	})
}

// check reports, by its stable name, each invariant of the published ports
// and of the container networks broken on purpose in a memory store, and
// none on the healthy store (checkWorld), with exit 1 and a line per
// finding starting with the name.
func TestCheckInvariants(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name, inv, want string
		corrupt         func(t *testing.T, st store.Store)
	}{
		{"address lost", portalloc.InvRecords, "endpoint port/net/node-a-1/eth0 claims ingress tcp/8080, which its address does not list",
			func(t *testing.T, st store.Store) {
				if err := st.Commit(ctx, nil, []store.Op{store.Delete("p/a/tcp/08080")}); err != nil {
					t.Fatal(err)
				}
			}},
		{"record-only ingress shadows a host port", portalloc.InvClash, "udp/5353 is held in ingress mode by port/net/node-c-1/eth0 and in host mode by port/net/node-b-1/eth0 on host node-b",
			func(t *testing.T, st store.Store) {
				// A record alone claims an ingress port on node-b's host port.
				p := portalloc.Port{Mode: portalloc.Ingress, Protocol: "udp", Number: 5353}
				b, _ := json.Marshal(portalloc.Endpoint{Kind: portalloc.Kind, Host: "node-c", Spec: []portalloc.Port{p}, Ports: []portalloc.Port{p}})
				if err := st.Commit(ctx, nil, []store.Op{store.Put("p/e/net/node-c-1/eth0", b)}); err != nil {
					t.Fatal(err)
				}
			}},
		{"host unknown", portalloc.InvHolder, "endpoint port/net/node-a-1/eth0 is published on host node-z, which the store does not know",
			func(t *testing.T, st store.Store) {
				// Record and address agree, on a host nobody knows.
				editKey(t, st, "p/e/net/node-a-1/eth0", func(m map[string]any) { m["host"] = "node-z" })
				editKey(t, st, "p/a/tcp/08080", func(m map[string]any) { m["ih"] = "node-z" })
			}},
		{"attachment released", portalloc.InvHolder, "endpoint port/net/node-b-1/eth0 holds ports, but network net has no attachment node-b-1/eth0",
			func(t *testing.T, st store.Store) {
				// The attachment is released, its ports are not.
				if _, _, err := mustPool(t, st, "node-b").Release(ctx, owner("node-b", 1)); err != nil {
					t.Fatal(err)
				}
			}},
		{"record unreadable", portalloc.InvCorrupt, "endpoint port/net/node-a-1/eth0: stored record is corrupt",
			func(t *testing.T, st store.Store) {
				if err := st.Commit(ctx, nil, []store.Op{store.Put("p/e/net/node-a-1/eth0", []byte("{"))}); err != nil {
					t.Fatal(err)
				}
			}},
		{"gateway is the ip", InvCNetValid, "ContainerNet violated by cni/cn/cn-0/eth0: invalid container network",
			func(t *testing.T, st store.Store) {
				// cn-0's gateway record names its own ip.
				key := "o/" + cnOwner(0).String()
				setRole(t, st, key, "cn", pool.RoleGateway, addrOfRole(t, st, key, "cn", pool.RoleIP))
			}},
		{"special subnet inside the pool", InvCNetValid, "CNetValid violated by cni/cn/cn-1/eth0: neither CNetPooled",
			func(t *testing.T, st store.Store) {
				// The special subnet's definition moved into the pool.
				editKey(t, st, "d/cn:subnet:10.99.0.0_24", func(m map[string]any) {
					m["ranges"] = []map[string]string{{"subnet": "198.19.0.0/25"}}
				})
			}},
		{"shared gateway", InvCNetPair, "CNetPairValid violated by cni/cn/cn-1/eth0 and cni/cn/cn-2/eth0: both have gateway",
			func(t *testing.T, st store.Store) {
				gw := addrOfRole(t, st, "o/"+cnOwner(1).String(), "cn", pool.RoleGateway)
				setRole(t, st, "o/"+cnOwner(2).String(), "cn", pool.RoleGateway, gw)
			}},
		{"shared ip", InvCNetPair, "CNetPairValid violated by cni/cn/cn-1/eth0 and cni/cn/cn-2/eth0: both have ip 10.99.0.5",
			func(t *testing.T, st store.Store) {
				setRole(t, st, "o/"+cnOwner(2).String(), "cn:subnet:10.99.0.0_24", pool.RoleIP, "10.99.0.5")
			}},
	} {
		t.Run(tc.inv+"/"+tc.name, func(t *testing.T) {
			w := checkWorld(t)
			tc.corrupt(t, w.ctl.Store)
			v, err := w.ctl.Check(ctx)
			if err != nil {
				t.Fatal(err)
			}
			var out bytes.Buffer
			RenderCheck(&out, v)
			found := false
			for _, x := range v {
				found = found || x.Invariant == tc.inv && strings.Contains(x.Detail, tc.want)
			}
			if !found {
				t.Fatalf("no %s finding containing %q:\n%s", tc.inv, tc.want, out.String())
			}
			if !strings.Contains(out.String(), "\n"+tc.inv+": ") && !strings.HasPrefix(out.String(), tc.inv+": ") {
				t.Errorf("no line starts with %s:\n%s", tc.inv, out.String())
			}
			checkWidth(t, out.String())
			t.Logf("check:\n%s", out.String())
		})
	}
}

func mustPool(t *testing.T, st store.Store, host string) *pool.Allocator {
	t.Helper()
	a, err := pool.New(st, host)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// busyStore is a store on which another host's ADD commits before each of
// the first reads: a live cluster, as ringctl check sees it.
type busyStore struct {
	store.Store
	t     *testing.T
	add   func(i int) error
	reads int
}

func (b *busyStore) Scan(ctx context.Context, from, to string, limit int) ([]store.KV, error) {
	b.reads++
	if b.reads <= 40 {
		if err := b.add(b.reads); err != nil {
			b.t.Errorf("the concurrent ADD %d: %v", b.reads, err)
		}
	}
	return b.Store.Scan(ctx, from, to, limit)
}

// TestCheckOfABusyStore: ADDs committed while check reads (each an owner
// record and its address key in one commit) are no finding: check reads
// the store at one revision. Reading each prefix of the live store in turn
// reported the addresses added between the owner records' read and the
// address keys' read as held by owners with no record.
func TestCheckOfABusyStore(t *testing.T) {
	w := newWorld(t)
	ctx := context.Background()
	b := &busyStore{Store: w.ctl.Store, t: t, add: func(i int) error {
		_, err := w.hosts["node-a"].Allocate(ctx, pool.Request{Owner: owner("node-a", 100+i), Wants: []pool.Want{{Pool: "net-0", Role: pool.RoleIP}}, Defs: w.defs[:1]})
		return err
	}}
	admin, err := pool.New(b, "admin", pool.WithClock(w.clk.Now))
	if err != nil {
		t.Fatal(err)
	}
	ctl := *w.ctl
	ctl.Pool, ctl.Store = admin, b
	v, err := ctl.Check(ctx)
	if err != nil || len(v) != 0 {
		t.Fatalf("check of a store that ADDs commit to while it reads: %v %v; want no finding", v, err)
	}
	if b.reads == 0 {
		t.Fatal("check did not read the store")
	}
}
