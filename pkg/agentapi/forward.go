package agentapi

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/containernetworking/cni/pkg/types"
)

// Forward is the plugins' side on an etcd store: it sends req (its
// Plugin, Command and the rest set by the caller) to the agent at socket
// and returns what the plugin prints, or the error to return to the
// runtime, always a *types.Error:
//   - the agent ran the verb: its stdout, or its CNI error as is (what
//     the verb logged is written to notes);
//   - no agent (ErrNoAgent), no answer (ErrNoAnswer) or an agent of
//     another protocol version (*VersionError): a DEL is queued in the
//     directory delQueue (DelQueue) and succeeds, with a note on notes
//     (stderr; nil: none); any other command fails with code 11 naming
//     the socket and the service to start (or the versions to align);
//   - a DEL that cannot be queued (the queue is full, the disk fails)
//     fails with code 11 saying why;
//   - the agent refused the call for another reason (ErrRefused): code 11
//     with the agent's reason.
func Forward(ctx context.Context, socket, delQueue string, req *Request, notes io.Writer) ([]byte, error) {
	a, err := Call(ctx, socket, req)
	if err == nil {
		if notes != nil && len(a.Stderr) > 0 {
			_, _ = notes.Write(a.Stderr)
		}
		if a.CNIError != nil {
			return a.Stdout, a.CNIError
		}
		return a.Stdout, nil
	}
	unreached := errors.Is(err, ErrNoAgent) || errors.Is(err, ErrNoAnswer) || errors.Is(err, ErrVersion)
	if req.Command == "DEL" && unreached {
		qerr := DelQueue{Dir: delQueue}.Put(req)
		if qerr != nil {
			return nil, types.NewError(types.ErrTryAgainLater,
				fmt.Sprintf("%s: %v; queuing the DEL for the agent failed too: %v", req.Plugin, err, qerr), "")
		}
		if notes != nil {
			fmt.Fprintf(notes, "%s: %v; the DEL is queued in %s, and the host agent runs it when it starts\n", req.Plugin, err, delQueue)
		}
		return nil, nil
	}
	var msg string
	switch {
	case errors.Is(err, ErrNoAgent):
		msg = fmt.Sprintf("%s: %v: start the host agent on this host (the ringipamd service, or the ringipam DaemonSet's pod on Kubernetes); on etcd the plugins run every call but a queued DEL through it", req.Plugin, err)
	default:
		msg = fmt.Sprintf("%s: %v", req.Plugin, err)
	}
	// The code travels in the plugin's JSON, but runtimes show operators
	// only the message (kubelet's FailedCreatePodSandBox events): say it.
	msg += " (CNI code 11: try again later)"
	return nil, types.NewError(types.ErrTryAgainLater, msg, "")
}
