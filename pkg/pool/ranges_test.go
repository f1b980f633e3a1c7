package pool

import (
	"context"
	"strings"
	"testing"

	"github.com/ringipam/ringipam/pkg/store"
)

// putRing makes r pool def's ring in st, as claims would have left it:
// every range key of the pool replaced by r's owned and tombstoned
// ranges, and each host's state listing its live ranges (a state is
// created for a host that has none, with states' Used when given).
func putRing(t testing.TB, st store.Store, def Def, r ring, used map[string]uint64) {
	t.Helper()
	ctx := context.Background()
	is4 := def.is4()
	old, err := st.Scan(ctx, rangePrefix(def.Name), store.PrefixEnd(rangePrefix(def.Name)), 0)
	if err != nil {
		t.Fatal(err)
	}
	var ops []store.Op
	flush := func(force bool) {
		if len(ops) >= store.MaxOps || force && len(ops) > 0 {
			if err := st.Commit(ctx, nil, ops); err != nil {
				t.Fatal(err)
			}
			ops = nil
		}
	}
	for _, kv := range old {
		ops = append(ops, store.Delete(kv.Key))
		flush(false)
	}
	own := map[string][]span{}
	for i, tok := range r.tokens {
		if tok.Host == "" {
			continue
		}
		s := r.spanOf(i)
		ops = append(ops, store.Put(rangeKey(def.Name, s.hi, is4), rangeKV{span: s, host: tok.Host, tomb: tok.Tomb}.encode(is4)))
		flush(false)
		if !tok.Tomb {
			own[tok.Host] = append(own[tok.Host], s)
		}
	}
	states, err := st.Scan(ctx, hostPrefix(def.Name), store.PrefixEnd(hostPrefix(def.Name)), 0)
	if err != nil {
		t.Fatal(err)
	}
	have := map[string]hostState{}
	for _, kv := range states {
		var hs hostState
		if err := decodeHostState(kv.Value, &hs); err != nil {
			t.Fatal(err)
		}
		have[strings.TrimPrefix(kv.Key, hostPrefix(def.Name))] = hs
	}
	hosts := map[string]bool{}
	for h := range have {
		hosts[h] = true
	}
	for h := range own {
		hosts[h] = true
	}
	for h := range hosts {
		hs, ok := have[h]
		if !ok {
			hs.Used = used[h]
		}
		hs.setSpans(own[h], is4)
		hs.Layout = stateLayout
		ops = append(ops, store.Put(hostKey(def.Name, h), encodeHostState(hs)))
		flush(false)
	}
	flush(true)
}

// readTestRing reads pool's ring from st.
func readTestRing(t testing.TB, st store.Store, pool string) (Def, ring) {
	t.Helper()
	a, err := New(st, "reader")
	if err != nil {
		t.Fatal(err)
	}
	def, r, _, err := a.readRing(context.Background(), pool)
	if err != nil {
		t.Fatal(err)
	}
	return def, r
}
