package portalloc

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/memory"
)

// This file is the model check of the store layout (p/a/, p/h/, the
// marker), where TestModelCheckPorts checks Plan over an abstract table.
// The Allocator's own code (Allocate: the view over p/a/ and p/h/, Plan,
// the commit's conditions and operations) runs on a memory store; its
// commit is captured instead of applied, so that two steps planned on one
// state can be committed one after the other, as two processes racing do.
//
// World: endpoints e1 and e2, hosts h1 and h2, protocol tcp, static
// number 80, dynamic range 30000-30001; specs of at most two entries
// (ingress or host mode, static or dynamic). In the mixed variant host h2
// first runs today's main's code (the old layout: p/a/ with every host
// user inside, read through the same Plan, as commit 082f606 decides) and
// may switch to the new code at any step (a rolling restart), never back.
//
// From every reachable state (the store's keys, and h2's version):
//
//   - every step of either endpoint on either host (its own host once it
//     exists) with every spec is planned and checked: a rejection by the
//     new code is justified (RejectJustified over the holders the store
//     lists; a dynamic ingress search may also pass a stale marker); a
//     removal never fails; re-applying an endpoint's spec returns its
//     ports (AllocateIdempotent); the store after the step audits clean
//     (Audit: records and holders agree both ways, no ingress port beside
//     a host port, no two host ports colliding on one host, every p/h/
//     binding marked in p/a/);
//   - every pair of steps of the two endpoints planned on the state is
//     committed in both orders: the second commit applies only if its
//     conditions still hold (else it conflicts and retries, a step from
//     the new state); when both apply, the store must audit clean too, and
//     the state is explored further (stale markers arise only this way).
type layoutModel struct {
	specs  [][]Port
	lo, hi uint16
	fault  layoutFault
	rules  Rules
	mixed  bool // h2 starts on today's main's code
}

func newLayoutModel() *layoutModel {
	m := &layoutModel{lo: 30000, hi: 30001, rules: AllRules}
	var entries []Port
	for _, mode := range []Mode{Ingress, Host} {
		for _, n := range []uint16{0, 80} {
			entries = append(entries, Port{Mode: mode, Name: "web", Protocol: "tcp", Number: n})
		}
	}
	m.specs = append(m.specs, nil)
	for i, a := range entries {
		m.specs = append(m.specs, []Port{a})
		for _, b := range entries[i:] {
			m.specs = append(m.specs, []Port{a, b})
		}
	}
	return m
}

// lstate is a model state: the store's keys (indexes left out) and
// whether h2 still runs the old code.
type lstate struct {
	kv    map[string]string
	h2Old bool
}

func (s lstate) key() string {
	var b strings.Builder
	for _, k := range slices.Sorted(maps.Keys(s.kv)) {
		b.WriteString(k + "=" + s.kv[k] + "\n")
	}
	if s.h2Old {
		b.WriteString("h2 old")
	}
	return b.String()
}

// load builds a store holding s's keys (every one at revision 1: two loads
// of one state agree on revisions, so a commit planned on one applies to
// the other).
func (s lstate) load() *memory.Store {
	st := memory.New()
	var ops []store.Op
	for k, v := range s.kv {
		ops = append(ops, store.Put(k, []byte(v)))
	}
	if len(ops) > 0 {
		if err := st.Commit(context.Background(), nil, ops); err != nil {
			panic(err)
		}
	}
	return st
}

func stateOf(st store.Store, h2Old bool) lstate {
	kvs, _ := st.Scan(context.Background(), "p/", store.PrefixEnd("p/"), 0)
	s := lstate{kv: map[string]string{}, h2Old: h2Old}
	for _, kv := range kvs {
		if !strings.HasPrefix(kv.Key, prefixHostIndex) && kv.Key != indexedKey {
			s.kv[kv.Key] = string(kv.Value)
		}
	}
	return s
}

// capture is a store whose Commit is recorded, not applied.
type capture struct {
	store.Store
	conds []store.Cond
	ops   []store.Op
}

