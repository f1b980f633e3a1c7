package agent

import (
	"slices"
	"testing"
	"time"

	"github.com/ringipam/ringipam/pkg/pool"
)

func TestVanishedDecision(t *testing.T) {
	const grace = 5 * time.Minute
	gone := vanishedFacts{Recorded: true, Synced: true, Age: 2 * grace, Pod: podAbsent, GoneFor: 2 * grace, Sandbox: sandboxAbsent}
	with := func(f func(*vanishedFacts)) vanishedFacts { x := gone; f(&x); return x }
	for _, tc := range []struct {
		name    string
		f       vanishedFacts
		release bool
	}{
		{"pod and sandbox gone, past the grace", gone, true},
		{"pod recreated with another UID, old sandbox gone", with(func(f *vanishedFacts) { f.Pod = podOtherUID }), true},
		{"exactly the grace", with(func(f *vanishedFacts) { f.Age, f.GoneFor = grace, grace }), true},
		{"pod present", with(func(f *vanishedFacts) { f.Pod = podPresent }), false},
		{"sandbox present", with(func(f *vanishedFacts) { f.Sandbox = sandboxPresent }), false},
		{"runtime not asked", with(func(f *vanishedFacts) { f.Sandbox = sandboxUnknown }), false},
		{"allocation younger than the grace", with(func(f *vanishedFacts) { f.Age = grace - time.Second }), false},
		{"pod known gone for less than the grace", with(func(f *vanishedFacts) { f.GoneFor = grace - time.Second }), false},
		{"informer not synced", with(func(f *vanishedFacts) { f.Synced = false }), false},
		{"no pod recorded (an older record)", with(func(f *vanishedFacts) { f.Recorded = false }), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, why := vanished(tc.f, grace)
			if got != tc.release {
				t.Errorf("vanished(%+v) = %v (%s), want %v", tc.f, got, why, tc.release)
			}
		})
	}
}

func TestNodeCandidates(t *testing.T) {
	hosts := []pool.HostInfo{
		{Name: "self", KubeNode: true, Ranges: 1},
		{Name: "gone", KubeNode: true, Ranges: 2, Used: 3},
		{Name: "gone-empty", KubeNode: true},                             // nothing left, not yet reclaimed: reclaimed (marks it)
		{Name: "reclaimed", KubeNode: true, OrphanedAt: time.Unix(1, 0)}, // reclaimed, nothing left
		{Name: "reclaimed-but-used", KubeNode: true, OrphanedAt: time.Unix(1, 0), Used: 1},
		{Name: "has-node", KubeNode: true, Ranges: 1},
		{Name: "docker-host", Ranges: 1, Used: 1}, // never a Kubernetes node
	}
	got := nodeCandidates(hosts, "self", func(n string) bool { return n == "has-node" })
	want := []string{"gone", "gone-empty", "reclaimed-but-used"}
	if !slices.Equal(got, want) {
		t.Errorf("nodeCandidates = %v, want %v", got, want)
	}
}
