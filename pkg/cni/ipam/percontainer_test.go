package ipam

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"testing"

	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"

	"github.com/ringipam/ringipam/pkg/containernet"
	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/store/memory"
)

const perContainerDual = `{"host":"h1","gatewayMode":"per-container","ranges":[[{"subnet":"198.18.0.0/24"}],[{"subnet":"2001:db8::/64"}]],"routes":[{"dst":"0.0.0.0/0"}]}`

func addr(t *testing.T, ip net.IP) netip.Addr {
	t.Helper()
	a, ok := netip.AddrFromSlice(ip)
	if !ok {
		t.Fatalf("bad ip %v", ip)
	}
	return a.Unmap()
}

// held lists every address any owner holds, as "pool role addr".
func heldAddrs(t *testing.T, a *pool.Allocator) []string {
	t.Helper()
	allocs, err := a.List(context.Background(), pool.Filter{})
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, al := range allocs {
		for _, x := range al.Addrs {
			out = append(out, fmt.Sprintf("%s %s %s", x.Pool, x.Role, x.Addr))
		}
	}
	return out
}

func TestPerContainerAddDualStack(t *testing.T) {
	ctx := context.Background()
	a := newAlloc(t, memory.New(), "h1")
	c := mustLoad(t, perContainerDual, "")
	seenIPs, seenGWs := map[netip.Addr]string{}, map[netip.Addr]string{}
	var results []*current.Result
	for _, id := range []string{"c1", "c2"} {
		r, err := Add(ctx, a, c, Attachment{ContainerID: id, IfName: "eth0"})
		if err != nil {
			t.Fatal(err)
		}
		results = append(results, r)
		if len(r.IPs) != 2 {
			t.Fatalf("%s: want one IPv4 and one IPv6 config, got %v", id, r.IPs)
		}
		for i, ipc := range r.IPs {
			ip, gw := addr(t, ipc.Address.IP), addr(t, ipc.Gateway)
			def := c.RangeSets[i].Def
			if !def.Contains(ip) || !def.Contains(gw) {
				t.Errorf("%s: ip %s and gateway %s must both come from pool %s", id, ip, gw, def.Name)
			}
			if gw == def.Ranges[0].Gateway {
				t.Errorf("%s: got the range's shared gateway %s", id, gw)
			}
			if ones, _ := ipc.Address.Mask.Size(); ones != def.Ranges[0].Subnet.Bits() {
				t.Errorf("%s: prefix /%d, want the range's /%d (perContainerPrefix range)", id, ones, def.Ranges[0].Subnet.Bits())
			}
			for _, x := range []netip.Addr{ip, gw} {
				if prev, dup := seenIPs[x]; dup {
					t.Errorf("%s: %s already handed out to %s", id, x, prev)
				}
				if prev, dup := seenGWs[x]; dup {
					t.Errorf("%s: %s already a gateway of %s", id, x, prev)
				}
			}
			seenIPs[ip], seenGWs[gw] = id, id
		}
		if len(r.Routes) != 1 {
			t.Errorf("routes not passed through: %v", r.Routes)
		}
	}
	again, err := Add(ctx, a, c, Attachment{ContainerID: "c1", IfName: "eth0"})
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(again.IPs) != fmt.Sprint(results[0].IPs) {
		t.Errorf("re-ADD gave %v, first ADD %v", again.IPs, results[0].IPs)
	}
	m := containernet.NewManager(a)
	for _, rs := range c.RangeSets {
		if err := m.Check(ctx, rs.Def.Name); err != nil {
			t.Errorf("invariants of %s: %v", rs.Def.Name, err)
		}
		n, ok, err := m.Lookup(ctx, c.Owner(Attachment{ContainerID: "c1", IfName: "eth0"}), rs.Def.Name)
		if err != nil || !ok || !n.Pooled() {
			t.Errorf("stored container network in %s: %v %v %v, want a pooled /32 or /128", rs.Def.Name, n, ok, err)
		}
	}
	// CHECK compares ip and gateway.
	cc := *c
	cc.PrevResult = results[0]
	at := Attachment{ContainerID: "c1", IfName: "eth0"}
	if err := Check(ctx, a, &cc, at); err != nil {
		t.Fatalf("CHECK of a fresh allocation: %v", err)
	}
	wrongGW := *results[0]
	wrongGW.IPs = []*current.IPConfig{results[0].IPs[0], {Address: results[0].IPs[1].Address, Gateway: results[1].IPs[1].Gateway}}
	cc.PrevResult = &wrongGW
	if err := Check(ctx, a, &cc, at); codeOf(err) != CodeCheckFailed || !strings.Contains(err.Error(), "via") {
		t.Fatalf("CHECK with another container's gateway = %v, want code %d", err, CodeCheckFailed)
	}
	// DEL releases ip and gateway of both families; a second DEL succeeds.
	for _, id := range []string{"c1", "c2", "c1"} {
		if err := Del(ctx, a, c, Attachment{ContainerID: id, IfName: "eth0"}); err != nil {
			t.Fatal(err)
		}
	}
	if h := heldAddrs(t, a); len(h) != 0 {
		t.Fatalf("after DEL still held: %v", h)
	}
	cc.PrevResult = results[0]
	if err := Check(ctx, a, &cc, at); codeOf(err) != CodeCheckFailed {
		t.Fatalf("CHECK after DEL = %v, want code %d", err, CodeCheckFailed)
	}
}

