package containernet

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/ringipam/ringipam/pkg/pool"
)

// This file is an exhaustive model check of the Manager. The Manager's own
// code (planning, decoding, idempotency, error paths) runs unchanged over
// modelAlloc, a model of pkg/pool whose dynamic picks are a nondeterministic
// choice: the checker enumerates every choice, so it visits every state the
// specification allows, not only those the pool's round robin reaches.
// Breadth-first from the empty state it applies every operation with every
// argument, and in every state it checks CheckNet (the seed's Net schema).
// On every transition it checks, against an oracle written from the seed's
// preconditions and postconditions, that an operation succeeds exactly when
// the seed says it may and changes exactly what the seed says.
//
// Pool definitions are global to a run rather than part of a state: Create
// always defines a special subnet pool before using it, so whether a
// definition already exists never changes an outcome.

// modelAlloc models pool.Allocator over an in-memory map of owners.
type modelAlloc struct {
	defs   map[string]pool.Def
	given  map[string]pool.Def     // as given to Define, for a fast repeat
	addrs  map[string][]netip.Addr // every address each pool hands out
	owners map[pool.Owner]pool.Allocation
	choose func(n int) int // which of n free addresses a dynamic want gets
	// partial breaks the model on purpose: a failed request keeps the
	// addresses taken before the failing want (no single transaction).
	partial bool
	// leaky breaks the model on purpose: special subnet pools do not keep
	// an address to one owner.
	leaky bool
}

func newModelAlloc() *modelAlloc {
	return &modelAlloc{defs: map[string]pool.Def{}, given: map[string]pool.Def{}, addrs: map[string][]netip.Addr{}, owners: map[pool.Owner]pool.Allocation{}}
}

func (m *modelAlloc) Define(_ context.Context, defs ...pool.Def) error {
	for _, d := range defs {
		if g, ok := m.given[d.Name]; ok && reflect.DeepEqual(g, d) {
			continue
		}
		n, err := d.Normalize()
		if err != nil {
			return err
		}
		if old, ok := m.defs[n.Name]; ok {
			if !reflect.DeepEqual(old, n) {
				return fmt.Errorf("%w: %s", pool.ErrDefinitionMismatch, n.Name)
			}
			continue
		}
		m.defs[n.Name] = n
		m.given[n.Name] = d
		var all []netip.Addr
		for _, r := range n.Ranges {
			for a := r.Start; a.IsValid() && a.Compare(r.End) <= 0; a = a.Next() {
				if n.Contains(a) {
					all = append(all, a)
				}
			}
		}
		m.addrs[n.Name] = all
	}
	return nil
}

func (m *modelAlloc) Definition(_ context.Context, name string) (pool.Def, error) {
	d, ok := m.defs[name]
	if !ok {
		return pool.Def{}, fmt.Errorf("%w: %s", pool.ErrUnknownPool, name)
	}
	return d, nil
}

// holder returns who holds addr in poolName.
func (m *modelAlloc) holder(poolName string, addr netip.Addr) (pool.Owner, bool) {
	for o, a := range m.owners {
		for _, x := range a.Addrs {
			if x.Pool == poolName && x.Addr == addr {
				return o, true
			}
		}
	}
	return pool.Owner{}, false
}

// Allocate follows pool.Allocator.Allocate: all wants or nothing, held
// (pool, role)s come back, static addresses must be handed out by the pool
// and free, dynamic ones are any free address (chosen by m.choose).
func (m *modelAlloc) Allocate(_ context.Context, req pool.Request) (pool.Allocation, error) {
	if err := req.Owner.Validate(); err != nil {
		return pool.Allocation{}, err
	}
	seen := map[string]bool{}
	for _, w := range req.Wants {
		k := w.Pool + "\x00" + string(w.Role)
		if seen[k] {
			return pool.Allocation{}, fmt.Errorf("%w: %s asked twice", pool.ErrInvalid, k)
		}
		seen[k] = true
	}
	cur, found := m.owners[req.Owner]
	if !found {
		cur = pool.Allocation{Owner: req.Owner, Host: "model", Reservation: req.Reservation}
	}
	next := cur
	next.Addrs = slices.Clone(cur.Addrs)
	alloc, err := m.allocate(req, cur, next)
	if err != nil && m.partial && len(alloc.Addrs) > 0 {
		m.owners[req.Owner] = alloc
	}
	if err != nil {
		return pool.Allocation{}, err
	}
	m.owners[req.Owner] = alloc
	return alloc, nil
}

