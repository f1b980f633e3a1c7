package hostlock

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

	"golang.org/x/sys/unix"
)

func TestLockIsExclusiveAndHasADeadline(t *testing.T) {
	d := Dir(t.TempDir())
	unlock, err := d.Lock(context.Background(), "p")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if _, err := d.Lock(ctx, "p"); !errors.Is(err, ErrTimeout) {
		t.Fatalf("second lock while held: %v, want ErrTimeout", err)
	}
	other, err := d.Lock(context.Background(), "q")
	if err != nil {
		t.Fatalf("a different name must not wait: %v", err)
	}
	other()
	unlock()
	again, err := d.Lock(context.Background(), "p")
	if err != nil {
		t.Fatalf("lock after release: %v", err)
	}
	again()
}

func TestLockSerialises(t *testing.T) {
	d := Dir(t.TempDir())
	var mu sync.Mutex
	inside, maxInside := 0, 0
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 20 {
				unlock, err := d.Lock(context.Background(), "p")
				if err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				inside++
				maxInside = max(maxInside, inside)
				mu.Unlock()
				time.Sleep(50 * time.Microsecond)
				mu.Lock()
				inside--
				mu.Unlock()
				unlock()
			}
		}()
	}
	wg.Wait()
	if maxInside != 1 {
		t.Fatalf("%d holders at once", maxInside)
	}
}

func TestBadNames(t *testing.T) {
	if _, err := Dir("").Lock(context.Background(), "p"); err == nil {
		t.Fatal("empty dir accepted")
	}
	if _, err := Dir(t.TempDir()).Lock(context.Background(), "a/b"); err == nil {
		t.Fatal("name with / accepted")
	}
}

// A waiter that gave up must leave nothing locked: its request may still
// be granted by the kernel after the holder lets go, and the lock must then
// go away with the closed file rather than block the next taker.
func TestAbandonedWaitLeavesNoLock(t *testing.T) {
	d := Dir(t.TempDir())
	unlock, err := d.Lock(context.Background(), "p")
	if err != nil {
		t.Fatal(err)
	}
	for range 5 {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Millisecond)
		_, err := d.Lock(ctx, "p")
		cancel()
		if !errors.Is(err, ErrTimeout) {
			t.Fatalf("lock while held: %v, want ErrTimeout", err)
		}
	}
	unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	again, err := d.Lock(ctx, "p")
	if err != nil {
		t.Fatalf("lock after the holder and five abandoned waiters: %v", err)
	}
	again()
}

func TestFlockSharedAndExclusive(t *testing.T) {
	path := filepath.Join(t.TempDir(), "f")
	open := func() *os.File {
		f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		return f
	}
	ctx, stop := context.WithTimeout(context.Background(), 10*time.Second)
	defer stop()
	a, b, c := open(), open(), open()
	if err := Flock(ctx, a, unix.LOCK_SH); err != nil {
		t.Fatal(err)
	}
	if err := Flock(ctx, b, unix.LOCK_SH); err != nil {
		t.Fatalf("second shared lock: %v", err)
	}
	short, cancel := context.WithTimeout(ctx, 5*time.Millisecond)
	defer cancel()
	if err := Flock(short, c, unix.LOCK_EX); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("exclusive lock under two shared ones: %v, want the deadline", err)
	}
	c.Close()
	c = open()
	done := make(chan error, 1)
	go func() { done <- Flock(ctx, c, unix.LOCK_EX) }()
	_ = unix.Flock(int(a.Fd()), unix.LOCK_UN)
	_ = unix.Flock(int(b.Fd()), unix.LOCK_UN)
	if err := <-done; err != nil {
		t.Fatalf("exclusive lock once the shared ones are gone: %v", err)
	}
}

// OpenFile opens like os.OpenFile (created with the mode asked, errors
// that errors.Is sees as os.ErrNotExist), close-on-exec, and the file
// reads and writes in place.
func TestOpenFile(t *testing.T) {
	dir := t.TempDir()
	if _, err := OpenFile(filepath.Join(dir, "missing"), os.O_RDWR, 0); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("opening a missing file: %v, want os.ErrNotExist", err)
	}
	path := filepath.Join(dir, "f")
	f, err := OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	st, err := os.Stat(path)
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("created file: %v %v, want mode 0600", st.Mode(), err)
	}
	flags, err := unix.FcntlInt(f.Fd(), unix.F_GETFD, 0)
	if err != nil || flags&unix.FD_CLOEXEC == 0 {
		t.Fatalf("descriptor flags %#x (%v): not close-on-exec", flags, err)
	}
	if _, err := f.WriteAt([]byte("ringipam"), 4); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 8)
	if _, err := f.ReadAt(got, 4); err != nil || string(got) != "ringipam" {
		t.Fatalf("read back %q (%v)", got, err)
	}
}