func TestPerContainerHostPrefix(t *testing.T) {
	ctx := context.Background()
	a := newAlloc(t, memory.New(), "h1")
	c := mustLoad(t, `{"host":"h1","gatewayMode":"per-container","perContainerPrefix":"host","ranges":[[{"subnet":"198.18.0.0/24"}],[{"subnet":"2001:db8::/64"}]]}`, "")
	r, err := Add(ctx, a, c, Attachment{ContainerID: "c1", IfName: "eth0"})
	if err != nil {
		t.Fatal(err)
	}
	for _, ipc := range r.IPs {
		ones, bits := ipc.Address.Mask.Size()
		if ones != bits || ipc.Gateway == nil || ipc.Gateway.Equal(ipc.Address.IP) {
			t.Errorf("got %s via %s, want a host prefix with its own gateway", ipc.Address.String(), ipc.Gateway)
		}
	}
	cc := *c
	cc.PrevResult = r
	if err := Check(ctx, a, &cc, Attachment{ContainerID: "c1", IfName: "eth0"}); err != nil {
		t.Fatal(err)
	}
}

func TestPerContainerStaticIP(t *testing.T) {
	ctx := context.Background()
	a := newAlloc(t, memory.New(), "h1")
	const ipam = `{"host":"h1","gatewayMode":"per-container","ranges":[[{"subnet":"198.18.0.0/24"}]]}`
	r, err := Add(ctx, a, mustLoad(t, ipam, "IP=198.18.0.77"), Attachment{ContainerID: "s1", IfName: "eth0"})
	if err != nil {
		t.Fatal(err)
	}
	if got := r.IPs[0].Address.String(); got != "198.18.0.77/24" {
		t.Fatalf("static per-container ADD gave %s", got)
	}
	gw := r.IPs[0].Gateway.String()
	// The first container's gateway is taken: a static request for it fails
	// naming the holder.
	_, err = Add(ctx, a, mustLoad(t, ipam, "IP="+gw), Attachment{ContainerID: "s2", IfName: "eth0"})
	if codeOf(err) != CodeAlreadyInUse || !strings.Contains(err.Error(), "s1") {
		t.Fatalf("static request for another container's gateway = %v (code %d), want %d naming s1", err, codeOf(err), CodeAlreadyInUse)
	}
	// CHECK with a different static ip than held.
	if err := Check(ctx, a, mustLoad(t, ipam, "IP=198.18.0.78"), Attachment{ContainerID: "s1", IfName: "eth0"}); codeOf(err) != CodeCheckFailed {
		t.Fatalf("CHECK with another static ip = %v", err)
	}
	// ADD with a different static ip for the same owner: already exists.
	if _, err := Add(ctx, a, mustLoad(t, ipam, "IP=198.18.0.78"), Attachment{ContainerID: "s1", IfName: "eth0"}); codeOf(err) != CodeAlreadyExists {
		t.Fatalf("second static ip for one owner = %v, want code %d", err, CodeAlreadyExists)
	}
}

