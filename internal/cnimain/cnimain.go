// Package cnimain is the entry point of ringipam's one-call CNI plugins
// (ipam-ring, portmap-ingress): it reads the CNI environment and the network
// configuration on stdin, checks them, and calls the plugin's verb.
//
// Contract:
//
//   - It behaves as the CNI library's dispatcher (containernetworking/cni
//     pkg/skel, v1.3.0) does on every input: the same checks in the same
//     order, the same CNI error codes, messages and details, the same version
//     negotiation (CHECK from 0.4.0, GC and STATUS from 1.1.0), the same
//     VERSION output, the same refusal of a CNI_NETNS that is the plugin's
//     own namespace, and the same help text when CNI_COMMAND is unset. The
//     package's tests run skel and this dispatcher on the same inputs and
//     compare what each calls and prints.
//   - It is not skel itself because importing skel links its name check's
//     regular expression and a network-namespace library whose
//     initialisation every call paid before doing anything (docs/benchmarks.md);
//     the checks here are the same rules written out.
//   - Stdin is bounded: a configuration larger than MaxStdin bytes is refused
//     with CNI error code 7 ("invalid network config") after reading at most
//     MaxStdin+1 bytes, so a runaway or hostile caller cannot make the plugin
//     hold more than that in memory. VERSION does not read stdin (as skel).
//   - Run never returns: it exits 0 on success, 1 after printing the error
//     to stdout as CNI JSON.
package cnimain

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"runtime"
	"slices"
	"strings"
	"unicode"

	"github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/cni/pkg/version"
	"golang.org/x/sys/unix"

	"github.com/ringipam/ringipam/internal/jsonscan"
	"github.com/ringipam/ringipam/internal/oneproc"
	"github.com/ringipam/ringipam/pkg/names"
)

// MaxStdin is the largest network configuration a plugin accepts: far above
// any real conflist entry with its prevResult (a few KiB), far below what
// would strain a node.
const MaxStdin = 4 << 20

// CmdArgs is one invocation: the CNI_* environment and the configuration
// read from stdin (the fields of skel's CmdArgs).
type CmdArgs struct {
	ContainerID   string
	Netns         string
	IfName        string
	Args          string
	Path          string
	NetnsOverride string
	StdinData     []byte
}

// Funcs are a plugin's verbs. A nil verb succeeds without being called once
// the version checks pass, as with skel.
type Funcs struct {
	Add, Check, Del, GC, Status func(*CmdArgs) error
}

// Run dispatches the process's invocation to funcs and exits. The process
// runs on one processor (internal/oneproc) unless its environment sets
// GOMAXPROCS.
func Run(funcs Funcs, versions version.PluginInfo, about string) {
	oneproc.RespectEnvironment(os.LookupEnv)
	inv := Invocation{Getenv: os.Getenv, Stdin: os.Stdin, Stdout: os.Stdout, Stderr: os.Stderr}
	if e := inv.Dispatch(funcs, versions, about); e != nil {
		if err := e.Print(); err != nil {
			fmt.Fprintf(os.Stderr, "Error writing error JSON to stdout: %v\n", err)
		}
		os.Exit(1)
	}
	os.Exit(0)
}

// Invocation is where a dispatch reads its environment and stdin and
// writes VERSION's answer and the help text.
type Invocation struct {
	Getenv         func(string) string
	Stdin          io.Reader
	Stdout, Stderr io.Writer
}

// cniVariable is one CNI_* variable as skel reads it: the commands that
// need it set (CNI_COMMAND is needed by every one), the check of a value a
// command needs, and where the value goes.
type cniVariable struct {
	name     string
	neededBy []string
	check    func(string) *types.Error
	field    func(*CmdArgs) *string
}

// variables are the CNI variables in the order skel reads and reports them.
var variables = []cniVariable{
	{name: "CNI_COMMAND"},
	{"CNI_CONTAINERID", []string{"ADD", "CHECK", "DEL"}, validateContainerID, func(a *CmdArgs) *string { return &a.ContainerID }},
	{"CNI_NETNS", []string{"ADD", "CHECK"}, nil, func(a *CmdArgs) *string { return &a.Netns }},
	{"CNI_IFNAME", []string{"ADD", "CHECK", "DEL"}, validateInterfaceName, func(a *CmdArgs) *string { return &a.IfName }},
	{"CNI_ARGS", nil, nil, func(a *CmdArgs) *string { return &a.Args }},
	{"CNI_PATH", []string{"ADD", "CHECK", "DEL", "GC", "STATUS"}, nil, func(a *CmdArgs) *string { return &a.Path }},
	{"CNI_NETNS_OVERRIDE", nil, nil, func(a *CmdArgs) *string { return &a.NetnsOverride }},
}

// A verb is a command's function, the first configuration version that
// allows it ("" for any) and whether its CNI_NETNS must not be the
// plugin's own.
type verb struct {
	fn         func(*CmdArgs) error
	since      string
	checkNetns bool
}

