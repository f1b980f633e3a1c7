// Package hostlock serialises work across the processes of one host with
// flock(2) lock files, always with a deadline.
//
// Short-lived CNI plugin processes that allocate in the same pool on the same
// host would otherwise all compute the same next address and conflict in the
// store; queueing them on a lock file is cheaper than retrying. A lock is
// held by an open file description, so it also serialises goroutines of one
// process that each call Lock. Locks vanish when the holder exits, so a
// crashed process never leaves a stale lock behind.
//
// The zero Dir is not usable; an empty directory name is an error.
package hostlock

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

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
	if d == "" {
		return nil, errors.New("hostlock: no lock directory")
	}
	if name == "" || strings.ContainsAny(name, "/\x00") {
		return nil, fmt.Errorf("hostlock: bad lock name %q", name)
	}
	if err := os.MkdirAll(string(d), 0o700); err != nil {
		return nil, fmt.Errorf("hostlock: %w", err)
	}
	path := filepath.Join(string(d), name+".lock")
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("hostlock: %w", err)
	}
	wait := 200 * time.Microsecond
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			return func() {
				_ = unix.Flock(int(f.Fd()), unix.LOCK_UN)
				_ = f.Close()
			}, nil
		}
		if !errors.Is(err, unix.EWOULDBLOCK) && !errors.Is(err, unix.EINTR) {
			_ = f.Close()
			return nil, fmt.Errorf("hostlock: flock %s: %w", path, err)
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			_ = f.Close()
			return nil, fmt.Errorf("%w %s: %w", ErrTimeout, path, ctx.Err())
		case <-t.C:
		}
		if wait < 5*time.Millisecond {
			wait *= 2
		}
	}
}
