//go:build integration

package agent_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"

	"github.com/ringipam/ringipam/integration/cnitest"
	"github.com/ringipam/ringipam/integration/netns"
	"github.com/ringipam/ringipam/pkg/portalloc"
)

// A host's agent keeps portmap-ingress's table equal to what the store
// records on its host, through the binaries on a real etcd, with nftables
// in a namespace host:
//
//   - sync: the store loses one of the host's endpoints while the agent runs
//     (what a reclaim does to a host that was away): its forwards go from
//     the table without a DEL, the others stay;
//   - start: the agent is killed, the host is orphaned and another host's
//     agent reclaims its ports; when the host's agent starts again, the
//     forwards of the reclaimed endpoint go at once, without a DEL.
func TestAgentRemovesForwardsOfEndpointsTheHostNoLongerHolds(t *testing.T) {
	c := newCluster(t)
	const host = "pm-host"
	h := netns.New(t, "agp")
	relay := "http://" + h.Relay(t, strings.TrimPrefix(c.etcd.Endpoints()[0], "http://"))
	sock := socketPath(t)
	st := throughAgent(c.storeObj(relay), sock) // the host's plugins go through its agent
	dir := cnitest.PluginDir(t, cnitest.IPAMBin, "bridge", "loopback")
	if err := symlink(portmapBin, dir+"/portmap-ingress"); err != nil {
		t.Fatal(err)
	}
	cni := cnitest.NewCNI(t, dir)
	network := netns.Unique("agp-")
	list := cnitest.ConfList(t, network,
		map[string]any{"type": "bridge", "bridge": "agpbr0", "isGateway": true, "ipMasq": false,
			"ipam": map[string]any{"type": "ipam-ring", "host": host, "store": st, "timeout": "30s",
				"ranges": [][]map[string]string{{{"subnet": "198.18.52.0/24"}}}}},
		map[string]any{"type": "portmap-ingress", "host": host, "store": st, "mode": "host", "timeout": "30s",
			"capabilities": map[string]bool{"portMappings": true}},
	)
	agentArgs := []string{"--host", host, "--addr", "198.18.53.1", "--store", "etcd", "--etcd-endpoints", relay,
		"--store-prefix", c.prefix, "--lease-ttl", "2s", "--heartbeat", "200ms", "--sync-interval", "300ms",
		"--sweep=false", "--listen", "off", "--log-level", "debug", "--store-socket", sock}
	agent := startBinary(t, h, agentArgs...)
	waitSocket(t, sock)
	ports := map[string]int{"web-1": 8091, "web-2": 8092, "web-3": 8093}
	for _, ctr := range []string{"web-1", "web-2", "web-3"} {
		ns := netns.New(t, "agq")
		rt := &libcni.RuntimeConf{ContainerID: ctr, NetNS: ns.Path, IfName: "eth0",
			CapabilityArgs: map[string]any{"portMappings": []map[string]any{{"hostPort": ports[ctr], "containerPort": 80, "protocol": "tcp"}}}}
		if _, err := cnitest.Add(cni, h, list, rt); err != nil {
			t.Fatalf("ADD %s: %v", ctr, err)
		}
	}
	table := func() (string, error) { return h.Run("nft", "list", "map", "inet", "ringipam-portmap", "any4") }
	// forwards checks that the table forwards the ports of have and not
	// those of gone.
	forwards := func(have, gone []string) func() (bool, string) {
		return func() (bool, string) {
			out, err := table()
			if err != nil {
				return false, err.Error()
			}
			for _, ctr := range append(have, gone...) {
				if strings.Contains(out, fmt.Sprintf("tcp . %d ", ports[ctr])) != slices.Contains(have, ctr) {
					return false, out
				}
			}
			return true, out
		}
	}
	all := []string{"web-1", "web-2", "web-3"}
	forwarded := func(want ...string) func() (bool, string) {
		var gone []string
		for _, ctr := range all {
			if !slices.Contains(want, ctr) {
				gone = append(gone, ctr)
			}
		}
		return forwards(want, gone)
	}
	waitFor(t, 20*time.Second, "the three forwards installed", forwarded("web-1", "web-2", "web-3"))

	// Sync: web-1 leaves the store behind the plugin's back.
	pa, err := portalloc.New(c.openStore(t), "test")
	if err != nil {
		t.Fatal(err)
	}
	ep := func(ctr string) portalloc.EndpointID {
		return portalloc.EndpointID{Network: network, ContainerID: ctr, IfName: "eth0"}
	}
	if _, err := pa.Release(context.Background(), ep("web-1")); err != nil {
		t.Fatal(err)
	}
	if !eventually(60*time.Second, forwarded("web-2", "web-3")) {
		out, _ := table()
		t.Errorf("sync: the forward of web-1, released in the store, is still installed 60s later:\n%s", out)
	}

	// Start: the host goes away, is orphaned, and another host's agent
	// reclaims its ports; then its agent starts again.
	if err := agent.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	<-agent.done
	startBinary(t, nil, "--host", "pm-sweeper", "--store", "etcd", "--etcd-endpoints", c.etcd.Endpoints()[0],
		"--store-prefix", c.prefix, "--orphan-after", "3s", "--sweep-interval", "200ms", "--ingress=false", "--listen", "off")
	waitFor(t, 60*time.Second, "the sweeper to release the orphaned host's endpoints", func() (bool, string) {
		var held []string
		for _, ctr := range []string{"web-2", "web-3"} {
			_, ok, err := pa.Lookup(context.Background(), ep(ctr))
			if err != nil {
				return false, err.Error()
			}
			if ok {
				held = append(held, ctr)
			}
		}
		return len(held) == 0, fmt.Sprint("still held: ", held)
	})
	// The table still has them: nothing on the host has run since.
	if ok, out := forwards([]string{"web-2", "web-3"}, nil)(); !ok {
		t.Fatalf("the host's table changed while its agent was away:\n%s", out)
	}
	startBinary(t, h, agentArgs...)
	if !eventually(60*time.Second, forwards(nil, []string{"web-2", "web-3"})) {
		out, _ := table()
		t.Errorf("start: the forwards of web-2 and web-3, reclaimed while the host was away, are still installed 60s after its agent started:\n%s", out)
	}
}

// eventually polls ok every 50ms until it holds or patience ends.
func eventually(patience time.Duration, ok func() (bool, string)) bool {
	deadline := time.Now().Add(patience)
	for {
		if done, _ := ok(); done {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(50 * time.Millisecond)
	}
}
