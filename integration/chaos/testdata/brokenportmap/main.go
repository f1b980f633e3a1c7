// Command brokenportmap is portmap-ingress with a deliberately broken store
// (package broken): every commit drops its revision conditions, the per-port
// ones of the port allocator's commit included, so two hosts that read a
// port free at once both take it. The chaos suite runs against it to show
// that it reports port duplicates when the port allocator is wrong. Its
// barrier holds the first commit that writes a port's key ("p/a/").
//
// It lives under testdata (see package broken). Everything else (config,
// verbs, attachment locks, retry policy, data path, wire errors) is the real
// plugin's.
package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/containernetworking/cni/pkg/skel"

	"github.com/ringipam/ringipam/integration/chaos/testdata/broken"
	"github.com/ringipam/ringipam/pkg/cni/portmap"
	"github.com/ringipam/ringipam/pkg/portalloc"
	"github.com/ringipam/ringipam/pkg/retry"
	"github.com/ringipam/ringipam/pkg/store"
	_ "github.com/ringipam/ringipam/pkg/store/etcd" // storeconfig.Open's etcd backend
	"github.com/ringipam/ringipam/pkg/storeconfig"
)

// open is portmap.OpenConfigured on the broken store, with the same options
// (the retry policy's values are portmap-ingress's contentionRetry).
func open(_ context.Context, c *portmap.Config) (portmap.Opened, error) {
	st, err := storeconfig.Open(c.Store)
	if err != nil {
		return portmap.Opened{}, fmt.Errorf("opening store: %w", err)
	}
	a, err := portalloc.New(broken.New(st, "p/a/"), c.Host, portalloc.WithDynamicRange(c.Lo, c.Hi),
		portalloc.WithRetry(retry.Policy{Attempts: 50, BaseDelay: time.Millisecond, MaxDelay: 80 * time.Millisecond}))
	if err != nil {
		st.Close()
		return portmap.Opened{}, fmt.Errorf("%w: %w", portmap.ErrBadConfig, err)
	}
	dp, err := portmap.NewDataplane(c.Dataplane, c.Table)
	if err != nil && !errors.Is(err, portmap.ErrNoDataplane) {
		st.Close()
		return portmap.Opened{}, err
	}
	return portmap.Opened{Ports: a, Dataplane: dp, Ping: func(ctx context.Context) error { return store.Ping(ctx, st) }, Close: st.Close}, nil
}

func main() {
	skel.PluginMainFuncs(portmap.Edge{Open: open}.Funcs(), portmap.SupportedVersions, "portmap-ingress, broken on purpose (chaos suite only)")
}
