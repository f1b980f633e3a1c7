//go:build integration

// Package containernet holds the end-to-end tests of ipam-ring's
// per-container gateway mode (the container network of pkg/containernet):
// the plugin binary built from this checkout, called by the reference ptp
// plugin through libcni, in real network namespaces, on the embedded local
// store.
//
// Topology: every test creates one "host" namespace, where ptp runs (it puts
// each container's gateway on the container's host-side veth and a host
// route to the container), and one namespace per container. Nothing touches
// the machine's own interfaces; every namespace is deleted when the test ends.
package containernet

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	current "github.com/containernetworking/cni/pkg/types/100"

	"github.com/ringipam/ringipam/integration/cnitest"
	"github.com/ringipam/ringipam/integration/netns"
	"github.com/ringipam/ringipam/pkg/pool"
)

// pingDeadline bounds the wait for a path to carry a ping (IPv6 duplicate
// address detection on the host veth takes about a second).
const pingDeadline = 20 * time.Second

func TestMain(m *testing.M) { os.Exit(cnitest.Main(m, nil)) }

// testbed is one host namespace, a CNI runtime and a ptp network whose
// IPAM is ipam-ring in per-container mode on a fresh local store.
type testbed struct {
	host  *netns.NS
	cni   *libcni.CNIConfig
	list  *libcni.NetworkConfigList
	store map[string]any // the ipam "store" object
	ipam  map[string]any
}

const hostName = "node1" // ipam-ring's "host": this machine's name in the ring

func newTestbed(t *testing.T, network string, rangeSets ...string) *testbed {
	t.Helper()
	return newTestbedWith(t, network, nil, rangeSets...)
}

// newTestbedWith is newTestbed with extra keys in the ipam object.
func newTestbedWith(t *testing.T, network string, extraIPAM map[string]any, rangeSets ...string) *testbed {
	t.Helper()
	netns.RequireRoot(t)
	tb := &testbed{host: netns.New(t, "cnh")}
	tb.store = map[string]any{"type": "local", "path": filepath.Join(t.TempDir(), "ringipam.db"), "openTimeout": "10s"}
	var ranges [][]map[string]string
	for _, s := range rangeSets {
		ranges = append(ranges, []map[string]string{{"subnet": s}})
	}
	tb.ipam = map[string]any{
		"type": "ipam-ring", "host": hostName, "gatewayMode": "per-container", "timeout": "20s",
		"store":  tb.store,
		"ranges": ranges,
	}
	for k, v := range extraIPAM {
		tb.ipam[k] = v
	}
	tb.list = cnitest.ConfList(t, network, map[string]any{
		"type": "ptp", "ipMasq": false, "mtu": 1500, "capabilities": map[string]bool{"ips": true}, "ipam": tb.ipam,
	})
	// ipam-ring needs no namespace and the local store is a file, so it
	// runs as ptp starts it (in the host namespace).
	tb.cni = cnitest.NewCNI(t, cnitest.PluginDir(t, cnitest.IPAMBin, "ptp"))
	return tb
}

// container is one container namespace attached (or to be attached) to the
// testbed's network.
type container struct {
	ns  *netns.NS
	rt  *libcni.RuntimeConf
	res *current.Result
}

func (tb *testbed) newContainer(t *testing.T, id string, cniArgs ...[2]string) *container {
	t.Helper()
	n := netns.New(t, "cnc")
	return &container{ns: n, rt: &libcni.RuntimeConf{ContainerID: id, NetNS: n.Path, IfName: "eth0", Args: cniArgs}}
}

// add, check and del run one libcni call from a thread inside the host
// namespace, so that ptp (and the ipam-ring it starts) run there.
func (tb *testbed) add(c *container) error {
	res, err := cnitest.Add(tb.cni, tb.host, tb.list, c.rt)
	if err != nil {
		return err
	}
	c.res = res
	return nil
}

func (tb *testbed) mustAdd(t *testing.T, c *container) {
	t.Helper()
	if err := tb.add(c); err != nil {
		t.Fatalf("ADD %s: %v", c.rt.ContainerID, err)
	}
}

func (tb *testbed) check(c *container) error {
	return cnitest.InNS(tb.host, func(ctx context.Context) error { return tb.cni.CheckNetworkList(ctx, tb.list, c.rt) })
}

func (tb *testbed) del(c *container) error {
	return cnitest.InNS(tb.host, func(ctx context.Context) error { return tb.cni.DelNetworkList(ctx, tb.list, c.rt) })
}

// inspect runs fn with a pool allocator on the store. The local store
// admits one process at a time: call it only between plugin invocations.
func (tb *testbed) inspect(t *testing.T, fn func(ctx context.Context, a *pool.Allocator)) {
	t.Helper()
	cnitest.Inspect(t, tb.store, hostName, func(a *pool.Allocator) {
		ctx, cancel := context.WithTimeout(context.Background(), cnitest.OpTimeout)
		defer cancel()
		fn(ctx, a)
	})
}

// heldAddrs lists every address held in the store, as "owner pool role addr".
func heldAddrs(ctx context.Context, t *testing.T, a *pool.Allocator) []string {
	t.Helper()
	allocs, err := a.List(ctx, pool.Filter{})
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, al := range allocs {
		for _, x := range al.Addrs {
			out = append(out, fmt.Sprintf("%s %s %s %s", al.Owner, x.Pool, x.Role, x.Addr))
		}
	}
	return out
}

// ping waits (up to pingDeadline) until one ping from c to dst gets an
// answer, and fails the test with the last output otherwise.
func ping(t *testing.T, c *container, dst netip.Addr) {
	t.Helper()
	deadline := time.Now().Add(pingDeadline)
	for {
		out, err := c.ns.Run("ping", "-c", "1", "-W", "1", dst.String())
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s cannot ping %s within %v: %v\n%s", c.rt.ContainerID, dst, pingDeadline, err, out)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// routeVia returns the gateway `ip route get dst` in c names ("" for none).
func routeVia(t *testing.T, c *container, dst netip.Addr) string {
	t.Helper()
	f := strings.Fields(c.ns.MustRun(t, "ip", "route", "get", dst.String()))
	for i := 0; i+1 < len(f); i++ {
		if f[i] == "via" {
			return f[i+1]
		}
	}
	return ""
}

// addrOf returns the i-th result address and gateway as netip values.
func addrOf(t *testing.T, r *current.Result, i int) (ip, gw netip.Addr, bits int) {
	t.Helper()
	if i >= len(r.IPs) {
		t.Fatalf("result has %d IPs, want index %d: %v", len(r.IPs), i, r.IPs)
	}
	ipc := r.IPs[i]
	ip, ok1 := netip.AddrFromSlice(ipc.Address.IP)
	gw, ok2 := netip.AddrFromSlice(ipc.Gateway)
	if !ok1 || !ok2 {
		t.Fatalf("result IP %d has no address or gateway: %v", i, ipc)
	}
	bits, _ = ipc.Address.Mask.Size()
	return ip.Unmap(), gw.Unmap(), bits
}
