package storetest_test

import (
	"context"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/memory"
	"github.com/ringipam/ringipam/pkg/store/storetest"
)

// The suite must be able to fail: each mutant below breaks one promise of
// the contract, and running the suite against it in a child process must
// fail in the subtest that guards that promise.

const mutantEnv = "RINGIPAM_STORETEST_MUTANT"

type mutant struct {
	*memory.Store
	commit func(m *memory.Store, ctx context.Context, conds []store.Cond, ops []store.Op) error
	scan   func(kvs []store.KV, limit int) []store.KV
	// speculate replaces CommitOrGet.
	speculate func(m *memory.Store, ctx context.Context, conds []store.Cond, same []store.KV, ops []store.Op, read []string) (int64, []store.KV, error)
}

func (m mutant) CommitOrGet(ctx context.Context, conds []store.Cond, same []store.KV, ops []store.Op, read []string) (int64, []store.KV, error) {
	if m.speculate != nil {
		return m.speculate(m.Store, ctx, conds, same, ops, read)
	}
	return m.Store.CommitOrGet(ctx, conds, same, ops, read)
}

func (m mutant) Commit(ctx context.Context, conds []store.Cond, ops []store.Op) error {
	if m.commit != nil {
		return m.commit(m.Store, ctx, conds, ops)
	}
	return m.Store.Commit(ctx, conds, ops)
}

func (m mutant) Scan(ctx context.Context, from, to string, limit int) ([]store.KV, error) {
	if m.scan == nil {
		return m.Store.Scan(ctx, from, to, limit)
	}
	kvs, err := m.Store.Scan(ctx, from, to, 0)
	if err != nil {
		return nil, err
	}
	return m.scan(kvs, limit), nil
}

