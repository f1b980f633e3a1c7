package ipam

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"time"

	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"

	"github.com/ringipam/ringipam/pkg/containernet"
	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/store"
)

// Allocator is what the verbs need from a pool allocator (*pool.Allocator
// implements it).
type Allocator interface {
	Define(ctx context.Context, defs ...pool.Def) error
	Definition(ctx context.Context, name string) (pool.Def, error)
	Allocate(ctx context.Context, req pool.Request) (pool.Allocation, error)
	Release(ctx context.Context, owner pool.Owner) (pool.Allocation, bool, error)
	ReleaseWith(ctx context.Context, owner pool.Owner, hint pool.ReleaseHint) (pool.Allocation, bool, error)
	Lookup(ctx context.Context, owner pool.Owner) (pool.Allocation, bool, error)
	List(ctx context.Context, f pool.Filter) ([]pool.Allocation, error)
	GC(ctx context.Context, kind pool.Kind, network string, valid []pool.Owner) ([]pool.Allocation, error)
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
	return pool.Owner{Kind: pool.KindCNI, Network: c.Network, ContainerID: at.ContainerID, IfName: at.IfName}
}

// Defs returns the pool definitions of every range set, in order.
func (c *Config) Defs() []pool.Def {
	defs := make([]pool.Def, len(c.RangeSets))
	for i, rs := range c.RangeSets {
		defs[i] = rs.Def
	}
	return defs
}

// plan is how one gateway mode allocates and reads back an owner's
// addresses. Load only lets through the modes that have one.
type plan interface {
	// add allocates (or returns what owner already holds) and gives the
	// IP configurations of the result, in range set order.
	add(ctx context.Context, a Allocator, c *Config, owner pool.Owner, resv string) ([]*current.IPConfig, error)
	// held returns the IP configurations owner holds, false when it holds
	// nothing, and an error wrapping ErrCheckFailed when what it holds is not
	// what c asks for (static ip, special subnet).
	held(ctx context.Context, a Allocator, c *Config, owner pool.Owner) ([]*current.IPConfig, bool, error)
	// withGateway: CHECK compares gateways too (they are per container).
	withGateway() bool
}

func planFor(m GatewayMode) plan {
	if m == GatewayPerContainer {
		return perContainerPlan{}
	}
	return sharedPlan{}
}

// sharedPlan: one address per range set, the range's gateway shared by
// every container of the subnet.
type sharedPlan struct{}

func (sharedPlan) withGateway() bool { return false }

func (p sharedPlan) add(ctx context.Context, a Allocator, c *Config, owner pool.Owner, resv string) ([]*current.IPConfig, error) {
	w := make([]pool.Want, len(c.RangeSets))
	for i, rs := range c.RangeSets {
		w[i] = pool.Want{Pool: rs.Def.Name, Role: pool.RoleIP, Addr: rs.Static}
	}
	// The definitions ride along: recorded or verified in the
	// allocation's own read and commit, no separate round trip.
	alloc, err := a.Allocate(ctx, pool.Request{Owner: owner, Reservation: resv, Wants: w, Defs: c.Defs(), Pod: c.Pod})
	if err != nil {
		return nil, fmt.Errorf("allocating for %s: %w", owner, err)
	}
	return p.ips(c, alloc)
}

func (p sharedPlan) held(ctx context.Context, a Allocator, c *Config, owner pool.Owner) ([]*current.IPConfig, bool, error) {
	alloc, ok, err := a.Lookup(ctx, owner)
	if err != nil {
		return nil, false, fmt.Errorf("looking up %s: %w", owner, err)
	}
	if !ok {
		return nil, false, nil
	}
	for _, rs := range c.RangeSets {
		if held, _ := alloc.Addr(rs.Def.Name, pool.RoleIP); rs.Static.IsValid() && held != rs.Static {
			return nil, true, fmt.Errorf("%w: %s holds %s in pool %s but %s is requested", ErrCheckFailed, owner, held, rs.Def.Name, rs.Static)
		}
	}
	ips, err := p.ips(c, alloc)
	if err != nil {
		return nil, true, fmt.Errorf("%w: %w", ErrCheckFailed, err)
	}
	return ips, true, nil
}

