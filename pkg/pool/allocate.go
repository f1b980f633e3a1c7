package pool

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"time"

	"github.com/ringipam/ringipam/pkg/store"
)

// hostState is a host's own record in one pool.
type hostState struct {
	Cursor netip.Addr `json:"c,omitzero"` // last address handed out dynamically
	Used   uint64     `json:"u"`          // addresses owners of this host hold in the pool (holds excluded)
	// Next and Run: the last scan saw Run free addresses starting at Next,
	// right after Cursor. The next dynamic allocations take them without
	// scanning; a stale hint only costs one conflict and a scan.
	Next netip.Addr `json:"n,omitzero"`
	Run  uint64     `json:"r,omitempty"`
	// Seen is when this host last allocated in the pool (Unix seconds):
	// the last-seen time that reclaiming lost hosts builds on.
	Seen int64 `json:"s,omitempty"`
	// Ranges are the host's live ranges of the pool, as its range keys
	// say (ranges.go); Layout is stateLayout once this layout wrote the
	// state (an older ringipam's rewrite drops both).
	Ranges []ownRange `json:"g,omitempty"`
	Layout int        `json:"v,omitempty"`
	// Free says whether the free-space index key f/<pool>/<host> exists
	// (freeindex.go): freeUnknown when an older ringipam wrote the state.
	Free int `json:"f,omitempty"`
}

// maxRun caps the free run remembered in the host state.
const maxRun = 1 << 32

// reservation remembers a named owner's addresses. While Owner is empty and
// Until lies ahead, the addresses are held for the name (their address keys
// carry a hold, see holder).
type reservation struct {
	Kind  Kind       `json:"k,omitempty"`
	Owner string     `json:"o,omitempty"` // current holder, "" when released
	Addrs []Assigned `json:"a,omitempty"`
	Until int64      `json:"u,omitempty"` // end of the hold after release (Unix seconds)
}

// Allocate gives req.Owner every address it wants, in one transaction. It is
// idempotent: an owner that already holds an address for a (pool, role)
// gets it back. See the package doc for the errors.
func (a *Allocator) Allocate(ctx context.Context, req Request) (Allocation, error) {
	if err := validateRequest(req); err != nil {
		return Allocation{}, err
	}
	defs, err := canonicalDefs(req)
	if err != nil {
		return Allocation{}, err
	}
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	var pools []string
	for _, w := range req.Wants {
		pools = append(pools, w.Pool)
	}
	unlock, err := a.lockPools(ctx, pools)
	if err != nil {
		return Allocation{}, err
	}
	defer unlock()
	var p plan
	err = a.run(ctx, func(attempt int) error {
		var snap *snapshot
		var err error
		if attempt == 0 {
			var done bool
			var rev int64
			if p, snap, rev, done, err = a.speculate(ctx, req, defs); err != nil {
				return err
			}
			if done {
				a.noteAllocation(snap, p, rev)
				return nil
			}
		}
		if snap == nil {
			if snap, err = a.read(ctx, req, defs); err != nil {
				return err
			}
		}
		if p, err = a.plan(ctx, snap, req, attempt == 0); err != nil {
			return err
		}
		rev, err := a.commit(ctx, p)
		if err != nil {
			return err
		}
		if p.noop {
			a.touch(ctx, snap.seenKV) // a replay commits nothing
		}
		a.noteAllocation(snap, p, rev)
		return nil
	})
	if err != nil {
		return Allocation{}, err
	}
	return p.alloc, nil
}

// canonicalDefs normalises req.Defs and returns them by pool name.
func canonicalDefs(req Request) (map[string]Def, error) {
	if len(req.Defs) == 0 {
		return nil, nil
	}
	wanted := map[string]bool{}
	for _, w := range req.Wants {
		wanted[w.Pool] = true
	}
	out := map[string]Def{}
	for _, d := range req.Defs {
		n, err := d.Normalize()
		if err != nil {
			return nil, err
		}
		if !wanted[n.Name] {
			return nil, fmt.Errorf("%w: definition of pool %s, which the request does not want", ErrInvalid, n.Name)
		}
		out[n.Name] = n
	}
	return out, nil
}

