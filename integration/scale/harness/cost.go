package harness

import (
	"context"
	"maps"
	"slices"
	"syscall"
	"time"
)

// Snapshot is what is read before and after a phase.
type Snapshot struct {
	At      time.Time
	Sum     Series // every member's metrics added up
	Max     Series // the largest member's value of each series
	CPU     time.Duration
	EtcdCPU time.Duration
}

// Take scrapes the members and reads the process's CPU time.
func Take(ctx context.Context, endpoints []string) (Snapshot, error) {
	sum, max, err := Scrape(ctx, endpoints)
	if err != nil {
		return Snapshot{}, err
	}
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	cpu := time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	return Snapshot{At: time.Now(), Sum: sum, Max: max, CPU: cpu, EtcdCPU: childCPU("etcd")}, nil
}

// Cost is what etcd did (and the process spent) between two snapshots,
// summed over the members: etcd's own counters.
type Cost struct {
	Seconds float64 `json:"seconds"`
	// Requests are the unary calls (grpc_server_started_total,
	// grpc_type="unary") by method, and the watch requests (creates and
	// cancels: messages received on Watch streams) as "Watch".
	Requests map[string]float64 `json:"requests"`
	// KeepAlives are the lease keep-alive messages received (aside from
	// Requests).
	KeepAlives float64 `json:"keepAlives"`
	// WatchMsgs are the messages sent on Watch streams
	// (grpc_server_msg_sent_total{grpc_method="Watch"}); MVCCEvents the
	// events etcd sent watchers (etcd_debugging_mvcc_events_total).
	WatchMsgs  float64 `json:"watchMsgs"`
	MVCCEvents float64 `json:"mvccEvents"`
	// BytesSent and BytesRecv are etcd's client gRPC bytes
	// (etcd_network_client_grpc_{sent,received}_bytes_total).
	BytesSent float64 `json:"bytesSent"`
	BytesRecv float64 `json:"bytesRecv"`
	// Proposals are the raft proposals committed (the largest member's
	// counter: every member commits each one).
	Proposals float64 `json:"proposals"`
	// DBSize is the backend's size at the end (largest member).
	DBSize float64 `json:"dbSize"`
	// CPU is this process's CPU time (the agents and the harness);
	// EtcdCPU the etcd members'.
	CPU     float64 `json:"cpuSeconds"`
	EtcdCPU float64 `json:"etcdCpuSeconds"`
}

// RequestsTotal is every request but the keep-alives.
func (c Cost) RequestsTotal() float64 {
	var t float64
	for _, v := range c.Requests {
		t += v
	}
	return t
}

// Diff is the cost between a and b.
func Diff(a, b Snapshot) Cost {
	c := Cost{Seconds: b.At.Sub(a.At).Seconds(), Requests: map[string]float64{}}
	ua, ub := a.Sum.ByLabel("grpc_server_started_total", "grpc_method", `grpc_type="unary"`),
		b.Sum.ByLabel("grpc_server_started_total", "grpc_method", `grpc_type="unary"`)
	for m, v := range ub {
		if d := v - ua[m]; d > 0 {
			c.Requests[m] = d
		}
	}
	d := func(s func(Snapshot) Series, name string, labels ...string) float64 {
		return s(b).Sum(name, labels...) - s(a).Sum(name, labels...)
	}
	sum := func(s Snapshot) Series { return s.Sum }
	max := func(s Snapshot) Series { return s.Max }
	if w := d(sum, "grpc_server_msg_received_total", `grpc_method="Watch"`); w > 0 {
		c.Requests["Watch"] = w
	}
	c.KeepAlives = d(sum, "grpc_server_msg_received_total", `grpc_method="LeaseKeepAlive"`)
	c.WatchMsgs = d(sum, "grpc_server_msg_sent_total", `grpc_method="Watch"`)
	c.MVCCEvents = d(sum, "etcd_debugging_mvcc_events_total")
	c.BytesSent = d(sum, "etcd_network_client_grpc_sent_bytes_total")
	c.BytesRecv = d(sum, "etcd_network_client_grpc_received_bytes_total")
	c.Proposals = d(max, "etcd_server_proposals_committed_total")
	c.DBSize = b.Max.Sum("etcd_mvcc_db_total_size_in_bytes")
	c.CPU = (b.CPU - a.CPU).Seconds()
	c.EtcdCPU = (b.EtcdCPU - a.EtcdCPU).Seconds()
	return c
}

// Methods are the request methods, sorted.
func (c Cost) Methods() []string { return slices.Sorted(maps.Keys(c.Requests)) }
