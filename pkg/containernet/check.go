package containernet

import (
	"errors"
	"fmt"
	"strings"

	"github.com/ringipam/ringipam/pkg/pool"
)

// Violation is one broken invariant found by CheckNet. It wraps ErrViolation.
type Violation struct {
	Invariant string       // CNetValid, CNetPairValid, ContainerNet, AddrsDistinct, Decode
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
			add("Decode", c.Problem, c.Owner)
		}
		if _, err := c.Net(); err != nil {
			add("ContainerNet", err.Error(), c.Owner)
		}
		pooled := cnetPooled(s, c)
		subnet := cnetSubnet(s, c)
		if pooled != "" && subnet != "" {
			add("CNetValid", "neither CNetPooled ("+pooled+") nor CNetSubnet ("+subnet+")", c.Owner)
		}
	}
	for i, c1 := range s.Containers {
		for _, c2 := range s.Containers[i+1:] {
			pair := []pool.Owner{c1.Owner, c2.Owner}
			if c1.IP == c2.IP {
				add("CNetPairValid", fmt.Sprintf("both have ip %s", c1.IP), pair...)
			}
			if c1.GW == c2.GW {
				add("CNetPairValid", fmt.Sprintf("both have gateway %s", c1.GW), pair...)
			}
			if c1.Subnet != c2.Subnet && c1.Subnet.Overlaps(c2.Subnet) {
				add("CNetPairValid", fmt.Sprintf("subnets %s and %s overlap without being equal", c1.Subnet, c2.Subnet), pair...)
			}
			if c1.IP.IsValid() && c1.IP == c2.GW || c2.IP.IsValid() && c2.IP == c1.GW {
				add("AddrsDistinct", "one's ip is the other's gateway", pair...)
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
