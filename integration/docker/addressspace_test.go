//go:build integration

package docker

import (
	"encoding/json"
	"net/netip"
	"strings"
	"sync"
	"testing"

	"github.com/ringipam/ringipam/integration/cnitest"
	"github.com/ringipam/ringipam/integration/netns"
	"github.com/ringipam/ringipam/internal/testenv"
)

// cniConf is an ipam-ring network configuration of host on etcd store st,
// through host's agent (hostAgent).
func cniConf(t *testing.T, version, network, host string, pools []string, subnet netip.Prefix, st storeSpec, extra map[string]any) []byte {
	t.Helper()
	ipamConf := map[string]any{
		"type": "ipam-ring", "host": host,
		"ranges": [][]map[string]string{{{"subnet": subnet.String()}}},
		"store":  hostAgent(t, st, host).Store(map[string]any{"type": "etcd", "endpoints": st.endpoints, "prefix": st.prefix}),
	}
	if pools != nil {
		ipamConf["pools"] = pools
	}
	conf := map[string]any{"cniVersion": version, "name": network, "type": "bridge", "ipam": ipamConf}
	for k, v := range extra {
		conf[k] = v
	}
	b, err := json.Marshal(conf)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// agents are the host agents the tests started, by etcd prefix (unique
// to a test) and host name.
var agents sync.Map

// hostAgent is the agent of host on etcd store st, started for t on first
// use: the CNI plugin on etcd goes through it (the driver reaches etcd
// itself, or its own agent's socket).
func hostAgent(t *testing.T, st storeSpec, host string) *cnitest.Agent {
	t.Helper()
	key := st.prefix + "|" + host
	if a, ok := agents.Load(key); ok {
		return a.(*cnitest.Agent)
	}
	a := cnitest.StartAgent(t, cnitest.AgentOptions{Endpoints: st.endpoints, Prefix: st.prefix, Host: host})
	agents.Store(key, a)
	t.Cleanup(func() { agents.Delete(key) })
	return a
}

// cniError returns the CNI error code and message in a plugin's failure output.
func cniError(t *testing.T, out []byte) (uint, string) {
	t.Helper()
	var e struct {
		Code uint   `json:"code"`
		Msg  string `json:"msg"`
	}
	if err := json.Unmarshal(out, &e); err != nil {
		t.Fatalf("plugin output %q is not a CNI error: %v", out, err)
	}
	return e.Code, e.Msg
}

// Issue 8, items 1 and 2 end to end on one real etcd, the real ipam-ring
// binary and the real driver under a real dockerd.
func TestFrontEndsShareOneAddressSpace(t *testing.T) {
	requireDocker(t)
	e := testenv.StartEtcd(t)
	st := storeSpec{endpoints: e.Endpoints(), prefix: "/" + netns.Unique("ras") + "/"}
	drv := startDriver(t, "dockerhost", st)
	d := startDockerd(t, "dockerhost", false)
	s := st.open(t)

	t.Run("CNI GC never releases Docker's endpoints", func(t *testing.T) {
		// A CNI network named like the Docker pool, on the same host name
		// and the same (shared) pool: in layout 1 its owners and Docker's
		// shared one key space.
		subnet := netip.MustParsePrefix("198.18.110.0/26")
		d.must("network", "create", "--ipam-driver", drv.name, "--subnet", subnet.String(), "--ipam-opt", "pool=shared", "dnet")
		names := runContainers(t, d, "dnet", "gc-", 3)
		gw := gateway(t, d, names[0], "dnet")
		dock := addrs(t, d, "dnet", subnet, gw, names)
		conf := cniConf(t, "1.1.0", "shared", "dockerhost", []string{"shared"}, subnet, st, nil)
		if _, err := cnitest.Exec("ADD", "cni-stale", conf); err != nil {
			t.Fatal(err)
		}
		gcConf := cniConf(t, "1.1.0", "shared", "dockerhost", []string{"shared"}, subnet, st,
			map[string]any{"cni.dev/valid-attachments": []any{}})
		if _, err := cnitest.Exec("GC", "", gcConf); err != nil {
			t.Fatal(err)
		}
		if h := keys(held(t, s, "shared", "dockerhost")); !mapsEqual(h, keys(dock)) {
			t.Fatalf("after a CNI GC with an empty valid list the store holds %v; Docker's containers have %v", h, dock)
		}
		if got := d.running(); len(got) < len(names) {
			t.Fatalf("running containers after the GC: %v", got)
		}
		checkPool(t, s, "shared")
	})

	t.Run("a Docker network and a CNI network on one subnet without a shared pool name", func(t *testing.T) {
		subnet := netip.MustParsePrefix("198.18.111.0/24")
		d.must("network", "create", "--ipam-driver", drv.name, "--subnet", subnet.String(), "dfirst")
		out, err := cnitest.Exec("ADD", "c1", cniConf(t, "1.0.0", "cnisecond", "cnihost", nil, subnet, st, nil))
		if err == nil {
			t.Fatal("CNI ADD on a subnet a Docker network holds under another pool name succeeded")
		}
		code, msg := cniError(t, out)
		if code != 103 {
			t.Fatalf("code %d, want 103: %s", code, out)
		}
		for _, want := range []string{"overlaps pool 198.18.111.0-24", `"pools": ["198.18.111.0-24"]`, "isolated"} {
			if !strings.Contains(msg, want) {
				t.Errorf("message %q does not say %q", msg, want)
			}
		}
	})

	t.Run("a CNI network first, then a Docker network on its subnet", func(t *testing.T) {
		subnet := netip.MustParsePrefix("198.18.112.0/24")
		if _, err := cnitest.Exec("ADD", "c1", cniConf(t, "1.0.0", "cnifirst", "cnihost", nil, subnet, st, nil)); err != nil {
			t.Fatal(err)
		}
		out, err := d.docker("network", "create", "--ipam-driver", drv.name, "--subnet", subnet.String(), "dsecond")
		if err == nil {
			t.Fatalf("docker network create on a subnet of CNI pool cnifirst-0 succeeded: %s", out)
		}
		if !strings.Contains(out, "overlaps pool cnifirst-0") || !strings.Contains(out, "--ipam-opt pool=cnifirst-0") {
			t.Fatalf("docker says %q; want the overlap with cnifirst-0 and how to share it", out)
		}
		// Sharing it by name works.
		d.must("network", "create", "--ipam-driver", drv.name, "--subnet", subnet.String(), "--ipam-opt", "pool=cnifirst-0", "dshared")
	})
}
