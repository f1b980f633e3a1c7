package pool

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ringipam/ringipam/pkg/retry"
	"github.com/ringipam/ringipam/pkg/store"
)

// This file is the engine of the exhaustive model checks of the ring, the
// claims and the reclaim of gone hosts (model_test.go holds the models).
// The product's own code runs: every operation is a call of an Allocator
// method (Allocate, Release, Sweep, GC), planning and committing exactly as
// in production, over mstore, a store the checker owns.
//
// Interleaving at commit granularity. An operation runs in a goroutine of
// its own over a pstore, which lets it read freely and stops it (Goexit)
// when it asks to commit. Each operation in flight is therefore always in
// one of two places: ready to read and plan (it has just started, or just
// had a commit answered), or holding a planned commit. The checker's steps
// are: start an operation (it reads and plans up to its first commit);
// commit an operation's planned commit (conditions checked against the
// store as it is now); let an operation that had a commit answered read
// and plan again (up to its next commit, or its end); crash an operation
// that has committed something (it never runs again); and environment
// steps (a host's liveness key vanishing or coming back). Any operation
// may commit between another one's reads and its commit, and any
// operation's reads may come after any number of other commits. The reads
// of one plan are made at one state (etcd would read them at revisions
// that may differ; the conditions, not the reads, carry the protocol).
//
// Operations in flight cannot be copied, so they are replayed: a state
// keeps each operation's log (the answers its store calls got), and a step
// runs the operation again from its start, answering from the log (the
// code is deterministic given its answers: fixed clock, no notes, retries
// without delay; a replay that asks for something else fails the check),
// then lets it make its next live call. The store is copied per state.
//
// States are deduplicated by a hash of their canonical form: the store's
// keys and values without revisions (history keys, which no modelled
// operation reads, are not kept), and per operation in flight its op, its
// place and its log with every revision replaced by its relation to the
// store now: absent, current (a condition on it would hold) or stale
// (revisions only grow, so a stale one never holds again). Operations are
// a multiset (sorted). Two states with one canonical form have the same
// futures. The search is breadth-first, so a violation's trace is a
// shortest one.

// mentry is one key of the model store.
type mentry struct {
	val []byte
	rev int64
}

// mstore is the checker's store: a map with revisions, copied per state.
type mstore struct {
	data map[string]mentry
	rev  int64
}

func newMstore() *mstore { return &mstore{data: map[string]mentry{}} }

func (m *mstore) clone() *mstore {
	c := &mstore{data: make(map[string]mentry, len(m.data)), rev: m.rev}
	for k, v := range m.data {
		c.data[k] = v
	}
	return c
}

func (m *mstore) get(keys []string) []store.KV {
	out := make([]store.KV, len(keys))
	for i, k := range keys {
		e := m.data[k]
		out[i] = store.KV{Key: k, Value: e.val, Revision: e.rev}
	}
	return out
}