func (c *capture) Commit(_ context.Context, conds []store.Cond, ops []store.Op) error {
	c.conds, c.ops = conds, ops
	return nil
}

// lstep is one planned step: its commit (none: nothing to write) or its
// rejection.
type lstep struct {
	id, host string
	spec     []Port
	conds    []store.Cond
	ops      []store.Op
	err      error
}

func (s lstep) String() string { return fmt.Sprintf("%s on %s asks %v", s.id, s.host, s.spec) }

// plan runs endpoint id's request on host against st with the host's code.
func (m *layoutModel) plan(st store.Store, id, host string, spec []Port, old bool) (lstep, Result) {
	c := &capture{Store: st}
	step := lstep{id: id, host: host, spec: spec}
	var res Result
	if old {
		res, step.conds, step.ops, step.err = oldAllocate(context.Background(), st, host, ep(id), spec, m.lo, m.hi)
		return step, res
	}
	a, _ := New(c, host, WithDynamicRange(m.lo, m.hi))
	a.fault, a.rules = m.fault, m.rules
	res, step.err = a.Allocate(context.Background(), ep(id), spec)
	step.conds, step.ops = c.conds, c.ops
	return step, res
}

// oldAllocate is Allocate as commit 082f606 does it: p/a/ holds every
// host user (an address's state is its p/a/ record as is: the marker is a
// host user to it), nothing else is read, the commit conditions on the
// endpoint record and every address changed.
func oldAllocate(ctx context.Context, st store.Store, host string, id EndpointID, spec []Port, lo, hi uint16) (Result, []store.Cond, []store.Op, error) {
	kvs, err := st.Get(ctx, endpointKey(id))
	if err != nil {
		return Result{}, nil, nil, err
	}
	epKV := kvs[0]
	old, err := decodeEndpoint(id, epKV)
	if err != nil {
		return Result{}, nil, nil, err
	}
	all, err := st.Scan(ctx, prefixAddr, store.PrefixEnd(prefixAddr), 0)
	if err != nil {
		return Result{}, nil, nil, err
	}
	v, read := memView{}, map[Address]store.KV{}
	for _, kv := range all {
		a, _ := addressOfKey(kv.Key)
		s, err := decodeState(kv)
		if err != nil {
			return Result{}, nil, nil, err
		}
		v[a], read[a] = s, kv
	}
	me := id.String()
	a := &Allocator{lo: lo, hi: hi}
	res, err := Plan(v, Request{Endpoint: me, Host: host, Old: old, Spec: spec, Lo: lo, Hi: hi, Start: a.start(me), Rules: AllRules})
	if err != nil {
		return Result{}, nil, nil, err
	}
	rec := Endpoint{Kind: Kind, Host: host, Spec: spec, Ports: res.Ports}
	conds := []store.Cond{store.Unchanged(epKV)}
	var ops []store.Op
	same := true
	for addr, s := range res.Changes {
		kv, ok := read[addr]
		if !ok {
			kv = store.KV{Key: addrKey(addr)}
		}
		conds = append(conds, store.Unchanged(kv))
		if !sameState(v[addr], s) {
			same = false
		}
		if s.empty() {
			ops = append(ops, store.Delete(kv.Key))
		} else {
			b, _ := json.Marshal(s)
			ops = append(ops, store.Put(kv.Key, b))
		}
	}
	if same && (len(spec) == 0 && !epKV.Exists() || epKV.Exists() && sameEndpoint(old, rec)) {
		return res, nil, nil, nil
	}
	if len(spec) == 0 {
		ops = append(ops, store.Delete(endpointKey(id)))
	} else {
		b, _ := json.Marshal(rec)
		ops = append(ops, store.Put(endpointKey(id), b))
	}
	return res, conds, ops, nil
}

