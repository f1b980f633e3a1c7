package containernet

import (
	"errors"
	"net"
	"net/netip"
	"strings"
	"testing"

	"github.com/ringipam/ringipam/pkg/pool"
)

func TestNew(t *testing.T) {
	tests := []struct {
		name       string
		ip, gw     string
		subnet     string
		wantSubnet string
		wantErr    string // "" for success
	}{
		{name: "pooled v4", ip: "198.18.0.5", subnet: "198.18.0.5/32", gw: "198.18.0.9", wantSubnet: "198.18.0.5/32"},
		{name: "pooled v6", ip: "fd00::5", subnet: "fd00::5/128", gw: "fd00::9", wantSubnet: "fd00::5/128"},
		{name: "special subnet, masked", ip: "198.19.7.3", subnet: "198.19.7.3/24", gw: "198.18.0.1", wantSubnet: "198.19.7.0/24"},
		{name: "ip outside subnet", ip: "198.19.8.3", subnet: "198.19.7.0/24", gw: "198.18.0.1", wantErr: "not in its subnet"},
		{name: "ip is gateway", ip: "198.18.0.5", subnet: "198.18.0.5/32", gw: "198.18.0.5", wantErr: "own gateway"},
		{name: "gateway inside subnet", ip: "198.19.7.3", subnet: "198.19.7.0/24", gw: "198.19.7.1", wantErr: "inside the container's subnet"},
		{name: "mixed families", ip: "198.18.0.5", subnet: "198.18.0.5/32", gw: "fd00::1", wantErr: "one family"},
		{name: "mapped v4", ip: "::ffff:198.18.0.5", subnet: "::ffff:198.18.0.5/128", gw: "::ffff:198.18.0.9", wantErr: "IPv4-mapped"},
		{name: "missing ip", subnet: "198.18.0.5/32", gw: "198.18.0.9", wantErr: "missing ip"},
		{name: "missing gateway", ip: "198.18.0.5", subnet: "198.18.0.5/32", wantErr: "missing gateway"},
		{name: "missing subnet", ip: "198.18.0.5", gw: "198.18.0.9", wantErr: "subnet"},
	}
	parseA := func(s string) netip.Addr {
		if s == "" {
			return netip.Addr{}
		}
		return netip.MustParseAddr(s)
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var subnet netip.Prefix
			if tt.subnet != "" {
				subnet = netip.MustParsePrefix(tt.subnet)
			}
			c, err := New(parseA(tt.ip), subnet, parseA(tt.gw))
			if tt.wantErr != "" {
				if !errors.Is(err, ErrInvalid) || !errors.Is(err, pool.ErrInvalid) || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("New = %v, %v; want an ErrInvalid saying %q", c, err, tt.wantErr)
				}
				if c.IsValid() {
					t.Fatalf("New returned a value with its error: %v", c)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if c.IP() != parseA(tt.ip) || c.Gateway() != parseA(tt.gw) || c.Subnet().String() != tt.wantSubnet {
				t.Fatalf("got %v", c)
			}
			if c.Pooled() != (c.Subnet() == HostPrefix(c.IP())) {
				t.Fatalf("Pooled() = %v for %v", c.Pooled(), c)
			}
		})
	}
}

func TestEdges(t *testing.T) {
	c, err := New(netip.MustParseAddr("198.19.7.3"), netip.MustParsePrefix("198.19.7.0/24"), netip.MustParseAddr("198.18.0.1"))
	if err != nil {
		t.Fatal(err)
	}
	n := c.IPNet()
	if n.String() != "198.19.7.3/24" || !c.GatewayIP().Equal(net.ParseIP("198.18.0.1")) {
		t.Fatalf("IPNet %v, gateway %v", n.String(), c.GatewayIP())
	}
	if c.Prefix().String() != "198.19.7.3/24" || c.Pooled() {
		t.Fatalf("Prefix %v, Pooled %v", c.Prefix(), c.Pooled())
	}
	p, err := New(netip.MustParseAddr("fd00::5"), HostPrefix(netip.MustParseAddr("fd00::5")), netip.MustParseAddr("fd00::9"))
	if err != nil {
		t.Fatal(err)
	}
	if pn := p.IPNet(); pn.String() != "fd00::5/128" || !p.Pooled() {
		t.Fatalf("IPNet %v, Pooled %v", p.Prefix(), p.Pooled())
	}
	var zero ContainerNet
	if zero.IsValid() || zero.GatewayIP() != nil || zero.IPNet().IP != nil || zero.String() != "<none>" {
		t.Fatal("zero value is not empty")
	}
}

