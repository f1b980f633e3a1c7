// Package local is the embedded, single-host store.Store: one bbolt file on
// the host's disk, no server.
//
// Contract:
//
//   - Crash safety: every Commit is one bbolt read-write transaction, which is
//     fsynced before Commit returns; a crash leaves the file either before or
//     after the commit, never in between.
//   - Many processes: the file is NOT held open between calls. Each Get, Scan
//     and Commit opens the file, takes its flock (shared for reads, exclusive
//     for writes), does its work and closes it again, so short-lived CNI
//     plugin processes and a long-running driver can share one file. The one
//     exception is Hold, which keeps the file open and exclusively locked for
//     the calls of one operation until its release. The lock is waited for
//     until Config.OpenTimeout (or the context's deadline, if earlier); when
//     it cannot be obtained the call fails with an error wrapping
//     store.ErrUnavailable that names the file and says another process holds
//     it. No call can wait forever.
//   - Goroutines: a Store is safe for concurrent use. Calls inside one process
//     are serialised by an in-process lock (with the same deadline), so
//     goroutines do not fight over the flock.
//   - Revisions: a counter in a meta bucket, incremented once per successful
//     Commit; each value is stored together with the revision that wrote it.
//   - Errors: conflicts wrap store.ErrConflict and write nothing; lock
//     timeouts wrap store.ErrUnavailable; other I/O errors (permissions, a
//     corrupt file, a full disk) are returned wrapped with the file's path.
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
	// held is the file kept open by Hold (nil when not held), and holds
	// the number of Holds not yet released; both guarded by sem.
	held  *openDB
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

