package pool

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"net/netip"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ringipam/ringipam/pkg/portalloc"
	"github.com/ringipam/ringipam/pkg/retry"
	"github.com/ringipam/ringipam/pkg/store"
)

// The exhaustive model checks of seed 002 (the ring of host-owned ranges
// and its claims) and seed 004 (the reclaim of gone hosts), over the
// engine of modelcheck_test.go. See docs/DESIGN-NOTES.md, "Model checks of
// the ring and the reclaim".

const modelPool = "p"

// modelDef is the pool of both models: 198.18.0.1-.6, six addresses.
func modelDef() Def { return v4Def(modelPool, "198.18.0.0/29") }

func modelAddrs() []u128 {
	var out []u128
	for i := 1; i <= 6; i++ {
		out = append(out, toU128(netip.AddrFrom4([4]byte{198, 18, 0, byte(i)})))
	}
	return out
}

func modelAddr(i int) netip.Addr { return netip.AddrFrom4([4]byte{198, 18, 0, byte(i)}) }

// modelRing decodes the pool's ring from its range keys in st, with the
// keys of patch replacing them (a nil value: absent), as before or after
// a commit.
func modelRing(st *mstore, patch map[string][]byte) ring {
	def, err := parseDef(modelPool, st.data[defKey(modelPool)].val)
	if err != nil {
		panic(err)
	}
	vals := map[string][]byte{}
	for k, e := range st.data {
		if strings.HasPrefix(k, rangePrefix(modelPool)) {
			vals[k] = e.val
		}
	}
	for k, v := range patch {
		if !strings.HasPrefix(k, rangePrefix(modelPool)) {
			continue
		}
		if v == nil {
			delete(vals, k)
		} else {
			vals[k] = v
		}
	}
	var rs []rangeKV
	for _, k := range slices.Sorted(maps.Keys(vals)) {
		r, err := decodeRangeKV(store.KV{Key: k, Value: vals[k], Revision: 1}, true)
		if err != nil {
			panic(err)
		}
		rs = append(rs, r)
	}
	r, err := ringOfRanges(def, rs)
	if err != nil {
		// Overlapping ranges: a ring that check refuses, its second
		// token naming what overlaps.
		r = newRing(def)
		r.tokens = append(r.tokens, token{Start: r.tokens[0].Start, Host: err.Error()})
	}
	return r
}

// opsPatch is the patch of modelRing that ops write.
func opsPatch(ops []store.Op) map[string][]byte {
	p := map[string][]byte{}
	for _, o := range ops {
		if o.Delete {
			p[o.Key] = nil
		} else {
			p[o.Key] = o.Value
		}
	}
	return p
}

// beforePatch is the patch of modelRing that undoes a commit.
func beforePatch(rec *commitRec) map[string][]byte {
	p := map[string][]byte{}
	for k, e := range rec.before {
		if e.rev == 0 {
			p[k] = nil
		} else {
			p[k] = e.val
		}
	}
	return p
}

func short(a u128) string { return fmt.Sprintf(".%d", a.lo&0xff) }

// Operations of the models.

func allocOp(host, id string, static int, after int) mop {
	name := fmt.Sprintf("%s alloc %s dynamic", host, id)
	var addr netip.Addr
	if static > 0 {
		addr = modelAddr(static)
		name = fmt.Sprintf("%s alloc %s static .%d", host, id, static)
	}
	return mop{name: name, host: host, kind: "alloc", after: after, fenceable: true,
		run: func(ctx context.Context, a *Allocator) error {
			_, err := a.Allocate(ctx, Request{Owner: own(id), Wants: []Want{{Pool: modelPool, Role: RoleIP, Addr: addr}}})
			return err
		}}
}

// modelPorts is a port allocator of host on st, as the models run it
// (retries without delay, a dynamic range of four ports).
func (m *model) ports(st store.Store, host string) *portalloc.Allocator {
	pa, err := portalloc.New(st, host, portalloc.WithRetry(retry.Policy{Attempts: m.attempts}), portalloc.WithDynamicRange(30000, 30003))
	if err != nil {
		panic(err)
	}
	return pa
}

// endpointOf is owner id's attachment as portmap-ingress names it.
func endpointOf(id string) portalloc.EndpointID {
	return portalloc.EndpointID{Network: "net", ContainerID: id, IfName: "eth0"}
}

