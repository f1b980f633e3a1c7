package portmap

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"

	current "github.com/containernetworking/cni/pkg/types/100"

	"github.com/ringipam/ringipam/pkg/portalloc"
)

// Ports is what the verbs need of the port allocator (*portalloc.Allocator).
type Ports interface {
	Allocate(ctx context.Context, id portalloc.EndpointID, spec []portalloc.Port) (portalloc.Result, error)
	Release(ctx context.Context, id portalloc.EndpointID) (portalloc.Result, error)
	Verify(ctx context.Context, id portalloc.EndpointID) (portalloc.Endpoint, bool, []string, error)
	HostEndpoints(ctx context.Context, host, network string) (map[portalloc.EndpointID]portalloc.Endpoint, error)
}

// Published is what an ADD set up.
type Published struct {
	Ports    []portalloc.Port // in the order of Config.Mappings
	Rules    []Rule
	Findings []string // inconsistent stored allocations the allocator reported
	Warnings []string // what went wrong without failing the ADD
}

// containerAddrs are the attachment's addresses from prevResult (those of
// the container's interfaces) and the host-side interface names.
func containerAddrs(r *current.Result) (ips []netip.Addr, hostIfs []string) {
	if r == nil {
		return nil, nil
	}
	inContainer := map[int]bool{}
	for i, ifc := range r.Interfaces {
		if ifc.Sandbox != "" {
			inContainer[i] = true
		} else {
			hostIfs = append(hostIfs, ifc.Name)
		}
	}
	for _, ip := range r.IPs {
		if ip.Interface != nil && len(inContainer) > 0 && !inContainer[*ip.Interface] {
			continue
		}
		if a, ok := netip.AddrFromSlice(ip.Address.IP); ok {
			ips = append(ips, a.Unmap())
		}
	}
	return ips, hostIfs
}

// rulesFor are the forwards of ports (ports[i] allocated for mappings[i]) to
// each container address of the port's family.
func rulesFor(ports []portalloc.Port, mappings []Mapping, ips []netip.Addr) []Rule {
	var out []Rule
	for i, p := range ports {
		for _, ip := range ips {
			if p.HostIP.IsValid() && p.HostIP.Is6() != ip.Is6() {
				continue
			}
			out = append(out, Rule{Protocol: p.Protocol, HostPort: p.Number, HostIP: p.HostIP, ContainerIP: ip, ContainerPort: mappings[i].ContainerPort})
		}
	}
	return out
}

// Add publishes c's mappings for attachment id: one store transaction, then
// the forwards. If the forwards cannot be installed, the ports are released
// again and nothing is left behind.
func Add(ctx context.Context, p Ports, dp Dataplane, c *Config, id portalloc.EndpointID) (Published, error) {
	if c.MappingsErr != nil {
		return Published{}, c.MappingsErr
	}
	if len(c.Mappings) == 0 {
		return Published{}, nil
	}
	if c.PrevResult == nil {
		return Published{}, badConfig("portmap-ingress is a chained plugin: it needs a prevResult (put it after the main plugin)")
	}
	ips, hostIfs := containerAddrs(c.PrevResult)
	if len(ips) == 0 {
		return Published{}, badConfig("prevResult has no container address to publish ports to")
	}
	for _, m := range c.Mappings {
		if m.HostIP.IsValid() && !slices.ContainsFunc(ips, func(a netip.Addr) bool { return a.Is6() == m.HostIP.Is6() }) {
			return Published{}, badConfig("mapping on host IP %s: the container has no address of its family", m.HostIP)
		}
	}
	res, err := p.Allocate(ctx, id, c.spec())
	if err != nil {
		return Published{}, err
	}
	out := Published{Ports: res.Ports, Findings: res.Findings, Rules: rulesFor(res.Ports, c.Mappings, ips)}
	mark := Mark(id)
	setup := func() error {
		if len(res.Previous) > 0 {
			// ADD again for the same attachment: the forwards of its
			// previous request go first (the only ADD that lists them).
			if err := dp.Remove(ctx, mark); err != nil {
				return err
			}
		}
		if err := dp.Add(ctx, mark, out.Rules); err != nil {
			return err
		}
		return enableRouteLocalnet(hostIfs)
	}
	if err := setup(); err != nil {
		undo := context.WithoutCancel(ctx)
		if rerr := dp.Remove(undo, mark); rerr != nil {
			err = errors.Join(err, fmt.Errorf("removing the forwards again: %w", rerr))
		}
		if _, rerr := p.Release(undo, id); rerr != nil {
			err = errors.Join(err, fmt.Errorf("releasing the ports again: %w", rerr))
		}
		return Published{}, err
	}
	if err := flushUDP(out.Rules); err != nil {
		out.Warnings = append(out.Warnings, err.Error())
	}
	return out, nil
}

