//go:build integration

package cni

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"

	"github.com/ringipam/ringipam/integration/cnitest"
	"github.com/ringipam/ringipam/integration/netns"
	"github.com/ringipam/ringipam/internal/testenv"
	"github.com/ringipam/ringipam/pkg/pool"
)

// writeConfList writes list as NAME.conflist into a fresh NETCONFPATH dir.
func writeConfList(t *testing.T, name string, plugins ...map[string]any) string {
	t.Helper()
	dir := t.TempDir()
	b, err := json.Marshal(map[string]any{"cniVersion": "1.1.0", "name": name, "plugins": plugins})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, name+".conflist"), b, 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

// cnitoolNet writes network name of plugins for cnitool and returns the
// environment cnitool needs to run it: NETCONFPATH holding the conflist
// and a CNI_PATH (pluginDir). cnitool's cached results of name are
// removed when the test ends.
func cnitoolNet(t *testing.T, name string, plugins ...map[string]any) []string {
	t.Helper()
	cnitest.CleanCNICache(t, name)
	return []string{"NETCONFPATH=" + writeConfList(t, name, plugins...), "CNI_PATH=" + pluginDir(t, false)}
}

// cnitoolAdd runs `cnitool add name` for container ctr inside host and
// returns the result it printed, and the output itself.
func cnitoolAdd(t *testing.T, host *netns.NS, env []string, name string, ctr *netns.NS) (*current.Result, string) {
	t.Helper()
	out, err := cnitest.Cnitool(t, host, env, "add", name, ctr.Path)
	if err != nil {
		t.Fatalf("cnitool add: %v\n%s", err, out)
	}
	var res current.Result
	if err := json.Unmarshal([]byte(out), &res); err != nil {
		t.Fatalf("cnitool add printed %q: %v", out, err)
	}
	return &res, out
}

func bridgePlugin(ipam map[string]any) map[string]any {
	return map[string]any{"type": "bridge", "bridge": "cni0", "isGateway": true, "ipam": ipam}
}

// allocations lists what the store holds on network.
func allocations(t *testing.T, st map[string]any, network string) []pool.Allocation {
	t.Helper()
	var list []pool.Allocation
	cnitest.Inspect(t, st, "inspector", func(a *pool.Allocator) {
		var err error
		list, err = a.List(context.Background(), pool.Filter{Network: network})
		if err != nil {
			t.Fatalf("listing allocations: %v", err)
		}
	})
	return list
}

func containerIDs(allocs []pool.Allocation) []string {
	var ids []string
	for _, a := range allocs {
		ids = append(ids, a.Owner.ContainerID)
	}
	slices.Sort(ids)
	return ids
}

