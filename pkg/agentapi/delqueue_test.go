package agentapi_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/ringipam/ringipam/pkg/agentapi"
)

func delOf(plugin, network, id string) *agentapi.Request {
	return &agentapi.Request{Version: agentapi.Version, Plugin: plugin, Command: "DEL", ContainerID: id, IfName: "eth0",
		TimeoutMS: 5000, Stdin: []byte(`{"cniVersion":"1.0.0","name":"` + network + `"}`)}
}

// recorder is a Handler that records the containers it ran and fails
// those in fail.
type recorder struct {
	mu   sync.Mutex
	ran  []string
	fail map[string]bool
	// refuse: container IDs whose DEL fails with this CNI code.
	refuse map[string]uint
}

func (r *recorder) Serve(ctx context.Context, req *agentapi.Request) agentapi.Answer {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.ran = append(r.ran, req.Plugin+"/"+req.ContainerID)
	if r.fail[req.ContainerID] {
		return agentapi.Answer{CNIError: types.NewError(types.ErrTryAgainLater, "etcd unreachable", "")}
	}
	if code, ok := r.refuse[req.ContainerID]; ok {
		return agentapi.Answer{CNIError: types.NewError(code, "refused by the test", "")}
	}
	return agentapi.Answer{}
}

func queueLen(t *testing.T, q agentapi.DelQueue) int {
	t.Helper()
	n, err := q.Len()
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// A repeated DEL of one attachment replaces its entry; another plugin,
// network or container is another entry; files are 0600 in a 0700
// directory; only DEL is queued.
func TestQueueReplaces(t *testing.T) {
	q := agentapi.DelQueue{Dir: filepath.Join(t.TempDir(), "del-queue")}
	for _, r := range []*agentapi.Request{
		delOf(agentapi.PluginIPAM, "n1", "a"),
		delOf(agentapi.PluginIPAM, "n1", "a"),
		delOf(agentapi.PluginPortmap, "n1", "a"),
		delOf(agentapi.PluginIPAM, "n2", "a"),
		delOf(agentapi.PluginIPAM, "n1", "b"),
	} {
		if err := q.Put(r); err != nil {
			t.Fatal(err)
		}
	}
	if n := queueLen(t, q); n != 4 {
		t.Fatalf("%d entries, want 4", n)
	}
	di, err := os.Stat(q.Dir)
	if err != nil {
		t.Fatal(err)
	}
	if di.Mode().Perm() != 0o700 {
		t.Fatalf("queue directory mode %v, want 0700", di.Mode().Perm())
	}
	des, _ := os.ReadDir(q.Dir)
	for _, de := range des {
		fi, _ := de.Info()
		if fi.Mode().Perm() != 0o600 || strings.HasPrefix(de.Name(), ".tmp-") {
			t.Fatalf("entry %s mode %v: want 0600 and no temporary file left", de.Name(), fi.Mode())
		}
	}
	add := delOf(agentapi.PluginIPAM, "n1", "c")
	add.Command = "ADD"
	if err := q.Put(add); err == nil {
		t.Fatal("an ADD was queued")
	}
}

// The queue holds at most MaxQueued entries of at most MaxQueuedSize
// bytes: a new DEL then fails (ErrQueueFull, and code 11 through Forward);
// a DEL already queued still replaces its entry.
func TestQueueBounds(t *testing.T) {
	q := agentapi.DelQueue{Dir: t.TempDir()}
	big := delOf(agentapi.PluginIPAM, "n1", "big")
	big.Stdin = bytes.Repeat([]byte("x"), agentapi.MaxQueuedSize)
	if err := q.Put(big); !errors.Is(err, agentapi.ErrEntryTooLarge) {
		t.Fatalf("an entry over the size bound: %v, want ErrEntryTooLarge", err)
	}
	if err := q.Put(delOf(agentapi.PluginIPAM, "n1", "kept")); err != nil {
		t.Fatal(err)
	}
	// Fill the rest with stand-in entries (no fsync each: Put's own path
	// is tested above).
	for i := 1; i < agentapi.MaxQueued; i++ {
		if err := os.WriteFile(filepath.Join(q.Dir, fmt.Sprintf("filler-%04d.json", i)), []byte("{}"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	err := q.Put(delOf(agentapi.PluginIPAM, "n1", "new"))
	if !errors.Is(err, agentapi.ErrQueueFull) || !strings.Contains(err.Error(), q.Dir) {
		t.Fatalf("a DEL into a full queue: %v, want ErrQueueFull naming the directory", err)
	}
	if err := q.Put(delOf(agentapi.PluginIPAM, "n1", "kept")); err != nil {
		t.Fatalf("a queued DEL repeated into a full queue: %v, want it replaced", err)
	}
	req := delOf(agentapi.PluginIPAM, "n1", "new")
	_, err = agentapi.Forward(context.Background(), filepath.Join(t.TempDir(), "none.sock"), q.Dir, req, nil)
	if code := cniCode(t, err); code != types.ErrTryAgainLater || !strings.Contains(err.Error(), "the DEL queue is full") {
		t.Fatalf("DEL without agent into a full queue: %v (code %d), want 11 saying the queue is full", err, code)
	}
}

// Drain runs every entry through the handler and removes it after it
// succeeded; a failed one stays for the next Drain.
func TestDrain(t *testing.T) {
	q := agentapi.DelQueue{Dir: t.TempDir()}
	for _, id := range []string{"a", "b", "c"} {
		if err := q.Put(delOf(agentapi.PluginIPAM, "n1", id)); err != nil {
			t.Fatal(err)
		}
	}
	if err := q.Put(delOf(agentapi.PluginPortmap, "n1", "a")); err != nil {
		t.Fatal(err)
	}
	h := &recorder{fail: map[string]bool{"b": true}}
	rep, err := q.Drain(context.Background(), h)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Done != 3 || rep.Failed != 1 || len(rep.Errs) != 1 || !strings.Contains(rep.Errs[0].Error(), "etcd unreachable") {
		t.Fatalf("first drain %+v, want 3 done and b failed", rep)
	}
	slices.Sort(h.ran)
	if got := strings.Join(h.ran, ","); got != "ipam-ring/a,ipam-ring/b,ipam-ring/c,portmap-ingress/a" {
		t.Fatalf("ran %s", got)
	}
	if n := queueLen(t, q); n != 1 {
		t.Fatalf("%d entries left, want 1 (b)", n)
	}
	h = &recorder{}
	rep, err = q.Drain(context.Background(), h)
	if err != nil || rep.Done != 1 || rep.Failed != 0 || len(h.ran) != 1 || h.ran[0] != "ipam-ring/b" {
		t.Fatalf("second drain %+v, %v, ran %v; want b done", rep, err, h.ran)
	}
	if n := queueLen(t, q); n != 0 {
		t.Fatalf("%d entries left, want 0", n)
	}
	// A directory that does not exist is an empty queue.
	rep, err = agentapi.DelQueue{Dir: filepath.Join(q.Dir, "none")}.Drain(context.Background(), h)
	if err != nil || rep.Done+rep.Failed != 0 {
		t.Fatalf("drain of a missing directory: %+v, %v", rep, err)
	}
}

// What a crash can leave: a temporary file of a Put that died before its
// rename (removed once older than a minute; a young one may be a Put under
// way and stays) and, written by hand, a damaged entry (moved to failed/:
// no retry can run it) and one of another protocol version (stays for an
// agent of its version); both reported, neither stops the others.
func TestDrainCrashLeftovers(t *testing.T) {
	q := agentapi.DelQueue{Dir: t.TempDir()}
	if err := q.Put(delOf(agentapi.PluginIPAM, "n1", "a")); err != nil {
		t.Fatal(err)
	}
	oldTemp := filepath.Join(q.Dir, ".tmp-123")
	youngTemp := filepath.Join(q.Dir, ".tmp-456")
	for _, p := range []string{oldTemp, youngTemp} {
		if err := os.WriteFile(p, []byte(`{"version":1,"plug`), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	old := time.Now().Add(-time.Hour)
	if err := os.Chtimes(oldTemp, old, old); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(q.Dir, "damaged.json"), []byte(`{"version":1,"plug`), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(q.Dir, "v2.json"), []byte(`{"version":2,"plugin":"ipam-ring","command":"DEL"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	h := &recorder{}
	rep, err := q.Drain(context.Background(), h)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Done != 1 || rep.Failed != 1 || rep.Dead != 1 || rep.TempRemoved != 1 {
		t.Fatalf("drain %+v, want 1 done, 1 failed (v2), 1 dead (damaged), 1 temporary file removed", rep)
	}
	if len(h.ran) != 1 {
		t.Fatalf("ran %v, want only the whole entry", h.ran)
	}
	if joined := errors.Join(rep.Errs...).Error(); !strings.Contains(joined, "agent API v2, this agent v1") {
		t.Fatalf("errors %q do not name the version", joined)
	}
	if joined := errors.Join(rep.DeadErrs...).Error(); !strings.Contains(joined, "undecodable") || !strings.Contains(joined, "moved to") {
		t.Fatalf("dead errors %q do not name the damaged entry and where it went", joined)
	}
	if _, err := os.Stat(filepath.Join(q.Dir, agentapi.FailedDir, "damaged.json")); err != nil {
		t.Fatalf("the damaged entry is not in %s: %v", agentapi.FailedDir, err)
	}
	for p, want := range map[string]bool{oldTemp: false, youngTemp: true} {
		if _, err := os.Stat(p); (err == nil) != want {
			t.Fatalf("%s present: %v, want %v", p, err == nil, want)
		}
	}
	if n := queueLen(t, q); n != 1 {
		t.Fatalf("%d entries left, want the v2 one", n)
	}
}

// A DEL refused with a code no retry changes (7, invalid configuration)
// leaves the queue for failed/ on its first drain, is not run again, and
// a refusal that may pass (11) stays queued.
func TestDrainMovesHopelessDELsAside(t *testing.T) {
	q := agentapi.DelQueue{Dir: t.TempDir()}
	for _, id := range []string{"bad-config", "busy", "fine"} {
		if err := q.Put(delOf(agentapi.PluginIPAM, "n1", id)); err != nil {
			t.Fatal(err)
		}
	}
	h := &recorder{fail: map[string]bool{"busy": true}, refuse: map[string]uint{"bad-config": types.ErrInvalidNetworkConfig}}
	rep, err := q.Drain(context.Background(), h)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Done != 1 || rep.Failed != 1 || rep.Dead != 1 {
		t.Fatalf("drain %+v, want fine done, busy failed, bad-config dead", rep)
	}
	if joined := errors.Join(rep.DeadErrs...).Error(); !strings.Contains(joined, "refused by the test") {
		t.Fatalf("dead errors %q do not carry the plugin's refusal", joined)
	}
	failed, err := os.ReadDir(filepath.Join(q.Dir, agentapi.FailedDir))
	if err != nil || len(failed) != 1 {
		t.Fatalf("%s holds %v (%v), want the one refused entry", agentapi.FailedDir, failed, err)
	}
	h = &recorder{}
	rep, err = q.Drain(context.Background(), h)
	if err != nil || rep.Done != 1 || rep.Dead != 0 || len(h.ran) != 1 || h.ran[0] != "ipam-ring/busy" {
		t.Fatalf("second drain %+v, %v, ran %v; want only busy run", rep, err, h.ran)
	}
}
