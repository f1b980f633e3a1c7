// Package local is the embedded, single-host store.Store: one bbolt file on
// the host's disk, no server.
//
// Contract:
//
//   - Crash safety: a Commit is durable when it returns, and a crash leaves
//     the store as it was after some commit, never in between. A commit is
//     one bbolt read-write transaction, flushed by bbolt before it returns
//     and before the file's lock is let go.
//   - Many processes: the file is NOT held open between calls. Each Get,
//     Scan and Commit opens it, takes its flock (shared for reads,
//     exclusive for writes), does its work and closes it again, so
//     short-lived CNI plugin processes and a long-running driver can share
//     one store. The one exception is Hold, which keeps the file open and
//     exclusively locked for the calls of one operation until its release
//     or its commit. The lock is waited for until Config.OpenTimeout (or
//     the context's deadline, if earlier); when it cannot be obtained the
//     call fails with an error wrapping store.ErrUnavailable that names the
//     file and says another process holds it. No call can wait forever.
//   - Goroutines: a Store is safe for concurrent use. Calls inside one process
//     are serialised by an in-process lock (with the same deadline), so
//     goroutines do not fight over the flock.
//   - Revisions: a counter incremented once per successful Commit, kept in a
//     meta bucket of the file; each value is stored together with the
//     revision that wrote it.
//   - Range conditions (no key in [Key, End)) are checked with a bbolt
//     cursor from the range's start, in the commit's transaction.
//   - Errors: conflicts wrap store.ErrConflict and write nothing; lock
//     timeouts wrap store.ErrUnavailable; other I/O errors (permissions, a
//     corrupt file, a full disk) are returned wrapped with the file's path.
//   - Upgrades: ringipam from commit 9ee916f (2026-11-25) to issue 34 kept
//     a write-ahead log beside the file ("<file>-wal"), whose latest
//     commits were not in the bbolt file yet; such a file has a 16-byte
//     revision counter (the revision and the log's anchor). The
//     first session that finds one, under the file's exclusive lock, reads
//     the log's chain once (oldlog.go), writes it into the file in one
//     transaction with the counter in its 8-byte form (bbolt flushes it),
//     then removes the log and flushes the directory. Applying the chain is
//     idempotent (puts and deletes of the latest values), and a crash
//     before the log's removal leaves a log that no anchor points to, never
//     read again, removed by the next process. Every value keeps the
//     revision its commit gave it. Nothing is needed of the operator; a
//     read-only caller that finds an old log opens the file for writing
//     once to do this.
//
// The zero value is not usable: call New.
package local

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
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
	// oldLog: a write-ahead log of the format before (oldlog.go) was
	// beside the file when New looked; guarded by sem.
	oldLog bool
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
	_, err = os.Lstat(path + oldLogSuffix)
	return &Store{
		path:    path,
		timeout: cfg.OpenTimeout,
		prefix:  cfg.Prefix,
		sem:     make(chan struct{}, 1),
		oldLog:  err == nil,
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
				rev, val, err := lookup(tx, s.prefix+k)
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
			b := tx.Bucket(bucketKV)
			if b == nil {
				return nil
			}
			hi := []byte(s.prefix + to)
			c := b.Cursor()
			for k, v := c.Seek([]byte(s.prefix + from)); k != nil && bytes.Compare(k, hi) < 0; k, v = c.Next() {
				if limit > 0 && len(out) >= limit {
					return nil
				}
				rev, val, err := decode(v)
				if err != nil {
					return fmt.Errorf("key %q: %w", k, err)
				}
				out = append(out, store.KV{Key: string(k[len(s.prefix):]), Value: val, Revision: rev})
			}
			return nil
		})
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// Commit implements store.Store: one bbolt read-write transaction, which
// bbolt flushes before it returns. When the commit creates the file, the
// directory is flushed too, so that the new name survives a crash as the
// contents do.
func (s *Store) Commit(ctx context.Context, conds []store.Cond, ops []store.Op) error {
	if err := store.CheckCommit(conds, ops); err != nil {
		return fmt.Errorf("local store %s: %w", s.path, err)
	}
	return s.with(ctx, false, func(sess *session) error {
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
			rev, err := revision(meta)
			if err != nil {
				return err
			}
			rev++
			if err := check(tx, s.prefix, conds); err != nil {
				return err
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
			return meta.Put(keyRev, binary.BigEndian.AppendUint64(nil, uint64(rev)))
		})
		if err != nil {
			return err
		}
		sess.committed = true
		if fresh {
			// Best effort: the commit is durable and applied, so a
			// failure here must not be reported as a failed commit.
			_ = syncDir(filepath.Dir(s.path))
		}
		return nil
	})
}

