package agent

import (
	"context"
	"net/netip"

	"github.com/ringipam/ringipam/pkg/routes"
	"github.com/ringipam/ringipam/pkg/store"
)

// The scale harness (integration/scale) runs many agents in one process,
// each with a router and a forwarder that touch no kernel. These are the
// test options it needs, exported; nothing in ringipamd uses them.

// HarnessRouter is what an agent installs its routes to other hosts'
// ranges into (the netlink routing table in production).
type HarnessRouter interface {
	OnLink() ([]netip.Prefix, error)
	Apply(rs []routes.Route) (routes.Change, error)
	ProxyARP(subnets []netip.Prefix) ([]string, error)
	Clear() error
	Close()
}

// HarnessForwarder is what an agent installs its ingress forwards into
// (nftables in production).
type HarnessForwarder interface {
	Sync(ctx context.Context, fs []Forward) error
	Remove(ctx context.Context) error
}

// WithHarnessRouter makes the agent install its routes into r.
func WithHarnessRouter(r HarnessRouter) Option { return withRouter(r) }

// WithHarnessForwarder makes the agent install its ingress forwards into f.
func WithHarnessForwarder(f HarnessForwarder) Option { return withForwarder(f) }

// WithHarnessStore runs the agent on st instead of opening cfg.Store
// (the agent then has no etcd client: no lease, no watch).
func WithHarnessStore(st store.Store) Option { return withStore(st) }
