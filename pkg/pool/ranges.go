package pool

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"maps"
	"math/rand/v2"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/ringipam/ringipam/pkg/store"
)

// The ring of layout 4: one key per range, g/<pool>/<hex last address>,
// whose value (rangeRec) names the range's first address, its host and
// whether it is tombstoned. Unowned space has no key: it is the gaps
// between range keys. A range key is named by the range's LAST address so
// that every lookup the protocols need is a forward Scan with limit 1:
// the first key at or after rangeKey(v) is the range holding v when its
// start is at most v, and otherwise the first range after v (its
// successor), v being unowned. Ranges never overlap; a range key's
// extent only changes by a write of that very key (a split keeps the key
// of the range's upper part and creates keys for the parts below it;
// ranges are never merged), which is what the claim's conditions below
// build on.
//
// A host's own live ranges are listed in its host state as well
// (hostState.Ranges), written in the same commit as the range keys: every
// commit that changes which addresses a host owns rewrites that host's
// state under a revision condition, so an allocation conditioned on its
// host state (as every allocation is) never hands out an address outside
// what its host owns, and reads no range key at all.

// rangeRec is the value of a range key.
type rangeRec struct {
	Start netip.Addr `json:"s"`
	Host  string     `json:"h"`
	Tomb  bool       `json:"t,omitempty"`
}

// rangeKV is one range key decoded (or about to be written).
type rangeKV struct {
	key string
	span
	host string
	tomb bool
}

func (r rangeKV) encode(is4 bool) []byte {
	b, _ := json.Marshal(rangeRec{Start: r.lo.addr(is4), Host: r.host, Tomb: r.tomb})
	return b
}

// rangePrefix is the prefix of pool's range keys.
func rangePrefix(pool string) string { return prefixRing + pool + "/" }

// rangeKey is the key of pool's range whose last address is last.
func rangeKey(pool string, last u128, is4 bool) string { return rangePrefix(pool) + hexOf(last, is4) }

// oldRingKey is layout 3's one key of the whole ring. A migrated pool (and
// every pool recorded by this layout) keeps there movedMarker, a value
// that layout-3 code cannot decode as a ring: an agent of that layout that
// is still running (it read the layout version once, when it started)
// fails every allocation in the pool, with an error that names the cause
// ("stored ring is corrupt: ParseAddr(\"... upgrade ringipam\")"),
// instead of writing a ring of its own.
func oldRingKey(pool string) string { return prefixRing + pool }

func movedMarker(pool string) []byte {
	b, _ := json.Marshal([]map[string]string{{"s": "store layout 4: pool " + pool + "'s ring moved to one key per range: upgrade ringipam"}})
	return b
}

// decodeRangeKV decodes a range key of pool as read.
func decodeRangeKV(kv store.KV, is4 bool) (rangeKV, error) {
	last, ok := parseAddrKey(kv.Key)
	if !ok || last.addr(is4).Is4() != is4 {
		return rangeKV{}, fmt.Errorf("%s: not a range key", kv.Key)
	}
	var rec rangeRec
	if err := json.Unmarshal(kv.Value, &rec); err != nil {
		return rangeKV{}, fmt.Errorf("%s: corrupt range: %w", kv.Key, err)
	}
	if !rec.Start.IsValid() || rec.Start.Is4() != is4 || toU128(rec.Start).cmp(last) > 0 {
		return rangeKV{}, fmt.Errorf("%s: range start %s is not an address up to its last", kv.Key, rec.Start)
	}
	return rangeKV{key: kv.Key, span: span{toU128(rec.Start), last}, host: rec.Host, tomb: rec.Tomb}, nil
}

// scanRanges reads every range key of pool, in address order.
func (a *Allocator) scanRanges(ctx context.Context, pool string, is4 bool) ([]rangeKV, error) {
	kvs, err := a.st.Scan(ctx, rangePrefix(pool), store.PrefixEnd(rangePrefix(pool)), 0)
	if err != nil {
		return nil, err
	}
	out := make([]rangeKV, 0, len(kvs))
	for _, kv := range kvs {
		r, err := decodeRangeKV(kv, is4)
		if err != nil {
			return nil, fmt.Errorf("pool %s: %w", pool, err)
		}
		out = append(out, r)
	}
	return out, nil
}

