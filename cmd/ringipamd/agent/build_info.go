package agent

import (
	"encoding/json"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/ringipam/ringipam/internal/version"
)

// registerBuildInfo registers ringipam_build_info{version,commit,goversion},
// always 1: the build of this agent (internal/version), for a dashboard
// to tell which hosts run which release during a rollout.
func registerBuildInfo(r prometheus.Registerer) {
	in := version.Get()
	g := prometheus.NewGauge(prometheus.GaugeOpts{
		Name:        "ringipam_build_info",
		Help:        "The agent's build, always 1: version (git describe, \"dev\" when not stamped), commit and Go version.",
		ConstLabels: prometheus.Labels{"version": in.Version, "commit": in.Commit, "goversion": in.GoVersion},
	})
	g.Set(1)
	r.MustRegister(g)
}

// BuildVersion is Snapshot's "version" field of /status.json: it needs no
// value, it marshals as this binary's version (internal/version), so that
// every snapshot, however it is made, carries it. Decoding accepts any
// string (a snapshot read back, e.g. by a test, keeps its JSON form).
type BuildVersion struct{}

// MarshalJSON implements json.Marshaler.
func (BuildVersion) MarshalJSON() ([]byte, error) { return json.Marshal(version.Get().Version) }

// UnmarshalJSON implements json.Unmarshaler.
func (*BuildVersion) UnmarshalJSON([]byte) error { return nil }

// String is the version, for the status page's template.
func (BuildVersion) String() string { return version.Get().Version }
