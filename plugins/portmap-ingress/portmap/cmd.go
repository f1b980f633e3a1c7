package portmap

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"strings"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/ringipam/ringipam/pkg/portalloc"
	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/storeconfig"
)

// SupportedVersions are the CNI versions the plugin speaks (chained
// plugins need prevResult: 0.4.0 and later).
var SupportedVersions = version.PluginSupports("0.4.0", "1.0.0", "1.1.0")

// Plugin-specific CNI error codes (the same numbering as ipam-ring).
const (
	CodeInUse     uint = 100 // the host port is published by another endpoint; the message names it
	CodeExhausted uint = 102 // no free port left in the dynamic range
	CodeDuplicate uint = 105 // the request asks for one port twice
	CodeCheck     uint = 104 // CHECK found the ports or rules gone or different
)

// ErrCheckFailed is wrapped by CHECK's findings.
var ErrCheckFailed = errors.New("published ports check failed")

// Edge runs the verbs for skel: config, store, allocator, data path.
type Edge struct {
	// Dataplane, when set, replaces the nftables data path (tests).
	Dataplane Dataplane
	Stdout    io.Writer
}

// Funcs returns the skel callbacks.
func (e Edge) Funcs() skel.CNIFuncs {
	return skel.CNIFuncs{Add: e.Add, Del: e.Del, Check: e.Check, GC: e.GC, Status: e.Status}
}

func (e Edge) run(c *Config, fn func(ctx context.Context, a *portalloc.Allocator, dp Dataplane) error) error {
	ctx, cancel := context.WithTimeout(context.Background(), c.Timeout)
	defer cancel()
	st, err := storeconfig.Open(c.Store)
	if err != nil {
		return fmt.Errorf("opening store: %w", err)
	}
	defer st.Close()
	a, err := portalloc.New(st, c.Host, portalloc.WithDynamicRange(c.Lo, c.Hi))
	if err != nil {
		return fmt.Errorf("%w: %w", ErrBadConfig, err)
	}
	dp := e.Dataplane
	if dp == nil {
		if dp, err = NewNFT(c.Table); err != nil {
			return err
		}
	}
	return fn(ctx, a, dp)
}

func owner(c *Config, args *skel.CmdArgs) portalloc.EndpointID {
	return portalloc.EndpointID{Network: c.Network, ContainerID: args.ContainerID, IfName: args.IfName}
}

// containerIPs are the attachment's addresses from prevResult (those on
// the container's interfaces), and the host-side interface names.
func containerIPs(r *current.Result) (ips []netip.Addr, hostIfs []string) {
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
		if ip.Interface != nil && !inContainer[*ip.Interface] && len(inContainer) > 0 {
			continue
		}
		if a, ok := netip.AddrFromSlice(ip.Address.IP); ok {
			ips = append(ips, a.Unmap())
		}
	}
	return ips, hostIfs
}

func rulesFor(ports []portalloc.Port, c *Config, ips []netip.Addr) []Rule {
	var out []Rule
	for i, p := range ports {
		for _, ip := range ips {
			out = append(out, Rule{Protocol: p.Protocol, HostPort: p.Number, HostIP: p.HostIP, ContainerIP: ip, ContainerPort: c.Mappings[i].ContainerPort})
		}
	}
	return out
}

// Add is the ADD verb: allocate, program, pass prevResult on.
func (e Edge) Add(args *skel.CmdArgs) error {
	c, err := Load(args.StdinData, args.Args)
	if err != nil {
		return wire(err)
	}
	if c.PrevResult == nil {
		return wire(badConfig("portmap-ingress is a chained plugin: it needs a prevResult (put it after the main plugin)"))
	}
	ips, hostIfs := containerIPs(c.PrevResult)
	if len(c.Mappings) > 0 && len(ips) == 0 {
		return wire(badConfig("prevResult has no container address to publish ports to"))
	}
	err = e.run(c, func(ctx context.Context, a *portalloc.Allocator, dp Dataplane) error {
		id := owner(c, args)
		if len(c.Mappings) == 0 {
			return nil
		}
		res, err := a.Allocate(ctx, id, c.spec())
		if err != nil {
			return err
		}
		for _, f := range res.Findings {
			fmt.Fprintln(os.Stderr, "portmap-ingress:", f)
		}
		var desc []string
		for i, p := range res.Ports {
			desc = append(desc, fmt.Sprintf("%s %s/%d->%d", p.Mode, p.Protocol, p.Number, c.Mappings[i].ContainerPort))
		}
		fmt.Fprintf(os.Stderr, "portmap-ingress: %s published %s\n", id, strings.Join(desc, ", "))
		if err := dp.Add(ctx, id.String(), rulesFor(res.Ports, c, ips)); err != nil {
			// All or nothing: give the ports back.
			_ = dp.Remove(ctx, id.String())
			if _, rerr := a.Release(context.WithoutCancel(ctx), id); rerr != nil {
				err = errors.Join(err, fmt.Errorf("releasing the ports again: %w", rerr))
			}
			return err
		}
		return enableRouteLocalnet(hostIfs)
	})
	if err != nil {
		return wire(err)
	}
	out := e.Stdout
	if out == nil {
		out = os.Stdout
	}
	r, err := c.PrevResult.GetAsVersion(c.CNIVersion)
	if err != nil {
		return wire(badConfig("cannot express the result as CNI %s: %v", c.CNIVersion, err))
	}
	return wire(r.PrintTo(out))
}

