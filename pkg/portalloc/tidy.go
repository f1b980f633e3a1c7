package portalloc

import (
	"context"
	"encoding/json"
	"errors"
	"maps"
	"slices"
	"strings"

	"github.com/ringipam/ringipam/pkg/retry"
	"github.com/ringipam/ringipam/pkg/store"
)

// Tidied counts what Tidy did (or, dry, would do).
type Tidied struct {
	Moved    int // old-format host users moved from p/a/ to their host's p/h/ key
	Marked   int // markers written (bindings under p/h/ whose p/a/ record lacked one)
	Unmarked int // stale markers removed (no binding left under p/h/)
	Released int // host-mode bindings whose endpoint record is gone (leaked), released
}

func (t Tidied) add(o Tidied) Tidied {
	return Tidied{t.Moved + o.Moved, t.Marked + o.Marked, t.Unmarked + o.Unmarked, t.Released + o.Released}
}

// Total is the number of changes.
func (t Tidied) Total() int { return t.Moved + t.Marked + t.Unmarked + t.Released }

// tidyBatch is how many hosts' p/h/ keys one Tidy commit writes.
const tidyBatch = 20

// Tidy is the one-off pass of the host-ports layout (ringctl gc): every
// old-format host user an older ringipam listed in p/a/ is moved to its
// host's p/h/ key, a marker is written where bindings lack one and removed
// where none is left, and a host-mode binding whose endpoint record is
// absent (leaked: an older plugin released the record after the binding
// had moved) is released. Each address is settled in commits conditioned
// on everything they read (the p/a/ record, the p/h/ keys written, the
// absent records, the absence of other p/h/ keys when the marker goes), so
// it is safe beside running allocators of either version and idempotent.
// It reads the whole of p/: run it once the rolling restart is over (an
// older plugin still running would find the users it wrote moved away and
// could no longer release them; the bindings left are then released here).
func (a *Allocator) Tidy(ctx context.Context) (Tidied, error) { return a.tidy(ctx, false) }

// PlanTidy counts what Tidy would do, changing nothing.
func (a *Allocator) PlanTidy(ctx context.Context) (Tidied, error) { return a.tidy(ctx, true) }

func (a *Allocator) tidy(ctx context.Context, dry bool) (Tidied, error) {
	kvs, err := a.st.Scan(ctx, "p/", store.PrefixEnd("p/"), 0)
	if err != nil {
		return Tidied{}, err
	}
	records := map[string]bool{} // endpoints recorded (EndpointID.String())
	marked := map[Address]bool{}
	bound := map[Address]bool{}
	todo := map[Address]bool{}
	var names = map[Address][]string{} // endpoints bound at each address
	for _, kv := range kvs {
		switch {
		case strings.HasPrefix(kv.Key, prefixEndpoint):
			if id, ok := endpointOfKey(kv.Key); ok {
				records[id.String()] = true
			}
		case strings.HasPrefix(kv.Key, prefixAddr):
			p, ok, err := decodeAddress(kv)
			if err != nil || !ok {
				continue // Audit reports it
			}
			s, _ := decodeState(kv)
			_, marked[p.Address] = splitMarker(s)
			if len(p.State.Hosts) > 0 {
				todo[p.Address] = true // old-format users to move
			}
		case strings.HasPrefix(kv.Key, prefixHostBind):
			addr, host, ok := parseHostBindKey(kv.Key)
			if !ok {
				continue
			}
			us, err := decodeBindings(kv, host)
			if err != nil {
				continue
			}
			bound[addr] = bound[addr] || len(us) > 0
			for _, u := range us {
				names[addr] = append(names[addr], u.Endpoint)
			}
		}
	}
	for addr, m := range marked {
		if m && !bound[addr] {
			todo[addr] = true
		}
	}
	for addr, b := range bound {
		if b && !marked[addr] {
			todo[addr] = true
		}
		for _, e := range names[addr] {
			if !records[e] {
				todo[addr] = true
			}
		}
	}
	var out Tidied
	var errs []error
	for _, addr := range slices.SortedFunc(maps.Keys(todo), compareAddr) {
		t, err := a.tidyAddress(ctx, addr, dry)
		out = out.add(t)
		if err != nil {
			errs = append(errs, err)
		}
	}
	return out, errors.Join(errs...)
}

