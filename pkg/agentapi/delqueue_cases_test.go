package agentapi_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/ringipam/ringipam/pkg/agentapi"
)

// failedEntries lists the entries in the queue's failed/ directory.
func failedEntries(t *testing.T, q agentapi.DelQueue) []string {
	t.Helper()
	des, err := os.ReadDir(filepath.Join(q.Dir, agentapi.FailedDir))
	if os.IsNotExist(err) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, de := range des {
		names = append(names, de.Name())
	}
	return names
}

// writeEntry writes an entry by hand (what Put would refuse to write).
func writeEntry(t *testing.T, q agentapi.DelQueue, name string, req *agentapi.Request) {
	t.Helper()
	b, err := json.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(q.Dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(q.Dir, name), b, 0o600); err != nil {
		t.Fatal(err)
	}
}

// An entry that is not a DEL is refused at both ends: Put does not queue
// one, and one found in the queue (written by anything else) is never run:
// it goes to failed/ on the first drain, saying why.
func TestQueueRefusesWhatIsNotADEL(t *testing.T) {
	q := agentapi.DelQueue{Dir: t.TempDir()}
	for _, cmd := range []string{"ADD", "CHECK", "GC", "STATUS", "VERSION", ""} {
		req := delOf(agentapi.PluginIPAM, "n1", "c")
		req.Command = cmd
		if err := q.Put(req); err == nil || !strings.Contains(err.Error(), "only DEL is queued") {
			t.Errorf("Put of a %q: %v, want refused", cmd, err)
		}
	}
	if n := queueLen(t, q); n != 0 {
		t.Fatalf("%d entries after refused Puts, want 0", n)
	}
	add := delOf(agentapi.PluginIPAM, "n1", "by-hand")
	add.Command = "ADD"
	writeEntry(t, q, "add.json", add)
	if err := q.Put(delOf(agentapi.PluginIPAM, "n1", "real")); err != nil {
		t.Fatal(err)
	}
	h := &recorder{}
	rep, err := q.Drain(context.Background(), h)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Done != 1 || rep.Dead != 1 || rep.Failed != 0 {
		t.Fatalf("drain %+v, want the DEL done and the ADD dead", rep)
	}
	if !slices.Equal(h.ran, []string{"ipam-ring/real"}) {
		t.Fatalf("ran %v, want only the DEL", h.ran)
	}
	if joined := fmt.Sprint(rep.DeadErrs); !strings.Contains(joined, `command "ADD", not DEL`) {
		t.Fatalf("dead errors %s do not say the entry is not a DEL", joined)
	}
	if got := failedEntries(t, q); !slices.Equal(got, []string{"add.json"}) {
		t.Fatalf("failed/ holds %v, want add.json", got)
	}
}

// payloadRecorder records the stdin of every request it runs.
type payloadRecorder struct{ ran []string }

func (r *payloadRecorder) Serve(_ context.Context, req *agentapi.Request) agentapi.Answer {
	r.ran = append(r.ran, req.ContainerID+" "+string(req.Stdin))
	return agentapi.Answer{}
}

// A second DEL of the same attachment (plugin, network, container,
// interface) with a different request (another configuration, other
// arguments) replaces the first: one entry, and the drain runs the last.
func TestQueueRepeatedDELReplacesTheEntry(t *testing.T) {
	q := agentapi.DelQueue{Dir: t.TempDir()}
	first := delOf(agentapi.PluginIPAM, "n1", "a")
	second := delOf(agentapi.PluginIPAM, "n1", "a")
	second.Stdin = []byte(`{"cniVersion":"1.1.0","name":"n1","ipam":{"type":"ipam-ring","timeout":"9s"}}`)
	second.Args = "K8S_POD_NAME=web-0"
	second.TimeoutMS = 9000
	for _, r := range []*agentapi.Request{first, second} {
		if err := q.Put(r); err != nil {
			t.Fatal(err)
		}
	}
	if n := queueLen(t, q); n != 1 {
		t.Fatalf("%d entries after two DELs of one attachment, want 1", n)
	}
	h := &payloadRecorder{}
	rep, err := q.Drain(context.Background(), h)
	if err != nil || rep.Done != 1 {
		t.Fatalf("drain %+v, %v, want one done", rep, err)
	}
	if want := []string{"a " + string(second.Stdin)}; !slices.Equal(h.ran, want) {
		t.Fatalf("ran %q, want the second request %q", h.ran, want)
	}
}

