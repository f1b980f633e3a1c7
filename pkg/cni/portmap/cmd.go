package portmap

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/ringipam/ringipam/pkg/hostlock"
	"github.com/ringipam/ringipam/pkg/names"
	"github.com/ringipam/ringipam/pkg/portalloc"
	"github.com/ringipam/ringipam/pkg/retry"
	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/storeconfig"
)

// SupportedVersions are the CNI versions the plugin speaks (chained
// plugins need prevResult: 0.4.0 and later).
var SupportedVersions = version.PluginSupports("0.4.0", "1.0.0", "1.1.0")

// Opened is what one invocation works on.
type Opened struct {
	Ports     Ports
	Dataplane Dataplane // nil when the host has no packet filter tool (DEL, GC)
	Ping      func(ctx context.Context) error
	Close     func() error
}

// Edge runs the verbs for skel.PluginMainFuncs: load config, open the store and the data
// path, call the core, print, map errors. The zero value opens the
// configured store and data path and prints to os.Stdout.
type Edge struct {
	// Open, when set, replaces opening the store and data path (tests).
	Open func(ctx context.Context, c *Config) (Opened, error)
	// Stdout receives ADD results; nil means os.Stdout. Stderr receives
	// the log of chosen ports and findings; nil means os.Stderr.
	Stdout, Stderr io.Writer
	// Locks is where the attachments' locks are kept (lockAttachment);
	// empty means hostlock.DefaultDir.
	Locks hostlock.Dir
	// ToAgent, if set, sends each invocation on an etcd store to the host
	// agent (agent.go). The plugin's main sets it.
	ToAgent bool

	// ctx and hostname are the invocation's context and the plugin's
	// hostname when the agent runs it (AgentHandler); zero in the plugin.
	ctx      context.Context
	hostname string
}

// lockAttachment takes the lock of attachment id for an ADD or a DEL, with
// hostlock.LockWithChildren: the nft (or iptables) process an ADD starts
// keeps it. A runtime that kills an ADD on its timeout and then sends the
// DEL would otherwise race the killed ADD's nft, still running: its rules
// could land after the DEL removed the attachment's, forwarding a released
// port. The DEL waits for that nft instead (within its deadline).
func (e Edge) lockAttachment(ctx context.Context, id portalloc.EndpointID) (func(), error) {
	release, err := e.lockDir().LockWithChildren(ctx, attachmentLock(id))
	if err != nil {
		return nil, fmt.Errorf("attachment %s: %w", id, err)
	}
	return release, nil
}

func (e Edge) lockDir() hostlock.Dir {
	if e.Locks == "" {
		return hostlock.DefaultDir
	}
	return e.Locks
}

// attachmentLockPrefix begins the name of every attachment's lock.
const attachmentLockPrefix = "portmap-"

func attachmentLock(id portalloc.EndpointID) string { return MarkLock(Mark(id)) }

// MarkLock is the name of the lock (in hostlock.DefaultDir) that the ADD
// and the DEL of the attachment marked mark hold while they change its
// allocation and its forwards: the host agent takes it before it removes
// forwards it found stale, so it never removes those of an ADD under way.
func MarkLock(mark string) string {
	if rest, ok := strings.CutPrefix(mark, portalloc.Kind+"/#"); ok {
		if _, h, ok := strings.Cut(rest, "/"); ok {
			return attachmentLockPrefix + h // Mark's hash of the holder name
		}
	}
	return attachmentLockPrefix + shortHash(mark, 32)
}

// locked runs fn holding attachment id's lock (lockAttachment). With
// discard, a successful fn ends the attachment: its lock file is removed
// before the lock is let go (hostlock.Dir.Discard), so that a host does
// not keep one file for every attachment it ever had.
func (e Edge) locked(ctx context.Context, id portalloc.EndpointID, discard bool, fn func() error) error {
	unlock, err := e.lockAttachment(ctx, id)
	if err != nil {
		return err
	}
	defer unlock()
	if err := fn(); err != nil {
		return err
	}
	if discard {
		// Best effort: a file left is one file, swept by the next GC.
		_ = e.lockDir().Discard(attachmentLock(id))
	}
	return nil
}

// Funcs returns the five verbs for skel.PluginMainFuncs.
func (e Edge) Funcs() skel.CNIFuncs {
	return skel.CNIFuncs{Add: e.via("ADD", e.Add), Del: e.via("DEL", e.Del), Check: e.via("CHECK", e.Check),
		GC: e.via("GC", e.GC), Status: e.via("STATUS", e.Status)}
}

func (e Edge) stderr() io.Writer {
	if e.Stderr == nil {
		return os.Stderr
	}
	return e.Stderr
}

// contentionRetry: concurrent ADDs of one host start their dynamic searches
// at different places, so conflicts are rare; those left wait (within the
// invocation's timeout) rather than fail with code 11.
func contentionRetry() retry.Policy {
	return retry.Policy{Attempts: 50, BaseDelay: time.Millisecond, MaxDelay: 80 * time.Millisecond}
}

