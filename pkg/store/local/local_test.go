package local_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/local"
	"github.com/ringipam/ringipam/pkg/store/storetest"
)

func newAt(t testing.TB, path string) *local.Store {
	t.Helper()
	s, err := local.New(local.Config{Path: path, OpenTimeout: 30 * time.Second})
	if err != nil {
		t.Fatalf("local.New: %v", err)
	}
	return s
}

func TestContract(t *testing.T) {
	storetest.Run(t,
		func(t *testing.T) store.Store { return newAt(t, filepath.Join(t.TempDir(), "store.db")) },
		storetest.Persistent(func(t *testing.T) func(t *testing.T) store.Store {
			path := filepath.Join(t.TempDir(), "sub", "dir", "store.db")
			return func(t *testing.T) store.Store { return newAt(t, path) }
		}))
}

// A prefix keeps two installations in one file apart.
func TestContractWithPrefix(t *testing.T) {
	storetest.Run(t, func(t *testing.T) store.Store {
		path := filepath.Join(t.TempDir(), "store.db")
		other, err := local.New(local.Config{Path: path, Prefix: "other/"})
		if err != nil {
			t.Fatal(err)
		}
		// Keys of another prefix sort before and after ours.
		ctx := context.Background()
		if err := other.Commit(ctx, nil, []store.Op{store.Put("a", []byte("x")), store.Put("\xff", []byte("x"))}); err != nil {
			t.Fatal(err)
		}
		s, err := local.New(local.Config{Path: path, Prefix: "p/"})
		if err != nil {
			t.Fatal(err)
		}
		return s
	})
}

func TestDirectoryCreatedPrivate(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "a", "b")
	s := newAt(t, filepath.Join(dir, "store.db"))
	fi, err := os.Stat(dir)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o700 {
		t.Errorf("directory mode %v, want 0700", fi.Mode().Perm())
	}
	if err := s.Commit(context.Background(), nil, []store.Op{store.Put("k", []byte("v"))}); err != nil {
		t.Fatal(err)
	}
	fi, err = os.Stat(s.Path())
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Errorf("file mode %v, want 0600", fi.Mode().Perm())
	}
}

