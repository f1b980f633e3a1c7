package cnimain

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math/rand"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/cni/pkg/version"
	"golang.org/x/sys/unix"

	"github.com/ringipam/ringipam/integration/netns"
)

// outcome is what one dispatch did: the verbs it called with their
// arguments, what it wrote, and the error it returned.
type outcome struct {
	Calls          []string
	Stdout, Stderr string
	Err            *types.Error
}

// verbFuncs returns verbs that record their calls in *calls and return
// ret (nil, a *types.Error or a plain error).
func verbFuncs(calls *[]string, ret error) (Funcs, skel.CNIFuncs) {
	rec := func(verb string) func(*CmdArgs) error {
		return func(a *CmdArgs) error {
			*calls = append(*calls, fmt.Sprintf("%s %+v", verb, *a))
			return ret
		}
	}
	fromSkel := func(f func(*CmdArgs) error) func(*skel.CmdArgs) error {
		return func(a *skel.CmdArgs) error {
			return f(&CmdArgs{ContainerID: a.ContainerID, Netns: a.Netns, IfName: a.IfName, Args: a.Args,
				Path: a.Path, NetnsOverride: a.NetnsOverride, StdinData: a.StdinData})
		}
	}
	ours := Funcs{Add: rec("ADD"), Check: rec("CHECK"), Del: rec("DEL"), GC: rec("GC"), Status: rec("STATUS")}
	theirs := skel.CNIFuncs{Add: fromSkel(ours.Add), Check: fromSkel(ours.Check), Del: fromSkel(ours.Del),
		GC: fromSkel(ours.GC), Status: fromSkel(ours.Status)}
	return ours, theirs
}

