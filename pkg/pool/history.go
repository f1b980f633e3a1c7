package pool

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/ringipam/ringipam/pkg/store"
)

// History: every commit that allocates, releases, holds or reclaims an
// address also writes one event key for it,
//
//	y/<pool>/<hex address>/<event time, 16 hex digits of Unix nanoseconds>
//
// a blind put in the same transaction (no extra read, one more operation),
// so "who had this address, and when" survives the owners. Keys by time
// never collide for the events of one address (they are commits on the
// same address key, one after the other), so no event is overwritten; the
// history is bounded by CompactHistory (the newest HistoryKeep per address),
// which the host agent runs every hour and `ringctl gc` runs on demand.

// Event is one change of an address's holder.
type Event struct {
	Time   time.Time  `json:"t"`
	What   string     `json:"e"` // alloc, release, hold (released, held for its reservation), reclaim
	Owner  string     `json:"o"` // Owner.String()
	Host   string     `json:"h"`
	Reserv string     `json:"r,omitempty"`
	Addr   netip.Addr `json:"-"`
}

// Event kinds.
const (
	EventAlloc   = "alloc"
	EventRelease = "release"
	EventHold    = "hold"
	EventReclaim = "reclaim"
)

// historyOp is the put that records ev for addr of pool.
func historyOp(pool string, addr netip.Addr, ev Event) store.Op {
	key := historyPrefix(pool, toU128(addr), addr.Is4()) + fmt.Sprintf("%016x", uint64(ev.Time.UnixNano()))
	return store.Put(key, encodeEvent(ev))
}

// HistoryKeep is how many events per address compaction keeps by default.
const HistoryKeep = 16

// CompactHistoryEvery is how often the host agent compacts the history.
const CompactHistoryEvery = time.Hour

// History returns the recorded events of addr in pool, oldest first.
func (a *Allocator) History(ctx context.Context, pool string, addr netip.Addr) ([]Event, error) {
	if err := validName("pool name", pool); err != nil {
		return nil, err
	}
	if !addr.IsValid() {
		return nil, fmt.Errorf("%w: no address given", ErrInvalid)
	}
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	if err := a.ensureLayout(ctx); err != nil {
		return nil, err
	}
	prefix := historyPrefix(pool, toU128(addr), addr.Is4())
	kvs, err := a.st.Scan(ctx, prefix, store.PrefixEnd(prefix), 0)
	if err != nil {
		return nil, err
	}
	out := make([]Event, 0, len(kvs))
	for _, kv := range kvs {
		var ev Event
		if err := json.Unmarshal(kv.Value, &ev); err != nil {
			return nil, fmt.Errorf("%s: corrupt history event: %w", kv.Key, err)
		}
		ev.Addr = addr
		out = append(out, ev)
	}
	slices.SortStableFunc(out, func(a, b Event) int { return a.Time.Compare(b.Time) })
	return out, nil
}

// historyBeyond returns the keys of the events beyond the newest keep per
// address and of those older than maxAge (0: no age limit).
func (a *Allocator) historyBeyond(ctx context.Context, keep int, maxAge time.Duration) ([]string, error) {
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	if err := a.ensureLayout(ctx); err != nil {
		return nil, err
	}
	kvs, err := a.st.Scan(ctx, prefixHistory, store.PrefixEnd(prefixHistory), 0)
	if err != nil {
		return nil, err
	}
	cutoff := int64(0)
	if maxAge > 0 {
		cutoff = a.now().Add(-maxAge).UnixNano()
	}
	type ev struct {
		key string
		t   int64
	}
	byAddr := map[string][]ev{}
	for _, kv := range kvs {
		var e Event
		if err := json.Unmarshal(kv.Value, &e); err != nil {
			continue
		}
		i := strings.LastIndexByte(kv.Key, '/')
		byAddr[kv.Key[:i]] = append(byAddr[kv.Key[:i]], ev{kv.Key, e.Time.UnixNano()})
	}
	var doomed []string
	for _, evs := range byAddr {
		slices.SortFunc(evs, func(a, b ev) int { return cmp.Compare(a.t, b.t) })
		for i, e := range evs {
			if i < len(evs)-keep || e.t < cutoff {
				doomed = append(doomed, e.key)
			}
		}
	}
	return doomed, nil
}

// PlanCompactHistory returns how many events CompactHistory(keep, maxAge)
// would delete now, without deleting any.
func (a *Allocator) PlanCompactHistory(ctx context.Context, keep int, maxAge time.Duration) (int, error) {
	doomed, err := a.historyBeyond(ctx, keep, maxAge)
	return len(doomed), err
}

// CompactHistory deletes events beyond the newest keep per address and
// events older than maxAge (0: no age limit), over every pool, and returns
// how many it deleted. It deletes in commits of at most store.MaxOps keys;
// running it from several processes at once is harmless.
func (a *Allocator) CompactHistory(ctx context.Context, keep int, maxAge time.Duration) (int, error) {
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	doomed, err := a.historyBeyond(ctx, keep, maxAge)
	if err != nil {
		return 0, err
	}
	deleted := 0
	for len(doomed) > 0 {
		n := min(len(doomed), store.MaxOps)
		var ops []store.Op
		for _, k := range doomed[:n] {
			ops = append(ops, store.Delete(k))
		}
		if err := a.st.Commit(ctx, nil, ops); err != nil {
			return deleted, err
		}
		deleted += n
		doomed = doomed[n:]
	}
	return deleted, nil
}