// Every CNI code no retry changes (1 incompatible version, 2 unsupported
// field, 4 bad environment, 6 undecodable, 7 invalid configuration) moves
// its entry to failed/ on the first drain; 5 (I/O) and 11 (try again) and
// a plugin's own code keep it queued, run again on the next drain.
func TestDrainCodes(t *testing.T) {
	for _, c := range []struct {
		code uint
		dead bool
	}{
		{types.ErrIncompatibleCNIVersion, true},
		{types.ErrUnsupportedField, true},
		{types.ErrInvalidEnvironmentVariables, true},
		{types.ErrDecodingFailure, true},
		{types.ErrInvalidNetworkConfig, true},
		{types.ErrIOFailure, false},
		{types.ErrTryAgainLater, false},
		{types.ErrUnknownContainer, false},
		{103, false},
	} {
		t.Run(fmt.Sprintf("code %d", c.code), func(t *testing.T) {
			q := agentapi.DelQueue{Dir: t.TempDir()}
			if err := q.Put(delOf(agentapi.PluginIPAM, "n1", "x")); err != nil {
				t.Fatal(err)
			}
			h := &recorder{refuse: map[string]uint{"x": c.code}}
			rep, err := q.Drain(context.Background(), h)
			if err != nil {
				t.Fatal(err)
			}
			failed, left := failedEntries(t, q), queueLen(t, q)
			if c.dead {
				if rep.Dead != 1 || rep.Failed != 0 || len(failed) != 1 || left != 0 {
					t.Fatalf("drain %+v, failed/ %v, %d left: want the entry moved to failed/", rep, failed, left)
				}
			} else if rep.Dead != 0 || rep.Failed != 1 || len(failed) != 0 || left != 1 {
				t.Fatalf("drain %+v, failed/ %v, %d left: want the entry kept in the queue", rep, failed, left)
			}
			// The next drain runs it again only if it was kept.
			h = &recorder{}
			if _, err := q.Drain(context.Background(), h); err != nil {
				t.Fatal(err)
			}
			if ranAgain := len(h.ran) == 1; ranAgain == c.dead {
				t.Fatalf("second drain ran %v; dead %v", h.ran, c.dead)
			}
		})
	}
}

// replacer is a Handler that, while it runs the entry of container id,
// has a plugin queue a new DEL of the same attachment (another request):
// the drain must not remove that new entry, which it did not run.
type replacer struct {
	q   agentapi.DelQueue
	id  string
	new *agentapi.Request
	ran []string
}

func (r *replacer) Serve(_ context.Context, req *agentapi.Request) agentapi.Answer {
	r.ran = append(r.ran, req.ContainerID+" "+string(req.Stdin))
	if req.ContainerID == r.id && r.new != nil {
		if err := r.q.Put(r.new); err != nil {
			return agentapi.Answer{Error: err.Error()}
		}
		r.new = nil
	}
	return agentapi.Answer{}
}

// Only the entries that ran are removed: a DEL queued again (with another
// request) while its entry runs stays for the next drain, which runs the
// new request; the other entries that ran are gone.
func TestDrainRemovesOnlyWhatRan(t *testing.T) {
	q := agentapi.DelQueue{Dir: t.TempDir()}
	for _, id := range []string{"a", "b", "c"} {
		if err := q.Put(delOf(agentapi.PluginIPAM, "n1", id)); err != nil {
			t.Fatal(err)
		}
	}
	again := delOf(agentapi.PluginIPAM, "n1", "b")
	again.Stdin = []byte(`{"cniVersion":"1.1.0","name":"n1","queued":"again"}`)
	h := &replacer{q: q, id: "b", new: again}
	rep, err := q.Drain(context.Background(), h)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Done != 3 || len(h.ran) != 3 {
		t.Fatalf("drain %+v ran %v, want the three entries run", rep, h.ran)
	}
	if n := queueLen(t, q); n != 1 {
		t.Fatalf("%d entries left, want 1: the DEL of b queued while b ran", n)
	}
	h2 := &payloadRecorder{}
	if rep, err := q.Drain(context.Background(), h2); err != nil || rep.Done != 1 {
		t.Fatalf("second drain %+v, %v", rep, err)
	}
	if want := []string{"b " + string(again.Stdin)}; !slices.Equal(h2.ran, want) {
		t.Fatalf("second drain ran %q, want %q", h2.ran, want)
	}
	if n := queueLen(t, q); n != 0 {
		t.Fatalf("%d entries left, want 0", n)
	}
}
