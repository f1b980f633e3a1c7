package pool

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/ringipam/ringipam/pkg/store"
)

// hostState is a host's own record in one pool.
type hostState struct {
	Cursor netip.Addr `json:"c,omitzero"` // last address handed out dynamically
	Used   uint64     `json:"u"`          // addresses this host holds in the pool
	// Next and Run: the last scan saw Run free addresses starting at Next,
	// right after Cursor. The next dynamic allocations take them without
	// scanning; a stale hint only costs one conflict and a scan.
	Next netip.Addr `json:"n,omitzero"`
	Run  uint64     `json:"r,omitempty"`
	// Seen is when this host last allocated in the pool (Unix seconds):
	// the last-seen time that reclaiming lost hosts builds on.
	Seen int64 `json:"s,omitempty"`
}

// maxRun caps the free run remembered in the host state.
const maxRun = 1 << 32

// reservation remembers a named owner's addresses.
type reservation struct {
	Owner string     `json:"o,omitempty"` // current holder, "" when released
	Addrs []Assigned `json:"a,omitempty"`
}

// poolTxn is one pool's state as read for one allocation, and its changes.
type poolTxn struct {
	name        string
	def         Def
	segs        []span
	ring        ring
	ringKV      store.KV
	ringChanged bool
	host        hostState
	hostKV      store.KV
	taken       map[u128]bool
	useHint     bool
}

// errNeedSpace says a pool has no free address in this host's ranges, so
// space must be claimed in the same transaction.
type errNeedSpace struct{ pool string }

func (e errNeedSpace) Error() string { return "need space in pool " + e.pool }

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
	var result Allocation
	var handoffs []handoff
	err = a.run(ctx, func(attempt int) error {
		var err error
		result, handoffs, err = a.allocateOnce(ctx, req, defs, attempt == 0)
		return err
	})
	if err != nil {
		return Allocation{}, err
	}
	for _, h := range handoffs {
		if err := a.returnStrays(ctx, h); err != nil {
			// The allocation stands; only ring bookkeeping is late.
			// Check reports it and the next claim in the pool retries.
			a.stats.strayErrors.Add(1)
		}
	}
	return result, nil
}

// canonicalDefs normalises req.Defs and returns them by pool name, as the
// bytes Define would record.
func canonicalDefs(req Request) (map[string][]byte, error) {
	if len(req.Defs) == 0 {
		return nil, nil
	}
	wanted := map[string]bool{}
	for _, w := range req.Wants {
		wanted[w.Pool] = true
	}
	out := map[string][]byte{}
	for _, d := range req.Defs {
		n, err := d.Normalize()
		if err != nil {
			return nil, err
		}
		if !wanted[n.Name] {
			return nil, fmt.Errorf("%w: definition of pool %s, which the request does not want", ErrInvalid, n.Name)
		}
		if out[n.Name], err = json.Marshal(n); err != nil {
			return nil, err
		}
	}
	return out, nil
}