func validateRequest(req Request) error {
	if err := req.Owner.Validate(); err != nil {
		return err
	}
	if err := validReservation(req.Reservation); err != nil {
		return err
	}
	if len(req.Wants) == 0 {
		return fmt.Errorf("%w: request for %s wants no address", ErrInvalid, req.Owner)
	}
	seen := map[string]bool{}
	for _, w := range req.Wants {
		if err := validName("pool name", w.Pool); err != nil {
			return err
		}
		if w.Role == "" {
			return fmt.Errorf("%w: want in pool %s has no role", ErrInvalid, w.Pool)
		}
		k := w.Pool + "\x00" + string(w.Role)
		if seen[k] {
			return fmt.Errorf("%w: pool %s role %s asked twice in one request", ErrInvalid, w.Pool, w.Role)
		}
		seen[k] = true
	}
	return nil
}

// validReservation accepts "" (none) or a name of printable characters (a
// '/' is fine: "namespace/pod") of at most 253 bytes.
func validReservation(name string) error {
	if len(name) > maxOwnerPart || hasControl(name) {
		return fmt.Errorf("%w: reservation name %q must be at most %d bytes without control characters", ErrInvalid, name, maxOwnerPart)
	}
	return nil
}

// snapshot is everything one allocation reads in its first round trip,
// decoded.
type snapshot struct {
	ownerKV store.KV
	held    Allocation // the owner's record (Owner, Host and Reservation set even when absent)
	exists  bool       // the owner record exists
	resvKV  store.KV   // the reservation record (when the request names one)
	resv    reservation
	pools   []*poolTxn // one per wanted pool, in request order
	// newDefs are the definitions this allocation records (first use of
	// the pool), with the registry they go into.
	newDefs    []Def
	registryKV store.KV
	registry   registry
	seenKV     store.KV // the host record, when the allocator keeps last-seen
}

// poolTxn is one pool's state as read for one allocation, and its changes.
type poolTxn struct {
	name    string
	def     Def
	segs    []span
	defKV   store.KV
	host    hostState // this host's state, its ranges among it
	hostKV  store.KV
	taken   map[u128]bool
	useHint bool
	// tx gathers the changes of range keys (claims, moves of one
	// address) this allocation makes in the pool; nil while it makes none.
	tx *ringTxn
}

// ringTxn returns t's ring transaction, starting it.
func (t *poolTxn) ringTxn(a *Allocator) *ringTxn {
	if t.tx == nil {
		t.tx = a.newRingTxn(t.name, t.def)
		t.tx.own(a.host, t.hostKV, &t.host)
	}
	return t.tx
}

func (s *snapshot) pool(name string) *poolTxn {
	for _, t := range s.pools {
		if t.name == name {
			return t
		}
	}
	return nil
}

// keyset collects the keys of one Get and finds each answer by its key.
type keyset struct {
	keys []string
	at   map[string]int
}

func (k *keyset) add(keys ...string) {
	if k.at == nil {
		k.at = map[string]int{}
	}
	for _, key := range keys {
		if _, ok := k.at[key]; !ok {
			k.at[key] = len(k.keys)
			k.keys = append(k.keys, key)
		}
	}
}

func (k *keyset) kv(kvs []store.KV, key string) store.KV { return kvs[k.at[key]] }

// readKeys are the keys of an allocation's first read, and the wanted pools
// in request order.
func (a *Allocator) readKeys(req Request) (keyset, []string) {
	var ks keyset
	ks.add(ownerKey(req.Owner))
	if req.Reservation != "" {
		ks.add(resvKey(req.Owner.Kind, req.Owner.Network, req.Reservation))
	}
	var pools []string
	for _, w := range req.Wants {
		if !slices.Contains(pools, w.Pool) {
			pools = append(pools, w.Pool)
			ks.add(defKey(w.Pool), hostKey(w.Pool, a.host))
		}
	}
	ks.add(a.seenKey()...)
	return ks, pools
}

