package containernet

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"sync"

	"github.com/ringipam/ringipam/pkg/pool"
)

// Allocator is what a Manager needs of a *pool.Allocator.
type Allocator interface {
	Define(ctx context.Context, defs ...pool.Def) error
	Definition(ctx context.Context, pool string) (pool.Def, error)
	Allocate(ctx context.Context, req pool.Request) (pool.Allocation, error)
	Release(ctx context.Context, owner pool.Owner) (pool.Allocation, bool, error)
	Lookup(ctx context.Context, owner pool.Owner) (pool.Allocation, bool, error)
	List(ctx context.Context, f pool.Filter) ([]pool.Allocation, error)
}

var _ Allocator = (*pool.Allocator)(nil)

// Manager creates, finds, destroys and checks container networks through an
// Allocator. It is safe for concurrent use. The zero value is not usable:
// call NewManager.
type Manager struct {
	a       Allocator
	planner func(pool.Def, Spec, []netip.Prefix) (plan, error) // planCreate; the model check swaps in broken ones
	subnets sync.Map                                           // special subnet pool name -> netip.Prefix (definitions are immutable)
}

// NewManager returns a Manager over a (normally a *pool.Allocator). Main
// pools must be defined (a.Define) before use; special subnet pools are
// defined by Create.
func NewManager(a Allocator) *Manager { return &Manager{a: a, planner: planCreate} }

// Request asks for one owner's container networks, one per Spec, all in one
// transaction (for example an IPv4 and an IPv6 one, each in its own main
// pool). Reservation is passed to the pool (see pool.Request).
type Request struct {
	Owner       pool.Owner
	Reservation string
	Specs       []Spec
	// Pod is passed to the pool (see pool.Request).
	Pod *pool.PodRef
}

// Create creates req's container networks and returns them in the order of
// req.Specs. It is all or nothing: every address is taken in one pool
// transaction. It is idempotent: an owner that already holds a container
// network matching a spec gets it back; one that holds a different one gets
// an error wrapping pool.ErrAlreadyExists (destroy it first). Other errors:
// ErrInvalid (a bad spec), ErrSubnetConflict, and the pool's, wrapped:
// pool.ErrAlreadyInUse (*pool.InUseError; for a special subnet the message
// says the ip is taken in that subnet), pool.ErrNoCapacity, pool.ErrTryAgain,
// pool.ErrUnknownPool (a main pool that was never defined).
func (m *Manager) Create(ctx context.Context, req Request) ([]ContainerNet, error) {
	if err := req.Owner.Validate(); err != nil {
		return nil, err
	}
	if len(req.Specs) == 0 {
		return nil, fmt.Errorf("%w: request for %s has no spec", ErrInvalid, req.Owner)
	}
	defs := make([]pool.Def, len(req.Specs))
	subnets := false
	for i, s := range req.Specs {
		for _, t := range req.Specs[:i] {
			if t.Pool == s.Pool {
				return nil, fmt.Errorf("%w: two specs for pool %s in one request", ErrInvalid, s.Pool)
			}
		}
		d, err := m.a.Definition(ctx, s.Pool)
		if err != nil {
			return nil, fmt.Errorf("container network %s for %s: %w", s, req.Owner, err)
		}
		defs[i] = d
		subnets = subnets || s.Mode() == InSubnet
	}
	existing, found, err := m.a.Lookup(ctx, req.Owner)
	if err != nil {
		return nil, fmt.Errorf("container network for %s: %w", req.Owner, err)
	}
	if found {
		for _, s := range req.Specs {
			if r, ok := recordOf(s.Pool, existing, m.subnetOf(ctx)); ok {
				if _, err := matchExisting(s, r); err != nil {
					return nil, err
				}
			}
		}
	}
	var live map[string][]netip.Prefix
	if subnets {
		allocs, err := m.a.List(ctx, pool.Filter{})
		if err != nil {
			return nil, fmt.Errorf("container network for %s: reading special subnets in use: %w", req.Owner, err)
		}
		live = map[string][]netip.Prefix{}
		for _, s := range req.Specs {
			live[s.Pool] = liveSpecials(recordsOf(s.Pool, allocs, m.subnetOf(ctx)))
		}
	}
	var wants []pool.Want
	var specials []pool.Def
	for i, s := range req.Specs {
		p, err := m.planner(defs[i], s, live[s.Pool])
		if err != nil {
			return nil, fmt.Errorf("container network %s for %s: %w", s, req.Owner, err)
		}
		wants = append(wants, p.wants...)
		if p.special != nil {
			specials = append(specials, *p.special)
		}
	}
	if len(specials) > 0 {
		if err := m.a.Define(ctx, specials...); err != nil {
			var ov *pool.OverlapError
			if errors.As(err, &ov) {
				// The store is one address space: a special subnet
				// overlapping any recorded pool is a subnet conflict.
				return nil, fmt.Errorf("container network for %s: %w: %w", req.Owner, ErrSubnetConflict, err)
			}
			return nil, fmt.Errorf("container network for %s: defining special subnet pool: %w", req.Owner, err)
		}
	}
	alloc, err := m.a.Allocate(ctx, pool.Request{Owner: req.Owner, Reservation: req.Reservation, Wants: wants, Pod: req.Pod})
	if err != nil {
		return nil, m.allocateError(req, err)
	}
	nets := make([]ContainerNet, len(req.Specs))
	for i, s := range req.Specs {
		r, _ := recordOf(s.Pool, alloc, m.subnetOf(ctx))
		if nets[i], err = matchExisting(s, r); err != nil {
			break
		}
	}
	if err == nil && subnets && !found {
		err = m.recheckOverlap(ctx, req, defs)
	}
	if err != nil && !found {
		// A lost overlap race, or a pool breaking its contract: setup is
		// all or nothing.
		if _, _, rerr := m.a.Release(ctx, req.Owner); rerr != nil {
			err = errors.Join(err, fmt.Errorf("releasing %s after the failed create: %w", req.Owner, rerr))
		}
	}
	if err != nil {
		return nil, err
	}
	return nets, nil
}

