// The plugins live for one call: GOMAXPROCS from the CPUs is enough, and
// reading the cgroup's CPU limit at start-up (mountinfo, cgroup files) and
// watching it afterwards cost every call about 0.1 ms of CPU
// (docs/benchmarks.md). internal/oneproc relies on it: a GOMAXPROCS other
// than the CPU count then comes from the environment.
//go:debug containermaxprocs=0
//go:debug updatemaxprocs=0

// Command portmap-ingress is a chained CNI plugin that publishes container
// ports, unique per host (host mode) or across the cluster (ingress mode),
// on a ringipam store. See README.md; the work is done by package portmap.
package main

import (
	"github.com/ringipam/ringipam/internal/cnimain"
	"github.com/ringipam/ringipam/pkg/cni/portmap"
)

func main() {
	cnimain.Run(portmap.Edge{}.Funcs(), portmap.SupportedVersions, "portmap-ingress: published ports unique across a ringipam cluster")
}
