// This file: what the runtime adds per invocation: CNI_ARGS, the ips and
// ipRanges capabilities, args.cni.ips, the pod annotation asking for an
// address, and GC's valid attachments.

package ipam

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/ringipam/ringipam/pkg/pool"
)

// IPAnnotation is the pod annotation asking for static addresses, one per
// range set, comma-separated ("198.18.0.9" or "198.18.0.9,2001:db8::9"),
// like CNI_ARGS IP=. Kubernetes runtimes send no "ips" capability, so this
// is how a pod asks for an address; ipam-ring sees it only when the
// conflist's main plugin declares the "io.kubernetes.cri.pod-annotations"
// capability.
const IPAnnotation = "ringipam.io/ip"

// ReservationAnnotation is the pod annotation that, with
// "reservationFromPod": "annotated", makes the pod's namespace/name its
// reservation: "true" for yes. Like IPAnnotation it reaches ipam-ring
// only when the main plugin declares the "io.kubernetes.cri.pod-annotations"
// capability.
const ReservationAnnotation = "ringipam.io/reservation"

// reservationMode is "reservationFromPod": false (off), true (every pod's
// namespace/name is its reservation) or "annotated" (only pods annotated
// ReservationAnnotation: "true", e.g. a StatefulSet's template: pods of
// generated names, a Deployment's, never come back under their name, and
// holding their addresses would only keep them out of use).
type reservationMode string

const (
	reservationOff       reservationMode = ""
	reservationAll       reservationMode = "all"
	reservationAnnotated reservationMode = "annotated"
)

func (m *reservationMode) UnmarshalJSON(b []byte) error {
	var on bool
	if err := json.Unmarshal(b, &on); err == nil {
		*m = reservationOff
		if on {
			*m = reservationAll
		}
		return nil
	}
	var s string
	if err := json.Unmarshal(b, &s); err != nil || s != string(reservationAnnotated) {
		return fmt.Errorf("reservationFromPod is %s: want true, false or \"annotated\"", b)
	}
	*m = reservationAnnotated
	return nil
}

// reserves says whether a pod with these annotations gets its
// namespace/name as its reservation.
func (m reservationMode) reserves(annotations map[string]string) bool {
	switch m {
	case reservationAll:
		return true
	case reservationAnnotated:
		return strings.TrimSpace(annotations[ReservationAnnotation]) == "true"
	}
	return false
}

// loadStatics assigns every requested static address to the one range set
// whose subnets contain it.
func (c *Config) loadStatics(n *netJSON, args cniArgs) error {
	type src struct{ from, s string }
	var all []src
	for _, s := range args.ips {
		all = append(all, src{"CNI_ARGS IP", s})
	}
	if n.Args != nil && n.Args.CNI != nil {
		for _, s := range n.Args.CNI.IPs {
			all = append(all, src{"args.cni.ips", s})
		}
	}
	for _, s := range n.RuntimeConfig.IPs {
		all = append(all, src{"runtimeConfig ips", s})
	}
	for _, s := range strings.Split(n.RuntimeConfig.Annotations[IPAnnotation], ",") {
		if s = strings.TrimSpace(s); s != "" {
			all = append(all, src{"pod annotation " + IPAnnotation, s})
		}
	}
	for _, x := range all {
		a, err := parseAddrMaybeCIDR(strings.TrimSpace(x.s))
		if err != nil {
			return badConfig("%s %q: %v", x.from, x.s, err)
		}
		idx := slices.IndexFunc(c.RangeSets, func(rs RangeSet) bool {
			return rs.Subnet.Contains(a)
		})
		if idx < 0 {
			idx = slices.IndexFunc(c.RangeSets, func(rs RangeSet) bool {
				return slices.ContainsFunc(rs.Def.Ranges, func(r pool.Range) bool { return r.Subnet.Contains(a) })
			})
		}
		if idx < 0 {
			return badConfig("requested IP %s (%s) is not in any configured range or requested SUBNET", a, x.from)
		}
		rs := &c.RangeSets[idx]
		if rs.Static.IsValid() && rs.Static != a {
			return badConfig("two IPs requested in pool %s: %s and %s", rs.Def.Name, rs.Static, a)
		}
		rs.Static = a
	}
	for _, rs := range c.RangeSets {
		if rs.Subnet.IsValid() && !rs.Static.IsValid() {
			return badConfig("CNI_ARGS SUBNET=%s needs the container's ip in it (CNI_ARGS IP=, or the \"ips\" capability)", rs.Subnet)
		}
	}
	return nil
}

