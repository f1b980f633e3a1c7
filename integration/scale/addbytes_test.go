//go:build integration || scale

package scale_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/skel"

	"github.com/ringipam/ringipam/integration/scale/harness"
	"github.com/ringipam/ringipam/internal/testenv"
	"github.com/ringipam/ringipam/pkg/agentapi"
	"github.com/ringipam/ringipam/pkg/cni/ipam"
	"github.com/ringipam/ringipam/pkg/hostlock"
	"github.com/ringipam/ringipam/pkg/storeconfig"
)

// Issue 42, "What it must show": an ADD at 1 000 simulated hosts sends no
// more bytes than at 10. The rings and host states of 10 and of 1 000
// hosts are written through ipam-ring's agent handler (one ADD per host
// name, each claiming its range; no agent runs), each under its own
// prefix of one real etcd; then one host makes steady-state ADDs through
// the same handler on a store whose connection goes through a counting
// relay: the bytes per ADD at 1 000 hosts must be at most 1.2 times those
// at 10. In make test (tag integration; about 10 s) since layout 4 split
// the ring; make scale runs it too.
func TestADDBytesDoNotGrowWithHosts(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Fatal("needs root (a network namespace of its own)")
	}
	srv := testenv.StartEtcd(t)
	locks := hostlock.Dir(t.TempDir())
	perADD := func(n int) float64 {
		prefix := fmt.Sprintf("/addbytes-%d/", n)
		direct := storeconfig.Config{Type: storeconfig.TypeEtcd, Endpoints: srv.Endpoints(), Prefix: prefix}
		st, err := storeconfig.Open(direct)
		if err != nil {
			t.Fatal(err)
		}
		defer st.Close()
		h := ipam.AgentHandler{Store: st, Config: direct, HostLocks: locks}
		add := func(h ipam.AgentHandler, host, ctr string) {
			t.Helper()
			conf, _ := json.Marshal(map[string]any{"cniVersion": "1.1.0", "name": harness.Network, "type": "bridge",
				"ipam": map[string]any{"type": "ipam-ring", "host": host, "timeout": "60s",
					"store":  map[string]any{"type": "etcd", "endpoints": h.Config.Endpoints, "prefix": prefix},
					"ranges": [][]map[string]string{{{"subnet": harness.Subnet}}}}})
			req := agentapi.NewRequest(agentapi.PluginIPAM, "ADD", &skel.CmdArgs{ContainerID: ctr, Netns: "/var/run/netns/" + ctr, IfName: "eth0", StdinData: conf}, time.Minute)
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			for try := 0; ; try++ {
				ans := h.Serve(ctx, req)
				if ans.CNIError == nil && ans.Error == "" {
					return
				}
				if try == 5 {
					t.Fatalf("ADD %s on %s: %+v %s", ctr, host, ans.CNIError, ans.Error)
				}
			}
		}
		start := time.Now()
		for i := range n {
			host := fmt.Sprintf("h%05d", i)
			add(h, host, host+"-first")
		}
		t.Logf("N=%d: %d hosts' first ADDs (their claims) in %s", n, n, time.Since(start).Round(time.Second))
		// The probe host, through a counting relay.
		p, err := harness.NewProxy(srv.Endpoints()[0])
		if err != nil {
			t.Fatal(err)
		}
		defer p.Close()
		viaProxy := storeconfig.Config{Type: storeconfig.TypeEtcd, Endpoints: []string{p.Endpoint()}, Prefix: prefix}
		pst, err := storeconfig.Open(viaProxy)
		if err != nil {
			t.Fatal(err)
		}
		defer pst.Close()
		ph := ipam.AgentHandler{Store: pst, Config: viaProxy, HostLocks: locks}
		for k := range 3 { // warm: its notes
			add(ph, "h00000", fmt.Sprintf("warm-%d", k))
		}
		const k = 20
		b0 := p.Bytes()
		for i := range k {
			add(ph, "h00000", fmt.Sprintf("probe-%d", i))
		}
		per := float64(p.Bytes()-b0) / k
		t.Logf("N=%d: %.0f bytes per steady-state ADD (both ways, framing included)", n, per)
		return per
	}
	small, large := perADD(10), perADD(1000)
	if large > 1.2*small {
		t.Errorf("an ADD at 1000 hosts moves %.0f bytes, at 10 hosts %.0f (x%.2f, limit x1.2): the ADD carries what grows with the hosts", large, small, large/small)
	}
}
