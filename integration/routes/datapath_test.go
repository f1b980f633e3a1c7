//go:build integration

package routes_test

import (
	"net/netip"
	"slices"
	"testing"

	"github.com/ringipam/ringipam/integration/netns"
	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/routes"
)

// host is one namespace host of the data path test: a LAN address, a
// bridge carrying the pool's gateway (as the bridge plugin with isGateway
// sets it up) and one container on it.
type host struct {
	name string
	ns   *netns.NS
	ctr  *netns.NS
	lan  netip.Addr
	tb   *routes.Table
}

// Two hosts on one LAN, each with a bridge on the same pool subnet and a
// container in its own range of the ring: no container reaches the other
// until each host installs its plan and proxy ARP on its bridge; then they
// ping each other both ways; after Clear they no longer do, and the hosts'
// routing state and proxy_arp are what they were.
func TestBridgeContainersReachEachOther(t *testing.T) {
	netns.RequireRoot(t)
	def := pool.Def{Name: "p", Ranges: []pool.Range{{Subnet: netip.MustParsePrefix("10.66.0.0/24"),
		Start: netip.MustParseAddr("10.66.0.1"), End: netip.MustParseAddr("10.66.0.254"), Gateway: netip.MustParseAddr("10.66.0.1")}}}
	ring := pool.Ring{Pool: "p", Ranges: []pool.OwnedRange{
		{Start: netip.MustParseAddr("10.66.0.1"), End: netip.MustParseAddr("10.66.0.127"), Host: "a"},
		{Start: netip.MustParseAddr("10.66.0.128"), End: netip.MustParseAddr("10.66.0.254"), Host: "b"},
	}}
	a := &host{name: "a", ns: netns.New(t, "rha"), ctr: netns.New(t, "rca"), lan: netip.MustParseAddr("192.168.78.1")}
	b := &host{name: "b", ns: netns.New(t, "rhb"), ctr: netns.New(t, "rcb"), lan: netip.MustParseAddr("192.168.78.2")}
	ctrAddr := map[string]string{"a": "10.66.0.10", "b": "10.66.0.200"}

	for _, h := range []*host{a, b} {
		// No IPv6: link-local addresses arriving late would make the
		// before/after comparison of the routing state flaky.
		h.ns.MustRun(t, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1")
	}
	a.ns.MustRun(t, "ip", "link", "add", "lan0", "type", "veth", "peer", "name", "lanp")
	a.ns.MustRun(t, "ip", "link", "set", "lanp", "netns", b.ns.Name)
	b.ns.MustRun(t, "ip", "link", "set", "lanp", "name", "lan0")
	before := map[string]string{}
	for _, h := range []*host{a, b} {
		h.ns.MustRun(t, "ip", "addr", "add", h.lan.String()+"/24", "dev", "lan0")
		h.ns.MustRun(t, "ip", "link", "set", "lan0", "up")
		h.ns.MustRun(t, "sysctl", "-qw", "net.ipv4.ip_forward=1")
		h.ns.MustRun(t, "ip", "link", "add", "br0", "type", "bridge")
		h.ns.MustRun(t, "ip", "addr", "add", "10.66.0.1/24", "dev", "br0")
		h.ns.MustRun(t, "ip", "link", "set", "br0", "up")
		h.ns.MustRun(t, "ip", "link", "add", "vc0", "type", "veth", "peer", "name", "eth0")
		h.ns.MustRun(t, "ip", "link", "set", "eth0", "netns", h.ctr.Name)
		h.ns.MustRun(t, "ip", "link", "set", "vc0", "master", "br0", "up")
		h.ctr.MustRun(t, "ip", "addr", "add", ctrAddr[h.name]+"/24", "dev", "eth0")
		h.ctr.MustRun(t, "ip", "link", "set", "eth0", "up")
		h.ctr.MustRun(t, "ip", "route", "add", "default", "via", "10.66.0.1")
	}
	for _, h := range []*host{a, b} { // both ends of the LAN up
		before[h.name] = h.ns.RoutingState(t) + h.ns.MustRun(t, "sysctl", "net.ipv4.conf.br0.proxy_arp")
	}
	ping := func(from *host, to string) error {
		_, err := from.ctr.Run("ping", "-c", "1", "-W", "2", to)
		return err
	}
	if ping(a, ctrAddr["b"]) == nil {
		t.Fatal("a's container reaches b's before any route: the test cannot fail")
	}

	for _, h := range []*host{a, b} {
		h := h
		if err := h.ns.Do(func() error {
			tb, err := routes.OpenTable(routes.TableConfig{})
			if err != nil {
				return err
			}
			h.tb = tb
			onLink, err := tb.OnLink()
			if err != nil {
				return err
			}
			plan := routes.Plan(routes.Input{Self: h.name, OnLink: onLink, Pools: []routes.Pool{{Def: def, Ring: ring}},
				Hosts: []routes.Host{{Name: "a", State: pool.HostUp, Addrs: []netip.Addr{a.lan}}, {Name: "b", State: pool.HostUp, Addrs: []netip.Addr{b.lan}}}})
			if len(plan.Refused) != 0 || len(plan.Routes) == 0 {
				t.Errorf("host %s: plan %+v", h.name, plan)
			}
			if _, err := tb.Apply(plan.Routes); err != nil {
				return err
			}
			links, err := tb.ProxyARP([]netip.Prefix{def.Ranges[0].Subnet})
			if err != nil {
				return err
			}
			if !slices.Equal(links, []string{"br0"}) {
				t.Errorf("host %s: proxy ARP on %v, want br0", h.name, links)
			}
			return nil
		}); err != nil {
			t.Fatalf("host %s: %v", h.name, err)
		}
		defer h.tb.Close()
	}
	if err := ping(a, ctrAddr["b"]); err != nil {
		t.Fatalf("a's container does not reach b's: %v", err)
	}
	if err := ping(b, ctrAddr["a"]); err != nil {
		t.Fatalf("b's container does not reach a's: %v", err)
	}
	for _, h := range []*host{a, b} {
		if err := h.ns.Do(h.tb.Clear); err != nil {
			t.Fatalf("host %s: Clear: %v", h.name, err)
		}
		after := h.ns.RoutingState(t) + h.ns.MustRun(t, "sysctl", "net.ipv4.conf.br0.proxy_arp")
		if after != before[h.name] {
			t.Errorf("host %s: state after Clear differs:\n--- before\n%s--- after\n%s", h.name, before[h.name], after)
		}
	}
	if ping(a, ctrAddr["b"]) == nil {
		t.Fatal("a's container still reaches b's after Clear")
	}
}
