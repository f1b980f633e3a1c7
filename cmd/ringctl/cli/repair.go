package cli

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/portalloc"
)

// ReleaseArgs names what release frees: the owner holding Addr (in Pool,
// when several isolated pools hold it), or every owner Owner matches.
type ReleaseArgs struct {
	Addr  netip.Addr
	Pool  string
	Owner *OwnerMatch
	// NoHold drops the hold a reservation would keep after the release, so
	// the addresses are free at once.
	NoHold bool
}

// Release frees owners' allocations (or, with dry, says which it would).
// An owner with a reservation name keeps its addresses held for that name,
// as on a DEL, unless args.NoHold.
func (c *Ctl) Release(ctx context.Context, args ReleaseArgs, dry bool) (Actions, error) {
	out := Actions{DryRun: dry, Actions: []Action{}}
	owners, err := c.releaseTargets(ctx, args, &out)
	if err != nil {
		return out, err
	}
	for _, o := range owners {
		plan, ok, err := c.Pool.PlanRelease(ctx, o)
		if err != nil {
			return out, err
		}
		if !ok {
			continue
		}
		hold := plan.Hold && !args.NoHold
		if dry {
			out.add(releaseAction(plan.Allocation, hold, c.Pool))
			continue
		}
		got, ok, err := c.Pool.Release(ctx, o)
		if err != nil {
			return out, fmt.Errorf("releasing %s: %w", o, err)
		}
		if !ok {
			continue // released by someone else meanwhile
		}
		if plan.Hold && args.NoHold {
			if _, err := c.Pool.DropHold(ctx, o.Kind, o.Network, got.Reservation); err != nil {
				return out, fmt.Errorf("dropping the hold of reservation %s after releasing %s: %w", got.Reservation, o, err)
			}
		}
		out.add(releaseAction(got, hold, c.Pool))
	}
	if len(out.Actions) == 0 {
		out.note("nothing to release")
	}
	return out, nil
}

func releaseAction(al pool.Allocation, hold bool, a *pool.Allocator) Action {
	x := Action{Do: "release", Target: al.Owner.String(), Host: al.Host, Pools: poolsOf(al), Addrs: addrsOf(al)}
	if hold {
		x.Detail = fmt.Sprintf("then held for reservation %s for %s", al.Reservation, a.ReservationHold())
	}
	return x
}

func (c *Ctl) releaseTargets(ctx context.Context, args ReleaseArgs, out *Actions) ([]pool.Owner, error) {
	if args.Owner != nil {
		if o, ok := args.Owner.Exact(); ok {
			if _, held, err := c.Pool.Lookup(ctx, o); err != nil || held {
				return []pool.Owner{o}, err
			}
		}
		list, err := c.Pool.List(ctx, pool.Filter{Kind: args.Owner.Kind, Network: args.Owner.Network})
		if err != nil {
			return nil, err
		}
		var owners []pool.Owner
		for _, al := range list {
			if args.Owner.Matches(al.Owner) {
				owners = append(owners, al.Owner)
			}
		}
		return owners, nil
	}
	d, err := c.findPool(ctx, args.Addr, args.Pool)
	if err != nil {
		return nil, err
	}
	holder, ok, err := c.Pool.HolderOf(ctx, d.Name, args.Addr)
	if err != nil {
		return nil, err
	}
	if !ok {
		out.note("%s in pool %s is free", args.Addr, d.Name)
		return nil, nil
	}
	if holder.Owner.ContainerID == "" {
		return nil, fmt.Errorf("%w: %s in pool %s is held for reservation %s (%s network %s), not by an owner: "+
			"free it with `ringctl hold drop %s --kind %s --network %s`", errRefused, args.Addr, d.Name,
			holder.Reservation, holder.Owner.Kind, holder.Owner.Network, holder.Reservation, holder.Owner.Kind, holder.Owner.Network)
	}
	return []pool.Owner{holder.Owner}, nil
}