// Get implements store.Store. All keys are read in one read transaction.
func (s *Store) Get(ctx context.Context, keys ...string) ([]store.KV, error) {
	out, done, err := store.StartGet(ctx, keys)
	if done {
		return out, err
	}
	err = s.view(ctx, func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketKV)
		if b == nil {
			return nil
		}
		for i, k := range keys {
			v := b.Get([]byte(s.prefix + k))
			if v == nil {
				continue
			}
			rev, val, err := decode(v)
			if err != nil {
				return fmt.Errorf("key %q: %w", k, err)
			}
			out[i].Value, out[i].Revision = val, rev
		}
		return nil
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
	err := s.view(ctx, func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketKV)
		if b == nil {
			return nil
		}
		lo, hi := []byte(s.prefix+from), []byte(s.prefix+to)
		c := b.Cursor()
		for k, v := c.Seek(lo); k != nil && bytes.Compare(k, hi) < 0; k, v = c.Next() {
			if limit > 0 && len(out) >= limit {
				break
			}
			rev, val, err := decode(v)
			if err != nil {
				return fmt.Errorf("key %q: %w", k, err)
			}
			out = append(out, store.KV{Key: string(k[len(s.prefix):]), Value: val, Revision: rev})
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// Commit implements store.Store.
func (s *Store) Commit(ctx context.Context, conds []store.Cond, ops []store.Op) error {
	if err := store.CheckCommit(conds, ops); err != nil {
		return fmt.Errorf("local store %s: %w", s.path, err)
	}
	return s.update(ctx, func(tx *bolt.Tx) error {
		kv, err := tx.CreateBucketIfNotExists(bucketKV)
		if err != nil {
			return err
		}
		meta, err := tx.CreateBucketIfNotExists(bucketMeta)
		if err != nil {
			return err
		}
		for _, c := range conds {
			var rev int64
			if v := kv.Get([]byte(s.prefix + c.Key)); v != nil {
				if rev, _, err = decode(v); err != nil {
					return fmt.Errorf("key %q: %w", c.Key, err)
				}
			}
			if rev != c.Revision {
				return fmt.Errorf("%w: key %q is at revision %d, expected %d", store.ErrConflict, c.Key, rev, c.Revision)
			}
		}
		var rev int64
		if v := meta.Get(keyRev); v != nil {
			if len(v) != 8 {
				return fmt.Errorf("corrupt revision counter (%d bytes)", len(v))
			}
			rev = int64(binary.BigEndian.Uint64(v))
		}
		rev++
		if err := meta.Put(keyRev, binary.BigEndian.AppendUint64(nil, uint64(rev))); err != nil {
			return err
		}
		for _, o := range ops {
			k := []byte(s.prefix + o.Key)
			if o.Delete {
				if err := kv.Delete(k); err != nil {
					return err
				}
				continue
			}
			if err := kv.Put(k, encode(rev, o.Value)); err != nil {
				return err
			}
		}
		return nil
	})
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
	return s.view(ctx, func(*bolt.Tx) error { return nil })
}

// Close implements store.Store. The file is held open between calls only
// inside Hold, whose release closes it, so there is nothing to release.
func (s *Store) Close() error { return nil }

// Hold opens the file for writing, under its exclusive lock, and keeps it
// open until release is called: the calls of one operation (the reads, then
// the commit that depends on them) then pay for one open and one lock
// instead of one each. Until release, every Get, Scan and Commit of this
// Store uses the held file, and other processes wait for its lock within
// their own timeouts, as they would for one commit. Holds nest: the file is
// closed when the last one is released.
//
// A file that does not exist yet is not created: Hold then keeps nothing
// and each call opens the file as usual (the first commit creates it).
func (s *Store) Hold(ctx context.Context) (release func(), err error) {
	if _, err := os.Stat(s.path); errors.Is(err, os.ErrNotExist) {
		return func() {}, ctx.Err()
	}
	deadline, err := s.enter(ctx)
	if err != nil {
		return nil, err
	}
	defer func() { <-s.sem }()
	if s.held == nil {
		db, err := s.open(ctx, false, deadline)
		if err != nil {
			return nil, err
		}
		s.held = db
	}
	s.holds++
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
		if s.holds--; s.holds == 0 {
			_ = s.held.close()
			s.held = nil
		}
	}, nil
}

// view runs fn in a read transaction under a shared file lock.
func (s *Store) view(ctx context.Context, fn func(*bolt.Tx) error) error {
	return s.with(ctx, true, func(db *bolt.DB) error { return db.View(fn) })
}

// update runs fn in a read-write transaction under an exclusive file lock.
// The commit that creates the file also fsyncs its directory, so that the
// new file's name survives a crash as its contents do.
func (s *Store) update(ctx context.Context, fn func(*bolt.Tx) error) error {
	return s.with(ctx, false, func(db *bolt.DB) error {
		fresh := false
		if err := db.Update(func(tx *bolt.Tx) error {
			fresh = tx.Bucket(bucketMeta) == nil
			return fn(tx)
		}); err != nil {
			return err
		}
		if fresh {
			// Best effort: the commit itself is durable and applied, so a
			// failure here must not be reported as a failed commit.
			_ = syncDir(filepath.Dir(s.path))
		}
		return nil
	})
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

// with takes the in-process lock, opens the file (read-only with a shared
// flock, or read-write with an exclusive one), runs fn and closes the file;
// inside a Hold it runs fn on the held file. A read of a file that does not
// exist yet runs nothing: nothing was ever committed, every key is absent.
func (s *Store) with(ctx context.Context, readOnly bool, fn func(*bolt.DB) error) error {
	deadline, err := s.enter(ctx)
	if err != nil {
		return err
	}
	defer func() { <-s.sem }()
	if s.held != nil {
		return s.run(s.held.DB, fn)
	}
	if readOnly {
		if _, err := os.Stat(s.path); errors.Is(err, os.ErrNotExist) {
			return ctx.Err()
		}
	}

	db, err := s.open(ctx, readOnly, deadline)
	if err != nil && readOnly && !errors.Is(err, store.ErrUnavailable) && ctx.Err() == nil {
		// A read-only open fails on a file that a writer created but has
		// not initialised yet; a read-write open initialises it.
		db, err = s.open(ctx, false, deadline)
	}
	if err != nil {
		return err
	}
	// A failing close cannot undo what fn read or durably committed, so it
	// must not turn a successful call into a reported failure.
	defer func() { _ = db.close() }()
	return s.run(db.DB, fn)
}

// run calls fn on db and wraps its error with the file's path.
func (s *Store) run(db *bolt.DB, fn func(*bolt.DB) error) error {
	if err := fn(db); err != nil {
		if errors.Is(err, store.ErrConflict) {
			return err
		}
		return fmt.Errorf("local store %s: %w", s.path, err)
	}
	return nil
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