// read fetches and decodes the state one allocation decides on, in one round
// trip (a second only when the request records a new pool, for the
// registry). defs are the canonical definitions the request carries.
func (a *Allocator) read(ctx context.Context, req Request, defs map[string]Def) (*snapshot, error) {
	ks, pools := a.readKeys(req)
	kvs, err := a.get(ctx, ks.keys...)
	if err != nil {
		return nil, err
	}
	return a.decodeSnapshot(ctx, req, defs, ks, pools, kvs)
}

// decodeSnapshot decodes kvs, read (or noted) at the keys ks and pools
// of readKeys, in their order.
func (a *Allocator) decodeSnapshot(ctx context.Context, req Request, defs map[string]Def, ks keyset, pools []string, kvs []store.KV) (*snapshot, error) {
	s := &snapshot{ownerKV: ks.kv(kvs, ownerKey(req.Owner))}
	if k := a.seenKey(); len(k) > 0 {
		s.seenKV = ks.kv(kvs, k[0])
	}
	s.held = Allocation{Owner: req.Owner, Host: a.host, Reservation: req.Reservation}
	if s.ownerKV.Exists() {
		if err := decodeAllocation(s.ownerKV.Value, &s.held); err != nil {
			return nil, fmt.Errorf("owner %s: stored allocation is corrupt: %w", req.Owner, err)
		}
		s.exists = true
	}
	if req.Reservation != "" {
		s.resvKV = ks.kv(kvs, resvKey(req.Owner.Kind, req.Owner.Network, req.Reservation))
		if s.resvKV.Exists() {
			if err := json.Unmarshal(s.resvKV.Value, &s.resv); err != nil {
				return nil, fmt.Errorf("reservation %s: corrupt: %w", req.Reservation, err)
			}
		}
	}
	var err error
	for _, p := range pools {
		t := &poolTxn{name: p, defKV: ks.kv(kvs, defKey(p)), hostKV: ks.kv(kvs, hostKey(p, a.host)), taken: map[u128]bool{}}
		given, hasGiven := defs[p]
		switch {
		case !t.defKV.Exists() && hasGiven:
			t.def = given // recorded by this very commit
			s.newDefs = append(s.newDefs, given)
		case hasGiven && !sameAsRecorded(t.defKV, given):
			return nil, mismatch(p, t.defKV.Value, given)
		default:
			if t.def, err = decodeDef(p, t.defKV); err != nil {
				return nil, err
			}
		}
		t.segs = dynamicSegmentsOf(t.def)
		if t.hostKV.Exists() {
			if err := decodeHostState(t.hostKV.Value, &t.host); err != nil {
				return nil, fmt.Errorf("pool %s host %s: corrupt state: %w", p, a.host, err)
			}
		}
		if err := a.repairState(ctx, t); err != nil {
			return nil, err
		}
		s.pools = append(s.pools, t)
	}
	if len(s.newDefs) > 0 {
		reg, err := a.st.Get(ctx, registryKey)
		if err != nil {
			return nil, err
		}
		s.registryKV = reg[0]
		if s.registry, err = decodeRegistry(reg[0]); err != nil {
			return nil, err
		}
	}
	return s, nil
}

// plan is one allocation's decision: what to write, under which conditions.
type plan struct {
	alloc Allocation
	conds []store.Cond
	ops   []store.Op
	noop  bool // the owner already holds everything asked
}

func (p *plan) require(c ...store.Cond) { p.conds = append(p.conds, c...) }
func (p *plan) write(o ...store.Op)     { p.ops = append(p.ops, o...) }