// tidyAddress settles one address, tidyBatch hosts a commit, re-reading
// after each commit.
func (a *Allocator) tidyAddress(ctx context.Context, addr Address, dry bool) (Tidied, error) {
	var out Tidied
	prefix := hostBindPrefix(addr)
	for {
		var done bool
		var t Tidied
		err := retry.Do(ctx, a.policy, func(err error) bool { return errors.Is(err, store.ErrConflict) }, func(int) error {
			got, err := a.st.Get(ctx, addrKey(addr))
			if err != nil {
				return err
			}
			akv := got[0]
			rec, err := decodeState(akv)
			if err != nil {
				return err
			}
			legacy, wasMarked := splitMarker(rec)
			hkvs, err := a.st.Scan(ctx, prefix, store.PrefixEnd(prefix), 0)
			if err != nil {
				return err
			}
			hostKV := map[string]store.KV{}
			bindings := map[string][]HostUse{}
			for _, kv := range hkvs {
				_, host, ok := parseHostBindKey(kv.Key)
				if !ok {
					continue
				}
				us, err := decodeBindings(kv, host)
				if err != nil {
					return err
				}
				hostKV[host], bindings[host] = kv, us
			}
			// The endpoint records of every binding: a binding whose record
			// is absent is leaked.
			var ids []string
			var epKeys []string
			for _, u := range append(slices.Concat(slices.Collect(maps.Values(bindings))...), legacy...) {
				if id, ok := ParseEndpointID(u.Endpoint); ok && !slices.Contains(ids, u.Endpoint) {
					ids, epKeys = append(ids, u.Endpoint), append(epKeys, endpointKey(id))
				}
			}
			eps, err := a.st.Get(ctx, epKeys...)
			if err != nil {
				return err
			}
			absent := map[string]store.KV{}
			for i, kv := range eps {
				if !kv.Exists() {
					absent[ids[i]] = kv
				}
			}
			leaked := func(u HostUse) bool { _, ok := absent[u.Endpoint]; return ok }
			// The hosts to settle: those with old-format users or leaked
			// bindings, tidyBatch at a time (all of them when dry).
			var batch []string
			for _, u := range legacy {
				if !slices.Contains(batch, u.Host) {
					batch = append(batch, u.Host)
				}
			}
			for _, h := range slices.Sorted(maps.Keys(bindings)) {
				if slices.ContainsFunc(bindings[h], leaked) && !slices.Contains(batch, h) {
					batch = append(batch, h)
				}
			}
			if !dry && len(batch) > tidyBatch {
				batch = batch[:tidyBatch]
			}
			t = Tidied{}
			var conds []store.Cond
			var ops []store.Op
			var keep []HostUse
			used := map[string]bool{} // leaked endpoints whose absence the commit relies on
			for _, u := range legacy {
				switch {
				case !slices.Contains(batch, u.Host):
					keep = append(keep, u)
				case leaked(u):
					t.Released++
					used[u.Endpoint] = true
				default:
					t.Moved++
				}
			}
			isBound := false
			batchKVs := []store.KV{}
			for _, h := range batch {
				kv, ok := hostKV[h]
				if !ok {
					kv = store.KV{Key: hostBindKey(addr, h)}
				}
				batchKVs = append(batchKVs, kv)
				var next []HostUse
				for _, u := range append(slices.Clone(bindings[h]), legacyOf(legacy, h)...) {
					if leaked(u) {
						if !slices.Contains(legacy, u) {
							t.Released++
						}
						used[u.Endpoint] = true
						continue
					}
					next = append(next, u)
				}
				next = sortedUses(next)
				isBound = isBound || len(next) > 0
				conds = append(conds, store.Unchanged(kv))
				switch {
				case len(next) == 0 && kv.Exists():
					ops = append(ops, store.Delete(kv.Key))
				case len(next) > 0 && !slices.Equal(sortedUses(bindings[h]), next):
					ops = append(ops, store.Put(kv.Key, encodeBindings(next)))
				}
			}
			for h, us := range bindings {
				if !slices.Contains(batch, h) && len(us) > 0 {
					isBound = true
				}
			}
			next := AddrState{Ingress: rec.Ingress, IngressHost: rec.IngressHost, Hosts: keep}
			if isBound {
				next.Hosts = append(next.Hosts, marker)
			}
			switch {
			case isBound && !wasMarked:
				t.Marked++
			case !isBound && wasMarked:
				t.Unmarked++
				conds = append(conds, absentBut(prefix, batchKVs)...)
			}
			switch {
			case next.empty() && akv.Exists():
				ops = append(ops, store.Delete(akv.Key))
			case !next.empty() && !sameState(next, rec):
				b, _ := json.Marshal(next)
				ops = append(ops, store.Put(akv.Key, b))
			}
			done = len(ops) == 0 || dry || len(batch) < tidyBatch
			if len(ops) == 0 || dry {
				if len(ops) == 0 {
					t = Tidied{}
				}
				return nil
			}
			conds = append(conds, store.Unchanged(akv))
			for e := range used {
				conds = append(conds, store.Unchanged(absent[e]))
			}
			return a.st.Commit(ctx, conds, ops)
		})
		if errors.Is(err, retry.ErrExhausted) {
			err = errors.Join(ErrTryAgain, err)
		}
		if err != nil {
			return out, err
		}
		out = out.add(t)
		if done {
			return out, nil
		}
	}
}

func legacyOf(legacy []HostUse, host string) []HostUse {
	var out []HostUse
	for _, u := range legacy {
		if u.Host == host {
			out = append(out, u)
		}
	}
	return out
}