// publish publishes one dynamic ingress port for id's attachment on host
// (portmap-ingress's ADD, chained after ipam-ring's).
func (m *model) publish(ctx context.Context, st store.Store, host, id string) error {
	_, err := m.ports(st, host).Allocate(ctx, endpointOf(id), []portalloc.Port{{Mode: portalloc.Ingress, Name: "http", Protocol: "tcp"}})
	return err
}

// publishOp is portmap-ingress's ADD on host for id's attachment alone.
func (m *model) publishOp(host, id string, after int) mop {
	return mop{name: fmt.Sprintf("%s publishes a port for %s", host, id), host: host, kind: "publish", after: after,
		run: func(ctx context.Context, a *Allocator) error { return m.publish(ctx, a.st, host, id) }}
}

func releaseOp(host, id string, after int) mop {
	return mop{name: fmt.Sprintf("%s release %s", host, id), host: host, kind: "release", after: after, fenceable: true,
		run: func(ctx context.Context, a *Allocator) error {
			_, _, err := a.Release(ctx, own(id))
			return err
		}}
}

// orphanAfter is the sweeps' threshold: the models' clock stands half a
// second after every recorded last-seen time (Unix seconds), so a host
// that is down is orphaned at once.
const orphanAfter = time.Nanosecond

func sweepOp(host string, after int) mop {
	return mop{name: host + " agent sweeps", host: host, kind: "sweep", after: after,
		run: func(ctx context.Context, a *Allocator) error {
			_, err := a.Sweep(ctx, orphanAfter)
			return err
		}}
}

// readoptOp is the agent of a host that is back readopting what a reclaim
// cut short left in its tombstoned ranges (Readopt, once its liveness key
// exists).
func readoptOp(host string, after int) mop {
	return mop{name: host + " agent readopts", host: host, kind: "readopt", after: after,
		run: func(ctx context.Context, a *Allocator) error {
			_, err := a.Readopt(ctx)
			return err
		}}
}

// agentSweepOp is the elected host agent's sweep: the product's Sweeper
// (sweeper.go, which cmd/ringipamd's leader runs), with the pool's reclaim
// and the release of orphaned hosts' published ports under the pool's
// ReclaimGuard.
func (m *model) agentSweepOp(host string, after int) mop {
	o := sweepOp(host, after)
	o.run = func(ctx context.Context, a *Allocator) error { return m.agentSweep(ctx, a) }
	return o
}

// agentSweep is one sweep of a fresh Sweeper (no memory of earlier
// sweeps: every host is read) with the models' orphanAfter.
func (m *model) agentSweep(ctx context.Context, a *Allocator) error {
	s := &Sweeper[portalloc.Released]{Alloc: a, Ports: m.ports(a.st, a.host), Options: SweepOptions{OrphanAfter: orphanAfter, Retention: time.Hour}}
	_, err := s.Sweep(ctx)
	return err
}

func livenessOp(host string, up bool, after int) mop {
	name := host + " goes down (its lease expires)"
	if up {
		name = host + " comes back (its agent takes a lease)"
	}
	return mop{name: name, host: host, kind: "env", after: after, env: func(m *mstore) {
		op := store.Delete(LivenessKey(host))
		if up {
			op = store.Put(LivenessKey(host), []byte("lease"))
		}
		if err := m.apply(nil, []store.Op{op}); err != nil {
			panic(err)
		}
	}}
}

// view is a state's store decoded.
type view struct {
	ring   ring
	addrs  map[u128]holder
	owners map[string]Allocation
	index  map[string]bool
	states map[string]hostState // host -> its state in the pool
	live   map[string]bool
}

func decodeView(st *mstore) (view, error) {
	v := view{addrs: map[u128]holder{}, owners: map[string]Allocation{}, index: map[string]bool{}, states: map[string]hostState{}, live: map[string]bool{}}
	v.ring = modelRing(st, nil)
	for k, e := range st.data {
		switch {
		case strings.HasPrefix(k, addrPrefix(modelPool)):
			a, ok := parseAddrKey(k)
			if !ok {
				return v, fmt.Errorf("bad address key %s", k)
			}
			v.addrs[a] = parseHolder(e.val)
		case strings.HasPrefix(k, prefixOwner):
			var rec Allocation
			if err := decodeAllocation(e.val, &rec); err != nil {
				return v, fmt.Errorf("%s: %v", k, err)
			}
			v.owners[strings.TrimPrefix(k, prefixOwner)] = rec
		case strings.HasPrefix(k, prefixHostOwner):
			v.index[k] = true
		case strings.HasPrefix(k, hostPrefix(modelPool)):
			var hs hostState
			if err := decodeHostState(e.val, &hs); err != nil {
				return v, fmt.Errorf("%s: %v", k, err)
			}
			v.states[strings.TrimPrefix(k, hostPrefix(modelPool))] = hs
		case strings.HasPrefix(k, prefixLive):
			v.live[strings.TrimPrefix(k, prefixLive)] = true
		}
	}
	return v, nil
}

