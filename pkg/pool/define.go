package pool

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/ringipam/ringipam/pkg/store"
)

// Define records each pool definition on first use, reading all of them in
// one round trip and recording the new ones in one commit. A pool already
// recorded with a different definition is an error wrapping
// ErrDefinitionMismatch that shows both, so two hosts can never silently
// split one pool.
func (a *Allocator) Define(ctx context.Context, defs ...Def) error {
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	keys := make([]string, len(defs))
	wants := make([][]byte, len(defs))
	for i, d := range defs {
		n, err := d.Normalize()
		if err != nil {
			return err
		}
		if wants[i], err = json.Marshal(n); err != nil {
			return err
		}
		keys[i] = defKey(n.Name)
	}
	return a.run(ctx, func(int) error {
		kvs, err := a.st.Get(ctx, keys...)
		if err != nil {
			return err
		}
		var conds []store.Cond
		var ops []store.Op
		for i, kv := range kvs {
			if kv.Exists() {
				if string(kv.Value) != string(wants[i]) {
					return fmt.Errorf("%w: pool %s is recorded as %s but this host was given %s", ErrDefinitionMismatch, defs[i].Name, kv.Value, wants[i])
				}
				continue
			}
			conds = append(conds, store.Cond{Key: kv.Key})
			ops = append(ops, store.Put(kv.Key, wants[i]))
		}
		if len(ops) == 0 {
			return nil
		}
		return a.st.Commit(ctx, conds, ops)
	})
}

// Definition returns the recorded definition of pool.
func (a *Allocator) Definition(ctx context.Context, pool string) (Def, error) {
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	kvs, err := a.st.Get(ctx, defKey(pool))
	if err != nil {
		return Def{}, err
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
	if err := json.Unmarshal(raw, &d); err != nil {
		return Def{}, fmt.Errorf("pool %s: stored definition is corrupt: %w", pool, err)
	}
	return d, nil
}
