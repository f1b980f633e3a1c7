package driver

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

// Metrics are the driver's Prometheus metrics, on a registry of their own
// (no global state). A nil *Metrics records nothing.
type Metrics struct {
	Registry *prometheus.Registry
	requests *prometheus.CounterVec
	latency  *prometheus.HistogramVec
	allocs   *prometheus.CounterVec
	releases *prometheus.CounterVec
	inflight prometheus.Gauge
}

// NewMetrics creates the metrics and registers them, with the Go runtime
// and process collectors, on a new registry.
func NewMetrics() *Metrics {
	m := &Metrics{
		Registry: prometheus.NewRegistry(),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "ringipam", Subsystem: "docker", Name: "requests_total",
			Help: "IPAM requests served, by remote-API method and result (ok or the error class).",
		}, []string{"method", "result"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "ringipam", Subsystem: "docker", Name: "request_duration_seconds",
			Help:    "Time to serve an IPAM request, by remote-API method.",
			Buckets: []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30},
		}, []string{"method"}),
		allocs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "ringipam", Subsystem: "docker", Name: "addresses_allocated_total",
			Help: "Container addresses handed out (replays of a held address included), by family.",
		}, []string{"family"}),
		releases: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "ringipam", Subsystem: "docker", Name: "addresses_released_total",
			Help: "Container addresses released, by family.",
		}, []string{"family"}),
		inflight: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: "ringipam", Subsystem: "docker", Name: "requests_in_flight",
			Help: "IPAM requests being served.",
		}),
	}
	m.Registry.MustRegister(m.requests, m.latency, m.allocs, m.releases, m.inflight,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

func family(is4 bool) string {
	if is4 {
		return "ipv4"
	}
	return "ipv6"
}

func (m *Metrics) allocated(is4 bool) {
	if m != nil {
		m.allocs.WithLabelValues(family(is4)).Inc()
	}
}

func (m *Metrics) released(is4 bool) {
	if m != nil {
		m.releases.WithLabelValues(family(is4)).Inc()
	}
}

// begin counts a request in flight and returns the function that records
// its end.
func (m *Metrics) begin(method string) func(err error) {
	if m == nil {
		return func(error) {}
	}
	m.inflight.Inc()
	start := time.Now()
	return func(err error) {
		m.inflight.Dec()
		m.latency.WithLabelValues(method).Observe(time.Since(start).Seconds())
		m.requests.WithLabelValues(method, Class(err)).Inc()
	}
}
