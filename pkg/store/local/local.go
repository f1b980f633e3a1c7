// Package local is the embedded, single-host store.Store: one bbolt file on
// the host's disk and its write-ahead log beside it ("<file>-wal"), no
// server.
//
// Contract:
//
//   - Crash safety: a Commit is durable when it returns, and a crash leaves
//     the store as it was after some commit, never in between. A commit is
//     one checksummed record appended to the log and flushed (one
//     fdatasync), or, when the log is full or the commit too large for it, a
//     checkpoint: one bbolt read-write transaction (which bbolt flushes)
//     holding the log's records and the commit, after which the log starts
//     again. The record format and why a torn or stale record can never be
//     read are in wal.go.
//   - Many processes: the files are NOT held open between calls. Each Get,
//     Scan and Commit opens them, takes the bbolt file's flock (shared for
//     reads, exclusive for writes), does its work and closes them again, so
//     short-lived CNI plugin processes and a long-running driver can share
//     one store. A commit that wrote a record lets the lock go before it
//     waits for the record's flush, so that the flushes of several
//     processes overlap (a process that reads meanwhile sees the record:
//     should the machine fail before the flush, the record and every commit
//     made after it are lost together, and none of them had returned). The
//     one exception is Hold, which keeps the file open and exclusively
//     locked for the calls of one operation until its release or its
//     commit. The lock is waited for until Config.OpenTimeout (or the
//     context's deadline, if earlier); when it cannot be obtained the call
//     fails with an error wrapping store.ErrUnavailable that names the file
//     and says another process holds it. No call can wait forever.
//   - Goroutines: a Store is safe for concurrent use. Calls inside one process
//     are serialised by an in-process lock (with the same deadline), so
//     goroutines do not fight over the flock.
//   - Revisions: a counter incremented once per successful Commit (the
//     record's sequence number, or the checkpoint's, kept in a meta bucket
//     of the bbolt file); each value is stored together with the revision
//     that wrote it.
//   - Range conditions (no key in [Key, End)) are checked with a bbolt
//     cursor from the range's start, skipping the keys the log deletes,
//     and against the log's own keys, in the commit's locked session.
//   - Errors: conflicts wrap store.ErrConflict and write nothing; lock
//     timeouts wrap store.ErrUnavailable; other I/O errors (permissions, a
//     corrupt file, a full disk) are returned wrapped with the file's path.
//   - Upgrades: a file written before the log is read as it is, and its
//     first commit is a checkpoint that starts the log. From then on the
//     revision counter also holds the log's anchor (16 bytes instead of 8),
//     so a ringipam from before the log refuses to commit to the file (it
//     reports a corrupt revision counter) instead of writing past records
//     it cannot read. Stop every ringipam process of the host (agent,
//     Docker driver) before replacing the binaries, and back up the two
//     files together.
//
// The zero value is not usable: call New.
package local

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"time"

	bolt "go.etcd.io/bbolt"
	"golang.org/x/sys/unix"

	"github.com/ringipam/ringipam/pkg/hostlock"
	"github.com/ringipam/ringipam/pkg/store"
)

// DefaultPath is where the store lives when Config.Path is empty.
const DefaultPath = "/var/lib/ringipam/store.db"

// DefaultOpenTimeout bounds the wait for the file lock when
// Config.OpenTimeout is zero.
const DefaultOpenTimeout = 5 * time.Second

var (
	bucketKV   = []byte("kv")
	bucketMeta = []byte("meta")
	keyRev     = []byte("rev")
)

// Config configures a local store.
type Config struct {
	// Path of the bbolt file; DefaultPath if empty. Its directory is created
	// with mode 0700 if missing.
	Path string
	// OpenTimeout bounds the wait for the file lock (and for the in-process
	// lock); DefaultOpenTimeout if zero.
	OpenTimeout time.Duration
	// Prefix is prepended to every key on disk. Optional: one file normally
	// serves one ringipam installation, but a prefix lets several share it.
	Prefix string
}

// Store is a store.Store backed by a bbolt file. See the package doc.
type Store struct {
	path    string
	timeout time.Duration
	prefix  string
	// sem is the in-process lock: one call at a time touches the file.
	sem chan struct{}
	// held is the session kept open by Hold (nil when not held, or once a
	// commit under the hold let it go), and holds the number of Holds not
	// yet released; both guarded by sem.
	held  *session
	holds int
}

