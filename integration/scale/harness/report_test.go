package harness

import (
	"strings"
	"testing"
)

// ringVerdict is Verdicts' 41.3 verdict on the ring change's watch
// messages for two runs.
func ringVerdict(t *testing.T, a, b Result) Verdict {
	t.Helper()
	for _, v := range Verdicts([]Result{a, b}) {
		if strings.HasPrefix(v.Target, "41.3 events O(N): ring change: watch messages per host") {
			return v
		}
	}
	t.Fatal("no ring change watch verdict")
	return Verdict{}
}

func ringRun(n, full, hosts int, watchMsgs float64) Result {
	return Result{N: n, Full: full, Phases: []Phase{{Name: "ring", Hosts: hosts, Cost: Cost{WatchMsgs: watchMsgs}}}}
}

// Between runs with different shares of whole agents, an event's watch
// messages are compared per whole agent: one message to each whole agent
// at both sizes is met, one to each host of the cluster (the hollow ones
// included) at the larger size, ten times as many per whole agent, is not.
func TestVerdictComparesWatchesPerWholeAgent(t *testing.T) {
	small := ringRun(10, 0, 10, 10)
	if v := ringVerdict(t, small, ringRun(1000, 100, 1001, 101)); !v.Met || !strings.Contains(v.Detail, "per whole agent") {
		t.Errorf("one message a whole agent at both sizes: %v", v)
	}
	if v := ringVerdict(t, small, ringRun(1000, 100, 1001, 1001)); v.Met {
		t.Errorf("ten messages a whole agent at N=1000: met: %v", v)
	}
	// The same share: per host, as before.
	if v := ringVerdict(t, small, ringRun(1000, 0, 1001, 3003)); v.Met || strings.Contains(v.Detail, "per whole agent") {
		t.Errorf("three messages a host, every agent whole: %v", v)
	}
}