func TestSpecialPoolName(t *testing.T) {
	for _, tt := range []struct{ subnet, want string }{
		{"198.19.7.9/24", "net:subnet:198.19.7.0_24"},
		{"fd00:7::/64", "net:subnet:fd00:7::_64"},
	} {
		d := specialDef("net", netip.MustParsePrefix(tt.subnet))
		if d.Name != tt.want {
			t.Errorf("name %q, want %q", d.Name, tt.want)
		}
		if _, err := d.Normalize(); err != nil {
			t.Errorf("%s: the pool library rejects the definition: %v", tt.subnet, err)
		}
		if !isSpecialOf("net", d.Name) || isSpecialOf("ne", d.Name) {
			t.Errorf("isSpecialOf wrong for %q", d.Name)
		}
	}
}

func TestPlanCreateRejects(t *testing.T) {
	def, err := pool.Def{Name: "net", Ranges: []pool.Range{{Subnet: pfx("198.18.0.0/24"), Gateway: ip("198.18.0.1")}}}.Normalize()
	if err != nil {
		t.Fatal(err)
	}
	live := []netip.Prefix{pfx("198.19.1.0/24")}
	tests := []struct {
		name string
		spec Spec
		want error
		msg  string
	}{
		{"ip outside pool", Spec{Pool: "net", IP: ip("198.18.1.1")}, ErrInvalid, "not an address pool net hands out"},
		{"ip is pool's gateway", Spec{Pool: "net", IP: ip("198.18.0.1")}, ErrInvalid, "hands out"},
		{"wrong family", Spec{Pool: "net", IP: ip("fd00::1")}, ErrInvalid, "IPv4"},
		{"subnet without ip", Spec{Pool: "net", Subnet: pfx("198.19.2.0/24")}, ErrInvalid, "needs the container's ip"},
		{"ip outside subnet", Spec{Pool: "net", Subnet: pfx("198.19.2.0/24"), IP: ip("198.19.3.1")}, ErrInvalid, "not in special subnet"},
		{"network address of subnet", Spec{Pool: "net", Subnet: pfx("198.19.2.0/24"), IP: ip("198.19.2.0")}, ErrInvalid, "network or broadcast"},
		{"broadcast address of subnet", Spec{Pool: "net", Subnet: pfx("198.19.2.0/24"), IP: ip("198.19.2.255")}, ErrInvalid, "network or broadcast"},
		{"subnet overlaps pool", Spec{Pool: "net", Subnet: pfx("198.18.0.128/25"), IP: ip("198.18.0.130")}, ErrInvalid, "overlaps pool"},
		{"subnet contains pool", Spec{Pool: "net", Subnet: pfx("198.18.0.0/16"), IP: ip("198.18.5.1")}, ErrInvalid, "overlaps pool"},
		{"subnet overlaps a live one", Spec{Pool: "net", Subnet: pfx("198.19.1.128/25"), IP: ip("198.19.1.130")}, ErrSubnetConflict, "overlaps special subnet 198.19.1.0/24"},
		{"from pool is fine", Spec{Pool: "net"}, nil, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := planCreate(def, tt.spec, live)
			if tt.want == nil {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if !errors.Is(err, tt.want) || !strings.Contains(err.Error(), tt.msg) {
				t.Fatalf("planCreate(%v) = %v; want %v saying %q", tt.spec, err, tt.want, tt.msg)
			}
		})
	}
	p, err := planCreate(def, Spec{Pool: "net", Subnet: pfx("198.19.1.0/24"), IP: ip("198.19.1.7")}, live)
	if err != nil || p.special == nil || len(p.wants) != 2 || p.wants[0].Pool != p.special.Name || p.wants[1].Role != pool.RoleGateway || p.wants[1].Pool != "net" {
		t.Fatalf("sharing a live subnet: %+v, %v", p, err)
	}
}