// allocate adds req's missing wants to next; on error it returns what it
// had taken so far.
func (m *modelAlloc) allocate(req pool.Request, cur, next pool.Allocation) (pool.Allocation, error) {
	for _, w := range req.Wants {
		if held, ok := cur.Addr(w.Pool, w.Role); ok {
			if w.Addr.IsValid() && w.Addr != held {
				return next, &pool.ExistsError{Owner: req.Owner.String(), Asked: w.Addr}
			}
			continue
		}
		d, ok := m.defs[w.Pool]
		if !ok {
			return next, fmt.Errorf("%w: %s", pool.ErrUnknownPool, w.Pool)
		}
		leak := m.leaky && strings.Contains(w.Pool, specialInfix)
		taken := func(a netip.Addr) bool {
			if _, ok := m.holder(w.Pool, a); ok && !leak {
				return true
			}
			return slices.Contains(next.Addrs, pool.Assigned{Pool: w.Pool, Role: pool.RoleIP, Addr: a}) ||
				slices.Contains(next.Addrs, pool.Assigned{Pool: w.Pool, Role: pool.RoleGateway, Addr: a})
		}
		got := w.Addr
		if got.IsValid() {
			if !d.Contains(got) {
				return next, fmt.Errorf("%w: %s is not in pool %s", pool.ErrInvalid, got, w.Pool)
			}
			if h, ok := m.holder(w.Pool, got); ok && !leak {
				return next, &pool.InUseError{Pool: w.Pool, Addr: got, Holder: h.String()}
			}
			if taken(got) {
				return next, fmt.Errorf("%w: %s asked twice in one request", pool.ErrInvalid, got)
			}
		} else {
			var free []netip.Addr
			for _, a := range m.addrs[w.Pool] {
				if !taken(a) {
					free = append(free, a)
				}
			}
			if len(free) == 0 {
				return next, &pool.CapacityError{Pool: w.Pool}
			}
			got = free[m.choose(len(free))]
		}
		next.Addrs = append(next.Addrs, pool.Assigned{Pool: w.Pool, Role: w.Role, Addr: got})
	}
	return next, nil
}

func (m *modelAlloc) Release(_ context.Context, o pool.Owner) (pool.Allocation, bool, error) {
	a, ok := m.owners[o]
	delete(m.owners, o)
	return a, ok, nil
}

func (m *modelAlloc) Lookup(_ context.Context, o pool.Owner) (pool.Allocation, bool, error) {
	a, ok := m.owners[o]
	return a, ok, nil
}

func (m *modelAlloc) List(_ context.Context, f pool.Filter) ([]pool.Allocation, error) {
	var out []pool.Allocation
	for _, a := range m.owners {
		if f.Pool == "" || slices.ContainsFunc(a.Addrs, func(x pool.Assigned) bool { return x.Pool == f.Pool }) {
			out = append(out, a)
		}
	}
	slices.SortFunc(out, func(a, b pool.Allocation) int { return strings.Compare(a.Owner.String(), b.Owner.String()) })
	return out, nil
}

// free returns the addresses of poolName nobody holds.
func (m *modelAlloc) free(poolName string) []netip.Addr {
	var out []netip.Addr
	for _, a := range m.addrs[poolName] {
		if _, ok := m.holder(poolName, a); !ok {
			out = append(out, a)
		}
	}
	return out
}

// chooser enumerates every sequence of choices an operation can make, as an
// odometer whose digits have the radix each choice offered.
type chooser struct {
	path, radix []int
	pos         int
}