// OpenConfigured opens c's store, an allocator for c's host on it, and c's
// data path. A host without nft and iptables gets no data path (Dataplane
// nil): ADD and CHECK then fail, DEL and GC still release.
func OpenConfigured(_ context.Context, c *Config) (Opened, error) {
	st, err := storeconfig.Open(c.Store)
	if err != nil {
		return Opened{}, fmt.Errorf("opening store: %w", err)
	}
	a, err := portalloc.New(st, c.Host, portalloc.WithDynamicRange(c.Lo, c.Hi), portalloc.WithRetry(contentionRetry()))
	if err != nil {
		st.Close()
		return Opened{}, fmt.Errorf("%w: %w", ErrBadConfig, err)
	}
	dp, err := NewDataplane(c.Dataplane, c.Table)
	if err != nil && !errors.Is(err, ErrNoDataplane) {
		st.Close()
		return Opened{}, err
	}
	return Opened{Ports: a, Dataplane: dp, Ping: func(ctx context.Context) error { return store.Ping(ctx, st) }, Close: st.Close}, nil
}

// run opens what c names under c's timeout, calls fn and closes again.
func (e Edge) run(c *Config, fn func(ctx context.Context, o Opened) error) error {
	parent := e.ctx
	if parent == nil {
		parent = context.Background()
	}
	ctx, cancel := context.WithTimeout(parent, c.Timeout)
	defer cancel()
	open := e.Open
	if open == nil {
		open = OpenConfigured
	}
	o, err := open(ctx, c)
	if err != nil {
		return err
	}
	err = fn(ctx, o)
	if err != nil && errors.Is(ctx.Err(), context.DeadlineExceeded) && !errors.Is(err, context.DeadlineExceeded) {
		// A step cut short by the deadline often says only how it ended
		// (nft killed by its context: "signal: killed"): it is the
		// deadline that failed the call, so the runtime may try again.
		err = fmt.Errorf("%w (the invocation's %s deadline passed: %w)", err, c.Timeout, context.DeadlineExceeded)
	}
	if cerr := o.Close(); cerr != nil {
		// What was committed stays committed.
		fmt.Fprintf(e.stderr(), "portmap-ingress: closing store: %v\n", cerr)
	}
	return err
}

func needDataplane(o Opened) error {
	if o.Dataplane == nil {
		return ErrNoDataplane
	}
	return nil
}

// checkAttachment refuses (code 7) a container ID or interface name that
// breaks pkg/names' rules, before any store work.
func checkAttachment(c *Config, args *skel.CmdArgs) error {
	if err := names.CNI(c.Network, args.ContainerID, args.IfName); err != nil {
		return fmt.Errorf("%w: %w", ErrBadConfig, err)
	}
	return nil
}

func attachment(c *Config, args *skel.CmdArgs) portalloc.EndpointID {
	return portalloc.EndpointID{Network: c.Network, ContainerID: args.ContainerID, IfName: args.IfName}
}

// Add is the ADD verb: publish, then pass prevResult on with the chosen
// ports added under "portMappings" (see publishedResult). The chosen ports
// are also logged on stderr and kept in the store (see README).
func (e Edge) Add(args *skel.CmdArgs) error {
	c, err := load(args.StdinData, args.Args, e.hostname)
	if err == nil {
		err = checkAttachment(c, args)
	}
	if err != nil {
		return wire(err)
	}
	if c.PrevResult == nil && c.MappingsErr == nil {
		return wire(badConfig("portmap-ingress is a chained plugin: it needs a prevResult (put it after the main plugin)"))
	}
	var pub Published
	if c.MappingsErr == nil && len(c.Mappings) > 0 {
		id := attachment(c, args)
		err = e.run(c, func(ctx context.Context, o Opened) error {
			if err := needDataplane(o); err != nil {
				return err
			}
			err := e.locked(ctx, id, false, func() (err error) {
				pub, err = Add(ctx, o.Ports, o.Dataplane, c, id)
				return err
			})
			if err != nil {
				return err
			}
			e.log(id, c, pub)
			return nil
		})
	} else {
		err = c.MappingsErr
	}
	if err != nil {
		return wire(err)
	}
	out := e.Stdout
	if out == nil {
		out = os.Stdout
	}
	r, err := c.PrevResult.GetAsVersion(c.CNIVersion)
	if err != nil {
		return wire(badConfig("cannot express the result as CNI %s: %v", c.CNIVersion, err))
	}
	if len(pub.Ports) == 0 {
		return wire(r.PrintTo(out))
	}
	b, err := publishedResult(r, c.Mappings, pub.Ports)
	if err != nil {
		return wire(fmt.Errorf("writing the result: %w", err))
	}
	_, err = out.Write(b)
	return wire(err)
}

// ResultMapping is one published port as ADD reports it in its result: the
// request's mapping with the host port the allocator chose (a dynamic one
// included) and its mode.
type ResultMapping struct {
	HostPort      uint16 `json:"hostPort"`
	ContainerPort uint16 `json:"containerPort"`
	Protocol      string `json:"protocol"`
	HostIP        string `json:"hostIP,omitempty"`
	Mode          string `json:"mode"`
}

