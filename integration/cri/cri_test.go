//go:build integration

// Package cri holds the end-to-end tests of the kubelet path: pods asked
// for over the CRI v1 API (as kubelet asks) from a private containerd
// (Debian's 1.6), whose CRI plugin runs the conflist with the reference
// bridge plugin, ipam-ring and portmap-ingress. Each "node" is a containerd
// in a network namespace and a mount namespace of its own (node_test.go);
// the pause image is a static binary the suite builds and imports
// (image_test.go, testdata/pause); the CRI client is the suite's own on
// k8s.io/cri-api (client_test.go). What the plugins see is what containerd
// really sends: K8S_POD_* in CNI_ARGS, DEL twice per pod (at stop with the
// netns, at remove without), a DEL right after a failed ADD, portMappings
// in Go field case, no "ips" capability.
//
// Under CI (the CI variable set) a missing containerd or privilege fails
// the suite instead of skipping it.
package cri

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"testing"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/ringipam/ringipam/integration/cnitest"
	"github.com/ringipam/ringipam/integration/netns"
	"github.com/ringipam/ringipam/pkg/pool"
)

var portmapBin, pauseArchive string

func TestMain(m *testing.M) {
	os.Exit(cnitest.Main(m, func(ctx context.Context, dir string) error {
		portmapBin = filepath.Join(dir, "portmap-ingress")
		if err := cnitest.Build(ctx, portmapBin, "./plugins/portmap-ingress"); err != nil {
			return err
		}
		pause := filepath.Join(dir, "pause")
		build := cnitest.GoCommand(ctx, cnitest.RepoRoot, "build", "-o", pause, "./integration/cri/testdata/pause")
		build.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := build.CombinedOutput(); err != nil {
			return fmt.Errorf("building pause: %v: %s", err, out)
		}
		pauseArchive = filepath.Join(dir, "pause.tar")
		return writeImageArchive(pauseArchive, pause, pauseImage)
	}))
}

// network describes the conflist a node runs: bridge with ipam-ring, then
// optionally portmap-ingress, then ipam-ring chained (for GC, as the
// README recommends).
type network struct {
	name    string
	bridge  string         // the bridge's name on the node
	subnet  string         // the pool's one range
	store   map[string]any // ipam-ring's and portmap-ingress's store
	ipam    map[string]any // further ipam keys (reservationFromPod, ...)
	portmap bool
}

// conflist is net's configuration list for node host, as an operator
// would write it for containerd 1.6 (CNI 1.0.0: its libcni knows no
// 1.1.0).
func (net network) conflist(host string) map[string]any {
	ipam := map[string]any{"type": "ipam-ring", "host": host, "store": net.store, "timeout": "50s",
		"ranges": [][]map[string]string{{{"subnet": net.subnet}}}, "routes": []map[string]string{{"dst": "0.0.0.0/0"}}}
	for k, v := range net.ipam {
		ipam[k] = v
	}
	plugins := []map[string]any{{"type": "bridge", "bridge": net.bridge, "isGateway": true, "ipMasq": false, "hairpinMode": true,
		"capabilities": map[string]bool{"io.kubernetes.cri.pod-annotations": true}, "ipam": ipam}}
	if net.portmap {
		plugins = append(plugins, map[string]any{"type": "portmap-ingress", "host": host, "store": net.store, "timeout": "50s",
			"capabilities": map[string]bool{"portMappings": true, "io.kubernetes.cri.pod-annotations": true}})
	}
	plugins = append(plugins, map[string]any{"type": "ipam-ring", "chained": true, "ipam": ipam})
	return map[string]any{"cniVersion": "1.0.0", "name": net.name, "plugins": plugins}
}

func localStore(t *testing.T) map[string]any {
	return map[string]any{"type": "local", "path": filepath.Join(t.TempDir(), "ringipam.db")}
}

// checkPods checks that every pod has a distinct address in subnet, that
// the sandbox status shows it, and that it is on the pod's eth0 (inside its
// own network namespace).
func checkPods(t *testing.T, n *node, subnet string, pods []pod) {
	t.Helper()
	sub := netip.MustParsePrefix(subnet)
	seen := map[string]string{}
	for _, p := range pods {
		a, err := netip.ParseAddr(p.IP)
		if err != nil || !sub.Contains(a) {
			t.Errorf("pod %s/%s: address %q not in %s", p.Namespace, p.Name, p.IP, subnet)
			continue
		}
		if other, dup := seen[p.IP]; dup {
			t.Errorf("pods %s and %s/%s share %s", other, p.Namespace, p.Name, p.IP)
		}
		seen[p.IP] = p.Namespace + "/" + p.Name
		addrs, err := n.eth0(p)
		if err != nil {
			t.Error(err)
			continue
		}
		want := fmt.Sprintf("%s/%d", p.IP, sub.Bits())
		if !slices.Equal(addrs, []string{want}) {
			t.Errorf("pod %s/%s: eth0 has %v, want [%s]", p.Namespace, p.Name, addrs, want)
		}
	}
}

// held returns the addresses ipam-ring's owners hold on network in the
// store (pool.List), by container ID.
func held(t *testing.T, st map[string]any, host, network string) map[string][]string {
	t.Helper()
	out := map[string][]string{}
	cnitest.Inspect(t, st, host, func(a *pool.Allocator) {
		allocs, err := a.List(context.Background(), pool.Filter{Kind: pool.KindCNI, Network: network})
		if err != nil {
			t.Fatal(err)
		}
		for _, al := range allocs {
			for _, x := range al.Addrs {
				out[al.Owner.ContainerID] = append(out[al.Owner.ContainerID], x.Addr.String())
			}
		}
	})
	return out
}

// Must-show 1: 20 pods, 4 at a time, on a /27 through containerd get
// distinct addresses, each on its eth0; stopping and removing them all
// leaves nothing held in the store; 20 more pods fit the same /27 (29
// usable addresses: a leak of 10 would show).
func TestPodsOnSmallPool(t *testing.T) {
	requireContainerd(t)
	net := network{name: netns.Unique("cri-"), bridge: "cri0", subnet: "198.18.60.0/27", store: localStore(t)}
	n := startNode(t, "node-a", net.conflist("node-a"))
	for round := range 2 {
		var cfgs []*runtimeapi.PodSandboxConfig
		for i := range 20 {
			cfgs = append(cfgs, podConfig("default", fmt.Sprintf("web-%d-%d", round, i)))
		}
		pods := n.runMany(t, 4, cfgs)
		checkPods(t, n, net.subnet, pods)
		h := held(t, net.store, n.name, net.name)
		for _, p := range pods {
			if !slices.Equal(h[p.ID], []string{p.IP}) {
				t.Errorf("round %d: store holds %v for %s/%s (sandbox %s), containerd says %s", round, h[p.ID], p.Namespace, p.Name, p.ID, p.IP)
			}
		}
		if len(h) != len(pods) {
			t.Errorf("round %d: store holds %d owners for %d pods: %v", round, len(h), len(pods), h)
		}
		n.removeMany(t, 4, pods)
		if h := held(t, net.store, n.name, net.name); len(h) != 0 {
			t.Fatalf("round %d: after stop and remove the store still holds %v", round, h)
		}
	}
}
