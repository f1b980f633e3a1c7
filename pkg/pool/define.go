package pool

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/ringipam/ringipam/pkg/store"
)

// Define records each pool definition on first use. A pool already recorded
// with a different definition is an error wrapping ErrDefinitionMismatch that
// shows both, so two hosts can never silently split one pool.
func (a *Allocator) Define(ctx context.Context, defs ...Def) error {
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	for _, d := range defs {
		n, err := d.Normalize()
		if err != nil {
			return err
		}
		want, err := json.Marshal(n)
		if err != nil {
			return err
		}
		err = a.run(ctx, func(int) error {
			kvs, err := a.st.Get(ctx, defKey(n.Name))
			if err != nil {
				return err
			}
			if kvs[0].Exists() {
				if string(kvs[0].Value) != string(want) {
					return fmt.Errorf("%w: pool %s is recorded as %s but this host was given %s", ErrDefinitionMismatch, n.Name, kvs[0].Value, want)
				}
				return nil
			}
			return a.st.Commit(ctx, []store.Cond{{Key: defKey(n.Name)}}, []store.Op{store.Put(defKey(n.Name), want)})
		})
		if err != nil {
			return err
		}
	}
	return nil
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
	var d Def
	if err := json.Unmarshal(kv.Value, &d); err != nil {
		return Def{}, fmt.Errorf("pool %s: stored definition is corrupt: %w", pool, err)
	}
	return d, nil
}