// publishedResult is r as JSON with one more top-level key, "portMappings",
// listing the published ports in the order of the request. The CNI result
// types have no field for ports: a runtime or chained plugin that decodes
// the result into them ignores the key (so nothing downstream breaks), and
// a caller that reads the plugin's output sees the chosen ports.
func publishedResult(r types.Result, mappings []Mapping, ports []portalloc.Port) ([]byte, error) {
	raw, err := json.Marshal(r)
	if err != nil {
		return nil, err
	}
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(raw, &obj); err != nil {
		return nil, err
	}
	list := make([]ResultMapping, len(ports))
	for i, p := range ports {
		m := ResultMapping{HostPort: p.Number, Protocol: p.Protocol, Mode: string(p.Mode)}
		if i < len(mappings) {
			m.ContainerPort = mappings[i].ContainerPort
		}
		if p.HostIP.IsValid() {
			m.HostIP = p.HostIP.String()
		}
		list[i] = m
	}
	if obj["portMappings"], err = json.Marshal(list); err != nil {
		return nil, err
	}
	return json.MarshalIndent(obj, "", "    ")
}

// log writes one line with the chosen ports, and the findings and warnings.
func (e Edge) log(id portalloc.EndpointID, c *Config, pub Published) {
	var desc []string
	for i, p := range pub.Ports {
		on := ""
		if p.HostIP.IsValid() {
			on = p.HostIP.String() + ":"
		}
		desc = append(desc, fmt.Sprintf("%s %s %s%d->%d", p.Mode, p.Protocol, on, p.Number, c.Mappings[i].ContainerPort))
	}
	w := e.stderr()
	fmt.Fprintf(w, "portmap-ingress: %s on %s published %s\n", id, c.Host, strings.Join(desc, ", "))
	for _, f := range pub.Findings {
		fmt.Fprintf(w, "portmap-ingress: store inconsistency: %s\n", f)
	}
	for _, x := range pub.Warnings {
		fmt.Fprintf(w, "portmap-ingress: warning: %s\n", x)
	}
}

// Del is the DEL verb. It needs neither mappings nor prevResult.
func (e Edge) Del(args *skel.CmdArgs) error {
	c, err := load(args.StdinData, args.Args, e.hostname)
	if err == nil {
		err = checkAttachment(c, args)
	}
	if err != nil {
		return wire(err)
	}
	return wire(e.run(c, func(ctx context.Context, o Opened) error {
		id := attachment(c, args)
		return e.locked(ctx, id, true, func() error { return Del(ctx, o.Ports, o.Dataplane, id) })
	}))
}

// Check is the CHECK verb.
func (e Edge) Check(args *skel.CmdArgs) error {
	c, err := load(args.StdinData, args.Args, e.hostname)
	if err == nil {
		err = checkAttachment(c, args)
	}
	if err != nil {
		return wire(err)
	}
	return wire(e.run(c, func(ctx context.Context, o Opened) error {
		if err := needDataplane(o); err != nil {
			return err
		}
		return Check(ctx, o.Ports, o.Dataplane, c, attachment(c, args))
	}))
}

// GC is the GC verb (CNI 1.1).
func (e Edge) GC(args *skel.CmdArgs) error {
	c, err := load(args.StdinData, args.Args, e.hostname)
	if err != nil {
		return wire(err)
	}
	return wire(e.run(c, func(ctx context.Context, o Opened) error {
		cleaned, err := GC(ctx, o.Ports, o.Dataplane, c)
		for _, m := range cleaned {
			fmt.Fprintf(e.stderr(), "portmap-ingress: GC removed %s\n", m)
		}
		// The lock files no one holds: those of attachments whose DEL
		// never came or could not remove them. A live attachment's is made
		// again by its next call.
		if n, serr := e.lockDir().Sweep(ctx, attachmentLockPrefix); serr != nil {
			fmt.Fprintf(e.stderr(), "portmap-ingress: GC: sweeping lock files: %v\n", serr)
		} else if n > 0 {
			fmt.Fprintf(e.stderr(), "portmap-ingress: GC removed %d unused lock files\n", n)
		}
		return err
	}))
}

// Status is the STATUS verb (CNI 1.1): code 50 when ADD cannot be served
// (store unreachable, no packet filter tool, its table unreadable).
func (e Edge) Status(args *skel.CmdArgs) error {
	c, err := load(args.StdinData, args.Args, e.hostname)
	if err != nil {
		return wire(err)
	}
	err = e.run(c, func(ctx context.Context, o Opened) error {
		if err := o.Ping(ctx); err != nil {
			return err
		}
		if err := needDataplane(o); err != nil {
			return err
		}
		_, err := o.Dataplane.Marks(ctx)
		return err
	})
	if err != nil && !errors.Is(err, ErrBadConfig) {
		return types.NewError(CodePluginNotAvailable, err.Error(), "")
	}
	return wire(err)
}
