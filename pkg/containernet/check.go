package containernet

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/ringipam/ringipam/pkg/pool"
)

// The invariants CheckNet checks (Violation.Invariant): the seed's names,
// and two of this package.
const (
	InvContainerNet  = "ContainerNet"  // ip ∈ subnet, ip ≠ gw, gw ∉ subnet
	InvCNetValid     = "CNetValid"     // CNetPooled ∨ CNetSubnet
	InvCNetPairValid = "CNetPairValid" // distinct ips and gateways; subnets equal or disjoint
	InvAddrsDistinct = "AddrsDistinct" // no container's gateway is another's ip
	InvDecode        = "Decode"        // the owner's addresses make one container network
)

// Violation is one broken invariant found by CheckNet. It wraps ErrViolation.
type Violation struct {
	Invariant string       // one of the Inv* constants
	Owners    []pool.Owner // the container, or the pair
	Detail    string
}

func (v *Violation) Error() string {
	names := make([]string, len(v.Owners))
	for i, o := range v.Owners {
		names[i] = o.String()
	}
	return fmt.Sprintf("%s violated by %s: %s", v.Invariant, strings.Join(names, " and "), v.Detail)
}

// Unwrap makes errors.Is(err, ErrViolation) hold.
func (v *Violation) Unwrap() error { return ErrViolation }

// maxViolations bounds how many violations one CheckNet reports.
const maxViolations = 32

// CheckNet checks the seed's Net schema over s and returns nil, or the
// violations found (at most 32, joined; each a *Violation wrapping
// ErrViolation):
//
//   - ContainerNet for every container: ip ∈ subnet, ip ≠ gw, gw ∉ subnet;
//   - CNetValid for every container: CNetPooled (ip ∈ pool, subnet = {ip},
//     gw ∈ alloc; and, stronger than the seed, ip ∈ alloc) or CNetSubnet
//     (subnet ∩ pool = ∅, gw ∈ alloc);
//   - CNetPairValid for every pair: ip₁ ≠ ip₂, gw₁ ≠ gw₂, and subnet₁ =
//     subnet₂ or subnet₁ ∩ subnet₂ = ∅;
//   - AddrsDistinct for every pair, which the seed leaves implicit: no
//     container's gateway is another's ip.
func CheckNet(s State) error {
	var errs []error
	add := func(inv, detail string, owners ...pool.Owner) {
		if len(errs) < maxViolations {
			errs = append(errs, &Violation{Invariant: inv, Owners: owners, Detail: detail})
		}
	}
	for _, c := range s.Containers {
		if c.Problem != "" {
			add(InvDecode, c.Problem, c.Owner)
		}
		if _, err := c.Net(); err != nil {
			add(InvContainerNet, err.Error(), c.Owner)
		}
		pooled := cnetPooled(s, c)
		subnet := cnetSubnet(s, c)
		if pooled != "" && subnet != "" {
			add(InvCNetValid, "neither CNetPooled ("+pooled+") nor CNetSubnet ("+subnet+")", c.Owner)
		}
	}
	for i, c1 := range s.Containers {
		for _, c2 := range s.Containers[i+1:] {
			pair := []pool.Owner{c1.Owner, c2.Owner}
			if c1.IP == c2.IP {
				add(InvCNetPairValid, fmt.Sprintf("both have ip %s", c1.IP), pair...)
			}
			if c1.GW == c2.GW {
				add(InvCNetPairValid, fmt.Sprintf("both have gateway %s", c1.GW), pair...)
			}
			if c1.Subnet != c2.Subnet && c1.Subnet.Overlaps(c2.Subnet) {
				add(InvCNetPairValid, fmt.Sprintf("subnets %s and %s overlap without being equal", c1.Subnet, c2.Subnet), pair...)
			}
			if c1.IP.IsValid() && c1.IP == c2.GW || c2.IP.IsValid() && c2.IP == c1.GW {
				add(InvAddrsDistinct, "one's ip is the other's gateway", pair...)
			}
		}
	}
	return errors.Join(errs...)
}

// cnetPooled returns "" when CNetPooled holds for c, else why not.
func cnetPooled(s State, c Record) string {
	switch {
	case !s.Pool.Contains(c.IP):
		return fmt.Sprintf("ip %v is not in pool %s", c.IP, s.Pool.Name)
	case !c.IP.IsValid() || c.Subnet != HostPrefix(c.IP):
		return fmt.Sprintf("subnet %v is not {%v}", c.Subnet, c.IP)
	case !s.Alloc[c.GW]:
		return fmt.Sprintf("gateway %v is not allocated in pool %s", c.GW, s.Pool.Name)
	case !s.Alloc[c.IP]:
		return fmt.Sprintf("ip %v is not allocated in pool %s", c.IP, s.Pool.Name)
	}
	return ""
}

// cnetSubnet returns "" when CNetSubnet holds for c, else why not.
func cnetSubnet(s State, c Record) string {
	switch {
	case !c.Subnet.IsValid():
		return "no subnet"
	case overlapsPool(s.Pool, c.Subnet):
		return fmt.Sprintf("subnet %v overlaps pool %s", c.Subnet, s.Pool.Name)
	case !s.Alloc[c.GW]:
		return fmt.Sprintf("gateway %v is not allocated in pool %s", c.GW, s.Pool.Name)
	}
	return ""
}

// PoolViolation is a violation CheckStore found in one main pool.
type PoolViolation struct {
	Pool string // the main pool
	*Violation
}

// CheckStore applies CheckNet to every main pool of a whole store, given
// every pool definition (special subnet pools included) and every owner
// record it holds (pool.Allocator.Records), and returns the violations
// found, main pool by main pool (at most 32 each). A main pool is one this
// package creates container networks in: a pool that is not a special
// subnet pool, in which an owner holds a gateway (pool.RoleGateway) or
// which has a special subnet pool. Pools of the shared-gateway mode hold
// no gateway and are not container networks of the seed: they are left
// alone. As for Check, every owner holding an address of a main pool is a
// container of it.
func CheckStore(defs []pool.Def, allocs []pool.Allocation) []PoolViolation {
	byName := map[string]pool.Def{}
	main := map[string]bool{}
	for _, d := range defs {
		byName[d.Name] = d
		if m, _, ok := strings.Cut(d.Name, specialInfix); ok {
			main[m] = true
		}
	}
	for _, a := range allocs {
		for _, x := range a.Addrs {
			if x.Role == pool.RoleGateway {
				main[x.Pool] = true
			}
		}
	}
	subnetOf := func(name string) (netip.Prefix, bool) {
		d, ok := byName[name]
		if !ok || len(d.Ranges) != 1 {
			return netip.Prefix{}, false
		}
		return d.Ranges[0].Subnet, true
	}
	var names []string
	for name := range main {
		if _, ok := byName[name]; ok && !strings.Contains(name, specialInfix) {
			names = append(names, name)
		}
	}
	slices.Sort(names)
	var out []PoolViolation
	for _, name := range names {
		err := CheckNet(StateOf(byName[name], allocs, subnetOf))
		if err == nil {
			continue
		}
		errs := []error{err}
		if j, ok := err.(interface{ Unwrap() []error }); ok {
			errs = j.Unwrap()
		}
		for _, e := range errs {
			var v *Violation
			if errors.As(e, &v) {
				out = append(out, PoolViolation{Pool: name, Violation: v})
			}
		}
	}
	return out
}
