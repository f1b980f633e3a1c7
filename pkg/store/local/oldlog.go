package local

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
)

// The write-ahead log that the local store kept beside its bbolt file
// from commit 9ee916f to issue 34 ("<file>-wal"). Nothing writes one any more: the first
// session that finds the file's revision counter anchored (16 bytes) reads
// the log once and checkpoints its chain into the file (checkpointOldLog in
// local.go). What follows is the reader of its format, and nothing else.
//
// The log held the commits made since the last checkpoint as a chain of
// records, written one after the other from offset 0 of a file of
// logCapacity bytes that was zero-filled when it was created:
//
//	offset  size
//	0       4   length of the record, header included (little endian)
//	4       8   seq: the revision the commit made
//	12      8   prev: the hash of the record before, or the anchor
//	20      8   hash: FNV-1a (64 bits) of bytes 0-19 and of the body
//	28          body: the commit's operations, each
//	            1 byte kind (0 put, 1 delete), 4 bytes key length, the key
//	            (with the store's prefix), and for a put 4 bytes value
//	            length and the value
//
// A record belongs to the chain when its hash is right, its seq is one more
// than the record before it (the first: one more than the checkpoint's
// revision) and its prev is that record's hash (the first: the anchor, a
// random number drawn at every checkpoint and kept with its revision in the
// bbolt file). The chain ends at the first record that is not, so a record
// torn by a crash ends it (its commit had not returned), and so does
// anything written before the last checkpoint.
const (
	oldLogSuffix = "-wal"
	logCapacity  = 32 << 10
	logHeader    = 28
)

// logEntry is the latest value of a key in the log's chain.
type logEntry struct {
	rev   int64
	value []byte // nil for a delete
	del   bool
}

// logChain is what a read of the log found: the chain's state on top of
// the checkpoint.
type logChain struct {
	seq     int64               // the revision of the last record, or the checkpoint's
	hash    uint64              // the hash of the last record, or the anchor
	next    int                 // the offset after the chain's last record
	entries map[string]logEntry // each of the chain's keys (prefixed): its latest entry
}

// errCorruptLog marks a record whose hash is right but whose body does not
// parse: only a bug writes one.
var errCorruptLog = errors.New("corrupt write-ahead log record")

// readChain reads the chain that follows a checkpoint at revision seq with
// anchor from f (nil: no log).
func readChain(f *os.File, seq int64, anchor uint64) (logChain, error) {
	c := logChain{seq: seq, hash: anchor}
	if f == nil {
		return c, nil
	}
	r := logReader{f: f}
	for {
		if !r.fill(c.next + logHeader) {
			break
		}
		n := int(binary.LittleEndian.Uint32(r.buf[c.next:]))
		if n < logHeader || c.next+n > logCapacity || !r.fill(c.next+n) {
			break
		}
		rec := r.buf[c.next : c.next+n]
		if int64(binary.LittleEndian.Uint64(rec[4:])) != c.seq+1 ||
			binary.LittleEndian.Uint64(rec[12:]) != c.hash ||
			binary.LittleEndian.Uint64(rec[20:]) != recordHash(rec) {
			break
		}
		if err := c.apply(rec[logHeader:], c.seq+1); err != nil {
			return logChain{}, fmt.Errorf("record %d at offset %d: %w", c.seq+1, c.next, err)
		}
		c.seq++
		c.hash = binary.LittleEndian.Uint64(rec[20:])
		c.next += n
	}
	return c, r.err
}

// apply records a body's operations as the latest of their keys.
func (c *logChain) apply(body []byte, rev int64) error {
	if c.entries == nil {
		c.entries = make(map[string]logEntry, 64)
	}
	for len(body) > 0 {
		if len(body) < 5 {
			return errCorruptLog
		}
		kind, n := body[0], int(binary.LittleEndian.Uint32(body[1:]))
		body = body[5:]
		if kind > 1 || n > len(body) {
			return errCorruptLog
		}
		key := string(body[:n])
		body = body[n:]
		if kind == 1 {
			c.entries[key] = logEntry{rev: rev, del: true}
			continue
		}
		if len(body) < 4 {
			return errCorruptLog
		}
		n = int(binary.LittleEndian.Uint32(body))
		body = body[4:]
		if n > len(body) {
			return errCorruptLog
		}
		c.entries[key] = logEntry{rev: rev, value: body[:n:n]}
		body = body[n:]
	}
	return nil
}

// recordHash is FNV-1a (64 bits) of a record's bytes 0-19 and its body.
func recordHash(rec []byte) uint64 {
	const offset, prime = 14695981039346656037, 1099511628211
	h := uint64(offset)
	for _, c := range rec[:20] {
		h = (h ^ uint64(c)) * prime
	}
	for _, c := range rec[logHeader:] {
		h = (h ^ uint64(c)) * prime
	}
	return h
}

// logReader reads a log file from its start, a page or more at a time, as
// far as the chain needs.
type logReader struct {
	f   *os.File
	buf []byte
	eof bool
	err error
}

// fill makes the first n bytes of the file readable in buf; false when the
// file (or the log's capacity) ends before, or on an error (kept in err).
func (r *logReader) fill(n int) bool {
	if n <= len(r.buf) {
		return true
	}
	if r.eof || r.err != nil || n > logCapacity {
		return false
	}
	want := min((n+8191)&^8191, logCapacity)
	have := len(r.buf)
	if want > cap(r.buf) {
		// A first read of 8 KiB, then one buffer for the whole log (the
		// chain's values point into the buffers, which stay as read).
		size := logCapacity
		if want <= 8192 && r.buf == nil {
			size = 8192
		}
		r.buf = append(make([]byte, 0, size), r.buf...)
	}
	r.buf = r.buf[:want]
	got, err := r.f.ReadAt(r.buf[have:], int64(have))
	r.buf = r.buf[:have+got]
	switch {
	case errors.Is(err, io.EOF):
		r.eof = true
	case err != nil:
		r.err = fmt.Errorf("read the write-ahead log: %w", err)
	}
	return n <= len(r.buf)
}