// recheckOverlap narrows the race that the plan's check of the live special
// subnets cannot close: after the commit it plans again against the live
// containers as they are now (the owner's own excluded), and backs off (the
// caller releases) if a container of another, overlapping special subnet
// appeared meanwhile. Of two racing creators the later one to commit always
// sees the earlier one (the stores read linearizably), so an overlap can
// outlive the race only if a creator dies between its commit and its
// release.
func (m *Manager) recheckOverlap(ctx context.Context, req Request, defs []pool.Def) error {
	allocs, err := m.a.List(ctx, pool.Filter{})
	if err != nil {
		return fmt.Errorf("container network for %s: re-reading special subnets in use: %w", req.Owner, err)
	}
	allocs = slices.DeleteFunc(allocs, func(a pool.Allocation) bool { return a.Owner == req.Owner })
	for i, s := range req.Specs {
		if s.Mode() != InSubnet {
			continue
		}
		if _, err := m.planner(defs[i], s, liveSpecials(recordsOf(s.Pool, allocs, m.subnetOf(ctx)))); err != nil {
			return fmt.Errorf("container network %s for %s, after a concurrent create (try again): %w", s, req.Owner, err)
		}
	}
	return nil
}

// allocateError says which part of a create the pool refused.
func (m *Manager) allocateError(req Request, err error) error {
	var inUse *pool.InUseError
	if errors.As(err, &inUse) {
		for _, s := range req.Specs {
			if s.Mode() == InSubnet && inUse.Pool == SpecialPoolName(s.Pool, s.Subnet) {
				return fmt.Errorf("container network for %s: ip %s is taken in special subnet %s: %w",
					req.Owner, s.IP, s.Subnet.Masked(), err)
			}
		}
	}
	return fmt.Errorf("container network %v for %s: %w", req.Specs, req.Owner, err)
}

// matchExisting returns r as the container network spec asks for, or an
// error saying why the owner's network is not that one.
func matchExisting(spec Spec, r Record) (ContainerNet, error) {
	n, err := r.Net()
	if err == nil && r.Problem != "" {
		err = errors.New(r.Problem)
	}
	if err != nil {
		return ContainerNet{}, fmt.Errorf("%w: %s holds a broken container network in pool %s (%w); destroy it first",
			ErrViolation, r.Owner, spec.Pool, err)
	}
	ok := false
	switch spec.Mode() {
	case FromPool:
		ok = !r.Special
	case FromPoolWithIP:
		ok = !r.Special && n.IP() == spec.IP
	case InSubnet:
		ok = r.Special && n.IP() == spec.IP && n.Subnet() == spec.Subnet.Masked()
	}
	if !ok {
		return ContainerNet{}, fmt.Errorf("%w: %s already has container network %s in pool %s, asked for %s (destroy it first)",
			pool.ErrAlreadyExists, r.Owner, n, spec.Pool, spec)
	}
	return n, nil
}

