package ipam

import (
	"context"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/ringipam/ringipam/pkg/hostlock"
	"github.com/ringipam/ringipam/pkg/names"
	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/retry"
	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/storeconfig"
)

// SupportedVersions are the CNI spec versions ipam-ring speaks.
var SupportedVersions = version.PluginSupports("0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0")

// Edge runs the verbs for skel.PluginMainFuncs: load config, open the
// store, call the core, print, map errors. The zero value opens the configured store and prints to
// os.Stdout.
type Edge struct {
	// Open returns an allocator for c and a function that closes it. Nil
	// means: open c's store (local or etcd) and wrap it in a pool.Allocator.
	Open func(ctx context.Context, c *Config) (Allocator, func() error, error)
	// Stdout receives ADD results; nil means os.Stdout.
	Stdout io.Writer
	// ToAgent, if set, sends each invocation on an etcd store to the host
	// agent (forward.go), which runs it; this process only prints its
	// answer. The plugin's main sets it; tests that run the verbs in
	// process leave it off.
	ToAgent bool
}

// Funcs returns the five verbs for skel.PluginMainFuncs.
func (e Edge) Funcs() skel.CNIFuncs {
	return skel.CNIFuncs{Add: e.Add, Del: e.Del, Check: e.Check, GC: e.GC, Status: e.Status}
}

func (e Edge) stdout() io.Writer {
	if e.Stdout == nil {
		return os.Stdout
	}
	return e.Stdout
}

// Add is the ADD verb.
func (e Edge) Add(args *skel.CmdArgs) error { return e.call("ADD", args) }

// Del is the DEL verb. It needs no network namespace.
func (e Edge) Del(args *skel.CmdArgs) error { return e.call("DEL", args) }

// Check is the CHECK verb.
func (e Edge) Check(args *skel.CmdArgs) error { return e.call("CHECK", args) }

// GC is the GC verb (CNI 1.1).
func (e Edge) GC(args *skel.CmdArgs) error { return e.call("GC", args) }

// Status is the STATUS verb (CNI 1.1): code 50 when ADD cannot be served.
func (e Edge) Status(args *skel.CmdArgs) error { return e.call("STATUS", args) }

// A verb runs one CNI command on a loaded configuration under parent and
// returns the error the runtime sees (a *types.Error, or nil).
type verb func(e Edge, parent context.Context, c *Config, args *skel.CmdArgs) error

// verbs are the verbs by CNI_COMMAND.
var verbs = map[string]verb{"ADD": Edge.add, "DEL": Edge.del, "CHECK": Edge.check, "GC": Edge.gc, "STATUS": Edge.status}

// call runs the verb of command for args: through the host agent when
// ToAgent is set and the store is etcd, here otherwise.
func (e Edge) call(command string, args *skel.CmdArgs) error {
	if err := checkSize(args.StdinData); err != nil {
		return wire(err)
	}
	c, err := Load(args.StdinData, args.Args)
	if err != nil {
		return wire(err)
	}
	if e.ToAgent && c.Store.Type == storeconfig.TypeEtcd {
		// The names first, as dispatch checks them: a DEL with a bad name
		// must fail here (7), not be queued for an agent that would
		// refuse it every time.
		if err := checkNames(command, c, args); err != nil {
			return err
		}
		return e.forward(command, c, args)
	}
	return e.dispatch(context.Background(), command, c, args)
}

// dispatch runs command's verb, here or for the agent, once the names of
// the attachment passed pkg/names' rules (code 7 otherwise, before any
// store work). GC and STATUS name no attachment.
func (e Edge) dispatch(ctx context.Context, command string, c *Config, args *skel.CmdArgs) error {
	if err := checkNames(command, c, args); err != nil {
		return err
	}
	return verbs[command](e, ctx, c, args)
}

// checkNames refuses (code 7) the names of the attachment of an ADD, DEL
// or CHECK that break pkg/names' rules. GC and STATUS name no attachment.
func checkNames(command string, c *Config, args *skel.CmdArgs) error {
	switch command {
	case "ADD", "DEL", "CHECK":
		if err := names.CNI(c.Network, args.ContainerID, args.IfName); err != nil {
			return wire(fmt.Errorf("%w: %w", ErrBadConfig, err))
		}
	}
	return nil
}

// run opens the allocator for c under c's timeout (counted within
// parent), calls fn and closes the allocator again.
func (e Edge) run(parent context.Context, c *Config, fn func(ctx context.Context, a Allocator) error) error {
	ctx, cancel := context.WithTimeout(parent, c.Timeout)
	defer cancel()
	open := e.Open
	if open == nil {
		open = OpenAllocator
	}
	a, closeFn, err := open(ctx, c)
	if err != nil {
		return err
	}
	err = fn(ctx, a)
	if cerr := closeFn(); cerr != nil {
		// What was committed stays committed: a failed close (a dropped
		// etcd connection) must not turn a done ADD into a failure.
		fmt.Fprintf(os.Stderr, "ipam-ring: closing store: %v\n", cerr)
	}
	return err
}

