package agentapi

import (
	"fmt"
	"io"
	"os"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
)

// The pieces both plugins and both of the agent's handlers share around
// Forward and Handler: one invocation turned into a Request and back, the
// answer printed, and the refusal of a configuration of another cluster.

// NewRequest is the Request of plugin's invocation args of command, run
// under timeout, from this process's host name (the name a configuration
// without "host" means).
func NewRequest(plugin, command string, args *skel.CmdArgs, timeout time.Duration) *Request {
	host, _ := os.Hostname()
	return &Request{Plugin: plugin, Command: command, ContainerID: args.ContainerID, Netns: args.Netns,
		IfName: args.IfName, Args: args.Args, Path: args.Path, Hostname: host,
		TimeoutMS: timeout.Milliseconds(), Stdin: args.StdinData}
}

// CmdArgs is the invocation r carries, as skel hands it to a verb.
func (r *Request) CmdArgs() *skel.CmdArgs {
	return &skel.CmdArgs{ContainerID: r.ContainerID, Netns: r.Netns, IfName: r.IfName,
		Args: r.Args, Path: r.Path, StdinData: r.Stdin}
}

// Print writes what Forward returned to the plugin's stdout and returns
// the error the runtime sees: Forward's, or code 5 (I/O failure) when the
// result could not be written.
func Print(stdout io.Writer, out []byte, err error) error {
	if len(out) > 0 {
		if _, werr := stdout.Write(out); werr != nil && err == nil {
			return types.NewError(types.ErrIOFailure, fmt.Sprintf("writing the result: %v", werr), "")
		}
	}
	return err
}

// OtherStore is a handler's refusal of an invocation whose configuration
// names store, when the agent serves served (both as described for logs):
// code 11, since the host's agent, not the network configuration, may be
// what has to change, and the runtime retries.
func OtherStore(plugin, store, served string) *types.Error {
	return types.NewError(types.ErrTryAgainLater, fmt.Sprintf(
		"%s: the configuration's store is %s, but this host's agent serves %s: point the configuration at the agent's cluster or run the agent of this one",
		plugin, store, served), "")
}
