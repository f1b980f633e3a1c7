package cli

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/netip"
	"os"
	"strings"
	"time"

	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/portalloc"
	"github.com/ringipam/ringipam/pkg/store"
	_ "github.com/ringipam/ringipam/pkg/store/etcd" // storeconfig.Open's etcd backend
	"github.com/ringipam/ringipam/pkg/storeconfig"
)

// Exit codes of ringctl.
const (
	ExitOK          = 0 // done; nothing wrong found
	ExitFindings    = 1 // check found violations, explain says an ADD would fail, import refused an owner
	ExitUsage       = 2 // bad arguments, flags or configuration
	ExitUnavailable = 3 // the store cannot be reached or stayed busy: try again later
	ExitFailed      = 4 // refused (a live host, a held address), not found, or failed otherwise
)

var (
	errNotFound = errors.New("not found")
	errRefused  = errors.New("refused")
)

func notFoundf(format string, a ...any) error {
	return fmt.Errorf("%w: %s", errNotFound, fmt.Sprintf(format, a...))
}

// ExitCode maps a command's error to its exit code.
func ExitCode(err error) int {
	switch {
	case err == nil:
		return ExitOK
	case errors.Is(err, errUsage), errors.Is(err, pool.ErrInvalid), errors.Is(err, storeconfig.ErrInvalid), errors.Is(err, portalloc.ErrInvalid):
		return ExitUsage
	case errors.Is(err, store.ErrUnavailable), errors.Is(err, pool.ErrTryAgain), errors.Is(err, context.DeadlineExceeded):
		return ExitUnavailable
	}
	return ExitFailed
}

// Env is what Main needs from the process.
type Env struct {
	Stdout, Stderr io.Writer
	Getenv         func(string) string
	ReadFile       func(string) ([]byte, error)
	Now            func() time.Time
}

// OSEnv is the process's own environment.
func OSEnv() Env {
	return Env{Stdout: os.Stdout, Stderr: os.Stderr, Getenv: os.Getenv, ReadFile: os.ReadFile, Now: time.Now}
}

// globals are the flags every command takes.
type globals struct {
	store       StoreFlags
	json        bool
	timeout     time.Duration
	orphanAfter time.Duration
	hold        time.Duration
}

func (g *globals) register(fs *flag.FlagSet, withHost bool) {
	s := &g.store
	fs.StringVar(&s.Config, "config", s.Config, "store (and network) from `FILE`: CNI conflist or config, driver config, store object")
	fs.StringVar(&s.DataDir, "data-dir", s.DataDir, "local store: `DIR` holding store.db (default /var/lib/ringipam)")
	s.Store.Register(fs)
	if withHost {
		fs.StringVar(&s.Host, "host", s.Host, "this host's `NAME` in the store (default: the config's, else the hostname)")
	}
	fs.BoolVar(&g.json, "json", g.json, "print JSON instead of text")
	fs.DurationVar(&g.timeout, "timeout", g.timeout, "bound for the whole command")
	fs.DurationVar(&g.orphanAfter, "orphan-after", g.orphanAfter, "a host down this long is orphaned")
	fs.DurationVar(&g.hold, "reservation-hold", g.hold, "hold after a reservation's release (the plugin's reservationHold)")
}

// run is a command's core call: it returns the value to print as JSON, its
// text rendering, and the exit code when there is no error.
type run func(ctx context.Context, c *Ctl, s Settings, pos []string) (any, func(io.Writer), int, error)

type command struct {
	name     string // "status", "hold drop", ...
	args     string
	help     string
	hostFlag bool // the global --host is this command's (ls and ports filter by --host instead)
	setup    func(fs *flag.FlagSet, env Env) run
}

