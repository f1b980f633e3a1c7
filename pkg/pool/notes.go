package pool

import (
	"bytes"
	"context"
	"errors"
	"hash/crc32"
	"slices"
	"strconv"

	"github.com/ringipam/ringipam/pkg/store"
)

// Notes: an allocation on etcd reads the pool's definition and this
// host's state (its ranges among it), then commits; two round trips. This
// host wrote its state itself last time, and the definition never changes
// once recorded, so a note of what the last allocation or release here
// wrote lets the next allocation plan without reading and commit in one
// round trip, conditioned on the noted keys being still at the noted
// revisions (store.Speculator). When they are not, the same round trip
// answers the store's state and the allocation goes on as if it had read
// it: two round trips, as without notes.
//
// A revision names a value only within the history it was read from;
// this host's own state, small, is also compared by value, and that
// anchors the rest: it holds the bytes this host wrote at the noted
// revision, which no other noted revision exceeds (anchored). A store
// that holds those bytes at that revision has the noted history up to
// there: one restored from an older backup holds this host's older state
// (or the same write, and all before it), one written afresh holds other
// bytes or another revision, short of another write of the very same
// bytes (the last-seen second included) at the very same revision. So
// keys at their noted revisions hold their noted values.
//
// Since layout 4 no ring key is read or noted: the host's ranges travel
// in its state (ranges.go), so nothing the size of the ring travels with
// an allocation, noted or not.

// NoteKeeper keeps one note per name for this host's processes (ipam-ring:
// a file beside the pool's host lock). The allocator reads and writes a
// pool's note only while it holds that pool's locks. A note is a belief,
// never trusted: a lost, stale, torn or foreign note costs one round trip,
// never a wrong allocation.
type NoteKeeper interface {
	// ReadNote returns the note called name, or nil.
	ReadNote(name string) []byte
	// WriteNote replaces the note called name; a failure only loses it.
	WriteNote(name string, note []byte)
}

// WithNotes makes allocations on a store.Speculator (etcd) plan on k's
// notes of their pools and commit in one round trip when the notes hold.
func WithNotes(k NoteKeeper) Option { return func(a *Allocator) { a.notes = k } }

// poolNote is what this host last knew of one pool: its definition and
// this host's state, each with the revision it had in the store (0:
// absent).
type poolNote struct {
	def, host store.KV
}

func (a *Allocator) noteName(pool string) string { return pool + "@" + a.host }

func (a *Allocator) newNote(pool string) poolNote {
	return poolNote{def: store.KV{Key: defKey(pool)}, host: store.KV{Key: hostKey(pool, a.host)}}
}

// noteMagic starts every note: the format's name and version (1 was
// values without revisions, 2 also noted the ring of layout 3; such a
// note does not decode, which costs one round trip).
const noteMagic = "ringipam pool note 3\n"

// encode writes the two keys, each
// as a line "<revision> <length>" (or "-" when absent) followed by its
// value's bytes and a newline, and "end" with the CRC-32C of all before
// it last: a note cut short anywhere, or mixed with its predecessor by a
// crash while it was written over it, does not decode. (Beliefs checked
// by value, as they were before revisions, would catch a mixed value;
// revisions do not, so the note checks itself.)
func (n poolNote) encode() []byte {
	b := []byte(noteMagic)
	for _, kv := range []store.KV{n.def, n.host} {
		if !kv.Exists() {
			b = append(b, "-\n"...)
			continue
		}
		b = strconv.AppendInt(b, kv.Revision, 10)
		b = append(b, ' ')
		b = strconv.AppendInt(b, int64(len(kv.Value)), 10)
		b = append(b, '\n')
		b = append(b, kv.Value...)
		b = append(b, '\n')
	}
	b = append(b, "end "...)
	b = strconv.AppendUint(b, uint64(crc32.Checksum(b, castagnoli)), 16)
	return append(b, '\n')
}

