//go:build integration

package k8s

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ringipam/ringipam/integration/cnitest"
)

// buildNextImage builds the image of this tree once more under another
// version (scripts/build-image.sh with RINGIPAM_VERSION: the binaries'
// --version and the tag), the "next commit" a rolling update goes to, and
// returns its archive and tag.
func buildNextImage(t *testing.T) (archive, tag string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), imageTimeout)
	defer cancel()
	tag = imageTag + "-next"
	archive = filepath.Join(cnitest.RepoRoot, "bin", "ringipam-image-"+tag+".oci.tar")
	t.Cleanup(func() { os.Remove(archive) })
	build := exec.CommandContext(ctx, filepath.Join(cnitest.RepoRoot, "scripts", "build-image.sh"))
	build.Dir = cnitest.RepoRoot
	build.Env = append(os.Environ(), "PATH="+filepath.Dir(goBinary())+":"+os.Getenv("PATH"), "RINGIPAM_VERSION="+tag)
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("scripts/build-image.sh (RINGIPAM_VERSION=%s): %v\n%s", tag, err, out)
	}
	return archive, tag
}

// agentVersion is the version the node's agent reports (/status.json).
func (c *cluster) agentVersion() string {
	cl := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DialContext: c.node.DialContext}}
	resp, err := cl.Get("http://127.0.0.1:9476/status.json")
	if err != nil {
		return ""
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var s struct {
		Version string `json:"version"`
	}
	_ = json.Unmarshal(b, &s)
	return s.Version
}

func (c *cluster) scale(t *testing.T, name string, n int32) {
	t.Helper()
	ctx := context.Background()
	s, err := c.cs.AppsV1().Deployments(testNS).GetScale(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	s.Spec.Replicas = n
	if _, err := c.cs.AppsV1().Deployments(testNS).UpdateScale(ctx, name, s, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// testRollingUpdate: the DaemonSet's image changes to another build (its
// version string differs) while a Deployment scales up and down: the agent
// is replaced under pods being added and deleted. At the end the agent
// runs the new build, the pods that lived through it kept their address,
// no address is given twice (ringctl's owners are exactly the pods'
// addresses), every pod is Running, the DEL queue is drained (nothing
// queued, nothing failed) and ringctl check is clean.
func testRollingUpdate(t *testing.T, c *cluster) {
	ctx := context.Background()
	archive, tag := buildNextImage(t)
	c.importImage(t, archive, "docker.io/ringipam/ringipam")
	d := &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: "roll", Namespace: testNS},
		Spec: appsv1.DeploymentSpec{
			Replicas: int32p(6),
			Selector: &metav1.LabelSelector{MatchLabels: labels("roll")},
			Template: corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: labels("roll")}, Spec: podSpec()},
		},
	}
	if _, err := c.cs.AppsV1().Deployments(testNS).Create(ctx, d, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	before := map[string]string{}
	for _, p := range c.waitPods(t, "roll", 6) {
		before[p.Name] = p.Status.PodIP
	}
	old, err := c.agentPod(ctx)
	if err != nil || old == nil {
		t.Fatalf("no agent pod: %v", err)
	}

	ds, err := c.cs.AppsV1().DaemonSets(installNS).Get(ctx, "ringipam", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	spec := &ds.Spec.Template.Spec
	for _, cs := range [][]corev1.Container{spec.InitContainers, spec.Containers} {
		for i := range cs {
			cs[i].Image = "docker.io/ringipam/ringipam:" + tag
		}
	}
	if _, err := c.cs.AppsV1().DaemonSets(installNS).Update(ctx, ds, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	// Pods added while the agent is replaced, then some deleted.
	c.scale(t, "roll", 12)
	if err := c.poll(installTimeout, func(ctx context.Context) (bool, error) {
		p, err := c.agentPod(ctx)
		return err == nil && p != nil && p.UID != old.UID, nil
	}); err != nil {
		t.Fatalf("the agent's pod not replaced: %v; %s", err, c.agentPodState())
	}
	c.scale(t, "roll", 4)
	err = c.poll(installTimeout, func(ctx context.Context) (bool, error) {
		ds, err := c.cs.AppsV1().DaemonSets(installNS).Get(ctx, "ringipam", metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		st := ds.Status
		return st.ObservedGeneration >= ds.Generation && st.UpdatedNumberScheduled == 1 && st.NumberReady == 1 && c.agentVersion() == tag, nil
	})
	if err != nil {
		t.Fatalf("rollout to %s not done: %v; agent reports %q; %s", tag, err, c.agentVersion(), c.agentPodState())
	}
	c.scale(t, "roll", 8)
	pods := c.waitPods(t, "roll", 8)
	seen := map[string]string{}
	for _, p := range pods {
		if ip, ok := before[p.Name]; ok && ip != p.Status.PodIP {
			t.Errorf("pod %s lived through the update but moved from %s to %s", p.Name, ip, p.Status.PodIP)
		}
		if other, dup := seen[p.Status.PodIP]; dup {
			t.Errorf("pods %s and %s share %s", other, p.Name, p.Status.PodIP)
		}
		seen[p.Status.PodIP] = p.Name
	}
	c.checkOwned(t, pods)
	// The DEL queue drained: no entry left, none failed.
	q := c.hostDir("/var/lib/ringipam/del-queue")
	var left []string
	filepath.WalkDir(q, func(p string, e os.DirEntry, err error) error {
		if err == nil && !e.IsDir() {
			left = append(left, strings.TrimPrefix(p, q))
		}
		return nil
	})
	if len(left) > 0 {
		t.Errorf("the DEL queue %s holds %v after the rollout", q, left)
	}
	out := c.ringctl(t, "check")
	t.Logf("rolled from %s to %s under a Deployment scaled 6 -> 12 -> 4 -> 8: addresses kept, none twice, DEL queue empty; ringctl check: %s",
		imageTag, tag, strings.TrimSpace(string(out)))

	if err := c.cs.AppsV1().Deployments(testNS).Delete(ctx, "roll", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	c.waitPods(t, "roll", 0)
	c.checkNothingLeft(t, "the pods gone")
}