var mutants = map[string]struct {
	make     func() store.Store
	failures []string // subtests that must fail
}{
	"ignores conditions": {
		func() store.Store {
			return mutant{Store: memory.New(), commit: func(m *memory.Store, ctx context.Context, _ []store.Cond, ops []store.Op) error {
				// As slow as a real round trip, so that concurrent
				// read-modify-writes overlap whatever the machine's load
				// (on an idle fast path they may happen not to).
				time.Sleep(200 * time.Microsecond)
				return m.Commit(ctx, nil, ops)
			}}
		},
		[]string{"CreateIfAbsent", "StaleConditionWritesNothing", "ConcurrentCASIncrements"},
	},
	"writes before checking": {
		func() store.Store {
			return mutant{Store: memory.New(), commit: func(m *memory.Store, ctx context.Context, conds []store.Cond, ops []store.Op) error {
				if err := m.Commit(ctx, nil, ops[:len(ops)/2]); err != nil {
					return err
				}
				return m.Commit(ctx, conds, ops[len(ops)/2:])
			}}
		},
		[]string{"StaleConditionWritesNothing"},
	},
	"scan unsorted and unlimited": {
		func() store.Store {
			return mutant{Store: memory.New(), scan: func(kvs []store.KV, _ int) []store.KV {
				slices.Reverse(kvs)
				return kvs
			}}
		},
		[]string{"ScanOrderBoundsLimit", "ScanBinaryKeysAndPrefixEnd"},
	},
	"speculates without checking values": {
		func() store.Store {
			return mutant{Store: memory.New(), speculate: func(m *memory.Store, ctx context.Context, conds []store.Cond, _ []store.KV, ops []store.Op, read []string) (int64, []store.KV, error) {
				return m.CommitOrGet(ctx, conds, nil, ops, read)
			}}
		},
		[]string{"CommitOrGet"},
	},
	"speculation answers nothing when it fails": {
		func() store.Store {
			return mutant{Store: memory.New(), speculate: func(m *memory.Store, ctx context.Context, conds []store.Cond, same []store.KV, ops []store.Op, read []string) (int64, []store.KV, error) {
				rev, _, err := m.CommitOrGet(ctx, conds, same, ops, read)
				return rev, nil, err
			}}
		},
		[]string{"CommitOrGet"},
	},
	"speculation tells the revision before its commit": {
		func() store.Store {
			return mutant{Store: memory.New(), speculate: func(m *memory.Store, ctx context.Context, conds []store.Cond, same []store.KV, ops []store.Op, read []string) (int64, []store.KV, error) {
				rev, kvs, err := m.CommitOrGet(ctx, conds, same, ops, read)
				if err == nil {
					rev--
				}
				return rev, kvs, err
			}}
		},
		[]string{"CommitOrGet"},
	},
	"speculation ignores revision conditions": {
		func() store.Store {
			return mutant{Store: memory.New(), speculate: func(m *memory.Store, ctx context.Context, conds []store.Cond, same []store.KV, ops []store.Op, read []string) (int64, []store.KV, error) {
				var kept []store.Cond
				for _, c := range conds {
					if c.IsRange() || c.Revision == 0 {
						kept = append(kept, c)
					}
				}
				return m.CommitOrGet(ctx, kept, same, ops, read)
			}}
		},
		[]string{"CommitOrGet"},
	},
	"checks a range condition on its first key only": {
		func() store.Store {
			return mutant{Store: memory.New(), commit: func(m *memory.Store, ctx context.Context, conds []store.Cond, ops []store.Op) error {
				if err := store.CheckCommit(conds, ops); err != nil {
					return err
				}
				var point []store.Cond
				for _, c := range conds {
					point = append(point, store.Cond{Key: c.Key, Revision: c.Revision})
				}
				return m.Commit(ctx, point, ops)
			}}
		},
		[]string{"RangeAbsent"},
	},
	"counts a key at a range's end": {
		func() store.Store {
			return mutant{Store: memory.New(), commit: func(m *memory.Store, ctx context.Context, conds []store.Cond, ops []store.Op) error {
				if err := store.CheckCommit(conds, ops); err != nil {
					return err
				}
				var wider []store.Cond
				for _, c := range conds {
					if c.IsRange() {
						c.End += "\x00"
					}
					wider = append(wider, c)
				}
				return m.Commit(ctx, wider, ops)
			}}
		},
		[]string{"RangeAbsent"},
	},
	"no size limit": {
		func() store.Store {
			return mutant{Store: memory.New(), commit: func(m *memory.Store, ctx context.Context, conds []store.Cond, ops []store.Op) error {
				for len(conds)+len(ops) > store.MaxOps {
					if err := m.Commit(ctx, nil, ops[:1]); err != nil {
						return err
					}
					ops = ops[1:]
				}
				return m.Commit(ctx, conds, ops)
			}}
		},
		[]string{"CommitLimits"},
	},
}

// TestMutantChild runs the contract suite on the mutant a child of
// TestSuiteCatchesMutants names; run on its own it is the control: the
// same suite, with the same concurrency, passes on the correct store.
func TestMutantChild(t *testing.T) {
	newStore := func() store.Store { return memory.New() }
	if name := os.Getenv(mutantEnv); name != "" {
		m, ok := mutants[name]
		if !ok {
			t.Fatalf("no mutant %q", name)
		}
		newStore = m.make
	}
	storetest.Run(t, func(*testing.T) store.Store { return newStore() }, storetest.Concurrency(8, 10))
}

func TestSuiteCatchesMutants(t *testing.T) {
	if os.Getenv(mutantEnv) != "" {
		return
	}
	for name, m := range mutants {
		t.Run(name, func(t *testing.T) {
			cmd := exec.Command(os.Args[0], "-test.run=^TestMutantChild$", "-test.v", "-test.timeout=2m")
			cmd.Env = append(os.Environ(), mutantEnv+"="+name)
			out, err := cmd.CombinedOutput()
			if err == nil {
				t.Fatalf("the suite passed a store that %s:\n%s", name, out)
			}
			for _, sub := range m.failures {
				if !strings.Contains(string(out), "--- FAIL: TestMutantChild/"+sub+" ") {
					t.Errorf("subtest %s did not catch a store that %s", sub, name)
				}
			}
			if t.Failed() {
				t.Logf("child output:\n%s", out)
			}
		})
	}
}
