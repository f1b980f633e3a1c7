package ipamring

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"

	current "github.com/containernetworking/cni/pkg/types/100"

	"github.com/ringipam/ringipam/pkg/pool"
)

// Allocator is what the verbs need from a pool allocator (*pool.Allocator
// implements it).
type Allocator interface {
	Define(ctx context.Context, defs ...pool.Def) error
	Definition(ctx context.Context, name string) (pool.Def, error)
	Allocate(ctx context.Context, req pool.Request) (pool.Allocation, error)
	Release(ctx context.Context, owner pool.Owner) (pool.Allocation, bool, error)
	Lookup(ctx context.Context, owner pool.Owner) (pool.Allocation, bool, error)
	GC(ctx context.Context, network string, valid []pool.Owner) ([]pool.Allocation, error)
	Usage(ctx context.Context, name string) (pool.Usage, error)
}

// Attachment names one CNI attachment: the container ID and interface name
// of the invocation (the network comes from the configuration).
type Attachment struct {
	ContainerID string
	IfName      string
}

// Owner is the pool owner of attachment at on c's network.
func (c *Config) Owner(at Attachment) pool.Owner {
	return pool.Owner{Network: c.Network, ContainerID: at.ContainerID, IfName: at.IfName}
}

// Defs returns the pool definitions of every range set, in order.
func (c *Config) Defs() []pool.Def {
	defs := make([]pool.Def, len(c.RangeSets))
	for i, rs := range c.RangeSets {
		defs[i] = rs.Def
	}
	return defs
}

// plan turns a configuration into pool wants and an allocation back into
// CNI IP configurations. Each gateway mode is one plan; Load only lets
// through the modes that have one.
type plan interface {
	wants(c *Config) []pool.Want
	ips(c *Config, a pool.Allocation) ([]*current.IPConfig, error)
}

func planFor(m GatewayMode) (plan, error) {
	switch m {
	case GatewayShared, "":
		return sharedPlan{}, nil
	}
	return nil, fmt.Errorf("%w: gatewayMode %q is %w", ErrBadConfig, m, ErrNotSupported)
}

// sharedPlan: one address per range set, the range's gateway shared by
// every container of the subnet.
type sharedPlan struct{}

func (sharedPlan) wants(c *Config) []pool.Want {
	w := make([]pool.Want, len(c.RangeSets))
	for i, rs := range c.RangeSets {
		w[i] = pool.Want{Pool: rs.Def.Name, Role: pool.RoleIP, Addr: rs.Static}
	}
	return w
}

func (sharedPlan) ips(c *Config, a pool.Allocation) ([]*current.IPConfig, error) {
	var out []*current.IPConfig
	for _, rs := range c.RangeSets {
		addr, ok := a.Addr(rs.Def.Name, pool.RoleIP)
		if !ok {
			return nil, fmt.Errorf("allocation of %s holds no address in pool %s", a.Owner, rs.Def.Name)
		}
		i := slices.IndexFunc(rs.Def.Ranges, func(r pool.Range) bool { return r.Subnet.Contains(addr) })
		if i < 0 {
			return nil, fmt.Errorf("address %s of %s is outside pool %s", addr, a.Owner, rs.Def.Name)
		}
		r := rs.Def.Ranges[i]
		ipc := &current.IPConfig{Address: net.IPNet{
			IP:   net.IP(addr.AsSlice()),
			Mask: net.CIDRMask(r.Subnet.Bits(), addr.BitLen()),
		}}
		if r.Gateway.IsValid() {
			ipc.Gateway = net.IP(r.Gateway.AsSlice())
		}
		out = append(out, ipc)
	}
	return out, nil
}

// Add allocates (or returns the already held) addresses of attachment at
// and builds the CNI result. It records the pool definitions on first use
// and fails with pool.ErrDefinitionMismatch when the store holds others.
func Add(ctx context.Context, a Allocator, c *Config, at Attachment) (*current.Result, error) {
	p, err := planFor(c.GatewayMode)
	if err != nil {
		return nil, err
	}
	if err := a.Define(ctx, c.Defs()...); err != nil {
		return nil, fmt.Errorf("recording pool definitions: %w", err)
	}
	alloc, err := a.Allocate(ctx, pool.Request{Owner: c.Owner(at), Reservation: c.Reservation, Wants: p.wants(c)})
	if err != nil {
		return nil, fmt.Errorf("allocating for %s: %w", c.Owner(at), err)
	}
	ips, err := p.ips(c, alloc)
	if err != nil {
		return nil, err
	}
	return &current.Result{
		CNIVersion: current.ImplementedSpecVersion,
		IPs:        ips,
		Routes:     c.Routes,
		DNS:        c.DNS,
	}, nil
}

