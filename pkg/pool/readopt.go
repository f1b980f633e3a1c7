package pool

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/ringipam/ringipam/pkg/store"
)

// ErrNotLive: Readopt needs this host's liveness key to exist.
var ErrNotLive = errors.New("this host's liveness key does not exist")

// Readopt is what a host that is back does about a reclaim it cut short
// (seed 004): a sweep tombstoned its ranges and dropped its state (and
// count) in each pool, and the host's agent took its liveness key again
// before its owners there were released. Every later reclaim commit is
// refused (they require the key absent), so those owners would stay in
// tombstoned ranges, uncounted, until their containers go. Readopt gives
// each address such an owner holds back to the host (the one address, not
// the tombstoned range around it, which others may be claiming) and sets
// the host's used count in the pool to what its owners hold there.
//
// It runs on the host itself, after its agent takes its liveness key (the
// agent calls it once per lease taken, until it succeeds); it releases
// nothing and touches nothing of another host. Each pool changes in one
// commit conditioned on the liveness key as read (present), the ring and
// the host's state, so no reclaim commit and no allocation or release of
// the host lands between its reads and its commit; the liveness key is
// read before the owners, so every reclaim commit came before those reads,
// and so are each pool's ring and state, so every allocation or release
// that the owners read misses changes the state and refuses the commit.
// It returns the pools it changed; none when nothing was cut short.
func (a *Allocator) Readopt(ctx context.Context) ([]string, error) {
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	var changed []string
	err := a.run(ctx, func(int) error {
		changed = changed[:0]
		live, err := a.get(ctx, LivenessKey(a.host))
		if err != nil {
			return err
		}
		if !live[0].Exists() {
			return fmt.Errorf("%w: readopting %s's owners", ErrNotLive, a.host)
		}
		// Each pool's ring and host state are read before the owners: an
		// allocation or release of this host that commits after these
		// reads changes the host state, so the commit below is refused
		// and the whole readoption runs again; one that committed before
		// them is among the owners read next.
		defs, err := a.st.Scan(ctx, prefixDef, store.PrefixEnd(prefixDef), 0)
		if err != nil {
			return err
		}
		type poolRead struct {
			name string
			r    ring
			kvs  []store.KV
		}
		pools := make([]poolRead, 0, len(defs))
		for _, kv := range defs {
			p := strings.TrimPrefix(kv.Key, prefixDef)
			_, r, kvs, err := a.readRing(ctx, p, hostKey(p, a.host))
			if err != nil {
				return err
			}
			pools = append(pools, poolRead{p, r, kvs})
		}
		held, _, err := a.hostOwners(ctx, a.host, "", "")
		if err != nil {
			return err
		}
		mine := map[string][]u128{} // pool -> addresses this host's owners hold there
		for _, h := range held {
			if h.rec.Host != a.host {
				continue
			}
			for _, x := range h.rec.Addrs {
				mine[x.Pool] = append(mine[x.Pool], toU128(x.Addr))
			}
		}
		for _, pr := range pools {
			p, r, kvs := pr.name, pr.r, pr.kvs
			out := r
			for _, v := range mine[p] {
				if t := out.ownerOf(v); t.Host == a.host && t.Tomb {
					out = out.assign(v, v, a.host)
				}
			}
			var hs hostState
			if kvs[2].Exists() {
				if err := decodeHostState(kvs[2].Value, &hs); err != nil {
					return fmt.Errorf("%s: corrupt host state: %w", kvs[2].Key, err)
				}
			}
			used := uint64(len(mine[p]))
			ringChanged := !slices.Equal(out.tokens, r.tokens)
			if !ringChanged && hs.Used == used && (kvs[2].Exists() || used == 0) {
				continue
			}
			hs.Used = used
			conds := []store.Cond{store.Unchanged(live[0]), store.Unchanged(kvs[1]), store.Unchanged(kvs[2])}
			ops := []store.Op{store.Put(hostKey(p, a.host), encodeHostState(hs))}
			if ringChanged {
				ops = append(ops, store.Put(ringKey(p), encodeTokens(out.tokens)))
			}
			if err := a.st.Commit(ctx, conds, ops); err != nil {
				return err
			}
			changed = append(changed, p)
		}
		return nil
	})
	return changed, err
}