// HoldDrop frees at once the addresses held for reservation name of (kind,
// network), and forgets the name unless an owner holds it now.
func (c *Ctl) HoldDrop(ctx context.Context, kind pool.Kind, network, name string, dry bool) (Actions, error) {
	out := Actions{DryRun: dry, Actions: []Action{}}
	planned, forget, err := c.Pool.PlanDropHold(ctx, kind, network, name)
	if err != nil {
		return out, err
	}
	holds := planned
	if !dry {
		if holds, err = c.Pool.DropHold(ctx, kind, network, name); err != nil {
			return out, err
		}
	}
	for _, h := range holds {
		out.add(Action{Do: "drop-hold", Target: holdName(h.Kind, h.Network, h.Reservation), Host: h.Host, Pools: []string{h.Pool},
			Addrs: []netip.Addr{h.Addr}, Detail: "held until " + stamp(h.Until)})
	}
	if len(holds) == 0 {
		out.note("reservation %s holds no address", holdName(kind, network, name))
	}
	if forget && len(planned) > 0 {
		out.note("no owner holds the name now, so it is forgotten too")
	}
	return out, nil
}

func holdName(kind pool.Kind, network, name string) string {
	return "reservation " + name + " (" + string(kind) + " network " + network + ")"
}

// RmpeerArgs says how rmpeer takes a host's space back.
type RmpeerArgs struct {
	Host string
	// Force reclaims a host whose agent still holds its liveness lease.
	Force bool
	// Tombstone leaves the host's free space tombstoned (any host claims
	// it as it needs) instead of handing it to the caller's host.
	Tombstone bool
}

// Rmpeer removes a host (Weave's rmpeer): its ranges are tombstoned, its
// owners released (reservations keep their holds), its published ports
// released, and, unless args.Tombstone, its free space handed to this
// ringctl's host.
func (c *Ctl) Rmpeer(ctx context.Context, args RmpeerArgs, dry bool) (Actions, error) {
	out := Actions{DryRun: dry, Actions: []Action{}}
	plan, err := c.Pool.PlanReclaim(ctx, args.Host, args.Force)
	if err != nil {
		return out, refusal(err)
	}
	ports, err := c.endpointsOf(ctx, args.Host)
	if err != nil {
		return out, err
	}
	if err := c.reclaim(ctx, plan, ports, pool.ReclaimOptions{ToCaller: !args.Tombstone, Force: args.Force}, dry, &out); err != nil {
		return out, err
	}
	return out, nil
}

// LeaveArgs says which host leaves.
type LeaveArgs struct {
	Host string
	// Force lets a host leave whose agent still holds its liveness lease.
	Force bool
}

// Leave makes a host leave the ring on purpose (seed 002's `weave reset`,
// for a host being decommissioned): its ranges are tombstoned, its owners
// released as by rmpeer, its published ports released, and the free space
// of each of its ranges goes to the owner of the range before it on the
// ring (or stays tombstoned where there is none). The host is not marked
// orphaned. HOST may be this ringctl's own host.
func (c *Ctl) Leave(ctx context.Context, args LeaveArgs, dry bool) (Actions, error) {
	out := Actions{DryRun: dry, Actions: []Action{}}
	plan, err := c.Pool.PlanLeave(ctx, args.Host, args.Force)
	if err != nil {
		return out, refusal(err)
	}
	ports, err := c.endpointsOf(ctx, args.Host)
	if err != nil {
		return out, err
	}
	if err := c.reclaim(ctx, plan, ports, pool.ReclaimOptions{Leave: true, Force: args.Force}, dry, &out); err != nil {
		return out, err
	}
	return out, nil
}