// holders is the table of who holds what, as the store lists it (p/a/'s
// ingress holders and old-format users, p/h/'s bindings), and the numbers
// of tcp whose p/a/ record carries a marker with no binding under p/h/.
func holders(st store.Store) (memView, map[uint16]bool) {
	kvs, _ := st.Scan(context.Background(), "p/", store.PrefixEnd("p/"), 0)
	t, marked, bound := memView{}, map[Address]bool{}, map[Address]bool{}
	for _, kv := range kvs {
		if p, ok, err := decodeAddress(kv); ok && err == nil && strings.HasPrefix(kv.Key, prefixAddr) {
			s := t[p.Address]
			s.Ingress, s.IngressHost = p.State.Ingress, p.State.IngressHost
			s.Hosts = append(s.Hosts, p.State.Hosts...)
			t[p.Address] = s
			raw, _ := decodeState(kv)
			_, marked[p.Address] = splitMarker(raw)
		}
		if a, host, ok := parseHostBindKey(kv.Key); ok {
			us, _ := decodeBindings(kv, host)
			s := t[a]
			s.Hosts = append(s.Hosts, us...)
			t[a] = s
			bound[a] = true
		}
	}
	stale := map[uint16]bool{}
	for a, m := range marked {
		if m && !bound[a] {
			stale[a.Number] = true
		}
	}
	return t, stale
}

// audit is the invariant of every state: Audit finds nothing.
func audit(st store.Store) error {
	f, err := Audit(context.Background(), st, Holders{})
	if err != nil || len(f) > 0 {
		return fmt.Errorf("the store audits %v %v", f, err)
	}
	return nil
}

// commit applies a step's commit to st; false when a condition fails.
func commit(st store.Store, s lstep) bool {
	if len(s.ops) == 0 {
		return true
	}
	err := st.Commit(context.Background(), s.conds, s.ops)
	if err != nil && !errors.Is(err, store.ErrConflict) {
		panic(err)
	}
	return err == nil
}

type layoutResult struct{ states, steps, races, both int }

func (m *layoutModel) check() (layoutResult, error) {
	var res layoutResult
	start := lstate{kv: map[string]string{}, h2Old: m.mixed}
	seen := map[string]bool{start.key(): true}
	queue := []lstate{start}
	push := func(s lstate) {
		if k := s.key(); !seen[k] {
			seen[k] = true
			queue = append(queue, s)
		}
	}
	for len(queue) > 0 {
		s := queue[0]
		queue = queue[1:]
		res.states = len(seen)
		if s.h2Old {
			push(lstate{kv: s.kv, h2Old: false}) // h2 restarts on the new code
		}
		st := s.load()
		t, stale := holders(st)
		recs := map[string]Endpoint{}
		for _, id := range []string{"e1", "e2"} {
			if e, ok, _ := (&Allocator{st: st}).Lookup(context.Background(), ep(id)); ok {
				recs[id] = e
			}
		}
		var steps [2][]lstep
		for i, id := range []string{"e1", "e2"} {
			hosts := []string{"h1", "h2"}
			if e, ok := recs[id]; ok {
				hosts = []string{e.Host}
			}
			for _, h := range hosts {
				old := h == "h2" && s.h2Old
				for _, spec := range m.specs {
					step, r := m.plan(st, id, h, spec, old)
					res.steps++
					where := func() string {
						return fmt.Sprintf("%v\n  in the state (h2 old: %v):\n%s", step, s.h2Old, s.key())
					}
					if step.err != nil {
						if len(spec) == 0 {
							return res, fmt.Errorf("removal failed: %v; %s", step.err, where())
						}
						if old {
							continue // today's main's rejections are its own
						}
						if !errors.Is(step.err, ErrInUse) && !errors.Is(step.err, ErrDuplicate) && !errors.Is(step.err, ErrExhausted) {
							return res, fmt.Errorf("unexpected error %v; %s", step.err, where())
						}
						if jerr := rejectJustified(m.lo, m.hi, []string{"tcp"}, t, ep(id).String(), h, spec, step.err); jerr != nil && !(errors.Is(step.err, ErrExhausted) && len(stale) > 0) {
							return res, fmt.Errorf("%v; %s", jerr, where())
						}
						continue
					}
					if e, ok := recs[id]; ok && !old && slices.Equal(e.Spec, spec) && !slices.Equal(e.Ports, r.Ports) {
						return res, fmt.Errorf("re-applying the spec changed the ports %v -> %v (AllocateIdempotent); %s", e.Ports, r.Ports, where())
					}
					next := s.load()
					if !commit(next, step) {
						return res, fmt.Errorf("a step's own commit conflicts on the state it read; %s", where())
					}
					if err := audit(next); err != nil {
						return res, fmt.Errorf("%w\n  after %s", err, where())
					}
					push(stateOf(next, s.h2Old))
					steps[i] = append(steps[i], step)
				}
			}
		}
		// Races: a step of e1 and a step of e2 planned on this state,
		// committed in either order.
		for _, a := range steps[0] {
			for _, b := range steps[1] {
				if len(a.ops) == 0 || len(b.ops) == 0 {
					continue
				}
				for _, order := range [][2]lstep{{a, b}, {b, a}} {
					res.races++
					next := s.load()
					commit(next, order[0])
					if !commit(next, order[1]) {
						continue
					}
					res.both++
					if err := audit(next); err != nil {
						return res, fmt.Errorf("%w\n  after %v and %v, both planned on the state (h2 old: %v):\n%s", err, order[0], order[1], s.h2Old, s.key())
					}
					push(stateOf(next, s.h2Old))
				}
			}
		}
	}
	res.states = len(seen)
	return res, nil
}

