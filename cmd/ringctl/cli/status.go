package cli

import (
	"context"
	"math/big"
	"net/netip"
	"slices"
	"time"

	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/routes"
)

// Status is the store at a glance: pools, hosts and each pool's ring.
type Status struct {
	Store string       `json:"store"`
	Time  time.Time    `json:"time"`
	Pools []PoolStatus `json:"pools"`
	Hosts []HostStatus `json:"hosts"`
}

// PoolStatus is one pool's fill and ring.
type PoolStatus struct {
	Name     string `json:"name"`
	Family   string `json:"family"` // IPv4 or IPv6
	Isolated bool   `json:"isolated,omitempty"`
	// Size is how many addresses the pool hands out (decimal: an IPv6 pool
	// may exceed 64 bits).
	Size string `json:"size"`
	// Used counts addresses owners hold; Held those kept for released
	// reservations whose hold has not ended; Free the rest.
	Used uint64 `json:"used"`
	Held uint64 `json:"held"`
	Free string `json:"free"`
	// EndedHolds are holds whose time has ended (free to allocate; gc
	// removes their keys).
	EndedHolds uint64        `json:"endedHolds,omitempty"`
	Ranges     []RangeStatus `json:"ranges"`
}

// RangeStatus is one range of a pool's ring.
type RangeStatus struct {
	Start     netip.Addr `json:"start"`
	End       netip.Addr `json:"end"`
	Host      string     `json:"host,omitempty"` // "" when unowned
	Tombstone bool       `json:"tombstone,omitempty"`
	Size      string     `json:"size"` // addresses in [Start, End], decimal
	Used      uint64     `json:"used"` // addresses held in it by owners
}

// HostStatus is one host as the cluster sees it.
type HostStatus struct {
	Name       string    `json:"name"`
	State      string    `json:"state"` // up, down, orphaned
	Agent      bool      `json:"agent"`
	Addr       string    `json:"addr,omitempty"`
	LastSeen   time.Time `json:"lastSeen,omitzero"`
	OrphanedAt time.Time `json:"orphanedAt,omitzero"`
	Ranges     int       `json:"ranges"` // live ranges, all pools
	Used       uint64    `json:"used"`   // addresses its owners hold, all pools
	Pools      []string  `json:"pools,omitempty"`
	// KubeNode: the host is a Kubernetes node (its agent runs with
	// Kubernetes on); the deletion of its Node object reclaims it.
	KubeNode bool `json:"kubeNode,omitempty"`
	// Routes is what its agent reported of the routes it holds
	// (ringipamd --routes); nil when it reported none.
	Routes *HostRoutes `json:"routes,omitempty"`
}

// HostRoutes is a host agent's routes to other hosts' ranges as it last
// reported them (pool.RoutesSummary), compared with the plan ringctl makes
// from the ring with the same planner (package routes) and the on-link
// prefixes the agent reported.
type HostRoutes struct {
	Held     int       `json:"held"`
	Failed   int       `json:"failed,omitempty"`
	Refused  int       `json:"refused,omitempty"`
	Digest   string    `json:"digest"`
	Reported time.Time `json:"reported,omitzero"`
	// Matches: the agent installed every route of the plan the ring
	// makes for it now (same digest, none failed).
	Matches bool `json:"matches"`
	// Ring is the plan the ring makes for the host now: the routes it
	// holds when Matches.
	Ring []routes.Route `json:"ring"`
}

// Status reads every pool (or only poolName) and host.
func (c *Ctl) Status(ctx context.Context, poolName string) (Status, error) {
	s := Status{Store: c.StoreDesc, Time: c.now()}
	defs, err := c.Pool.Pools(ctx)
	if err != nil {
		return s, err
	}
	found := false
	var planPools []routes.Pool // every pool: routes are planned over all of them
	for _, d := range defs {
		ring, err := c.Pool.RingOf(ctx, d.Name)
		if err != nil {
			return s, err
		}
		planPools = append(planPools, routes.Pool{Def: d, Ring: ring})
		if poolName != "" && d.Name != poolName {
			continue
		}
		found = true
		ps, err := c.poolStatus(ctx, d)
		if err != nil {
			return s, err
		}
		s.Pools = append(s.Pools, ps)
	}
	if poolName != "" && !found {
		return s, notFoundf("pool %s is not recorded in this store", poolName)
	}
	hosts, err := c.Pool.Hosts(ctx, c.OrphanAfter)
	if err != nil {
		return s, err
	}
	for _, h := range hosts {
		s.Hosts = append(s.Hosts, HostStatus{
			Name: h.Name, State: string(h.State), Agent: h.Agent, Addr: h.Addr,
			LastSeen: h.LastSeen, OrphanedAt: h.OrphanedAt, Ranges: h.Ranges, Used: h.Used, Pools: h.Pools,
			KubeNode: h.KubeNode, Routes: hostRoutes(h, planPools, hosts),
		})
	}
	return s, nil
}

