package pool_test

import (
	"context"
	"net/netip"
	"reflect"
	"strings"
	"testing"

	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/memory"
)

// What the decoders make of the raw keys is what the Allocator's own reads
// return: definitions (Pools), rings (RingOf), host records (Hosts, but
// for what the record does not hold) and liveness keys.
func TestDecodersAgreeWithTheReads(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	def := pool.Def{Name: "p", Ranges: []pool.Range{{Subnet: netip.MustParsePrefix("198.18.8.0/24")}}}
	for _, h := range []string{"host-a", "host-b"} {
		a, err := pool.New(st, h)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := a.Allocate(ctx, pool.Request{Owner: pool.Owner{Kind: pool.KindCNI, Network: "n", ContainerID: h, IfName: "eth0"},
			Defs: []pool.Def{def}, Wants: []pool.Want{{Pool: "p", Role: pool.RoleIP}}}); err != nil {
			t.Fatal(err)
		}
	}
	b, _ := pool.New(st, "host-b")
	if _, err := b.Heartbeat(ctx, "198.18.0.2,fd00::2", nil); err != nil {
		t.Fatal(err)
	}
	if err := st.Commit(ctx, nil, []store.Op{store.Put(pool.LivenessKey("host-b"), []byte("{}"))}); err != nil {
		t.Fatal(err)
	}
	scan := func(prefix string) []store.KV {
		kvs, err := st.Scan(ctx, prefix, store.PrefixEnd(prefix), 0)
		if err != nil {
			t.Fatal(err)
		}
		return kvs
	}
	defs, err := b.Pools(ctx)
	if err != nil {
		t.Fatal(err)
	}
	kvs := scan(pool.DefKeyPrefix)
	if len(kvs) != 1 {
		t.Fatalf("definitions %v", kvs)
	}
	d, err := pool.ParseDef(kvs[0].Key, kvs[0].Value)
	if err != nil || !reflect.DeepEqual(d, defs[0]) {
		t.Fatalf("ParseDef %+v, %v; Pools %+v", d, err, defs[0])
	}
	ring, err := b.RingOf(ctx, "p")
	if err != nil {
		t.Fatal(err)
	}
	keys := map[string][]byte{}
	for _, kv := range scan(pool.RingKeyPrefix) {
		if p, ok := pool.RangeKeyPool(kv.Key); ok && p == "p" {
			keys[kv.Key] = kv.Value
		}
	}
	if len(keys) == 0 {
		t.Fatal("no range key of pool p")
	}
	got, err := pool.DecodeRingKeys("p", d, keys)
	if err != nil || !reflect.DeepEqual(got, ring) {
		t.Fatalf("DecodeRingKeys %+v, %v; RingOf %+v", got, err, ring)
	}
	for k, v := range keys {
		// A range key decoded alone is refused with the other family's
		// definition, and a corrupt value is an error naming the key.
		rk, err := pool.DecodeRangeKey(k, v)
		if err != nil {
			t.Fatal(err)
		}
		v6 := pool.Def{Name: "p", Ranges: []pool.Range{{Subnet: netip.MustParsePrefix("2001:db8::/64")}}}
		if _, err := pool.RingOfRangeKeys("p", v6, []pool.RangeKey{rk}); err == nil {
			t.Error("an IPv4 range key made an IPv6 pool's ring")
		}
		if _, err := pool.DecodeRangeKey(k, []byte("{")); err == nil || !strings.Contains(err.Error(), k) {
			t.Errorf("a corrupt range key: %v", err)
		}
		break
	}
	if empty, err := pool.DecodeRingKeys("p", d, nil); err != nil || len(empty.Ranges) == 0 || empty.Ranges[0].Host != "" {
		t.Fatalf("no ring yet: %+v, %v", empty, err)
	}
	infos, err := b.Hosts(ctx, 0)
	if err != nil {
		t.Fatal(err)
	}
	recs := scan(pool.HostRecordKeyPrefix)
	if len(recs) != 1 {
		t.Fatalf("host records %v", recs)
	}
	h, err := pool.DecodeHostRecord(recs[0].Key, recs[0].Value)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range infos {
		if want.Name != "host-b" {
			continue
		}
		if h.Name != want.Name || h.Addr != want.Addr || h.Agent != want.Agent || !h.OrphanedAt.Equal(want.OrphanedAt) || h.Addr != "198.18.0.2,fd00::2" {
			t.Fatalf("DecodeHostRecord %+v; Hosts %+v", h, want)
		}
	}
	if _, err := pool.DecodeHostRecord(recs[0].Key, []byte("{")); err == nil {
		t.Fatal("a corrupt record decoded")
	}
	if name, ok := pool.LivenessKeyHost(scan(pool.LivenessKeyPrefix)[0].Key); !ok || name != "host-b" {
		t.Fatalf("LivenessKeyHost %q %v", name, ok)
	}
}
