// This file: the range sets of a configuration, their pools and exclusions.

package ipam

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net/netip"
	"strings"

	"github.com/ringipam/ringipam/pkg/pool"
)

// loadRangeSets builds one pool definition per range set: the "ipRanges"
// capability's sets first (as host-local does), then the configured
// "ranges" (after host-local's legacy single range, if any).
func (c *Config) loadRangeSets(n *netJSON, im *ipamJSON) error {
	configured := im.Ranges
	if im.Subnet != "" {
		legacy := []rangeJSON{{Subnet: im.Subnet, RangeStart: im.RangeStart, RangeEnd: im.RangeEnd, Gateway: im.Gateway}}
		configured = append([][]rangeJSON{legacy}, configured...)
	}
	if len(im.Pools) > 0 && len(im.Pools) != len(configured) {
		return badConfig("\"pools\" names %d pools but there are %d range sets", len(im.Pools), len(configured))
	}
	var excl []netip.Prefix
	for _, e := range im.Exclude {
		p, err := parsePrefixOrAddr(e)
		if err != nil {
			return badConfig("exclude %q: %v", e, err)
		}
		excl = append(excl, p)
	}
	for i, rs := range n.RuntimeConfig.IPRanges {
		def, err := buildDef("", rs, excl)
		if err != nil {
			return badConfig("runtimeConfig ipRanges[%d]: %v", i, err)
		}
		// Runtime ranges are usually per node (a node's pod CIDR): name the
		// pool after its content so different nodes get different pools.
		def.Name = c.Network + "-rt-" + defHash(def)
		if def, err = def.Normalize(); err != nil {
			return badConfig("runtimeConfig ipRanges[%d]: %v", i, err)
		}
		c.RangeSets = append(c.RangeSets, RangeSet{Def: def, FromRuntime: true})
	}
	for i, rs := range configured {
		name := fmt.Sprintf("%s-%d", c.Network, i)
		if len(im.Pools) > 0 {
			name = im.Pools[i]
		}
		def, err := buildDef(name, rs, excl)
		if err != nil {
			return badConfig("ranges[%d]: %v", i, err)
		}
		if def, err = def.Normalize(); err != nil {
			return badConfig("ranges[%d]: %v", i, err)
		}
		c.RangeSets = append(c.RangeSets, RangeSet{Def: def})
	}
	for i := range c.RangeSets {
		c.RangeSets[i].Def.Isolated = im.Isolated
	}
	if len(c.RangeSets) == 0 {
		return badConfig("no IP ranges specified (\"ranges\" is empty)")
	}
	seen := map[string]bool{}
	for i, a := range c.RangeSets {
		if seen[a.Def.Name] {
			return badConfig("pool name %q is used by two range sets", a.Def.Name)
		}
		seen[a.Def.Name] = true
		for _, b := range c.RangeSets[i+1:] {
			for _, ra := range a.Def.Ranges {
				for _, rb := range b.Def.Ranges {
					if ra.Subnet.Overlaps(rb.Subnet) {
						return badConfig("range sets of pools %s and %s overlap (%s, %s)", a.Def.Name, b.Def.Name, ra.Subnet, rb.Subnet)
					}
				}
			}
		}
	}
	return nil
}

// buildDef turns one range set into a pool definition, defaulting each
// range's gateway to the subnet's first usable address like host-local.
// Exclusions of the set's family go into the definition.
func buildDef(name string, rs []rangeJSON, excl []netip.Prefix) (pool.Def, error) {
	if len(rs) == 0 {
		return pool.Def{}, errors.New("empty range set")
	}
	def := pool.Def{Name: name}
	for j, r := range rs {
		var pr pool.Range
		sub, err := netip.ParsePrefix(r.Subnet)
		if err != nil {
			return pool.Def{}, fmt.Errorf("range %d: subnet %q: %v", j, r.Subnet, err)
		}
		pr.Subnet = sub.Masked()
		pr.Static = r.Static
		for _, f := range []struct {
			key string
			s   string
			dst *netip.Addr
		}{{"rangeStart", r.RangeStart, &pr.Start}, {"rangeEnd", r.RangeEnd, &pr.End}, {"gateway", r.Gateway, &pr.Gateway}} {
			if f.s == "" {
				continue
			}
			a, err := netip.ParseAddr(f.s)
			if err != nil {
				return pool.Def{}, fmt.Errorf("range %d: %s %q: %v", j, f.key, f.s, err)
			}
			*f.dst = a.Unmap()
		}
		if !pr.Gateway.IsValid() {
			pr.Gateway, _ = pool.DefaultGateway(pr.Subnet)
		}
		def.Ranges = append(def.Ranges, pr)
	}
	is4 := def.Ranges[0].Subnet.Addr().Is4()
	for _, p := range excl {
		if p.Addr().Is4() == is4 {
			def.Exclude = append(def.Exclude, p)
		}
	}
	return def, nil
}

func defHash(d pool.Def) string {
	b := pool.RangesJSON(d.Ranges)
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:6])
}

func parsePrefixOrAddr(s string) (netip.Prefix, error) {
	if strings.Contains(s, "/") {
		p, err := netip.ParsePrefix(s)
		if err != nil {
			return netip.Prefix{}, err
		}
		return p.Masked(), nil
	}
	a, err := netip.ParseAddr(s)
	if err != nil {
		return netip.Prefix{}, err
	}
	a = a.Unmap()
	return netip.PrefixFrom(a, a.BitLen()), nil
}

// parseAddrMaybeCIDR accepts "198.18.0.5" or "198.18.0.5/24" (the prefix is
// ignored: the range set decides the subnet).
func parseAddrMaybeCIDR(s string) (netip.Addr, error) {
	if i := strings.IndexByte(s, '/'); i >= 0 {
		p, err := netip.ParsePrefix(s)
		if err != nil {
			return netip.Addr{}, err
		}
		return p.Addr().Unmap(), nil
	}
	a, err := netip.ParseAddr(s)
	return a.Unmap(), err
}