// plan decides the allocation on s. It reads more only to find a free
// address (an ordered scan from the cursor, unless the free-run hint
// answers) or to check a static address. useHint lets dynamic picks trust
// the host state's free-run hint (first attempt only: after a conflict the
// host's ranges are scanned).
func (a *Allocator) plan(ctx context.Context, s *snapshot, req Request, useHint bool) (plan, error) {
	p := plan{alloc: s.held}
	// Definitions first: even an owner that already holds everything must
	// not be served from a pool this host knows differently.
	if len(s.newDefs) > 0 {
		reg := s.registry
		for _, d := range s.newDefs {
			var err error
			if reg, err = reg.admit(d); err != nil {
				return plan{}, err
			}
			b, _ := json.Marshal(d)
			p.require(store.Cond{Key: defKey(d.Name)})
			// The layout-3 ring key holds the marker a layout-3 process
			// cannot read as a ring (oldRingKey).
			p.write(store.Put(defKey(d.Name), b), store.Put(oldRingKey(d.Name), movedMarker(d.Name)))
		}
		b, _ := json.Marshal(reg)
		p.require(store.Unchanged(s.registryKV))
		p.write(store.Put(registryKey, b))
	}
	owner := req.Owner.String()
	var missing []Want
	for _, w := range req.Wants {
		if held, ok := s.held.Addr(w.Pool, w.Role); ok {
			if w.Addr.IsValid() && w.Addr != held {
				return plan{}, &ExistsError{Owner: owner, Holds: addrsOf(s.held), Asked: w.Addr}
			}
			continue
		}
		missing = append(missing, w)
	}
	if len(missing) == 0 {
		if len(p.ops) == 0 {
			p.noop = true
		}
		return p, nil
	}
	if s.exists && s.held.Host != a.host {
		return plan{}, &ExistsError{Owner: owner, Holds: addrsOf(s.held), Host: s.held.Host}
	}
	p.require(store.Unchanged(s.ownerKV))
	if req.Reservation != "" {
		p.require(store.Unchanged(s.resvKV))
		if r := s.resv; r.Owner != "" && r.Owner != owner {
			holderKV, err := a.st.Get(ctx, ownerKeyOf(r.Owner))
			if err != nil {
				return plan{}, err
			}
			if holderKV[0].Exists() {
				return plan{}, &InUseError{Name: req.Reservation, Pool: req.Owner.Network, Holder: r.Owner}
			}
			p.require(store.Cond{Key: ownerKeyOf(r.Owner)})
		}
	}
	for _, t := range s.pools {
		t.useHint = useHint
		for _, x := range s.held.Addrs {
			if x.Pool == t.name {
				t.taken[toU128(x.Addr)] = true
			}
		}
	}
	for _, w := range missing {
		t := s.pool(w.Pool)
		got, kv, err := a.pick(ctx, t, w, req, s.resv, &p)
		if err != nil {
			return plan{}, err
		}
		t.taken[got] = true
		t.host.Used++
		p.require(store.Unchanged(kv))
		p.write(store.Put(kv.Key, ownerHolder(a.host, req.Owner).encode()))
		addr := got.addr(t.def.is4())
		p.write(historyOp(w.Pool, addr, Event{Time: a.now(), What: EventAlloc, Owner: owner, Host: a.host, Reserv: req.Reservation}))
		p.alloc.Addrs = append(p.alloc.Addrs, Assigned{Pool: w.Pool, Role: w.Role, Addr: addr})
	}
	for _, t := range s.pools {
		t.host.Seen = a.now().Unix()
		if !a.broken.noHostCond {
			p.require(store.Unchanged(t.hostKV))
		}
		conds, ops := t.tx.finish()
		p.require(conds...)
		p.write(ops...)
		p.write(putHostState(t.name, a.host, &t.host)...)
	}
	if req.shared && !s.exists {
		p.alloc.Holders = []string{a.host}
	}
	if !s.exists && req.Pod != nil {
		p.alloc.Pod, p.alloc.Since = req.Pod, a.now().Unix()
	}
	b, err := encodeAllocation(p.alloc)
	if err != nil {
		return plan{}, err
	}
	p.write(store.Put(ownerKey(req.Owner), b), store.Put(hostOwnerKey(a.host, req.Owner), []byte{}))
	if req.Reservation != "" {
		rb, _ := json.Marshal(reservation{Kind: req.Owner.Kind, Owner: owner, Addrs: p.alloc.Addrs})
		p.write(store.Put(s.resvKV.Key, rb))
	}
	return p, nil
}