var commands = []command{
	{"status", "[--pool P]", "pools (size, used, held, free), hosts (state, last seen), each pool's ring", true, setupStatus},
	{"ls", "[--pool P] [--host H] [--owner O] [--no-holds]", "held addresses: owner, front end, reservation, host, age", false, setupLs},
	{"ports", "[--host H] [--mode host|ingress] [--owner O]", "published ports by mode, protocol, host and owner", false, setupPorts},
	{"release", "ADDRESS [--pool P] | --owner O  [--no-hold] [--dry-run]", "release the owner of ADDRESS, or every owner O matches", true, setupRelease},
	{"hold drop", "NAME --network N [--kind K] [--dry-run]", "free the addresses held for released reservation NAME", true, setupHoldDrop},
	{"rmpeer", "HOST [--force] [--tombstone] [--dry-run]", "remove HOST: tombstone its ranges, release its owners and ports", true, setupRmpeer},
	{"leave", "HOST [--force] [--dry-run]", "HOST leaves (weave reset): release its owners and ports; its ranges go to the owners of the ranges before them", true, setupLeave},
	{"gc", "[--dry-run]", "reclaim orphaned hosts, drop ended holds, repair the owner index", true, setupGC},
	{"host ack", "[HOST]", "clear HOST's orphaned mark (default: this host)", true, setupHostAck},
	{"check", "", "check the store's invariants; one line per violation", true, setupCheck},
	{"import host-local", "DIR [--network N] [--host H] [--conflist FILE] [--dry-run]", "adopt host-local's allocations in DIR", true, setupImport},
	{"history", "ADDRESS [--pool P]", "who held ADDRESS, and when", true, setupHistory},
	{"explain", "[--pool P]... [--ip A] [--container ID [--ifname I]] [--reservation R]", "why an ADD would fail now", true, setupExplain},
}

// Usage prints the command summary.
func Usage(w io.Writer) {
	fmt.Fprintln(w, "usage: ringctl [global flags] COMMAND [flags] [args]")
	fmt.Fprintln(w, "")
	for _, c := range commands {
		fmt.Fprintf(w, "  %-18s %s\n", c.name, c.args)
		fmt.Fprintf(w, "  %-18s   %s\n", "", c.help)
	}
	fmt.Fprintln(w, "")
	fmt.Fprintln(w, "global flags (before or after the command; RINGIPAM_* variables set the same):")
	fs := flag.NewFlagSet("ringctl", flag.ContinueOnError)
	g := defaultGlobals()
	g.register(fs, true)
	fs.SetOutput(w)
	fs.PrintDefaults()
	fmt.Fprintln(w, "")
	fmt.Fprintln(w, "exit codes: 0 ok, 1 findings (check, explain, import), 2 usage, 3 store unavailable, 4 failed")
}

func defaultGlobals() globals {
	return globals{timeout: 60 * time.Second, orphanAfter: pool.DefaultOrphanAfter, hold: pool.DefaultReservationHold}
}

// Main runs ringctl with args (without the program name) and returns the
// exit code.
func Main(args []string, env Env) int {
	g := defaultGlobals()
	top := flag.NewFlagSet("ringctl", flag.ContinueOnError)
	top.SetOutput(io.Discard)
	g.register(top, true)
	if err := top.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			Usage(env.Stdout)
			return ExitOK
		}
		fmt.Fprintf(env.Stderr, "ringctl: %v\n", err)
		Usage(env.Stderr)
		return ExitUsage
	}
	rest := top.Args()
	if len(rest) == 0 || rest[0] == "help" {
		Usage(env.Stdout)
		if len(rest) == 0 {
			return ExitUsage
		}
		return ExitOK
	}
	var cmd *command
	for i := range commands {
		words := strings.Fields(commands[i].name)
		if len(rest) >= len(words) && strings.Join(rest[:len(words)], " ") == commands[i].name {
			cmd, rest = &commands[i], rest[len(words):]
			break
		}
	}
	if cmd == nil {
		fmt.Fprintf(env.Stderr, "ringctl: unknown command %q\n", strings.Join(rest, " "))
		Usage(env.Stderr)
		return ExitUsage
	}
	fs := flag.NewFlagSet("ringctl "+cmd.name, flag.ContinueOnError)
	fs.SetOutput(env.Stderr)
	fs.Usage = func() {
		fmt.Fprintf(env.Stderr, "usage: ringctl %s %s\n  %s\n", cmd.name, cmd.args, cmd.help)
		fs.PrintDefaults()
	}
	g.register(fs, cmd.hostFlag)
	runFn := cmd.setup(fs, env)
	pos, err := parseInterleaved(fs, rest)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return ExitOK
		}
		return ExitUsage
	}
	out, render, code, err := g.execute(runFn, pos, env)
	if err != nil {
		code = ExitCode(err)
		fmt.Fprintf(env.Stderr, "ringctl %s: %v\n", cmd.name, err)
		if g.json {
			writeJSON(env.Stdout, map[string]any{"error": err.Error(), "exit": code})
		} else if partial(out) && render != nil {
			render(env.Stdout) // what a repair did before it failed
		}
		return code
	}
	if g.json {
		writeJSON(env.Stdout, out)
	} else {
		render(env.Stdout)
	}
	return code
}

