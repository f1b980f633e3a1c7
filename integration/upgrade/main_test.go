//go:build integration

// Package upgrade_test is the mixed-version rolling restart (issue 41,
// item 6; issue 42, item 4): agents and plugins of a pinned earlier commit
// (store layout 3) and of this working tree (layout 4) on one real etcd,
// hosts restarted one at a time onto the new code while containers are
// added and deleted on every host and ports are published in host and
// ingress modes. The first new agent migrates the store while the old
// ones run. It asserts that no address or port is ever held twice, that
// nothing is left once every container is deleted (the new ringctl's ls,
// ports and check), and that every failed call failed with a clear CNI
// error: 11 ("try again later") while a host's agent restarts, retried;
// after the migration, an old host's calls fail with the layout's error
// ("upgrade ringipam", code 103); anything else fails the test.
//
// The earlier code is PinnedCommit, extracted with `git archive` from the
// test's own repository and built with the Go running the test. A
// checkout where that commit is not reachable (a shallow clone) fails the
// suite, saying so; it never skips.
package upgrade_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ringipam/ringipam/integration/cnitest"
)

// PinnedCommit is the code the rolling restart starts from: main before
// store layout 4 (issue 42; layout 3, the keys of v0.1.0 and of issue 41's
// work). Move it forward to the previous release when a release is cut:
// the supported upgrade is from one release to the next.
const PinnedCommit = "80a95bbec4c4cd0d684648974b8693cc28c01f72"

// version is one build of the binaries a host runs.
type version struct {
	name                 string // "old (082f606)" or "new (working tree)"
	agent, ipam, portmap string
}

var (
	oldVer, newVer version
	ringctlBin     string // the new ringctl: what an operator runs after the upgrade
)

func TestMain(m *testing.M) {
	os.Exit(cnitest.Main(m, func(ctx context.Context, dir string) error {
		newVer = version{name: "new (working tree)", ipam: cnitest.IPAMBin,
			agent: filepath.Join(dir, "ringipamd"), portmap: filepath.Join(dir, "portmap-ingress")}
		ringctlBin = filepath.Join(dir, "ringctl")
		for out, pkg := range map[string]string{newVer.agent: "./cmd/ringipamd", newVer.portmap: "./plugins/portmap-ingress", ringctlBin: "./cmd/ringctl"} {
			if err := cnitest.Build(ctx, out, pkg); err != nil {
				return err
			}
		}
		src := filepath.Join(dir, "old-src")
		if err := extract(ctx, PinnedCommit, src); err != nil {
			return err
		}
		oldDir := filepath.Join(dir, "old")
		oldVer = version{name: "old (" + PinnedCommit[:7] + ")", agent: filepath.Join(oldDir, "ringipamd"),
			ipam: filepath.Join(oldDir, "ipam-ring"), portmap: filepath.Join(oldDir, "portmap-ingress")}
		for out, pkg := range map[string]string{oldVer.agent: "./cmd/ringipamd", oldVer.ipam: "./plugins/ipam-ring", oldVer.portmap: "./plugins/portmap-ingress"} {
			build := cnitest.GoCommand(ctx, src, "build", "-trimpath", "-o", out, pkg)
			build.Env = append(os.Environ(), "CGO_ENABLED=0")
			if b, err := build.CombinedOutput(); err != nil {
				return fmt.Errorf("building %s of the pinned commit %s: %v\n%s", pkg, PinnedCommit, err, b)
			}
		}
		return nil
	}))
}

// extract writes the tree of commit, from the repository the test runs
// in, into dir (git archive: the repository is left as it was).
func extract(ctx context.Context, commit, dir string) error {
	check := exec.CommandContext(ctx, "git", "cat-file", "-e", commit+"^{commit}")
	check.Dir = cnitest.RepoRoot
	if out, err := check.CombinedOutput(); err != nil {
		return fmt.Errorf("integration/upgrade: the pinned commit %s (PinnedCommit, the release the rolling restart upgrades from) "+
			"is not reachable in %s (%v: %s): fetch it (a shallow clone lacks it: git fetch --unshallow)",
			commit, cnitest.RepoRoot, err, strings.TrimSpace(string(out)))
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	archive := exec.CommandContext(ctx, "git", "archive", "--format=tar", commit)
	archive.Dir = cnitest.RepoRoot
	untar := exec.CommandContext(ctx, "tar", "-x", "-C", dir)
	pipe, err := archive.StdoutPipe()
	if err != nil {
		return err
	}
	untar.Stdin = pipe
	var aerr, uerr strings.Builder
	archive.Stderr, untar.Stderr = &aerr, &uerr
	if err := untar.Start(); err != nil {
		return err
	}
	if err := archive.Run(); err != nil {
		_ = untar.Wait()
		return fmt.Errorf("git archive %s: %v: %s", commit, err, aerr.String())
	}
	if err := untar.Wait(); err != nil {
		return fmt.Errorf("extracting %s: %v: %s", commit, err, uerr.String())
	}
	return nil
}
