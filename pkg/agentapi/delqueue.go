package agentapi

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/containernetworking/cni/pkg/types"
)

// Bounds of the DEL queue (the count is checked before each new entry
// without a lock, so DELs written at the same moment may pass it by a
// few). A DEL that finds the queue full, or is larger
// than an entry may be, is not queued: it fails with code 11 and says so,
// and the runtime retries it (as it retries any failed DEL). Failing is
// chosen over dropping an entry: a dropped DEL would leak its address
// silently, a failed one is visible and retried. 4096 pods removed while
// the agent is down, each with a configuration of at most 1 MiB, is far
// beyond a host's pod count and keeps the queue within 4 GiB at worst.
const (
	MaxQueued     = 4096
	MaxQueuedSize = 1 << 20
)

// Errors of the DEL queue.
var (
	ErrQueueFull     = errors.New("the DEL queue is full")
	ErrEntryTooLarge = errors.New("the DEL is too large to queue")
)

// staleTemp is how old a temporary file must be for Drain to remove it: a
// younger one may be a Put under way.
const staleTemp = time.Minute

const (
	entrySuffix = ".json"
	tempPrefix  = ".tmp-"
	// FailedDir is the subdirectory of the queue that entries which can
	// never succeed are moved to (see Drain); at most MaxQueued are kept.
	FailedDir = "failed"
)

// deadError marks a queued DEL that can never succeed however often it is
// run: an entry that does not decode, one that is not a DEL, or a DEL the
// plugin's code refused for a reason no retry changes (CNI codes 1, 2, 4,
// 6 and 7: incompatible version, unsupported field, bad environment,
// undecodable or invalid configuration).
type deadError struct{ err error }

func (e *deadError) Error() string { return e.err.Error() }
func (e *deadError) Unwrap() error { return e.err }

// permanentCNICodes are the CNI error codes a retry of the same DEL cannot
// change. 11 (try again later), 5 (I/O) and plugin-specific codes stay
// queued.
var permanentCNICodes = map[uint]bool{
	types.ErrIncompatibleCNIVersion:      true,
	types.ErrUnsupportedField:            true,
	types.ErrInvalidEnvironmentVariables: true,
	types.ErrDecodingFailure:             true,
	types.ErrInvalidNetworkConfig:        true,
}

// DelQueue is a directory of DELs that could not reach the agent (the
// store object's "delQueue", default /var/lib/ringipam/del-queue). The
// zero value is not usable: set Dir.
// Several processes may Put and Drain at once: each entry is written
// whole by rename, and Drain removes an entry only when it still holds
// what Drain ran.
type DelQueue struct {
	Dir string
}

// Key is the name of req's entry: a hash of its plugin, network name,
// container ID and interface name. A repeated DEL of one attachment has
// one key, so it replaces the entry before (DEL is idempotent).
func Key(req *Request) string {
	h := sha256.New()
	for _, s := range []string{req.Plugin, networkName(req.Stdin), req.ContainerID, req.IfName} {
		h.Write([]byte(s))
		h.Write([]byte{0})
	}
	return hex.EncodeToString(h.Sum(nil))
}

// Put queues req (a DEL), stamped with this package's Version: written to a temporary file in the directory
// (created 0700 if missing), fsynced, renamed to its entry's name, and the
// directory fsynced. When Put returns nil the entry survives a crash.
func (q DelQueue) Put(req *Request) error {
	if req.Command != "DEL" {
		return fmt.Errorf("only DEL is queued, not %q", req.Command)
	}
	entry := *req
	entry.Version = Version // the entry is in this writer's protocol
	b, err := json.Marshal(&entry)
	if err != nil {
		return fmt.Errorf("DEL queue %s: %w", q.Dir, err)
	}
	if len(b) > MaxQueuedSize {
		return fmt.Errorf("%w: %d bytes, at most %d (DEL queue %s)", ErrEntryTooLarge, len(b), MaxQueuedSize, q.Dir)
	}
	if err := os.MkdirAll(q.Dir, 0o700); err != nil {
		return fmt.Errorf("DEL queue: %w", err)
	}
	name := filepath.Join(q.Dir, Key(req)+entrySuffix)
	if _, err := os.Lstat(name); errors.Is(err, os.ErrNotExist) {
		names, err := q.entries()
		if err != nil {
			return err
		}
		if len(names) >= MaxQueued {
			return fmt.Errorf("%w: %d DELs wait in %s for the host agent to drain them", ErrQueueFull, len(names), q.Dir)
		}
	}
	f, err := os.CreateTemp(q.Dir, tempPrefix+"*")
	if err != nil {
		return fmt.Errorf("DEL queue: %w", err)
	}
	tmp := f.Name()
	_, err = f.Write(b)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, name)
	}
	if err != nil {
		os.Remove(tmp)
		return fmt.Errorf("DEL queue: %w", err)
	}
	if err := syncDir(q.Dir); err != nil {
		return fmt.Errorf("DEL queue: %w", err)
	}
	return nil
}

// entries lists the queued entries' file names (no temporary files).
func (q DelQueue) entries() ([]string, error) {
	des, err := os.ReadDir(q.Dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("DEL queue: %w", err)
	}
	var names []string
	for _, de := range des {
		if n := de.Name(); de.Type().IsRegular() && strings.HasSuffix(n, entrySuffix) && !strings.HasPrefix(n, tempPrefix) {
			names = append(names, n)
		}
	}
	return names, nil
}

