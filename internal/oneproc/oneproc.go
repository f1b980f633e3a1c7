// Package oneproc is imported, for its effect alone, by the plugins that live
// for one call (ipam-ring, portmap-ingress). Its init sets GOMAXPROCS to 1
// unless the environment sets GOMAXPROCS itself.
//
// A plugin runs one call on one goroutine (and, at most, a goroutine waiting
// in the kernel for a lock). With a processor per CPU, every goroutine the
// runtime or a library starts wakes another thread that spins looking for
// work and then parks; when eight plugins start at once on a two-CPU node
// those threads take the CPUs from the calls. Measured with 8 ADDs at a
// time on the local store: 6-16% less CPU per ADD and 4-15% more ADDs a
// second, and one call alone no slower (docs/DESIGN-NOTES.md). Long-running
// programs (the agent, the Docker driver) keep the default.
//
// The package imports nothing but runtime and syscall, so that its init is
// among the first to run: the processor it removes has then cached little
// memory that the runtime must hand back (one call's CPU was 8% lower than
// with the init after package os's).
package oneproc

import (
	"runtime"
	"syscall"
)

func init() {
	if _, set := syscall.Getenv("GOMAXPROCS"); !set {
		runtime.GOMAXPROCS(1)
	}
}
