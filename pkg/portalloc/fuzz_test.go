package portalloc

import "testing"

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