// partial reports whether out lists what a repair did before an error.
func partial(out any) bool {
	switch v := out.(type) {
	case Actions:
		return len(v.Actions) > 0
	case ImportReport:
		return len(v.Owners) > 0
	}
	return false
}

func writeJSON(w io.Writer, v any) {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.Encode(v)
}

// parseInterleaved parses flags that may come before, between or after
// positional arguments, and returns the positional ones.
func parseInterleaved(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		args = fs.Args()
		if len(args) == 0 {
			return pos, nil
		}
		pos, args = append(pos, args[0]), args[1:]
	}
}

// execute resolves the settings, opens the store and runs the command.
func (g *globals) execute(fn run, pos []string, env Env) (any, func(io.Writer), int, error) {
	f, err := g.store.withEnv(env.Getenv)
	if err != nil {
		return nil, nil, 0, err
	}
	for _, d := range f.Store.Deprecated() {
		fmt.Fprintf(env.Stderr, "ringctl: warning: %s\n", d)
	}
	var file []byte
	if f.Config != "" {
		b, err := env.ReadFile(f.Config)
		if err != nil {
			return nil, nil, 0, usagef("--config: %v", err)
		}
		file = b
	}
	s, err := Resolve(f, file)
	if err != nil {
		return nil, nil, 0, err
	}
	host, err := storeconfig.HostName(s.Host)
	if err != nil {
		return nil, nil, 0, usagef("%v", err)
	}
	s.Host = host
	if g.timeout <= 0 || g.orphanAfter <= 0 || g.hold < 0 {
		return nil, nil, 0, usagef("--timeout and --orphan-after must be positive, --reservation-hold not negative")
	}
	st, err := storeconfig.Open(s.Store)
	if err != nil {
		return nil, nil, 0, err
	}
	defer st.Close()
	ctx, cancel := context.WithTimeout(context.Background(), g.timeout)
	defer cancel()
	a, err := pool.New(st, host, pool.WithTimeout(g.timeout), pool.WithReservationHold(g.hold))
	if err != nil {
		return nil, nil, 0, usagef("%v", err)
	}
	pa, err := portalloc.New(st, host)
	if err != nil {
		return nil, nil, 0, usagef("%v", err)
	}
	c := &Ctl{
		Pool: a, Ports: pa, Store: st, StoreDesc: s.Store.Describe(), OrphanAfter: g.orphanAfter, Now: env.Now,
		NewPool: func(h string) (*pool.Allocator, error) {
			return pool.New(st, h, pool.WithTimeout(g.timeout), pool.WithReservationHold(g.hold))
		},
	}
	return fn(ctx, c, s, pos)
}

func wantArgs(pos []string, n int, what string) error {
	if len(pos) != n {
		if n == 0 {
			return usagef("unexpected argument %q", pos[0])
		}
		return usagef("want %s, got %d arguments", what, len(pos))
	}
	return nil
}