func (m *mstore) sortedKeys() []string {
	keys := make([]string, 0, len(m.data))
	for k := range m.data {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

func (m *mstore) scan(from, to string, limit int) []store.KV {
	var out []store.KV
	for _, k := range m.sortedKeys() {
		if k < from || k >= to {
			continue
		}
		e := m.data[k]
		out = append(out, store.KV{Key: k, Value: e.val, Revision: e.rev})
		if limit > 0 && len(out) == limit {
			break
		}
	}
	return out
}

// apply commits ops if conds hold. History keys are not kept.
func (m *mstore) apply(conds []store.Cond, ops []store.Op) error {
	if err := store.CheckCommit(conds, ops); err != nil {
		return err
	}
	for _, c := range conds {
		if c.IsRange() {
			for k := range m.data {
				if k >= c.Key && k < c.End {
					return fmt.Errorf("%w: key %q exists in [%q, %q)", store.ErrConflict, k, c.Key, c.End)
				}
			}
			continue
		}
		if m.data[c.Key].rev != c.Revision {
			return fmt.Errorf("%w: key %q", store.ErrConflict, c.Key)
		}
	}
	m.rev++
	for _, o := range ops {
		switch {
		case strings.HasPrefix(o.Key, prefixHistory):
		case o.Delete:
			delete(m.data, o.Key)
		default:
			m.data[o.Key] = mentry{val: append([]byte(nil), o.Value...), rev: m.rev}
		}
	}
	return nil
}

// direct is mstore as a plain store.Store: setup and recovery run on it
// without interleaving.
type direct struct{ m *mstore }

func (d direct) Get(ctx context.Context, keys ...string) ([]store.KV, error) {
	return d.m.get(keys), nil
}
func (d direct) Scan(ctx context.Context, from, to string, limit int) ([]store.KV, error) {
	return d.m.scan(from, to, limit), nil
}
func (d direct) Commit(ctx context.Context, conds []store.Cond, ops []store.Op) error {
	return d.m.apply(conds, ops)
}
func (d direct) Close() error { return nil }

// logEntry is one store call of an operation and its answer.
type logEntry struct {
	call string // what was asked (checked on replay)
	kvs  []store.KV
	err  bool // a commit that met a conflict
}

// Where an operation in flight is.
const (
	placeReady    = iota // to read and plan (after a commit was answered)
	placeAtCommit        // holding a planned commit
	placeDone            // returned (only during a step)
)

// commitRec is what one live commit did, for the checks on transitions.
type commitRec struct {
	conds  []store.Cond
	ops    []store.Op
	ok     bool
	before map[string]mentry // each written key as it was before (absent: rev 0)
}

// pstore is the store one step of one operation sees: it answers from the
// log, then makes live calls against the model store until the step ends.
type pstore struct {
	m       *mstore
	log     []logEntry
	pos     int
	commit  bool // a commit step: the first live call is the planned commit
	made    *commitRec
	place   int
	nondet  string // set when a replay asked for something else
	liveErr error
}

// callString names a store call by its kind and keys (cheap: it is
// built for every call of every replay).
func callString(kind string, keys ...string) string {
	return kind + " " + strings.Join(keys, " ")
}

func commitCall(conds []store.Cond, ops []store.Op) string {
	var b strings.Builder
	b.WriteString("commit")
	for _, c := range conds {
		b.WriteString(" ?" + c.Key)
		if c.IsRange() {
			b.WriteString(".." + c.End)
		}
	}
	for _, o := range ops {
		b.WriteString(" !" + o.Key)
	}
	return b.String()
}

func (p *pstore) replay(call string) (logEntry, bool) {
	if p.pos >= len(p.log) {
		return logEntry{}, false
	}
	e := p.log[p.pos]
	if e.call != call {
		p.nondet = fmt.Sprintf("call %d: replay asked %s, the log has %s", p.pos, call, e.call)
		runtime.Goexit()
	}
	p.pos++
	return e, true
}

// read is a live read: made in a plan step; in a commit step after the
// commit it ends the step (the operation reads again in its next plan).
func (p *pstore) read(call string, f func() []store.KV) []store.KV {
	if e, ok := p.replay(call); ok {
		return slices.Clone(e.kvs)
	}
	if p.commit {
		if p.made == nil {
			p.nondet = "a commit step's first live call is a read: " + call
			runtime.Goexit()
		}
		p.place = placeReady
		runtime.Goexit()
	}
	kvs := f()
	p.log = append(p.log, logEntry{call: call, kvs: kvs})
	p.pos++
	return slices.Clone(kvs)
}

func (p *pstore) Get(ctx context.Context, keys ...string) ([]store.KV, error) {
	return p.read(callString("get", keys...), func() []store.KV { return p.m.get(keys) }), nil
}

func (p *pstore) Scan(ctx context.Context, from, to string, limit int) ([]store.KV, error) {
	return p.read(callString("scan", from, to, strconv.Itoa(limit)), func() []store.KV { return p.m.scan(from, to, limit) }), nil
}

func (p *pstore) Commit(ctx context.Context, conds []store.Cond, ops []store.Op) error {
	call := commitCall(conds, ops)
	if e, ok := p.replay(call); ok {
		if e.err {
			return fmt.Errorf("%w: (replayed)", store.ErrConflict)
		}
		return nil
	}
	if !p.commit || p.made != nil {
		p.place = placeAtCommit
		runtime.Goexit()
	}
	rec := &commitRec{conds: conds, ops: ops, before: map[string]mentry{}}
	for _, o := range ops {
		rec.before[o.Key] = p.m.data[o.Key]
	}
	err := p.m.apply(conds, ops)
	if err != nil && !errors.Is(err, store.ErrConflict) {
		p.liveErr = err
	}
	rec.ok = err == nil
	p.made = rec
	p.log = append(p.log, logEntry{call: call, err: err != nil})
	p.pos++
	return err
}

func (p *pstore) Close() error { return nil }

// mop is one operation a model may start (at most once per run).
type mop struct {
	name  string
	host  string // the host whose allocator runs it
	kind  string // "alloc", "release", "sweep", "gc", "env"
	after int    // an op that must have ended (or crashed) first; -1: none
	run   func(ctx context.Context, a *Allocator) error
	env   func(m *mstore) // environment steps: applied at once
	// fenceable: the op plans from its host's view (allocations and
	// releases), which a reclaim of the host must fence off.
	fenceable bool
}

// proc is an operation in flight.
type proc struct {
	op      int
	log     []logEntry
	place   int
	commits int // successful commits
	// fenced: the op's host was tombstoned after the op last read.
	fenced bool
}

// mstate is one state of a model.
type mstate struct {
	st      *mstore
	procs   []proc
	started uint64 // ops started (bit per op)
	crashed uint64 // ops crashed
}

func (s *mstate) inFlight(op int) bool {
	for _, p := range s.procs {
		if p.op == op {
			return true
		}
	}
	return false
}

func (s *mstate) ended(op int) bool {
	return s.started&(1<<op) != 0 && !s.inFlight(op)
}

// model is what a check explores.
type model struct {
	name     string
	ops      []mop
	maxProcs int // operations in flight at once
	broken   faults
	clock    time.Time
	attempts int // the retry policy's attempts
	// check is called on every new state and on every transition (tr,
	// with the commit it made if any); it returns a violation or "".
	check func(m *model, s *mstate, tr *transition) string
	// quiescent is called on states with no operation in flight (every
	// operation ended or crashed); it returns a violation or "" and may
	// record findings.
	quiescent func(m *model, s *mstate, find func(name, detail string)) string
	setup     func(m *model, st *mstore)
}

// transition is one step between states.
type transition struct {
	label  string
	fenced bool // the committing op was fenced (see proc.fenced)
	proc   int  // index of the proc in the new state's procs, -1 if none
	op     int
	commit *commitRec
	before *mstate
}

func (m *model) allocator(st store.Store, host string) *Allocator {
	a, err := New(st, host, WithClock(func() time.Time { return m.clock }),
		WithRetry(retry.Policy{Attempts: m.attempts}), WithTimeout(time.Hour),
		WithReservationHold(time.Hour))
	if err != nil {
		panic(err)
	}
	a.broken = m.broken
	return a
}

// runStep runs op o from its log to the end of one step.
func (m *model) runStep(st *mstore, p proc, commit bool) (proc, *commitRec, error) {
	o := m.ops[p.op]
	ps := &pstore{m: st, log: slices.Clone(p.log), commit: commit, place: placeDone}
	done := make(chan struct{})
	go func() {
		defer close(done)
		a := m.allocator(ps, o.host)
		_ = o.run(context.Background(), a)
	}()
	select {
	case <-done:
	case <-time.After(time.Minute):
		return p, nil, fmt.Errorf("%s did not finish a step within a minute", o.name)
	}
	if ps.nondet != "" {
		return p, nil, fmt.Errorf("%s is not deterministic: %s", o.name, ps.nondet)
	}
	if ps.liveErr != nil {
		return p, nil, fmt.Errorf("%s: commit refused: %w", o.name, ps.liveErr)
	}
	if ps.pos != len(ps.log) {
		return p, nil, fmt.Errorf("%s ended before replaying its log (%d of %d)", o.name, ps.pos, len(ps.log))
	}
	n := p
	n.log = ps.log
	n.place = ps.place
	if !commit {
		n.fenced = false
	}
	if ps.made != nil && ps.made.ok {
		n.commits++
	}
	return n, ps.made, nil
}

// result is what a check found.
type result struct {
	states      int
	transitions int
	violation   string
	trace       []string
	findings    map[string]*finding
	elapsed     time.Duration
}

// findingPrefix marks what a check returns for a finding, not a violation.
const findingPrefix = "finding: "

// finding is a known behaviour the check counts and shows (not a
// violation): how many states show it and a shortest trace to one.
type finding struct {
	states int
	trace  []string
}

type node struct {
	parent int32
	label  string
}

// explorer is one breadth-first search.
type explorer struct {
	m        *model
	seen     map[[16]byte]int32
	nodes    []node
	res      *result
	cur      int32 // node of the state being expanded
	maxState int
}

func (e *explorer) trace(n int32, last string) []string {
	var out []string
	if last != "" {
		out = append(out, last)
	}
	for n > 0 {
		out = append(out, e.nodes[n].label)
		n = e.nodes[n].parent
	}
	slices.Reverse(out)
	return out
}

// find records a finding in state node n (after step last, if any).
func (e *explorer) find(name string, n int32, last, detail string) {
	f := e.res.findings[name]
	if f == nil {
		f = &finding{trace: e.trace(n, last)}
		if detail != "" {
			f.trace = append(f.trace, "=> "+detail)
		}
		e.res.findings[name] = f
	}
	f.states++
}

// run explores m from its setup state, up to maxStates states (0: no
// bound), and stops at the first violation.
func (m *model) explore(t testing.TB, maxStates int) *result {
	start := time.Now()
	res := &result{findings: map[string]*finding{}}
	init := &mstate{st: newMstore()}
	m.setup(m, init.st)
	e := &explorer{m: m, seen: map[[16]byte]int32{}, res: res, maxState: maxStates}
	e.nodes = append(e.nodes, node{parent: -1, label: "setup"})
	e.seen[m.hash(init)] = 0
	frontier := []*mstate{init}
	ids := []int32{0}
	visit := func(s *mstate, id int32) bool {
		if v := m.check(m, s, nil); v != "" {
			res.violation, res.trace = v, e.trace(id, "")
			return false
		}
		if len(s.procs) == 0 && m.quiescent != nil {
			if v := m.quiescent(m, s, func(name, detail string) { e.find(name, id, "", detail) }); v != "" {
				res.violation, res.trace = v, e.trace(id, "")
				return false
			}
		}
		return true
	}
	if !visit(init, 0) {
		res.states, res.elapsed = 1, time.Since(start)
		return res
	}
	for len(frontier) > 0 {
		var next []*mstate
		var nextIDs []int32
		for i, s := range frontier {
			e.cur = ids[i]
			for _, tr := range m.successors(t, s) {
				res.transitions++
				v := m.check(m, tr.after, &tr.transition)
				if name, ok := strings.CutPrefix(v, findingPrefix); ok {
					e.find(name, ids[i], tr.label, "")
					v = ""
				}
				if v != "" {
					res.violation, res.trace = v, e.trace(ids[i], tr.label)
					res.states, res.elapsed = len(e.nodes), time.Since(start)
					return res
				}
				h := m.hash(tr.after)
				if _, ok := e.seen[h]; ok {
					continue
				}
				id := int32(len(e.nodes))
				e.seen[h] = id
				e.nodes = append(e.nodes, node{parent: ids[i], label: tr.label})
				if !visit(tr.after, id) {
					res.states, res.elapsed = len(e.nodes), time.Since(start)
					return res
				}
				next = append(next, tr.after)
				nextIDs = append(nextIDs, id)
				if maxStates > 0 && len(e.nodes) >= maxStates {
					t.Fatalf("%s: more than %d states", m.name, maxStates)
				}
			}
		}
		frontier, ids = next, nextIDs
	}
	res.states, res.elapsed = len(e.nodes), time.Since(start)
	return res
}

// successor is a transition and the state it leads to.
type successor struct {
	transition
	after *mstate
}

func (s *mstate) with(st *mstore, procs []proc) *mstate {
	return &mstate{st: st, procs: procs, started: s.started, crashed: s.crashed}
}

// successors lists every step from s.
func (m *model) successors(t testing.TB, s *mstate) []successor {
	var out []successor
	fail := func(err error) { t.Fatalf("%s: %v", m.name, err) }
	// Start an operation.
	for i, o := range m.ops {
		if s.started&(1<<i) != 0 || o.after >= 0 && !s.ended(o.after) {
			continue
		}
		if o.env != nil {
			st := s.st.clone()
			o.env(st)
			n := s.with(st, slices.Clone(s.procs))
			n.started |= 1 << i
			out = append(out, successor{transition{label: o.name, proc: -1, op: i, before: s}, n})
			continue
		}
		if len(s.procs) >= m.maxProcs {
			continue
		}
		st := s.st.clone()
		p, _, err := m.runStep(st, proc{op: i}, false)
		if err != nil {
			fail(err)
		}
		n := s.with(st, slices.Clone(s.procs))
		n.started |= 1 << i
		idx := -1
		if p.place != placeDone {
			n.procs = append(n.procs, p)
			idx = len(n.procs) - 1
		}
		out = append(out, successor{transition{label: o.name + ": reads, plans", proc: idx, op: i, before: s}, n})
	}
	for j, p := range s.procs {
		o := m.ops[p.op]
		// Its next step.
		st := s.st.clone()
		commit := p.place == placeAtCommit
		q, rec, err := m.runStep(st, p, commit)
		if err != nil {
			fail(err)
		}
		procs := slices.Clone(s.procs)
		label := o.name + ": reads, plans"
		idx := j
		if commit {
			label = o.name + ": commit ok"
			if rec == nil || !rec.ok {
				label = o.name + ": commit conflicts"
			}
		}
		if q.place == placeDone {
			procs = slices.Delete(procs, j, j+1)
			idx = -1
			label += ", ends"
		} else {
			procs[j] = q
		}
		n := s.with(st, procs)
		if rec != nil && rec.ok {
			m.afterCommit(n, idx, o, rec)
		}
		out = append(out, successor{transition{label: label, fenced: p.fenced, proc: idx, op: p.op, commit: rec, before: s}, n})
		// A crash, once it has changed something.
		if p.commits > 0 {
			n := s.with(s.st.clone(), slices.Delete(slices.Clone(s.procs), j, j+1))
			n.crashed |= 1 << p.op
			out = append(out, successor{transition{label: o.name + ": crashes", proc: -1, op: p.op, before: s}, n})
		}
	}
	return out
}

// hash is the canonical form's hash (see the file comment).
func (m *model) hash(s *mstate) [16]byte {
	h := sha256.New()
	var b [8]byte
	put := func(v uint64) { binary.LittleEndian.PutUint64(b[:], v); h.Write(b[:]) }
	str := func(x string) { put(uint64(len(x))); h.Write([]byte(x)) }
	put(s.started)
	put(s.crashed)
	for _, k := range s.st.sortedKeys() {
		str(k)
		str(string(s.st.data[k].val))
	}
	procs := make([]string, len(s.procs))
	for i, p := range s.procs {
		sb := make([]byte, 0, 1024)
		sb = binary.LittleEndian.AppendUint64(sb, uint64(p.op))
		sb = append(sb, byte(p.place), boolByte(p.commits > 0), boolByte(p.fenced))
		for _, e := range p.log {
			sb = append(sb, '[', boolByte(e.err))
			for _, kv := range e.kvs {
				rel := byte('a')
				switch cur := s.st.data[kv.Key].rev; {
				case kv.Revision == 0:
				case cur == kv.Revision:
					rel = 'c'
				default:
					rel = 's'
				}
				sb = append(sb, kv.Key...)
				sb = append(sb, 0, rel)
				sb = binary.LittleEndian.AppendUint32(sb, uint32(len(kv.Value)))
				sb = append(sb, kv.Value...)
			}
			sb = append(sb, ']')
		}
		procs[i] = string(sb)
	}
	slices.Sort(procs)
	for _, p := range procs {
		str(p)
	}
	var out [16]byte
	copy(out[:], h.Sum(nil))
	return out
}

// afterCommit keeps the bookkeeping of a successful commit by an op of
// host o.host (proc idx of n, -1 when it ended): the fencing of the ops of
// a host whose ranges it tombstoned.
func (m *model) afterCommit(n *mstate, idx int, o mop, rec *commitRec) {
	changed := false
	for _, op := range rec.ops {
		changed = changed || strings.HasPrefix(op.Key, rangePrefix(modelPool))
	}
	if !changed {
		return
	}
	old, now := modelRing(n.st, beforePatch(rec)), modelRing(n.st, nil)
	for _, v := range modelAddrs() {
		was, is := old.ownerOf(v), now.ownerOf(v)
		if was.Host != "" && !was.Tomb && is.Host == was.Host && is.Tomb {
			for j := range n.procs {
				if j != idx && m.ops[n.procs[j].op].fenceable && m.ops[n.procs[j].op].host == was.Host {
					n.procs[j].fenced = true
				}
			}
		}
	}
}

func boolByte(b bool) byte {
	if b {
		return 1
	}
	return 0
}