var errBadNote = errors.New("not a pool note")

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// decodeNote reads what encode wrote into n, whose keys are set.
func decodeNote(b []byte, n *poolNote) error {
	rest, ok := bytes.CutPrefix(b, []byte(noteMagic))
	if !ok {
		return errBadNote
	}
	at := bytes.LastIndex(b, []byte("end "))
	if at < 0 || !bytes.HasSuffix(b, []byte{'\n'}) {
		return errBadNote
	}
	sum, err := strconv.ParseUint(string(b[at+len("end "):len(b)-1]), 16, 32)
	if err != nil || uint32(sum) != crc32.Checksum(b[:at+len("end ")], castagnoli) {
		return errBadNote
	}
	for _, kv := range []*store.KV{&n.def, &n.host} {
		line, after, ok := bytes.Cut(rest, []byte{'\n'})
		if !ok {
			return errBadNote
		}
		if string(line) == "-" {
			kv.Value, kv.Revision, rest = nil, 0, after
			continue
		}
		revText, sizeText, ok := bytes.Cut(line, []byte{' '})
		if !ok {
			return errBadNote
		}
		rev, err := strconv.ParseInt(string(revText), 10, 64)
		if err != nil || rev <= 0 {
			return errBadNote
		}
		size, err := strconv.Atoi(string(sizeText))
		if err != nil || size < 0 || size >= len(after) || after[size] != '\n' {
			return errBadNote
		}
		kv.Value, kv.Revision, rest = bytes.Clone(after[:size]), rev, after[size+1:]
	}
	if len(rest) != len(b)-at {
		return errBadNote
	}
	return nil
}

// readNote returns this host's note of pool, if there is a usable one:
// the definition and this host's state present (the state anchors the
// revisions, see above).
func (a *Allocator) readNote(pool string) (poolNote, bool) {
	n := a.newNote(pool)
	if a.notes == nil {
		return n, false
	}
	b := a.notes.ReadNote(a.noteName(pool))
	if b == nil || decodeNote(b, &n) != nil || !n.anchored() {
		return n, false
	}
	return n, true
}

// anchored reports whether n can be believed: the definition and this
// host's state present, and no revision noted later than the state's.
func (n poolNote) anchored() bool {
	return n.def.Exists() && n.host.Exists() && n.def.Revision <= n.host.Revision
}

// apply updates n by what ops, committed at revision rev, wrote.
func (n *poolNote) apply(ops []store.Op, rev int64) {
	for _, o := range ops {
		for _, kv := range []*store.KV{&n.def, &n.host} {
			switch {
			case o.Key != kv.Key:
			case o.Delete:
				kv.Value, kv.Revision = nil, 0
			default:
				kv.Value, kv.Revision = o.Value, rev
			}
		}
	}
}

// speculating reports whether allocations may commit on notes.
func (a *Allocator) speculating() (store.Speculator, bool) {
	if a.notes == nil {
		return nil, false
	}
	sp, ok := a.st.(store.Speculator)
	return sp, ok
}

// commitNoted commits conds and ops and returns the commit's revision,
// which notes record: through the store.Speculator when this allocator
// keeps notes (one round trip, as Commit), else 0.
func (a *Allocator) commitNoted(ctx context.Context, conds []store.Cond, ops []store.Op) (int64, error) {
	sp, ok := a.speculating()
	if !ok {
		return 0, a.st.Commit(ctx, conds, ops)
	}
	rev, _, err := sp.CommitOrGet(ctx, conds, nil, ops, nil)
	return rev, err
}

// noteAllocation records, for each pool of s, what the plan p, committed
// at revision rev, left in the store. A commit whose revision is unknown
// (0) leaves the notes as they were: stale, which costs a round trip.
func (a *Allocator) noteAllocation(s *snapshot, p plan, rev int64) {
	if _, ok := a.speculating(); !ok || rev <= 0 && len(p.ops) > 0 {
		return
	}
	for _, t := range s.pools {
		n := poolNote{def: t.defKV, host: t.hostKV}
		n.apply(p.ops, rev)
		if n.anchored() {
			a.notes.WriteNote(a.noteName(t.name), n.encode())
		}
	}
}