func parseAddr(s string) (netip.Addr, error) {
	a, err := netip.ParseAddr(s)
	if err != nil {
		return netip.Addr{}, usagef("%q is not an IP address", s)
	}
	return a.Unmap(), nil
}

func setupStatus(fs *flag.FlagSet, env Env) run {
	p := fs.String("pool", "", "only this `pool`")
	return func(ctx context.Context, c *Ctl, s Settings, pos []string) (any, func(io.Writer), int, error) {
		if err := wantArgs(pos, 0, ""); err != nil {
			return nil, nil, 0, err
		}
		st, err := c.Status(ctx, *p)
		return st, func(w io.Writer) { RenderStatus(w, st) }, ExitOK, err
	}
}

func ownerFlag(fs *flag.FlagSet) *string {
	return fs.String("owner", "", "owners matching `kind/network/container/interface` (trailing parts may be left out; the container ID matches by prefix)")
}

func parseOwnerFlag(s string) (*OwnerMatch, error) {
	if s == "" {
		return nil, nil
	}
	m, err := ParseOwnerMatch(s)
	return &m, err
}

func setupLs(fs *flag.FlagSet, env Env) run {
	p := fs.String("pool", "", "only this `pool`")
	h := fs.String("host", "", "only addresses held on `host`")
	o := ownerFlag(fs)
	noHolds := fs.Bool("no-holds", false, "leave out addresses held for released reservations")
	return func(ctx context.Context, c *Ctl, s Settings, pos []string) (any, func(io.Writer), int, error) {
		if err := wantArgs(pos, 0, ""); err != nil {
			return nil, nil, 0, err
		}
		m, err := parseOwnerFlag(*o)
		if err != nil {
			return nil, nil, 0, err
		}
		rows, err := c.Ls(ctx, LsFilter{Pool: *p, Host: *h, Owner: m, NoHolds: *noHolds})
		return rows, func(w io.Writer) { RenderLs(w, rows, c.now()) }, ExitOK, err
	}
}

func setupPorts(fs *flag.FlagSet, env Env) run {
	h := fs.String("host", "", "only ports of `host`")
	mode := fs.String("mode", "", "only `mode` host or ingress")
	o := ownerFlag(fs)
	return func(ctx context.Context, c *Ctl, s Settings, pos []string) (any, func(io.Writer), int, error) {
		if err := wantArgs(pos, 0, ""); err != nil {
			return nil, nil, 0, err
		}
		if *mode != "" && *mode != string(portalloc.Host) && *mode != string(portalloc.Ingress) {
			return nil, nil, 0, usagef("--mode %q: want host or ingress", *mode)
		}
		m, err := parseOwnerFlag(*o)
		if err != nil {
			return nil, nil, 0, err
		}
		rows, err := c.PortsList(ctx, PortFilter{Host: *h, Mode: *mode, Owner: m})
		return rows, func(w io.Writer) { RenderPorts(w, rows) }, ExitOK, err
	}
}

func dryRunFlag(fs *flag.FlagSet) *bool {
	return fs.Bool("dry-run", false, "print what would be done, change nothing")
}

func actionsResult(a Actions, err error) (any, func(io.Writer), int, error) {
	return a, func(w io.Writer) { RenderActions(w, a) }, ExitOK, err
}

func setupRelease(fs *flag.FlagSet, env Env) run {
	p := fs.String("pool", "", "the `pool` of ADDRESS, when isolated pools share it")
	o := ownerFlag(fs)
	noHold := fs.Bool("no-hold", false, "free the addresses at once even if the owner's reservation would hold them")
	dry := dryRunFlag(fs)
	return func(ctx context.Context, c *Ctl, s Settings, pos []string) (any, func(io.Writer), int, error) {
		m, err := parseOwnerFlag(*o)
		if err != nil {
			return nil, nil, 0, err
		}
		args := ReleaseArgs{Pool: *p, Owner: m, NoHold: *noHold}
		switch {
		case m != nil && len(pos) > 0, m == nil && len(pos) != 1:
			return nil, nil, 0, usagef("give either one ADDRESS or --owner")
		case m == nil:
			if args.Addr, err = parseAddr(pos[0]); err != nil {
				return nil, nil, 0, err
			}
		}
		return actionsResult(c.Release(ctx, args, *dry))
	}
}