func (f Funcs) verb(cmd string) (verb, bool) {
	switch cmd {
	case "ADD":
		return verb{f.Add, "", true}, true
	case "DEL":
		return verb{f.Del, "", true}, true
	case "CHECK":
		return verb{f.Check, "0.4.0", false}, true
	case "GC":
		return verb{f.GC, "1.1.0", false}, true
	case "STATUS":
		return verb{f.Status, "1.1.0", false}, true
	}
	return verb{}, false
}

// Dispatch runs the invocation's verb and returns the error to print, or
// nil (also when it printed the help text).
func (inv Invocation) Dispatch(funcs Funcs, versions version.PluginInfo, about string) *types.Error {
	cmd, args, fields, err := inv.read()
	if err != nil {
		if err.Code == types.ErrInvalidEnvironmentVariables && inv.Getenv("CNI_COMMAND") == "" && about != "" {
			fmt.Fprintln(inv.Stderr, about)
			fmt.Fprintf(inv.Stderr, "CNI protocol versions supported: %s\n", strings.Join(versions.SupportedVersions(), ", "))
			return nil
		}
		return err
	}
	if cmd == "VERSION" {
		if err := versions.Encode(inv.Stdout); err != nil {
			return types.NewError(types.ErrIOFailure, err.Error(), "")
		}
		return nil
	}
	v, ok := funcs.verb(cmd)
	if !ok {
		return types.NewError(types.ErrInvalidEnvironmentVariables, fmt.Sprintf("unknown CNI_COMMAND: %v", cmd), "")
	}
	confVersion, verr := fields.cniVersion(args.StdinData)
	if verr != nil {
		return types.NewError(types.ErrDecodingFailure, verr.Error(), "")
	}
	if v.since != "" {
		return callFrom(v.since, cmd, args, confVersion, versions, v.fn)
	}
	e := call(args, confVersion, versions, v.fn)
	if v.checkNetns {
		e = notOwnNetns(args, e)
	}
	return e
}

// read gathers the environment, checks it, and reads stdin (except for
// VERSION) and what the dispatcher needs of it.
func (inv Invocation) read() (string, *CmdArgs, confFields, *types.Error) {
	cmd := inv.Getenv("CNI_COMMAND")
	args := &CmdArgs{StdinData: []byte{}}
	var missing []string
	for _, v := range variables {
		val := inv.Getenv(v.name)
		if v.field != nil {
			*v.field(args) = val
		}
		needed := slices.Contains(v.neededBy, cmd)
		switch {
		case val == "":
			if needed || v.name == "CNI_COMMAND" {
				missing = append(missing, v.name)
			}
		case needed && v.check != nil:
			if err := v.check(val); err != nil {
				return "", nil, confFields{}, err
			}
		}
	}
	if len(missing) > 0 {
		return "", nil, confFields{}, types.NewError(types.ErrInvalidEnvironmentVariables, fmt.Sprintf("required env variables [%s] missing", strings.Join(missing, ",")), "")
	}
	if cmd == "VERSION" {
		return cmd, args, confFields{}, nil
	}
	data, e := readBounded(inv.Stdin, MaxStdin)
	if e != nil {
		return "", nil, confFields{}, e
	}
	args.StdinData = data
	fields := scanConf(data)
	if e := validateConfig(data, fields); e != nil {
		return "", nil, confFields{}, e
	}
	return cmd, args, fields, nil
}

// readBounded reads r to its end, refusing (code 7) more than max bytes
// after reading at most max+1.
func readBounded(r io.Reader, max int64) ([]byte, *types.Error) {
	data, err := io.ReadAll(io.LimitReader(r, max+1))
	if err != nil {
		return nil, types.NewError(types.ErrIOFailure, fmt.Sprintf("error reading from stdin: %v", err), "")
	}
	if int64(len(data)) > max {
		return nil, types.NewError(types.ErrInvalidNetworkConfig, fmt.Sprintf("network configuration on stdin is larger than %d bytes: refused unread", max), "")
	}
	return data, nil
}

// confFields are the configuration's name and cniVersion when jsonscan
// read them (ok); otherwise they are decoded with encoding/json as skel
// decodes them, which also gives skel's errors.
type confFields struct {
	name, version string
	ok            bool
}

func scanConf(data []byte) confFields {
	var f confFields
	f.ok = jsonscan.ParseMembers(data, []string{"name", "cniVersion"}, false, func(key string, val jsonscan.Value) bool {
		s, ok := val.String()
		if key == "name" {
			f.name = s
		} else {
			f.version = s
		}
		return ok
	})
	return f
}

// cniVersion is the configuration's cniVersion, "0.1.0" when absent (as
// skel's decoder has it).
func (f confFields) cniVersion(data []byte) (string, error) {
	if !f.ok {
		return (&version.ConfigDecoder{}).Decode(data)
	}
	if f.version == "" {
		return "0.1.0", nil
	}
	return f.version, nil
}

// validateConfig checks the configuration's name, as skel does.
func validateConfig(data []byte, fields confFields) *types.Error {
	name := fields.name
	if !fields.ok {
		var err error
		if name, err = networkName(data); err != nil {
			return types.NewError(types.ErrDecodingFailure, fmt.Sprintf("error unmarshall network config: %v", err), "")
		}
	}
	if name == "" {
		return types.NewError(types.ErrInvalidNetworkConfig, "missing network name", "")
	}
	if !names.IsCNIName(name) {
		return types.NewError(types.ErrInvalidNetworkConfig, "invalid characters found in network name", name)
	}
	return nil
}