// A process that holds the file (here: bbolt opened directly, as a stuck
// process would) makes calls fail with ErrUnavailable naming the file, and
// they succeed again once it lets go.
func TestLockHeldElsewhereIsUnavailable(t *testing.T) {
	path := filepath.Join(t.TempDir(), "store.db")
	s, err := local.New(local.Config{Path: path, OpenTimeout: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := s.Commit(ctx, nil, []store.Op{store.Put("k", []byte("v"))}); err != nil {
		t.Fatal(err)
	}
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	calls := map[string]func() error{
		"Commit": func() error { return s.Commit(ctx, nil, []store.Op{store.Put("k", []byte("w"))}) },
		"Get":    func() error { _, err := s.Get(ctx, "k"); return err },
		"Scan":   func() error { _, err := s.Scan(ctx, "", "\xff", 0); return err },
		"Ping":   func() error { return s.Ping(ctx) },
	}
	for name, call := range calls {
		err := call()
		if !errors.Is(err, store.ErrUnavailable) {
			t.Errorf("%s while locked: err = %v, want ErrUnavailable", name, err)
			continue
		}
		if !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), "another process") {
			t.Errorf("%s error %q does not name the file and the other process", name, err)
		}
	}
	// The caller's deadline also bounds the wait.
	dctx, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
	defer cancel()
	slow, err := local.New(local.Config{Path: path, OpenTimeout: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := slow.Get(dctx, "k"); err == nil {
		t.Errorf("Get with a short ctx deadline succeeded while the file was locked")
	}
	if err := db.Close(); err != nil {
		t.Fatal(err)
	}
	kvs, err := s.Get(ctx, "k")
	if err != nil || string(kvs[0].Value) != "v" {
		t.Fatalf("after unlock: %v %v", kvs, err)
	}
}

// Readers share the file: a reader in another handle holding a read-only
// open does not block a Get.
func TestReadersShare(t *testing.T) {
	path := filepath.Join(t.TempDir(), "store.db")
	s, err := local.New(local.Config{Path: path, OpenTimeout: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := s.Commit(ctx, nil, []store.Op{store.Put("k", []byte("v"))}); err != nil {
		t.Fatal(err)
	}
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: 10 * time.Second, ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if _, err := s.Get(ctx, "k"); err != nil {
		t.Fatalf("Get beside a reader: %v", err)
	}
	if err := s.Commit(ctx, nil, []store.Op{store.Put("k", []byte("w"))}); !errors.Is(err, store.ErrUnavailable) {
		t.Fatalf("Commit beside a reader: err = %v, want ErrUnavailable", err)
	}
}

func TestConfigErrors(t *testing.T) {
	if _, err := local.New(local.Config{Path: filepath.Join(t.TempDir(), "x.db"), OpenTimeout: -time.Second}); err == nil {
		t.Error("negative timeout accepted")
	}
	file := filepath.Join(t.TempDir(), "file")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := local.New(local.Config{Path: filepath.Join(file, "store.db")}); err == nil {
		t.Error("directory under a regular file accepted")
	}
	// A file that is not a bbolt database is an error, not "absent".
	junk := filepath.Join(t.TempDir(), "junk.db")
	if err := os.WriteFile(junk, []byte(strings.Repeat("not bolt ", 1000)), 0o600); err != nil {
		t.Fatal(err)
	}
	s := newAt(t, junk)
	if _, err := s.Get(context.Background(), "k"); err == nil || errors.Is(err, store.ErrUnavailable) {
		t.Errorf("Get on a corrupt file: err = %v, want a plain error", err)
	}
}

// Several processes (this test binary re-executed) and this process commit
// compare-and-swap increments to one file at once; none may be lost.
const (
	childEnv  = "RINGIPAM_LOCAL_CHILD_PATH"
	procs     = 4
	perProc   = 40
	inProcess = 40
)

func TestMultiProcessIncrements(t *testing.T) {
	if path := os.Getenv(childEnv); path != "" {
		childIncrement(t, path)
		return
	}
	path := filepath.Join(t.TempDir(), "store.db")
	type result struct {
		n   int
		err error
	}
	results := make(chan result, procs+1)
	var wg sync.WaitGroup
	for range procs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestMultiProcessIncrements$", "-test.v")
			cmd.Env = append(os.Environ(), childEnv+"="+path)
			out, err := cmd.CombinedOutput()
			if err != nil {
				results <- result{err: fmt.Errorf("child: %w\n%s", err, out)}
				return
			}
			sc := bufio.NewScanner(strings.NewReader(string(out)))
			for sc.Scan() {
				if v, ok := strings.CutPrefix(strings.TrimSpace(sc.Text()), "CHILD-DONE "); ok {
					n, err := strconv.Atoi(v)
					results <- result{n: n, err: err}
					return
				}
			}
			results <- result{err: fmt.Errorf("child printed no count:\n%s", out)}
		}()
	}
	// This process plays the long-running driver on the same file.
	wg.Add(1)
	go func() {
		defer wg.Done()
		s := newAt(t, path)
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		n := 0
		for range inProcess {
			if _, err := storetest.Increment(ctx, s, "counter"); err != nil {
				results <- result{n: n, err: err}
				return
			}
			n++
		}
		results <- result{n: n}
	}()
	wg.Wait()
	close(results)
	total := 0
	for r := range results {
		if r.err != nil {
			t.Error(r.err)
		}
		total += r.n
	}
	if t.Failed() {
		return
	}
	kvs, err := newAt(t, path).Get(context.Background(), "counter")
	if err != nil {
		t.Fatal(err)
	}
	if got := string(kvs[0].Value); got != strconv.Itoa(total) || total != procs*perProc+inProcess {
		t.Fatalf("counter = %s after %d reported increments, want %d", got, total, procs*perProc+inProcess)
	}
}

func childIncrement(t *testing.T, path string) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	n := 0
	for range perProc {
		// A new Store per increment, as a CNI plugin process would have.
		if _, err := storetest.Increment(ctx, newAt(t, path), "counter"); err != nil {
			t.Fatalf("increment %d: %v", n, err)
		}
		n++
	}
	fmt.Printf("CHILD-DONE %d\n", n)
}

func BenchmarkCommit(b *testing.B) {
	storetest.BenchmarkCommit(b, newAt(b, filepath.Join(b.TempDir(), "store.db")))
}

func BenchmarkGetCommit(b *testing.B) {
	storetest.BenchmarkGetCommit(b, newAt(b, filepath.Join(b.TempDir(), "store.db")))
}

func BenchmarkGet(b *testing.B) {
	s := newAt(b, filepath.Join(b.TempDir(), "store.db"))
	ctx := context.Background()
	if err := s.Commit(ctx, nil, []store.Op{store.Put("k", []byte("v"))}); err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		if _, err := s.Get(ctx, "k"); err != nil {
			b.Fatal(err)
		}
	}
}