// ringOfRanges builds the whole ring (gaps as unowned tokens) from pool's
// range keys in address order; an overlap or a range outside the pool is
// an error.
func ringOfRanges(d Def, rs []rangeKV) (ring, error) {
	r := newRing(d)
	var tokens []token
	next := r.space.lo
	open := true // next is a valid address (false past the top of the space)
	for i, x := range rs {
		if !r.space.contains(x.lo) || !r.space.contains(x.hi) {
			return ring{}, fmt.Errorf("range %s-%s is outside the pool", x.lo.addr(r.is4), x.hi.addr(r.is4))
		}
		if i > 0 && (!open || x.lo.cmp(next) < 0) {
			return ring{}, fmt.Errorf("ranges %s-%s and %s-%s overlap", rs[i-1].lo.addr(r.is4), rs[i-1].hi.addr(r.is4), x.lo.addr(r.is4), x.hi.addr(r.is4))
		}
		if x.lo.cmp(next) > 0 {
			tokens = append(tokens, token{Start: next.addr(r.is4)})
		}
		tokens = append(tokens, token{Start: x.lo.addr(r.is4), Host: x.host, Tomb: x.tomb})
		open = x.hi.cmp(r.space.hi) < 0
		if open {
			next = x.hi.inc()
		}
	}
	if len(rs) > 0 && open {
		tokens = append(tokens, token{Start: next.addr(r.is4)})
	}
	if len(tokens) > 0 {
		r.tokens = merge(tokens)
	}
	return r, nil
}

// readRing reads pool's definition and its whole ring (every range key),
// then the extra keys (at a later revision than the ranges: callers
// condition on what they use). kvs[0] is the definition as read, kvs[1:]
// the extra keys.
func (a *Allocator) readRing(ctx context.Context, pool string, extra ...string) (Def, ring, []store.KV, error) {
	kvs, err := a.st.Get(ctx, append([]string{defKey(pool)}, extra...)...)
	if err != nil {
		return Def{}, ring{}, nil, err
	}
	def, err := decodeDef(pool, kvs[0])
	if err != nil {
		return Def{}, ring{}, nil, err
	}
	rs, err := a.scanRanges(ctx, pool, def.is4())
	if err != nil {
		return Def{}, ring{}, nil, err
	}
	r, err := ringOfRanges(def, rs)
	if err != nil {
		return Def{}, ring{}, nil, fmt.Errorf("pool %s: %w", pool, err)
	}
	return def, r, kvs, nil
}

// ownRange is one of a host's live ranges as its host state lists it.
type ownRange struct {
	Start netip.Addr `json:"s"`
	End   netip.Addr `json:"e"`
}

// spans returns the host's ranges in address order.
func (h hostState) spans() []span {
	out := make([]span, 0, len(h.Ranges))
	for _, r := range h.Ranges {
		out = append(out, span{toU128(r.Start), toU128(r.End)})
	}
	return out
}

func (h *hostState) setSpans(ss []span, is4 bool) {
	slices.SortFunc(ss, func(x, y span) int { return x.lo.cmp(y.lo) })
	h.Ranges = h.Ranges[:0:0]
	for _, s := range ss {
		h.Ranges = append(h.Ranges, ownRange{Start: s.lo.addr(is4), End: s.hi.addr(is4)})
	}
}

// addSpan lists s among the host's ranges.
func (h *hostState) addSpan(s span, is4 bool) { h.setSpans(append(h.spans(), s), is4) }

// removeSpan takes s out of the host's ranges (splitting the one that
// holds it).
func (h *hostState) removeSpan(s span, is4 bool) {
	var out []span
	for _, r := range h.spans() {
		if r.hi.cmp(s.lo) < 0 || r.lo.cmp(s.hi) > 0 {
			out = append(out, r)
			continue
		}
		if r.lo.cmp(s.lo) < 0 {
			out = append(out, span{r.lo, s.lo.dec()})
		}
		if s.hi.cmp(r.hi) < 0 {
			out = append(out, span{s.hi.inc(), r.hi})
		}
	}
	h.setSpans(out, is4)
}