// Del is the DEL verb: remove the rules, release the ports; succeeds when
// there is nothing left.
func (e Edge) Del(args *skel.CmdArgs) error {
	c, err := Load(args.StdinData, args.Args)
	if err != nil {
		return wire(err)
	}
	return wire(e.run(c, func(ctx context.Context, a *portalloc.Allocator, dp Dataplane) error {
		id := owner(c, args)
		return errors.Join(dp.Remove(ctx, id.String()), func() error { _, err := a.Release(ctx, id); return err }())
	}))
}

// Check is the CHECK verb: the allocation is there, matches the request,
// and every rule is installed.
func (e Edge) Check(args *skel.CmdArgs) error {
	c, err := Load(args.StdinData, args.Args)
	if err != nil {
		return wire(err)
	}
	ips, _ := containerIPs(c.PrevResult)
	return wire(e.run(c, func(ctx context.Context, a *portalloc.Allocator, dp Dataplane) error {
		id := owner(c, args)
		ep, ok, err := a.Lookup(ctx, id)
		if err != nil {
			return err
		}
		if len(c.Mappings) == 0 && !ok {
			return nil
		}
		if !ok {
			return fmt.Errorf("%w: %s publishes no port", ErrCheckFailed, id)
		}
		want := c.spec()
		if len(want) != len(ep.Spec) {
			return fmt.Errorf("%w: %s holds %d ports, the request has %d", ErrCheckFailed, id, len(ep.Spec), len(want))
		}
		for i := range want {
			if want[i] != ep.Spec[i] {
				return fmt.Errorf("%w: %s holds %+v for %+v", ErrCheckFailed, id, ep.Ports[i], want[i])
			}
		}
		have, err := dp.Owners(ctx)
		if err != nil {
			return err
		}
		got := map[Rule]bool{}
		for _, r := range have[id.String()] {
			got[r] = true
		}
		for _, r := range rulesFor(ep.Ports, c, ips) {
			if !got[r] {
				return fmt.Errorf("%w: the forward %s/%d -> %s:%d is missing", ErrCheckFailed, r.Protocol, r.HostPort, r.ContainerIP, r.ContainerPort)
			}
		}
		return nil
	}))
}

// GC is the GC verb (CNI 1.1): rules and allocations of this network's
// attachments on this host that the runtime no longer lists go.
func (e Edge) GC(args *skel.CmdArgs) error {
	c, err := Load(args.StdinData, args.Args)
	if err != nil {
		return wire(err)
	}
	if !c.HasValid {
		return nil // no list of valid attachments: nothing can be judged stale
	}
	return wire(e.run(c, func(ctx context.Context, a *portalloc.Allocator, dp Dataplane) error {
		keep := map[string]bool{}
		for _, v := range c.Valid {
			keep[portalloc.EndpointID{Network: c.Network, ContainerID: v.ContainerID, IfName: v.IfName}.String()] = true
		}
		stale := map[string]bool{}
		have, err := dp.Owners(ctx)
		if err != nil {
			return err
		}
		for o := range have {
			if id, ok := portalloc.ParseEndpointID(o); ok && id.Network == c.Network && !keep[o] {
				stale[o] = true
			}
		}
		eps, err := a.Endpoints(ctx, c.Network)
		if err != nil {
			return err
		}
		for id, ep := range eps {
			if ep.Host == c.Host && !keep[id.String()] {
				stale[id.String()] = true
			}
		}
		var errs []error
		for o := range stale {
			id, _ := portalloc.ParseEndpointID(o)
			errs = append(errs, dp.Remove(ctx, o))
			if ep, ok := eps[id]; !ok || ep.Host == c.Host {
				if _, err := a.Release(ctx, id); err != nil {
					errs = append(errs, err)
				}
			}
		}
		return errors.Join(errs...)
	}))
}

// Status is the STATUS verb: the store answers and nftables is there.
func (e Edge) Status(args *skel.CmdArgs) error {
	c, err := Load(args.StdinData, args.Args)
	if err != nil {
		return wire(err)
	}
	err = e.run(c, func(ctx context.Context, a *portalloc.Allocator, dp Dataplane) error {
		_, err := dp.Owners(ctx)
		return err
	})
	if err != nil && !errors.Is(err, ErrBadConfig) {
		return types.NewError(50, err.Error(), "")
	}
	return wire(err)
}

// CNIError maps errors to CNI codes at the edge.
func CNIError(err error) *types.Error {
	var te *types.Error
	switch {
	case errors.As(err, &te):
		return te
	case errors.Is(err, ErrBadConfig), errors.Is(err, portalloc.ErrInvalid):
		return types.NewError(types.ErrInvalidNetworkConfig, err.Error(), "")
	case errors.Is(err, ErrCheckFailed):
		return types.NewError(CodeCheck, err.Error(), "")
	case errors.Is(err, portalloc.ErrInUse):
		return types.NewError(CodeInUse, err.Error(), "")
	case errors.Is(err, portalloc.ErrDuplicate):
		return types.NewError(CodeDuplicate, err.Error(), "")
	case errors.Is(err, portalloc.ErrExhausted):
		return types.NewError(CodeExhausted, err.Error(), "")
	case errors.Is(err, store.ErrUnavailable), errors.Is(err, portalloc.ErrTryAgain), errors.Is(err, context.DeadlineExceeded):
		return types.NewError(types.ErrTryAgainLater, err.Error(), "")
	}
	return types.NewError(types.ErrInternal, err.Error(), "")
}

func wire(err error) error {
	if err == nil {
		return nil
	}
	return CNIError(err)
}