// checkOptions say which invariants a state must meet at once.
type checkOptions struct {
	// tombstoneLeftovers: an owner may still hold an address in a
	// tombstoned range of its host (a reclaim has not released it yet).
	tombstoneLeftovers bool
	// counts: each host's used count is exact.
	counts bool
}

// checkState checks the invariants every state meets.
func checkState(m *model, s *mstate, opt checkOptions) string {
	v, err := decodeView(s.st)
	if err != nil {
		return "corrupt: " + err.Error()
	}
	// The ring covers the pool exactly once.
	if err := v.ring.check(); err != nil {
		if len(v.ring.tokens) == 2 && v.ring.tokens[1].Start == v.ring.tokens[0].Start {
			return "ring-cover: " + v.ring.tokens[1].Host // modelRing's overlap
		}
		return "ring-cover: " + err.Error()
	}
	// Each host's state lists exactly its live ranges (what its
	// allocations, conditioned on the state alone, allocate in).
	for host, hs := range v.states {
		got := hs.spans()
		var want []span
		for i, t := range v.ring.tokens {
			if t.Host == host && !t.Tomb {
				want = append(want, v.ring.spanOf(i))
			}
		}
		if capacityOf(got) != capacityOf(want) || !coversAll(want, got) {
			return fmt.Sprintf("outside-range: %s's state lists %v but the ring gives it %v", host, got, want)
		}
	}
	// No address held by two live owners; records, address keys and the
	// host index agree.
	listed := map[u128]string{}
	for o, rec := range v.owners {
		if !v.index[hostOwnerKey(rec.Host, rec.Owner)] {
			return fmt.Sprintf("host-index: owner %s of %s is not in its host's index", o, rec.Host)
		}
		for _, x := range rec.Addrs {
			a := toU128(x.Addr)
			if other, ok := listed[a]; ok {
				return fmt.Sprintf("two-owners: %s is listed by %s and %s", short(a), other, o)
			}
			listed[a] = o
			if h, ok := v.addrs[a]; !ok || h.IsHold() || h.Owner != o || h.Host != rec.Host {
				return fmt.Sprintf("records-disagree: %s lists %s, whose key says %q", o, short(a), h.encode())
			}
		}
	}
	if len(v.index) != len(v.owners) {
		return fmt.Sprintf("host-index: %d index keys for %d owners", len(v.index), len(v.owners))
	}
	count := map[string]uint64{}
	for _, a := range sortedAddrs(v.addrs) {
		h := v.addrs[a]
		t := v.ring.ownerOf(a)
		if h.IsHold() {
			if t.Host != h.Host {
				return fmt.Sprintf("outside-range: %s is held for reservation %s of %s but lies in a range of %s", short(a), h.HoldName, h.Host, hostName(t.Host))
			}
			continue
		}
		if listed[a] != h.Owner {
			return fmt.Sprintf("records-disagree: %s is held by %s, whose record does not list it", short(a), h.Owner)
		}
		count[h.Host]++
		switch {
		case t.Host == h.Host && !t.Tomb:
		case t.Host == h.Host && t.Tomb:
			if !opt.tombstoneLeftovers {
				return fmt.Sprintf("tombstoned: %s is held by %s of %s in a tombstoned range", short(a), h.Owner, h.Host)
			}
		default:
			// No exception, not even for a moment: a claim of a live
			// host's space requires in its commit that the space holds
			// no address, so no stray can arise.
			return fmt.Sprintf("outside-range: %s is held by %s of %s but lies in a range of %s", short(a), h.Owner, h.Host, hostName(t.Host))
		}
	}
	if opt.counts {
		for host, hs := range v.states {
			if hs.Used != count[host] {
				return fmt.Sprintf("host-count: %s counts %d used addresses, its owners hold %d", host, hs.Used, count[host])
			}
		}
		for host, n := range count {
			if _, ok := v.states[host]; !ok && n > 0 {
				return fmt.Sprintf("host-count: %s holds %d addresses but has no state", host, n)
			}
		}
	}
	return ""
}