func validateRequest(req Request) error {
	if err := req.Owner.Validate(); err != nil {
		return err
	}
	if strings.ContainsRune(req.Reservation, 0) || len(req.Reservation) > 253 {
		return fmt.Errorf("%w: reservation name %q", ErrInvalid, req.Reservation)
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

// allocateOnce reads, decides and commits once. defs are the canonical
// definitions to record or verify (see Request.Defs). useHint lets dynamic
// picks trust the host state's free-run hint (first attempt only: after a
// conflict the host's ranges are scanned).
func (a *Allocator) allocateOnce(ctx context.Context, req Request, defs map[string][]byte, useHint bool) (alloc Allocation, handoffs []handoff, err error) {
	owner := req.Owner.String()
	keys := []string{ownerKey(req.Owner)}
	if req.Reservation != "" {
		keys = append(keys, resvKey(req.Owner.Network, req.Reservation))
	}
	var pools []string
	for _, w := range req.Wants {
		if !slices.Contains(pools, w.Pool) {
			pools = append(pools, w.Pool)
			keys = append(keys, defKey(w.Pool), ringKey(w.Pool), hostKey(w.Pool, a.host))
		}
	}
	kvs, err := a.st.Get(ctx, keys...)
	if err != nil {
		return Allocation{}, nil, err
	}
	base := 1
	if req.Reservation != "" {
		base = 2
	}
	// Definitions first: even an owner that already holds everything must
	// not be served from a pool this host knows differently.
	var conds []store.Cond
	var ops []store.Op
	for i, p := range pools {
		want, ok := defs[p]
		if !ok {
			continue
		}
		kv := kvs[base+3*i]
		switch {
		case !kv.Exists():
			conds = append(conds, store.Cond{Key: kv.Key})
			ops = append(ops, store.Put(kv.Key, want))
		case string(kv.Value) != string(want):
			return Allocation{}, nil, fmt.Errorf("%w: pool %s is recorded as %s but this host was given %s", ErrDefinitionMismatch, p, kv.Value, want)
		}
	}
	ownerKV := kvs[0]
	alloc = Allocation{Owner: req.Owner, Host: a.host, Reservation: req.Reservation}
	if ownerKV.Exists() {
		if err := json.Unmarshal(ownerKV.Value, &alloc); err != nil {
			return Allocation{}, nil, fmt.Errorf("owner %s: stored allocation is corrupt: %w", owner, err)
		}
	}
	var missing []Want
	for _, w := range req.Wants {
		if held, ok := alloc.Addr(w.Pool, w.Role); ok {
			if w.Addr.IsValid() && w.Addr != held {
				return Allocation{}, nil, &ExistsError{Owner: owner, Holds: addrsOf(alloc), Asked: w.Addr}
			}
			continue
		}
		missing = append(missing, w)
	}
	if len(missing) == 0 {
		return alloc, nil, nil
	}
	if ownerKV.Exists() && alloc.Host != a.host {
		return Allocation{}, nil, fmt.Errorf("%w: %s holds %v allocated on host %s; release it there first", ErrAlreadyExists, owner, addrsOf(alloc), alloc.Host)
	}

	conds = append(conds, store.Unchanged(ownerKV))
	var resv reservation
	var resvKV store.KV
	if req.Reservation != "" {
		resvKV = kvs[1]
		if resvKV.Exists() {
			if err := json.Unmarshal(resvKV.Value, &resv); err != nil {
				return Allocation{}, nil, fmt.Errorf("reservation %s: corrupt: %w", req.Reservation, err)
			}
		}
		conds = append(conds, store.Unchanged(resvKV))
		if resv.Owner != "" && resv.Owner != owner {
			holder, err := a.st.Get(ctx, "o/"+resv.Owner)
			if err != nil {
				return Allocation{}, nil, err
			}
			if holder[0].Exists() {
				return Allocation{}, nil, &InUseError{Name: req.Reservation, Pool: req.Owner.Network, Holder: resv.Owner}
			}
			conds = append(conds, store.Cond{Key: "o/" + resv.Owner})
		}
	}

	txns := map[string]*poolTxn{}
	for i, p := range pools {
		defKV, ringKV, hostKV := kvs[base+3*i], kvs[base+3*i+1], kvs[base+3*i+2]
		var def Def
		if want, ok := defs[p]; ok && !defKV.Exists() {
			def, err = parseDef(p, want) // recorded by this very commit
		} else {
			def, err = decodeDef(p, defKV)
		}
		if err != nil {
			return Allocation{}, nil, err
		}
		t := &poolTxn{name: p, def: def, segs: segmentsOf(def), ringKV: ringKV, hostKV: hostKV, taken: map[u128]bool{}, useHint: useHint}
		var tokens []token
		if ringKV.Exists() {
			if err := json.Unmarshal(ringKV.Value, &tokens); err != nil {
				return Allocation{}, nil, fmt.Errorf("pool %s: stored ring is corrupt: %w", p, err)
			}
		}
		t.ring = ringFrom(def, tokens)
		if hostKV.Exists() {
			if err := json.Unmarshal(hostKV.Value, &t.host); err != nil {
				return Allocation{}, nil, fmt.Errorf("pool %s host %s: corrupt state: %w", p, a.host, err)
			}
		}
		for _, x := range alloc.Addrs {
			if x.Pool == p {
				t.taken[toU128(x.Addr)] = true
			}
		}
		txns[p] = t
	}

	for _, w := range missing {
		t := txns[w.Pool]
		var got u128
		var ok bool
		if w.Addr.IsValid() {
			if got, err = a.pickStatic(ctx, t, w.Addr, false); err != nil {
				return Allocation{}, nil, err
			}
			ok = true
		} else if pref, has := reservedAddr(resv, w); has {
			got, err = a.pickStatic(ctx, t, pref, true)
			if err == nil {
				ok = true
			} else if !errors.Is(err, errSoftMiss) {
				return Allocation{}, nil, err
			}
		}
		if !ok {
			got, err = a.pickDynamic(ctx, t)
			var need errNeedSpace
			if errors.As(err, &need) {
				var h *handoff
				if t.ring, h, err = a.planClaim(ctx, t.name, t.def, t.ring); err != nil {
					return Allocation{}, nil, err
				}
				t.ringChanged = true
				if h != nil {
					handoffs = append(handoffs, *h)
				}
				got, err = a.pickDynamic(ctx, t)
				if errors.As(err, &need) {
					// The claimed hole filled up after it was read: the
					// donor allocated meanwhile, so this commit would
					// conflict anyway. Start again from fresh state.
					return Allocation{}, nil, fmt.Errorf("%w: claimed space in pool %s filled meanwhile", store.ErrConflict, t.name)
				}
			}
			if err != nil {
				return Allocation{}, nil, err
			}
			t.host.Cursor = got.addr(t.def.is4())
		}
		t.taken[got] = true
		t.host.Used++
		key := addrKey(t.name, got, t.def.is4())
		conds = append(conds, store.Cond{Key: key})
		ops = append(ops, store.Put(key, holderValue(a.host, req.Owner)))
		alloc.Addrs = append(alloc.Addrs, Assigned{Pool: w.Pool, Role: w.Role, Addr: got.addr(t.def.is4())})
	}
	for _, p := range pools {
		t := txns[p]
		t.host.Seen = a.now().Unix()
		conds = append(conds, store.Unchanged(t.ringKV), store.Unchanged(t.hostKV))
		if t.ringChanged {
			b, _ := json.Marshal(t.ring.tokens)
			ops = append(ops, store.Put(ringKey(p), b))
		}
		b, _ := json.Marshal(t.host)
		ops = append(ops, store.Put(hostKey(p, a.host), b))
	}
	b, err := json.Marshal(alloc)
	if err != nil {
		return Allocation{}, nil, err
	}
	ops = append(ops, store.Put(ownerKey(req.Owner), b))
	if req.Reservation != "" {
		rb, _ := json.Marshal(reservation{Owner: owner, Addrs: alloc.Addrs})
		ops = append(ops, store.Put(resvKey(req.Owner.Network, req.Reservation), rb))
	}
	if err := a.st.Commit(ctx, conds, ops); err != nil {
		return Allocation{}, nil, err
	}
	a.stats.commits.Add(1)
	return alloc, handoffs, nil
}

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
// the same commit. soft turns every refusal into errSoftMiss (for addresses
// remembered by a reservation, where the fallback is a dynamic address).
func (a *Allocator) pickStatic(ctx context.Context, t *poolTxn, addr netip.Addr, soft bool) (u128, error) {
	miss := func(err error) (u128, error) {
		if soft {
			return u128{}, errSoftMiss
		}
		return u128{}, err
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
		return u128{}, err
	}
	if kvs[0].Exists() {
		host, holder := parseHolder(kvs[0].Value)
		return miss(&InUseError{Pool: t.name, Addr: addr, Holder: holder, Host: host})
	}
	// The address key's create-if-absent condition, added by the caller,
	// is all it takes to move one free address safely.
	if tok := t.ring.ownerOf(v); tok.Host != a.host || tok.Tomb {
		t.ring = t.ring.assign(v, v, a.host)
		t.ringChanged = true
	}
	return v, nil
}

// pickDynamic finds the next free address in this host's ranges after its
// cursor, wrapping around: round robin.
func (a *Allocator) pickDynamic(ctx context.Context, t *poolTxn) (u128, error) {
	spans := t.ring.ownedBy(a.host, t.segs)
	if len(spans) == 0 {
		return u128{}, errNeedSpace{t.name}
	}
	if h := t.host; t.useHint && h.Run > 0 && h.Next.IsValid() && h.Next.Is4() == t.def.is4() {
		v := toU128(h.Next)
		if !t.taken[v] && inSpans(v, spans) {
			t.setHint(v, h.Run-1)
			return v, nil
		}
	}
	t.host.Next, t.host.Run = netip.Addr{}, 0
	start := spans[0].lo
	if t.host.Cursor.IsValid() && t.host.Cursor.Is4() == t.def.is4() {
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
	for _, s := range order {
		v, run, ok, err := a.firstFree(ctx, t, s)
		if err != nil {
			return u128{}, err
		}
		if ok {
			t.setHint(v, run)
			return v, nil
		}
	}
	return u128{}, errNeedSpace{t.name}
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

// firstFree returns the lowest address of s that is not held, and how many
// free addresses follow it as far as the scan saw.
func (a *Allocator) firstFree(ctx context.Context, t *poolTxn, s span) (u128, uint64, bool, error) {
	is4 := t.def.is4()
	cur := s.lo
	for {
		kvs, err := a.st.Scan(ctx, addrKey(t.name, cur, is4), addrKey(t.name, s.hi, is4)+"\x00", scanPage)
		if err != nil {
			return u128{}, 0, false, err
		}
		for _, kv := range kvs {
			k, ok := parseAddrKey(kv.Key)
			if !ok {
				continue
			}
			for cur.cmp(k) < 0 {
				if !t.taken[cur] {
					return cur, runLen(cur.inc(), k.dec()), true, nil
				}
				cur = cur.inc()
			}
			if cur.cmp(k) == 0 {
				if cur == s.hi {
					return u128{}, 0, false, nil
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
					return cur, run, true, nil
				}
				if cur == s.hi {
					break
				}
			}
			return u128{}, 0, false, nil
		}
	}
}
