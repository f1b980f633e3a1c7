//go:build integration

package agent_test

import (
	"context"
	"fmt"
	"net/netip"
	"os/exec"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"

	"github.com/ringipam/ringipam/integration/cnitest"
	"github.com/ringipam/ringipam/integration/netns"
	"github.com/ringipam/ringipam/pkg/pool"
)

// routingState is the namespace's whole routing state (netns.RoutingState);
// without withOurs, the lines of what ringipamd --routes adds (its table
// 4212 and the rules to it) are left out.
func routingState(t *testing.T, ns *netns.NS, withOurs bool) string {
	t.Helper()
	var b strings.Builder
	for _, line := range strings.SplitAfter(ns.RoutingState(t), "\n") {
		if !withOurs && (strings.Contains(line, "table 4212") || strings.Contains(line, "lookup 4212")) {
			continue
		}
		b.WriteString(line)
	}
	return b.String()
}

// Three dual-stack namespace hosts on one LAN and one real etcd, each with
// its agent running --routes with one --addr per family (host-c gives the
// flag twice) and a container on a `bridge` network (isGateway, no
// masquerade, ipam-ring's ipv6ViaGateway) or a `ptp` network
// (per-container gateways) of two ipam-ring pools, one IPv4 and one IPv6:
// the containers ping each other by address across hosts, both families
// (routes to each host's ranges through its address of the pool's family;
// proxy ARP on the bridges for IPv4, the subnet route through the gateway
// for IPv6), CHECK passes, and ringctl status shows both addresses of
// every host and its routes matching the ring; a container of host-a in
// space it claimed from another host is reached from host-c within 5s;
// host-b killed and orphaned loses its routes on host-c and the space
// host-a takes from it is routed to host-a; stopping host-c's agent
// removes every route and rule it added and its proxy ARP, and nothing
// else.
func TestRoutesContainersReachEachOtherAcrossHosts(t *testing.T) {
	for _, plugin := range []string{"bridge", "ptp"} {
		t.Run(plugin, func(t *testing.T) { testRoutesAcrossHosts(t, plugin) })
	}
}