// Len is the number of queued DELs.
func (q DelQueue) Len() (int, error) {
	names, err := q.entries()
	return len(names), err
}

// DrainReport is what one Drain did.
type DrainReport struct {
	// Done: entries run successfully and removed.
	Done int
	// Failed: entries whose run failed or that could not be read; they
	// stay for the next Drain (one of another protocol version stays until
	// an agent of that version drains it). Errs says why, one per entry.
	Failed int
	Errs   []error
	// Dead: entries that can never succeed (undecodable, not a DEL, or
	// refused with a CNI code no retry changes), moved to FailedDir (or
	// removed when it already holds MaxQueued) so that they are not run
	// on every drain forever. DeadErrs says why, one per entry, naming
	// where it went. What such a DEL would have freed is left to the
	// network's CNI GC or to ringctl release.
	Dead     int
	DeadErrs []error
	// TempRemoved: temporary files left by a Put that crashed.
	TempRemoved int
}

// Drain runs every queued DEL through h (each under its own timeout) and
// removes its entry after it succeeded; failed ones stay, but for those
// that can never succeed, which go to FailedDir (DrainReport.Dead). It removes
// temporary files older than a minute (a crashed Put's). It stops early
// when ctx ends. A queue directory that does not exist is empty.
func (q DelQueue) Drain(ctx context.Context, h Handler) (DrainReport, error) {
	var rep DrainReport
	des, err := os.ReadDir(q.Dir)
	if errors.Is(err, os.ErrNotExist) {
		return rep, nil
	}
	if err != nil {
		return rep, fmt.Errorf("DEL queue: %w", err)
	}
	for _, de := range des {
		if ctx.Err() != nil {
			return rep, ctx.Err()
		}
		n := de.Name()
		path := filepath.Join(q.Dir, n)
		if strings.HasPrefix(n, tempPrefix) {
			if info, err := de.Info(); err == nil && time.Since(info.ModTime()) > staleTemp && os.Remove(path) == nil {
				rep.TempRemoved++
			}
			continue
		}
		if !de.Type().IsRegular() || !strings.HasSuffix(n, entrySuffix) {
			continue
		}
		if err := q.runOne(ctx, path, h); err != nil {
			var dead *deadError
			if errors.As(err, &dead) {
				rep.Dead++
				rep.DeadErrs = append(rep.DeadErrs, fmt.Errorf("%s (%s): %w", n, q.bury(path, n), err))
				continue
			}
			rep.Failed++
			rep.Errs = append(rep.Errs, fmt.Errorf("%s: %w", n, err))
			continue
		}
		rep.Done++
	}
	return rep, nil
}

// runOne runs the entry at path and removes it if it succeeded and still
// holds what ran.
func (q DelQueue) runOne(ctx context.Context, path string, h Handler) error {
	b, err := readBounded(path, MaxQueuedSize)
	if errors.Is(err, os.ErrNotExist) {
		return nil // drained by another Drain meanwhile
	}
	if err != nil {
		return err
	}
	var req Request
	if err := json.Unmarshal(b, &req); err != nil {
		return &deadError{fmt.Errorf("undecodable entry: %w", err)}
	}
	if req.Command != "DEL" {
		return &deadError{fmt.Errorf("entry of command %q, not DEL", req.Command)}
	}
	if req.Version != Version {
		return fmt.Errorf("%w: the entry is of agent API v%d, this agent v%d: it stays until an agent of its version drains it", ErrVersion, req.Version, Version)
	}
	cctx, cancel := context.WithTimeout(ctx, req.Timeout())
	a := h.Serve(cctx, &req)
	cancel()
	switch {
	case a.Error != "":
		return fmt.Errorf("%w: %s", ErrRefused, a.Error)
	case a.CNIError != nil && permanentCNICodes[a.CNIError.Code]:
		return &deadError{a.CNIError}
	case a.CNIError != nil:
		return a.CNIError
	}
	// A Put of the same attachment may have replaced the entry since:
	// remove only what ran.
	now, err := readBounded(path, MaxQueuedSize)
	if err != nil || !bytes.Equal(now, b) {
		return nil
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// bury moves a dead entry out of the queue into FailedDir, or removes it
// when FailedDir is full or the move fails, and says which.
func (q DelQueue) bury(path, name string) string {
	dir := filepath.Join(q.Dir, FailedDir)
	if err := os.MkdirAll(dir, 0o700); err == nil {
		if n, err := (DelQueue{Dir: dir}).entries(); err == nil && len(n) < MaxQueued {
			if err := os.Rename(path, filepath.Join(dir, name)); err == nil {
				return "moved to " + filepath.Join(dir, name)
			}
		}
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return "could not be moved or removed: " + err.Error()
	}
	return "removed: " + dir + " is full or cannot be written"
}

// readBounded reads a file of at most limit bytes.
func readBounded(path string, limit int64) ([]byte, error) {
	info, err := os.Lstat(path)
	if err != nil {
		return nil, err
	}
	if info.Size() > limit {
		return nil, fmt.Errorf("%w: %d bytes", ErrEntryTooLarge, info.Size())
	}
	return os.ReadFile(path)
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}
