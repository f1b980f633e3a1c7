package agent

import (
	"context"
	"testing"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/ringipam/ringipam/pkg/agentapi"
	"github.com/ringipam/ringipam/pkg/store/memory"
	"github.com/ringipam/ringipam/pkg/storeconfig"
)

// delQueueRuns reads ringipam_del_queue_runs_total{result} from the
// agent's registry, as /metrics serves it.
func delQueueRuns(t *testing.T, a *Agent) map[string]float64 {
	t.Helper()
	families, err := a.metrics.registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, f := range families {
		if f.GetName() != "ringipam_del_queue_runs_total" {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "result" {
					got[l.GetValue()] = m.GetCounter().GetValue()
				}
			}
		}
	}
	return got
}

// The agent's drain counts each queued DEL it ran by result in
// ringipam_del_queue_runs_total: ok (released, removed), failed (kept for
// the next drain: code 11), dead (moved to failed/: code 7).
func TestDrainCountsRunsByResult(t *testing.T) {
	a := newTestAgent(t, memory.New(), "host-a", nil)
	a.cfg.Store.Type = storeconfig.TypeEtcd
	a.cfg.Store.DelQueue = t.TempDir()
	q := agentapi.DelQueue{Dir: a.cfg.Store.DelQueueDir()}
	for _, id := range []string{"ok-1", "ok-2", "busy", "bad"} {
		if err := q.Put(&agentapi.Request{Version: agentapi.Version, Plugin: agentapi.PluginIPAM, Command: "DEL",
			ContainerID: id, IfName: "eth0", Stdin: []byte(`{"cniVersion":"1.0.0","name":"n"}`)}); err != nil {
			t.Fatal(err)
		}
	}
	hs := agentapi.Handlers{agentapi.PluginIPAM: agentapi.HandlerFunc(func(_ context.Context, req *agentapi.Request) agentapi.Answer {
		switch req.ContainerID {
		case "busy":
			return agentapi.Answer{CNIError: types.NewError(types.ErrTryAgainLater, "etcd unreachable", "")}
		case "bad":
			return agentapi.Answer{CNIError: types.NewError(types.ErrInvalidNetworkConfig, "bad configuration", "")}
		}
		return agentapi.Answer{}
	})}
	if got := delQueueRuns(t, a); got["ok"] != 0 || got["failed"] != 0 || got["dead"] != 0 || len(got) != 3 {
		t.Fatalf("before any drain: %v, want ok, failed and dead at 0", got)
	}
	a.drain(context.Background(), hs, 0)
	if got := delQueueRuns(t, a); got["ok"] != 2 || got["failed"] != 1 || got["dead"] != 1 {
		t.Fatalf("after the first drain: %v, want ok 2, failed 1, dead 1", got)
	}
	a.drain(context.Background(), hs, 0)
	if got := delQueueRuns(t, a); got["ok"] != 2 || got["failed"] != 2 || got["dead"] != 1 {
		t.Fatalf("after the second drain: %v, want ok 2, failed 2 (busy again), dead 1", got)
	}
}
