//go:build integration

// Package portmap holds the end-to-end tests of portmap-ingress: the real
// plugin chained after the reference bridge plugin and ipam-ring, run by
// libcni, in namespaces the test makes: a "host" (the runtime's namespace,
// where the bridge and the nftables table live), a container running a TCP
// and UDP echo server, and a client namespace wired to the host by a veth
// pair.
package portmap

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"

	"github.com/ringipam/ringipam/integration/cnitest"
	"github.com/ringipam/ringipam/integration/netns"
)

var portmapBin, echoBin string

func TestMain(m *testing.M) {
	os.Exit(cnitest.Main(m, func(ctx context.Context, dir string) error {
		portmapBin = filepath.Join(dir, "portmap-ingress")
		if err := cnitest.Build(ctx, portmapBin, "./plugins/portmap-ingress"); err != nil {
			return err
		}
		echoBin = filepath.Join(dir, "echo")
		return cnitest.Build(ctx, echoBin, "./integration/portmap/testdata/echo")
	}))
}

// world is one host with a client wired to it.
type world struct {
	host, client *netns.NS
	cni          *libcni.CNIConfig
	store        map[string]any
}

func newWorld(t *testing.T) *world {
	netns.RequireRoot(t)
	w := &world{host: netns.New(t, "pmh"), client: netns.New(t, "pmk")}
	hv, kv := netns.Unique("pmv"), netns.Unique("pmv")
	if out, err := netns.Command("ip", "link", "add", hv, "netns", w.host.Name, "type", "veth", "peer", "name", kv, "netns", w.client.Name); err != nil {
		t.Fatalf("veth: %v %s", err, out)
	}
	w.host.MustRun(t, "ip", "addr", "add", "198.18.130.1/24", "dev", hv)
	w.host.MustRun(t, "ip", "link", "set", hv, "up")
	w.host.MustRun(t, "ip", "link", "set", "lo", "up")
	w.host.MustRun(t, "sysctl", "-qw", "net.ipv4.ip_forward=1")
	w.client.MustRun(t, "ip", "addr", "add", "198.18.130.2/24", "dev", kv)
	w.client.MustRun(t, "ip", "link", "set", kv, "up")
	w.client.MustRun(t, "ip", "link", "set", "lo", "up")
	dir := cnitest.PluginDir(t, cnitest.IPAMBin, "bridge", "loopback")
	if err := os.Symlink(portmapBin, filepath.Join(dir, "portmap-ingress")); err != nil {
		t.Fatal(err)
	}
	w.cni = cnitest.NewCNI(t, dir)
	w.store = map[string]any{"type": "local", "path": filepath.Join(t.TempDir(), "ringipam.db")}
	return w
}

func (w *world) list(t *testing.T, name string) *libcni.NetworkConfigList {
	return cnitest.ConfList(t, name,
		map[string]any{"type": "bridge", "bridge": "pmbr0", "isGateway": true, "hairpinMode": true, "ipMasq": false,
			"ipam": map[string]any{"type": "ipam-ring", "host": "pmhost", "store": w.store,
				"ranges": [][]map[string]string{{{"subnet": "198.18.131.0/24"}}}, "routes": []map[string]string{{"dst": "0.0.0.0/0"}}}},
		map[string]any{"type": "portmap-ingress", "host": "pmhost", "store": w.store,
			"capabilities": map[string]bool{"portMappings": true}},
	)
}

// container makes a container namespace running the echo server.
func (w *world) container(t *testing.T) *netns.NS {
	c := netns.New(t, "pmc")
	c.MustRun(t, "ip", "link", "set", "lo", "up")
	return c
}

func startEcho(t *testing.T, c *netns.NS) {
	cmd := exec.Command("ip", "netns", "exec", c.Name, echoBin, "-tcp", ":80", "-udp", ":53")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
}