var (
	testVersions = version.PluginSupports("0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0")
	cniVariables = []string{"CNI_COMMAND", "CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "CNI_ARGS", "CNI_PATH", "CNI_NETNS_OVERRIDE"}
)

const about = "test plugin: about text"

// ours runs this package's dispatcher on env and stdin.
func ours(env map[string]string, stdin string, ret error) outcome {
	var o outcome
	funcs, _ := verbFuncs(&o.Calls, ret)
	var stdout, stderr bytes.Buffer
	inv := Invocation{Getenv: func(k string) string { return env[k] }, Stdin: strings.NewReader(stdin), Stdout: &stdout, Stderr: &stderr}
	o.Err = inv.Dispatch(funcs, testVersions, about)
	o.Stdout, o.Stderr = stdout.String(), stderr.String()
	return o
}

// theirs runs skel's dispatcher on the same input: skel reads the process's
// environment and standard streams, so they are swapped for the call.
func theirs(t *testing.T, env map[string]string, stdin string, ret error) outcome {
	t.Helper()
	for _, k := range cniVariables {
		t.Setenv(k, env[k]) // skel treats an empty variable as unset
	}
	dir := t.TempDir()
	in := writeFile(t, filepath.Join(dir, "stdin"), stdin)
	out := writeFile(t, filepath.Join(dir, "stdout"), "")
	errf := writeFile(t, filepath.Join(dir, "stderr"), "")
	saved := [3]*os.File{os.Stdin, os.Stdout, os.Stderr}
	os.Stdin, os.Stdout, os.Stderr = in, out, errf
	var o outcome
	_, funcs := verbFuncs(&o.Calls, ret)
	o.Err = skel.PluginMainFuncsWithError(funcs, testVersions, about)
	os.Stdin, os.Stdout, os.Stderr = saved[0], saved[1], saved[2]
	o.Stdout, o.Stderr = readFile(t, out), readFile(t, errf)
	return o
}

func writeFile(t *testing.T, path, content string) *os.File {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

func readFile(t *testing.T, f *os.File) string {
	t.Helper()
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		t.Fatal(err)
	}
	b, err := io.ReadAll(f)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func env(cmd string, kv ...string) map[string]string {
	m := map[string]string{"CNI_COMMAND": cmd, "CNI_CONTAINERID": "c1", "CNI_NETNS": "/nonexistent/netns",
		"CNI_IFNAME": "eth0", "CNI_PATH": "/opt/cni/bin"}
	for i := 0; i+1 < len(kv); i += 2 {
		m[kv[i]] = kv[i+1]
	}
	return m
}

func conf(version, name string) string {
	return fmt.Sprintf(`{"cniVersion":%q,"name":%q,"type":"x"}`, version, name)
}

// The cases every verb and check of skel is tried on; TestSameAsSkel
// also runs random mixtures of their parts.
var (
	commands = []string{"ADD", "DEL", "CHECK", "GC", "STATUS", "VERSION", "FOO", "add", ""}
	configs  = []string{
		conf("1.0.0", "net1"), conf("1.1.0", "net1"), conf("0.4.0", "net1"), conf("0.3.1", "net1"),
		conf("0.3.0", "net-1_x.y"), conf("9.9.9", "net1"), conf("", "net1"), conf("x.y", "net1"),
		conf("1.1.0", ""), conf("1.0.0", "net/1"), conf("1.0.0", "-net"), conf("1.0.0", "é"),
		`{"name":"net1"}`, `{"cniVersion":"1.1.0"}`, `{}`, ``, `nul`, `[1,2]`, `"str"`, `{"name":5}`,
		`{"name":null,"cniVersion":"1.0.0"}`, `{"cniVersion":null,"name":"n"}`, `{"cniVersion":1,"name":"n"}`,
		`{"Name":"n","CNIVERSION":"1.1.0"}`, `{"name":"a","name":"b","cniVersion":"1.1.0"}`,
		`{"na\u006de":"n","cniVersion":"1.0.0"}`, `{"name":"n\u0041","cniVersion":"1.0.0"}`,
		`{"cniVerſion":"1.1.0","name":"n"}`, `{"name":"n","cniVersion":"1.0.0"} x`, `{"name":"n","cniVersion":"1.0.0",}`,
		` {"name" : "n" , "cniVersion" : "1.0.0" , "ipam" : {"type":"y","nested":[{"a":1.5e3}]}} `,
	}
	containerIDs = []string{"c1", "", "a/b", "-x", "x-", "_x", "é", "a b", "abc.DEF_123-x", strings.Repeat("a", 300)}
	ifNames      = []string{"eth0", "", "eth0123456789ab", "eth0123456789abc", ".", "..", "a:b", "a/b", "a b", "a\tb", "a\u00a0b", "\xff"}
	netnses      = []string{"/nonexistent/netns", "", "/proc/self/ns/net", "/proc/self/ns/mnt"}
	overrides    = []string{"", "true", "TRUE", "True", "1", "0", "false"}
	returns      = []error{nil, types.NewError(types.ErrTryAgainLater, "busy", "later"), errors.New("plain failure")}
)

func TestSameAsSkel(t *testing.T) {
	type input struct {
		env   map[string]string
		stdin string
		ret   error
	}
	var inputs []input
	for _, cmd := range commands {
		for _, c := range configs {
			inputs = append(inputs, input{env(cmd), c, nil})
		}
		for _, id := range containerIDs {
			inputs = append(inputs, input{env(cmd, "CNI_CONTAINERID", id), conf("1.1.0", "n"), nil})
		}
		for _, name := range ifNames {
			inputs = append(inputs, input{env(cmd, "CNI_IFNAME", name), conf("1.1.0", "n"), nil})
		}
		for _, ns := range netnses {
			for _, o := range overrides {
				inputs = append(inputs, input{env(cmd, "CNI_NETNS", ns, "CNI_NETNS_OVERRIDE", o), conf("1.1.0", "n"), nil})
			}
		}
		for _, ret := range returns {
			inputs = append(inputs, input{env(cmd, "CNI_ARGS", "IgnoreUnknown=1;K8S_POD_NAME=p"), conf("1.1.0", "n"), ret})
		}
		for _, missing := range cniVariables {
			inputs = append(inputs, input{env(cmd, missing, ""), conf("1.1.0", "n"), nil})
		}
	}
	r := rand.New(rand.NewSource(1))
	pick := func(s []string) string { return s[r.Intn(len(s))] }
	for range 400 {
		e := env(pick(commands), "CNI_CONTAINERID", pick(containerIDs), "CNI_IFNAME", pick(ifNames),
			"CNI_NETNS", pick(netnses), "CNI_NETNS_OVERRIDE", pick(overrides))
		if r.Intn(4) == 0 {
			e[pick(cniVariables)] = ""
		}
		inputs = append(inputs, input{e, pick(configs), returns[r.Intn(len(returns))]})
	}
	called := 0
	for _, in := range inputs {
		got, want := ours(in.env, in.stdin, in.ret), theirs(t, in.env, in.stdin, in.ret)
		if !reflect.DeepEqual(got, want) {
			t.Errorf("env %q, stdin %q, verb returns %v:\n got  %+v\n skel %+v", in.env, in.stdin, in.ret, got, want)
		}
		if len(want.Calls) > 0 {
			called++
		}
	}
	// The comparison means something only if both sides got far enough
	// to call verbs, refuse inputs and print.
	if called < len(inputs)/10 {
		t.Fatalf("only %d of %d inputs reached a verb", called, len(inputs))
	}
}

func TestRefusesOversizeConfigBeforeReadingItAll(t *testing.T) {
	big := strings.NewReader(`{"name":"n","cniVersion":"1.0.0","pad":"` + strings.Repeat("x", MaxStdin) + `"}`)
	var calls []string
	funcs, _ := verbFuncs(&calls, nil)
	inv := Invocation{Getenv: func(k string) string { return env("ADD")[k] }, Stdin: big, Stdout: io.Discard, Stderr: io.Discard}
	e := inv.Dispatch(funcs, testVersions, about)
	if e == nil || e.Code != types.ErrInvalidNetworkConfig || !strings.Contains(e.Msg, "larger than") {
		t.Fatalf("oversize configuration: %v, want code 7 saying it is too large", e)
	}
	if len(calls) != 0 {
		t.Fatalf("oversize configuration reached the verb: %q", calls)
	}
	if left := big.Len(); left == 0 {
		t.Fatal("the whole configuration was read before it was refused")
	}
}

// TestIPAMRingLinksNoSkel keeps skel, its regular expression and the
// namespace library out of ipam-ring: their initialisation is what this
// package exists to avoid.
func TestIPAMRingLinksNoSkel(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", "../../plugins/ipam-ring").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	deps := strings.Fields(string(out))
	if len(deps) < 20 {
		t.Fatalf("go list -deps printed %d packages: %q", len(deps), out)
	}
	for _, banned := range []string{"github.com/containernetworking/cni/pkg/skel", "github.com/containernetworking/cni/pkg/utils",
		"github.com/vishvananda/netns", "regexp"} {
		for _, d := range deps {
			if d == banned {
				t.Errorf("ipam-ring links %s", banned)
			}
		}
	}
}

// TestOwnNetnsIsTheCallingThreads: like skel, the refusal of the plugin's
// own network namespace compares CNI_NETNS with the namespace of the thread
// that runs the check, which the lock-free /proc/thread-self names. A
// thread moved into a namespace of its own must be refused that namespace
// and allowed the process's: /proc/self (the first thread) would get both
// wrong.
func TestOwnNetnsIsTheCallingThreads(t *testing.T) {
	netns.RequireRoot(t)
	type verdicts struct{ own, leaders *types.Error }
	got := make(chan verdicts, 1)
	failed := make(chan error, 1)
	var check func()
	check = func() {
		// Never unlocked: the thread, in a namespace of its own, ends
		// with this goroutine instead of going back to the runtime.
		runtime.LockOSThread()
		if unix.Gettid() == os.Getpid() {
			// The first thread, whose namespace is the process's: it
			// stays locked here, idle, so that the check runs on
			// another thread, and is given back once it is done.
			done := make(chan struct{})
			go func() { check(); close(done) }()
			<-done
			runtime.UnlockOSThread()
			return
		}
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			failed <- fmt.Errorf("unshare: %w", err)
			return
		}
		threads := fmt.Sprintf("/proc/%d/task/%d/ns/net", os.Getpid(), unix.Gettid())
		got <- verdicts{
			own:     notOwnNetns(&CmdArgs{Netns: threads}, nil),
			leaders: notOwnNetns(&CmdArgs{Netns: fmt.Sprintf("/proc/%d/ns/net", os.Getpid())}, nil),
		}
	}
	go check()
	select {
	case err := <-failed:
		t.Fatal(err)
	case v := <-got:
		if v.own == nil || v.own.Code != types.ErrInvalidNetNS || !strings.Contains(v.own.Msg, "should not be the same") {
			t.Errorf("the thread's own namespace: got %v, want code %d refusing it", v.own, types.ErrInvalidNetNS)
		}
		if v.leaders != nil {
			t.Errorf("the first thread's namespace, not this thread's: got %v, want it allowed", v.leaders)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the check did not return within 10s")
	}
}
