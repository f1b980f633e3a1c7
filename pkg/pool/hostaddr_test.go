package pool

import (
	"context"
	"encoding/json"
	"reflect"
	"testing"

	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/memory"
)

// TestHostAddrOnePerFamily: a dual-stack heartbeat ("198.18.0.1,fd00::1")
// keeps the first address in the record's "addr", the one older agents
// read, and both in "as"; Hosts and Heartbeat report both; a record written
// before dual-stack hosts (only "addr") reads as before; a heartbeat
// without an address keeps them, one with a single address drops "as".
func TestHostAddrOnePerFamily(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	a, _ := New(st, "host-a")
	admin, _ := New(st, "admin")
	addrOf := func(host string) string {
		t.Helper()
		hs, err := admin.Hosts(ctx, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, h := range hs {
			if h.Name == host {
				return h.Addr
			}
		}
		t.Fatalf("%s not in %+v", host, hs)
		return ""
	}
	raw := func(host string) map[string]any {
		t.Helper()
		kvs, err := st.Get(ctx, hostRecordKey(host))
		if err != nil || !kvs[0].Exists() {
			t.Fatalf("host record of %s: %v %+v", host, err, kvs)
		}
		var m map[string]any
		if err := json.Unmarshal(kvs[0].Value, &m); err != nil {
			t.Fatal(err)
		}
		return m
	}

	if _, err := a.Heartbeat(ctx, "198.18.0.1, fd00::1", nil); err != nil {
		t.Fatal(err)
	}
	if got := addrOf("host-a"); got != "198.18.0.1,fd00::1" {
		t.Fatalf("Hosts reports addr %q", got)
	}
	m := raw("host-a")
	if m["addr"] != "198.18.0.1" || !reflect.DeepEqual(m["as"], []any{"198.18.0.1", "fd00::1"}) {
		t.Fatalf("record %v: want addr 198.18.0.1 and as [198.18.0.1 fd00::1]", m)
	}
	info, err := a.Heartbeat(ctx, "", nil)
	if err != nil {
		t.Fatal(err)
	}
	if info.Addr != "198.18.0.1,fd00::1" || !reflect.DeepEqual(info.AddrList(), []string{"198.18.0.1", "fd00::1"}) {
		t.Fatalf("Heartbeat reports the record's addr %q (%q)", info.Addr, info.AddrList())
	}
	if got := addrOf("host-a"); got != "198.18.0.1,fd00::1" {
		t.Fatalf("a heartbeat without --addr changed it: %q", got)
	}
	if _, err := a.Heartbeat(ctx, "fd00::1", nil); err != nil {
		t.Fatal(err)
	}
	if m := raw("host-a"); m["addr"] != "fd00::1" || m["as"] != nil {
		t.Fatalf("record after a single-address heartbeat: %v", m)
	}

	// A record as agents before dual-stack hosts wrote it.
	old := []byte(`{"addr":"198.18.0.2","s":1800000000}`)
	if err := st.Commit(ctx, nil, []store.Op{store.Put(hostRecordKey("host-b"), old)}); err != nil {
		t.Fatal(err)
	}
	if got := addrOf("host-b"); got != "198.18.0.2" {
		t.Fatalf("an old record's addr reads as %q", got)
	}
	if got := (HostInfo{Addr: "198.18.0.2"}).AddrList(); !reflect.DeepEqual(got, []string{"198.18.0.2"}) {
		t.Fatalf("AddrList of one address: %q", got)
	}
	if got := (HostInfo{}).AddrList(); got != nil {
		t.Fatalf("AddrList of none: %q", got)
	}
}
