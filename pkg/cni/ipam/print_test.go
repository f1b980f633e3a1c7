package ipam

import (
	"bytes"
	"math/rand/v2"
	"net"
	"testing"

	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
)

// randomResult makes a result with every field types/100 prints, each
// present or not; with awkward set, strings include what JSON escapes.
func randomResult(rng *rand.Rand, awkward bool) *current.Result {
	str := func() string {
		plain := []string{"", "eth0", "net1", "example.com", "ndots:5", "a b", "x-y_z.9", "/var/run/netns/cni-1"}
		odd := []string{"<script>", "a&b", `q"uote`, `back\slash`, "tab\there", "new\nline", "é", "\u2028", "\xff"}
		if awkward && rng.IntN(3) == 0 {
			return odd[rng.IntN(len(odd))]
		}
		return plain[rng.IntN(len(plain))]
	}
	strs := func() []string {
		out := make([]string, rng.IntN(3))
		for i := range out {
			out[i] = str()
		}
		return out
	}
	ip := func() net.IP {
		if rng.IntN(2) == 0 {
			return net.IPv4(198, 18, byte(rng.IntN(256)), byte(rng.IntN(256)))
		}
		b := make(net.IP, 16)
		copy(b, net.ParseIP("2001:db8::"))
		b[14], b[15] = byte(rng.IntN(256)), byte(rng.IntN(256))
		return b
	}
	ipnet := func() net.IPNet {
		a := ip()
		if a.To4() != nil {
			return net.IPNet{IP: a.To4(), Mask: net.CIDRMask(rng.IntN(33), 32)}
		}
		return net.IPNet{IP: a, Mask: net.CIDRMask(rng.IntN(129), 128)}
	}
	maybeInt := func() *int {
		if rng.IntN(2) == 0 {
			return nil
		}
		v := rng.IntN(300) - 20
		return &v
	}
	num := func() int {
		if rng.IntN(2) == 0 {
			return 0
		}
		return rng.IntN(9000)
	}
	r := &current.Result{CNIVersion: []string{"1.0.0", "1.1.0"}[rng.IntN(2)]}
	for range rng.IntN(3) {
		r.Interfaces = append(r.Interfaces, &current.Interface{Name: str(), Mac: str(), Mtu: num(), Sandbox: str(), SocketPath: str(), PciID: str()})
	}
	for range rng.IntN(4) {
		c := &current.IPConfig{Address: ipnet(), Interface: maybeInt()}
		if rng.IntN(3) > 0 {
			c.Gateway = ip()
		}
		r.IPs = append(r.IPs, c)
	}
	for range rng.IntN(4) {
		rt := &types.Route{Dst: ipnet(), MTU: num(), AdvMSS: num(), Priority: num(), Table: maybeInt(), Scope: maybeInt()}
		if rng.IntN(2) == 0 {
			rt.GW = ip()
		}
		r.Routes = append(r.Routes, rt)
	}
	if rng.IntN(2) == 0 {
		r.DNS = types.DNS{Nameservers: strs(), Domain: str(), Search: strs(), Options: strs()}
	}
	return r
}

// The fast printer writes exactly what types/100's PrintTo writes, or
// declines; it declines only for what JSON would escape or cannot encode.
func TestPrintCurrentMatchesPrintTo(t *testing.T) {
	rng := rand.New(rand.NewPCG(12, 34))
	fast := 0
	for i := range 5000 {
		awkward := i%2 == 1
		r := randomResult(rng, awkward)
		var want bytes.Buffer
		if err := r.PrintTo(&want); err != nil {
			t.Fatalf("PrintTo: %v", err)
		}
		got, ok := encodeCurrent(r)
		if !ok {
			if !awkward {
				t.Fatalf("declined a plain result:\n%s", want.String())
			}
			continue
		}
		fast++
		if !bytes.Equal(got, want.Bytes()) {
			t.Fatalf("result %d printed as\n%s\nPrintTo prints\n%s", i, got, want.String())
		}
		var viaPrintAs bytes.Buffer
		if err := printAs(&viaPrintAs, r, r.CNIVersion); err != nil || !bytes.Equal(viaPrintAs.Bytes(), want.Bytes()) {
			t.Fatalf("printAs: %v\n%s", err, viaPrintAs.String())
		}
	}
	if fast < 2500 {
		t.Fatalf("only %d of 5000 results printed by the fast printer", fast)
	}

	// What JSON cannot encode (a 5-byte gateway) is left to PrintTo.
	bad := &current.Result{CNIVersion: "1.0.0", IPs: []*current.IPConfig{{Address: net.IPNet{IP: net.IPv4(198, 18, 0, 1).To4(), Mask: net.CIDRMask(24, 32)}, Gateway: net.IP{1, 2, 3, 4, 5}}}}
	if _, ok := encodeCurrent(bad); ok {
		t.Fatal("a 5-byte gateway was printed")
	}
	if err := printAs(&bytes.Buffer{}, bad, "1.0.0"); err == nil {
		t.Fatal("printAs printed a gateway JSON cannot encode")
	}
	// Older versions go through their own types.
	var old bytes.Buffer
	r := randomResult(rng, false)
	if err := printAs(&old, r, "0.4.0"); err != nil || !bytes.Contains(old.Bytes(), []byte(`"cniVersion": "0.4.0"`)) {
		t.Fatalf("printAs 0.4.0: %v\n%s", err, old.String())
	}
}
