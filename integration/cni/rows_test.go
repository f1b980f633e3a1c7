//go:build integration

package cni

import (
	"fmt"
	"strings"
	"testing"

	"github.com/ringipam/ringipam/integration/cnitest"
	"github.com/ringipam/ringipam/integration/netns"
)

// TestStaticOnlyRangeBinary (issue 33, seed 001's BOSH static IPs) runs the
// ipam-ring binary on the local store with a range marked "static": true.
// Dynamic ADDs never get one of its addresses, not even when the dynamic
// range is exhausted (they fail with the capacity code, 102); a static ADD
// (CNI_ARGS IP=) in the static range succeeds.
func TestStaticOnlyRangeBinary(t *testing.T) {
	name := netns.Unique("it33s-")
	ranges := []map[string]any{
		{"subnet": "198.18.33.0/24", "rangeStart": "198.18.33.10", "rangeEnd": "198.18.33.12"},
		{"subnet": "198.18.33.0/24", "rangeStart": "198.18.33.100", "rangeEnd": "198.18.33.199", "static": true},
	}
	ipam := map[string]any{"type": "ipam-ring", "host": "host1", "store": localStore(t), "ranges": []any{ranges}, "timeout": "20s"}
	conf := netConf(t, name, ipam, nil)
	for i := range 3 {
		r, err := execIPAM("ADD", conf, fmt.Sprintf("dyn-%d", i), "")
		if err != nil {
			t.Fatalf("dynamic ADD %d: %v", i, err)
		}
		if got := ipsOf(r)[0]; !strings.HasPrefix(got, "198.18.33.1") || len(got) != len("198.18.33.10/24") {
			t.Fatalf("dynamic ADD %d got %s, outside the dynamic range 198.18.33.10-12", i, got)
		}
	}
	_, err := execIPAM("ADD", conf, "dyn-over", "")
	if cnitest.CNICode(err) != 102 {
		t.Fatalf("dynamic ADD with the dynamic range exhausted: %v (code %d), want the capacity code 102", err, cnitest.CNICode(err))
	}
	t.Logf("dynamic ADD refused as documented: %v", err)
	r, err := execIPAM("ADD", conf, "static-1", "IP=198.18.33.150")
	if err != nil || ipsOf(r)[0] != "198.18.33.150/24" {
		t.Fatalf("static ADD in the static range: %v, %v", r, err)
	}
}
