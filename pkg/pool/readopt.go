package pool

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/ringipam/ringipam/pkg/store"
)

// maxReadoptMoves bounds the addresses one commit of Readopt moves out of
// tombstoned ranges.
const maxReadoptMoves = 16

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
// nothing and touches nothing of another host. Each pool changes in a
// commit (one per maxReadoptMoves addresses) conditioned on the liveness
// key as read (present), the range keys it rewrites and the host's state,
// so no reclaim commit and no allocation or release of the host lands
// between its reads and its commit; the liveness key is
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
		// Each pool's host state is read before the owners: an
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
			def  Def
			kvs  []store.KV // the definition, the host state
		}
		pools := make([]poolRead, 0, len(defs))
		for _, kv := range defs {
			p := strings.TrimPrefix(kv.Key, prefixDef)
			kvs, err := a.st.Get(ctx, defKey(p), hostKey(p, a.host))
			if err != nil {
				return err
			}
			def, err := decodeDef(p, kvs[0])
			if err != nil {
				return err
			}
			pools = append(pools, poolRead{p, def, kvs})
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
			p, hostKV := pr.name, pr.kvs[1]
			rest := mine[p]
			for first := true; ; first = false {
				t := &poolTxn{name: p, def: pr.def, hostKV: hostKV}
				if hostKV.Exists() {
					if err := decodeHostState(hostKV.Value, &t.host); err != nil {
						return fmt.Errorf("%s: corrupt host state: %w", hostKV.Key, err)
					}
				}
				if err := a.repairState(ctx, t); err != nil {
					return err
				}
				// At most maxReadoptMoves addresses per commit (each a
				// few range keys), far below store.MaxOps.
				tx := t.ringTxn(a)
				moved := 0
				for len(rest) > 0 && moved < maxReadoptMoves {
					v := rest[0]
					rest = rest[1:]
					r, held, _, err := tx.at(ctx, v)
					if err != nil {
						return err
					}
					if held && r.host == a.host && r.tomb {
						if err := tx.assign(ctx, r, span{v, v}, a.host, false); err != nil {
							return err
						}
						moved++
					}
				}
				used := uint64(len(mine[p]))
				if tx.empty() && t.host.Used == used && (hostKV.Exists() || used == 0) {
					break
				}
				t.host.Used = used
				conds, ops := tx.finish()
				conds = append(conds, store.Unchanged(live[0]), store.Unchanged(hostKV))
				ops = append(ops, putHostState(p, a.host, &t.host)...)
				wrote := encodeHostState(t.host)
				if err := a.st.Commit(ctx, conds, ops); err != nil {
					return err
				}
				if first {
					changed = append(changed, p)
				}
				if len(rest) == 0 {
					break
				}
				// The next batch conditions on the state this one wrote:
				// read again, it must hold those very bytes (an allocation
				// or release of this host in between changed them; then
				// the owners read are stale and everything runs again).
				kvs, err := a.st.Get(ctx, hostKey(p, a.host))
				if err != nil {
					return err
				}
				if string(kvs[0].Value) != string(wrote) {
					return fmt.Errorf("%w: %s changed between two commits of the readoption", store.ErrConflict, hostKey(p, a.host))
				}
				hostKV = kvs[0]
			}
		}
		return nil
	})
	return changed, err
}
