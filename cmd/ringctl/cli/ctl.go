package cli

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"time"

	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/portalloc"
	"github.com/ringipam/ringipam/pkg/store"
)

// Ctl is what the commands work on.
type Ctl struct {
	Pool  *pool.Allocator
	Ports *portalloc.Allocator
	Store store.Store
	// StoreDesc describes the store for humans (no secrets).
	StoreDesc string
	// OrphanAfter is how long a host must be down to be orphaned.
	OrphanAfter time.Duration
	// Now is the clock for ages; time.Now when nil.
	Now func() time.Time
	// NewPool returns an allocator acting as another host (host ack);
	// nil: pool.New on Store with default options.
	NewPool func(host string) (*pool.Allocator, error)
}

func (c *Ctl) now() time.Time {
	if c.Now != nil {
		return c.Now()
	}
	return time.Now()
}

func (c *Ctl) poolAs(host string) (*pool.Allocator, error) {
	if c.NewPool != nil {
		return c.NewPool(host)
	}
	return pool.New(c.Store, host)
}

// OwnerMatch selects owners by the parts given of kind/network/container/if.
// The kind may be left out ("net1/abc"); the container ID matches by prefix
// (as listings shorten it); the other parts match exactly; missing trailing
// parts match anything.
type OwnerMatch struct {
	Kind        pool.Kind
	Network     string
	ContainerID string
	IfName      string
	parts       int // how many of network, container, interface were given
}

// ParseOwnerMatch parses an --owner argument.
func ParseOwnerMatch(s string) (OwnerMatch, error) {
	s = strings.TrimSuffix(s, "/")
	if s == "" {
		return OwnerMatch{}, usagef("--owner is empty: give kind/network[/container[/interface]], e.g. cni/net1/3f2a")
	}
	parts := strings.Split(s, "/")
	var m OwnerMatch
	if k := pool.Kind(parts[0]); k.Valid() {
		m.Kind = k
		parts = parts[1:]
	}
	if len(parts) > 3 {
		return OwnerMatch{}, usagef("--owner %q has too many parts: kind/network/container/interface", s)
	}
	for i, p := range parts {
		if p == "" {
			return OwnerMatch{}, usagef("--owner %q has an empty part", s)
		}
		switch i {
		case 0:
			m.Network = p
		case 1:
			m.ContainerID = p
		case 2:
			m.IfName = p
		}
	}
	m.parts = len(parts)
	return m, nil
}

// Matches reports whether o is selected.
func (m OwnerMatch) Matches(o pool.Owner) bool {
	if m.Kind != "" && o.Kind != m.Kind {
		return false
	}
	if m.parts >= 1 && o.Network != m.Network {
		return false
	}
	if m.parts >= 2 && !strings.HasPrefix(o.ContainerID, m.ContainerID) {
		return false
	}
	return m.parts < 3 || o.IfName == m.IfName
}

// Exact is the owner named when every part was given; false otherwise.
func (m OwnerMatch) Exact() (pool.Owner, bool) {
	if m.Kind == "" || m.parts < 3 {
		return pool.Owner{}, false
	}
	return pool.Owner{Kind: m.Kind, Network: m.Network, ContainerID: m.ContainerID, IfName: m.IfName}, true
}

// Action is one change a repair made (or, in a dry run, would make).
type Action struct {
	// Do is what: release, drop-hold, reclaim, hand-over, release-ports,
	// drop-ended-hold, compact-history, adopt, ack.
	Do string `json:"do"`
	// Target is whom: an owner, a host, an endpoint, a reservation.
	Target string       `json:"target"`
	Host   string       `json:"host,omitempty"`
	Pools  []string     `json:"pools,omitempty"`
	Addrs  []netip.Addr `json:"addrs,omitempty"`
	// Detail completes the sentence (ports, hold, times).
	Detail string `json:"detail,omitempty"`
}

// Actions is the result of a repair.
type Actions struct {
	DryRun  bool     `json:"dryRun"`
	Actions []Action `json:"actions"`
	// Notes say what is not an action of its own (counts, advice); they
	// may differ between a dry run and the real run.
	Notes []string `json:"notes,omitempty"`
}

func (a *Actions) add(x Action) { a.Actions = append(a.Actions, x) }

func (a *Actions) note(format string, args ...any) {
	a.Notes = append(a.Notes, fmt.Sprintf(format, args...))
}

// addrsOf returns an allocation's addresses, in record order.
func addrsOf(al pool.Allocation) []netip.Addr {
	out := make([]netip.Addr, 0, len(al.Addrs))
	for _, x := range al.Addrs {
		out = append(out, x.Addr)
	}
	return out
}

func poolsOf(al pool.Allocation) []string {
	var out []string
	for _, x := range al.Addrs {
		if len(out) == 0 || out[len(out)-1] != x.Pool {
			out = append(out, x.Pool)
		}
	}
	return out
}

// ago renders how long before now t was, coarsely.
func ago(now, t time.Time) string {
	if t.IsZero() {
		return "never"
	}
	d := now.Sub(t)
	switch {
	case d < 0:
		return "in " + short(-d)
	case d < time.Second:
		return "now"
	}
	return short(d) + " ago"
}

func short(d time.Duration) string {
	switch {
	case d < time.Minute:
		return fmt.Sprintf("%ds", int(d/time.Second))
	case d < time.Hour:
		return fmt.Sprintf("%dm", int(d/time.Minute))
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh%02dm", int(d/time.Hour), int(d%time.Hour/time.Minute))
	}
	return fmt.Sprintf("%dd%02dh", int(d/(24*time.Hour)), int(d%(24*time.Hour)/time.Hour))
}

func stamp(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format(time.RFC3339)
}

// findPool returns the one recorded pool that hands out addr (name, when
// given, must be it).
func (c *Ctl) findPool(ctx context.Context, addr netip.Addr, name string) (pool.Def, error) {
	defs, err := c.Pool.PoolsContaining(ctx, addr)
	if err != nil {
		return pool.Def{}, err
	}
	var names []string
	for _, d := range defs {
		if name == "" || d.Name == name {
			names = append(names, d.Name)
		}
	}
	switch len(names) {
	case 0:
		if name != "" {
			return pool.Def{}, notFoundf("%s is not an address pool %s hands out", addr, name)
		}
		return pool.Def{}, notFoundf("no recorded pool hands out %s", addr)
	case 1:
		for _, d := range defs {
			if d.Name == names[0] {
				return d, nil
			}
		}
	}
	return pool.Def{}, usagef("%s lies in several isolated pools (%s): name one with --pool", addr, strings.Join(names, ", "))
}