// pick chooses the address for one want: the static address asked for, else
// the one the reservation remembers when it can be had, else the next free
// one in this host's ranges, claiming space when they are full. It returns
// the address key as read (absent, or an ended or own hold), which the
// commit requires unchanged.
func (a *Allocator) pick(ctx context.Context, t *poolTxn, w Want, req Request, resv reservation, p *plan) (u128, store.KV, error) {
	if w.Addr.IsValid() {
		return a.pickStatic(ctx, t, w.Addr, req, false)
	}
	if pref, ok := reservedAddr(resv, w); ok {
		got, kv, err := a.pickStatic(ctx, t, pref, req, true)
		if err == nil {
			return got, kv, nil
		}
		if !errors.Is(err, errSoftMiss) {
			return u128{}, store.KV{}, err
		}
	}
	got, kv, err := a.pickDynamic(ctx, t)
	var need errNeedSpace
	if errors.As(err, &need) {
		if err := a.planClaim(ctx, t); err != nil {
			return u128{}, store.KV{}, err
		}
		got, kv, err = a.pickDynamic(ctx, t)
		if errors.As(err, &need) {
			// The claimed hole filled up after it was read: the donor
			// allocated meanwhile, so this commit would conflict anyway.
			// Start again from fresh state.
			return u128{}, store.KV{}, fmt.Errorf("%w: claimed space in pool %s filled meanwhile", store.ErrConflict, t.name)
		}
	}
	if err != nil {
		return u128{}, store.KV{}, err
	}
	t.host.Cursor = got.addr(t.def.is4())
	return got, kv, nil
}

// commit writes p, unless it changes nothing, and returns the commit's
// revision when notes are kept (see commitNoted).
func (a *Allocator) commit(ctx context.Context, p plan) (int64, error) {
	if p.noop {
		return 0, nil
	}
	rev, err := a.commitNoted(ctx, p.conds, p.ops)
	if err != nil {
		return 0, err
	}
	a.stats.commits.Add(1)
	return rev, nil
}

// errNeedSpace says a pool has no free address in this host's ranges, so
// space must be claimed in the same transaction.
type errNeedSpace struct{ pool string }

func (e errNeedSpace) Error() string { return "need space in pool " + e.pool }

var errSoftMiss = errors.New("preferred address not available")

func reservedAddr(r reservation, w Want) (netip.Addr, bool) {
	for _, x := range r.Addrs {
		if x.Pool == w.Pool && x.Role == w.Role {
			return x.Addr, true
		}
	}
	return netip.Addr{}, false
}

func addrsOf(a Allocation) []netip.Addr {
	var out []netip.Addr
	for _, x := range a.Addrs {
		out = append(out, x.Addr)
	}
	return out
}