func sortedAddrs(m map[u128]holder) []u128 {
	var out []u128
	for a := range m {
		out = append(out, a)
	}
	slices.SortFunc(out, func(x, y u128) int { return x.cmp(y) })
	return out
}

// checkCommit checks what one successful commit did: it takes or frees no
// address of an owner whose record it does not delete, and it deletes
// only records that exist (each owner released exactly once). With
// reclaim, also: a reclaim touches nothing of a host whose liveness key
// exists, and no op of a host commits from a view its host's tombstoning
// made stale.
func checkCommit(m *model, tr *transition, reclaim bool) string {
	rec := tr.commit
	if rec == nil || !rec.ok {
		return ""
	}
	o := m.ops[tr.op]
	deleted := map[string]bool{}
	for _, op := range rec.ops {
		if strings.HasPrefix(op.Key, prefixOwner) && op.Delete {
			if rec.before[op.Key].rev == 0 {
				return fmt.Sprintf("released twice: %s deletes the record %s, which is gone", o.name, op.Key)
			}
			deleted[strings.TrimPrefix(op.Key, prefixOwner)] = true
		}
	}
	for _, op := range rec.ops {
		if strings.HasPrefix(op.Key, portEndpointPrefix) && op.Delete && rec.before[op.Key].rev == 0 {
			return fmt.Sprintf("released twice: %s deletes the endpoint record %s, which is gone", o.name, op.Key)
		}
	}
	for _, op := range rec.ops {
		if !strings.HasPrefix(op.Key, addrPrefix(modelPool)) {
			continue
		}
		b := rec.before[op.Key]
		if b.rev == 0 {
			continue
		}
		if h := parseHolder(b.val); !h.IsHold() && !deleted[h.Owner] {
			a, _ := parseAddrKey(op.Key)
			return fmt.Sprintf("two-owners: %s rewrites %s, held by %s whose record stays", o.name, short(a), h.Owner)
		}
	}
	if !reclaim {
		return ""
	}
	portsOnly := true
	for _, op := range rec.ops {
		portsOnly = portsOnly && strings.HasPrefix(op.Key, "p/")
	}
	if portsOnly && o.kind != "sweep" {
		// Publishing a port is fenced by nothing: a port a reclaimed host's
		// plugin publishes is released by the next sweep (the quiescence
		// check runs one).
		return ""
	}
	if o.kind == "alloc" {
		// No allocation puts an owner into a tombstoned range (owners of
		// before the tombstoning may be left there; Readopt takes back
		// only those).
		r := modelRing(tr.before.st, opsPatch(rec.ops))
		for _, op := range rec.ops {
			if !strings.HasPrefix(op.Key, addrPrefix(modelPool)) || op.Delete || parseHolder(op.Value).IsHold() {
				continue
			}
			if a, ok := parseAddrKey(op.Key); ok && r.ownerOf(a).Tomb {
				return fmt.Sprintf("tombstoned: %s allocates %s in a tombstoned range of %s", o.name, short(a), r.ownerOf(a).Host)
			}
		}
	}
	if tr.fenced && o.kind == "alloc" {
		return fmt.Sprintf("stale view: %s commits from what it read before %s was reclaimed", o.name, o.host)
	}
	if tr.fenced && o.kind == "release" {
		return findingPrefix + releaseFinding
	}
	if o.kind != "sweep" {
		return ""
	}
	st := tr.before.st // liveness keys: no reclaim commit writes them
	ringOld, ringNow := modelRing(st, nil), modelRing(st, opsPatch(rec.ops))
	for _, op := range rec.ops {
		switch {
		case strings.HasPrefix(op.Key, rangePrefix(modelPool)):
			old, now := ringOld, ringNow
			for _, a := range modelAddrs() {
				if was, is := old.ownerOf(a), now.ownerOf(a); !was.Tomb && is.Tomb && isLive(st, was.Host) {
					return fmt.Sprintf("live host reclaimed: %s tombstones %s of %s, whose liveness key exists", o.name, short(a), was.Host)
				}
			}
		case strings.HasPrefix(op.Key, prefixOwner) && op.Delete:
			var r Allocation
			if err := decodeAllocation(rec.before[op.Key].val, &r); err == nil && isLive(st, r.Host) {
				return fmt.Sprintf("live host reclaimed: %s releases %s of %s, whose liveness key exists", o.name, r.Owner, r.Host)
			}
		case strings.HasPrefix(op.Key, hostPrefix(modelPool)) && op.Delete:
			if h := strings.TrimPrefix(op.Key, hostPrefix(modelPool)); isLive(st, h) {
				return fmt.Sprintf("live host reclaimed: %s drops the state of %s, whose liveness key exists", o.name, h)
			}
		case strings.HasPrefix(op.Key, portEndpointPrefix) && op.Delete:
			var e portalloc.Endpoint
			if err := json.Unmarshal(rec.before[op.Key].val, &e); err == nil && isLive(st, e.Host) {
				return fmt.Sprintf("live host reclaimed: %s releases the published ports of %s of %s, whose liveness key exists", o.name, op.Key, e.Host)
			}
		}
	}
	return ""
}

