// Package oneproc is imported, through internal/cnimain, by the plugins that
// live for one call (ipam-ring, portmap-ingress). Its init sets GOMAXPROCS
// to 1 unless the environment sets GOMAXPROCS itself.
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
// The package imports nothing but runtime, so that its init is among the
// first to run (the third after the runtime's in ipam-ring): the processor
// it removes has then cached little memory that the runtime must hand back. Each span it has
// cached goes back to a list the process has not touched yet, a fresh page
// each; about half the processes of an 8-way burst gave back 18-25 spans
// when the init came after package syscall's (to read the environment), and
// mostly 4-7 since, at most 15 (4% less CPU per ADD, docs/DESIGN-NOTES.md).
//
// Without syscall the init cannot read the environment. It reads what the
// runtime made of it instead: a GOMAXPROCS other than the CPU count can
// only come from the environment (the plugins build with
// containermaxprocs=0, so the runtime's own choice is the CPU count), and
// then the init leaves it. The one case it cannot tell, GOMAXPROCS set to
// the CPU count, is settled by RespectEnvironment, which cnimain.Run calls
// first thing with os.LookupEnv.
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

import "runtime"

// lowered is the processor count the init found and lowered to 1 (0 when it
// left the count alone).
var lowered int

func init() {
	growStack()
	if n := runtime.GOMAXPROCS(0); n > 1 && n == runtime.NumCPU() {
		runtime.GOMAXPROCS(1)
		lowered = n
	}
}

// RespectEnvironment gives the processors back when lookupEnv (os.LookupEnv)
// shows GOMAXPROCS set: the init lowered a count equal to the CPUs', which
// the environment may have asked for. A GOMAXPROCS the runtime ignored
// (not a positive number) gets the runtime's default back, the CPU count,
// as it would have without this package.
func RespectEnvironment(lookupEnv func(string) (string, bool)) {
	if lowered == 0 {
		return
	}
	if _, set := lookupEnv("GOMAXPROCS"); set {
		runtime.GOMAXPROCS(lowered)
		lowered = 0
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