// Hold keeps the file open and locked for this Store's calls until the last
// release or a commit: other processes (another Store on the same file)
// wait for it as for one commit, see what the commit wrote once it
// returns, and wait again while a call under the same hold holds the file
// anew.
func TestHold(t *testing.T) {
	path := filepath.Join(t.TempDir(), "store.db")
	ctx := context.Background()
	s := newAt(t, path)
	other, err := local.New(local.Config{Path: path, OpenTimeout: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	// No file yet: nothing to hold, and the first commit still creates it.
	release, err := s.Hold(ctx)
	if err != nil {
		t.Fatalf("Hold before the file exists: %v", err)
	}
	if err := s.Commit(ctx, nil, []store.Op{store.Put("k", []byte("v1"))}); err != nil {
		t.Fatal(err)
	}
	release()
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("first commit under an empty hold: %v", err)
	}

	outer, err := s.Hold(ctx)
	if err != nil {
		t.Fatal(err)
	}
	inner, err := s.Hold(ctx)
	if err != nil {
		t.Fatal(err)
	}
	kvs, err := s.Get(ctx, "k")
	if err != nil || string(kvs[0].Value) != "v1" {
		t.Fatalf("Get under the hold: %v %v", kvs, err)
	}
	if _, err := other.Get(ctx, "k"); !errors.Is(err, store.ErrUnavailable) {
		t.Fatalf("another Store's Get while held: %v, want ErrUnavailable", err)
	}
	if err := s.Commit(ctx, []store.Cond{store.Unchanged(kvs[0])}, []store.Op{store.Put("k", []byte("v2"))}); err != nil {
		t.Fatalf("Commit under the hold: %v", err)
	}
	kvs, err = other.Get(ctx, "k")
	if err != nil || string(kvs[0].Value) != "v2" {
		t.Fatalf("another Store's Get after the commit under the hold: %v %v, want v2", kvs, err)
	}
	if kvs, err := s.Get(ctx, "k"); err != nil || string(kvs[0].Value) != "v2" {
		t.Fatalf("Get under the hold after its commit: %v %v, want v2", kvs, err)
	}
	if _, err := other.Get(ctx, "k"); !errors.Is(err, store.ErrUnavailable) {
		t.Fatalf("another Store's Get once a call under the hold holds the file again: %v, want ErrUnavailable", err)
	}
	inner()
	inner() // a second call of one release does nothing
	if _, err := other.Get(ctx, "k"); !errors.Is(err, store.ErrUnavailable) {
		t.Fatalf("another Store's Get while the outer hold remains: %v, want ErrUnavailable", err)
	}
	outer()
	kvs, err = other.Get(ctx, "k")
	if err != nil || string(kvs[0].Value) != "v2" {
		t.Fatalf("another Store's Get after the last release: %v %v, want v2", kvs, err)
	}
}

// Processes killed (SIGKILL) in the middle of their commits leave a file
// that every later process reads and commits to: the counter holds every
// increment a killed process had reported done, and at most the one each
// was in.
func TestKilledWriters(t *testing.T) {
	if path := os.Getenv(killChildEnv); path != "" {
		childPaddedIncrements(t, path)
		return
	}
	path := filepath.Join(t.TempDir(), "store.db")
	const rounds, writers = 3, 4
	acked, killed := 0, 0
	for round := range rounds {
		var mu sync.Mutex
		var wg sync.WaitGroup
		for w := range writers {
			cmd := exec.Command(os.Args[0], "-test.run=^TestKilledWriters$")
			cmd.Env = append(os.Environ(), killChildEnv+"="+path)
			out, err := cmd.StdoutPipe()
			if err != nil {
				t.Fatal(err)
			}
			cmd.Stderr = os.Stderr
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			// Each writer is killed only after it has acknowledged
			// ackedBeforeKill increments (so that the writers overlap
			// whatever the machine's speed), a few milliseconds later,
			// wherever its next commit then is; one that never gets
			// there is killed at the deadline and the test fails.
			gotThere := make(chan struct{})
			wg.Add(1)
			go func() {
				defer wg.Done()
				sc := bufio.NewScanner(out)
				mine := 0
				for sc.Scan() {
					if sc.Text() == "ACK" {
						mu.Lock()
						acked++
						mu.Unlock()
						if mine++; mine == ackedBeforeKill {
							close(gotThere)
						}
					}
				}
			}()
			go func() {
				select {
				case <-gotThere:
					time.Sleep(time.Duration(5*w+3*round) * time.Millisecond)
				case <-time.After(2 * time.Minute):
				}
				_ = cmd.Process.Kill()
			}()
			defer func() { _ = cmd.Wait() }()
		}
		wg.Wait()
		killed += writers
	}
	s := newAt(t, path)
	ctx := context.Background()
	n, _, err := storetest.IncrementPadded(ctx, s, "counter", paddingForTest)
	if err != nil {
		t.Fatalf("increment after the kills: %v", err)
	}
	n-- // the increment just made
	if n < acked || n > acked+killed {
		t.Fatalf("counter %d after %d acknowledged increments and %d kills", n, acked, killed)
	}
	if acked < rounds*writers*ackedBeforeKill {
		t.Fatalf("only %d increments acknowledged (test premise: %d)", acked, rounds*writers*ackedBeforeKill)
	}
	t.Logf("%d increments acknowledged, counter %d, %d writers killed", acked, n, killed)
}

const (
	killChildEnv   = "RINGIPAM_LOCAL_KILL_CHILD_PATH"
	paddingForTest = 2000
	// ackedBeforeKill: increments each of TestKilledWriters' 12 writers
	// acknowledges before it is killed.
	ackedBeforeKill = 5
)

// childPaddedIncrements increments until it is killed, printing ACK after
// each increment that returned.
func childPaddedIncrements(t *testing.T, path string) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for {
		// A new Store per increment, as a CNI plugin process would have.
		if _, _, err := storetest.IncrementPadded(ctx, newAt(t, path), "counter", paddingForTest); err != nil {
			t.Fatalf("increment: %v", err)
		}
		fmt.Println("ACK")
	}
}