// Keys of pkg/portalloc the checks read: endpoint records and the hosts'
// index of their endpoints.
const (
	portEndpointPrefix = "p/e/"
	portIndexPrefix    = "p/i/"
)

// portsAudit runs portalloc.Audit on st with the hosts the pool knows as
// holders (ringctl check's Hosts; not its Attachments: a host that came
// back keeps the ports of an attachment whose address was released before
// it came back, until the container's DEL, as it keeps the container).
func (m *model) portsAudit(st *mstore) string {
	a, _ := New(direct{st}, "auditor", WithClock(func() time.Time { return m.clock }))
	hosts, err := a.Hosts(context.Background(), orphanAfter)
	if err != nil {
		return "hosts: " + err.Error()
	}
	h := portalloc.Holders{Hosts: map[string]bool{}}
	for _, x := range hosts {
		h.Hosts[x.Name] = true
	}
	fs, err := portalloc.Audit(context.Background(), direct{st}, h)
	if err != nil {
		return "ports audit: " + err.Error()
	}
	var out []string
	for _, f := range fs {
		out = append(out, f.String())
	}
	return strings.Join(out, "; ")
}

// portsOf lists the endpoint records and index keys of host's ports in st.
func portsOf(st *mstore, host string) []string {
	var out []string
	for _, k := range st.sortedKeys() {
		switch {
		case strings.HasPrefix(k, portIndexPrefix+host+"/"):
			out = append(out, k)
		case strings.HasPrefix(k, portEndpointPrefix):
			var e portalloc.Endpoint
			if json.Unmarshal(st.data[k].val, &e) == nil && e.Host == host {
				out = append(out, k)
			}
		}
	}
	return out
}

func isLive(st *mstore, host string) bool { _, ok := st.data[LivenessKey(host)]; return ok }

// recover runs what brings a quiescent state back to the steady state
// after every container is gone, sequentially on a copy: the given steps,
// then each host's GC with no valid owner. It returns the store after.
func (m *model) recoverWith(s *mstate, hosts []string, before func(st store.Store) error) (*mstore, error) {
	st := s.st.clone()
	ctx := context.Background()
	if before != nil {
		if err := before(direct{st}); err != nil {
			return nil, err
		}
	}
	for _, h := range hosts {
		a, _ := New(direct{st}, h, WithClock(func() time.Time { return m.clock }))
		if _, err := a.GC(ctx, KindCNI, "net", nil); err != nil {
			return nil, fmt.Errorf("GC on %s: %w", h, err)
		}
	}
	return st, nil
}

// audit runs the product's Audit on st.
func (m *model) audit(st *mstore) string {
	a, _ := New(direct{st}, "auditor", WithClock(func() time.Time { return m.clock }))
	vs, err := a.Audit(context.Background())
	if err != nil {
		return "audit: " + err.Error()
	}
	var out []string
	for _, v := range vs {
		out = append(out, v.String())
	}
	return strings.Join(out, "; ")
}

// nothingLeaked: every address is free or held for a reservation; no
// owner, index key or used count is left.
func nothingLeaked(st *mstore) string {
	v, err := decodeView(st)
	if err != nil {
		return "corrupt: " + err.Error()
	}
	for a, h := range v.addrs {
		if !h.IsHold() {
			return fmt.Sprintf("leak: %s is still held by %s after every host's GC", short(a), h.Owner)
		}
	}
	if len(v.owners) > 0 || len(v.index) > 0 {
		return fmt.Sprintf("leak: %d owner records and %d index keys left after every host's GC", len(v.owners), len(v.index))
	}
	for host, hs := range v.states {
		if hs.Used != 0 {
			return fmt.Sprintf("leak: %s counts %d used addresses after its GC", host, hs.Used)
		}
	}
	return ""
}

