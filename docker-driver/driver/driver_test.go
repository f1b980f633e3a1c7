package driver

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"strings"
	"testing"

	"github.com/docker/go-plugins-helpers/ipam"

	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/memory"
)

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func newDriver(t *testing.T, st store.Store, host string, pools ...DefaultPool) *Driver {
	t.Helper()
	a, err := pool.New(st, host)
	if err != nil {
		t.Fatal(err)
	}
	d, err := New(a, Options{DefaultPools: pools, Logger: quiet(), Metrics: NewMetrics()})
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func mac(i int) string { return fmt.Sprintf("02:42:c6:12:%02x:%02x", i>>8, i&0xff) }

// network creates a network as dockerd does: RequestPool, then the gateway.
func network(t *testing.T, d *Driver, req *ipam.RequestPoolRequest, gw string) (poolID string, gateway string) {
	t.Helper()
	ctx := context.Background()
	res, err := d.RequestPool(ctx, req)
	if err != nil {
		t.Fatalf("RequestPool(%+v): %v", *req, err)
	}
	g, err := d.RequestAddress(ctx, &ipam.RequestAddressRequest{PoolID: res.PoolID, Address: gw, Options: map[string]string{OptAddressType: AddressTypeGateway}})
	if err != nil {
		t.Fatalf("gateway request: %v", err)
	}
	return res.PoolID, g.Address
}

func addr(t *testing.T, d *Driver, pid, m, want string) (string, error) {
	t.Helper()
	res, err := d.RequestAddress(context.Background(), &ipam.RequestAddressRequest{PoolID: pid, Address: want, Options: map[string]string{OptMAC: m}})
	if err != nil {
		return "", err
	}
	return res.Address, nil
}

func TestCapabilities(t *testing.T) {
	d := newDriver(t, memory.New(), "h1")
	if c := d.Capabilities(); !c.RequiresMACAddress || !c.RequiresRequestReplay {
		t.Fatalf("capabilities %+v", c)
	}
}

func TestExplicitSubnet(t *testing.T) {
	ctx := context.Background()
	d := newDriver(t, memory.New(), "h1")
	pid, gw := network(t, d, &ipam.RequestPoolRequest{Pool: "198.18.10.0/24"}, "")
	if gw != "198.18.10.1/24" {
		t.Fatalf("gateway %s, want 198.18.10.1/24", gw)
	}
	seen := map[string]bool{gw: true}
	for i := range 20 {
		a, err := addr(t, d, pid, mac(i), "")
		if err != nil {
			t.Fatal(err)
		}
		if seen[a] || !strings.HasPrefix(a, "198.18.10.") || !strings.HasSuffix(a, "/24") {
			t.Fatalf("address %s duplicate or outside the subnet", a)
		}
		seen[a] = true
	}
	// A replay by the same endpoint (same MAC, its address preferred) is idempotent.
	first, err := addr(t, d, pid, mac(0), "")
	if err != nil {
		t.Fatal(err)
	}
	again, err := addr(t, d, pid, mac(0), strings.TrimSuffix(first, "/24"))
	if err != nil || again != first {
		t.Fatalf("replay gave %s, %v; want %s", again, err, first)
	}
	// --ip, and the same --ip for another endpoint.
	if a, err := addr(t, d, pid, mac(100), "198.18.10.200"); err != nil || a != "198.18.10.200/24" {
		t.Fatalf("static: %s, %v", a, err)
	}
	_, err = addr(t, d, pid, mac(101), "198.18.10.200")
	if !errors.Is(err, pool.ErrAlreadyInUse) {
		t.Fatalf("taken static: %v, want in use", err)
	}
	if msg := Message(err); !strings.Contains(msg, "198.18.10.200 is already in use") {
		t.Fatalf("message %q", msg)
	}
	// The gateway cannot be taken.
	if _, err := addr(t, d, pid, mac(102), "198.18.10.1"); err == nil {
		t.Fatal("allocated the gateway")
	}
	// Release, including unknown and gateway addresses.
	for _, a := range []string{"198.18.10.200", "198.18.10.250", "198.18.10.1", "198.18.10.200"} {
		if err := d.ReleaseAddress(ctx, &ipam.ReleaseAddressRequest{PoolID: pid, Address: a}); err != nil {
			t.Fatalf("release %s: %v", a, err)
		}
	}
	if a, err := addr(t, d, pid, mac(101), "198.18.10.200"); err != nil || a != "198.18.10.200/24" {
		t.Fatalf("static after release: %s, %v", a, err)
	}
	if err := d.ReleasePool(ctx, &ipam.ReleasePoolRequest{PoolID: pid}); err != nil {
		t.Fatal(err)
	}
}

func TestTwoHostsOnePool(t *testing.T) {
	st := memory.New()
	a, b := newDriver(t, st, "hostA"), newDriver(t, st, "hostB")
	pa, ga := network(t, a, &ipam.RequestPoolRequest{Pool: "198.18.20.0/26", SubPool: "198.18.20.0/27"}, "198.18.20.62")
	pb, gb := network(t, b, &ipam.RequestPoolRequest{Pool: "198.18.20.0/26", SubPool: "198.18.20.0/27"}, "")
	if ga != gb || ga != "198.18.20.62/26" {
		t.Fatalf("gateways %s and %s, want both 198.18.20.62/26", ga, gb)
	}
	seen := map[string]string{}
	for i := range 15 {
		for _, x := range []struct {
			d   *Driver
			pid string
		}{{a, pa}, {b, pb}} {
			m := mac(i)
			if x.d == b {
				m = mac(100 + i)
			}
			got, err := addr(t, x.d, x.pid, m, "")
			if err != nil {
				t.Fatal(err)
			}
			if h, dup := seen[got]; dup {
				t.Fatalf("%s handed out to %s and %s", got, h, x.d.Host())
			}
			ip := netip.MustParsePrefix(got).Addr()
			if !netip.MustParsePrefix("198.18.20.0/27").Contains(ip) {
				t.Fatalf("%s outside --ip-range", got)
			}
			seen[got] = x.d.Host()
		}
	}
	// The range has 31 usable addresses (.1-.31); 30 are taken.
	if _, err := addr(t, a, pa, mac(200), ""); err != nil {
		t.Fatal(err)
	}
	_, err := addr(t, b, pb, mac(201), "")
	if !errors.Is(err, pool.ErrNoCapacity) {
		t.Fatalf("full pool: %v", err)
	}
	// A host given another range, or another gateway, is refused.
	c := newDriver(t, st, "hostC")
	if _, err := c.RequestPool(context.Background(), &ipam.RequestPoolRequest{Pool: "198.18.20.0/26", SubPool: "198.18.20.32/27"}); !errors.Is(err, pool.ErrDefinitionMismatch) {
		t.Fatalf("other range: %v", err)
	}
	res, err := c.RequestPool(context.Background(), &ipam.RequestPoolRequest{Pool: "198.18.20.0/26"})
	if err != nil {
		t.Fatalf("no --ip-range adopts the recorded one: %v", err)
	}
	_, err = c.RequestAddress(context.Background(), &ipam.RequestAddressRequest{PoolID: res.PoolID, Address: "198.18.20.33", Options: map[string]string{OptAddressType: AddressTypeGateway}})
	if !errors.Is(err, pool.ErrDefinitionMismatch) {
		t.Fatalf("other gateway: %v", err)
	}
}

func TestDefaultPools(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	dp := DefaultPool{Base: netip.MustParsePrefix("198.18.0.0/22"), Size: 24}
	d := newDriver(t, st, "h1", dp, DefaultPool{Base: netip.MustParsePrefix("fd00:1::/48"), Size: 64})
	var ids []string
	for i := range 4 {
		res, err := d.RequestPool(ctx, &ipam.RequestPoolRequest{})
		if err != nil {
			t.Fatal(err)
		}
		if want := fmt.Sprintf("198.18.%d.0/24", i); res.Pool != want {
			t.Fatalf("pick %d: %s, want %s", i, res.Pool, want)
		}
		ids = append(ids, res.PoolID)
	}
	if _, err := d.RequestPool(ctx, &ipam.RequestPoolRequest{}); !errors.Is(err, pool.ErrNoCapacity) {
		t.Fatalf("exhausted default pools: %v", err)
	}
	// Another host leases independently (its networks are its own).
	if res, err := newDriver(t, st, "h2", dp).RequestPool(ctx, &ipam.RequestPoolRequest{}); err != nil || res.Pool != "198.18.0.0/24" {
		t.Fatalf("h2: %v, %v", res, err)
	}
	// A replay asks with the subnet and takes no lease.
	if _, err := d.RequestPool(ctx, &ipam.RequestPoolRequest{Pool: "198.18.1.0/24"}); err != nil {
		t.Fatal(err)
	}
	if err := d.ReleasePool(ctx, &ipam.ReleasePoolRequest{PoolID: ids[1]}); err != nil {
		t.Fatal(err)
	}
	if err := d.ReleasePool(ctx, &ipam.ReleasePoolRequest{PoolID: ids[1]}); err != nil {
		t.Fatalf("second release: %v", err)
	}
	res, err := d.RequestPool(ctx, &ipam.RequestPoolRequest{})
	if err != nil || res.Pool != "198.18.1.0/24" {
		t.Fatalf("after release: %v, %v", res, err)
	}
	// A restarted driver (same store) sees the leases.
	if _, err := newDriver(t, st, "h1", dp).RequestPool(ctx, &ipam.RequestPoolRequest{}); !errors.Is(err, pool.ErrNoCapacity) {
		t.Fatalf("restarted driver: %v", err)
	}
	res6, err := d.RequestPool(ctx, &ipam.RequestPoolRequest{V6: true})
	if err != nil || res6.Pool != "fd00:1::/64" {
		t.Fatalf("v6: %v, %v", res6, err)
	}
}

func TestIPv6(t *testing.T) {
	d := newDriver(t, memory.New(), "h1")
	pid, gw := network(t, d, &ipam.RequestPoolRequest{Pool: "2001:db8:5::/64", V6: true}, "")
	if gw != "2001:db8:5::1/64" {
		t.Fatalf("gateway %s", gw)
	}
	a, err := addr(t, d, pid, mac(1), "")
	if err != nil || !strings.HasPrefix(a, "2001:db8:5::") {
		t.Fatalf("%s, %v", a, err)
	}
	if _, err := d.RequestPool(context.Background(), &ipam.RequestPoolRequest{Pool: "2001:db8:5::/64"}); !errors.Is(err, pool.ErrInvalid) {
		t.Fatalf("family mismatch: %v", err)
	}
}

func TestAuxAddresses(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	a, b := newDriver(t, st, "hostA"), newDriver(t, st, "hostB")
	pa, _ := network(t, a, &ipam.RequestPoolRequest{Pool: "198.18.30.0/24", SubPool: "198.18.30.0/25"}, "")
	pb, _ := network(t, b, &ipam.RequestPoolRequest{Pool: "198.18.30.0/24", SubPool: "198.18.30.0/25"}, "")
	aux := func(d *Driver, pid, ip string) error {
		_, err := d.RequestAddress(ctx, &ipam.RequestAddressRequest{PoolID: pid, Address: ip})
		return err
	}
	for _, x := range []struct {
		d   *Driver
		pid string
	}{{a, pa}, {b, pb}} {
		if err := aux(x.d, x.pid, "198.18.30.5"); err != nil {
			t.Fatalf("%s: aux in range: %v", x.d.Host(), err)
		}
		if err := aux(x.d, x.pid, "198.18.30.200"); err != nil {
			t.Fatalf("%s: aux outside range: %v", x.d.Host(), err)
		}
	}
	if _, err := addr(t, a, pa, mac(1), "198.18.30.5"); !errors.Is(err, pool.ErrAlreadyInUse) {
		t.Fatalf("aux address handed out: %v", err)
	}
	// hostA leaves the network: hostB still holds the aux address.
	if err := a.ReleaseAddress(ctx, &ipam.ReleaseAddressRequest{PoolID: pa, Address: "198.18.30.5"}); err != nil {
		t.Fatal(err)
	}
	if _, err := addr(t, a, pa, mac(1), "198.18.30.5"); !errors.Is(err, pool.ErrAlreadyInUse) {
		t.Fatalf("aux address freed while hostB holds it: %v", err)
	}
	if err := b.ReleaseAddress(ctx, &ipam.ReleaseAddressRequest{PoolID: pb, Address: "198.18.30.5"}); err != nil {
		t.Fatal(err)
	}
	if got, err := addr(t, a, pa, mac(1), "198.18.30.5"); err != nil || got != "198.18.30.5/24" {
		t.Fatalf("aux address not freed by the last host: %s, %v", got, err)
	}
}

func TestNamedPoolSharedWithCNI(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	cni, err := pool.New(st, "cnihost")
	if err != nil {
		t.Fatal(err)
	}
	def := pool.Def{Name: "shared", Ranges: []pool.Range{{Subnet: netip.MustParsePrefix("198.18.40.0/24"), Gateway: netip.MustParseAddr("198.18.40.1")}}}
	if err := cni.Define(ctx, def); err != nil {
		t.Fatal(err)
	}
	held, err := cni.Allocate(ctx, pool.Request{Owner: pool.Owner{Kind: pool.KindCNI, Network: "cninet", ContainerID: "c1", IfName: "eth0"}, Wants: []pool.Want{{Pool: "shared", Role: pool.RoleIP, Addr: netip.MustParseAddr("198.18.40.9")}}})
	if err != nil {
		t.Fatal(err)
	}
	d := newDriver(t, st, "dockerhost")
	pid, gw := network(t, d, &ipam.RequestPoolRequest{Pool: "198.18.40.0/24", Options: map[string]string{OptPool: "shared"}}, "")
	if gw != "198.18.40.1/24" {
		t.Fatalf("gateway %s", gw)
	}
	_, err = addr(t, d, pid, mac(1), "198.18.40.9")
	var inUse *pool.InUseError
	if !errors.As(err, &inUse) || inUse.Host != "cnihost" {
		t.Fatalf("CNI's address: %v (held %v)", err, held.Addrs)
	}
	if _, err := d.RequestPool(ctx, &ipam.RequestPoolRequest{Pool: "198.18.41.0/24", Options: map[string]string{OptPool: "shared"}}); !errors.Is(err, pool.ErrDefinitionMismatch) {
		t.Fatalf("other subnet, same pool name: %v", err)
	}
}

// A ReleaseAddress for an address that a CNI container on the same host
// name holds (a late release: replayed, or retried after the driver died
// mid-request) leaves the container's address alone.
func TestReleaseLeavesOtherFrontEndsAlone(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	cni, err := pool.New(st, "h1")
	if err != nil {
		t.Fatal(err)
	}
	def := pool.Def{Name: "shared", Ranges: []pool.Range{{Subnet: netip.MustParsePrefix("198.18.40.0/24"), Gateway: netip.MustParseAddr("198.18.40.1")}}}
	if err := cni.Define(ctx, def); err != nil {
		t.Fatal(err)
	}
	owner := pool.Owner{Kind: pool.KindCNI, Network: "cninet", ContainerID: "c1", IfName: "eth0"}
	if _, err := cni.Allocate(ctx, pool.Request{Owner: owner, Wants: []pool.Want{{Pool: "shared", Role: pool.RoleIP, Addr: netip.MustParseAddr("198.18.40.9")}}}); err != nil {
		t.Fatal(err)
	}
	d := newDriver(t, st, "h1")
	pid, _ := network(t, d, &ipam.RequestPoolRequest{Pool: "198.18.40.0/24", Options: map[string]string{OptPool: "shared"}}, "")
	if err := d.ReleaseAddress(ctx, &ipam.ReleaseAddressRequest{PoolID: pid, Address: "198.18.40.9"}); err != nil {
		t.Fatalf("release: %v", err)
	}
	if al, ok, err := cni.Lookup(ctx, owner); err != nil || !ok || len(al.Addrs) != 1 {
		t.Fatalf("the CNI container lost its address to a Docker release: %+v %v %v", al, ok, err)
	}
	// The driver's own endpoint is still released by address.
	got, err := addr(t, d, pid, mac(1), "")
	if err != nil {
		t.Fatal(err)
	}
	a := strings.Split(got, "/")[0]
	if err := d.ReleaseAddress(ctx, &ipam.ReleaseAddressRequest{PoolID: pid, Address: a}); err != nil {
		t.Fatal(err)
	}
	if h, held, err := cni.HolderOf(ctx, "shared", netip.MustParseAddr(a)); err != nil || held {
		t.Fatalf("endpoint's %s still held after release: %+v %v", a, h, err)
	}
}

func TestBadRequests(t *testing.T) {
	ctx := context.Background()
	d := newDriver(t, memory.New(), "h1")
	for name, req := range map[string]*ipam.RequestPoolRequest{
		"host bits":           {Pool: "198.18.50.1/24"},
		"not a cidr":          {Pool: "198.18.50.0"},
		"range outside":       {Pool: "198.18.50.0/24", SubPool: "198.18.51.0/25"},
		"range without pool":  {SubPool: "198.18.51.0/25"},
		"named without pool":  {Options: map[string]string{OptPool: "x"}},
		"v4 subnet, v6 asked": {Pool: "198.18.50.0/24", V6: true},
	} {
		if _, err := d.RequestPool(ctx, req); !errors.Is(err, pool.ErrInvalid) {
			t.Errorf("%s: %v, want invalid", name, err)
		}
	}
	pid, _ := network(t, d, &ipam.RequestPoolRequest{Pool: "198.18.50.0/24"}, "")
	for name, req := range map[string]*ipam.RequestAddressRequest{
		"bad pool id":  {PoolID: "nope", Options: map[string]string{OptMAC: mac(1)}},
		"bad mac":      {PoolID: pid, Options: map[string]string{OptMAC: "zz"}},
		"no mac":       {PoolID: pid},
		"outside":      {PoolID: pid, Address: "198.18.51.3", Options: map[string]string{OptMAC: mac(1)}},
		"not an addr":  {PoolID: pid, Address: "x", Options: map[string]string{OptMAC: mac(1)}},
		"gw elsewhere": {PoolID: pid, Address: "198.18.60.1", Options: map[string]string{OptAddressType: AddressTypeGateway}},
	} {
		if _, err := d.RequestAddress(ctx, req); !errors.Is(err, pool.ErrInvalid) {
			t.Errorf("%s: %v, want invalid", name, err)
		}
	}
}

func TestPoolIDRoundTrip(t *testing.T) {
	for _, p := range []poolID{
		{Pool: "198.18.0.0-24", Subnet: netip.MustParsePrefix("198.18.0.0/24"), Start: netip.MustParseAddr("198.18.0.1"), End: netip.MustParseAddr("198.18.0.254")},
		{Pool: "fd00::-64", Subnet: netip.MustParsePrefix("fd00::/64"), Start: netip.MustParseAddr("fd00::1"), End: netip.MustParseAddr("fd00::ffff:ffff:ffff:ffff"), Lease: "abc"},
	} {
		got, err := parsePoolID(p.String())
		if err != nil || got != p {
			t.Errorf("%s: %+v, %v", p, got, err)
		}
	}
}

func TestDefaultPoolNth(t *testing.T) {
	p := DefaultPool{Base: netip.MustParsePrefix("198.18.0.0/15"), Size: 24}
	for n, want := range map[uint64]string{0: "198.18.0.0/24", 1: "198.18.1.0/24", 256: "198.19.0.0/24", 511: "198.19.255.0/24"} {
		if got, ok := p.nth(n); !ok || got.String() != want {
			t.Errorf("nth(%d) = %s, %v; want %s", n, got, ok, want)
		}
	}
	if _, ok := p.nth(512); ok {
		t.Error("nth past the end")
	}
	p6 := DefaultPool{Base: netip.MustParsePrefix("fd00:1::/48"), Size: 64}
	if got, ok := p6.nth(0x1234); !ok || got.String() != "fd00:1:0:1234::/64" {
		t.Errorf("v6: %s", got)
	}
}

func TestDefaultPoolSkipsSubnetRecordedOtherwise(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	other, err := pool.New(st, "cnihost")
	if err != nil {
		t.Fatal(err)
	}
	// Someone recorded pool "198.18.0.0-24" with two subnets: unusable for Docker.
	if err := other.Define(ctx, pool.Def{Name: "198.18.0.0-24", Ranges: []pool.Range{
		{Subnet: netip.MustParsePrefix("198.18.0.0/24")}, {Subnet: netip.MustParsePrefix("198.18.9.0/24")}}}); err != nil {
		t.Fatal(err)
	}
	d := newDriver(t, st, "h1", DefaultPool{Base: netip.MustParsePrefix("198.18.0.0/23"), Size: 24})
	res, err := d.RequestPool(ctx, &ipam.RequestPoolRequest{})
	if err != nil || res.Pool != "198.18.1.0/24" {
		t.Fatalf("got %v, %v; want 198.18.1.0/24", res, err)
	}
	if _, err := d.RequestPool(ctx, &ipam.RequestPoolRequest{}); !errors.Is(err, pool.ErrNoCapacity) {
		t.Fatalf("second pick: %v", err)
	}
	leases, err := st.Scan(ctx, leasePrefix("h1"), store.PrefixEnd(leasePrefix("h1")), 0)
	if err != nil || len(leases) != 1 {
		t.Fatalf("leases %v, %v: the skipped subnet's lease must be dropped", leases, err)
	}
}

func FuzzParsePoolID(f *testing.F) {
	f.Add("198.18.0.0-24;198.18.0.0/24;198.18.0.1-198.18.0.254")
	f.Add("p;fd00::/64;fd00::1-fd00::ffff;tok")
	f.Add(";;;")
	f.Fuzz(func(t *testing.T, s string) {
		p, err := parsePoolID(s)
		if err != nil {
			return
		}
		again, err := parsePoolID(p.String())
		if err != nil || again != p {
			t.Fatalf("%q -> %+v -> %q -> %+v, %v", s, p, p.String(), again, err)
		}
	})
}

// An endpoint MAC that a second host reuses is refused with "already
// exists" naming the first host, never served the first host's address.
func TestSameMACOnTwoHostsIsRefused(t *testing.T) {
	st := memory.New()
	a, b := newDriver(t, st, "hostA"), newDriver(t, st, "hostB")
	pa, _ := network(t, a, &ipam.RequestPoolRequest{Pool: "198.18.21.0/26"}, "")
	pb, _ := network(t, b, &ipam.RequestPoolRequest{Pool: "198.18.21.0/26"}, "")
	if _, err := addr(t, a, pa, mac(1), ""); err != nil {
		t.Fatal(err)
	}
	_, err := addr(t, b, pb, mac(1), "")
	if !errors.Is(err, pool.ErrAlreadyExists) || !strings.Contains(Message(err), "hostA") {
		t.Fatalf("same MAC on host B: %v, want already exists on hostA", err)
	}
}
