package portalloc

import (
	"slices"
	"testing"
)

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
			old, exists := w.eps[id]
			if exists {
				host = old.Host
			}
			res, err := Plan(w.addrs, Request{Endpoint: id, Host: host, Old: old, Spec: spec, Lo: m.lo, Hi: m.hi, Start: m.lo, Rules: AllRules})
			if err != nil {
				if jerr := m.rejectJustified(w, id, host, spec, err); jerr != nil {
					t.Fatal(jerr)
				}
				continue
			}
			if exists && slices.Equal(old.Spec, spec) && !slices.Equal(old.Ports, res.Ports) {
				t.Fatalf("re-applying %v changed %v -> %v", spec, old.Ports, res.Ports)
			}
			next := world{eps: map[string]Endpoint{}, addrs: w.addrs.apply(res.Changes)}
			for k, v := range w.eps {
				next.eps[k] = v
			}
			if len(spec) == 0 {
				delete(next.eps, id)
			} else {
				next.eps[id] = Endpoint{Host: host, Spec: spec, Ports: res.Ports}
			}
			if err := m.allocationsOK(next); err != nil {
				t.Fatal(err)
			}
			w = next
		}
	})
}