// 1. cnitool add / check / del with bridge + ipam-ring on the local store.
func TestCnitoolBridgeLocalStore(t *testing.T) {
	netns.RequireRoot(t)
	host := netns.New(t, "it1h")
	ctr := netns.New(t, "it1c")
	name := netns.Unique("it1-")
	st := localStore(t)
	env := cnitoolNet(t, name, bridgePlugin(ipamSection("host1", st, subnet("198.18.10.0/24"))))

	res, out := cnitoolAdd(t, host, env, name, ctr)
	if len(res.IPs) != 1 {
		t.Fatalf("want one address, got %s", out)
	}
	addr, _ := netip.AddrFromSlice(res.IPs[0].Address.IP.To4())
	if !netip.MustParsePrefix("198.18.10.0/24").Contains(addr) || addr == netip.MustParseAddr("198.18.10.1") {
		t.Fatalf("address %s is not a container address of 198.18.10.0/24", addr)
	}
	if got := ctr.Addrs(t, "eth0"); !contains(got, res.IPs[0].Address.String()) {
		t.Fatalf("eth0 in the container has %v, want %s", got, res.IPs[0].Address.String())
	}
	ctr.MustRun(t, "ping", "-c", "1", "-W", "5", "198.18.10.1")

	if out, err := cnitest.Cnitool(t, host, env, "check", name, ctr.Path); err != nil {
		t.Fatalf("cnitool check: %v\n%s", err, out)
	}
	ids := containerIDs(allocations(t, st, name))
	if len(ids) != 1 {
		t.Fatalf("store holds %v after add, want one allocation", ids)
	}
	// CHECK notices an allocation that has gone behind the runtime's back.
	ipam := ipamSection("host1", st, subnet("198.18.10.0/24"))
	if _, err := execIPAM("DEL", netConf(t, name, ipam, nil), ids[0], ""); err != nil {
		t.Fatalf("IPAM-only DEL: %v", err)
	}
	out, err := cnitest.Cnitool(t, host, env, "check", name, ctr.Path)
	if err == nil || !strings.Contains(out, "holds no address") {
		t.Fatalf("cnitool check after the allocation vanished: err %v, output %q; want a failure saying it holds no address", err, out)
	}
	if out, err := cnitest.Cnitool(t, host, env, "del", name, ctr.Path); err != nil {
		t.Fatalf("cnitool del: %v\n%s", err, out)
	}
	if ids := containerIDs(allocations(t, st, name)); len(ids) != 0 {
		t.Fatalf("store still holds %v after del", ids)
	}
	if out, err := cnitest.Cnitool(t, host, env, "del", name, ctr.Path); err != nil {
		t.Fatalf("second cnitool del: %v\n%s", err, out)
	}
}

// 2. Two hosts sharing one etcd, 50 containers added on each concurrently:
// every address distinct and inside a range its host owns.
func TestTwoHostsShareEtcd(t *testing.T) {
	netns.RequireRoot(t)
	etcd := testenv.StartEtcd(t)
	name := netns.Unique("it2-")
	st := etcdStore(etcd.Endpoints(), "/"+name)
	const perHost, parallel = 50, 50 // all of a host's ADDs at once
	pdir := pluginDir(t, true)

	type added struct {
		host, id string
		addr     netip.Addr
	}
	var (
		mu   sync.Mutex
		got  []added
		errs []error
	)
	var wg sync.WaitGroup
	for _, hostName := range []string{"hostA", "hostB"} {
		hostNS := netns.New(t, "it2h")
		hostSt := agentStore(t, etcd.Endpoints(), "/"+name, hostName)
		list := bridgeList(t, name, "cni0", ipamSection(hostName, hostSt, subnet("198.18.32.0/22")))
		cn := cnitest.NewCNI(t, pdir)
		ctrs := make([]*netns.NS, perHost)
		for i := range ctrs {
			ctrs[i] = netns.New(t, "it2c")
		}
		sem := make(chan struct{}, parallel)
		for i, ctr := range ctrs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				sem <- struct{}{}
				defer func() { <-sem }()
				id := fmt.Sprintf("%s-c%02d", hostName, i)
				res, err := cnitest.Add(cn, hostNS, list, rt(ctr, id))
				mu.Lock()
				defer mu.Unlock()
				if err != nil {
					errs = append(errs, fmt.Errorf("ADD %s: %w", id, err))
					return
				}
				a, _ := netip.AddrFromSlice(res.IPs[0].Address.IP.To4())
				got = append(got, added{hostName, id, a})
			}()
		}
	}
	wg.Wait()
	if err := joinErrs(errs); err != nil {
		t.Fatal(err)
	}
	if len(got) != 2*perHost {
		t.Fatalf("got %d addresses, want %d", len(got), 2*perHost)
	}
	seen := map[netip.Addr]string{}
	for _, g := range got {
		if other, dup := seen[g.addr]; dup {
			t.Errorf("%s given to both %s and %s", g.addr, other, g.id)
		}
		seen[g.addr] = g.id
	}
	cnitest.Inspect(t, st, "inspector", func(a *pool.Allocator) {
		ring, err := a.RingOf(context.Background(), name+"-0")
		if err != nil {
			t.Fatal(err)
		}
		for _, g := range got {
			i := slices.IndexFunc(ring.Ranges, func(r pool.OwnedRange) bool {
				return r.Start.Compare(g.addr) <= 0 && g.addr.Compare(r.End) <= 0
			})
			if i < 0 || ring.Ranges[i].Host != g.host {
				t.Errorf("%s (%s on %s) is not inside a range %s owns; ring: %+v", g.addr, g.id, g.host, g.host, ring.Ranges)
			}
		}
	})
}