// stateLayout marks a host state written by this layout (hostState.Layout):
// a state without it was rewritten by an older ringipam during a rolling
// upgrade, which dropped its Ranges, and is repaired from the range keys.
const stateLayout = 4

// ringTxn gathers one commit's changes to a pool's range keys and to the
// host states they imply, with the conditions that make them safe.
type ringTxn struct {
	a     *Allocator
	pool  string
	is4   bool
	space span
	block uint64
	read  map[string]store.KV // range keys as read
	// conds: revisions of range keys relied on, absent ranges.
	conds  []store.Cond
	relied map[string]bool
	edits  map[string]rangeKV // range keys this commit writes
	order  []string
	hosts  map[string]*hostEdit
	hostOr []string
}

// hostEdit is one host's state as read, and changed, by a ringTxn.
type hostEdit struct {
	kv    store.KV
	st    *hostState
	own   bool // the caller conditions on and writes it (an allocation's own state)
	donor bool // its condition is one of a donation's guards (faults.noRangeCond)
	dirty bool
}

func (a *Allocator) newRingTxn(pool string, def Def) *ringTxn {
	segs := segmentsOf(def)
	return &ringTxn{a: a, pool: pool, is4: def.is4(), space: span{segs[0].lo, segs[len(segs)-1].hi}, block: blockSize(def),
		read: map[string]store.KV{}, relied: map[string]bool{}, edits: map[string]rangeKV{}, hosts: map[string]*hostEdit{}}
}

// maxBlock is the most addresses a claim of unowned space takes.
const maxBlock = 64

// blockSize is how many addresses the aligned blocks of pool d's claims
// of unowned space hold: the smallest power of two that covers the pool's
// space, at most maxBlock (so a small pool is claimed whole, as before
// layout 4). It depends on the definition alone, which never changes.
func blockSize(d Def) uint64 {
	segs := segmentsOf(d)
	n := span{segs[0].lo, segs[len(segs)-1].hi}.size()
	b := uint64(1)
	for b < maxBlock && (n.hi != 0 || b < n.lo) {
		b <<= 1
	}
	return b
}

// blockOf is the aligned block of tx's pool holding v, clipped to the space.
func (tx *ringTxn) blockOf(v u128) (block, clipped span) {
	lo := u128{hi: v.hi, lo: v.lo &^ (tx.block - 1)}
	block = span{lo, lo.add(u128{lo: tx.block - 1})}
	return block, span{maxU(block.lo, tx.space.lo), minU(block.hi, tx.space.hi)}
}

// own seeds tx with the caller's own host state (an allocation's).
func (tx *ringTxn) own(host string, kv store.KV, st *hostState) {
	tx.hosts[host] = &hostEdit{kv: kv, st: st, own: true}
}

// seed gives tx a host state the caller read (a donor's).
func (tx *ringTxn) seed(host string, kv store.KV, st hostState, donor bool) {
	if _, ok := tx.hosts[host]; !ok {
		tx.hosts[host] = &hostEdit{kv: kv, st: &st, donor: donor}
		tx.hostOr = append(tx.hostOr, host)
	}
}

// state returns host's state as tx changes it, reading it first. A host
// without a state gets one only when create (it receives space);
// otherwise nil (its ranges are being tombstoned: they keep its name).
func (tx *ringTxn) state(ctx context.Context, host string, create bool) (*hostEdit, error) {
	if he, ok := tx.hosts[host]; ok {
		if he.st == nil && create {
			he.st = &hostState{Layout: stateLayout}
		}
		if he.st == nil {
			return nil, nil
		}
		return he, nil
	}
	kvs, err := tx.a.st.Get(ctx, hostKey(tx.pool, host))
	if err != nil {
		return nil, err
	}
	he := &hostEdit{kv: kvs[0]}
	if kvs[0].Exists() {
		he.st = &hostState{}
		if err := decodeHostState(kvs[0].Value, he.st); err != nil {
			return nil, fmt.Errorf("pool %s host %s: corrupt state: %w", tx.pool, host, err)
		}
	} else if create {
		he.st = &hostState{Layout: stateLayout}
	}
	tx.hosts[host] = he
	tx.hostOr = append(tx.hostOr, host)
	if he.st == nil {
		return nil, nil
	}
	return he, nil
}