// reclaim runs (or with dry, lists) one host's reclaim and the release of
// its ports.
func (c *Ctl) reclaim(ctx context.Context, plan pool.ReclaimPlan, ports []endpoint, opt pool.ReclaimOptions, dry bool, out *Actions) error {
	h := plan.Host
	head := func(pools []string) Action {
		return Action{Do: "reclaim", Target: h.Name, Pools: pools,
			Detail: fmt.Sprintf("%s, last seen %s", h.State, stamp(h.LastSeen))}
	}
	handover := Action{Do: "hand-over", Target: h.Name, Host: c.Pool.Host(), Detail: "its free space goes to " + c.Pool.Host()}
	if opt.Leave {
		handover = Action{Do: "hand-over", Target: h.Name, Detail: "its free space goes to the owner of the range before each of its ranges"}
	}
	if dry {
		out.add(head(plan.Pools))
		for _, al := range plan.Owners {
			out.add(Action{Do: "release", Target: al.Owner.String(), Host: al.Host, Pools: poolsOf(al), Addrs: addrsOf(al)})
		}
		if opt.ToCaller || opt.Leave {
			out.add(handover)
		}
		for _, e := range ports {
			out.add(portsAction(e.id, e.rec.Host, e.rec.Ports))
		}
		return nil
	}
	rep, err := c.Pool.Reclaim(ctx, h.Name, opt)
	out.add(head(rep.TombstonedPools))
	for _, al := range rep.ReleasedOwners {
		out.add(Action{Do: "release", Target: al.Owner.String(), Host: al.Host, Pools: poolsOf(al), Addrs: addrsOf(al)})
	}
	if err != nil {
		return refusal(err)
	}
	switch {
	case opt.ToCaller:
		out.add(handover)
		out.note("host %s: %d free ranges handed to %s", h.Name, rep.Handed, c.Pool.Host())
	case opt.Leave:
		out.add(handover)
		out.note("host %s left: %d free ranges handed to the owners of the ranges before them", h.Name, rep.Handed)
	}
	if len(ports) == 0 {
		return nil
	}
	// The pool's guard, as for the owners: a host back meanwhile keeps
	// every port not yet released.
	guard, err := c.Pool.ReclaimGuard(ctx, h.Name, opt.Force)
	if err != nil {
		return refusal(err)
	}
	rel, err := c.Ports.ReleaseHost(ctx, h.Name, guard)
	for _, r := range rel {
		out.add(portsAction(r.ID, h.Name, r.Ports))
	}
	if errors.Is(err, portalloc.ErrGuard) {
		return fmt.Errorf("%w: releasing the published ports of %s: %w", errRefused, h.Name, err)
	}
	if err != nil {
		return fmt.Errorf("releasing the published ports of %s: %w", h.Name, err)
	}
	return nil
}

func portsAction(id portalloc.EndpointID, host string, ports []portalloc.Port) Action {
	var s []string
	for _, p := range ports {
		x := fmt.Sprintf("%s %s/%d", p.Mode, p.Protocol, p.Number)
		if p.HostIP.IsValid() {
			x += " on " + p.HostIP.String()
		}
		s = append(s, x)
	}
	return Action{Do: "release-ports", Target: id.String(), Host: host, Detail: strings.Join(s, ", ")}
}

type endpoint struct {
	id  portalloc.EndpointID
	rec portalloc.Endpoint
}

// endpointsOf returns the port endpoints recorded on host, by id (through
// the host's index of its endpoints).
func (c *Ctl) endpointsOf(ctx context.Context, host string) ([]endpoint, error) {
	if c.Ports == nil {
		return nil, nil
	}
	eps, err := c.Ports.HostEndpoints(ctx, host, "")
	if err != nil {
		return nil, err
	}
	var out []endpoint
	for id, e := range eps {
		if len(e.Ports) > 0 {
			out = append(out, endpoint{id, e})
		}
	}
	slices.SortFunc(out, func(a, b endpoint) int { return strings.Compare(a.id.String(), b.id.String()) })
	return out, nil
}

// GC reclaims every orphaned host (down longer than OrphanAfter) with its
// published ports, removes the keys of holds whose time has ended, compacts
// the address history, repairs the hosts' index of their owners and tidies
// the host-mode ports (portalloc.Tidy: old-format users moved to their
// host's key, markers right, leaked bindings released).
func (c *Ctl) GC(ctx context.Context, dry bool) (Actions, error) {
	out := Actions{DryRun: dry, Actions: []Action{}}
	plans, err := c.Pool.PlanSweep(ctx, c.OrphanAfter)
	if err != nil {
		return out, err
	}
	// Ended holds are read before any reclaim, which may add holds.
	ended, err := c.Pool.EndedHolds(ctx)
	if err != nil {
		return out, err
	}
	for _, p := range plans {
		ports, err := c.endpointsOf(ctx, p.Host.Name)
		if err != nil {
			return out, err
		}
		if err := c.reclaim(ctx, p, ports, pool.ReclaimOptions{}, dry, &out); err != nil {
			return out, err
		}
	}
	for _, h := range ended {
		if !dry {
			ok, err := c.Pool.DropEndedHold(ctx, h)
			if err != nil {
				return out, err
			}
			if !ok {
				continue
			}
		}
		out.add(Action{Do: "drop-ended-hold", Target: holdName(h.Kind, h.Network, h.Reservation), Host: h.Host,
			Pools: []string{h.Pool}, Addrs: []netip.Addr{h.Addr}, Detail: "hold ended " + stamp(h.Until)})
	}
	if err := c.compactHistory(ctx, dry, &out); err != nil {
		return out, err
	}
	if err := c.reindex(ctx, dry, &out); err != nil {
		return out, err
	}
	if err := c.tidyPorts(ctx, dry, &out); err != nil {
		return out, err
	}
	if len(out.Actions) == 0 {
		out.note("nothing to collect: no orphaned host (orphanAfter %s), no ended hold, no history beyond %d events per address, every host's index of its owners and of its port endpoints exact, every host-mode port in its host's key", c.OrphanAfter, pool.HistoryKeep)
	}
	return out, nil
}