func (c *chooser) choose(n int) int {
	if c.pos < len(c.path) {
		c.radix[c.pos] = n
		c.pos++
		return c.path[c.pos-1]
	}
	c.path, c.radix = append(c.path, 0), append(c.radix, n)
	c.pos++
	return 0
}

// next moves to the next sequence; false when all were run.
func (c *chooser) next() bool {
	c.path, c.radix = c.path[:c.pos], c.radix[:c.pos]
	c.pos = 0
	for i := len(c.path) - 1; i >= 0; i-- {
		if c.path[i]+1 < c.radix[i] {
			c.path[i]++
			c.path, c.radix = c.path[:i+1], c.radix[:i+1]
			return true
		}
	}
	return false
}

// modelOp is one operation with its arguments.
type modelOp struct {
	destroy bool
	owner   pool.Owner
	spec    Spec
}

func (o modelOp) String() string {
	if o.destroy {
		return "Destroy(" + o.owner.ContainerID + ")"
	}
	return o.owner.ContainerID + ": " + o.spec.String()
}

// modelConfig is the small world the checker explores.
type modelConfig struct {
	main    pool.Def
	owners  []pool.Owner
	ops     []modelOp
	planner func(pool.Def, Spec, []netip.Prefix) (plan, error)
	partial bool // see modelAlloc.partial
	leaky   bool // see modelAlloc.leaky
}

func pfx(s string) netip.Prefix { return netip.MustParsePrefix(s) }
func ip(s string) netip.Addr    { return netip.MustParseAddr(s) }

// smallWorld: 5 pool addresses (198.18.0.1-5; 198.18.0.6 is excluded), 3
// containers, 2 special subnets of 2 addresses, plus arguments the seed
// rules out (a special subnet overlapping another, one inside the pool, ips
// outside the pool, excluded, or outside their subnet). Five addresses and
// not six: with six, three containers (two addresses each at most) could
// never exhaust the pool, and running out is a path worth checking.
func smallWorld() modelConfig {
	cfg := modelConfig{
		main:    pool.Def{Name: "net", Ranges: []pool.Range{{Subnet: pfx("198.18.0.0/29")}}, Exclude: []netip.Prefix{pfx("198.18.0.6/32")}},
		planner: planCreate,
	}
	for _, c := range []string{"c0", "c1", "c2"} {
		cfg.owners = append(cfg.owners, pool.Owner{Kind: pool.KindCNI, Network: "net", ContainerID: c, IfName: "eth0"})
	}
	type sip struct{ subnet, ip string }
	var specs []Spec
	specs = append(specs, Spec{Pool: "net"})
	for _, a := range []string{"198.18.0.1", "198.18.0.2", "198.18.0.3", "198.18.0.4", "198.18.0.5", "198.18.0.6", "198.18.0.0", "198.19.1.1"} {
		specs = append(specs, Spec{Pool: "net", IP: ip(a)})
	}
	for _, x := range []sip{
		{"198.19.1.0/30", "198.19.1.1"}, {"198.19.1.0/30", "198.19.1.2"}, // A
		{"198.19.1.0/30", "198.19.1.0"}, {"198.19.1.0/30", "198.19.2.1"}, // A: network address, outside A
		{"198.18.172.0/30", "198.18.172.1"}, {"198.18.172.0/30", "198.18.172.2"}, // B
		{"198.19.1.0/29", "198.19.1.1"}, {"198.19.1.0/29", "198.19.1.5"}, // C overlaps A
		{"198.18.0.0/30", "198.18.0.1"}, // D overlaps the pool
	} {
		specs = append(specs, Spec{Pool: "net", Subnet: pfx(x.subnet), IP: ip(x.ip)})
	}
	for _, o := range cfg.owners {
		for _, s := range specs {
			cfg.ops = append(cfg.ops, modelOp{owner: o, spec: s})
		}
		cfg.ops = append(cfg.ops, modelOp{destroy: true, owner: o})
	}
	return cfg
}

// modelState is a snapshot of the owners map.
type modelState map[pool.Owner]pool.Allocation