func TestPerContainerSpecialSubnet(t *testing.T) {
	ctx := context.Background()
	a := newAlloc(t, memory.New(), "h1")
	const ipam = `{"host":"h1","gatewayMode":"per-container","ranges":[[{"subnet":"198.18.0.0/24"}]]}`
	gws := map[string]string{}
	var first *current.Result
	for i, id := range []string{"a", "b", "c"} {
		ip := fmt.Sprintf("198.19.7.%d", i+3)
		r, err := Add(ctx, a, mustLoad(t, ipam, "SUBNET=198.19.7.0/24;IP="+ip), Attachment{ContainerID: id, IfName: "eth0"})
		if err != nil {
			t.Fatal(err)
		}
		if first == nil {
			first = r
		}
		ipc := r.IPs[0]
		if ipc.Address.String() != ip+"/24" {
			t.Errorf("%s: address %s, want %s/24", id, ipc.Address.String(), ip)
		}
		gw := addr(t, ipc.Gateway)
		if !c0(t, ipam).Contains(gw) {
			t.Errorf("%s: gateway %s is not from the pool", id, gw)
		}
		if prev, dup := gws[gw.String()]; dup {
			t.Errorf("%s and %s share gateway %s", prev, id, gw)
		}
		gws[gw.String()] = id
	}
	if err := containernet.NewManager(a).Check(ctx, "net1-0"); err != nil {
		t.Fatalf("invariants: %v", err)
	}
	// A fourth container asking for a taken ip in the subnet.
	_, err := Add(ctx, a, mustLoad(t, ipam, "SUBNET=198.19.7.0/24;IP=198.19.7.4"), Attachment{ContainerID: "d", IfName: "eth0"})
	if codeOf(err) != CodeAlreadyInUse || !strings.Contains(err.Error(), "198.19.7.4 is taken in special subnet 198.19.7.0/24") || !strings.Contains(err.Error(), "net1/b/eth0") {
		t.Fatalf("taken ip in the special subnet = %v (code %d), want code %d naming net1/b/eth0", err, codeOf(err), CodeAlreadyInUse)
	}
	// An overlapping, different special subnet while a, b, c live in theirs.
	_, err = Add(ctx, a, mustLoad(t, ipam, "SUBNET=198.19.7.128/25;IP=198.19.7.200"), Attachment{ContainerID: "e", IfName: "eth0"})
	if codeOf(err) != CodeAlreadyInUse {
		t.Fatalf("overlapping special subnet = %v (code %d), want %d", err, codeOf(err), CodeAlreadyInUse)
	}
	// The refused requests left nothing behind: 3 ips + 3 gateways.
	if h := heldAddrs(t, a); len(h) != 6 {
		t.Fatalf("held after refusals: %v", h)
	}
	// CHECK compares the subnet too.
	at := Attachment{ContainerID: "a", IfName: "eth0"}
	cc := mustLoad(t, ipam, "SUBNET=198.19.7.0/24;IP=198.19.7.3")
	cc.PrevResult = first
	if err := Check(ctx, a, cc, at); err != nil {
		t.Fatalf("CHECK: %v", err)
	}
	if err := Check(ctx, a, mustLoad(t, ipam, ""), at); codeOf(err) != CodeCheckFailed {
		t.Fatalf("CHECK without the SUBNET = %v, want code %d", err, CodeCheckFailed)
	}
	// GC (nothing valid) releases ip and gateway of all three.
	gc := mustLoad(t, ipam, "")
	gc.HasValid = true
	gc.Valid = []types.GCAttachment{}
	if _, err := GC(ctx, a, gc); err != nil {
		t.Fatal(err)
	}
	if h := heldAddrs(t, a); len(h) != 0 {
		t.Fatalf("after GC still held: %v", h)
	}
}

func c0(t *testing.T, ipam string) pool.Def { return mustLoad(t, ipam, "").RangeSets[0].Def }

func TestModeSwitchNeedsDel(t *testing.T) {
	ctx := context.Background()
	a := newAlloc(t, memory.New(), "h1")
	at := Attachment{ContainerID: "c1", IfName: "eth0"}
	if _, err := Add(ctx, a, mustLoad(t, `{"host":"h1","ranges":[[{"subnet":"198.18.0.0/24"}]]}`, ""), at); err != nil {
		t.Fatal(err)
	}
	pc := mustLoad(t, `{"host":"h1","gatewayMode":"per-container","ranges":[[{"subnet":"198.18.0.0/24"}]]}`, "")
	if _, err := Add(ctx, a, pc, at); codeOf(err) != CodeAlreadyExists {
		t.Fatalf("per-container ADD over a shared-mode allocation = %v (code %d), want %d", err, codeOf(err), CodeAlreadyExists)
	}
	if err := Check(ctx, a, pc, at); codeOf(err) != CodeCheckFailed {
		t.Fatalf("per-container CHECK of a shared-mode allocation = %v, want %d", err, CodeCheckFailed)
	}
	if err := Del(ctx, a, pc, at); err != nil {
		t.Fatal(err)
	}
	if _, err := Add(ctx, a, pc, at); err != nil {
		t.Fatalf("ADD after DEL: %v", err)
	}
}
