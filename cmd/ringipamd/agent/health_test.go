package agent

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/ringipam/ringipam/pkg/store/memory"
)

func TestHealthAnswers(t *testing.T) {
	now := time.Date(2026, 11, 26, 12, 0, 0, 0, time.UTC)
	stall := stallAfter(30*time.Second, 20*time.Second)
	if stall != 150*time.Second {
		t.Fatalf("stallAfter(30s, 20s) = %s, want 2m30s", stall)
	}
	fine := healthInput{now: now, lastBeat: now.Add(-time.Minute), stallAfter: stall, held: true}
	cases := []struct {
		name        string
		change      func(*healthInput)
		live, ready string // "" for healthy, else a part of the reason
	}{
		{"all well", func(*healthInput) {}, "", ""},
		{"etcd out of reach: alive, not ready", func(in *healthInput) { in.held = false }, "", "liveness record not held"},
		{"name held by another agent", func(in *healthInput) { in.nameLost = true }, "", "holds this host's name"},
		{"heartbeat loop stuck", func(in *healthInput) { in.lastBeat = now.Add(-stall - time.Second) }, "has not turned", "has not turned"},
		{"just within the stall limit", func(in *healthInput) { in.lastBeat = now.Add(-stall) }, "", ""},
		{"plugins' socket down", func(in *healthInput) { in.apiDown = true }, "socket stopped serving", "socket stopped serving"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			in := fine
			c.change(&in)
			check := func(what string, err error, want string) {
				switch {
				case want == "" && err != nil:
					t.Errorf("%s: %v, want healthy", what, err)
				case want != "" && (err == nil || !strings.Contains(err.Error(), want)):
					t.Errorf("%s: %v, want an error containing %q", what, err, want)
				}
			}
			check("liveness", liveness(in), c.live)
			check("readiness", readiness(in), c.ready)
		})
	}
}

// TestHealthEndpoints: the HTTP answers follow the agent's state: /livez
// stays 200 while the store is out of reach (no liveness record held) and
// turns 503 only when the heartbeat loop is stuck; /readyz and /healthz
// need the record.
func TestHealthEndpoints(t *testing.T) {
	now := time.Date(2026, 11, 26, 12, 0, 0, 0, time.UTC)
	a := newTestAgent(t, memory.New(), "host-a", nil, WithClock(func() time.Time { return now }))
	h := a.Handler()
	code := func(path string) (int, string) {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
		return rec.Code, rec.Body.String()
	}
	want := func(state string, codes map[string]int) {
		t.Helper()
		for path, w := range codes {
			if got, body := code(path); got != w {
				t.Errorf("%s: %s answered %d (%q), want %d", state, path, got, strings.TrimSpace(body), w)
			}
		}
	}
	held := false
	a.held = func() bool { return held }
	a.lastBeat.Store(now.UnixNano())
	want("store out of reach", map[string]int{"/livez": 200, "/readyz": 503, "/healthz": 503})
	held = true
	want("record held", map[string]int{"/livez": 200, "/readyz": 200, "/healthz": 200})
	a.lastBeat.Store(now.Add(-time.Hour).UnixNano())
	want("heartbeat loop stuck", map[string]int{"/livez": 503, "/readyz": 503, "/healthz": 503})
}
