package ipam

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"

	"github.com/ringipam/ringipam/pkg/hostlock"
	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/relay"
	"github.com/ringipam/ringipam/pkg/storeconfig"
)

// Whole invocations through the host agent.
//
// The plugin's side (Edge.forward): on an etcd store, before it loads its
// configuration, the plugin sends the invocation to the agent's socket
// (the store's "agentSocket", default /run/ringipam/store.sock; "off":
// never). If an agent answers and serves the same etcd cluster, it runs
// the verb with this package's code on its open store (its long-lived
// gRPC connection) and the plugin prints what it answers: one exchange
// with the agent instead of one per store call, and no configuration
// loaded or store opened in the plugin. Otherwise, and when the agent
// stops before answering, the plugin runs the call itself: every verb is
// idempotent (a repeated ADD returns the attachment's allocation), so a
// call the agent may have run is safe to run again. An agent that does not answer within the call's
// timeout fails it with code 11, as a store would.
//
// The agent's side (AgentInvoker): a relay.Invoker on the agent's store.
//
// Not for the local store: an agent serving a local store's invocations
// measured no faster than the plugin opening the file itself (the
// exchange's wake-ups cost what the plugin's store work does; two
// fdatasyncs per commit stay either way; docs/benchmarks.md), so the
// plugin opens the file and the agent has no socket on a local store.

// forward sends the invocation of command to the host agent. served is
// false when the plugin must run the call itself; otherwise err is what
// the runtime sees.
func (e Edge) forward(command string, args *skel.CmdArgs) (served bool, err error) {
	sock, timeout := agentSocketOf(args.StdinData)
	if sock == "" {
		return false, nil
	}
	host, _ := os.Hostname()
	out, served, err := relay.Invoke(sock, timeout, &relay.Invocation{
		Command: command, ContainerID: args.ContainerID, Netns: args.Netns, IfName: args.IfName,
		Args: args.Args, Path: args.Path, Hostname: host, Stdin: args.StdinData,
	})
	switch {
	case !served:
		return false, nil
	case errors.Is(err, os.ErrDeadlineExceeded):
		return true, types.NewError(types.ErrTryAgainLater, fmt.Sprintf("ipam-ring: %v", err), "")
	case err != nil:
		fmt.Fprintf(os.Stderr, "ipam-ring: %v; running the call here\n", err)
		return false, nil
	}
	if len(out.Stdout) > 0 {
		if _, err := e.stdout().Write(out.Stdout); err != nil {
			return true, types.NewError(types.ErrIOFailure, fmt.Sprintf("writing the result: %v", err), "")
		}
	}
	if len(out.Error) == 0 {
		return true, nil
	}
	te := &types.Error{}
	if err := json.Unmarshal(out.Error, te); err != nil {
		return true, types.NewError(types.ErrInternal, fmt.Sprintf("undecodable error from the host agent: %v", err), "")
	}
	return true, te
}

// agentSocketOf reads the agent's socket and the call's timeout from a
// configuration without loading it: "ipam.store.agentSocket", its default
// applied, and "ipam.timeout". The socket is "" for a local store, when it
// is "off", and when the configuration cannot be read: the plugin then
// runs the call itself (and reports the configuration's problem).
func agentSocketOf(stdin []byte) (socket string, timeout time.Duration) {
	if !bytes.Contains(stdin, []byte(storeconfig.TypeEtcd)) {
		// No etcd store in it (the common local store): not worth
		// decoding. A type spelt with escapes is run here, which is safe.
		return "", 0
	}
	var n agentJSON
	if err := json.Unmarshal(stdin, &n); err != nil {
		return "", 0
	}
	timeout, err := parseTimeout(n.IPAM.Timeout)
	if err != nil {
		return "", 0
	}
	st := n.IPAM.Store
	return storeconfig.Config{Type: st.Type, AgentSocket: st.AgentSocket}.Socket(), timeout
}

// agentJSON is what the plugin reads of its configuration to find the
// agent: the store's type and socket, and the call's timeout.
type agentJSON struct {
	IPAM struct {
		Timeout string `json:"timeout"`
		Store   struct {
			Type        string `json:"type"`
			AgentSocket string `json:"agentSocket"`
		} `json:"store"`
	} `json:"ipam"`
}

// AgentInvoker runs forwarded invocations in the host agent, on the
// agent's open store. It serves an invocation whose configuration loads
// and names the same store (storeconfig.Config.SameStore) and refuses the
// rest, which their plugins then run themselves.
type AgentInvoker struct {
	// Store is the agent's open store, shared by every invocation.
	Store store.Store
	// Config describes Store.
	Config storeconfig.Config
	// HostLocks queues the invocations with this host's plugins that run
	// calls themselves; nil means hostlock.DefaultDir, where they queue.
	HostLocks pool.HostLocker
}

var _ relay.Invoker = AgentInvoker{}

// Accept implements relay.Invoker.
func (s AgentInvoker) Accept(inv *relay.Invocation) (func(context.Context) relay.Outcome, time.Duration, bool) {
	if _, ok := verbs[inv.Command]; !ok {
		return nil, 0, false
	}
	c, err := load(inv.Stdin, inv.Args, inv.Hostname)
	if err != nil || !s.Config.SameStore(c.Store) {
		return nil, 0, false
	}
	args := &skel.CmdArgs{ContainerID: inv.ContainerID, Netns: inv.Netns, IfName: inv.IfName,
		Args: inv.Args, Path: inv.Path, StdinData: inv.Stdin}
	locks := s.HostLocks
	if locks == nil {
		locks = hostlock.DefaultDir
	}
	run := func(ctx context.Context) relay.Outcome {
		var stdout bytes.Buffer
		e := Edge{Stdout: &stdout, Open: func(context.Context, *Config) (Allocator, func() error, error) {
			a, err := newAllocator(s.Store, c, locks)
			if err != nil {
				return nil, nil, err
			}
			return a, func() error { return nil }, nil
		}}
		var out relay.Outcome
		if err := e.dispatch(ctx, inv.Command, c, args); err != nil {
			b, merr := json.Marshal(CNIError(err))
			if merr != nil {
				b, _ = json.Marshal(types.NewError(types.ErrInternal, err.Error(), ""))
			}
			out.Error = b
		}
		out.Stdout = stdout.Bytes()
		return out
	}
	return run, c.Timeout, true
}