// ringModel: seed 002. A pool of six addresses whose every range was
// tombstoned when host h0 left, one address still held there for h0's
// reservation; hosts h1, h2, h3 allocate (dynamic and static, claiming
// tombstoned space and live hosts' free space) and release, up to three
// operations at once, any of them crashing after a commit. Every state:
// checkState with exact counts, no owner in a tombstoned range and none
// outside its host's ranges; every commit: checkCommit; every quiescent
// state: the product's Audit is clean, and after every host's GC nothing
// is leaked.
func ringModel(broken faults) *model {
	m := &model{name: "ring", maxProcs: 3, broken: broken, attempts: 3,
		clock: time.Unix(1_800_000_000, 500_000_000).UTC()}
	m.ops = []mop{
		allocOp("h1", "a", 0, -1), // 0
		allocOp("h1", "b", 6, -1), // 1: same host as a; in the half h2 claims
		allocOp("h2", "c", 0, -1), // 2
		allocOp("h3", "d", 0, -1), // 3
		releaseOp("h1", "a", 0),   // 4
		releaseOp("h2", "c", 2),   // 5
	}
	if os.Getenv("RINGIPAM_MODEL_FULL") != "" {
		m.ops = append(m.ops, allocOp("h2", "e", 3, -1))
	}
	m.setup = func(m *model, st *mstore) {
		ctx := context.Background()
		h0, _ := New(direct{st}, "h0", WithClock(func() time.Time { return m.clock }), WithReservationHold(time.Hour))
		// y's claim gives h0 the whole pool; z's address stays held for
		// its reservation when z is released.
		for _, req := range []Request{
			{Owner: own("y"), Wants: ipWant(modelPool), Defs: []Def{modelDef()}},
			{Owner: own("z"), Reservation: "rz", Wants: []Want{{Pool: modelPool, Role: RoleIP, Addr: modelAddr(2)}}},
		} {
			if _, err := h0.Allocate(ctx, req); err != nil {
				panic(err)
			}
			if _, _, err := h0.Release(ctx, req.Owner); err != nil {
				panic(err)
			}
		}
		h3, _ := New(direct{st}, "h3", WithClock(func() time.Time { return m.clock }))
		if _, err := h3.Reclaim(ctx, "h0", ReclaimOptions{}); err != nil {
			panic(err)
		}
	}
	m.check = func(m *model, s *mstate, tr *transition) string {
		if tr != nil {
			return checkCommit(m, tr, false)
		}
		return checkState(m, s, checkOptions{counts: true})
	}
	m.quiescent = func(m *model, s *mstate, find func(name, detail string)) string {
		if v := m.audit(s.st); v != "" {
			return "Audit of a quiescent state: " + v
		}
		st, err := m.recoverWith(s, []string{"h1", "h2", "h3"}, nil)
		if err != nil {
			return "recovery: " + err.Error()
		}
		if v := nothingLeaked(st); v != "" {
			return v
		}
		if v := m.audit(st); v != "" {
			return "Audit after every host's GC: " + v
		}
		return ""
	}
	return m
}

func logResult(t *testing.T, m *model, res *result) {
	t.Logf("model check %s: %d states, %d transitions, %s", m.name, res.states, res.transitions, res.elapsed.Round(time.Millisecond))
	for name, f := range res.findings {
		t.Logf("model check %s: finding in %d states: %s; shortest trace:\n    %s", m.name, f.states, name, strings.Join(f.trace, "\n    "))
	}
}

func TestModelCheckRing(t *testing.T) {
	m := ringModel(faults{})
	res := m.explore(t, 0)
	logResult(t, m, res)
	if res.violation != "" {
		t.Fatalf("model check %s: %s\ntrace:\n    %s", m.name, res.violation, strings.Join(res.trace, "\n    "))
	}
	// Strays cannot arise (issue 33 item 4): the ring check has no
	// finding at all.
	for name := range res.findings {
		t.Errorf("model check %s: finding %q reached, want none", m.name, name)
	}
}