// Del releases everything attachment at holds on c's network. It succeeds
// when nothing is held.
func Del(ctx context.Context, a Allocator, c *Config, at Attachment) error {
	if _, _, err := a.Release(ctx, c.Owner(at)); err != nil {
		return fmt.Errorf("releasing %s: %w", c.Owner(at), err)
	}
	return nil
}

// Check verifies that attachment at still holds what the configuration asks
// for and what prevResult (if any) says it got.
func Check(ctx context.Context, a Allocator, c *Config, at Attachment) error {
	p, err := planFor(c.GatewayMode)
	if err != nil {
		return err
	}
	owner := c.Owner(at)
	alloc, ok, err := a.Lookup(ctx, owner)
	if err != nil {
		return fmt.Errorf("looking up %s: %w", owner, err)
	}
	if !ok {
		return fmt.Errorf("%w: %s holds no address on this network", ErrCheckFailed, owner)
	}
	want, err := p.ips(c, alloc)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrCheckFailed, err)
	}
	for _, rs := range c.RangeSets {
		if held, _ := alloc.Addr(rs.Def.Name, pool.RoleIP); rs.Static.IsValid() && held != rs.Static {
			return fmt.Errorf("%w: %s holds %s in pool %s but %s is requested", ErrCheckFailed, owner, held, rs.Def.Name, rs.Static)
		}
	}
	if c.PrevResult == nil {
		return nil
	}
	inPools := func(x netip.Addr) bool {
		return slices.ContainsFunc(c.RangeSets, func(rs RangeSet) bool {
			return slices.ContainsFunc(rs.Def.Ranges, func(r pool.Range) bool { return r.Subnet.Contains(x) })
		})
	}
	var got []string
	for _, ipc := range c.PrevResult.IPs {
		x, ok := netip.AddrFromSlice(ipc.Address.IP)
		if ok && inPools(x.Unmap()) {
			got = append(got, ipc.Address.String())
		}
	}
	var held []string
	for _, ipc := range want {
		held = append(held, ipc.Address.String())
	}
	slices.Sort(got)
	slices.Sort(held)
	if !slices.Equal(got, held) {
		return fmt.Errorf("%w: %s holds %v but prevResult says %v", ErrCheckFailed, owner, held, got)
	}
	return nil
}

// GC releases this host's allocations on c's network whose attachment is
// not in c.Valid. Without a list (c.HasValid false) it releases nothing.
// It returns what it released.
func GC(ctx context.Context, a Allocator, c *Config) ([]pool.Allocation, error) {
	if !c.HasValid {
		return nil, nil
	}
	valid := make([]pool.Owner, 0, len(c.Valid))
	for _, v := range c.Valid {
		valid = append(valid, pool.Owner{Network: c.Network, ContainerID: v.ContainerID, IfName: v.IfName})
	}
	released, err := a.GC(ctx, c.Network, valid)
	if err != nil {
		return released, fmt.Errorf("garbage-collecting network %s: %w", c.Network, err)
	}
	return released, nil
}

// Status reports whether an ADD could be served now: the store answers,
// every pool is either not yet recorded or recorded as configured, and every
// pool has a free address. Its errors are mapped to code 50 by CmdStatus.
func Status(ctx context.Context, a Allocator, c *Config) error {
	var errs []error
	for _, rs := range c.RangeSets {
		rec, err := a.Definition(ctx, rs.Def.Name)
		if errors.Is(err, pool.ErrUnknownPool) {
			continue // recorded by the first ADD
		}
		if err != nil {
			return fmt.Errorf("reading pool %s: %w", rs.Def.Name, err)
		}
		got, _ := json.Marshal(rec)
		want, _ := json.Marshal(rs.Def)
		if string(got) != string(want) {
			errs = append(errs, fmt.Errorf("%w: pool %s is recorded as %s but this host is configured with %s", pool.ErrDefinitionMismatch, rs.Def.Name, got, want))
			continue
		}
		u, err := a.Usage(ctx, rs.Def.Name)
		if err != nil {
			return fmt.Errorf("reading usage of pool %s: %w", rs.Def.Name, err)
		}
		if !u.Free {
			errs = append(errs, &pool.CapacityError{Pool: rs.Def.Name, Used: u.Used, Capacity: u.Capacity})
		}
	}
	return errors.Join(errs...)
}
