package portmap

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"slices"

	"github.com/containernetworking/cni/pkg/skel"

	"github.com/ringipam/ringipam/pkg/agentapi"
	"github.com/ringipam/ringipam/pkg/hostlock"
	"github.com/ringipam/ringipam/pkg/portalloc"
	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/storeconfig"
)

// Whole invocations through the host agent (package agentapi), as
// ipam-ring's: on an etcd store the plugin sends its invocation to the
// agent's socket and prints the answer; the agent runs the same verb
// (AgentHandler) on its open store, with the data path of its own network
// namespace (the host's: the agent runs there, as the runtime does). The
// local store needs no agent.

// via runs verb here, or through the host agent when ToAgent is set and
// the configuration's store is etcd.
func (e Edge) via(command string, verb func(*skel.CmdArgs) error) func(*skel.CmdArgs) error {
	return func(args *skel.CmdArgs) error {
		if !e.ToAgent {
			return verb(args)
		}
		c, err := Load(args.StdinData, args.Args)
		if err != nil {
			return wire(err)
		}
		if c.Store.Type != storeconfig.TypeEtcd {
			return verb(args)
		}
		if command == "ADD" || command == "DEL" || command == "CHECK" {
			// As the verb checks them: a DEL with a bad name fails here
			// (7), rather than be queued for an agent that refuses it.
			if err := checkAttachment(c, args); err != nil {
				return wire(err)
			}
		}
		req := agentapi.NewRequest(agentapi.PluginPortmap, command, args, c.Timeout)
		out, err := agentapi.Forward(context.Background(), c.Store.Socket(), c.Store.DelQueueDir(), req, e.stderr())
		stdout := e.Stdout
		if stdout == nil {
			stdout = os.Stdout
		}
		return agentapi.Print(stdout, out, err)
	}
}

// AgentHandler runs portmap-ingress's invocations in the host agent, on
// the agent's open store. As ipam-ring's (ipamring.AgentHandler): a
// configuration that does not load fails with code 7, one naming another
// store than the agent's with code 11. What the verb logs (the chosen
// ports) goes back to the plugin, which writes it to its stderr.
type AgentHandler struct {
	// Store is the agent's open store; Config describes it.
	Store  store.Store
	Config storeconfig.Config
	// Locks is where the attachments' locks are kept (the plugins' own
	// directory); empty means hostlock.DefaultDir.
	Locks hostlock.Dir
	// Dataplane opens c's data path; nil means NewDataplane (tests set a
	// fake).
	Dataplane func(c *Config) (Dataplane, error)
}

var _ agentapi.Handler = AgentHandler{}

// Serve implements agentapi.Handler.
func (h AgentHandler) Serve(ctx context.Context, req *agentapi.Request) agentapi.Answer {
	var stdout, stderr bytes.Buffer
	e := Edge{Stdout: &stdout, Stderr: &stderr, Locks: h.Locks, ctx: ctx, hostname: req.Hostname}
	if !slices.Contains([]string{"ADD", "DEL", "CHECK", "GC", "STATUS"}, req.Command) {
		return agentapi.Answer{Error: fmt.Sprintf("portmap-ingress has no command %q", req.Command)}
	}
	c, err := load(req.Stdin, req.Args, req.Hostname)
	if err != nil {
		return agentapi.Answer{CNIError: CNIError(err)}
	}
	if !h.Config.SameStore(c.Store) {
		return agentapi.Answer{CNIError: agentapi.OtherStore("portmap-ingress", c.Store.Describe(), h.Config.Describe())}
	}
	e.Open = func(_ context.Context, c *Config) (Opened, error) {
		a, err := portalloc.New(h.Store, c.Host, portalloc.WithDynamicRange(c.Lo, c.Hi), portalloc.WithRetry(contentionRetry()))
		if err != nil {
			return Opened{}, fmt.Errorf("%w: %w", ErrBadConfig, err)
		}
		open := h.Dataplane
		if open == nil {
			open = func(c *Config) (Dataplane, error) { return NewDataplane(c.Dataplane, c.Table) }
		}
		dp, err := open(c)
		if err != nil && !errors.Is(err, ErrNoDataplane) {
			return Opened{}, err
		}
		return Opened{Ports: a, Dataplane: dp, Ping: func(ctx context.Context) error { return store.Ping(ctx, h.Store) },
			Close: func() error { return nil }}, nil
	}
	// The verbs are bound to e now that it is complete (method values
	// copy their receiver).
	verb := map[string]func(*skel.CmdArgs) error{"ADD": e.Add, "DEL": e.Del, "CHECK": e.Check, "GC": e.GC, "STATUS": e.Status}[req.Command]
	var a agentapi.Answer
	if err := verb(req.CmdArgs()); err != nil {
		a.CNIError = CNIError(err)
	}
	a.Stdout, a.Stderr = stdout.Bytes(), stderr.Bytes()
	return a
}
