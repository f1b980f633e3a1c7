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
//
// The same init grows the main goroutine's stack to 16 KiB while the stack
// is still shallow. A goroutine starts with 2 KiB and the runtime doubles
// it by copying whenever a call needs more, walking every frame to move its
// pointers and taking each new size's stacks from memory not yet touched;
// an ADD's stack was copied three times (to 4, 8 and 16 KiB), the later
// copies deep in the call. The first copy happens before this init runs;
// the second, here, goes straight to 16 KiB with a few frames on the stack,
// and the call needs no third: 4-5% less CPU per ADD
// (docs/DESIGN-NOTES.md).
package oneproc

import (
	"runtime"
	"syscall"
)

func init() {
	growStack()
	if _, set := syscall.Getenv("GOMAXPROCS"); !set {
		runtime.GOMAXPROCS(1)
	}
}

// growStack has a 12 KiB frame: entering it makes the runtime grow the
// stack to the next size that holds the frame, 16 KiB.
//
//go:noinline
func growStack() byte {
	var frame [12 << 10]byte
	return last(frame[:])
}

// last keeps frame alive (and on the stack: it does not escape).
//
//go:noinline
func last(b []byte) byte { return b[len(b)-1] }