// 3. A static request for a held address fails with code 100 naming the
// holder; re-ADD of the holder returns the same address.
func TestStaticInUse(t *testing.T) {
	netns.RequireRoot(t)
	host := netns.New(t, "it3h")
	c1, c2 := netns.New(t, "it3c"), netns.New(t, "it3c")
	name := netns.Unique("it3-")
	st := localStore(t)
	ipam := ipamSection("host1", st, subnet("198.18.11.0/24"))
	list := bridgeList(t, name, "cni0", ipam)
	cn := cnitest.NewCNI(t, pluginDir(t, false))

	holderID := netns.Unique("holder-")
	held, err := cnitest.Add(cn, host, list, rt(c1, holderID))
	if err != nil {
		t.Fatal(err)
	}
	heldCIDR := held.IPs[0].Address.String()

	req := rt(c2, netns.Unique("other-"))
	req.CapabilityArgs = map[string]any{"ips": []string{heldCIDR}}
	_, err = cnitest.Add(cn, host, list, req)
	if cnitest.CNICode(err) != 100 {
		t.Fatalf("static ADD of held %s: err = %v (code %d), want code 100", heldCIDR, err, cnitest.CNICode(err))
	}
	if !strings.Contains(err.Error(), holderID) {
		t.Fatalf("error %q does not name the holder %s", err, holderID)
	}
	t.Logf("static request refused as documented: %v", err)

	for _, args := range []string{"", "IP=" + held.IPs[0].Address.IP.String()} {
		again, err := execIPAM("ADD", netConf(t, name, ipam, nil), holderID, args)
		if err != nil {
			t.Fatalf("re-ADD of holder (CNI_ARGS %q): %v", args, err)
		}
		if ipsOf(again)[0] != heldCIDR {
			t.Fatalf("re-ADD of holder (CNI_ARGS %q) returned %v, want %s", args, ipsOf(again), heldCIDR)
		}
	}
	// DEL needs no network namespace and may be repeated; afterwards the
	// address is free for the static request.
	for range 2 {
		if _, err := execIPAM("DEL", netConf(t, name, ipam, nil), holderID, ""); err != nil {
			t.Fatalf("DEL of the holder without a netns: %v", err)
		}
	}
	got, err := execIPAM("ADD", netConf(t, name, ipam, nil), netns.Unique("next-"), "IP="+held.IPs[0].Address.IP.String())
	if err != nil || ipsOf(got)[0] != heldCIDR {
		t.Fatalf("static ADD after the holder's DEL: %v, %v", got, err)
	}
}

