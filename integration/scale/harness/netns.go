package harness

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"testing"
)

// netnsEnv marks the test binary re-executed in its own network namespace.
const netnsEnv = "RINGIPAM_SCALE_NETNS"

// Main runs the tests of m in a network namespace of their own: the
// first run re-executes the test binary under `unshare --net` with the
// loopback up (etcd listens there; the agents' portmap-ingress tables are
// made there), and exits with its status.
func Main(m *testing.M) {
	if os.Getenv(netnsEnv) != "" {
		os.Exit(m.Run())
	}
	if os.Geteuid() != 0 {
		fmt.Fprintln(os.Stderr, "suite scale needs root: the harness runs in a network namespace of its own, and the agent socket serves root only")
		os.Exit(1)
	}
	args := append([]string{"--net", "--", "/bin/sh", "-c", `ip link set lo up && exec "$0" "$@"`}, os.Args...)
	cmd := exec.Command("unshare", args...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	cmd.Env = append(os.Environ(), netnsEnv+"=1")
	err := cmd.Run()
	var ee *exec.ExitError
	switch {
	case err == nil:
		os.Exit(0)
	case errors.As(err, &ee):
		os.Exit(ee.ExitCode())
	}
	fmt.Fprintf(os.Stderr, "scale: re-executing in a network namespace of its own: %v\n", err)
	os.Exit(1)
}
