//go:build integration

package ringctl

import (
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ringipam/ringipam/integration/netns"
)

// TestEmptyRangeOfALiveDonorIsGivenWholeBinary (issue 33, seed 002) runs
// the ipam-ring binary as three hosts of one local store and reads the ring
// with the ringctl binary: h1 takes the unowned pool, h2 the upper half of
// h1's free hole, h1's only container goes; h3's first ADD then finds h1,
// a live host, with the most free space and a range that holds no address,
// and is given that range whole, not its upper half.
func TestEmptyRangeOfALiveDonorIsGivenWholeBinary(t *testing.T) {
	netns.RequireRoot(t)
	db := filepath.Join(t.TempDir(), "ringipam.db")
	ipam := func(host string) []byte {
		return netConf(map[string]any{"type": "ipam-ring", "host": host, "timeout": "30s",
			"store":  map[string]any{"type": "local", "path": db},
			"ranges": [][]map[string]string{{{"subnet": "198.18.35.0/27"}}}})
	}
	add := func(host, ctr string) string {
		t.Helper()
		var r addResult
		if err := json.Unmarshal(ipamExec(t, "ADD", ipam(host), ctr, ""), &r); err != nil || len(r.IPs) != 1 {
			t.Fatalf("ADD %s on %s: %+v %v", ctr, host, r, err)
		}
		return strings.Split(r.IPs[0].Address, "/")[0]
	}
	ranges := func() []map[string]any {
		t.Helper()
		r := ringctlRun(t, nil, "--store", "local", "--store-path", db, "--host", "admin", "status", "--json")
		var st struct {
			Pools []struct {
				Ranges []map[string]any `json:"ranges"`
			} `json:"pools"`
		}
		if err := json.Unmarshal([]byte(r.stdout), &st); err != nil || r.code != 0 || len(st.Pools) != 1 {
			t.Fatalf("ringctl status --json: exit %d %v\n%s%s", r.code, err, r.stdout, r.stderr)
		}
		return st.Pools[0].Ranges
	}
	add("h1", "a")
	add("h2", "b")
	ipamExec(t, "DEL", ipam("h1"), "a", "")
	var h1 []map[string]any
	for _, r := range ranges() {
		if r["host"] == "h1" {
			h1 = append(h1, r)
		}
	}
	if len(h1) != 1 {
		t.Fatalf("ring before h3's claim %v: want one range of h1", ranges())
	}
	got := add("h3", "c")
	for _, r := range ranges() {
		if r["start"] == h1[0]["start"] {
			if r["host"] != "h3" || r["end"] != h1[0]["end"] {
				t.Fatalf("after h3's claim (it got %s) the range at %v is %v; want h1's empty range %v-%v given whole to h3",
					got, h1[0]["start"], r, h1[0]["start"], h1[0]["end"])
			}
			return
		}
	}
	t.Fatalf("after h3's claim no range starts at %v: %v", h1[0]["start"], ranges())
}