// key identifies s up to a renaming of the containers: every operation is
// applied to every container alike and no invariant names one, so states
// that differ only by which container holds what are equivalent (symmetry
// reduction).
func (s modelState) key(owners []pool.Owner) string {
	parts := make([]string, 0, len(owners))
	for _, o := range owners {
		a, ok := s[o]
		if !ok {
			continue
		}
		xs := make([]string, len(a.Addrs))
		for i, x := range a.Addrs {
			xs[i] = x.Pool + "/" + string(x.Role) + "=" + x.Addr.String()
		}
		slices.Sort(xs)
		parts = append(parts, strings.Join(xs, ";"))
	}
	slices.Sort(parts)
	return strings.Join(parts, "|")
}

func (s modelState) clone() modelState {
	out := make(modelState, len(s))
	for o, a := range s {
		a.Addrs = slices.Clone(a.Addrs)
		out[o] = a
	}
	return out
}

// modelResult is what one exploration found.
type modelResult struct {
	states, transitions int
}

// explore runs the model check; the error is the first violation, with the
// operations that lead to it from the empty state.
func explore(cfg modelConfig) (modelResult, error) {
	ctx := context.Background()
	ma := newModelAlloc()
	ma.partial, ma.leaky = cfg.partial, cfg.leaky
	if err := ma.Define(ctx, cfg.main); err != nil {
		return modelResult{}, err
	}
	mgr := NewManager(ma)
	mgr.planner = cfg.planner
	main := ma.defs[cfg.main.Name]

	type node struct {
		st     modelState
		parent int
		op     string
	}
	nodes := []node{{st: modelState{}, parent: -1}}
	seen := map[string]bool{nodes[0].st.key(cfg.owners): true}
	trace := func(i int, last string) string {
		var steps []string
		if last != "" {
			steps = append(steps, last)
		}
		for ; i > 0; i = nodes[i].parent {
			steps = append(steps, nodes[i].op)
		}
		slices.Reverse(steps)
		return "from the empty state: " + strings.Join(steps, " ; ")
	}
	var res modelResult
	for i := 0; i < len(nodes); i++ {
		cur := nodes[i].st
		ma.owners = cur
		allocs, _ := ma.List(ctx, pool.Filter{})
		pre := StateOf(main, allocs, mgr.subnetOf(ctx))
		if i == 0 {
			if err := CheckNet(pre); err != nil {
				return res, fmt.Errorf("the empty state violates the Net schema: %w", err)
			}
		}
		for _, op := range cfg.ops {
			var ch chooser
			for {
				ma.owners = cur.clone()
				ma.choose = ch.choose
				var got ContainerNet
				var err error
				if op.destroy {
					_, _, err = mgr.Destroy(ctx, op.owner)
				} else {
					got, err = mgr.createOne(ctx, op.owner, op.spec)
				}
				res.transitions++
				post := modelState(ma.owners)
				var postState State
				k := post.key(cfg.owners)
				if !seen[k] || err == nil {
					allocs, _ := ma.List(ctx, pool.Filter{})
					postState = StateOf(main, allocs, mgr.subnetOf(ctx))
				}
				if !seen[k] {
					// the invariants are a function of the state: check each state once
					if verr := CheckNet(postState); verr != nil {
						return res, fmt.Errorf("%s reaches a state that violates the Net schema: %w\n%s", op, verr, trace(i, op.String()))
					}
					seen[k] = true
					nodes = append(nodes, node{st: post, parent: i, op: op.String()})
				}
				if verr := checkTransition(cfg, ma, main, pre, postState, cur, post, op, got, err); verr != nil {
					return res, fmt.Errorf("%s: %w\n%s", op, verr, trace(i, op.String()))
				}
				if !ch.next() {
					break
				}
			}
		}
	}
	res.states = len(nodes)
	return res, nil
}