func setupHoldDrop(fs *flag.FlagSet, env Env) run {
	network := fs.String("network", "", "the reservation's `network` (CNI network name, or Docker pool)")
	kind := fs.String("kind", string(pool.KindCNI), "the front end: cni, docker, port or ringctl")
	dry := dryRunFlag(fs)
	return func(ctx context.Context, c *Ctl, s Settings, pos []string) (any, func(io.Writer), int, error) {
		if err := wantArgs(pos, 1, "the reservation NAME"); err != nil {
			return nil, nil, 0, err
		}
		n := *network
		if n == "" {
			n = s.NetworkName
		}
		if n == "" {
			return nil, nil, 0, usagef("--network is needed (or --config naming the network's conflist)")
		}
		return actionsResult(c.HoldDrop(ctx, pool.Kind(*kind), n, pos[0], *dry))
	}
}

func setupRmpeer(fs *flag.FlagSet, env Env) run {
	force := fs.Bool("force", false, "remove the host even though its agent holds its liveness lease")
	tomb := fs.Bool("tombstone", false, "leave its free space tombstoned instead of handing it to this host")
	dry := dryRunFlag(fs)
	return func(ctx context.Context, c *Ctl, s Settings, pos []string) (any, func(io.Writer), int, error) {
		if err := wantArgs(pos, 1, "the HOST to remove"); err != nil {
			return nil, nil, 0, err
		}
		return actionsResult(c.Rmpeer(ctx, RmpeerArgs{Host: pos[0], Force: *force, Tombstone: *tomb}, *dry))
	}
}

func setupLeave(fs *flag.FlagSet, env Env) run {
	force := fs.Bool("force", false, "let the host leave even though its agent holds its liveness lease")
	dry := dryRunFlag(fs)
	return func(ctx context.Context, c *Ctl, s Settings, pos []string) (any, func(io.Writer), int, error) {
		if err := wantArgs(pos, 1, "the HOST that leaves"); err != nil {
			return nil, nil, 0, err
		}
		return actionsResult(c.Leave(ctx, LeaveArgs{Host: pos[0], Force: *force}, *dry))
	}
}

func setupGC(fs *flag.FlagSet, env Env) run {
	dry := dryRunFlag(fs)
	return func(ctx context.Context, c *Ctl, s Settings, pos []string) (any, func(io.Writer), int, error) {
		if err := wantArgs(pos, 0, ""); err != nil {
			return nil, nil, 0, err
		}
		return actionsResult(c.GC(ctx, *dry))
	}
}

func setupHostAck(fs *flag.FlagSet, env Env) run {
	return func(ctx context.Context, c *Ctl, s Settings, pos []string) (any, func(io.Writer), int, error) {
		host := s.Host
		switch len(pos) {
		case 0:
		case 1:
			host = pos[0]
		default:
			return nil, nil, 0, usagef("want at most one HOST")
		}
		return actionsResult(c.HostAck(ctx, host))
	}
}

func setupCheck(fs *flag.FlagSet, env Env) run {
	return func(ctx context.Context, c *Ctl, s Settings, pos []string) (any, func(io.Writer), int, error) {
		if err := wantArgs(pos, 0, ""); err != nil {
			return nil, nil, 0, err
		}
		v, err := c.Check(ctx)
		if v == nil {
			v = []pool.Violation{}
		}
		code := ExitOK
		if len(v) > 0 {
			code = ExitFindings
		}
		return map[string]any{"violations": v}, func(w io.Writer) { RenderCheck(w, v) }, code, err
	}
}