var _ store.Store = (*Store)(nil)

// New returns a Store for cfg. It creates the file's directory (0700) if
// missing but does not open the file: that happens on every call.
func New(cfg Config) (*Store, error) {
	if cfg.Path == "" {
		cfg.Path = DefaultPath
	}
	if cfg.OpenTimeout == 0 {
		cfg.OpenTimeout = DefaultOpenTimeout
	}
	if cfg.OpenTimeout < 0 {
		return nil, fmt.Errorf("local store: negative open timeout %s", cfg.OpenTimeout)
	}
	path, err := filepath.Abs(cfg.Path)
	if err != nil {
		return nil, fmt.Errorf("local store %s: %w", cfg.Path, err)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, fmt.Errorf("local store %s: create directory: %w", path, err)
	}
	return &Store{
		path:    path,
		timeout: cfg.OpenTimeout,
		prefix:  cfg.Prefix,
		sem:     make(chan struct{}, 1),
	}, nil
}

// Path returns the absolute path of the store's file.
func (s *Store) Path() string { return s.path }

// Get implements store.Store. All keys are read at one revision.
func (s *Store) Get(ctx context.Context, keys ...string) ([]store.KV, error) {
	out, done, err := store.StartGet(ctx, keys)
	if done {
		return out, err
	}
	err = s.with(ctx, true, func(sess *session) error {
		return sess.db.View(func(tx *bolt.Tx) error {
			for i, k := range keys {
				rev, val, err := sess.lookup(tx, s.prefix+k)
				if err != nil {
					return fmt.Errorf("key %q: %w", k, err)
				}
				out[i].Value, out[i].Revision = val, rev
			}
			return nil
		})
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// Scan implements store.Store.
func (s *Store) Scan(ctx context.Context, from, to string, limit int) ([]store.KV, error) {
	if to <= from {
		return nil, ctx.Err() // an empty range: nothing to read
	}
	var out []store.KV
	err := s.with(ctx, true, func(sess *session) error {
		return sess.db.View(func(tx *bolt.Tx) error {
			lo, hi := s.prefix+from, s.prefix+to
			// The checkpoint's keys and the log's, merged in key order;
			// the log's entry of a key is the later one.
			logged := sess.chain.keysBetween(lo, hi)
			var k, v []byte
			var c *bolt.Cursor
			if b := tx.Bucket(bucketKV); b != nil {
				c = b.Cursor()
				k, v = c.Seek([]byte(lo))
			}
			for limit <= 0 || len(out) < limit {
				inFile := k != nil && bytes.Compare(k, []byte(hi)) < 0
				var key string
				var rev int64
				var val []byte
				switch {
				case len(logged) > 0 && (!inFile || logged[0] <= string(k)):
					key, logged = logged[0], logged[1:]
					if inFile && key == string(k) {
						k, v = c.Next()
					}
					e := sess.chain.entries[key]
					if e.del {
						continue
					}
					rev, val = e.rev, bytes.Clone(e.value)
				case inFile:
					var err error
					if rev, val, err = decode(v); err != nil {
						return fmt.Errorf("key %q: %w", k, err)
					}
					key = string(k)
					k, v = c.Next()
				default:
					return nil
				}
				out = append(out, store.KV{Key: key[len(s.prefix):], Value: val, Revision: rev})
			}
			return nil
		})
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// Commit implements store.Store. A commit that fits in the log is one
// record written there; the others (the first commit of a file, one too
// large for what is left of the log) are a checkpoint: one bbolt
// transaction holding the log's chain and the commit, after which the log
// starts again.
func (s *Store) Commit(ctx context.Context, conds []store.Cond, ops []store.Op) error {
	if err := store.CheckCommit(conds, ops); err != nil {
		return fmt.Errorf("local store %s: %w", s.path, err)
	}
	return s.with(ctx, false, func(sess *session) error {
		rev := sess.chain.seq + 1
		if sess.anchored && sess.log != nil {
			rec := encodeRecord(rev, sess.chain.hash, s.prefix, ops)
			if sess.chain.next+len(rec) <= logCapacity {
				if err := sess.db.View(func(tx *bolt.Tx) error { return sess.check(tx, s.prefix, conds) }); err != nil {
					return err
				}
				if _, err := sess.log.WriteAt(rec, int64(sess.chain.next)); err != nil {
					return fmt.Errorf("write the write-ahead log: %w", err)
				}
				sess.committed, sess.flush = true, true
				return nil
			}
		}
		return s.checkpoint(sess, rev, conds, ops)
	})
}

// checkpoint commits ops at revision rev in one bbolt transaction together
// with the log's chain, and draws a new anchor, which ends the chain: the
// next record is written at the log's start. bbolt flushes the
// transaction before it returns. A checkpoint also creates the log when
// there is none (the file's first commit, or the first since an upgrade);
// then, and when the commit creates the file, it fsyncs their directory,
// so that the new names survive a crash as the contents do.
func (s *Store) checkpoint(sess *session, rev int64, conds []store.Cond, ops []store.Op) error {
	fresh := false
	err := sess.db.Update(func(tx *bolt.Tx) error {
		fresh = tx.Bucket(bucketMeta) == nil
		kv, err := tx.CreateBucketIfNotExists(bucketKV)
		if err != nil {
			return err
		}
		meta, err := tx.CreateBucketIfNotExists(bucketMeta)
		if err != nil {
			return err
		}
		if err := sess.check(tx, s.prefix, conds); err != nil {
			return err
		}
		for k, e := range sess.chain.entries {
			if e.del {
				err = kv.Delete([]byte(k))
			} else {
				err = kv.Put([]byte(k), encode(e.rev, e.value))
			}
			if err != nil {
				return err
			}
		}
		for _, o := range ops {
			k := []byte(s.prefix + o.Key)
			if o.Delete {
				err = kv.Delete(k)
			} else {
				err = kv.Put(k, encode(rev, o.Value))
			}
			if err != nil {
				return err
			}
		}
		counter := binary.BigEndian.AppendUint64(nil, uint64(rev))
		return meta.Put(keyRev, binary.BigEndian.AppendUint64(counter, rand.Uint64()))
	})
	if err != nil {
		return err
	}
	sess.committed = true
	// Best effort from here on: the commit itself is durable and applied,
	// so a failure must not be reported as a failed commit. Without a log
	// the next commit is a checkpoint again, which tries again.
	created := false
	if sess.log == nil {
		created = createLog(s.path+logSuffix) == nil
	}
	if fresh || created {
		_ = syncDir(filepath.Dir(s.path))
	}
	return nil
}

// createLog creates the write-ahead log at path: logCapacity bytes of
// zeros (no record), flushed, written under a temporary name and renamed,
// so that a log never has its name before it is whole. The caller syncs
// the directory.
func createLog(path string) error {
	tmp := path + ".new"
	f, err := hostlock.OpenFile(tmp, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	_, err = f.WriteAt(make([]byte, logCapacity), 0)
	if err == nil {
		err = unix.Fdatasync(int(f.Fd()))
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		_ = os.Remove(tmp)
	}
	return err
}

// Ping checks that the file can be opened and locked within the timeout or,
// before the first commit, that its directory is writable.
func (s *Store) Ping(ctx context.Context) error {
	if _, err := os.Stat(s.path); errors.Is(err, os.ErrNotExist) {
		if err := unix.Access(filepath.Dir(s.path), unix.W_OK); err != nil {
			return fmt.Errorf("local store %s: directory not writable: %w", s.path, err)
		}
		return ctx.Err()
	}
	return s.with(ctx, true, func(*session) error { return nil })
}

// Close implements store.Store. The file is held open between calls only
// inside Hold, whose release closes it, so there is nothing to release.
func (s *Store) Close() error { return nil }

// Hold opens the file for writing, under its exclusive lock, and keeps it
// open until release is called or a Commit of this Store succeeds,
// whichever comes first: the calls of one operation (the reads, then the
// commit that depends on them) then pay for one open and one lock instead
// of one each. Meanwhile every Get, Scan and Commit of this Store uses the
// held file, and other processes wait for its lock within their own
// timeouts, as they would for one commit. The commit lets the lock go
// before it waits for its flush; calls after it, under the same hold, open
// and lock the file again and keep it so until the next commit or the
// release. Holds nest: the file is closed when the last one is released.
//
// A file that does not exist yet is not created: Hold then keeps nothing
// until a Commit under it creates the file.
func (s *Store) Hold(ctx context.Context) (release func(), err error) {
	deadline, err := s.enter(ctx)
	if err != nil {
		return nil, err
	}
	defer func() { <-s.sem }()
	// Under a hold, session opens the file for writing and keeps it; asked
	// for a read, it creates no file.
	s.holds++
	if _, err := s.session(ctx, true, deadline); err != nil {
		s.holds--
		return nil, err
	}
	var once bool
	return func() {
		if once {
			return
		}
		once = true
		// Calls hold sem only for one bbolt transaction, so this wait is
		// bounded by theirs.
		s.sem <- struct{}{}
		defer func() { <-s.sem }()
		if s.holds--; s.holds == 0 && s.held != nil {
			s.held.close()
			s.held = nil
		}
	}, nil
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("sync directory: %w", err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("sync directory %s: %w", dir, err)
	}
	return nil
}

// session is the store as one call (or one hold) sees it: the bbolt file,
// opened under its flock, and the log's chain on top of it.
type session struct {
	db       *openDB
	log      *os.File // nil while there is no log file (or it was not needed)
	anchored bool     // the checkpoint has an anchor: the log may hold a chain
	chain    logChain
	// committed: a Commit succeeded, which ends the session; flush: it
	// wrote a record, which the log's flush makes durable.
	committed, flush bool
}

// begin opens the file (read-only with a shared flock, or read-write with
// an exclusive one) and reads the log's chain.
func (s *Store) begin(ctx context.Context, readOnly bool, deadline time.Time) (*session, error) {
	db, err := s.open(ctx, readOnly, deadline)
	if err != nil && readOnly && !errors.Is(err, store.ErrUnavailable) && ctx.Err() == nil {
		// A read-only open fails on a file that a writer created but has
		// not initialised yet; a read-write open initialises it.
		db, err = s.open(ctx, false, deadline)
	}
	if err != nil {
		return nil, err
	}
	sess := &session{db: db}
	if err := sess.load(s.path+logSuffix, readOnly); err != nil {
		sess.close()
		return nil, fmt.Errorf("local store %s: %w", s.path, err)
	}
	return sess, nil
}

// load reads the checkpoint's revision and anchor, then the log's chain.
func (sess *session) load(logPath string, readOnly bool) error {
	var rev int64
	var anchor uint64
	err := sess.db.View(func(tx *bolt.Tx) error {
		meta := tx.Bucket(bucketMeta)
		if meta == nil {
			return nil
		}
		switch v := meta.Get(keyRev); len(v) {
		case 0:
		case 8: // written before the log: no chain
			rev = int64(binary.BigEndian.Uint64(v))
		case 16:
			rev, anchor = int64(binary.BigEndian.Uint64(v)), binary.BigEndian.Uint64(v[8:])
			sess.anchored = true
		default:
			return fmt.Errorf("corrupt revision counter (%d bytes)", len(v))
		}
		return nil
	})
	if err != nil {
		return err
	}
	if sess.anchored {
		flag := os.O_RDWR
		if readOnly {
			flag = os.O_RDONLY
		}
		f, err := hostlock.OpenFile(logPath, flag, 0)
		switch {
		case errors.Is(err, os.ErrNotExist):
		case err != nil:
			return fmt.Errorf("open the write-ahead log: %w", err)
		default:
			sess.log = f
		}
	}
	sess.chain, err = readChain(sess.log, rev, anchor)
	return err
}

// lookup returns key's revision and a copy of its value (0 and nil when
// absent): the log's entry if it has one, else the checkpoint's.
func (sess *session) lookup(tx *bolt.Tx, key string) (int64, []byte, error) {
	if e, ok := sess.chain.entries[key]; ok {
		if e.del {
			return 0, nil, nil
		}
		return e.rev, bytes.Clone(e.value), nil
	}
	b := tx.Bucket(bucketKV)
	if b == nil {
		return 0, nil, nil
	}
	v := b.Get([]byte(key))
	if v == nil {
		return 0, nil, nil
	}
	return decode(v)
}

// check verifies conds (keys without the store's prefix).
func (sess *session) check(tx *bolt.Tx, prefix string, conds []store.Cond) error {
	for _, c := range conds {
		if c.IsRange() {
			if k, ok := sess.someKeyIn(tx, prefix+c.Key, prefix+c.End); ok {
				return fmt.Errorf("%w: key %q exists in [%q, %q)", store.ErrConflict, k[len(prefix):], c.Key, c.End)
			}
			continue
		}
		rev, _, err := sess.lookup(tx, prefix+c.Key)
		if err != nil {
			return fmt.Errorf("key %q: %w", c.Key, err)
		}
		if rev != c.Revision {
			return fmt.Errorf("%w: key %q is at revision %d, expected %d", store.ErrConflict, c.Key, rev, c.Revision)
		}
	}
	return nil
}

// someKeyIn returns a key k with lo <= k < hi that exists (its log entry,
// if it has one, is not a delete), if there is one: any of the log's, else
// the checkpoint's first by a cursor from lo that the log does not delete.
func (sess *session) someKeyIn(tx *bolt.Tx, lo, hi string) (string, bool) {
	for k, e := range sess.chain.entries {
		if k >= lo && k < hi && !e.del {
			return k, true
		}
	}
	b := tx.Bucket(bucketKV)
	if b == nil {
		return "", false
	}
	c := b.Cursor()
	for k, _ := c.Seek([]byte(lo)); k != nil && string(k) < hi; k, _ = c.Next() {
		if _, logged := sess.chain.entries[string(k)]; !logged {
			return string(k), true // a logged one was a delete: seen above
		}
	}
	return "", false
}

// close lets go of the file's lock and closes it, and the log.
func (sess *session) close() {
	// A failing close cannot undo what was read or durably committed, so
	// it is not reported.
	_ = sess.db.close()
	if sess.log != nil {
		_ = sess.log.Close()
	}
}

// with takes the in-process lock, runs fn on a session (the held one, or
// one opened for the call and closed after it) and, when fn wrote a record
// to the log, lets go of both locks before it waits for the log's flush:
// other calls, here and in other processes, go on meanwhile, and the
// commit returns once its record is on the disk. A read of a file that
// does not exist yet runs nothing: nothing was ever committed, every key is
// absent.
func (s *Store) with(ctx context.Context, readOnly bool, fn func(*session) error) error {
	deadline, err := s.enter(ctx)
	if err != nil {
		return err
	}
	sess, err := s.session(ctx, readOnly, deadline)
	if err != nil || sess == nil {
		<-s.sem
		if err != nil {
			return err
		}
		return ctx.Err()
	}
	err = fn(sess)
	var flush *os.File
	if sess.committed || s.held != sess {
		if sess.flush {
			flush, sess.log = sess.log, nil
		}
		sess.close()
		if s.held == sess {
			s.held = nil
		}
	}
	<-s.sem
	if flush != nil {
		if ferr := unix.Fdatasync(int(flush.Fd())); ferr != nil && err == nil {
			err = fmt.Errorf("flush the write-ahead log: %w", ferr)
		}
		_ = flush.Close()
	}
	if err != nil && !errors.Is(err, store.ErrConflict) {
		return fmt.Errorf("local store %s: %w", s.path, err)
	}
	return err
}

// session returns the session for one call: the held one; under a hold
// whose lock a commit let go, a new one that is then held; else one for
// this call alone (nil for a read before the file exists).
func (s *Store) session(ctx context.Context, readOnly bool, deadline time.Time) (*session, error) {
	if s.held != nil {
		return s.held, nil
	}
	if readOnly {
		if _, err := os.Stat(s.path); errors.Is(err, os.ErrNotExist) {
			return nil, nil
		}
	}
	if s.holds > 0 {
		sess, err := s.begin(ctx, false, deadline)
		if err != nil {
			return nil, err
		}
		s.held = sess
		return sess, nil
	}
	return s.begin(ctx, readOnly, deadline)
}

// enter takes the in-process lock (sem) within the store's timeout or ctx's
// deadline, whichever is first, and returns that deadline for the file lock.
func (s *Store) enter(ctx context.Context) (time.Time, error) {
	if err := ctx.Err(); err != nil {
		return time.Time{}, err
	}
	deadline := time.Now().Add(s.timeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	timer := time.NewTimer(time.Until(deadline))
	defer timer.Stop()
	select {
	case s.sem <- struct{}{}:
		return deadline, nil
	case <-ctx.Done():
		return time.Time{}, ctx.Err()
	case <-timer.C:
		return time.Time{}, fmt.Errorf("%w: local store %s: busy in this process for more than %s", store.ErrUnavailable, s.path, s.timeout)
	}
}

// errLockTimeout marks a flock that was not obtained before the deadline.
var errLockTimeout = errors.New("lock timeout")

// open opens the bbolt file. Our own OpenFile hook opens it without the
// runtime's poller (hostlock.OpenFile) and takes the flock, waiting in the
// kernel until the deadline (bbolt's own loop sleeps 50 ms between
// attempts, which would idle the file under contention); bbolt's flock on
// the same descriptor then succeeds at once.
func (s *Store) open(ctx context.Context, readOnly bool, deadline time.Time) (*openDB, error) {
	var locked *os.File
	openFile := func(name string, flag int, mode os.FileMode) (*os.File, error) {
		f, err := hostlock.OpenFile(name, flag, mode)
		if err != nil || locked != nil {
			return f, err
		}
		how := unix.LOCK_EX
		if readOnly {
			how = unix.LOCK_SH
		}
		if err := lockFile(ctx, f, how, deadline); err != nil {
			f.Close()
			return nil, err
		}
		locked = f
		return f, nil
	}
	remaining := time.Until(deadline)
	if remaining <= 0 {
		remaining = time.Millisecond
	}
	db, err := bolt.Open(s.path, 0o600, &bolt.Options{
		Timeout:  remaining, // backstop only: the hook has taken the lock
		ReadOnly: readOnly,
		OpenFile: openFile,
	})
	switch {
	case err == nil:
		return &openDB{DB: db, locked: locked}, nil
	case errors.Is(err, errLockTimeout):
		return nil, fmt.Errorf("%w: local store %s: another process holds its lock (waited %s)", store.ErrUnavailable, s.path, s.timeout)
	case ctx.Err() != nil:
		return nil, fmt.Errorf("local store %s: %w", s.path, ctx.Err())
	default:
		return nil, fmt.Errorf("local store %s: open: %w", s.path, err)
	}
}

// openDB is a bbolt file opened by Store.open, with the descriptor that
// holds its flock.
type openDB struct {
	*bolt.DB
	locked *os.File
}

// close lets go of the flock, then closes the file. bbolt's own Close
// unmaps the file before it unlocks; the unmap, in a process whose threads
// ran on several CPUs, waits for the others to flush their TLBs, and other
// processes need not wait for that: nothing reads the map once the call is
// done.
func (db *openDB) close() error {
	if db.locked != nil {
		_ = unix.Flock(int(db.locked.Fd()), unix.LOCK_UN)
	}
	return db.DB.Close()
}

// lockFile waits for flock(how) on f until ctx ends or the deadline passes
// (errLockTimeout). The wait is the kernel's (hostlock.Flock): the lock is
// taken the moment its holder lets go.
func lockFile(ctx context.Context, f *os.File, how int, deadline time.Time) error {
	wait, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	err := hostlock.Flock(wait, f, how)
	if err != nil && ctx.Err() == nil && wait.Err() != nil {
		return errLockTimeout
	}
	return err
}

// encode stores a value as 8 bytes of revision followed by the value.
func encode(rev int64, value []byte) []byte {
	b := make([]byte, 8, 8+len(value))
	binary.BigEndian.PutUint64(b, uint64(rev))
	return append(b, value...)
}

// decode splits a stored value; the returned value is a copy, safe to use
// after the transaction ends.
func decode(v []byte) (int64, []byte, error) {
	if len(v) < 8 {
		return 0, nil, fmt.Errorf("corrupt value (%d bytes)", len(v))
	}
	return int64(binary.BigEndian.Uint64(v[:8])), bytes.Clone(v[8:]), nil
}
