package driver

import (
	"fmt"
	"net/netip"
	"strings"

	"github.com/ringipam/ringipam/pkg/names"
	"github.com/ringipam/ringipam/pkg/pool"
)

// poolID is what the driver hands dockerd as PoolID. dockerd stores it with
// the network and passes it back on every later call (also after it
// restarts), so it carries everything those calls need without a lookup:
// the ringipam pool name, the subnet and allocatable range dockerd asked for,
// and, for a pool picked from the default pools, the lease that holds it.
//
// Wire form: "[!]<pool>;<subnet>;<start>-<end>[;<lease>]", the '!' marking
// an isolated pool (--ipam-opt isolated=true). Pool names cannot contain ';'
// or '!' (pool names are [A-Za-z0-9._:-]), nor can addresses.
type poolID struct {
	Pool     string       // ringipam pool name
	Isolated bool         // the pool is its own address space (see pool.Def)
	Subnet   netip.Prefix // the network's subnet (masked)
	Start    netip.Addr   // first allocatable address (canonical, never zero)
	End      netip.Addr   // last allocatable address
	Lease    string       // default-pool lease token; "" for an explicit --subnet
}

func (p poolID) String() string {
	s := p.Pool + ";" + p.Subnet.String() + ";" + p.Start.String() + "-" + p.End.String()
	if p.Isolated {
		s = "!" + s
	}
	if p.Lease != "" {
		s += ";" + p.Lease
	}
	return s
}

func parsePoolID(s string) (poolID, error) {
	parts := strings.Split(s, ";")
	if len(parts) != 3 && len(parts) != 4 {
		return poolID{}, fmt.Errorf("%w: pool ID %q was not issued by this driver", pool.ErrInvalid, s)
	}
	var p poolID
	var err error
	p.Pool, p.Isolated = strings.CutPrefix(parts[0], "!")
	if err := names.Pool(p.Pool); err != nil {
		return poolID{}, fmt.Errorf("%w: pool ID %q: %w", pool.ErrInvalid, s, err)
	}
	if p.Subnet, err = netip.ParsePrefix(parts[1]); err != nil {
		return poolID{}, fmt.Errorf("%w: pool ID %q: %v", pool.ErrInvalid, s, err)
	}
	lo, hi, ok := strings.Cut(parts[2], "-")
	if !ok {
		return poolID{}, fmt.Errorf("%w: pool ID %q: no range", pool.ErrInvalid, s)
	}
	if p.Start, err = netip.ParseAddr(lo); err != nil {
		return poolID{}, fmt.Errorf("%w: pool ID %q: %v", pool.ErrInvalid, s, err)
	}
	if p.End, err = netip.ParseAddr(hi); err != nil {
		return poolID{}, fmt.Errorf("%w: pool ID %q: %v", pool.ErrInvalid, s, err)
	}
	if len(parts) == 4 {
		p.Lease = parts[3]
		if p.Lease == "" {
			return poolID{}, fmt.Errorf("%w: pool ID %q: empty lease", pool.ErrInvalid, s)
		}
	}
	if p.Pool == "" || p.Subnet != p.Subnet.Masked() || !p.Subnet.Contains(p.Start) || !p.Subnet.Contains(p.End) {
		return poolID{}, fmt.Errorf("%w: pool ID %q is inconsistent", pool.ErrInvalid, s)
	}
	return p, nil
}

// PoolName is the ringipam pool a Docker network on subnet uses when no
// "pool" IPAM option names one: the subnet with '/' replaced by '-'
// ("198.18.7.0-24", "fd00:1::-64"). Every host, and any CNI configuration
// that names the same pool, derives the same name.
func PoolName(subnet netip.Prefix) string {
	s := subnet.Masked()
	return s.Addr().String() + "-" + fmt.Sprint(s.Bits())
}

// shape computes the network's allocatable range from dockerd's pool and
// sub-pool (--subnet, --ip-range): the sub-pool clipped to the subnet's
// usable addresses.
func shape(subnet netip.Prefix, subPool string) (start, end netip.Addr, err error) {
	first, last, ok := pool.UsableBounds(subnet)
	if !ok {
		return netip.Addr{}, netip.Addr{}, fmt.Errorf("%w: subnet %s has no usable address", pool.ErrInvalid, subnet)
	}
	if subPool == "" {
		return first, last, nil
	}
	sp, err := netip.ParsePrefix(subPool)
	if err != nil {
		return netip.Addr{}, netip.Addr{}, fmt.Errorf("%w: ip-range %q: %v", pool.ErrInvalid, subPool, err)
	}
	sp = sp.Masked()
	if sp.Addr().Is4() != subnet.Addr().Is4() || sp.Bits() < subnet.Bits() || !subnet.Contains(sp.Addr()) {
		return netip.Addr{}, netip.Addr{}, fmt.Errorf("%w: ip-range %s is not inside subnet %s", pool.ErrInvalid, sp, subnet)
	}
	start, end = sp.Addr(), pool.LastAddr(sp)
	if start.Compare(first) < 0 {
		start = first
	}
	if end.Compare(last) > 0 {
		end = last
	}
	if start.Compare(end) > 0 {
		return netip.Addr{}, netip.Addr{}, fmt.Errorf("%w: ip-range %s holds no usable address of subnet %s", pool.ErrInvalid, sp, subnet)
	}
	return start, end, nil
}