// pickStatic takes exactly addr. When addr lies in another host's (or
// unowned, or tombstoned) range, that one free address moves to this host in
// the same commit. An address held for a reservation is given to an owner
// that carries that reservation name, or to anyone once the hold has ended;
// to others it is in use. soft turns every refusal into errSoftMiss (for
// addresses remembered by a reservation, where the fallback is a dynamic
// address).
func (a *Allocator) pickStatic(ctx context.Context, t *poolTxn, addr netip.Addr, req Request, soft bool) (u128, store.KV, error) {
	miss := func(err error) (u128, store.KV, error) {
		if soft {
			return u128{}, store.KV{}, errSoftMiss
		}
		return u128{}, store.KV{}, err
	}
	if !t.def.Contains(addr) {
		return miss(fmt.Errorf("%w: %s is not an address pool %s hands out (outside its ranges, a gateway, or excluded)", ErrInvalid, addr, t.name))
	}
	v := toU128(addr)
	if t.taken[v] {
		return miss(fmt.Errorf("%w: %s asked twice in one request", ErrInvalid, addr))
	}
	key := addrKey(t.name, v, t.def.is4())
	kvs, err := a.st.Get(ctx, key)
	if err != nil {
		return u128{}, store.KV{}, err
	}
	kv := kvs[0]
	if kv.Exists() {
		h := parseHolder(kv.Value)
		ours := req.Reservation != "" && h.heldFor(req.Owner.Kind, req.Owner.Network, req.Reservation)
		if !ours && !h.expired(a.now()) {
			e := &InUseError{Pool: t.name, Addr: addr, Holder: h.describe(), Host: h.Host}
			if h.IsHold() {
				e.Name, e.Until = h.HoldName, h.Until
			}
			return miss(e)
		}
	}
	if inSpans(v, t.host.spans()) {
		return v, kv, nil
	}
	// The address lies outside this host's ranges: it moves to this host
	// in the same commit. The address key's condition (absent, or the
	// hold as read), added by the caller, says it is free; the range
	// keys' conditions say whose it was.
	tx := t.ringTxn(a)
	r, held, ok, err := tx.at(ctx, v)
	if err != nil {
		return u128{}, store.KV{}, err
	}
	switch {
	case held && r.host == a.host && !r.tomb:
		return u128{}, store.KV{}, fmt.Errorf("%w: pool %s: range %s is this host's but its state does not list it", store.ErrConflict, t.name, r.key)
	case held && r.host == a.host && a.broken.ignoreTombs:
	case held:
		err = tx.assign(ctx, r, span{v, v}, a.host, false)
	default:
		b, _ := tx.blockOf(v)
		err = tx.claimGap(ctx, span{v, v}, b, r, ok, a.host)
	}
	if err != nil {
		return u128{}, store.KV{}, err
	}
	return v, kv, nil
}

// pickDynamic finds the next free address in this host's ranges after its
// cursor, wrapping around: round robin. An address whose hold has ended is
// free.
func (a *Allocator) pickDynamic(ctx context.Context, t *poolTxn) (u128, store.KV, error) {
	spans := clipAll(t.host.spans(), t.segs)
	if a.broken.ignoreTombs {
		// The broken variant: this host's tombstoned ranges count as its own.
		rs, err := a.scanRanges(ctx, t.name, t.def.is4())
		if err != nil {
			return u128{}, store.KV{}, err
		}
		for _, r := range rs {
			if r.host == a.host && r.tomb {
				spans = append(spans, clip(r.span, t.segs)...)
			}
		}
		slices.SortFunc(spans, func(x, y span) int { return x.lo.cmp(y.lo) })
	}
	if len(spans) == 0 {
		return u128{}, store.KV{}, errNeedSpace{t.name}
	}
	is4 := t.def.is4()
	if h := t.host; t.useHint && h.Run > 0 && h.Next.IsValid() && h.Next.Is4() == is4 {
		v := toU128(h.Next)
		if !t.taken[v] && inSpans(v, spans) {
			t.setHint(v, h.Run-1)
			return v, store.KV{Key: addrKey(t.name, v, is4)}, nil
		}
	}
	t.host.Next, t.host.Run = netip.Addr{}, 0
	start := spans[0].lo
	if t.host.Cursor.IsValid() && t.host.Cursor.Is4() == is4 {
		start = toU128(t.host.Cursor).inc()
	}
	var order []span
	var wrapped []span
	for _, s := range spans {
		switch {
		case s.hi.cmp(start) < 0:
			wrapped = append(wrapped, s)
		case s.lo.cmp(start) >= 0:
			order = append(order, s)
		default:
			order = append(order, span{start, s.hi})
			wrapped = append(wrapped, span{s.lo, start.dec()})
		}
	}
	order = append(order, wrapped...)
	now := a.now()
	for _, s := range order {
		v, run, kv, ok, err := a.firstFree(ctx, t, s, now)
		if err != nil {
			return u128{}, store.KV{}, err
		}
		if ok {
			t.setHint(v, run)
			return v, kv, nil
		}
	}
	return u128{}, store.KV{}, errNeedSpace{t.name}
}

