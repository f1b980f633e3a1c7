//go:build integration

// Package k8s proves deploy/kubernetes/ringipam.yaml on a real Kubernetes
// cluster: kube-apiserver (on the suite's etcd),
// kube-controller-manager, kube-scheduler and kubelet at the version
// tools/k8s pins (built by scripts/build-k8s.sh into .cache/bin/k8s), on a
// private containerd 1.6 (cluster_test.go), authorized as a real cluster
// is (Node,RBAC and NodeRestriction; each component its own identity),
// so the DaemonSet's agents run with only what the manifest's RBAC grants
// their ServiceAccount (rbac_test.go checks it). The suite builds ringipam's
// image with scripts/build-image.sh and the pause image (package
// integration/pause), imports both into the node's containerd (nothing is
// pulled), applies the manifest through the apiserver with client-go
// (manifest_test.go), waits for the DaemonSet, then runs Deployments,
// StatefulSets and hostPorts whose addresses come from ipam-ring, restarts
// the agent under them, replaces its pod (its preStop hook keeps the
// node's files), deletes the Node of a second host (reclaim_test.go: its
// space reclaimed at once by the leader, once its agent is gone), makes a
// pod vanish behind the kubelet's back (its address released by the
// agent after the grace), joins two more kubelets (each node a network
// namespace on one LAN: flat_test.go) whose pods reach the first node's
// by pod IP through the agents' --routes, stops the third as a machine
// that loses power and deletes its Node (its host reclaimed at once: its
// ranges, owners, ports and the other nodes' routes to it gone), and
// deletes the manifest again (the hook removes them).
//
// Runs as root. Under CI (the CI variable set) a missing binary fails the
// suite instead of skipping it.
package k8s

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ringipam/ringipam/integration/cnitest"
	"github.com/ringipam/ringipam/integration/pause"
)

var (
	// k8sDir holds the control plane's binaries (scripts/build-k8s.sh).
	k8sDir = filepath.Join(cnitest.RepoRoot, ".cache", "bin", "k8s")
	// pauseArchive is the pause image (sandbox and test pods' container).
	pauseArchive string
	// ringctlBin is ringctl built from this checkout.
	ringctlBin string
	// imageArchive and imageTag: ringipam's image (scripts/build-image.sh)
	// and its tag, set by buildImage.
	imageArchive, imageTag string
)

func TestMain(m *testing.M) {
	os.Exit(cnitest.Main(m, func(ctx context.Context, dir string) error {
		ringctlBin = filepath.Join(dir, "ringctl")
		if err := cnitest.Build(ctx, ringctlBin, "./cmd/ringctl"); err != nil {
			return err
		}
		agentBin = filepath.Join(dir, "ringipamd")
		if err := cnitest.Build(ctx, agentBin, "./cmd/ringipamd"); err != nil {
			return err
		}
		var err error
		pauseArchive, err = pause.Build(ctx, dir)
		return err
	}))
}

// imageTimeout bounds scripts/build-image.sh (about 2 minutes when it
// makes the Debian base layer from the mirror; seconds more than the
// static binaries' build when it reuses the one ./.cache/image keeps for a
// day, as RollingUpdate's second image does).
const imageTimeout = 10 * time.Minute

// buildImage sets imageArchive and imageTag: bin/ringipam-image-<version>
// for this checkout's `git describe`, reused when it exists and the tree is
// clean (the file was built from this very commit), built otherwise (and
// removed at the end when the tree is dirty).
func buildImage(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), imageTimeout)
	defer cancel()
	describe := exec.CommandContext(ctx, "git", "describe", "--tags", "--always", "--dirty")
	describe.Dir = cnitest.RepoRoot
	out, err := describe.Output()
	if err != nil {
		t.Fatalf("git describe: %v", err)
	}
	imageTag = strings.TrimSpace(string(out))
	imageArchive = filepath.Join(cnitest.RepoRoot, "bin", "ringipam-image-"+imageTag+".oci.tar")
	if _, err := os.Stat(imageArchive); err == nil && !strings.HasSuffix(imageTag, "-dirty") {
		t.Logf("image %s: reusing %s", imageTag, imageArchive)
		return
	}
	start := time.Now()
	build := exec.CommandContext(ctx, filepath.Join(cnitest.RepoRoot, "scripts", "build-image.sh"))
	build.Dir = cnitest.RepoRoot
	// RINGIPAM_VERSION emptied: the image is tagged with git describe, as
	// imageTag (scripts/version.sh).
	build.Env = append(os.Environ(), "PATH="+filepath.Dir(goBinary())+":"+os.Getenv("PATH"), "RINGIPAM_VERSION=")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("scripts/build-image.sh: %v\n%s", err, out)
	}
	if _, err := os.Stat(imageArchive); err != nil {
		t.Fatalf("scripts/build-image.sh wrote no %s", imageArchive)
	}
	if strings.HasSuffix(imageTag, "-dirty") {
		// Never reused (see above): not left to pile up in bin/.
		archive := imageArchive
		t.Cleanup(func() { os.Remove(archive) })
	}
	t.Logf("image %s built in %v", imageTag, time.Since(start).Round(time.Second))
}

// goBinary is the go command the suite's builds use.
func goBinary() string {
	if p, err := exec.LookPath("go"); err == nil {
		return p
	}
	return "/usr/local/go/bin/go"
}

// phase logs how long a part of the suite took (the CI's time budget).
func phase(t *testing.T, name string, start time.Time) {
	t.Helper()
	t.Logf("timing: %s took %v", name, time.Since(start).Round(100*time.Millisecond))
}

func TestKubernetes(t *testing.T) {
	requireK8s(t)
	start := time.Now()
	buildImage(t)
	phase(t, "image", start)

	start = time.Now()
	c := startCluster(t)
	phase(t, "control plane and node", start)

	start = time.Now()
	m := c.install(t)
	phase(t, "manifest applied, DaemonSet ready, node Ready", start)

	for _, s := range []struct {
		name string
		fn   func(t *testing.T, c *cluster)
	}{
		{"RBAC", testRBAC},
		{"Deployment", testDeployment},
		{"StatefulSet", testStatefulSet},
		{"HostPort", testHostPort},
		{"AgentRestart", testAgentRestart},
		{"AgentReplaced", testAgentReplaced},
		{"RollingUpdate", testRollingUpdate},
		{"NodeDeleted", testNodeDeleted},
		{"VanishedPods", testVanishedPods},
		{"FlatNetwork", testFlatNetwork},
	} {
		start := time.Now()
		if !t.Run(s.name, func(t *testing.T) { s.fn(t, c) }) {
			t.Fatalf("%s failed: the cluster's state is unknown, the rest is not run", s.name)
		}
		phase(t, s.name, start)
	}

	start = time.Now()
	t.Run("Uninstall", func(t *testing.T) { testUninstall(t, c, m) })
	phase(t, "Uninstall", start)
}