// next returns the first range whose last address is at least v, as tx
// sees it (its own edits over the store's keys); ok is false when there
// is none.
func (tx *ringTxn) next(ctx context.Context, v u128) (rangeKV, bool, error) {
	kvs, err := tx.a.st.Scan(ctx, rangeKey(tx.pool, v, tx.is4), store.PrefixEnd(rangePrefix(tx.pool)), 1)
	if err != nil {
		return rangeKV{}, false, err
	}
	var best rangeKV
	found := false
	if len(kvs) == 1 {
		r, err := decodeRangeKV(kvs[0], tx.is4)
		if err != nil {
			return rangeKV{}, false, fmt.Errorf("pool %s: %w", tx.pool, err)
		}
		if was, ok := tx.read[r.key]; ok && was.Revision != kvs[0].Revision {
			return rangeKV{}, false, fmt.Errorf("%w: range %s changed while it was read", store.ErrConflict, r.key)
		}
		tx.read[r.key] = kvs[0]
		if e, ok := tx.edits[r.key]; ok {
			r = e
		}
		best, found = r, true
	}
	for _, e := range tx.edits {
		if e.hi.cmp(v) >= 0 && (!found || e.hi.cmp(best.hi) < 0) {
			best, found = e, true
		}
	}
	return best, found, nil
}

// at returns the range holding v (held true), else v's successor, if any
// (ok): v is then unowned.
func (tx *ringTxn) at(ctx context.Context, v u128) (r rangeKV, held, ok bool, err error) {
	r, ok, err = tx.next(ctx, v)
	return r, ok && r.lo.cmp(v) <= 0, ok, err
}

// rely makes the commit require the range key as read.
func (tx *ringTxn) rely(key string) {
	if kv, ok := tx.read[key]; ok && !tx.relied[key] {
		tx.relied[key] = true
		tx.conds = append(tx.conds, store.Unchanged(kv))
	}
}

func (tx *ringTxn) put(r rangeKV) {
	if _, ok := tx.edits[r.key]; !ok {
		tx.order = append(tx.order, r.key)
	}
	tx.edits[r.key] = r
}

// assign gives s, which lies inside the range r (as tx sees it), to host
// to (tombstoned when tomb): r is split, its key keeping the upper part;
// r's host's state (when r is live) loses s and to's (when live) gains
// it.
func (tx *ringTxn) assign(ctx context.Context, r rangeKV, s span, to string, tomb bool) error {
	tx.rely(r.key)
	if s.lo.cmp(r.lo) > 0 {
		lo := s.lo.dec()
		tx.put(rangeKV{key: rangeKey(tx.pool, lo, tx.is4), span: span{r.lo, lo}, host: r.host, tomb: r.tomb})
	}
	if s.hi.cmp(r.hi) < 0 {
		tx.put(rangeKV{key: r.key, span: span{s.hi.inc(), r.hi}, host: r.host, tomb: r.tomb})
	}
	tx.put(rangeKV{key: rangeKey(tx.pool, s.hi, tx.is4), span: s, host: to, tomb: tomb})
	if r.host != "" && !r.tomb {
		he, err := tx.state(ctx, r.host, false)
		if err != nil {
			return err
		}
		if he != nil {
			he.st.removeSpan(s, tx.is4)
			he.dirty = true
		}
	}
	if to != "" && !tomb {
		he, err := tx.state(ctx, to, true)
		if err != nil {
			return err
		}
		he.st.addSpan(s, tx.is4)
		he.dirty = true
	}
	return nil
}