// contentionRetry is the retry policy for store conflicts. Concurrent ADDs
// on one host queue on the host lock (/run/ringipam/locks), so what is
// left to retry is contention between hosts: ring changes when a host
// claims space. A runtime starting dozens of containers at once on many
// hosts should see them wait (within the invocation's timeout, which also
// bounds this policy) rather than fail with code 11.
func contentionRetry() retry.Policy {
	return retry.Policy{Attempts: 50, BaseDelay: time.Millisecond, MaxDelay: 80 * time.Millisecond}
}

// OpenAllocator opens c's store and returns a pool allocator for c.Host on
// it, with c.Timeout as the allocator's default deadline.
func OpenAllocator(ctx context.Context, c *Config) (Allocator, func() error, error) {
	st, err := openStore(ctx, c.Store)
	if err != nil {
		return nil, nil, fmt.Errorf("opening store: %w", err)
	}
	a, err := newAllocator(st, c, hostlock.DefaultDir)
	if err != nil {
		st.Close()
		return nil, nil, err
	}
	return a, st.Close, nil
}

// newAllocator is the pool allocator of c on the open store st, queueing
// this host's callers on locks (for a store that cannot be held).
func newAllocator(st store.Store, c *Config, locks pool.HostLocker) (*pool.Allocator, error) {
	opts := []pool.Option{pool.WithTimeout(c.Timeout), pool.WithRetry(contentionRetry()),
		pool.WithHostLock(locks), pool.WithReservationHold(c.ReservationHold), pool.WithLastSeen()}
	if notes, ok := locks.(pool.NoteKeeper); ok && c.Store.Type == storeconfig.TypeEtcd {
		// The notes of one etcd cluster (and prefix): configurations
		// naming another keep their own, rather than spoiling these.
		opts = append(opts, pool.WithNotes(clusterNotes{notes, clusterTag(c.Store)}))
	}
	a, err := pool.New(st, c.Host, opts...)
	if err != nil {
		return nil, fmt.Errorf("%w: host %q: %w", ErrBadConfig, c.Host, err)
	}
	return a, nil
}

func attachment(args *skel.CmdArgs) Attachment {
	return Attachment{ContainerID: args.ContainerID, IfName: args.IfName}
}

func (e Edge) add(parent context.Context, c *Config, args *skel.CmdArgs) error {
	if c.Chained {
		// Chained only for GC/STATUS: pass the previous result through.
		if c.PrevResult == nil {
			return wire(badConfig("\"chained\": true needs a prevResult (put ipam-ring after the main plugin)"))
		}
		return wire(printAs(e.stdout(), c.PrevResult, c.CNIVersion))
	}
	var res types.Result
	err := e.run(parent, c, func(ctx context.Context, a Allocator) error {
		r, err := Add(ctx, a, c, attachment(args))
		res = r
		return err
	})
	if err != nil {
		return wire(err)
	}
	return wire(printAs(e.stdout(), res, c.CNIVersion))
}

func (e Edge) del(parent context.Context, c *Config, args *skel.CmdArgs) error {
	if c.Chained {
		return nil // the main plugin's IPAM delegation releases
	}
	return wire(e.run(parent, c, func(ctx context.Context, a Allocator) error {
		return Del(ctx, a, c, attachment(args))
	}))
}

func (e Edge) check(parent context.Context, c *Config, args *skel.CmdArgs) error {
	if c.Chained {
		return nil
	}
	return wire(e.run(parent, c, func(ctx context.Context, a Allocator) error {
		return Check(ctx, a, c, attachment(args))
	}))
}

func (e Edge) gc(parent context.Context, c *Config, _ *skel.CmdArgs) error {
	return wire(e.run(parent, c, func(ctx context.Context, a Allocator) error {
		_, err := GC(ctx, a, c)
		return err
	}))
}

func (e Edge) status(parent context.Context, c *Config, _ *skel.CmdArgs) error {
	err := e.run(parent, c, func(ctx context.Context, a Allocator) error {
		return Status(ctx, a, c)
	})
	if err == nil {
		return nil
	}
	return statusError(err)
}

// printAs prints r to w as CNI version ver (types.PrintResult's
// conversion, to w rather than os.Stdout: the agent captures it).
func printAs(w io.Writer, r types.Result, ver string) error {
	out, err := r.GetAsVersion(ver)
	if err != nil {
		return fmt.Errorf("%w: cannot express the result as CNI %s: %w", ErrBadConfig, ver, err)
	}
	return out.PrintTo(w)
}

// wire returns err as a *types.Error, and a nil error (not a typed nil
// pointer) when there is none.
func wire(err error) error {
	if err == nil {
		return nil
	}
	return CNIError(err)
}