// loadSubnets assigns every special subnet of CNI_ARGS SUBNET= to the one
// range set of its family. A special subnet lies outside the pool: it may
// not overlap any configured range.
func (c *Config) loadSubnets(args cniArgs) error {
	if len(args.subnets) > 0 && c.GatewayMode != GatewayPerContainer {
		return badConfig("CNI_ARGS SUBNET= needs gatewayMode \"per-container\" (this network's is %q)", c.GatewayMode)
	}
	for _, s := range args.subnets {
		p, err := netip.ParsePrefix(s)
		if err != nil {
			return badConfig("CNI_ARGS SUBNET %q: %v", s, err)
		}
		if p.Addr().Is4In6() || p.Addr().Zone() != "" {
			return badConfig("CNI_ARGS SUBNET %q: use a plain IPv4 or IPv6 prefix", s)
		}
		p = p.Masked()
		var idx []int
		for i, rs := range c.RangeSets {
			for _, r := range rs.Def.Ranges {
				if r.Subnet.Overlaps(p) {
					return badConfig("CNI_ARGS SUBNET %s overlaps range %s of pool %s; a special subnet must lie outside the pool", p, r.Subnet, rs.Def.Name)
				}
			}
			if rs.Def.Ranges[0].Subnet.Addr().Is4() == p.Addr().Is4() {
				idx = append(idx, i)
			}
		}
		switch {
		case len(idx) == 0:
			return badConfig("CNI_ARGS SUBNET %s: no range set of its address family gives it a gateway", p)
		case len(idx) > 1:
			return badConfig("CNI_ARGS SUBNET %s: several range sets of its address family (pools %s, %s); which one gives the gateway is ambiguous", p, c.RangeSets[idx[0]].Def.Name, c.RangeSets[idx[1]].Def.Name)
		}
		rs := &c.RangeSets[idx[0]]
		if rs.Subnet.IsValid() && rs.Subnet != p {
			return badConfig("CNI_ARGS: two SUBNETs of one address family: %s and %s", rs.Subnet, p)
		}
		rs.Subnet = p
	}
	return nil
}

func (c *Config) loadValid(n *netJSON) error {
	raw := n.Valid
	key := "cni.dev/valid-attachments"
	if len(raw) == 0 || string(raw) == "null" {
		raw, key = n.OldValid, "cni.dev/attachments"
	}
	if len(raw) == 0 || string(raw) == "null" {
		return nil
	}
	if err := json.Unmarshal(raw, &c.Valid); err != nil {
		return badConfig("cannot parse %q: %v", key, err)
	}
	c.HasValid = true
	return nil
}

type cniArgs struct {
	ips                   []string
	subnets               []string
	reservation           string
	podNamespace, podName string
	podUID                string
	ignoreUnknown         bool
}

// parseCNIArgs reads CNI_ARGS ("K=V;K=V"). Known keys: IP (comma-separated
// addresses), SUBNET (comma-separated special subnets), RESERVATION, K8S_POD_NAMESPACE, K8S_POD_NAME, and the other
// K8S_* keys runtimes send. Unknown keys are an error unless
// IgnoreUnknown=1 (or true) is present, as in CNI's CommonArgs.
func parseCNIArgs(s string) (cniArgs, error) {
	var a cniArgs
	if s == "" {
		return a, nil
	}
	var unknown []string
	for _, pair := range strings.Split(s, ";") {
		if pair == "" {
			continue
		}
		k, v, ok := strings.Cut(pair, "=")
		if !ok {
			return a, badConfig("CNI_ARGS: %q is not KEY=VALUE", pair)
		}
		switch k {
		case "IP":
			for _, ip := range strings.Split(v, ",") {
				if ip = strings.TrimSpace(ip); ip != "" {
					a.ips = append(a.ips, ip)
				}
			}
		case "SUBNET":
			for _, sn := range strings.Split(v, ",") {
				if sn = strings.TrimSpace(sn); sn != "" {
					a.subnets = append(a.subnets, sn)
				}
			}
		case "RESERVATION":
			a.reservation = v
		case "K8S_POD_NAMESPACE":
			a.podNamespace = v
		case "K8S_POD_NAME":
			a.podName = v
		case "K8S_POD_UID":
			a.podUID = v
		case "K8S_POD_INFRA_CONTAINER_ID":
		case "IgnoreUnknown":
			a.ignoreUnknown = v == "1" || strings.EqualFold(v, "true")
		default:
			unknown = append(unknown, k)
		}
	}
	if len(unknown) > 0 && !a.ignoreUnknown {
		return a, badConfig("CNI_ARGS: unknown keys %v (add IgnoreUnknown=1 to ignore them)", unknown)
	}
	return a, nil
}
