// Package cnimain is the shared entry point of ringipam's CNI plugins: it
// bounds what a plugin reads from stdin before anything parses it, then
// hands the verbs to skel.
//
// Contract: Run never returns. A configuration larger than MaxStdin bytes is
// refused with CNI error code 7 ("invalid network config") after reading at
// most MaxStdin+1 bytes, so a runaway or hostile caller cannot make the
// plugin hold more than that in memory.
package cnimain

import (
	"fmt"
	"io"
	"os"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/cni/pkg/version"
	"golang.org/x/sys/unix"
)

// MaxStdin is the largest network configuration a plugin accepts: far above
// any real conflist entry with its prevResult (a few KiB), far below what
// would strain a node.
const MaxStdin = 4 << 20

// Run bounds stdin and runs the plugin's verbs through skel.
func Run(funcs skel.CNIFuncs, versions version.PluginInfo, about string) {
	if err := limitStdin(MaxStdin); err != nil {
		e := types.NewError(types.ErrInvalidNetworkConfig, err.Error(), "")
		_ = e.Print()
		os.Exit(1)
	}
	skel.PluginMainFuncs(funcs, versions, about)
}

// limitStdin reads stdin up to max bytes and puts what it read back as
// os.Stdin, or fails when there is more. The bytes are put back in an
// anonymous memory file (memfd), which skel then reads like any file: no
// pipe, and no goroutine to feed one.
func limitStdin(max int64) error {
	data, err := io.ReadAll(io.LimitReader(os.Stdin, max+1))
	if err != nil {
		return fmt.Errorf("reading the network configuration from stdin: %w", err)
	}
	if int64(len(data)) > max {
		return fmt.Errorf("network configuration on stdin is larger than %d bytes: refused unread", max)
	}
	fd, err := unix.MemfdCreate("cni-stdin", unix.MFD_CLOEXEC)
	if err != nil {
		return fmt.Errorf("re-reading stdin: %w", err)
	}
	f := os.NewFile(uintptr(fd), "stdin")
	if _, err := f.Write(data); err != nil {
		f.Close()
		return fmt.Errorf("re-reading stdin: %w", err)
	}
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		f.Close()
		return fmt.Errorf("re-reading stdin: %w", err)
	}
	os.Stdin = f
	return nil
}
