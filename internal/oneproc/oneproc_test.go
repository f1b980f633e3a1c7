package oneproc

import (
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"testing"
)

// TestMain lets the test binary report the GOMAXPROCS its init left, for
// TestProcessors to run it under different environments.
func TestMain(m *testing.M) {
	if os.Getenv("ONEPROC_REPORT") != "" {
		os.Stdout.WriteString(strconv.Itoa(runtime.GOMAXPROCS(0)))
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func TestProcessors(t *testing.T) {
	for _, c := range []struct {
		env  string // GOMAXPROCS in the environment; "" for none
		want int
	}{
		{"", 1},
		{"3", 3},
	} {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), "ONEPROC_REPORT=1")
		cmd.Env = slicesWithout(cmd.Env, "GOMAXPROCS=")
		if c.env != "" {
			cmd.Env = append(cmd.Env, "GOMAXPROCS="+c.env)
		}
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("GOMAXPROCS=%q: %v", c.env, err)
		}
		if got, _ := strconv.Atoi(string(out)); got != c.want {
			t.Errorf("GOMAXPROCS=%q in the environment: the process runs with %q processors, want %d", c.env, out, c.want)
		}
	}
}

// slicesWithout returns env without the entries that start with prefix.
func slicesWithout(env []string, prefix string) []string {
	var out []string
	for _, e := range env {
		if !strings.HasPrefix(e, prefix) {
			out = append(out, e)
		}
	}
	return out
}