func (sharedPlan) ips(c *Config, a pool.Allocation) ([]*current.IPConfig, error) {
	var out []*current.IPConfig
	for _, rs := range c.RangeSets {
		addr, ok := a.Addr(rs.Def.Name, pool.RoleIP)
		if !ok {
			return nil, fmt.Errorf("allocation of %s holds no address in pool %s", a.Owner, rs.Def.Name)
		}
		r, ok := rs.Def.RangeFor(addr)
		if !ok {
			return nil, fmt.Errorf("address %s of %s is outside pool %s", addr, a.Owner, rs.Def.Name)
		}
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

// perContainerPlan: per range set one container network of
// pkg/containernet, its gateway allocated from the range set's pool next to
// the ip; all of an owner's networks in one transaction.
type perContainerPlan struct{}

func (perContainerPlan) withGateway() bool { return true }

// specs asks for one container network per range set: from the pool, from
// the pool with the static ip, or in the requested special subnet.
func (perContainerPlan) specs(c *Config) []containernet.Spec {
	out := make([]containernet.Spec, len(c.RangeSets))
	for i, rs := range c.RangeSets {
		out[i] = containernet.Spec{Pool: rs.Def.Name, IP: rs.Static, Subnet: rs.Subnet}
	}
	return out
}

func (p perContainerPlan) add(ctx context.Context, a Allocator, c *Config, owner pool.Owner, resv string) ([]*current.IPConfig, error) {
	if err := a.Define(ctx, c.Defs()...); err != nil {
		return nil, fmt.Errorf("recording pool definitions: %w", err)
	}
	nets, err := containernet.NewManager(a).Create(ctx, containernet.Request{Owner: owner, Reservation: resv, Specs: p.specs(c), Pod: c.Pod})
	if err != nil {
		return nil, fmt.Errorf("creating container network: %w", err)
	}
	out := make([]*current.IPConfig, len(nets))
	for i, n := range nets {
		if out[i], err = p.ipConfig(c, c.RangeSets[i], n); err != nil {
			return nil, err
		}
	}
	return out, nil
}

func (p perContainerPlan) held(ctx context.Context, a Allocator, c *Config, owner pool.Owner) ([]*current.IPConfig, bool, error) {
	m := containernet.NewManager(a)
	var out []*current.IPConfig
	var missing []string
	for _, rs := range c.RangeSets {
		n, ok, err := m.Lookup(ctx, owner, rs.Def.Name)
		if errors.Is(err, containernet.ErrViolation) {
			return nil, true, fmt.Errorf("%w: %w", ErrCheckFailed, err)
		}
		if err != nil {
			return nil, false, fmt.Errorf("looking up %s: %w", owner, err)
		}
		if !ok {
			missing = append(missing, rs.Def.Name)
			continue
		}
		switch {
		case rs.Subnet.IsValid() && n.Subnet() != rs.Subnet:
			return nil, true, fmt.Errorf("%w: %s holds %s in pool %s but special subnet %s is requested", ErrCheckFailed, owner, n, rs.Def.Name, rs.Subnet)
		case !rs.Subnet.IsValid() && !n.Pooled():
			return nil, true, fmt.Errorf("%w: %s holds %s in pool %s but no special subnet is requested", ErrCheckFailed, owner, n, rs.Def.Name)
		case rs.Static.IsValid() && n.IP() != rs.Static:
			return nil, true, fmt.Errorf("%w: %s holds %s in pool %s but %s is requested", ErrCheckFailed, owner, n, rs.Def.Name, rs.Static)
		}
		ipc, err := p.ipConfig(c, rs, n)
		if err != nil {
			return nil, true, fmt.Errorf("%w: %w", ErrCheckFailed, err)
		}
		out = append(out, ipc)
	}
	switch {
	case len(missing) == len(c.RangeSets):
		return nil, false, nil
	case len(missing) > 0:
		return nil, true, fmt.Errorf("%w: %s holds no container network in pools %v", ErrCheckFailed, owner, missing)
	}
	return out, true, nil
}

// ipConfig is container network n of range set rs as a CNI IP
// configuration: the ip with the subnet's length (a special subnet's, or
// for a pooled network the range's or /32 and /128, see PrefixMode) and the
// container's own gateway.
func (perContainerPlan) ipConfig(c *Config, rs RangeSet, n containernet.ContainerNet) (*current.IPConfig, error) {
	prefix := n.Prefix()
	if n.Pooled() && c.PerContainerPrefix != PrefixHost {
		r, ok := rs.Def.RangeFor(n.IP())
		if !ok {
			return nil, fmt.Errorf("address %s is outside pool %s", n.IP(), rs.Def.Name)
		}
		prefix = netip.PrefixFrom(n.IP(), r.Subnet.Bits())
	}
	return &current.IPConfig{
		Address: net.IPNet{IP: net.IP(n.IP().AsSlice()), Mask: net.CIDRMask(prefix.Bits(), n.IP().BitLen())},
		Gateway: n.GatewayIP(),
	}, nil
}

// Add allocates (or returns the already held) addresses of attachment at
// and builds the CNI result. It records the pool definitions on first use
// and fails with pool.ErrDefinitionMismatch when the store holds others.
func Add(ctx context.Context, a Allocator, c *Config, at Attachment) (*current.Result, error) {
	p := planFor(c.GatewayMode)
	ips, err := p.add(ctx, a, c, c.Owner(at), c.Reservation)
	if err != nil {
		return nil, err
	}
	return &current.Result{
		CNIVersion: current.ImplementedSpecVersion,
		IPs:        ips,
		Routes:     c.resultRoutes(ips),
		DNS:        c.DNS,
	}, nil
}

// SubnetViaGatewayMetric is the metric of the subnet routes ipv6ViaGateway
// adds: below 256, the metric of the on-link prefix route the kernel adds
// with an IPv6 address, so the route through the gateway wins. (IPv4 has
// no such choice: its on-link route has metric 0, and IPv4 keeps proxy
// ARP on the bridge.)
const SubnetViaGatewayMetric = 100

// resultRoutes is the configured routes, and with IPv6ViaGateway one route
// per IPv6 address with a gateway: its subnet through the gateway, metric
// SubnetViaGatewayMetric.
func (c *Config) resultRoutes(ips []*current.IPConfig) []*types.Route {
	if !c.IPv6ViaGateway {
		return c.Routes
	}
	out := slices.Clone(c.Routes)
	for _, ipc := range ips {
		if ipc.Address.IP.To4() != nil || ipc.Gateway == nil {
			continue
		}
		subnet := net.IPNet{IP: ipc.Address.IP.Mask(ipc.Address.Mask), Mask: ipc.Address.Mask}
		if ones, bits := subnet.Mask.Size(); ones == bits {
			continue // a /128 has no on-link neighbours
		}
		out = append(out, &types.Route{Dst: subnet, GW: ipc.Gateway, Priority: SubnetViaGatewayMetric})
	}
	return out
}

// Del releases everything attachment at holds on c's network (in
// per-container mode: ip and gateway). It succeeds when nothing is held.
func Del(ctx context.Context, a Allocator, c *Config, at Attachment) error {
	// The configured pools and reservation tell the release which keys to
	// read with the owner record: one read and one commit.
	hint := pool.ReleaseHint{Reservation: c.Reservation}
	for _, d := range c.Defs() {
		hint.Pools = append(hint.Pools, d.Name)
	}
	if _, _, err := a.ReleaseWith(ctx, c.Owner(at), hint); err != nil {
		return fmt.Errorf("releasing %s: %w", c.Owner(at), err)
	}
	return nil
}

// Check verifies that attachment at still holds what the configuration asks
// for and what prevResult (if any) says it got: the addresses, and in
// per-container mode their gateways too.
func Check(ctx context.Context, a Allocator, c *Config, at Attachment) error {
	p := planFor(c.GatewayMode)
	owner := c.Owner(at)
	want, ok, err := p.held(ctx, a, c, owner)
	if err != nil {
		return err
	}
	if !ok {
		return fmt.Errorf("%w: %s holds no address on this network", ErrCheckFailed, owner)
	}
	if c.PrevResult == nil {
		return nil
	}
	// prevResult may carry addresses of other plugins: compare only those
	// in this network's pools or in the subnets it handed out.
	ours := func(x netip.Addr) bool {
		for _, rs := range c.RangeSets {
			if _, in := rs.Def.RangeFor(x); in || rs.Subnet.Contains(x) {
				return true
			}
		}
		return slices.ContainsFunc(want, func(ipc *current.IPConfig) bool {
			return ipc.Address.Contains(net.IP(x.AsSlice()))
		})
	}
	key := func(ipc *current.IPConfig) string {
		if p.withGateway() {
			return ipc.Address.String() + " via " + ipc.Gateway.String()
		}
		return ipc.Address.String()
	}
	var got []string
	for _, ipc := range c.PrevResult.IPs {
		x, ok := netip.AddrFromSlice(ipc.Address.IP)
		if ok && ours(x.Unmap()) {
			got = append(got, key(ipc))
		}
	}
	var held []string
	for _, ipc := range want {
		held = append(held, key(ipc))
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
		// Nothing to release; still a sign of life (see pool.LastSeenEvery).
		if s, ok := a.(interface{ RefreshSeen(context.Context) error }); ok {
			if err := s.RefreshSeen(ctx); err != nil {
				return nil, fmt.Errorf("garbage-collecting network %s: %w", c.Network, err)
			}
		}
		return nil, nil
	}
	valid := make([]pool.Owner, 0, len(c.Valid))
	for _, v := range c.Valid {
		valid = append(valid, pool.Owner{Kind: pool.KindCNI, Network: c.Network, ContainerID: v.ContainerID, IfName: v.IfName})
	}
	released, err := a.GC(ctx, pool.KindCNI, c.Network, valid)
	if err != nil {
		return released, fmt.Errorf("garbage-collecting network %s: %w", c.Network, err)
	}
	return released, nil
}

// Status reports whether an ADD could be served now: the store answers,
// every pool is either not yet recorded or recorded as configured, and every
// pool has a free address. Its errors are mapped to code 50 by CmdStatus.
func Status(ctx context.Context, a Allocator, c *Config) error {
	// Reachability first, through the store's own health check: for etcd
	// over TLS it names the cause (wrong CA, refused client certificate)
	// that a failed read would only report as a timeout.
	if s, ok := a.(interface{ Store() store.Store }); ok {
		if err := store.Ping(ctx, s.Store()); err != nil {
			return fmt.Errorf("store: %w", err)
		}
	}
	// A host that was orphaned while it was away: containers it started
	// before then lost their addresses, which may be in use elsewhere now.
	if o, ok := a.(interface {
		Orphaned(context.Context) (time.Time, error)
	}); ok {
		at, err := o.Orphaned(ctx)
		if err != nil {
			return fmt.Errorf("reading this host's record: %w", err)
		}
		if !at.IsZero() {
			return fmt.Errorf("host %s was orphaned at %s (down longer than orphanAfter): its old containers' addresses were reclaimed and may be in use elsewhere; "+
				"remove those containers, then acknowledge with `ringctl host ack %s` (or restart its ringipamd)", c.Host, at.UTC().Format(time.RFC3339), c.Host)
		}
	}
	var errs []error
	for _, rs := range c.RangeSets {
		rec, err := a.Definition(ctx, rs.Def.Name)
		if errors.Is(err, pool.ErrUnknownPool) {
			continue // recorded by the first ADD
		}
		if err != nil {
			return fmt.Errorf("reading pool %s: %w", rs.Def.Name, err)
		}
		if err := pool.CheckDefinition(rec, rs.Def); err != nil {
			errs = append(errs, err)
			continue
		}
		// What one ADD takes from the pool in this network's mode: the
		// address, and in per-container mode its own gateway too.
		need := uint64(1)
		if c.GatewayMode == GatewayPerContainer {
			need = 2
		}
		// A host whose own ranges have room answers from its own state
		// (pool.Allocator.HasRoom: one read whatever the number of
		// hosts); the pool's usage decides otherwise.
		var u pool.Usage
		room := false
		if r, ok := a.(interface {
			HasRoom(context.Context, string, uint64) (bool, pool.Usage, error)
		}); ok {
			room, u, err = r.HasRoom(ctx, rs.Def.Name, need)
		} else {
			u, err = a.Usage(ctx, rs.Def.Name)
			room = u.Available >= need
		}
		if err != nil {
			return fmt.Errorf("reading usage of pool %s: %w", rs.Def.Name, err)
		}
		if !room {
			errs = append(errs, fmt.Errorf("%w (a %s ADD needs %d)", &pool.CapacityError{Pool: rs.Def.Name, Used: u.Used, Capacity: u.Capacity}, c.GatewayMode, need))
		}
	}
	return errors.Join(errs...)
}