// networkName is the configuration's "name", decoded as skel decodes it.
func networkName(data []byte) (string, error) {
	var conf struct {
		Name string `json:"name"`
	}
	err := json.Unmarshal(data, &conf)
	return conf.Name, err
}

func validateContainerID(id string) *types.Error {
	if !names.IsCNIName(id) {
		return types.NewError(types.ErrInvalidEnvironmentVariables, "invalid characters in containerID", id)
	}
	return nil
}

// maxInterfaceName is the longest Linux interface name (IFNAMSIZ-1).
const maxInterfaceName = 15

func validateInterfaceName(name string) *types.Error {
	if len(name) > maxInterfaceName {
		return types.NewError(types.ErrInvalidEnvironmentVariables, "interface name is too long", fmt.Sprintf("interface name should be less than %d characters", maxInterfaceName+1))
	}
	if name == "." || name == ".." {
		return types.NewError(types.ErrInvalidEnvironmentVariables, "interface name is . or ..", "")
	}
	for _, r := range name {
		if r == '/' || r == ':' || unicode.IsSpace(r) {
			return types.NewError(types.ErrInvalidEnvironmentVariables, "interface name contains / or : or whitespace characters", "")
		}
	}
	return nil
}

// call checks the configuration's version against versions and calls fn.
func call(args *CmdArgs, confVersion string, versions version.PluginInfo, fn func(*CmdArgs) error) *types.Error {
	if verErr := (&version.Reconciler{}).Check(confVersion, versions); verErr != nil {
		return types.NewError(types.ErrIncompatibleCNIVersion, "incompatible CNI versions", verErr.Details())
	}
	if fn == nil {
		return nil
	}
	if err := fn(args); err != nil {
		var e *types.Error
		if errors.As(err, &e) {
			return e
		}
		return types.NewError(types.ErrInternal, err.Error(), "")
	}
	return nil
}

// callFrom calls fn only for configurations of version min or later, and
// when the plugin speaks a version at least the configuration's.
func callFrom(min, cmd string, args *CmdArgs, confVersion string, versions version.PluginInfo, fn func(*CmdArgs) error) *types.Error {
	if ok, err := version.GreaterThanOrEqualTo(confVersion, min); err != nil {
		return types.NewError(types.ErrDecodingFailure, err.Error(), "")
	} else if !ok {
		return types.NewError(types.ErrIncompatibleCNIVersion, "config version does not allow "+cmd, "")
	}
	for _, pluginVersion := range versions.SupportedVersions() {
		ok, err := version.GreaterThanOrEqualTo(pluginVersion, confVersion)
		if err != nil {
			return types.NewError(types.ErrDecodingFailure, err.Error(), "")
		}
		if ok {
			return call(args, confVersion, versions, fn)
		}
	}
	return types.NewError(types.ErrIncompatibleCNIVersion, "plugin version does not allow "+cmd, "")
}

// notOwnNetns passes on err; after a successful ADD or DEL it refuses a
// CNI_NETNS that is the plugin's own network namespace, unless
// CNI_NETNS_OVERRIDE is "true" or "1" (as skel does, after the verb).
func notOwnNetns(args *CmdArgs, err *types.Error) *types.Error {
	if err != nil {
		return err
	}
	if strings.ToUpper(args.NetnsOverride) == "TRUE" || args.NetnsOverride == "1" {
		return nil
	}
	var target unix.Stat_t
	if err := statNetns(args.Netns, &target); err != nil {
		return nil // unusable paths are the verb's to judge; an empty one is a finished DEL
	}
	var own unix.Stat_t
	if err := statOwnNetns(&own); err != nil {
		return types.NewError(types.ErrInvalidNetNS, "get plugin's netns failed", "")
	}
	if own.Dev == target.Dev && own.Ino == target.Ino {
		return types.NewError(types.ErrInvalidNetNS, "plugin's netns and netns from CNI_NETNS should not be the same", "")
	}
	return nil
}

// statOwnNetns stats the network namespace of the calling thread, as skel
// does. /proc/thread-self names the thread that makes the open, in one
// system call, so the goroutine need not be locked to its thread: locking
// one starts the runtime's template thread, a thread more to create and
// tear down in every call (2-3% of an ADD's CPU under bursts,
// docs/DESIGN-NOTES.md). Kernels older than 3.17 have no thread-self; there
// the thread is named by number, locked while it is.
func statOwnNetns(st *unix.Stat_t) error {
	err := statNetns("/proc/thread-self/ns/net", st)
	if !errors.Is(err, unix.ENOENT) {
		return err
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	return statNetns(fmt.Sprintf("/proc/%d/task/%d/ns/net", os.Getpid(), unix.Gettid()), st)
}

// statNetns opens path as skel does (read-only) and stats what it opened.
func statNetns(path string, st *unix.Stat_t) error {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return unix.Fstat(fd, st)
}
