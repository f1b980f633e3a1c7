// Package hostlock serialises work across the processes of one host with
// flock(2) lock files, always with a deadline.
//
// Short-lived CNI plugin processes that allocate in the same pool on the same
// host would otherwise all compute the same next address and conflict in the
// store; queueing them on a lock file is cheaper than retrying. A lock is
// held by an open file description, so it also serialises goroutines of one
// process that each call Lock. Locks vanish when the holder exits (with
// LockWithChildren: once the children it started meanwhile have exited
// too), so a crashed process never leaves a stale lock behind. A lock file
// named after something that ends (an attachment) can be removed by its
// holder (Discard) or, when no one holds it, by anyone (Sweep): every lock
// taken is checked against the file at its path, and a waiter that locked
// a file removed meanwhile locks the new one instead. Beside each
// lock a note may be kept (ReadNote, WriteNote) for the lock's next holder:
// a hint that is never synced and that its reader must validate.
//
// The zero Dir is not usable; an empty directory name is an error.
package hostlock

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// ErrTimeout is wrapped by Lock's error when ctx ended before the lock was free.
var ErrTimeout = errors.New("hostlock: timed out waiting for lock")

// Dir is a directory of lock files, one per name.
type Dir string

// DefaultDir is where ringipam keeps its lock files.
const DefaultDir Dir = "/run/ringipam/locks"

// Lock takes the exclusive lock called name, waiting until ctx ends, and
// returns the function that releases it.
func (d Dir) Lock(ctx context.Context, name string) (func(), error) {
	return d.lock(ctx, name, true)
}

// LockWithChildren is Lock for work that child processes finish: the lock
// file's descriptor is inherited by every process the caller starts while
// it holds the lock, so that if the caller is killed (a runtime's timeout)
// the lock stays held until those children have exited too. The next
// holder then finds their work done, not under way (portmap-ingress: a
// killed ADD's nft transaction lands before the DEL that follows it, not
// after). Meant for short-lived processes that start no other children
// meanwhile; the release function ends the lock for the children too.
func (d Dir) LockWithChildren(ctx context.Context, name string) (func(), error) {
	return d.lock(ctx, name, false)
}

func (d Dir) lock(ctx context.Context, name string, closeOnExec bool) (func(), error) {
	if d == "" {
		return nil, errors.New("hostlock: no lock directory")
	}
	if !validName(name) {
		return nil, fmt.Errorf("hostlock: bad lock name %q", name)
	}
	if err := os.MkdirAll(string(d), 0o700); err != nil {
		return nil, fmt.Errorf("hostlock: %w", err)
	}
	path := filepath.Join(string(d), name+".lock")
	flag := os.O_RDWR | os.O_CREATE
	if closeOnExec {
		flag |= unix.O_CLOEXEC
	}
	for {
		f, err := openFile(path, flag, 0o600)
		if err != nil {
			return nil, fmt.Errorf("hostlock: %w", err)
		}
		if err := Flock(ctx, f, unix.LOCK_EX); err != nil {
			_ = f.Close()
			if ctx.Err() != nil {
				return nil, fmt.Errorf("%w %s: %w", ErrTimeout, path, err)
			}
			return nil, fmt.Errorf("hostlock: flock %s: %w", path, err)
		}
		if current(f, path) {
			return func() {
				_ = unix.Flock(int(f.Fd()), unix.LOCK_UN)
				_ = f.Close()
			}, nil
		}
		// The holder we waited for removed the file (Discard, Sweep):
		// the lock is now the file at path, a new one.
		_ = f.Close()
		if err := ctx.Err(); err != nil {
			return nil, fmt.Errorf("%w %s: %w", ErrTimeout, path, err)
		}
	}
}

// current reports whether f is still the file at path: a lock taken on a
// file that was removed meanwhile locks nothing anyone else will take.
func current(f *os.File, path string) bool {
	var held, named unix.Stat_t
	if unix.Fstat(int(f.Fd()), &held) != nil || unix.Stat(path, &named) != nil {
		return false
	}
	return held.Dev == named.Dev && held.Ino == named.Ino
}

// Discard removes the lock file called name: for a lock that names
// something that is gone (a released attachment), so that its files do
// not pile up. Call it only while holding the lock, before its release:
// whoever waits for it then finds the file gone and locks a new one.
// The lock's note, if any, is removed too. A file already gone is not an
// error.
func (d Dir) Discard(name string) error {
	if d == "" || !validName(name) {
		return fmt.Errorf("hostlock: bad lock name %q", name)
	}
	_ = os.Remove(filepath.Join(string(d), name+".note"))
	if err := os.Remove(filepath.Join(string(d), name+".lock")); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("hostlock: %w", err)
	}
	return nil
}

// Sweep removes the lock files whose names begin with prefix and that no
// process holds, with their notes: locks left by work that ended without
// Discard (a holder killed, a name never taken again). A held lock is
// left alone, and a lock file removed here is simply made again by its
// next holder, so Sweep is safe at any time. It stops when ctx ends and
// returns how many it removed.
func (d Dir) Sweep(ctx context.Context, prefix string) (int, error) {
	if d == "" || (prefix != "" && !validName(prefix)) {
		return 0, fmt.Errorf("hostlock: bad prefix %q", prefix)
	}
	entries, err := os.ReadDir(string(d))
	if errors.Is(err, os.ErrNotExist) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("hostlock: %w", err)
	}
	removed := 0
	for _, e := range entries {
		if err := ctx.Err(); err != nil {
			return removed, err
		}
		name, ok := strings.CutSuffix(e.Name(), ".lock")
		if !ok || !strings.HasPrefix(name, prefix) || !validName(name) {
			continue
		}
		if d.discardIfFree(name) {
			removed++
		}
	}
	return removed, nil
}