// The holder side of TestLockWithChildrenOutlivesAKilledHolder, run in a
// process of its own: take the lock "x" in the directory given, start a
// child that sleeps, print the child's pid, and wait to be killed.
func holdLockAndStartChild(dir string, withChildren bool) {
	lock := Dir(dir).Lock
	if withChildren {
		lock = Dir(dir).LockWithChildren
	}
	if _, err := lock(context.Background(), "x"); err != nil {
		fmt.Println("error", err)
		os.Exit(1)
	}
	child := exec.Command("sleep", "60")
	if err := child.Start(); err != nil {
		fmt.Println("error", err)
		os.Exit(1)
	}
	fmt.Println(child.Process.Pid)
	time.Sleep(time.Minute)
	os.Exit(0)
}

// A holder killed while a child it started runs: with LockWithChildren the
// lock stays held until the child exits; with Lock it goes with the holder.
func TestLockWithChildrenOutlivesAKilledHolder(t *testing.T) {
	if dir := os.Getenv("HOSTLOCK_TEST_HOLDER_DIR"); dir != "" {
		holdLockAndStartChild(dir, os.Getenv("HOSTLOCK_TEST_WITH_CHILDREN") == "1")
		return
	}
	for _, withChildren := range []bool{true, false} {
		t.Run(fmt.Sprintf("withChildren=%v", withChildren), func(t *testing.T) {
			dir := t.TempDir()
			holder := exec.Command(os.Args[0], "-test.run=^TestLockWithChildrenOutlivesAKilledHolder$")
			holder.Env = append(os.Environ(), "HOSTLOCK_TEST_HOLDER_DIR="+dir, fmt.Sprintf("HOSTLOCK_TEST_WITH_CHILDREN=%d", map[bool]int{true: 1}[withChildren]))
			out, err := holder.StdoutPipe()
			if err != nil {
				t.Fatal(err)
			}
			if err := holder.Start(); err != nil {
				t.Fatal(err)
			}
			line, err := bufio.NewReader(out).ReadString('\n')
			pid, perr := strconv.Atoi(strings.TrimSpace(line))
			if err != nil || perr != nil {
				holder.Process.Kill()
				holder.Wait()
				t.Fatalf("holder said %q (%v, %v)", line, err, perr)
			}
			child, _ := os.FindProcess(pid)
			defer child.Kill()
			if err := holder.Process.Kill(); err != nil {
				t.Fatal(err)
			}
			holder.Wait()

			ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
			release, err := Dir(dir).Lock(ctx, "x")
			cancel()
			switch {
			case withChildren && err == nil:
				release()
				t.Fatal("the lock was free with the holder's child still running")
			case withChildren && !errors.Is(err, ErrTimeout):
				t.Fatalf("lock while the child runs: %v, want ErrTimeout", err)
			case !withChildren && err != nil:
				t.Fatalf("Lock's lock outlived its killed holder: %v", err)
			case !withChildren:
				release()
				return
			}
			// Once the child is gone, so is the lock.
			if err := child.Kill(); err != nil {
				t.Fatal(err)
			}
			ctx, cancel = context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			release, err = Dir(dir).Lock(ctx, "x")
			if err != nil {
				t.Fatalf("lock after the child was killed: %v", err)
			}
			release()
		})
	}
}

// A note reads back as last written, a shorter one over a longer one
// included (it is written in place, then cut), and is kept beside its
// lock; bad names and missing notes read as nil.
func TestNotes(t *testing.T) {
	d := Dir(filepath.Join(t.TempDir(), "locks")) // created on the first write
	if got := d.ReadNote("p@h"); got != nil {
		t.Fatalf("missing note = %q, want nil", got)
	}
	long := []byte(strings.Repeat("long note ", 100))
	d.WriteNote("p@h", long)
	if got := d.ReadNote("p@h"); string(got) != string(long) {
		t.Fatalf("note = %q, want the long note", got)
	}
	d.WriteNote("p@h", []byte("short"))
	if got := d.ReadNote("p@h"); string(got) != "short" {
		t.Fatalf("note after a shorter one = %q, want %q", got, "short")
	}
	if _, err := os.Stat(filepath.Join(string(d), "p@h.note")); err != nil {
		t.Fatalf("note not beside the locks: %v", err)
	}
	for _, bad := range []string{"", "a/b", "a\x00b"} {
		d.WriteNote(bad, []byte("x"))
		if got := d.ReadNote(bad); got != nil {
			t.Errorf("note %q = %q, want nil", bad, got)
		}
	}
	if got := Dir("").ReadNote("p@h"); got != nil {
		t.Errorf("note in no directory = %q", got)
	}
}