func setupImport(fs *flag.FlagSet, env Env) run {
	network := fs.String("network", "", "the CNI `network` name (default: the configuration's)")
	conflist := fs.String("conflist", "", "the network's conflist `FILE` (default: --config)")
	dry := dryRunFlag(fs)
	return func(ctx context.Context, c *Ctl, s Settings, pos []string) (any, func(io.Writer), int, error) {
		if err := wantArgs(pos, 1, "host-local's data directory DIR"); err != nil {
			return nil, nil, 0, err
		}
		netconf := s.Network
		if *conflist != "" {
			b, err := env.ReadFile(*conflist)
			if err != nil {
				return nil, nil, 0, usagef("--conflist: %v", err)
			}
			cs, err := parseConfigFile(b)
			if err != nil {
				return nil, nil, 0, err
			}
			netconf = cs.Network
		}
		rep, err := c.ImportHostLocal(ctx, ImportArgs{Dir: pos[0], Network: *network, Host: s.Host, NetConf: netconf, DryRun: *dry})
		code := ExitOK
		if rep.Refused() > 0 {
			code = ExitFindings
		}
		return rep, func(w io.Writer) { RenderImport(w, rep) }, code, err
	}
}

func setupHistory(fs *flag.FlagSet, env Env) run {
	p := fs.String("pool", "", "the `pool` of ADDRESS, when isolated pools share it")
	return func(ctx context.Context, c *Ctl, s Settings, pos []string) (any, func(io.Writer), int, error) {
		if err := wantArgs(pos, 1, "an ADDRESS"); err != nil {
			return nil, nil, 0, err
		}
		addr, err := parseAddr(pos[0])
		if err != nil {
			return nil, nil, 0, err
		}
		rows, err := c.History(ctx, addr, *p)
		return rows, func(w io.Writer) { RenderHistory(w, rows) }, ExitOK, err
	}
}

type stringList []string

func (l *stringList) String() string     { return strings.Join(*l, ",") }
func (l *stringList) Set(s string) error { *l = append(*l, s); return nil }

func setupExplain(fs *flag.FlagSet, env Env) run {
	var pools stringList
	fs.Var(&pools, "pool", "a `pool` the ADD would use (repeatable; default: the --config network's)")
	ip := fs.String("ip", "", "a static `address` the ADD would ask for")
	ctr := fs.String("container", "", "the container `ID` of the ADD")
	ifName := fs.String("ifname", "eth0", "the `interface` of the ADD")
	network := fs.String("network", "", "the CNI `network` (default: the --config network's)")
	resv := fs.String("reservation", "", "a reservation `name` the ADD would carry")
	return func(ctx context.Context, c *Ctl, s Settings, pos []string) (any, func(io.Writer), int, error) {
		if err := wantArgs(pos, 0, ""); err != nil {
			return nil, nil, 0, err
		}
		args := ExplainArgs{Pools: pools, Reservation: *resv, Host: s.Host}
		if len(pools) == 0 {
			args.NetConf = s.Network
		}
		if *ip != "" {
			a, err := parseAddr(*ip)
			if err != nil {
				return nil, nil, 0, err
			}
			args.IP = a
		}
		if *ctr != "" {
			n := *network
			if n == "" {
				n = s.NetworkName
			}
			o := pool.Owner{Kind: pool.KindCNI, Network: n, ContainerID: *ctr, IfName: *ifName}
			if err := o.Validate(); err != nil {
				return nil, nil, 0, fmt.Errorf("--container/--network: %w", err)
			}
			args.Owner = &o
		}
		ex, err := c.Explain(ctx, args)
		code := ExitOK
		if !ex.WouldSucceed {
			code = ExitFindings
		}
		return ex, func(w io.Writer) { RenderExplain(w, ex) }, code, err
	}
}
