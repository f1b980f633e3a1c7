package agent

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/ringipam/ringipam/internal/version"
)

// The agent's registry (newMetrics) carries ringipam_build_info with this
// binary's version, commit and Go version, valued 1.
func TestBuildInfoMetric(t *testing.T) {
	m := newMetrics(func() metricsView { return metricsView{} })
	families, err := m.registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	in := version.Get()
	for _, f := range families {
		if f.GetName() != "ringipam_build_info" {
			continue
		}
		if len(f.GetMetric()) != 1 {
			t.Fatalf("ringipam_build_info: %d series, want 1", len(f.GetMetric()))
		}
		s := f.GetMetric()[0]
		labels := map[string]string{}
		for _, l := range s.GetLabel() {
			labels[l.GetName()] = l.GetValue()
		}
		want := map[string]string{"version": in.Version, "commit": in.Commit, "goversion": in.GoVersion}
		for k, v := range want {
			if labels[k] != v {
				t.Errorf("label %s = %q, want %q", k, labels[k], v)
			}
		}
		if len(labels) != len(want) {
			t.Errorf("labels %v, want exactly %v", labels, want)
		}
		if v := s.GetGauge().GetValue(); v != 1 {
			t.Errorf("value %v, want 1", v)
		}
		return
	}
	t.Fatal("ringipam_build_info not in the agent's registry")
}

// /status.json's "version" is the build's, however the snapshot was made,
// and a snapshot read back decodes.
func TestStatusJSONVersion(t *testing.T) {
	b, err := json.Marshal(&Snapshot{Host: "host-a"})
	if err != nil {
		t.Fatal(err)
	}
	want := `"version":"` + version.Get().Version + `"`
	if !strings.Contains(string(b), want) {
		t.Errorf("status.json %s: want %s", b, want)
	}
	var back Snapshot
	if err := json.Unmarshal(b, &back); err != nil || back.Host != "host-a" {
		t.Errorf("decoding %s: %v, host %q", b, err, back.Host)
	}
}