// Del removes attachment id's forwards and releases its ports; it needs no
// mappings (the store record says what the attachment holds) and succeeds
// when there is nothing left.
func Del(ctx context.Context, p Ports, dp Dataplane, id portalloc.EndpointID) error {
	var errs []error
	if dp != nil {
		errs = append(errs, dp.Remove(ctx, Mark(id)))
	}
	if _, err := p.Release(ctx, id); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// Check verifies that attachment id holds the ports c asks for, that the
// store's addresses list them, and that every forward is installed.
func Check(ctx context.Context, p Ports, dp Dataplane, c *Config, id portalloc.EndpointID) error {
	if c.MappingsErr != nil {
		return c.MappingsErr
	}
	e, ok, findings, err := p.Verify(ctx, id)
	if err != nil {
		return err
	}
	want := c.spec()
	switch {
	case !ok && len(want) == 0:
		return nil
	case !ok:
		return fmt.Errorf("%w: %s publishes no port, the request has %d", ErrCheckFailed, id, len(want))
	case len(findings) > 0:
		return fmt.Errorf("%w: %v", ErrCheckFailed, findings)
	case !slices.Equal(e.Spec, want):
		return fmt.Errorf("%w: %s was published for %v, the request is %v", ErrCheckFailed, id, e.Spec, want)
	}
	if c.PrevResult == nil {
		return badConfig("CHECK needs a prevResult")
	}
	ips, _ := containerAddrs(c.PrevResult)
	marks, err := dp.Marks(ctx)
	if err != nil {
		return err
	}
	have := marks[Mark(id)]
	for _, r := range rulesFor(e.Ports, c.Mappings, ips) {
		if !slices.Contains(have, r) {
			return fmt.Errorf("%w: the forward %s of %s is missing", ErrCheckFailed, r, id)
		}
	}
	return nil
}

// GC removes the forwards and releases the ports of this network's
// attachments on this host that are not in c's list of valid attachments.
// Other hosts' attachments are never touched. It returns the attachments'
// marks it cleaned; without a list it does nothing.
func GC(ctx context.Context, p Ports, dp Dataplane, c *Config) ([]string, error) {
	if !c.HasValid {
		return nil, nil
	}
	keep := map[string]bool{}
	for _, v := range c.Valid {
		keep[Mark(portalloc.EndpointID{Network: c.Network, ContainerID: v.ContainerID, IfName: v.IfName})] = true
	}
	var errs []error
	stale := map[string]bool{}
	if dp != nil {
		marks, err := dp.Marks(ctx)
		if err != nil {
			return nil, err
		}
		for m := range marks {
			if markOfNetwork(m, c.Network) && !keep[m] {
				stale[m] = true
				errs = append(errs, dp.Remove(ctx, m))
			}
		}
	}
	// This host's endpoints of the network, through its index (what other
	// hosts publish is not read). A corrupt record is reported, the
	// readable ones still collected.
	eps, err := p.HostEndpoints(ctx, c.Host, c.Network)
	errs = append(errs, err)
	for id, e := range eps {
		m := Mark(id)
		if e.Host != c.Host || keep[m] {
			continue
		}
		if dp != nil && !stale[m] {
			errs = append(errs, dp.Remove(ctx, m))
		}
		stale[m] = true
		if _, err := p.Release(ctx, id); err != nil {
			errs = append(errs, err)
		}
	}
	var out []string
	for m := range stale {
		out = append(out, m)
	}
	slices.Sort(out)
	return out, errors.Join(errs...)
}
