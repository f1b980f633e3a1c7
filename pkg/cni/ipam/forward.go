package ipam

import (
	"bytes"
	"context"
	"fmt"
	"os"

	"github.com/containernetworking/cni/pkg/skel"

	"github.com/ringipam/ringipam/pkg/agentapi"
	"github.com/ringipam/ringipam/pkg/hostlock"
	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/storeconfig"
)

// Whole invocations through the host agent (package agentapi).
//
// The plugin's side (Edge.forward): on an etcd store the plugin does no
// store work: it sends its whole invocation to the agent's socket (the
// store's "agentSocket", default /run/ringipam/agent.sock), which runs the
// verb with this package's code on its open store, and prints what the
// agent answers. Without an agent, ADD, CHECK, GC and STATUS fail with
// code 11 naming the socket and the service to start, and DEL is queued
// on disk (the store's "delQueue") for the agent to run when it starts
// (agentapi.Forward).
//
// The agent's side (AgentHandler): an agentapi.Handler on the agent's
// store.
//
// The local store needs no agent: the plugin opens the file itself.

// forward sends the invocation of command on c's etcd store to the host
// agent; the error is what the runtime sees.
func (e Edge) forward(command string, c *Config, args *skel.CmdArgs) error {
	req := agentapi.NewRequest(agentapi.PluginIPAM, command, args, c.Timeout)
	out, err := agentapi.Forward(context.Background(), c.Store.Socket(), c.Store.DelQueueDir(), req, os.Stderr)
	return agentapi.Print(e.stdout(), out, err)
}

// AgentHandler runs ipam-ring's invocations in the host agent, on the
// agent's open store. An invocation whose configuration does not load
// fails as in the plugin (code 7); one that names another store than the
// agent's (storeconfig.Config.SameStore: the prefix, and one endpoint in
// common) fails with code 11 naming both: the host's agent serves another
// cluster, which its operator, not the network configuration, may have to
// change, and the runtime retries.
type AgentHandler struct {
	// Store is the agent's open store, shared by every invocation.
	Store store.Store
	// Config describes Store.
	Config storeconfig.Config
	// HostLocks queues the invocations of this host; nil means
	// hostlock.DefaultDir.
	HostLocks pool.HostLocker
}

var _ agentapi.Handler = AgentHandler{}

// Serve implements agentapi.Handler.
func (h AgentHandler) Serve(ctx context.Context, req *agentapi.Request) agentapi.Answer {
	if _, ok := verbs[req.Command]; !ok {
		return agentapi.Answer{Error: fmt.Sprintf("ipam-ring has no command %q", req.Command)}
	}
	c, err := load(req.Stdin, req.Args, req.Hostname)
	if err != nil {
		return agentapi.Answer{CNIError: CNIError(err)}
	}
	if !h.Config.SameStore(c.Store) {
		return agentapi.Answer{CNIError: agentapi.OtherStore("ipam-ring", c.Store.Describe(), h.Config.Describe())}
	}
	args := req.CmdArgs()
	locks := h.HostLocks
	if locks == nil {
		locks = hostlock.DefaultDir
	}
	var stdout bytes.Buffer
	e := Edge{Stdout: &stdout, Open: func(context.Context, *Config) (Allocator, func() error, error) {
		a, err := newAllocator(h.Store, c, locks)
		if err != nil {
			return nil, nil, err
		}
		return a, func() error { return nil }, nil
	}}
	var a agentapi.Answer
	if err := e.dispatch(ctx, req.Command, c, args); err != nil {
		a.CNIError = CNIError(err)
	}
	a.Stdout = stdout.Bytes()
	return a
}
