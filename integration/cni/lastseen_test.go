//go:build integration

package cni

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/ringipam/ringipam/integration/cnitest"
	"github.com/ringipam/ringipam/integration/netns"
	"github.com/ringipam/ringipam/internal/testenv"
	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/store"
)

// TestVerbsRefreshLastSeen: through the ipam-ring binary on a real etcd, a
// host's last-seen time made a day old in the store is refreshed by a
// STATUS, a replayed ADD and a DEL of nothing, none of which changes an
// allocation.
func TestVerbsRefreshLastSeen(t *testing.T) {
	netns.RequireRoot(t)
	etcd := testenv.StartEtcd(t)
	name := netns.Unique("ls-")
	// The agent's own heartbeat (which refreshes the time too) is kept
	// out of the test's way: only the verbs may refresh it.
	st := agentStore(t, etcd.Endpoints(), "/"+name, "ls-host", "--heartbeat", "24h")
	conf := netConf(t, name, ipamSection("ls-host", st, subnet("198.18.40.0/24")), nil)
	if _, err := execIPAM("ADD", conf, "ctr-1", ""); err != nil {
		t.Fatal(err)
	}
	old := time.Now().Add(-24 * time.Hour).Unix()
	// age sets every last-seen field of ls-host (its records, its pool
	// states) a day back, as a host that did nothing for a day.
	age := func() {
		raw := cnitest.OpenStore(t, st)
		defer raw.Close()
		ctx := context.Background()
		recs, err := raw.Scan(ctx, "h/", store.PrefixEnd("h/"), 0)
		if err != nil {
			t.Fatal(err)
		}
		// The host record as agents before the status record wrote it,
		// and the status record (s/<host>) the agent and verbs write now.
		ops := []store.Op{store.Put("n/ls-host", []byte(`{"c":`+jsonInt(old)+`}`)),
			store.Put("s/ls-host", []byte(`{"s":`+jsonInt(old)+`,"c":`+jsonInt(old)+`}`))}
		for _, kv := range recs {
			if !strings.HasSuffix(kv.Key, "/ls-host") {
				continue
			}
			var m map[string]any
			if err := json.Unmarshal(kv.Value, &m); err != nil {
				t.Fatal(err)
			}
			m["s"] = old
			b, _ := json.Marshal(m)
			ops = append(ops, store.Put(kv.Key, b))
		}
		if err := raw.Commit(ctx, nil, ops); err != nil {
			t.Fatal(err)
		}
	}
	lastSeen := func() time.Time {
		var at time.Time
		cnitest.Inspect(t, st, "judge", func(a *pool.Allocator) {
			hosts, err := a.Hosts(context.Background(), 48*time.Hour)
			if err != nil {
				t.Fatal(err)
			}
			for _, h := range hosts {
				if h.Name == "ls-host" {
					at = h.LastSeen
				}
			}
		})
		return at
	}
	for _, v := range []struct {
		name string
		run  func() error
	}{
		{"STATUS", func() error { _, err := execIPAM("STATUS", conf, "", ""); return err }},
		{"replayed ADD", func() error { _, err := execIPAM("ADD", conf, "ctr-1", ""); return err }},
		{"DEL of nothing", func() error { _, err := execIPAM("DEL", conf, "ctr-none", ""); return err }},
	} {
		age()
		if got := lastSeen(); got.Unix() != old {
			t.Fatalf("before %s: last seen %s, want the aged %s", v.name, got, time.Unix(old, 0))
		}
		before := time.Now().Add(-time.Second)
		if err := v.run(); err != nil {
			t.Fatalf("%s: %v", v.name, err)
		}
		if got := lastSeen(); got.Before(before.Truncate(time.Second)) {
			t.Errorf("%s did not refresh ls-host's last-seen time: %s (the verb ran after %s)", v.name, got, before)
		}
	}
}

func jsonInt(v int64) string { b, _ := json.Marshal(v); return string(b) }