// setHint records that run free addresses follow v (v itself being taken now).
func (t *poolTxn) setHint(v u128, run uint64) {
	if run == 0 {
		t.host.Next, t.host.Run = netip.Addr{}, 0
		return
	}
	t.host.Next, t.host.Run = v.inc().addr(t.def.is4()), min(run, maxRun)
}

func inSpans(v u128, spans []span) bool {
	for _, s := range spans {
		if s.contains(v) {
			return true
		}
	}
	return false
}

// runLen is the number of addresses in [from, to], 0 when from > to, capped
// at maxRun.
func runLen(from, to u128) uint64 {
	if from.cmp(to) > 0 {
		return 0
	}
	n := span{from, to}.size()
	if n.hi != 0 || n.lo > maxRun {
		return maxRun
	}
	return n.lo
}

// scanPage is how many held addresses one scan reads.
const scanPage = 256

// firstFree returns the lowest address of s that is free (no key, or a hold
// that ended before now), the key as read, and how many free addresses
// follow it as far as the scan saw.
func (a *Allocator) firstFree(ctx context.Context, t *poolTxn, s span, now time.Time) (u128, uint64, store.KV, bool, error) {
	is4 := t.def.is4()
	absent := func(v u128) store.KV { return store.KV{Key: addrKey(t.name, v, is4)} }
	cur := s.lo
	for {
		kvs, err := a.st.Scan(ctx, addrKey(t.name, cur, is4), addrKey(t.name, s.hi, is4)+"\x00", scanPage)
		if err != nil {
			return u128{}, 0, store.KV{}, false, err
		}
		for _, kv := range kvs {
			k, ok := parseAddrKey(kv.Key)
			if !ok {
				continue
			}
			for cur.cmp(k) < 0 {
				if !t.taken[cur] {
					return cur, runLen(cur.inc(), k.dec()), absent(cur), true, nil
				}
				cur = cur.inc()
			}
			if cur.cmp(k) == 0 {
				if !t.taken[cur] && parseHolder(kv.Value).expired(now) {
					return cur, 0, kv, true, nil
				}
				if cur == s.hi {
					return u128{}, 0, store.KV{}, false, nil
				}
				cur = cur.inc()
			}
		}
		if len(kvs) < scanPage {
			for ; cur.cmp(s.hi) <= 0; cur = cur.inc() {
				if !t.taken[cur] {
					var run uint64
					if cur != s.hi {
						run = runLen(cur.inc(), s.hi)
					}
					return cur, run, absent(cur), true, nil
				}
				if cur == s.hi {
					break
				}
			}
			return u128{}, 0, store.KV{}, false, nil
		}
	}
}

// repairState gives t's host state its ranges when an older ringipam
// rewrote it during a rolling upgrade (dropping Ranges and Layout): they
// are read from the range keys, once; the commit writes the state back,
// conditioned on its revision. A new state starts with this layout.
func (a *Allocator) repairState(ctx context.Context, t *poolTxn) error {
	if !t.hostKV.Exists() {
		t.host.Layout = stateLayout
		return nil
	}
	if t.host.Layout == stateLayout {
		return nil
	}
	rs, err := a.scanRanges(ctx, t.name, t.def.is4())
	if err != nil {
		return err
	}
	var own []span
	for _, r := range rs {
		if r.host == a.host && !r.tomb {
			own = append(own, r.span)
		}
	}
	t.host.setSpans(own, t.def.is4())
	t.host.Layout = stateLayout
	return nil
}