// claimGap gives c, unowned space inside the aligned block b, to host to.
// succ (when hasSucc) is the first range after c as read. The commit
// requires that no range key ends in [c.lo, e], where e is the end of b,
// or the address before succ's end when succ ends inside b, and that succ
// is unchanged. That is enough for c to be unowned at commit time:
//
// A range K overlapping c at commit time ends at or after c.lo. If it
// ends by e, the range condition fails the commit. If it is succ, it is
// unchanged and starts after c. If it ends after succ (succ ending inside
// b), it starts after succ, so after c (ranges never overlap). What is
// left is a K that ends after b and starts at or below c's end: it
// straddles b's upper boundary. No range key straddled it with its end at
// or after c.lo when c was read but succ (which does not reach c), so K
// was made after the read, and keys are only made by (1) a claim of
// unowned space, which stays inside one aligned block (as c does) and so
// straddles no block boundary; (2) a static move of one address out of
// unowned space: one address straddles nothing; (3) splitting a range,
// whose parts lie inside it: the first straddling key made after the read
// came from a range that straddled before it, which is succ (rewritten, so
// the commit fails) or one made after the read (not the first). Ranges are
// never merged or extended. So blocks claimed by different hosts never
// conflict, and what they condition on (succ) seldom changes.
func (tx *ringTxn) claimGap(ctx context.Context, c, b span, succ rangeKV, hasSucc bool, to string) error {
	e := b.hi
	if hasSucc && succ.hi.cmp(b.hi) <= 0 {
		e = succ.hi.dec()
	}
	tx.conds = append(tx.conds, store.AbsentRange(rangeKey(tx.pool, c.lo, tx.is4), rangeKey(tx.pool, e, tx.is4)+"\x00"))
	if hasSucc {
		tx.rely(succ.key)
	}
	tx.put(rangeKV{key: rangeKey(tx.pool, c.hi, tx.is4), span: c, host: to})
	he, err := tx.state(ctx, to, true)
	if err != nil {
		return err
	}
	he.st.addSpan(c, tx.is4)
	he.dirty = true
	return nil
}

// wasTomb reports whether the range key kv, as read, was tombstoned.
func wasTomb(kv store.KV, is4 bool) bool {
	r, err := decodeRangeKV(kv, is4)
	return err == nil && r.tomb
}

// empty reports whether tx changes nothing.
func (tx *ringTxn) empty() bool { return tx == nil || len(tx.order) == 0 && len(tx.conds) == 0 }

// finish returns tx's conditions and writes: every range key it writes
// (a new one required absent), the conditions it relied on, and every
// changed host state other than the caller's own, conditioned on its
// revision as read.
func (tx *ringTxn) finish() ([]store.Cond, []store.Op) {
	if tx == nil {
		return nil, nil
	}
	var conds []store.Cond
	var ops []store.Op
	noRing := tx.a.broken.noRingCond
	for _, k := range tx.order {
		e := tx.edits[k]
		ops = append(ops, store.Put(k, e.encode(tx.is4)))
		// The tombstone index (freeindex.go) follows the range key in
		// the same commit: an entry while it is tombstoned.
		if e.tomb {
			ops = append(ops, store.Put(tombKeyOf(k), []byte{}))
		} else if was, ok := tx.read[k]; ok && wasTomb(was, tx.is4) {
			ops = append(ops, store.Delete(tombKeyOf(k)))
		}
		if _, ok := tx.read[k]; !ok && !noRing {
			conds = append(conds, store.Cond{Key: k})
		} else if ok && !noRing {
			tx.rely(k)
		}
	}
	if !noRing {
		conds = append(conds, tx.conds...)
	} else {
		for _, c := range tx.conds {
			if strings.HasPrefix(c.Key, prefixAddr) { // the donor's guard stays
				conds = append(conds, c)
			}
		}
	}
	for _, h := range tx.hostOr {
		he := tx.hosts[h]
		if he.own || !he.dirty || he.st == nil {
			continue
		}
		if !(he.donor && tx.a.broken.noRangeCond) {
			conds = append(conds, store.Unchanged(he.kv))
		}
		ops = append(ops, putHostState(tx.pool, h, he.st)...)
	}
	return conds, ops
}