// compactHistory deletes the address history beyond the newest
// pool.HistoryKeep events per address (what the host agents do hourly).
func (c *Ctl) compactHistory(ctx context.Context, dry bool, out *Actions) error {
	var n int
	var err error
	if dry {
		n, err = c.Pool.PlanCompactHistory(ctx, pool.HistoryKeep, 0)
	} else {
		n, err = c.Pool.CompactHistory(ctx, pool.HistoryKeep, 0)
	}
	if err != nil || n == 0 {
		return err
	}
	out.add(Action{Do: "compact-history", Target: "address history",
		Detail: fmt.Sprintf("%d events beyond the newest %d per address", n, pool.HistoryKeep)})
	return nil
}

// reindex makes every host's index of its owners match the owner records
// (what an older ringipam may have left while the store was migrated).
func (c *Ctl) reindex(ctx context.Context, dry bool, out *Actions) error {
	var entered, deleted int
	var err error
	if dry {
		entered, deleted, err = c.Pool.PlanReindex(ctx)
	} else {
		entered, deleted, err = c.Pool.Reindex(ctx)
	}
	if err != nil {
		return err
	}
	if entered+deleted > 0 {
		out.add(Action{Do: "reindex", Target: "hosts' owner index",
			Detail: fmt.Sprintf("%d owners entered in their host's index, %d index keys of owners gone deleted", entered, deleted)})
	}
	if c.Ports == nil {
		return nil
	}
	if dry {
		entered, deleted, err = c.Ports.PlanReindex(ctx)
	} else {
		entered, deleted, err = c.Ports.Reindex(ctx)
	}
	if err != nil || entered+deleted == 0 {
		return err
	}
	out.add(Action{Do: "reindex", Target: "hosts' port endpoint index",
		Detail: fmt.Sprintf("%d port endpoints entered in their host's index, %d index keys of endpoints gone deleted", entered, deleted)})
	return nil
}

// tidyPorts runs portalloc's one-off pass over the host-mode ports (what a
// store written by an older ringipam, or a rolling restart, leaves).
func (c *Ctl) tidyPorts(ctx context.Context, dry bool, out *Actions) error {
	if c.Ports == nil {
		return nil
	}
	var t portalloc.Tidied
	var err error
	if dry {
		t, err = c.Ports.PlanTidy(ctx)
	} else {
		t, err = c.Ports.Tidy(ctx)
	}
	if err != nil || t.Total() == 0 {
		return err
	}
	out.add(Action{Do: "tidy-ports", Target: "host-mode ports",
		Detail: fmt.Sprintf("%d old-format host users moved to their host's key, %d markers written, %d stale markers removed, %d leaked bindings released", t.Moved, t.Marked, t.Unmarked, t.Released)})
	return nil
}

// HostAck clears host's orphaned mark (its STATUS then succeeds again): the
// operator acknowledges that the host's old containers lost their addresses.
func (c *Ctl) HostAck(ctx context.Context, host string) (Actions, error) {
	out := Actions{Actions: []Action{}}
	a, err := c.poolAs(host)
	if err != nil {
		return out, err
	}
	at, err := a.AckOrphaned(ctx)
	if err != nil {
		return out, err
	}
	if at.IsZero() {
		out.note("host %s is not marked orphaned", host)
		return out, nil
	}
	out.add(Action{Do: "ack", Target: host, Detail: "orphaned at " + stamp(at) + "; mark cleared"})
	return out, nil
}

// refusal marks the errors of a refused repair (a live host, a host
// reclaiming itself) for the exit code.
func refusal(err error) error {
	if errors.Is(err, pool.ErrHostLive) || errors.Is(err, pool.ErrInvalid) {
		return fmt.Errorf("%w: %w", errRefused, err)
	}
	return err
}