// 4. GC through libcni with a list of valid attachments releases exactly
// the stale allocations: those libcni has cached (via DEL) and those it
// does not know (via ipam-ring's GC, chained after bridge because the
// reference main plugins do not forward GC to IPAM).
func TestGCThroughLibcni(t *testing.T) {
	netns.RequireRoot(t)
	host := netns.New(t, "it4h")
	name := netns.Unique("it4-")
	st := localStore(t)
	ipam := ipamSection("host1", st, subnet("198.18.12.0/24"))
	list := bridgeList(t, name, "cni0", ipam, map[string]any{"type": "ipam-ring", "chained": true, "ipam": ipam})
	cn := cnitest.NewCNI(t, pluginDir(t, false))

	var valid []types.GCAttachment
	for _, id := range []string{"keep-a", "keep-b", "stale-c", "stale-d"} {
		if _, err := cnitest.Add(cn, host, list, rt(netns.New(t, "it4c"), id)); err != nil {
			t.Fatalf("ADD %s: %v", id, err)
		}
		if strings.HasPrefix(id, "keep") {
			valid = append(valid, types.GCAttachment{ContainerID: id, IfName: "eth0"})
		}
	}
	// Allocations the runtime has lost track of (no libcni cache entry).
	for _, id := range []string{"lost-e", "lost-f"} {
		if _, err := execIPAM("ADD", netConf(t, name, ipam, nil), id, ""); err != nil {
			t.Fatalf("IPAM-only ADD %s: %v", id, err)
		}
	}
	// A GC without a list releases nothing.
	if _, err := execIPAM("GC", netConf(t, name, ipam, nil), "", ""); err != nil {
		t.Fatalf("GC without a list: %v", err)
	}
	if ids := containerIDs(allocations(t, st, name)); len(ids) != 6 {
		t.Fatalf("after a GC without a list the store holds %v, want all 6", ids)
	}
	err := cnitest.InNS(host, func(ctx context.Context) error {
		return cn.GCNetworkList(ctx, list, &libcni.GCArgs{ValidAttachments: valid})
	})
	if err != nil {
		t.Fatalf("GCNetworkList: %v", err)
	}
	if ids := containerIDs(allocations(t, st, name)); !slices.Equal(ids, []string{"keep-a", "keep-b"}) {
		t.Fatalf("after GC the store holds %v, want [keep-a keep-b]", ids)
	}
}

// 5. With etcd stopped: STATUS returns 50, ADD returns 11, nothing is
// half-written; after etcd restarts ADD works and no address leaked.
func TestEtcdDown(t *testing.T) {
	netns.RequireRoot(t)
	etcd := testenv.StartEtcd(t)
	host := netns.New(t, "it5h")
	name := netns.Unique("it5-")
	// The agent's etcd client fails fast: the test stops etcd on purpose
	// and wants the failure reported quickly.
	st := agentStore(t, etcd.Endpoints(), "/"+name, "host1", "--etcd-dial-timeout", "1s", "--etcd-request-timeout", "2s")
	ipam := ipamSection("host1", st, subnet("198.18.13.0/24"))
	ipam["timeout"] = "5s"
	list := bridgeList(t, name, "cni0", ipam)
	cn := cnitest.NewCNI(t, pluginDir(t, true))
	ctx := context.Background()

	for _, id := range []string{"before-1", "before-2"} {
		if _, err := cnitest.Add(cn, host, list, rt(netns.New(t, "it5c"), id)); err != nil {
			t.Fatalf("ADD %s: %v", id, err)
		}
	}
	if err := host.Do(func() error { return cn.GetStatusNetworkList(ctx, list) }); err != nil {
		t.Fatalf("STATUS with etcd up: %v", err)
	}

	etcd.Stop()
	err := host.Do(func() error { return cn.GetStatusNetworkList(ctx, list) })
	if cnitest.CNICode(err) != 50 {
		t.Fatalf("STATUS with etcd down: err = %v (code %d), want 50", err, cnitest.CNICode(err))
	}
	down := netns.New(t, "it5c")
	_, err = cnitest.Add(cn, host, list, rt(down, "during"))
	if cnitest.CNICode(err) != 11 {
		t.Fatalf("ADD with etcd down: err = %v (code %d), want 11", err, cnitest.CNICode(err))
	}
	t.Logf("with etcd down ADD failed as documented: %v", err)

	etcd.Start()
	// Nothing of the failed ADD reached the store.
	if ids := containerIDs(allocations(t, st, name)); !slices.Equal(ids, []string{"before-1", "before-2"}) {
		t.Fatalf("after the failed ADD the store holds %v, want [before-1 before-2]", ids)
	}
	checkUsed(t, st, name+"-0", 2)
	// The runtime cleans up the failed attachment (bridge left a veth).
	if err := host.Do(func() error { return cn.DelNetworkList(ctx, list, rt(down, "during")) }); err != nil {
		t.Fatalf("DEL of the failed attachment: %v", err)
	}
	if _, err := cnitest.Add(cn, host, list, rt(netns.New(t, "it5c"), "after")); err != nil {
		t.Fatalf("ADD after etcd restarted: %v", err)
	}
	if ids := containerIDs(allocations(t, st, name)); !slices.Equal(ids, []string{"after", "before-1", "before-2"}) {
		t.Fatalf("store holds %v, want [after before-1 before-2]", ids)
	}
	checkUsed(t, st, name+"-0", 3)
}