func dial(t *testing.T, from *netns.NS, target string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var last string
	var err error
	for ctx.Err() == nil { // the server may still be starting
		var out []byte
		out, err = exec.CommandContext(ctx, "ip", "netns", "exec", from.Name, echoBin, "-dial", target, "-msg", "ping").CombinedOutput()
		last = string(out)
		if err == nil {
			return strings.TrimSpace(last), nil
		}
		time.Sleep(200 * time.Millisecond)
	}
	return last, err
}

func elementCount(t *testing.T, host *netns.NS) int {
	out, err := host.Run("nft", "-j", "list", "table", "inet", "ringipam-portmap")
	if err != nil {
		return 0 // no table yet
	}
	return strings.Count(out, `"elem"`) + strings.Count(out, `"comment"`) - strings.Count(out, `"comment": "ringipam`)
}

func TestPublishedPortsReachTheContainer(t *testing.T) {
	w := newWorld(t)
	name := netns.Unique("pm-")
	list := w.list(t, name)
	ctr := w.container(t)
	before := elementCount(t, w.host)
	rt := &libcni.RuntimeConf{ContainerID: "web", NetNS: ctr.Path, IfName: "eth0",
		CapabilityArgs: map[string]any{"portMappings": []map[string]any{
			{"hostPort": 8080, "containerPort": 80, "protocol": "tcp"},
			{"HostPort": 5353, "ContainerPort": 53, "Protocol": "udp"}, // containerd's spelling
		}}}
	res, err := cnitest.Add(w.cni, w.host, list, rt)
	if err != nil {
		t.Fatalf("ADD: %v", err)
	}
	if len(res.IPs) != 1 {
		t.Fatalf("result %+v", res)
	}
	startEcho(t, ctr)
	for _, c := range []struct{ what, from, target string }{
		{"TCP from a client", "client", "tcp/198.18.130.1:8080"},
		{"UDP from a client", "client", "udp/198.18.130.1:5353"},
		{"TCP from the host itself (localhost)", "host", "tcp/127.0.0.1:8080"},
		{"TCP from the container itself (hairpin)", "ctr", "tcp/198.18.131.1:8080"},
	} {
		from := map[string]*netns.NS{"client": w.client, "host": w.host, "ctr": ctr}[c.from]
		out, err := dial(t, from, c.target)
		if err != nil || out != "echo ping" {
			nft, _ := w.host.Run("nft", "list", "table", "inet", "ringipam-portmap")
			t.Fatalf("%s: %q %v\n%s", c.what, out, err, nft)
		}
	}
	// CHECK passes; a second ADD for the taken host port names the holder.
	if err := cnitest.InNS(w.host, func(ctx context.Context) error { return w.cni.CheckNetworkList(ctx, list, rt) }); err != nil {
		t.Fatalf("CHECK: %v", err)
	}
	other := w.container(t)
	rt2 := &libcni.RuntimeConf{ContainerID: "api", NetNS: other.Path, IfName: "eth0",
		CapabilityArgs: map[string]any{"portMappings": []map[string]any{{"hostPort": 8080, "containerPort": 80, "protocol": "tcp"}}}}
	_, err = cnitest.Add(w.cni, w.host, list, rt2)
	if err == nil || !strings.Contains(err.Error(), "/web/eth0") || cnitest.CNICode(err) != 100 {
		t.Fatalf("second ADD of host port 8080: %v (code %d), want code 100 naming the holder", err, cnitest.CNICode(err))
	}
	// DEL brings the rules back to what they were.
	if err := cnitest.InNS(w.host, func(ctx context.Context) error { return w.cni.DelNetworkList(ctx, list, rt) }); err != nil {
		t.Fatalf("DEL: %v", err)
	}
	if after := elementCount(t, w.host); after != before {
		nft, _ := w.host.Run("nft", "list", "table", "inet", "ringipam-portmap")
		t.Fatalf("rules after DEL: %d, before ADD: %d\n%s", after, before, nft)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if out, err := exec.CommandContext(ctx, "ip", "netns", "exec", w.client.Name, echoBin, "-dial", "tcp/198.18.130.1:8080").CombinedOutput(); err == nil {
		t.Fatalf("port 8080 still answers after DEL: %q", out)
	}
}