func TestModelCheckLayout(t *testing.T) {
	for _, mixed := range []bool{false, true} {
		t.Run(map[bool]string{false: "new code", true: "rolling restart"}[mixed], func(t *testing.T) {
			began := time.Now()
			m := newLayoutModel()
			m.mixed = mixed
			res, err := m.check()
			msg := fmt.Sprintf("layout model check (%s): %d states, %d steps, %d races (%d with both commits applied), in %v; Audit clean, RejectJustified and AllocateIdempotent hold",
				t.Name(), res.states, res.steps, res.races, res.both, time.Since(began).Round(time.Millisecond))
			if err != nil {
				t.Fatal(err)
			}
			t.Log(msg)
			if testing.Verbose() {
				fmt.Println(msg)
			}
			if res.states < 100 || res.both == 0 {
				t.Fatalf("only %d states, %d races with both commits: the model is not exploring", res.states, res.both)
			}
		})
	}
}

// Each layout rule broken is caught by the layout model check, as is each
// SwarmKit XXX behaviour the store model can show.
func TestModelCheckLayoutBroken(t *testing.T) {
	for _, tc := range []struct {
		name  string
		fault layoutFault
		off   func(*Rules)
		mixed bool
		want  string
	}{
		// Without the range conditions, the removal of a marker races a new
		// binding of another host (and an ingress port a binding beside a
		// stale marker).
		{"the range conditions over p/h/ forgotten", faultNoAbsent, nil, false, "lacks the marker"},
		{"a first host binding writes no marker", faultNoMarker, nil, true, "lacks the marker"},
		{"a host-mode commit forgets p/a/ as read", faultNoAddrCond, nil, false, "shadows the host port"},
		{"XXX 3 dynamic ingress shadows a host port", faultNone, func(r *Rules) { r.IngressAvoidsHostPorts = false }, false, ""},
		{"XXX 4 host port hidden by an ingress port accepted", faultNone, func(r *Rules) { r.RefuseHiddenHostPorts = false }, false, "shadows the host port"},
		{"XXX 5 host ports collide on one host", faultNone, func(r *Rules) { r.HostPortsUnique = false }, false, "twice"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := newLayoutModel()
			m.fault, m.mixed = tc.fault, tc.mixed
			if tc.off != nil {
				tc.off(&m.rules)
			}
			res, err := m.check()
			if err == nil {
				t.Fatalf("the broken layout passed the model check (%d states)", res.states)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("reported %v; want a report mentioning %q", err, tc.want)
			}
			t.Logf("caught after %d states, %d races: %v", res.states, res.races, err)
		})
	}
}