// waitForBlockedFlock waits (at most 10 s) until /proc/locks shows a
// process blocked on a flock of file f.
func waitForBlockedFlock(t *testing.T, f string) {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(f, &st); err != nil {
		t.Fatal(err)
	}
	ino := fmt.Sprintf(":%d ", st.Ino)
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		b, err := os.ReadFile("/proc/locks")
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(string(b), "\n") {
			if strings.Contains(line, "->") && strings.Contains(line, "FLOCK") && strings.Contains(line, ino) {
				return
			}
		}
	}
	t.Fatalf("no process blocked on %s", f)
}

// A holder that discards its lock file hands the lock over cleanly: the
// waiter that had opened the removed file takes the new one, and holds it
// against everyone else.
func TestDiscardHandsOverToWaiter(t *testing.T) {
	d := Dir(t.TempDir())
	ctx := context.Background()
	release, err := d.Lock(ctx, "p")
	if err != nil {
		t.Fatal(err)
	}
	d.WriteNote("p", []byte("hint"))
	path := filepath.Join(string(d), "p.lock")
	got := make(chan func(), 1)
	go func() {
		r, err := d.Lock(ctx, "p")
		if err != nil {
			t.Error(err)
			r = func() {}
		}
		got <- r
	}()
	waitForBlockedFlock(t, path)
	if err := d.Discard("p"); err != nil {
		t.Fatal(err)
	}
	if d.ReadNote("p") != nil {
		t.Error("the discarded lock's note is still there")
	}
	release()
	second := <-got
	defer second()
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("the waiter holds no lock file: %v", err)
	}
	short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	if r, err := d.Lock(short, "p"); !errors.Is(err, ErrTimeout) {
		if err == nil {
			r()
		}
		t.Fatalf("a third Lock while the waiter holds it: %v, want ErrTimeout", err)
	}
	if err := d.Discard("gone"); err != nil {
		t.Errorf("Discard of a lock with no file: %v", err)
	}
	if err := d.Discard("a/b"); err == nil {
		t.Error("Discard of a bad name succeeded")
	}
}

// Sweep removes the free lock files of its prefix, with their notes, and
// leaves held ones and other names alone.
func TestSweep(t *testing.T) {
	d := Dir(t.TempDir())
	ctx := context.Background()
	for _, n := range []string{"a-1", "a-2", "b-1"} {
		r, err := d.Lock(ctx, n)
		if err != nil {
			t.Fatal(err)
		}
		r()
	}
	d.WriteNote("a-2", []byte("x"))
	held, err := d.Lock(ctx, "a-1")
	if err != nil {
		t.Fatal(err)
	}
	defer held()
	n, err := d.Sweep(ctx, "a-")
	if err != nil || n != 1 {
		t.Fatalf("Sweep = %d, %v; want 1 removed", n, err)
	}
	exists := func(f string) bool { _, err := os.Stat(filepath.Join(string(d), f)); return err == nil }
	for f, want := range map[string]bool{"a-1.lock": true, "a-2.lock": false, "a-2.note": false, "b-1.lock": true} {
		if exists(f) != want {
			t.Errorf("%s exists = %v, want %v", f, !want, want)
		}
	}
	short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	if _, err := d.Lock(short, "a-1"); !errors.Is(err, ErrTimeout) {
		t.Errorf("the held lock after Sweep: %v, want ErrTimeout", err)
	}
	if n, err := Dir(filepath.Join(string(d), "none")).Sweep(ctx, "a-"); n != 0 || err != nil {
		t.Errorf("Sweep of a missing directory = %d, %v", n, err)
	}
	if _, err := d.Sweep(ctx, "../x"); err == nil {
		t.Error("Sweep of a prefix with a slash succeeded")
	}
}
