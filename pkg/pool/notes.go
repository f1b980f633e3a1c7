package pool

import (
	"bytes"
	"context"
	"errors"
	"strconv"

	"github.com/ringipam/ringipam/pkg/store"
)

// Notes: an allocation on etcd reads the pool's definition, its ring and
// this host's state, then commits; two round trips. This host wrote its
// state itself last time, and the definition and the ring seldom change,
// so a note of what the last allocation or release here wrote lets the
// next allocation plan without reading and commit in one round trip,
// conditioned on the note's values being still the store's
// (store.Speculator). When they are not, the same round trip answers the
// store's state and the allocation goes on as if it had read it: two round
// trips, as without notes.

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

// believed is the revision given to a key known from a note: conditions on
// it are checked by value.
const believed = -1

// poolNote is what this host last knew of one pool: its definition, its
// ring and this host's state (absent keys with Revision 0, present ones
// with Revision believed).
type poolNote struct {
	def, ring, host store.KV
}

func (a *Allocator) noteName(pool string) string { return pool + "@" + a.host }

func (a *Allocator) newNote(pool string) poolNote {
	return poolNote{def: store.KV{Key: defKey(pool)}, ring: store.KV{Key: ringKey(pool)}, host: store.KV{Key: hostKey(pool, a.host)}}
}

// noteMagic starts every note: the format's name and version.
const noteMagic = "ringipam pool note 1\n"

// encode writes the three values, each as its length (or "-" when absent)
// on a line, then its bytes and a newline, and "end" last: a note cut
// short anywhere does not decode.
func (n poolNote) encode() []byte {
	b := []byte(noteMagic)
	for _, kv := range []store.KV{n.def, n.ring, n.host} {
		if !kv.Exists() {
			b = append(b, "-\n"...)
			continue
		}
		b = strconv.AppendInt(b, int64(len(kv.Value)), 10)
		b = append(b, '\n')
		b = append(b, kv.Value...)
		b = append(b, '\n')
	}
	return append(b, "end\n"...)
}

var errBadNote = errors.New("not a pool note")

// decodeNote reads what encode wrote into n, whose keys are set.
func decodeNote(b []byte, n *poolNote) error {
	rest, ok := bytes.CutPrefix(b, []byte(noteMagic))
	if !ok {
		return errBadNote
	}
	for _, kv := range []*store.KV{&n.def, &n.ring, &n.host} {
		line, after, ok := bytes.Cut(rest, []byte{'\n'})
		if !ok {
			return errBadNote
		}
		if string(line) == "-" {
			kv.Value, kv.Revision, rest = nil, 0, after
			continue
		}
		size, err := strconv.Atoi(string(line))
		if err != nil || size < 0 || size >= len(after) || after[size] != '\n' {
			return errBadNote
		}
		kv.Value, kv.Revision, rest = bytes.Clone(after[:size]), believed, after[size+1:]
	}
	if string(rest) != "end\n" {
		return errBadNote
	}
	return nil
}

// readNote returns this host's note of pool, if there is a usable one.
func (a *Allocator) readNote(pool string) (poolNote, bool) {
	n := a.newNote(pool)
	if a.notes == nil {
		return n, false
	}
	b := a.notes.ReadNote(a.noteName(pool))
	if b == nil || decodeNote(b, &n) != nil || !n.def.Exists() {
		return n, false
	}
	return n, true
}

// apply updates n by what ops write.
func (n *poolNote) apply(ops []store.Op) {
	for _, o := range ops {
		for _, kv := range []*store.KV{&n.def, &n.ring, &n.host} {
			switch {
			case o.Key != kv.Key:
			case o.Delete:
				kv.Value, kv.Revision = nil, 0
			default:
				kv.Value, kv.Revision = o.Value, believed
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

// noteAllocation records, for each pool of s, what the committed plan p
// left in the store.
func (a *Allocator) noteAllocation(s *snapshot, p plan) {
	if _, ok := a.speculating(); !ok {
		return
	}
	for _, t := range s.pools {
		n := poolNote{def: t.defKV, ring: t.ringKV, host: t.hostKV}
		n.apply(p.ops)
		if n.def.Exists() {
			a.notes.WriteNote(a.noteName(t.name), n.encode())
		}
	}
}

// noteRelease updates this host's notes of pools by a committed release's
// ops (a pool without a note keeps none: the release did not read its
// definition and ring).
func (a *Allocator) noteRelease(pools []string, ops []store.Op) {
	if _, ok := a.speculating(); !ok {
		return
	}
	for _, pool := range pools {
		if n, ok := a.readNote(pool); ok {
			n.apply(ops)
			a.notes.WriteNote(a.noteName(pool), n.encode())
		}
	}
}

// speculate tries an allocation in one round trip, planned on this host's
// notes of the wanted pools with the owner (and its reservation) believed
// absent. done says it committed p, and s is the state p was planned on
// (noteAllocation's). Otherwise s, unless nil, is the state the store
// answered when the notes no longer held, decoded as a read would be: the
// caller plans on it instead of reading. A nil s means nothing was tried,
// or what was answered is stale (the store was just migrated).
func (a *Allocator) speculate(ctx context.Context, req Request, defs map[string]Def) (p plan, s *snapshot, done bool, err error) {
	sp, ok := a.speculating()
	if !ok {
		return plan{}, nil, false, nil
	}
	ks, pools := a.readKeys(req)
	kvs := make([]store.KV, len(ks.keys))
	for i, k := range ks.keys {
		kvs[i].Key = k
	}
	same := []store.KV{{Key: layoutKey, Value: []byte(layoutVersion)}}
	for _, pool := range pools {
		n, ok := a.readNote(pool)
		if !ok {
			return plan{}, nil, false, nil
		}
		for _, kv := range []store.KV{n.def, n.ring, n.host} {
			kvs[ks.at[kv.Key]] = kv
		}
		same = append(same, n.def)
	}
	// A note that does not decode or plan is only a wrong belief: the
	// ordinary path reads and decides, and reports what is really wrong.
	if s, err = a.decodeSnapshot(ctx, req, defs, ks, pools, kvs); err != nil || len(s.newDefs) > 0 {
		return plan{}, nil, false, nil
	}
	if p, err = a.plan(ctx, s, req, true); err != nil || p.noop {
		return plan{}, nil, false, nil
	}
	var conds []store.Cond
	for _, c := range p.conds {
		if c.Revision == believed {
			same = append(same, kvs[ks.at[c.Key]])
		} else {
			conds = append(conds, c)
		}
	}
	read := ks.keys
	if !a.layoutOK.Load() {
		read = append(read[:len(read):len(read)], layoutKey)
	}
	answered, err := sp.CommitOrGet(ctx, conds, same, p.ops, read)
	switch {
	case err == nil:
		a.stats.commits.Add(1)
		a.stats.onNotes.Add(1)
		return p, s, true, nil
	case errors.Is(err, store.ErrTooLarge):
		return plan{}, nil, false, nil // the ordinary commit is smaller
	case !errors.Is(err, store.ErrConflict) || len(answered) != len(read):
		return plan{}, nil, false, err
	}
	a.stats.notesWrong.Add(1)
	if len(read) > len(ks.keys) {
		migrated, err := a.layoutRead(ctx, answered[len(read)-1])
		if err != nil || migrated {
			return plan{}, nil, false, err
		}
		answered = answered[:len(ks.keys)]
	}
	s, err = a.decodeSnapshot(ctx, req, defs, ks, pools, answered)
	return plan{}, s, false, err
}