// hostRoutes compares what h's agent reported of its routes with the plan
// the ring makes for h; nil when it reported none.
func hostRoutes(h pool.HostInfo, pools []routes.Pool, hosts []pool.HostInfo) *HostRoutes {
	r := h.Routes
	if r == nil {
		return nil
	}
	plan := routes.Plan(routes.Input{Self: h.Name, Pools: pools, Hosts: routes.HostsFrom(hosts), OnLink: r.OnLink})
	return &HostRoutes{
		Held: r.Held, Failed: r.Failed, Refused: r.Refused, Digest: r.Digest, Reported: time.Unix(r.At, 0),
		Matches: r.Failed == 0 && r.Digest == routes.Digest(plan.Routes), Ring: plan.Routes,
	}
}

func (c *Ctl) poolStatus(ctx context.Context, d pool.Def) (PoolStatus, error) {
	ps := PoolStatus{Name: d.Name, Family: "IPv6", Isolated: d.Isolated, Size: d.Capacity()}
	if d.Ranges[0].Subnet.Addr().Is4() {
		ps.Family = "IPv4"
	}
	r, err := c.Pool.RingOf(ctx, d.Name)
	if err != nil {
		return ps, err
	}
	held, err := c.Pool.Held(ctx, d.Name)
	if err != nil {
		return ps, err
	}
	now := c.now()
	for _, x := range r.Ranges {
		ps.Ranges = append(ps.Ranges, RangeStatus{Start: x.Start, End: x.End, Host: x.Host, Tombstone: x.Tombstone, Size: spanSize(x.Start, x.End).String()})
	}
	for _, h := range held {
		switch {
		case h.Hold == nil:
			ps.Used++
			i := slices.IndexFunc(ps.Ranges, func(x RangeStatus) bool {
				return x.Start.Compare(h.Addr) <= 0 && h.Addr.Compare(x.End) <= 0
			})
			if i >= 0 {
				ps.Ranges[i].Used++
			}
		case now.Before(h.Hold.Until):
			ps.Held++
		default:
			ps.EndedHolds++
		}
	}
	free, _ := new(big.Int).SetString(ps.Size, 10)
	free.Sub(free, new(big.Int).SetUint64(ps.Used+ps.Held))
	if free.Sign() < 0 {
		free.SetInt64(0)
	}
	ps.Free = free.String()
	return ps, nil
}

// spanSize is the number of addresses in [lo, hi].
func spanSize(lo, hi netip.Addr) *big.Int {
	a := new(big.Int).SetBytes(lo.AsSlice())
	b := new(big.Int).SetBytes(hi.AsSlice())
	return b.Sub(b, a).Add(b, big.NewInt(1))
}

// ringBar draws ranges as width characters: one letter per host (upper
// case; lower case for its tombstoned ranges), '.' for unowned space. Each
// range gets at least one character when there are no more ranges than
// characters; the rest is shared in proportion to size.
func ringBar(ranges []RangeStatus, letter func(host string) byte, width int) string {
	if len(ranges) == 0 || width <= 0 {
		return ""
	}
	sizes := make([]*big.Int, len(ranges))
	total := new(big.Int)
	for i, r := range ranges {
		sizes[i], _ = new(big.Int).SetString(r.Size, 10)
		if sizes[i] == nil {
			sizes[i] = new(big.Int)
		}
		total.Add(total, sizes[i])
	}
	base := 0
	if len(ranges) <= width {
		base = 1
	}
	spare := int64(width - base*len(ranges))
	widths := make([]int, len(ranges))
	cum := new(big.Int)
	prev := int64(0)
	for i := range ranges {
		cum.Add(cum, sizes[i])
		// round(cum * spare / total)
		x := new(big.Int).Mul(cum, big.NewInt(2*spare))
		x.Add(x, total)
		x.Div(x, new(big.Int).Mul(total, big.NewInt(2)))
		n := x.Int64()
		widths[i] = base + int(n-prev)
		prev = n
	}
	out := make([]byte, 0, width)
	for i, r := range ranges {
		ch := byte('.')
		if r.Host != "" {
			ch = letter(r.Host)
			if r.Tombstone && ch >= 'A' && ch <= 'Z' {
				ch += 'a' - 'A'
			}
		}
		for range widths[i] {
			out = append(out, ch)
		}
	}
	return string(out)
}

// hostLetters gives each host a letter, in name order: A..Z, then '+'.
func hostLetters(s Status) map[string]byte {
	var names []string
	seen := map[string]bool{}
	add := func(h string) {
		if h != "" && !seen[h] {
			seen[h] = true
			names = append(names, h)
		}
	}
	for _, h := range s.Hosts {
		add(h.Name)
	}
	for _, p := range s.Pools {
		for _, r := range p.Ranges {
			add(r.Host)
		}
	}
	slices.Sort(names)
	out := map[string]byte{}
	for i, n := range names {
		out[n] = '+'
		if i < 26 {
			out[n] = byte('A' + i)
		}
	}
	return out
}