// CreateFromPool creates owner's container network with ip and gateway from
// mainPool (CNCreateFromPool). See Create.
func (m *Manager) CreateFromPool(ctx context.Context, owner pool.Owner, mainPool string) (ContainerNet, error) {
	return m.createOne(ctx, owner, Spec{Pool: mainPool})
}

// CreateFromPoolWithIP creates owner's container network with ip from
// mainPool and a gateway from it (CNCreateFromPoolWithSpecificIP).
func (m *Manager) CreateFromPoolWithIP(ctx context.Context, owner pool.Owner, mainPool string, ip netip.Addr) (ContainerNet, error) {
	if !ip.IsValid() {
		return ContainerNet{}, fmt.Errorf("%w: no ip given", ErrInvalid)
	}
	return m.createOne(ctx, owner, Spec{Pool: mainPool, IP: ip})
}

// CreateInSubnet creates owner's container network with ip in special
// subnet subnet and a gateway from mainPool (CNCreateSubnet).
func (m *Manager) CreateInSubnet(ctx context.Context, owner pool.Owner, mainPool string, subnet netip.Prefix, ip netip.Addr) (ContainerNet, error) {
	if !subnet.IsValid() {
		return ContainerNet{}, fmt.Errorf("%w: no special subnet given", ErrInvalid)
	}
	return m.createOne(ctx, owner, Spec{Pool: mainPool, IP: ip, Subnet: subnet})
}

func (m *Manager) createOne(ctx context.Context, owner pool.Owner, s Spec) (ContainerNet, error) {
	nets, err := m.Create(ctx, Request{Owner: owner, Specs: []Spec{s}})
	if err != nil {
		return ContainerNet{}, err
	}
	return nets[0], nil
}

// Destroy releases everything owner holds (CNDestroy: its ip and gateway)
// and returns what was released. Destroying an owner that holds nothing
// succeeds with false.
func (m *Manager) Destroy(ctx context.Context, owner pool.Owner) (pool.Allocation, bool, error) {
	a, ok, err := m.a.Release(ctx, owner)
	if err != nil {
		return pool.Allocation{}, false, fmt.Errorf("destroying container network of %s: %w", owner, err)
	}
	return a, ok, nil
}

// Lookup returns owner's container network in mainPool, and false when it
// has none. A stored network that is not valid is an error wrapping
// ErrViolation.
func (m *Manager) Lookup(ctx context.Context, owner pool.Owner, mainPool string) (ContainerNet, bool, error) {
	a, ok, err := m.a.Lookup(ctx, owner)
	if err != nil || !ok {
		return ContainerNet{}, false, err
	}
	r, ok := recordOf(mainPool, a, m.subnetOf(ctx))
	if !ok {
		return ContainerNet{}, false, nil
	}
	n, err := r.Net()
	if err == nil && r.Problem != "" {
		err = errors.New(r.Problem)
	}
	if err != nil {
		return ContainerNet{}, true, fmt.Errorf("%w: %s in pool %s: %w", ErrViolation, owner, mainPool, err)
	}
	return n, true, nil
}

// State reads main pool mainPool's state from the store: its definition,
// its allocated addresses and its container networks.
func (m *Manager) State(ctx context.Context, mainPool string) (State, error) {
	def, err := m.a.Definition(ctx, mainPool)
	if err != nil {
		return State{}, err
	}
	allocs, err := m.a.List(ctx, pool.Filter{})
	if err != nil {
		return State{}, fmt.Errorf("reading allocations: %w", err)
	}
	return StateOf(def, allocs, m.subnetOf(ctx)), nil
}

// Check runs CheckNet on what the store holds for mainPool. It returns nil,
// the violations (each wrapping ErrViolation), or the error reading the state.
func (m *Manager) Check(ctx context.Context, mainPool string) error {
	s, err := m.State(ctx, mainPool)
	if err != nil {
		return err
	}
	return CheckNet(s)
}

// subnetOf resolves special subnet pools through their recorded
// definitions, cached (a definition never changes once recorded).
func (m *Manager) subnetOf(ctx context.Context) SubnetOf {
	return func(name string) (netip.Prefix, bool) {
		if v, ok := m.subnets.Load(name); ok {
			return v.(netip.Prefix), true
		}
		d, err := m.a.Definition(ctx, name)
		if err != nil || len(d.Ranges) != 1 {
			return netip.Prefix{}, false
		}
		m.subnets.Store(name, d.Ranges[0].Subnet)
		return d.Ranges[0].Subnet, true
	}
}
