package pool

import (
	"context"
	"strings"

	"github.com/ringipam/ringipam/pkg/store"
)

// Pools returns every pool defined in the store, by name, with its
// definition as recorded (one range read).
func (a *Allocator) Pools(ctx context.Context) ([]Def, error) {
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	if err := a.ensureLayout(ctx); err != nil {
		return nil, err
	}
	kvs, err := a.st.Scan(ctx, prefixDef, store.PrefixEnd(prefixDef), 0)
	if err != nil {
		return nil, err
	}
	out := make([]Def, 0, len(kvs))
	for _, kv := range kvs {
		d, err := parseDef(strings.TrimPrefix(kv.Key, prefixDef), kv.Value)
		if err != nil {
			return nil, err
		}
		out = append(out, d)
	}
	return out, nil
}