// checkUsed fails t unless the pool counts exactly want addresses in use.
func checkUsed(t *testing.T, st map[string]any, poolName string, want uint64) {
	t.Helper()
	cnitest.Inspect(t, st, "inspector", func(a *pool.Allocator) {
		u, err := a.Usage(context.Background(), poolName)
		if err != nil {
			t.Fatal(err)
		}
		if u.Used != want {
			t.Fatalf("pool %s counts %d addresses in use, want %d (leaked or lost)", poolName, u.Used, want)
		}
	})
}

// 6. Dual-stack: IPv4 and IPv6 range sets in one config, both assigned.
func TestDualStack(t *testing.T) {
	netns.RequireRoot(t)
	host := netns.New(t, "it6h")
	ctr := netns.New(t, "it6c")
	name := netns.Unique("it6-")
	st := localStore(t)
	env := cnitoolNet(t, name, bridgePlugin(ipamSection("host1", st, subnet("198.18.14.0/24"), subnet("2001:db8:14::/64"))))
	res, out := cnitoolAdd(t, host, env, name, ctr)
	var v4, v6 string
	for _, ip := range res.IPs {
		a, _ := netip.AddrFromSlice(ip.Address.IP)
		switch {
		case netip.MustParsePrefix("198.18.14.0/24").Contains(a.Unmap()):
			v4 = ip.Address.String()
		case netip.MustParsePrefix("2001:db8:14::/64").Contains(a):
			v6 = ip.Address.String()
		}
	}
	if v4 == "" || v6 == "" {
		t.Fatalf("want an IPv4 and an IPv6 address, got %s", out)
	}
	got := ctr.Addrs(t, "eth0")
	if !contains(got, v4) || !contains(got, v6) {
		t.Fatalf("eth0 has %v, want %s and %s", got, v4, v6)
	}
	allocs := allocations(t, st, name)
	if len(allocs) != 1 || len(allocs[0].Addrs) != 2 {
		t.Fatalf("store holds %+v, want one owner with two addresses", allocs)
	}
	if out, err := cnitest.Cnitool(t, host, env, "del", name, ctr.Path); err != nil {
		t.Fatalf("cnitool del: %v\n%s", err, out)
	}
}

// ptp with ipam-ring (conf/ptp-local.conflist's shape): each container gets
// its own veth to the host, and the shared gateway answers on every one.
func TestPtpLocalStore(t *testing.T) {
	netns.RequireRoot(t)
	host := netns.New(t, "itph")
	host.MustRun(t, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
	name := netns.Unique("itp-")
	st := localStore(t)
	env := cnitoolNet(t, name, map[string]any{"type": "ptp", "ipMasq": false, "ipam": ipamSection("host1", st, subnet("198.19.0.0/24"))})
	var addrs []string
	var ctrs []*netns.NS
	for range 2 {
		ctr := netns.New(t, "itpc")
		res, out := cnitoolAdd(t, host, env, name, ctr)
		if len(res.IPs) != 1 {
			t.Fatalf("want one address, got %s", out)
		}
		addrs = append(addrs, res.IPs[0].Address.IP.String())
		ctrs = append(ctrs, ctr)
		t.Cleanup(func() { cnitest.Cnitool(t, host, env, "del", name, ctr.Path) })
	}
	if addrs[0] == addrs[1] {
		t.Fatalf("both containers got %s", addrs[0])
	}
	ctrs[0].MustRun(t, "ping", "-c", "1", "-W", "5", "198.19.0.1")
	ctrs[0].MustRun(t, "ping", "-c", "1", "-W", "5", addrs[1])
}