// checkTransition is the oracle: the seed's preconditions and postconditions
// of CNCreateFromPool, CNCreateFromPoolWithSpecificIP, CNCreateSubnet and
// CNDestroy, written over records and free addresses, independently of the
// Manager's planning.
func checkTransition(cfg modelConfig, ma *modelAlloc, main pool.Def, pre, post State, before, after modelState, op modelOp, got ContainerNet, err error) error {
	rec := func(recs []Record, o pool.Owner) (Record, bool) {
		for _, r := range recs {
			if r.Owner == o {
				return r, true
			}
		}
		return Record{}, false
	}
	// the frame: nobody but op.owner changes
	for _, o := range cfg.owners {
		if o != op.owner && !sameAlloc(before[o], after[o]) {
			return fmt.Errorf("changed %s", o)
		}
	}
	old, exists := rec(pre.Containers, op.owner)
	if op.destroy {
		if err != nil {
			return fmt.Errorf("destroy failed: %w", err)
		}
		if _, ok := after[op.owner]; ok {
			return errors.New("destroy left the owner's addresses held")
		}
		return nil
	}
	if exists {
		// CNCreateBase: cid! ∉ dom cnet. An existing owner gets its own
		// network back when it matches, else an error; nothing changes.
		if !sameAlloc(before[op.owner], after[op.owner]) {
			return errors.New("create changed an existing container")
		}
		n, _ := old.Net()
		matches := op.spec.Mode() == InSubnet && old.Special && old.Subnet == op.spec.Subnet && old.IP == op.spec.IP ||
			op.spec.Mode() == FromPoolWithIP && !old.Special && old.IP == op.spec.IP ||
			op.spec.Mode() == FromPool && !old.Special
		switch {
		case matches && (err != nil || got != n):
			return fmt.Errorf("repeated create did not return %s: %v, %v", n, got, err)
		case !matches && !errors.Is(err, pool.ErrAlreadyExists):
			return fmt.Errorf("create over a different network: want ErrAlreadyExists, got %v", err)
		}
		return nil
	}
	// seed preconditions
	ma.owners = before
	free := ma.free(main.Name)
	ma.owners = after
	s, x := op.spec.Subnet, op.spec.IP
	var ok bool
	switch op.spec.Mode() {
	case FromPool:
		ok = len(free) >= 2
	case FromPoolWithIP:
		ok = slices.Contains(free, x) && len(free) >= 2
	case InSubnet:
		ok = s.Contains(x) && !s.Overlaps(main.Ranges[0].Subnet) && len(free) >= 1 && usable(s, x)
		for _, r := range pre.Containers {
			ok = ok && r.IP != x && (r.Subnet == s || !r.Subnet.Overlaps(s))
		}
	}
	if ok != (err == nil) {
		return fmt.Errorf("the seed's precondition is %v but create returned %v", ok, err)
	}
	if err != nil {
		if !sameAlloc(before[op.owner], after[op.owner]) {
			return fmt.Errorf("failed create (%v) left addresses held: %v", err, after[op.owner])
		}
		return nil
	}
	// seed postconditions
	ip, gw := got.IP(), got.Gateway()
	switch op.spec.Mode() {
	case FromPool, FromPoolWithIP:
		if !slices.Contains(free, ip) || !slices.Contains(free, gw) || got.Subnet() != HostPrefix(ip) {
			return fmt.Errorf("AllocateTwo: got %s with free %v", got, free)
		}
		if op.spec.Mode() == FromPoolWithIP && ip != x {
			return fmt.Errorf("asked for ip %s, got %s", x, got)
		}
	case InSubnet:
		if ip != x || got.Subnet() != s || !slices.Contains(free, gw) {
			return fmt.Errorf("CNCreateSubnet: got %s", got)
		}
	}
	if r, ok := rec(post.Containers, op.owner); !ok || r.IP != ip || r.GW != gw || r.Subnet != got.Subnet() {
		return fmt.Errorf("stored %v differs from returned %s", r, got)
	}
	if n := len(after[op.owner].Addrs); n != 2 {
		return fmt.Errorf("owner holds %d addresses, want 2", n)
	}
	return nil
}

func sameAlloc(a, b pool.Allocation) bool {
	return a.Owner == b.Owner && a.Host == b.Host && a.Reservation == b.Reservation && slices.Equal(a.Addrs, b.Addrs)
}

