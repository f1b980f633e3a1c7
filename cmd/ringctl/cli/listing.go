package cli

import (
	"cmp"
	"context"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/portalloc"
)

// LsFilter selects the rows of Ls; empty fields match anything.
type LsFilter struct {
	Pool  string
	Host  string
	Owner *OwnerMatch
	// NoHolds leaves out addresses held for released reservations.
	NoHolds bool
}

// AddrRow is one held address.
type AddrRow struct {
	Addr netip.Addr `json:"addr"`
	Pool string     `json:"pool"`
	Role pool.Role  `json:"role,omitempty"`
	// Owner is set for an owner's address; Kind is the front end (for a
	// hold: the reservation's).
	Owner       *pool.Owner `json:"owner,omitempty"`
	Kind        pool.Kind   `json:"kind"`
	Network     string      `json:"network"`
	Reservation string      `json:"reservation,omitempty"`
	Host        string      `json:"host"`
	// Since is when the holder got the address, from the address's
	// history (zero when the bounded history no longer tells).
	Since time.Time `json:"since,omitzero"`
	// HeldUntil is set for an address kept for a released reservation.
	HeldUntil time.Time `json:"heldUntil,omitzero"`
}

// Ls lists held addresses (owners' and holds), by pool and address.
func (c *Ctl) Ls(ctx context.Context, f LsFilter) ([]AddrRow, error) {
	defs, err := c.Pool.Pools(ctx)
	if err != nil {
		return nil, err
	}
	owners, err := c.Pool.List(ctx, pool.Filter{Pool: f.Pool})
	if err != nil {
		return nil, err
	}
	recs := map[string]pool.Allocation{}
	for _, o := range owners {
		recs[o.Owner.String()] = o
	}
	rows := []AddrRow{}
	found := f.Pool == ""
	for _, d := range defs {
		if f.Pool != "" && d.Name != f.Pool {
			continue
		}
		found = true
		held, err := c.Pool.Held(ctx, d.Name)
		if err != nil {
			return nil, err
		}
		since, err := c.Pool.AllocatedAt(ctx, d.Name)
		if err != nil {
			return nil, err
		}
		for _, h := range held {
			if f.Host != "" && h.Host != f.Host {
				continue
			}
			row := AddrRow{Addr: h.Addr, Pool: h.Pool, Host: h.Host}
			if h.Hold != nil {
				if f.NoHolds || f.Owner != nil && !f.Owner.Matches(pool.Owner{Kind: h.Hold.Kind, Network: h.Hold.Network}) || f.Owner != nil && f.Owner.parts > 1 {
					continue
				}
				row.Kind, row.Network, row.Reservation, row.HeldUntil = h.Hold.Kind, h.Hold.Network, h.Hold.Reservation, h.Hold.Until
				rows = append(rows, row)
				continue
			}
			rec, ok := recs[h.Owner]
			if !ok {
				// No record (check reports it): show the key's holder.
				o, _ := ownerOfString(h.Owner)
				rec = pool.Allocation{Owner: o, Host: h.Host}
			}
			if f.Owner != nil && !f.Owner.Matches(rec.Owner) {
				continue
			}
			o := rec.Owner
			row.Owner, row.Kind, row.Network, row.Reservation = &o, o.Kind, o.Network, rec.Reservation
			for _, x := range rec.Addrs {
				if x.Pool == h.Pool && x.Addr == h.Addr {
					row.Role = x.Role
				}
			}
			if ev, ok := since[h.Addr]; ok && ev.Owner == h.Owner {
				row.Since = ev.Time
			}
			rows = append(rows, row)
		}
	}
	if !found {
		return nil, notFoundf("pool %s is not recorded in this store", f.Pool)
	}
	return rows, nil
}

// ownerOfString parses kind/network/container/if.
func ownerOfString(s string) (pool.Owner, bool) {
	p := strings.Split(s, "/")
	if len(p) != 4 {
		return pool.Owner{ContainerID: s}, false
	}
	return pool.Owner{Kind: pool.Kind(p[0]), Network: p[1], ContainerID: p[2], IfName: p[3]}, true
}

// PortFilter selects the rows of Ports; empty fields match anything.
type PortFilter struct {
	Host  string
	Mode  string // host or ingress
	Owner *OwnerMatch
}

// PortRow is one published port: an ingress port (reachable on every
// host, served by Host) or a host port bound on Host.
type PortRow struct {
	Mode     string     `json:"mode"`
	Protocol string     `json:"protocol"`
	Port     uint16     `json:"port"`
	Host     string     `json:"host"`
	HostIP   netip.Addr `json:"hostIP,omitzero"` // host mode; invalid: every address of the host
	Owner    string     `json:"owner"`           // port/<network>/<container>/<if>
}

// PortsList lists published ports by protocol, number and mode.
func (c *Ctl) PortsList(ctx context.Context, f PortFilter) ([]PortRow, error) {
	pubs, err := c.Ports.List(ctx)
	if err != nil {
		return nil, err
	}
	rows := []PortRow{}
	keep := func(r PortRow) {
		if f.Host != "" && r.Host != f.Host || f.Mode != "" && r.Mode != f.Mode {
			return
		}
		if f.Owner != nil {
			id, ok := portalloc.ParseEndpointID(r.Owner)
			if !ok || !f.Owner.Matches(pool.Owner{Kind: pool.KindPort, Network: id.Network, ContainerID: id.ContainerID, IfName: id.IfName}) {
				return
			}
		}
		rows = append(rows, r)
	}
	for _, p := range pubs {
		if p.State.Ingress != "" {
			keep(PortRow{Mode: string(portalloc.Ingress), Protocol: p.Address.Protocol, Port: p.Address.Number, Host: p.State.IngressHost, Owner: p.State.Ingress})
		}
		for _, h := range p.State.Hosts {
			keep(PortRow{Mode: string(portalloc.Host), Protocol: p.Address.Protocol, Port: p.Address.Number, Host: h.Host, HostIP: h.IP, Owner: h.Endpoint})
		}
	}
	slices.SortStableFunc(rows, func(a, b PortRow) int {
		return cmp.Or(cmp.Compare(a.Protocol, b.Protocol), cmp.Compare(a.Port, b.Port), cmp.Compare(a.Mode, b.Mode), cmp.Compare(a.Host, b.Host))
	})
	return rows, nil
}

// HistoryRow is one event of an address.
type HistoryRow struct {
	Time        time.Time  `json:"time"`
	Pool        string     `json:"pool"`
	Addr        netip.Addr `json:"addr"`
	What        string     `json:"what"` // alloc, release, hold, reclaim
	Owner       string     `json:"owner"`
	Host        string     `json:"host"`
	Reservation string     `json:"reservation,omitempty"`
}

// History returns who held addr and when, oldest first, from the bounded
// history the store keeps per address.
func (c *Ctl) History(ctx context.Context, addr netip.Addr, poolName string) ([]HistoryRow, error) {
	d, err := c.findPool(ctx, addr, poolName)
	if err != nil {
		return nil, err
	}
	evs, err := c.Pool.History(ctx, d.Name, addr)
	if err != nil {
		return nil, err
	}
	rows := []HistoryRow{}
	for _, e := range evs {
		rows = append(rows, HistoryRow{Time: e.Time, Pool: d.Name, Addr: addr, What: e.What, Owner: e.Owner, Host: e.Host, Reservation: e.Reserv})
	}
	return rows, nil
}
