package pool

import (
	"context"
	"fmt"

	"github.com/ringipam/ringipam/pkg/store"
)

// ReclaimGuard reads host's liveness key and returns the conditions that
// every commit reclaiming something of host carries: the key as read
// (absent), so that no such commit lands once the host is back. It fails
// with ErrHostLive when the key exists, unless force; a forced guard
// still holds only while the key is unchanged (an agent that starts again
// writes it anew). Reclaim takes its guard here, and so do the reclaims of
// a host's other state (its published ports: portalloc.ReleaseHost), so the
// cluster has one notion of a host being back.
func (a *Allocator) ReclaimGuard(ctx context.Context, host string, force bool) ([]store.Cond, error) {
	if err := validName("host", host); err != nil {
		return nil, err
	}
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	live, err := a.get(ctx, LivenessKey(host))
	if err != nil {
		return nil, err
	}
	if live[0].Exists() && !force {
		return nil, fmt.Errorf("%w: %s has a live liveness record; stop its agent, wait for its lease to expire, or force", ErrHostLive, host)
	}
	return []store.Cond{store.Unchanged(live[0])}, nil
}