// usable is the pool library's rule for a special subnet: its network
// address, and for IPv4 subnets larger than /31 its broadcast address, are
// never handed out.
func usable(s netip.Prefix, a netip.Addr) bool {
	host := a.BitLen() - s.Bits()
	if host == 0 || (a.Is4() && host == 1) {
		return true
	}
	if a == s.Masked().Addr() {
		return false
	}
	if a.Is4() {
		last := s.Masked().Addr().As4()
		for i := range last {
			bits := 8*(i+1) - s.Bits()
			switch {
			case bits >= 8:
				last[i] = 0xff
			case bits > 0:
				last[i] |= byte(1<<bits - 1)
			}
		}
		return a != netip.AddrFrom4(last)
	}
	return true
}

func TestModelCheck(t *testing.T) {
	if testing.Short() {
		t.Skip("exhaustive model check skipped in -short")
	}
	res, err := explore(smallWorld())
	if err != nil {
		t.Fatal(err)
	}
	msg := fmt.Sprintf("model check: %d states visited (up to renaming the containers), %d transitions checked; CNetValid and CNetPairValid hold in every state", res.states, res.transitions)
	t.Log(msg)
	if testing.Verbose() {
		fmt.Println(msg)
	}
	if res.states < 500 {
		t.Fatalf("only %d states: the model is not exploring", res.states)
	}
}

// TestModelCheckFindsBrokenVariants shows that the checker can fail: each
// variant breaks one rule of the seed and must be reported.
func TestModelCheckFindsBrokenVariants(t *testing.T) {
	if testing.Short() {
		t.Skip("exhaustive model check skipped in -short")
	}
	calls := 0
	tests := []struct {
		name    string
		planner func(pool.Def, Spec, []netip.Prefix) (plan, error)
		partial bool
		leaky   bool
		want    string // in the report
	}{
		{
			name: "gateway not allocated",
			planner: func(d pool.Def, s Spec, live []netip.Prefix) (plan, error) {
				p, err := planCreate(d, s, live)
				p.wants = slices.DeleteFunc(p.wants, func(w pool.Want) bool { return w.Role == pool.RoleGateway })
				return p, err
			},
			want: "precondition",
		},
		{
			name: "a special subnet pool per create",
			planner: func(d pool.Def, s Spec, live []netip.Prefix) (plan, error) {
				p, err := planCreate(d, s, live)
				if err == nil && p.special != nil {
					// a pool per create: nothing makes two containers' ips differ
					calls++
					sp := *p.special
					sp.Name += fmt.Sprintf(":%d", calls)
					p.special = &sp
					p.wants[0].Pool = sp.Name
				}
				return p, err
			},
			want: "violates the Net schema", // two ips in one subnet, or one owner holding two

		},
		{
			name: "overlapping special subnets allowed",
			planner: func(d pool.Def, s Spec, _ []netip.Prefix) (plan, error) {
				return planCreate(d, s, nil)
			},
			want: "overlap without being equal",
		},
		{
			name: "special subnet inside the pool allowed",
			planner: func(d pool.Def, s Spec, live []netip.Prefix) (plan, error) {
				if s.Mode() == InSubnet && overlapsPool(d, s.Subnet) {
					return wantsFor(s), nil
				}
				return planCreate(d, s, live)
			},
			want: "CNetValid",
		},
		{
			name:    "pool lets special subnet ips collide",
			planner: planCreate,
			leaky:   true,
			want:    "CNetPairValid violated by cni/net/c0/eth0 and cni/net/c1/eth0: both have ip 198.19.1.1",
		},
		{
			name:    "ip and gateway not in one transaction",
			planner: planCreate,
			partial: true,
			want:    "missing gateway",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := smallWorld()
			cfg.planner, cfg.partial, cfg.leaky = tt.planner, tt.partial, tt.leaky
			res, err := explore(cfg)
			if err == nil {
				t.Fatalf("the checker found nothing wrong in %d states", res.states)
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("reported %v; want a report mentioning %q", err, tt.want)
			}
			t.Logf("reported after %d transitions, as it should be: %v", res.transitions, err)
		})
	}
}