// blockAddr returns the i-th pseudo-random address of the dynamic
// segments segs that host tries for pool's claims (each address about
// equally likely). The sequence is a hash of (host, pool, i): hosts that
// start together try different blocks, as with Calico's random block
// search, and a host's choices are reproducible.
func blockAddr(segs []span, host, pool string, i int) u128 {
	h := fnv.New128a()
	h.Write([]byte(host + "\x00" + pool + "\x00" + strconv.Itoa(i)))
	sum := h.Sum(nil)
	rnd := rand.New(rand.NewPCG(binary.BigEndian.Uint64(sum[:8]), binary.BigEndian.Uint64(sum[8:])))
	var total float64
	for _, s := range segs {
		total += sizeFloat(s)
	}
	x := rnd.Float64() * total
	for _, s := range segs {
		f := sizeFloat(s)
		if x < f || s == segs[len(segs)-1] {
			n := s.size()
			var off u128
			switch {
			case n.hi == 0 && n.lo == 0: // the whole IPv6 space
				off = u128{hi: rnd.Uint64(), lo: rnd.Uint64()}
			case n.hi == 0:
				off = u128{lo: rnd.Uint64N(n.lo)}
			default:
				off = u128{hi: rnd.Uint64N(n.hi), lo: rnd.Uint64()}
			}
			return s.lo.add(off)
		}
		x -= f
	}
	return segs[0].lo
}

func sizeFloat(s span) float64 {
	n := s.size()
	return float64(n.hi)*18446744073709551616.0 + float64(n.lo)
}

// overlay returns rs (range keys in address order, as scanned) as tx
// sees them: its edits replace or join them.
func (tx *ringTxn) overlay(rs []rangeKV) []rangeKV {
	if len(tx.edits) == 0 {
		return rs
	}
	seen := map[string]bool{}
	out := make([]rangeKV, 0, len(rs)+len(tx.edits))
	for _, r := range rs {
		if e, ok := tx.edits[r.key]; ok {
			r = e
		}
		seen[r.key] = true
		out = append(out, r)
	}
	for k, e := range tx.edits {
		if !seen[k] {
			out = append(out, e)
		}
	}
	slices.SortFunc(out, func(x, y rangeKV) int { return x.hi.cmp(y.hi) })
	return out
}

// poolRing reads pool's whole ring from its range keys, for the readers
// that show or check it (never an allocation).
func (a *Allocator) poolRing(ctx context.Context, pool string, def Def) (ring, error) {
	rs, err := a.scanRanges(ctx, pool, def.is4())
	if err != nil {
		return ring{}, err
	}
	r, err := ringOfRanges(def, rs)
	if err != nil {
		return ring{}, fmt.Errorf("pool %s: %w", pool, err)
	}
	return r, nil
}

// stateRangeFaults compares the hosts' states of pool (as scanned, h/
// keys) with its range keys: each live host's state lists exactly its
// live ranges. It returns one sentence per disagreement.
func (a *Allocator) stateRangeFaults(ctx context.Context, pool string, def Def, hostKVs []store.KV) ([]string, error) {
	rs, err := a.scanRanges(ctx, pool, def.is4())
	if err != nil {
		return nil, err
	}
	keys := map[string][]span{}
	for _, r := range rs {
		if !r.tomb {
			keys[r.host] = append(keys[r.host], r.span)
		}
	}
	var bad []string
	seen := map[string]bool{}
	for _, kv := range hostKVs {
		host := strings.TrimPrefix(kv.Key, hostPrefix(pool))
		var hs hostState
		if decodeHostState(kv.Value, &hs) != nil {
			continue // reported as corrupt elsewhere
		}
		seen[host] = true
		if hs.Layout != stateLayout {
			continue // an older ringipam's write: repaired on the host's next allocation
		}
		if got := hs.spans(); !slices.Equal(got, keys[host]) {
			bad = append(bad, fmt.Sprintf("host %s's state lists %s but its range keys are %s", host, spansString(got, def.is4()), spansString(keys[host], def.is4())))
		}
	}
	for _, host := range slices.Sorted(maps.Keys(keys)) {
		if !seen[host] && host != "" {
			bad = append(bad, fmt.Sprintf("host %s owns live ranges %s but has no state in the pool", host, spansString(keys[host], def.is4())))
		}
	}
	return bad, nil
}

func spansString(ss []span, is4 bool) string {
	var parts []string
	for _, s := range ss {
		parts = append(parts, s.lo.addr(is4).String()+"-"+s.hi.addr(is4).String())
	}
	return "[" + strings.Join(parts, " ") + "]"
}