// discardIfFree removes lock name if no one holds it, under its lock.
func (d Dir) discardIfFree(name string) bool {
	path := filepath.Join(string(d), name+".lock")
	f, err := openFile(path, os.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return false
	}
	defer f.Close()
	if unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB) != nil {
		return false // held (or briefly contended): its holder's
	}
	defer unix.Flock(int(f.Fd()), unix.LOCK_UN)
	// Only the file at path, which a new holder may have made meanwhile
	// and then locked, is ours to remove if it is the one locked here.
	return current(f, path) && d.Discard(name) == nil
}

// OpenFile opens name like os.OpenFile, for a file to be locked with Flock
// and read or written in place: a plain descriptor whose calls block in the
// kernel, never seen by the Go runtime's poller. A regular file cannot be
// polled anyway; os.OpenFile still tries (setting the poller up on its first
// use in a process, then a refused registration and two flag changes per
// file), a dozen system calls that a short-lived plugin pays for nothing.
func OpenFile(name string, flag int, perm os.FileMode) (*os.File, error) {
	return openFile(name, flag|unix.O_CLOEXEC, perm)
}

// openFile is OpenFile with the flags as given (close-on-exec only when
// flag says so).
func openFile(name string, flag int, perm os.FileMode) (*os.File, error) {
	for {
		fd, err := unix.Open(name, flag, uint32(perm.Perm()))
		switch {
		case err == unix.EINTR:
			continue
		case err != nil:
			return nil, &os.PathError{Op: "open", Path: name, Err: err}
		}
		return os.NewFile(uintptr(fd), name), nil
	}
}

// Flock takes the flock(2) lock how (unix.LOCK_EX or unix.LOCK_SH) on f,
// waiting until it is granted or ctx ends, and returns ctx's error in the
// latter case.
//
// The wait is the kernel's: a blocked flock wakes the moment the holder lets
// go, where polling would leave the lock idle for the rest of a sleep. It
// happens on a goroutine of its own, so that the caller's wait still ends
// with ctx. After an error the caller must close f: should the kernel grant
// the abandoned request later, the lock belongs to f's open file description
// and is dropped when the last descriptor of it is closed, so nothing stays
// locked.
func Flock(ctx context.Context, f *os.File, how int) error {
	fd := int(f.Fd())
	err := unix.Flock(fd, how|unix.LOCK_NB)
	if err == nil {
		return nil
	}
	if !errors.Is(err, unix.EWOULDBLOCK) && !errors.Is(err, unix.EINTR) {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	// The waiter works on a duplicate of the descriptor (the same open file
	// description, so the lock it gets is f's) and closes it itself: the
	// caller may close f, and its number be reused, while the waiter still
	// sleeps in the kernel or has not entered it yet.
	dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("duplicate descriptor: %w", err)
	}
	granted := make(chan error, 1) // buffered: an abandoned waiter must not block
	go func() {
		defer unix.Close(dup)
		for {
			err := unix.Flock(dup, how)
			if !errors.Is(err, unix.EINTR) {
				granted <- err
				return
			}
		}
	}()
	select {
	case err := <-granted:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// validName reports whether name can name a file in the directory: not
// empty, no '/' and no NUL.
func validName(name string) bool { return name != "" && !strings.ContainsAny(name, "/\x00") }

// maxNote bounds what ReadNote reads: a note is a small record, and a file
// larger than this is not one.
const maxNote = 4 << 20

// ReadNote returns the note called name kept in d by WriteNote, or nil when
// there is none (or it cannot be read, or is larger than 4 MiB).
func (d Dir) ReadNote(name string) []byte {
	if d == "" || !validName(name) {
		return nil
	}
	f, err := openFile(filepath.Join(string(d), name+".note"), os.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxNote+1))
	if err != nil || len(b) > maxNote {
		return nil
	}
	return b
}

// WriteNote keeps note under name in d, beside the lock of the same name,
// for that lock's next holder: only the holder of a lock should read or
// write its note. A note is a hint: it is not synced, a failure to write
// it is ignored, and a note cut short or mixed with its predecessor by a
// crash must be recognisable as such by its reader.
//
// The note is written over the old one in place and the file then cut to
// its length, never truncated to nothing first: on ext4 (a /run that is
// not a tmpfs) a file truncated to zero and written again is flushed to
// the disk when closed, which would cost every call a disk write.
func (d Dir) WriteNote(name string, note []byte) {
	if d == "" || !validName(name) {
		return
	}
	f, err := openFile(filepath.Join(string(d), name+".note"), os.O_WRONLY|os.O_CREATE|unix.O_CLOEXEC, 0o600)
	if errors.Is(err, os.ErrNotExist) && os.MkdirAll(string(d), 0o700) == nil {
		f, err = openFile(filepath.Join(string(d), name+".note"), os.O_WRONLY|os.O_CREATE|unix.O_CLOEXEC, 0o600)
	}
	if err != nil {
		return
	}
	defer f.Close()
	if _, err := f.WriteAt(note, 0); err == nil {
		_ = f.Truncate(int64(len(note)))
	}
}
