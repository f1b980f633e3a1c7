package portalloc

import "testing"

// FuzzPlanAgainstProperties applies a byte-coded sequence of requests
// (endpoint, host, spec from the full-size model) and checks every step
// like the model check: allocations consistent, rejections justified,
// re-applying a spec idempotent.
func FuzzPlanAgainstProperties(f *testing.F) {
	f.Add([]byte{0, 0, 1, 1, 1, 2, 0, 0, 0})
	f.Add([]byte{0, 0, 200, 1, 1, 200, 0, 0, 200, 0, 0, 0})
	m := newModel([]string{"tcp", "udp"}, []uint16{80, 81}, 30000, 30002)
	f.Fuzz(func(t *testing.T, ops []byte) {
		w := world{eps: map[string]Endpoint{}, addrs: memView{}}
		for i := 0; i+2 < len(ops) && i < 3*200; i += 3 {
			id := m.ids[int(ops[i])%len(m.ids)]
			host := m.hosts[int(ops[i+1])%len(m.hosts)]
			spec := m.specs[int(ops[i+2])%len(m.specs)]
			if old, exists := w.eps[id]; exists {
				host = old.Host
			}
			next, _, err := m.step(w, id, host, spec, AllRules)
			if err != nil {
				t.Fatal(err)
			}
			w = next
		}
	})
}