func TestCheckNetReports(t *testing.T) {
	def, err := pool.Def{Name: "net", Ranges: []pool.Range{{Subnet: pfx("198.18.0.0/24")}}}.Normalize()
	if err != nil {
		t.Fatal(err)
	}
	o := func(c string) pool.Owner { return pool.Owner{Kind: pool.KindCNI, Network: "net", ContainerID: c} }
	alloc := func(as ...string) map[netip.Addr]bool {
		m := map[netip.Addr]bool{}
		for _, a := range as {
			m[ip(a)] = true
		}
		return m
	}
	pooled := func(c, x, gw string) Record {
		return Record{Owner: o(c), IP: ip(x), Subnet: HostPrefix(ip(x)), GW: ip(gw)}
	}
	special := func(c, s, x, gw string) Record {
		return Record{Owner: o(c), IP: ip(x), Subnet: pfx(s), GW: ip(gw), Special: true}
	}
	tests := []struct {
		name string
		s    State
		want string // "" for a valid state
	}{
		{"valid", State{def, alloc("198.18.0.1", "198.18.0.2", "198.18.0.3", "198.18.0.4", "198.18.0.5"), []Record{
			pooled("a", "198.18.0.1", "198.18.0.2"),
			special("b", "198.19.1.0/24", "198.19.1.5", "198.18.0.3"),
			special("c", "198.19.1.0/24", "198.19.1.6", "198.18.0.4"),
			special("d", "198.19.2.0/24", "198.19.2.5", "198.18.0.5"),
		}}, ""},
		{"no gateway", State{def, alloc("198.18.0.1"), []Record{{Owner: o("a"), IP: ip("198.18.0.1"), Subnet: HostPrefix(ip("198.18.0.1"))}}}, "missing gateway"},
		{"gateway not allocated", State{def, alloc("198.18.0.1"), []Record{pooled("a", "198.18.0.1", "198.18.0.2")}}, "gateway 198.18.0.2 is not allocated"},
		{"pooled ip not allocated", State{def, alloc("198.18.0.2"), []Record{pooled("a", "198.18.0.1", "198.18.0.2")}}, "ip 198.18.0.1 is not allocated"},
		{"pooled subnet not {ip}", State{def, alloc("198.18.0.1", "198.18.0.2"), []Record{{Owner: o("a"), IP: ip("198.18.0.1"), Subnet: pfx("198.18.0.0/31"), GW: ip("198.18.0.2")}}}, "CNetValid"},
		{"special subnet in pool", State{def, alloc("198.18.0.2"), []Record{special("a", "198.18.0.0/30", "198.18.0.1", "198.18.0.2")}}, "overlaps pool"},
		{"same ip", State{def, alloc("198.18.0.3", "198.18.0.4"), []Record{
			special("a", "198.19.1.0/24", "198.19.1.5", "198.18.0.3"), special("b", "198.19.1.0/24", "198.19.1.5", "198.18.0.4"),
		}}, "both have ip 198.19.1.5"},
		{"same gateway", State{def, alloc("198.18.0.3"), []Record{
			special("a", "198.19.1.0/24", "198.19.1.5", "198.18.0.3"), special("b", "198.19.1.0/24", "198.19.1.6", "198.18.0.3"),
		}}, "both have gateway 198.18.0.3"},
		{"overlapping subnets", State{def, alloc("198.18.0.3", "198.18.0.4"), []Record{
			special("a", "198.19.1.0/24", "198.19.1.5", "198.18.0.3"), special("b", "198.19.1.0/25", "198.19.1.6", "198.18.0.4"),
		}}, "overlap without being equal"},
		{"gateway is another's ip", State{def, alloc("198.18.0.1", "198.18.0.2", "198.18.0.3"), []Record{
			pooled("a", "198.18.0.1", "198.18.0.2"), pooled("b", "198.18.0.3", "198.18.0.1"),
		}}, "AddrsDistinct"},
		{"two ips", State{def, alloc("198.18.0.1", "198.18.0.2"), []Record{func() Record {
			r := pooled("a", "198.18.0.1", "198.18.0.2")
			r.Problem = "holds several ips: 198.18.0.1, 198.19.1.1"
			return r
		}()}}, "Decode"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := CheckNet(tt.s)
			if tt.want == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			var v *Violation
			if !errors.Is(err, ErrViolation) || !errors.As(err, &v) || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("CheckNet = %v; want a violation saying %q", err, tt.want)
			}
		})
	}
}
