package cli

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/ringipam/ringipam/pkg/containernet"
	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/portalloc"
	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/memory"
)

// The invariants check reports beside pkg/pool's (pool.Inv*) and pkg/
// portalloc's (portalloc.Inv*: port-records, port-clash, port-holder):
// the container networks of seed 003 (pkg/containernet's CheckNet).
const (
	// InvCNetValid: every container network is one (ContainerNet: ip in
	// its subnet, ip not its gateway, the gateway outside the subnet) and
	// is valid against its main pool (CNetValid: CNetPooled or
	// CNetSubnet); its owner's addresses make one network (Decode).
	InvCNetValid = "cnet-valid"
	// InvCNetPair: every two container networks of a main pool have
	// distinct ips and distinct gateways and equal or disjoint subnets
	// (CNetPairValid), and neither's gateway is the other's ip
	// (AddrsDistinct).
	InvCNetPair = "cnet-pair"
)

// cnetInvariant is the name check gives a containernet invariant.
func cnetInvariant(inv string) string {
	switch inv {
	case containernet.InvCNetPairValid, containernet.InvAddrsDistinct:
		return InvCNetPair
	}
	return InvCNetValid
}

// Check reads the whole store and returns every broken invariant, sorted:
// the pool's (pool.Allocator.Audit), the published ports'
// (portalloc.Audit, with the hosts and the CNI attachments the pool knows
// as their holders) and the container networks' (containernet.CheckStore).
// It changes nothing. It reads the store once, at one revision
// (memory.Snapshot), and checks that copy: on a live cluster an ADD
// committed between two reads of a live store would otherwise look like an
// address without an owner record.
func (c *Ctl) Check(ctx context.Context) ([]pool.Violation, error) {
	snap, err := memory.Snapshot(ctx, c.Pool.Store())
	if err != nil {
		return nil, err
	}
	var opts []pool.Option
	if c.Now != nil {
		opts = append(opts, pool.WithClock(c.Now))
	}
	p, err := pool.New(snap, c.Pool.Host(), opts...)
	if err != nil {
		return nil, err
	}
	v, err := p.Audit(ctx)
	if err != nil {
		return nil, err
	}
	defs, allocs, err := p.Records(ctx)
	if err != nil {
		return nil, err
	}
	holders := portalloc.Holders{Hosts: map[string]bool{}, Attachments: map[portalloc.EndpointID]string{}}
	hosts, err := p.Hosts(ctx, c.OrphanAfter)
	switch {
	case errors.Is(err, store.ErrUnavailable) || ctx.Err() != nil:
		return nil, err
	case err != nil:
		// A host record that cannot be read: the hosts of the ports are
		// not checked, and that is a finding of its own.
		v = append(v, pool.Violation{Invariant: pool.InvCorrupt, Detail: fmt.Sprintf("the hosts cannot be read, so the hosts of published ports were not checked: %v", err)})
		holders.Hosts = nil
	}
	for _, h := range hosts {
		holders.Hosts[h.Name] = true
	}
	for _, a := range allocs {
		if a.Owner.Kind == pool.KindCNI {
			holders.Attachments[portalloc.EndpointID{Network: a.Owner.Network, ContainerID: a.Owner.ContainerID, IfName: a.Owner.IfName}] = a.Host
		}
	}
	findings, err := portalloc.Audit(ctx, snap, holders)
	if err != nil {
		return nil, err
	}
	for _, f := range findings {
		v = append(v, pool.Violation{Invariant: f.Invariant, Detail: f.Detail})
	}
	for _, x := range containernet.CheckStore(defs, allocs) {
		v = append(v, pool.Violation{Invariant: cnetInvariant(x.Invariant), Pool: x.Pool, Detail: x.Error()})
	}
	slices.SortFunc(v, func(x, y pool.Violation) int {
		return cmp.Or(cmp.Compare(x.Invariant, y.Invariant), cmp.Compare(x.Pool, y.Pool), cmp.Compare(x.Detail, y.Detail))
	})
	return slices.Compact(v), nil
}
