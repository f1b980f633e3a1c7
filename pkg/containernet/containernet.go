package containernet

import (
	"errors"
	"fmt"
	"net"
	"net/netip"

	"github.com/ringipam/ringipam/pkg/pool"
)

// Sentinel errors of this package. Test them with errors.Is.
var (
	// ErrInvalid: a Spec or a container network value breaks the rules of
	// the specification (ip ∉ subnet, gw ∈ subnet, a special subnet
	// overlapping the pool, mixed families, ...). It wraps pool.ErrInvalid,
	// so a caller mapping pool errors to wire codes needs no extra case.
	ErrInvalid = fmt.Errorf("invalid container network: %w", pool.ErrInvalid)
	// ErrSubnetConflict: a special subnet overlaps, without being equal to,
	// a special subnet that live containers of the same pool use. It wraps
	// pool.ErrAlreadyInUse.
	ErrSubnetConflict = fmt.Errorf("special subnet conflicts with one in use: %w", pool.ErrAlreadyInUse)
	// ErrViolation: CheckNet found stored state that breaks an invariant.
	ErrViolation = errors.New("container network invariant violated")
)

// ContainerNet is a container's network: its ip, the subnet it belongs to
// and its gateway. Its fields are unexported so that a value cannot exist
// unless ip ∈ subnet, ip ≠ gw and gw ∉ subnet; build one with New. The zero
// value is not a container network (IsValid reports false). Values are
// comparable with ==.
type ContainerNet struct {
	ip     netip.Addr
	subnet netip.Prefix
	gw     netip.Addr
}

// New returns the container network (ip, subnet, gw), or an error wrapping
// ErrInvalid when ip ∉ subnet, ip = gw, gw ∈ subnet, an address is missing,
// or the three are not all of one family. The subnet is canonicalised
// (masked); IPv4-mapped IPv6 addresses are rejected rather than guessed at.
func New(ip netip.Addr, subnet netip.Prefix, gw netip.Addr) (ContainerNet, error) {
	switch {
	case !ip.IsValid():
		return ContainerNet{}, fmt.Errorf("%w: missing ip", ErrInvalid)
	case !subnet.IsValid():
		return ContainerNet{}, fmt.Errorf("%w: missing or invalid subnet for ip %s", ErrInvalid, ip)
	case !gw.IsValid():
		return ContainerNet{}, fmt.Errorf("%w: missing gateway for ip %s", ErrInvalid, ip)
	case ip.Is4In6() || gw.Is4In6() || subnet.Addr().Is4In6():
		return ContainerNet{}, fmt.Errorf("%w: IPv4-mapped IPv6 address in (%s, %s, %s); use plain IPv4", ErrInvalid, ip, subnet, gw)
	case ip.Is4() != subnet.Addr().Is4() || ip.Is4() != gw.Is4():
		return ContainerNet{}, fmt.Errorf("%w: ip %s, subnet %s and gateway %s are not all of one family", ErrInvalid, ip, subnet, gw)
	case ip.Zone() != "" || gw.Zone() != "":
		return ContainerNet{}, fmt.Errorf("%w: zoned address in (%s, %s)", ErrInvalid, ip, gw)
	}
	subnet = subnet.Masked()
	switch {
	case !subnet.Contains(ip):
		return ContainerNet{}, fmt.Errorf("%w: ip %s is not in its subnet %s", ErrInvalid, ip, subnet)
	case ip == gw:
		return ContainerNet{}, fmt.Errorf("%w: ip %s is its own gateway", ErrInvalid, ip)
	case subnet.Contains(gw):
		return ContainerNet{}, fmt.Errorf("%w: gateway %s is inside the container's subnet %s", ErrInvalid, gw, subnet)
	}
	return ContainerNet{ip: ip, subnet: subnet, gw: gw}, nil
}

// HostPrefix returns the subnet {ip}: ip/32 for IPv4, ip/128 for IPv6.
func HostPrefix(ip netip.Addr) netip.Prefix {
	return netip.PrefixFrom(ip, ip.BitLen())
}

// IsValid reports whether c is a container network (not the zero value).
func (c ContainerNet) IsValid() bool { return c.ip.IsValid() }

// IP returns the container's address.
func (c ContainerNet) IP() netip.Addr { return c.ip }

// Subnet returns the container's subnet (masked).
func (c ContainerNet) Subnet() netip.Prefix { return c.subnet }

// Gateway returns the container's gateway, which is outside its subnet.
func (c ContainerNet) Gateway() netip.Addr { return c.gw }

// Pooled reports whether the subnet is the ip alone (/32 or /128), as for a
// container network created from the pool.
func (c ContainerNet) Pooled() bool { return c.IsValid() && c.subnet == HostPrefix(c.ip) }

// Prefix returns the ip with the subnet's length, as an interface address is
// written (198.18.0.5/32, 198.19.7.3/24).
func (c ContainerNet) Prefix() netip.Prefix { return netip.PrefixFrom(c.ip, c.subnet.Bits()) }

// IPNet returns Prefix as a net.IPNet, for the CNI and Docker edges.
func (c ContainerNet) IPNet() net.IPNet {
	if !c.IsValid() {
		return net.IPNet{}
	}
	return net.IPNet{IP: net.IP(c.ip.AsSlice()), Mask: net.CIDRMask(c.subnet.Bits(), c.ip.BitLen())}
}

// GatewayIP returns the gateway as a net.IP, for the CNI and Docker edges.
func (c ContainerNet) GatewayIP() net.IP {
	if !c.IsValid() {
		return nil
	}
	return net.IP(c.gw.AsSlice())
}

// String renders c as "ip in subnet via gw".
func (c ContainerNet) String() string {
	if !c.IsValid() {
		return "<none>"
	}
	return fmt.Sprintf("%s in %s via %s", c.ip, c.subnet, c.gw)
}