const releaseFinding = "a release planned before its host was tombstoned commits after it: the host state it requires absent was written and dropped again in between (ABA); the owner's record was unchanged, so it is still released once, and the host's state comes back with count 0"

// reclaimModel: seed 004. Host h1 holds a, h2 holds c (h2 claimed half of
// h1's space); every host's liveness key exists. h1 goes down (its lease
// expires) and may come back; the agents of h2 and h3 sweep at once; h1's
// plugin allocates and releases from what it read, possibly before it was
// reclaimed (a returning host's stale plan); h2 allocates (claiming
// tombstoned space). Every state: checkState (an owner may still be in a
// tombstoned range while its reclaim is under way). Every commit:
// checkCommit with reclaim: nothing of a host whose liveness key exists is
// released, a reclaimed host's stale view never commits, each owner is
// released exactly once. Every quiescent state: a sweep (when h1 is down)
// leaves the product's Audit clean, and after every host's GC nothing is
// leaked.
func reclaimModel(broken faults) *model { return reclaimModelOf(broken, false) }

// reclaimPortsModel is reclaimModel with published ports: a's attachment
// has published a port before h1 goes down, the agents' sweeps release
// the ports of orphaned hosts after the pool's reclaim (ReleaseHost under
// ReclaimGuard, as cmd/ringipamd/agent's sweep does), and h1's portmap-ingress
// publishes a port for d from whatever it reads (also after h1 was
// reclaimed). h1's allocation of d is left to reclaimModel: with it and the
// ports' release the check passes 100 000 states (over 100 s here), past
// make model-check's budget. Every commit,
// besides reclaimModel's: no sweep releases an endpoint of a host whose
// liveness key exists; each endpoint is released once. Every quiescent
// state, after the sweep: portalloc.Audit is clean, and nothing of h1's
// ports is left while h1 is down.
func reclaimPortsModel(broken faults) *model { return reclaimModelOf(broken, true) }

func reclaimModelOf(broken faults, ports bool) *model {
	m := &model{name: "reclaim", maxProcs: 3, broken: broken, attempts: 3,
		clock: time.Unix(1_800_000_000, 500_000_000).UTC()}
	m.ops = []mop{
		livenessOp("h1", false, -1), // 0
		livenessOp("h1", true, 0),   // 1
		sweepOp("h2", 0),            // 2
		sweepOp("h3", 0),            // 3
		allocOp("h1", "d", 0, -1),   // 4
	}
	if !ports {
		// (In reclaim-ports h1's readopting is the quiescence step alone:
		// it touches no port, and as an op it doubles the states.)
		m.ops = append(m.ops, readoptOp("h1", 1)) // 5
	}
	if ports {
		m.name = "reclaim-ports"
		m.ops[2], m.ops[3] = m.agentSweepOp("h2", 0), m.agentSweepOp("h3", 0)
		m.ops[4] = m.publishOp("h1", "d", -1)
	}
	if os.Getenv("RINGIPAM_MODEL_FULL") != "" {
		m.ops = append(m.ops, releaseOp("h1", "a", -1), allocOp("h2", "e", 0, 0))
	}
	m.setup = func(m *model, st *mstore) {
		ctx := context.Background()
		for _, x := range []struct{ host, id string }{{"h1", "a"}, {"h2", "c"}} {
			a, _ := New(direct{st}, x.host, WithClock(func() time.Time { return m.clock }))
			if _, err := a.Allocate(ctx, Request{Owner: own(x.id), Wants: ipWant(modelPool), Defs: []Def{modelDef()}}); err != nil {
				panic(err)
			}
		}
		if ports {
			// a's attachment publishes a port (the hosts' index of their
			// endpoints built first, as every reader of a new store does).
			if _, err := m.ports(direct{st}, "h1").HostEndpoints(ctx, "h1", ""); err != nil {
				panic(err)
			}
			if err := m.publish(ctx, direct{st}, "h1", "a"); err != nil {
				panic(err)
			}
		}
		for _, h := range []string{"h1", "h2", "h3"} {
			if err := st.apply(nil, []store.Op{store.Put(LivenessKey(h), []byte("lease"))}); err != nil {
				panic(err)
			}
		}
	}
	m.check = func(m *model, s *mstate, tr *transition) string {
		if tr != nil {
			return checkCommit(m, tr, true)
		}
		return checkState(m, s, checkOptions{tombstoneLeftovers: true})
	}
	m.quiescent = func(m *model, s *mstate, find func(name, detail string)) string {
		st := s.st.clone()
		if isLive(st, "h1") {
			// The named step that finishes a reclaim the host's return
			// cut short: its agent readopts (until it succeeds).
			a, _ := New(direct{st}, "h1", WithClock(func() time.Time { return m.clock }))
			if _, err := a.Readopt(context.Background()); err != nil {
				return "readopt: " + err.Error()
			}
		} else {
			// The named step that finishes a reclaim a crash cut short:
			// the next sweep.
			a, _ := New(direct{st}, "h2", WithClock(func() time.Time { return m.clock }))
			if err := m.agentSweep(context.Background(), a); err != nil {
				return "recovery sweep: " + err.Error()
			}
		}
		if v := m.portsAudit(st); v != "" {
			return "ports Audit of a quiescent state after a sweep: " + v
		}
		if left := portsOf(st, "h1"); !isLive(st, "h1") && len(left) > 0 {
			return fmt.Sprintf("ports leak: h1 is gone and a sweep ran, yet %s remain", strings.Join(left, ", "))
		}
		v := m.audit(st)
		switch {
		case v != "":
			return "Audit of a quiescent state after a sweep: " + v
		}
		after, err := m.recoverWith(&mstate{st: st}, []string{"h1", "h2", "h3"}, nil)
		if err != nil {
			return "recovery: " + err.Error()
		}
		if v := nothingLeaked(after); v != "" {
			return v
		}
		if v := m.audit(after); v != "" {
			return "Audit after every host's GC: " + v
		}
		return ""
	}
	return m
}

