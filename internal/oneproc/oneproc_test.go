// As the plugins are built: the runtime's own GOMAXPROCS is the CPU count.
//go:debug containermaxprocs=0

package oneproc_test

import (
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/containernetworking/cni/pkg/version"

	"github.com/ringipam/ringipam/internal/cnimain"
)

// TestMain lets the test binary be a plugin for TestProcessors: it runs an
// ADD through cnimain.Run, as the plugins' mains do (the init, then Run's
// reading of the environment), and the ADD prints the processors it runs
// with.
func TestMain(m *testing.M) {
	if os.Getenv("ONEPROC_REPORT") != "" {
		cnimain.Run(cnimain.Funcs{Add: func(*cnimain.CmdArgs) error {
			fmt.Print(runtime.GOMAXPROCS(0))
			return nil
		}}, version.All, "report")
	}
	os.Exit(m.Run())
}

// TestProcessors: a plugin's call runs on one processor unless its
// environment sets GOMAXPROCS, to any count, the CPUs' included (which the
// init cannot tell from the runtime's default, and cnimain.Run settles).
func TestProcessors(t *testing.T) {
	cpus := runtime.NumCPU()
	if cpus < 2 {
		t.Fatalf("needs at least 2 CPUs to tell 1 processor from the default, have %d", cpus)
	}
	for _, c := range []struct {
		env  string // GOMAXPROCS in the environment; "" for none
		want int
	}{
		{"", 1},
		{strconv.Itoa(cpus + 1), cpus + 1},
		{"1", 1},
		// The count the init cannot tell from the runtime's own choice:
		// RespectEnvironment gives it back.
		{strconv.Itoa(cpus), cpus},
		// Ignored by the runtime (not a positive number): its default.
		{"0", cpus},
		{"many", cpus},
	} {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = []string{"ONEPROC_REPORT=1", "CNI_COMMAND=ADD", "CNI_CONTAINERID=c1",
			"CNI_NETNS=/nonexistent/netns", "CNI_IFNAME=eth0", "CNI_PATH=/nonexistent"}
		if c.env != "" {
			cmd.Env = append(cmd.Env, "GOMAXPROCS="+c.env)
		}
		cmd.Stdin = strings.NewReader(`{"cniVersion":"1.0.0","name":"n","type":"t"}`)
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("GOMAXPROCS=%q: %v (%s)", c.env, err, out)
		}
		if got, _ := strconv.Atoi(string(out)); got != c.want {
			t.Errorf("GOMAXPROCS=%q in the environment: the process runs with %q processors, want %d", c.env, out, c.want)
		}
	}
}

// TestPluginsUseIt checks that both one-call plugins link the package and
// that it imports nothing but runtime (so that its init runs among the
// first).
func TestPluginsUseIt(t *testing.T) {
	const self = "github.com/ringipam/ringipam/internal/oneproc"
	for _, pkg := range []string{"../../plugins/ipam-ring", "../../plugins/portmap-ingress"} {
		out, err := exec.Command("go", "list", "-deps", pkg).CombinedOutput()
		if err != nil {
			t.Fatalf("go list %s: %v\n%s", pkg, err, out)
		}
		if !slices.Contains(strings.Fields(string(out)), self) {
			t.Errorf("%s does not link %s", pkg, self)
		}
	}
	out, err := exec.Command("go", "list", "-f", "{{join .Imports \" \"}}", ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	if got := strings.TrimSpace(string(out)); got != "runtime" {
		t.Errorf("oneproc imports %q, want only runtime", got)
	}
}