// noteRelease updates this host's notes of pools by a release's ops,
// committed at revision rev (a pool without a note keeps none: the
// release did not read its definition and ring).
func (a *Allocator) noteRelease(pools []string, ops []store.Op, rev int64) {
	if _, ok := a.speculating(); !ok || rev <= 0 {
		return
	}
	for _, pool := range pools {
		if n, ok := a.readNote(pool); ok {
			n.apply(ops, rev)
			a.notes.WriteNote(a.noteName(pool), n.encode())
		}
	}
}

// speculate tries an allocation in one round trip, planned on this host's
// notes of the wanted pools with the owner (and its reservation) believed
// absent, conditioned on the noted revisions and on this host's noted
// states by value. done says it committed p, at revision rev, and s is
// the state p was planned on (noteAllocation's). Otherwise s, unless nil,
// is the state the store answered when the notes no longer held, decoded
// as a read would be: the caller plans on it instead of reading. A nil s
// means nothing was tried, or what was answered is stale (the store was
// just migrated).
func (a *Allocator) speculate(ctx context.Context, req Request, defs map[string]Def) (p plan, s *snapshot, rev int64, done bool, err error) {
	sp, ok := a.speculating()
	if !ok {
		return plan{}, nil, 0, false, nil
	}
	ks, pools := a.readKeys(req)
	kvs := make([]store.KV, len(ks.keys))
	for i, k := range ks.keys {
		kvs[i].Key = k
	}
	same := []store.KV{{Key: layoutKey, Value: []byte(layoutVersion)}}
	var conds []store.Cond
	for _, pool := range pools {
		n, ok := a.readNote(pool)
		if !ok {
			return plan{}, nil, 0, false, nil
		}
		for _, kv := range []store.KV{n.def, n.host} {
			kvs[ks.at[kv.Key]] = kv
		}
		// The definition is not a condition of the plan (it never
		// changes once recorded); the note's must be the store's. The
		// host state is, by revision; its value anchors the revisions.
		conds = append(conds, store.Unchanged(n.def), store.Unchanged(n.host))
		same = append(same, n.host)
	}
	// A note that does not decode or plan is only a wrong belief: the
	// ordinary path reads and decides, and reports what is really wrong.
	if s, err = a.decodeSnapshot(ctx, req, defs, ks, pools, kvs); err != nil || len(s.newDefs) > 0 {
		return plan{}, nil, 0, false, nil
	}
	if p, err = a.plan(ctx, s, req, true); err != nil || p.noop {
		return plan{}, nil, 0, false, nil
	}
	for _, c := range p.conds {
		if !slices.Contains(conds, c) {
			conds = append(conds, c)
		}
	}
	read := ks.keys
	if !a.layoutOK.Load() {
		read = append(read[:len(read):len(read)], layoutKey)
	}
	rev, answered, err := sp.CommitOrGet(ctx, conds, same, p.ops, read)
	switch {
	case err == nil:
		a.stats.commits.Add(1)
		a.stats.onNotes.Add(1)
		return p, s, rev, true, nil
	case errors.Is(err, store.ErrTooLarge):
		return plan{}, nil, 0, false, nil // the ordinary commit is smaller
	case !errors.Is(err, store.ErrConflict) || len(answered) != len(read):
		return plan{}, nil, 0, false, err
	}
	a.stats.notesWrong.Add(1)
	if len(read) > len(ks.keys) {
		migrated, err := a.layoutRead(ctx, answered[len(read)-1])
		if err != nil || migrated {
			return plan{}, nil, 0, false, err
		}
		answered = answered[:len(ks.keys)]
	}
	s, err = a.decodeSnapshot(ctx, req, defs, ks, pools, answered)
	return plan{}, s, 0, false, err
}
