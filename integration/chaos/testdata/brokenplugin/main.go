// Command brokenplugin is ipam-ring with a deliberately broken store
// (package broken): every commit drops its revision conditions, so a
// decision made on state that changed meanwhile is written anyway (the
// "commit without the revision condition" allocator of issue 14). The chaos
// suite runs against it to show that it reports duplicates when the
// allocator is wrong. Its barrier holds the first commit that writes an
// address key ("a/").
//
// It lives under testdata so that `go build ./...`, `make build` and every
// production binary never contain it: only the chaos suite builds it, by
// its explicit path. Everything else (config, verbs, host lock, retry
// policy, wire errors) is the real plugin's.
package main

import (
	"context"
	"fmt"
	"time"

	"github.com/containernetworking/cni/pkg/skel"

	"github.com/ringipam/ringipam/integration/chaos/testdata/broken"
	"github.com/ringipam/ringipam/pkg/cni/ipam"
	"github.com/ringipam/ringipam/pkg/hostlock"
	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/retry"
	_ "github.com/ringipam/ringipam/pkg/store/etcd" // storeconfig.Open's etcd backend
	"github.com/ringipam/ringipam/pkg/storeconfig"
)

// open is ipam.OpenAllocator on the broken store, with the same
// options (the retry policy's values are ipam-ring's contentionRetry).
func open(_ context.Context, c *ipam.Config) (ipam.Allocator, func() error, error) {
	st, err := storeconfig.Open(c.Store)
	if err != nil {
		return nil, nil, fmt.Errorf("opening store: %w", err)
	}
	a, err := pool.New(broken.New(st, "a/"), c.Host, pool.WithTimeout(c.Timeout),
		pool.WithRetry(retry.Policy{Attempts: 50, BaseDelay: time.Millisecond, MaxDelay: 80 * time.Millisecond}),
		pool.WithHostLock(hostlock.DefaultDir), pool.WithReservationHold(c.ReservationHold))
	if err != nil {
		st.Close()
		return nil, nil, fmt.Errorf("%w: host %q: %w", ipam.ErrBadConfig, c.Host, err)
	}
	return a, st.Close, nil
}

func main() {
	skel.PluginMainFuncs(ipam.Edge{Open: open}.Funcs(), ipam.SupportedVersions, "ipam-ring, broken on purpose (chaos suite only)")
}