func TestModelCheckReclaim(t *testing.T) {
	for _, m := range []*model{reclaimModel(faults{}), reclaimPortsModel(faults{})} {
		res := m.explore(t, 0)
		logResult(t, m, res)
		if res.violation != "" {
			t.Fatalf("model check %s: %s\ntrace:\n    %s", m.name, res.violation, strings.Join(res.trace, "\n    "))
		}
	}
}

// TestModelCheckBroken switches off one guard at a time (faults) and
// requires the check to catch it, printing its counterexample: the
// shortest sequence of steps that reaches the broken invariant.
func TestModelCheckBroken(t *testing.T) {
	for _, c := range []struct {
		name   string
		model  func(faults) *model
		broken faults
		want   string // the invariant the violation names
	}{
		// Layout 4: without the range keys' conditions two claims of one
		// tombstoned range both commit, which leaves overlapping range
		// keys (in layout 3 the one ring key could not overlap).
		{"ring condition dropped", ringModel, faults{noRingCond: true}, "ring-cover"},
		{"host-state condition dropped", ringModel, faults{noHostCond: true}, "host-count"},
		{"claim's range condition dropped", ringModel, faults{noRangeCond: true}, "outside-range"},
		{"tombstones ignored", ringModel, faults{ignoreTombs: true}, "outside-range"},
		{"tombstones ignored (returning host)", reclaimModel, faults{ignoreTombs: true}, "tombstoned"},
		{"liveness condition of reclaim dropped", reclaimModel, faults{noLiveCond: true}, "live host reclaimed"},
		{"sweeper releases ports under a forced guard", reclaimPortsModel, faults{sweepForce: true}, "live host reclaimed"},
		{"sweeper releases ports without a guard", reclaimPortsModel, faults{sweepNoGuard: true}, "live host reclaimed"},
	} {
		t.Run(c.name, func(t *testing.T) {
			m := c.model(c.broken)
			res := m.explore(t, 0)
			if res.violation == "" {
				logResult(t, m, res)
				t.Fatalf("model check %s with %s: not caught", m.name, c.name)
			}
			t.Logf("model check %s with %s: caught after %d states: %s\n    %s", m.name, c.name, res.states, res.violation, strings.Join(res.trace, "\n    "))
			if !strings.Contains(res.violation, c.want) {
				t.Fatalf("caught as %q, want %s", res.violation, c.want)
			}
		})
	}
}

// coversAll reports whether every span of inner lies inside one of outer.
func coversAll(outer, inner []span) bool {
	for _, s := range inner {
		ok := false
		for _, o := range outer {
			ok = ok || o.lo.cmp(s.lo) <= 0 && s.hi.cmp(o.hi) <= 0
		}
		if !ok {
			return false
		}
	}
	return true
}
