// The plugins live for one call: GOMAXPROCS from the CPUs is enough, and
// reading the cgroup's CPU limit at start-up (mountinfo, cgroup files) and
// watching it afterwards cost every call about 0.1 ms of CPU
// (docs/benchmarks.md). internal/oneproc relies on it: a GOMAXPROCS other
// than the CPU count then comes from the environment.
//go:debug containermaxprocs=0
//go:debug updatemaxprocs=0

// Command ipam-ring is a CNI IPAM plugin that hands out container addresses
// unique across every host sharing a ringipam store (etcd, or the embedded
// local store for a single host). See README.md for its configuration and
// error codes; the work is done by package ipam.
package main

import (
	"github.com/ringipam/ringipam/internal/cnimain"
	"github.com/ringipam/ringipam/pkg/cni/ipam"
)

func main() {
	cnimain.Run(ipam.Edge{ToAgent: true}.Funcs(), ipam.SupportedVersions, "ipam-ring: cluster-wide CNI IPAM on a ring of host-owned ranges")
}
