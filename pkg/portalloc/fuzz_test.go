package portalloc

import (
	"context"
	"testing"

	"github.com/ringipam/ringipam/pkg/store/memory"
)

// FuzzPlanAgainstProperties applies a byte-coded sequence of steps
// (endpoint, host, spec of the model check's model) and checks every one
// like the model check: rejections justified, re-applying a spec
// idempotent, allocations consistent.
func FuzzPlanAgainstProperties(f *testing.F) {
	f.Add([]byte{0, 0, 1, 1, 1, 2, 0, 0, 0})
	f.Add([]byte{0, 0, 200, 1, 1, 200, 0, 0, 200, 0, 0, 0})
	f.Fuzz(func(t *testing.T, ops []byte) {
		w := newWalk()
		for i := 0; i+2 < len(ops) && i < 3*200; i += 3 {
			id := []string{me, other}[ops[i]%2]
			if err := w.step(id, int(ops[i+1]), int(ops[i+2])); err != nil {
				t.Fatal(err)
			}
		}
	})
}

// FuzzLayoutSteps drives the layout model's world (layoutmodel_test.go)
// by a byte-coded sequence: each step is an endpoint, a host and a spec,
// and a flag to plan the next step on the same state and commit both in
// turn (a race); h2 runs today's main's code until a step upgrades it.
// After every step the store must audit clean.
func FuzzLayoutSteps(f *testing.F) {
	f.Add([]byte{1, 0, 0, 3, 1, 1, 3, 0, 0, 0, 1, 1, 0, 0})
	f.Add([]byte{0, 0, 0, 7, 1, 1, 1, 7, 0, 0, 0, 0, 0, 1, 1, 0, 0})
	f.Fuzz(func(t *testing.T, ops []byte) {
		if len(ops) == 0 {
			return
		}
		m := newLayoutModel()
		h2Old := ops[0]%2 == 1
		st := memory.New()
		planOne := func(b []byte) lstep {
			id := []string{"e1", "e2"}[b[0]%2]
			host := []string{"h1", "h2"}[b[1]%2]
			if e, ok, _ := (&Allocator{st: st}).Lookup(context.Background(), ep(id)); ok {
				host = e.Host
			}
			step, _ := m.plan(st, id, host, m.specs[int(b[2])%len(m.specs)], host == "h2" && h2Old)
			if step.err != nil && len(step.spec) == 0 {
				t.Fatalf("removal failed: %v", step.err)
			}
			return step
		}
		for i := 1; i+3 < len(ops) && i < 4*100; i += 4 {
			a := planOne(ops[i : i+3])
			race := ops[i+3]%3 == 1 && i+7 < len(ops)
			var b lstep
			if race {
				b = planOne(ops[i+4 : i+7])
			}
			if a.err == nil && !commit(st, a) {
				t.Fatalf("%v: its own commit conflicts", a)
			}
			if race {
				if b.err == nil {
					commit(st, b)
				}
				i += 4
			}
			if err := audit(st); err != nil {
				t.Fatalf("after %v (race %v, %v): %v", a, race, b, err)
			}
			if ops[i+3]%3 == 2 {
				h2Old = false
			}
		}
	})
}
