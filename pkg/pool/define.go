package pool

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/ringipam/ringipam/pkg/store"
)

// Define records each pool definition on first use, reading all of them and
// the pool registry in one round trip and recording the new ones in one
// commit. A pool already recorded with a different definition is an error
// wrapping ErrDefinitionMismatch that shows both, so two hosts can never
// silently split one pool; a new pool whose ranges overlap a recorded one is
// an *OverlapError (which wraps ErrDefinitionMismatch too).
func (a *Allocator) Define(ctx context.Context, defs ...Def) error {
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	canon := make([]Def, len(defs))
	var ks keyset
	ks.add(registryKey)
	for i, d := range defs {
		n, err := d.Normalize()
		if err != nil {
			return err
		}
		canon[i] = n
		ks.add(defKey(n.Name))
	}
	return a.run(ctx, func(int) error {
		kvs, err := a.get(ctx, ks.keys...)
		if err != nil {
			return err
		}
		regKV := ks.kv(kvs, registryKey)
		reg, err := decodeRegistry(regKV)
		if err != nil {
			return err
		}
		var conds []store.Cond
		var ops []store.Op
		for _, d := range canon {
			kv := ks.kv(kvs, defKey(d.Name))
			if kv.Exists() {
				if !sameAsRecorded(kv, d) {
					return mismatch(d.Name, kv.Value, d)
				}
				continue
			}
			if reg, err = reg.admit(d); err != nil {
				return err
			}
			b, _ := json.Marshal(d)
			conds = append(conds, store.Cond{Key: kv.Key})
			ops = append(ops, store.Put(kv.Key, b), store.Put(oldRingKey(d.Name), movedMarker(d.Name)))
		}
		if len(ops) == 0 {
			return nil
		}
		b, _ := json.Marshal(reg)
		conds = append(conds, store.Unchanged(regKV))
		ops = append(ops, store.Put(registryKey, b))
		return a.st.Commit(ctx, conds, ops)
	})
}

// sameAsRecorded reports whether the recorded definition kv is d (Def.Equal).
func sameAsRecorded(kv store.KV, d Def) bool {
	rec, err := parseDef(d.Name, kv.Value)
	return err == nil && rec.Equal(d)
}

// mismatch is the error for a pool recorded with another definition than d.
func mismatch(pool string, recorded []byte, d Def) error {
	b, _ := json.Marshal(d)
	return fmt.Errorf("%w: pool %s is recorded as %s but this host was given %s", ErrDefinitionMismatch, pool, recorded, b)
}

// Definition returns the recorded definition of pool.
func (a *Allocator) Definition(ctx context.Context, pool string) (Def, error) {
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	kvs, err := a.get(ctx, append([]string{defKey(pool)}, a.seenKey()...)...)
	if err != nil {
		return Def{}, err
	}
	if len(kvs) > 1 {
		a.touch(ctx, kvs[1])
	}
	return decodeDef(pool, kvs[0])
}

func decodeDef(pool string, kv store.KV) (Def, error) {
	if !kv.Exists() {
		return Def{}, fmt.Errorf("%w: %s (define it first)", ErrUnknownPool, pool)
	}
	return parseDef(pool, kv.Value)
}

func parseDef(pool string, raw []byte) (Def, error) {
	var d Def
	if err := decodeDefJSON(raw, &d); err != nil {
		return Def{}, fmt.Errorf("pool %s: stored definition is corrupt: %w", pool, err)
	}
	return d, nil
}