func testRoutesAcrossHosts(t *testing.T, plugin string) {
	c := newCluster(t)
	lan := netns.New(t, "rtlan")
	lan.MustRun(t, "ip", "link", "add", "br0", "type", "bridge")
	lan.MustRun(t, "ip", "link", "set", "br0", "up")
	network := netns.Unique("rtn-")
	type rHost struct {
		lanHost
		agent *binaryAgent
		ctr   *netns.NS
		addr  string
		ip6   string // the host's IPv6 address on the LAN
		addr6 string // its container's IPv6 address
	}
	var hosts []*rHost
	for i, name := range []string{"host-a", "host-b", "host-c"} {
		h := &rHost{lanHost: lanHost{name: name, ns: netns.New(t, "rth"), ip: fmt.Sprintf("198.18.60.%d", i+1)}, ip6: fmt.Sprintf("fd00:60::%d", i+1)}
		port := fmt.Sprintf("p%d", i)
		lan.MustRun(t, "ip", "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", h.ns.Name)
		lan.MustRun(t, "ip", "link", "set", port, "master", "br0", "up")
		h.ns.MustRun(t, "ip", "addr", "add", h.ip+"/24", "dev", "eth0")
		h.ns.MustRun(t, "ip", "addr", "add", h.ip6+"/64", "dev", "eth0", "nodad")
		h.ns.MustRun(t, "ip", "link", "set", "eth0", "up")
		h.st = c.storeObj("http://" + h.ns.Relay(t, strings.TrimPrefix(c.etcd.Endpoints()[0], "http://")))
		h.cni = cnitest.NewCNI(t, cnitest.PluginDir(t, cnitest.IPAMBin, "bridge", "ptp", "loopback"))
		addr := []string{"--addr", h.ip + "," + h.ip6}
		if name == "host-c" {
			addr = []string{"--addr", h.ip, "--addr", h.ip6}
		}
		h.agent = startBinary(t, h.ns, append(append([]string{"--host", name}, addr...), "--store", "etcd", "--etcd-endpoints", h.st["endpoints"].([]string)[0],
			"--store-prefix", c.prefix, "--lease-ttl", "3s", "--sync-interval", "300ms", "--listen", "off", "--ingress=false",
			"--orphan-after", "4s", "--sweep-interval", "300ms",
			"--routes", "--log-level", "debug")...)
		waitSocket(t, h.agent.socket)
		h.st = h.agent.store(h.st)
		hosts = append(hosts, h)
	}
	list := func(h *rHost) *libcni.NetworkConfigList {
		ipam := map[string]any{"type": "ipam-ring", "host": h.name, "store": h.st, "timeout": "30s",
			"ranges": [][]map[string]string{{{"subnet": "198.18.61.0/24"}}, {{"subnet": "fd00:61::/64"}}}, "routes": []map[string]string{{"dst": "0.0.0.0/0"}}}
		netConf := map[string]any{"type": "bridge", "bridge": "rtbr0", "isGateway": true, "ipMasq": false, "ipam": ipam}
		if plugin == "bridge" {
			// Without it the bridge containers' IPv6 pings across
			// hosts fail (no proxy NDP): the test can fail.
			ipam["ipv6ViaGateway"] = true
		}
		if plugin == "ptp" {
			netConf = map[string]any{"type": "ptp", "ipMasq": false, "ipam": ipam}
		}
		return cnitest.ConfList(t, network,
			netConf,
		)
	}
	for _, h := range hosts {
		h.ctr = netns.New(t, "rtc")
		res, err := cnitest.Add(h.cni, h.ns, list(h), &libcni.RuntimeConf{ContainerID: "c-" + h.name, NetNS: h.ctr.Path, IfName: "eth0"})
		if err != nil {
			t.Fatalf("ADD on %s: %v", h.name, err)
		}
		if len(res.IPs) != 2 || res.IPs[0].Address.IP.To4() == nil || res.IPs[1].Address.IP.To4() != nil {
			t.Fatalf("ADD on %s: want one IPv4 and one IPv6 address, got %v", h.name, res.IPs)
		}
		h.addr, h.addr6 = res.IPs[0].Address.IP.String(), res.IPs[1].Address.IP.String()
		// CHECK passes, the bridge's too (it looks for the result's
		// routes in the container, the IPv6 subnet route included).
		if err := cnitest.InNS(h.ns, func(ctx context.Context) error {
			return h.cni.CheckNetworkList(ctx, list(h), &libcni.RuntimeConf{ContainerID: "c-" + h.name, NetNS: h.ctr.Path, IfName: "eth0"})
		}); err != nil {
			t.Fatalf("CHECK on %s: %v", h.name, err)
		}
	}
	for _, from := range hosts {
		for _, to := range hosts {
			if from == to {
				continue
			}
			for _, dst := range []string{to.addr, to.addr6} {
				waitFor(t, 20*time.Second, fmt.Sprintf("%s's container to reach %s's (%s)", from.name, to.name, dst), func() (bool, string) {
					out, err := from.ctr.Run("ping", "-c", "1", "-W", "1", dst)
					return err == nil, out + "\n" + routingState(t, from.ns, true) + "# container\n" + from.ctr.MustRun(t, "ip", "-6", "route")
				})
			}
		}
	}
	// ringctl status shows, per host, the routes its agent holds (from
	// the summary in its host record) and that they match the ring.
	pl := poolName(t, c.allocator(t, "admin", nil), "198.18.61.0/24")
	pl6 := poolName(t, c.allocator(t, "admin", nil), "fd00:61::/64")
	waitFor(t, 20*time.Second, "ringctl status to show every host's routes matching the ring", func() (bool, string) {
		ctx, cancel := context.WithTimeout(context.Background(), cnitest.OpTimeout)
		defer cancel()
		out, err := exec.CommandContext(ctx, ringctlBin, "--store", "etcd", "--etcd-endpoints", c.etcd.Endpoints()[0],
			"--etcd-prefix", c.prefix, "--host", "admin", "status").CombinedOutput()
		if err != nil {
			return false, fmt.Sprintf("%v\n%s", err, out)
		}
		text := string(out)
		for _, h := range hosts {
			// The host with both its addresses.
			head := "  " + h.name + " (" + h.ip + ", " + h.ip6 + "): "
			if !regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(head) + `\d+ held, matches the ring$`).MatchString(text) {
				return false, text
			}
			for _, to := range hosts {
				// Each host's block lists every other host, and not
				// itself, through its address of each pool's family.
				block := text[strings.Index(text, head):]
				if next := strings.Index(block[2:], "\n  "+"host-"); next >= 0 {
					block = block[:next+2]
				}
				for _, line := range []string{"    pool " + pl + ": " + to.name + " via " + to.ip + ": ", "    pool " + pl6 + ": " + to.name + " via " + to.ip6 + ": "} {
					if strings.Contains(block, line) != (to != h) {
						return false, text
					}
				}
			}
		}
		return true, text
	})

	// host-a fills its ranges and claims space from another host: a new
	// container of host-a in the claimed space is reachable from host-c
	// within 5s (the ring watch).
	ha, hc := hosts[0], hosts[2]
	fill := c.allocator(t, "host-a", nil)
	defs, err := fill.Pools(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var def pool.Def
	for _, d := range defs {
		if d.Name == pl {
			def = d
		}
	}
	owned := func() []pool.OwnedRange {
		ring, err := fill.RingOf(context.Background(), pl)
		if err != nil {
			t.Fatal(err)
		}
		var out []pool.OwnedRange
		for _, r := range ring.Ranges {
			if r.Host == "host-a" && !r.Tombstone {
				out = append(out, r)
			}
		}
		return out
	}
	inAny := func(rs []pool.OwnedRange, ip netip.Addr) bool {
		return slices.ContainsFunc(rs, func(r pool.OwnedRange) bool { return r.Start.Compare(ip) <= 0 && ip.Compare(r.End) <= 0 })
	}
	before := owned()
	var last pool.Owner
	for i := 0; ; i++ {
		if i > 300 {
			t.Fatal("host-a never claimed space")
		}
		last = pool.Owner{Kind: pool.KindCNI, Network: "fill", ContainerID: fmt.Sprintf("f%d", i), IfName: "eth0"}
		al, err := fill.Allocate(context.Background(), pool.Request{Owner: last, Defs: []pool.Def{def}, Wants: []pool.Want{{Pool: pl, Role: pool.RoleIP}}})
		if err != nil {
			t.Fatalf("filling host-a: %v", err)
		}
		if !inAny(before, al.Addrs[0].Addr) {
			break // taken from claimed space
		}
	}
	if _, _, err := fill.Release(context.Background(), last); err != nil {
		t.Fatal(err)
	}
	claimed := netns.New(t, "rtc")
	res, err := cnitest.Add(ha.cni, ha.ns, list(ha), &libcni.RuntimeConf{ContainerID: "c-claimed", NetNS: claimed.Path, IfName: "eth0"})
	if err != nil {
		t.Fatalf("ADD in claimed space on host-a: %v", err)
	}
	newAddr, _ := netip.AddrFromSlice(res.IPs[0].Address.IP)
	newAddr = newAddr.Unmap()
	if inAny(before, newAddr) {
		t.Fatalf("the new container's %s is not in claimed space (host-a owned %v)", newAddr, before)
	}
	waitFor(t, 5*time.Second, "host-c to reach host-a's container in claimed space "+newAddr.String(), func() (bool, string) {
		out, err := hc.ctr.Run("ping", "-c", "1", "-W", "1", newAddr.String())
		return err == nil, out + "\n" + routingState(t, hc.ns, true)
	})

	// host-b dies and is orphaned: the sweep tombstones its ranges, and
	// host-c's routes to them go; the space host-a takes from them is
	// routed to host-a.
	hb := hosts[1]
	var bRanges []pool.OwnedRange
	ring, err := fill.RingOf(context.Background(), pl)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range ring.Ranges {
		if r.Host == "host-b" {
			bRanges = append(bRanges, r)
		}
	}
	if err := hb.agent.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "host-b's ranges tombstoned", func() (bool, string) {
		ring, err := fill.RingOf(context.Background(), pl)
		if err != nil {
			return false, err.Error()
		}
		live := slices.ContainsFunc(ring.Ranges, func(r pool.OwnedRange) bool { return r.Host == "host-b" && !r.Tombstone })
		return !live, fmt.Sprint(ring.Ranges)
	})
	waitFor(t, 15*time.Second, "host-c's routes to host-b gone", func() (bool, string) {
		out := hc.ns.MustRun(t, "ip", "-4", "route", "show", "table", "4212") + hc.ns.MustRun(t, "ip", "-6", "route", "show", "table", "4212")
		return !strings.Contains(out, "via "+hb.ip) && !strings.Contains(out, "via "+hb.ip6), out
	})
	before = owned()
	for i := 0; ; i++ {
		if i > 300 {
			t.Fatal("host-a never took the tombstoned space")
		}
		o := pool.Owner{Kind: pool.KindCNI, Network: "fill", ContainerID: fmt.Sprintf("g%d", i), IfName: "eth0"}
		al, err := fill.Allocate(context.Background(), pool.Request{Owner: o, Defs: []pool.Def{def}, Wants: []pool.Want{{Pool: pl, Role: pool.RoleIP}}})
		if err != nil {
			t.Fatalf("filling host-a again: %v", err)
		}
		if got := al.Addrs[0].Addr; !inAny(before, got) {
			if !inAny(bRanges, got) {
				t.Fatalf("host-a took %s, not from host-b's old ranges %v", got, bRanges)
			}
			waitFor(t, 15*time.Second, "host-c's route to "+got.String()+" via host-a", func() (bool, string) {
				// Until the route is there, a ptp host has no route to
				// the address at all: ip fails ("Network is
				// unreachable"), which is "not yet", not a failure.
				out, err := hc.ns.Run("ip", "route", "get", got.String())
				if err != nil {
					return false, fmt.Sprintf("%v: %s", err, out)
				}
				return strings.Contains(out, "via "+ha.ip) && strings.Contains(out, "table 4212"), out
			})
			break
		}
	}

	if plugin == "bridge" {
		if out := hc.ns.MustRun(t, "sysctl", "-n", "net.ipv4.conf.rtbr0.proxy_arp"); strings.TrimSpace(out) != "1" {
			t.Fatalf("proxy_arp on host-c's bridge: %q", out)
		}
	}
	others := routingState(t, hc.ns, false)
	if err := hc.agent.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case <-hc.agent.done:
	case <-time.After(30 * time.Second):
		t.Fatal("host-c's agent did not stop within 30s")
	}
	if after := routingState(t, hc.ns, true); after != others {
		t.Fatalf("host-c's routing state after its agent stopped is not the state without the agent's routes:\n--- want\n%s--- got\n%s", others, after)
	}
	if plugin != "bridge" {
		return
	}
	if out := hc.ns.MustRun(t, "sysctl", "-n", "net.ipv4.conf.rtbr0.proxy_arp"); strings.TrimSpace(out) != "0" {
		t.Fatalf("proxy_arp on host-c's bridge after its agent stopped: %q", out)
	}
}