// revision reads the revision counter: 8 bytes, or absent before the
// first commit. A 16-byte counter (the revision and the anchor of an old
// write-ahead log) is checkpointed when the session begins, so a commit
// never finds one.
func revision(meta *bolt.Bucket) (int64, error) {
	switch v := meta.Get(keyRev); len(v) {
	case 0:
		return 0, nil
	case 8:
		return int64(binary.BigEndian.Uint64(v)), nil
	default:
		return 0, fmt.Errorf("corrupt revision counter (%d bytes)", len(v))
	}
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
// timeouts, as they would for one commit. A commit, once bbolt has flushed
// it, lets the lock go (the operation's reads and commit are done); calls
// after it, under the same hold, open and lock the file again and keep it
// so until the next commit or the release. Holds nest: the file is closed
// when the last one is released.
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
// opened under its flock.
type session struct {
	db *openDB
	// committed: a Commit succeeded, which ends the session.
	committed bool
}

// begin opens the file (read-only with a shared flock, or read-write with
// an exclusive one). A file that an old write-ahead log still has commits
// for is checkpointed first (see the package doc), in a read-write session
// that the call then uses, even a read.
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
	anchored := false
	err = db.View(func(tx *bolt.Tx) error {
		if meta := tx.Bucket(bucketMeta); meta != nil {
			anchored = len(meta.Get(keyRev)) == 16
		}
		return nil
	})
	if err == nil && anchored && db.IsReadOnly() {
		sess.close()
		return s.begin(ctx, false, deadline)
	}
	if err == nil && anchored {
		err = s.checkpointOldLog(db)
	}
	if err == nil && s.oldLog && !anchored {
		// A log that no anchor points to (left by a crash after its
		// checkpoint): never read. Under the file's lock, no process of
		// the log's time can be writing it: they wrote it only while the
		// counter was anchored.
		s.removeOldLog()
	}
	if err != nil {
		sess.close()
		return nil, fmt.Errorf("local store %s: %w", s.path, err)
	}
	return sess, nil
}

// checkpointOldLog writes the chain of the old write-ahead log beside the
// file (oldlog.go) into the file, in one transaction that also turns the
// revision counter into its 8-byte form (the chain's last revision), then
// removes the log. The caller holds the file's exclusive lock.
func (s *Store) checkpointOldLog(db *openDB) error {
	logPath := s.path + oldLogSuffix
	f, err := hostlock.OpenFile(logPath, os.O_RDONLY, 0)
	switch {
	case errors.Is(err, os.ErrNotExist):
		f = nil // a checkpoint whose log was never created: no chain
	case err != nil:
		return fmt.Errorf("open the old write-ahead log: %w", err)
	default:
		defer f.Close()
	}
	err = db.Update(func(tx *bolt.Tx) error {
		meta := tx.Bucket(bucketMeta)
		v := meta.Get(keyRev)
		if len(v) != 16 {
			return nil
		}
		chain, err := readChain(f, int64(binary.BigEndian.Uint64(v)), binary.BigEndian.Uint64(v[8:]))
		if err != nil {
			return fmt.Errorf("old write-ahead log %s: %w", logPath, err)
		}
		kv, err := tx.CreateBucketIfNotExists(bucketKV)
		if err != nil {
			return err
		}
		// Puts and deletes of each key's latest value: whatever of it the
		// file holds already, the result is the chain's.
		for k, e := range chain.entries {
			if e.del {
				err = kv.Delete([]byte(k))
			} else {
				err = kv.Put([]byte(k), encode(e.rev, e.value))
			}
			if err != nil {
				return err
			}
		}
		return meta.Put(keyRev, binary.BigEndian.AppendUint64(nil, uint64(chain.seq)))
	})
	if err != nil {
		return fmt.Errorf("checkpoint the old write-ahead log: %w", err)
	}
	s.removeOldLog()
	return nil
}

// removeOldLog removes the old write-ahead log (and the temporary file of
// its creation, if a crash left one) and flushes the directory. Best
// effort: once the counter is in its 8-byte form nothing reads the log, and
// a process that finds it again tries again.
func (s *Store) removeOldLog() {
	logPath := s.path + oldLogSuffix
	gone := true
	for _, p := range []string{logPath, logPath + ".new"} {
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			gone = false
		}
	}
	if syncDir(filepath.Dir(s.path)) == nil && gone {
		s.oldLog = false
	}
}

// lookup returns key's revision and a copy of its value (0 and nil when
// absent).
func lookup(tx *bolt.Tx, key string) (int64, []byte, error) {
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
func check(tx *bolt.Tx, prefix string, conds []store.Cond) error {
	for _, c := range conds {
		if c.IsRange() {
			if k, ok := someKeyIn(tx, prefix+c.Key, prefix+c.End); ok {
				return fmt.Errorf("%w: key %q exists in [%q, %q)", store.ErrConflict, k[len(prefix):], c.Key, c.End)
			}
			continue
		}
		rev, _, err := lookup(tx, prefix+c.Key)
		if err != nil {
			return fmt.Errorf("key %q: %w", c.Key, err)
		}
		if rev != c.Revision {
			return fmt.Errorf("%w: key %q is at revision %d, expected %d", store.ErrConflict, c.Key, rev, c.Revision)
		}
	}
	return nil
}

// someKeyIn returns the first key k with lo <= k < hi, if there is one.
func someKeyIn(tx *bolt.Tx, lo, hi string) (string, bool) {
	b := tx.Bucket(bucketKV)
	if b == nil {
		return "", false
	}
	k, _ := b.Cursor().Seek([]byte(lo))
	if k != nil && string(k) < hi {
		return string(k), true
	}
	return "", false
}

// close lets go of the file's lock and closes it.
func (sess *session) close() {
	// A failing close cannot undo what was read or durably committed, so
	// it is not reported.
	_ = sess.db.close()
}

// with takes the in-process lock and runs fn on a session: the held one,
// or one opened for the call and closed after it. A commit ends the
// session, held or not. A read of a file that does not exist yet runs
// nothing: nothing was ever committed, every key is absent.
func (s *Store) with(ctx context.Context, readOnly bool, fn func(*session) error) error {
	deadline, err := s.enter(ctx)
	if err != nil {
		return err
	}
	defer func() { <-s.sem }()
	sess, err := s.session(ctx, readOnly, deadline)
	if err != nil {
		return err
	}
	if sess == nil {
		return ctx.Err()
	}
	err = fn(sess)
	if sess.committed || s.held != sess {
		sess.close()
		if s.held == sess {
			s.held = nil
		}
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
