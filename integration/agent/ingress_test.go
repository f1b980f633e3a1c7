//go:build integration

package agent_test

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"

	"github.com/ringipam/ringipam/integration/cnitest"
	"github.com/ringipam/ringipam/integration/netns"
)

// lanHost is a host of the ingress test: a namespace on the LAN with its
// own container bridge, plugins and agent.
type lanHost struct {
	name string
	ns   *netns.NS
	ip   string // on the LAN
	st   map[string]any
	cni  *libcni.CNIConfig
}

// Three dual-stack namespace hosts on one real etcd, each running ringipamd
// with one --addr per family: an ingress port published on host A through
// portmap-ingress (a container with an IPv4 and an IPv6 address) is reached
// from a client through A, B and C over both families, each forward going
// to A's address of the packet's family; after DEL it is reachable
// nowhere.
func TestIngressPortReachableThroughEveryHost(t *testing.T) {
	c := newCluster(t)
	lan := netns.New(t, "aglan")
	lan.MustRun(t, "ip", "link", "add", "br0", "type", "bridge")
	lan.MustRun(t, "ip", "link", "set", "br0", "up")
	attach := func(ns *netns.NS, port, ip, ip6 string) {
		lan.MustRun(t, "ip", "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns.Name)
		lan.MustRun(t, "ip", "link", "set", port, "master", "br0", "up")
		ns.MustRun(t, "ip", "addr", "add", ip+"/24", "dev", "eth0")
		ns.MustRun(t, "ip", "addr", "add", ip6+"/64", "dev", "eth0", "nodad")
		ns.MustRun(t, "ip", "link", "set", "eth0", "up")
	}
	ip6 := map[string]string{"host-a": "fd00:50::1", "host-b": "fd00:50::2", "host-c": "fd00:50::3"}
	network := netns.Unique("agi-")
	var hosts []*lanHost
	for i, name := range []string{"host-a", "host-b", "host-c"} {
		h := &lanHost{name: name, ns: netns.New(t, "agh"), ip: fmt.Sprintf("198.18.50.%d", i+1)}
		attach(h.ns, fmt.Sprintf("p%d", i), h.ip, ip6[name])
		h.st = c.storeObj("http://" + h.ns.Relay(t, strings.TrimPrefix(c.etcd.Endpoints()[0], "http://")))
		dir := cnitest.PluginDir(t, cnitest.IPAMBin, "bridge", "loopback")
		if err := symlink(portmapBin, dir+"/portmap-ingress"); err != nil {
			t.Fatal(err)
		}
		h.cni = cnitest.NewCNI(t, dir)
		b := startBinary(t, h.ns, "--host", name, "--addr", h.ip+","+ip6[name], "--store", "etcd", "--etcd-endpoints", h.st["endpoints"].([]string)[0],
			"--store-prefix", c.prefix, "--lease-ttl", "3s", "--sync-interval", "300ms", "--listen", "off", "--log-level", "debug")
		waitSocket(t, b.socket)
		h.st = b.store(h.st) // the host's plugins go through its agent
		hosts = append(hosts, h)
	}
	client := netns.New(t, "agk")
	attach(client, "pk", "198.18.50.100", "fd00:50::100")
	a := hosts[0]
	list := func(h *lanHost) *libcni.NetworkConfigList {
		return cnitest.ConfList(t, network,
			map[string]any{"type": "bridge", "bridge": "agbr0", "isGateway": true, "ipMasq": false,
				"ipam": map[string]any{"type": "ipam-ring", "host": h.name, "store": h.st, "timeout": "30s",
					"ranges": [][]map[string]string{{{"subnet": "198.18.51.0/24"}}, {{"subnet": "fd00:51::/64"}}}, "routes": []map[string]string{{"dst": "0.0.0.0/0"}, {"dst": "::/0"}}}},
			map[string]any{"type": "portmap-ingress", "host": h.name, "store": h.st, "mode": "ingress", "timeout": "30s",
				"capabilities": map[string]bool{"portMappings": true}},
		)
	}
	ctr := netns.New(t, "agc")
	rt := &libcni.RuntimeConf{ContainerID: "web-1", NetNS: ctr.Path, IfName: "eth0",
		CapabilityArgs: map[string]any{"portMappings": []map[string]any{{"hostPort": 8088, "containerPort": 80, "protocol": "tcp"}}}}
	if _, err := cnitest.Add(a.cni, a.ns, list(a), rt); err != nil {
		t.Fatalf("ADD on host-a: %v", err)
	}
	serveEcho(t, ctr, ":80")
	for _, h := range hosts[1:] {
		waitFor(t, 20*time.Second, h.name+" to forward 8088 to host-a, each family to its address", func() (bool, string) {
			out4, err4 := h.ns.Run("nft", "list", "map", "inet", "ringipam-ingress", "fwd4")
			out6, err6 := h.ns.Run("nft", "list", "map", "inet", "ringipam-ingress", "fwd6")
			return err4 == nil && strings.Contains(out4, "tcp . 8088 ") && strings.Contains(out4, ": 198.18.50.1") &&
				err6 == nil && strings.Contains(out6, "tcp . 8088 ") && strings.Contains(out6, ": fd00:50::1"), out4 + out6
		})
	}
	for _, h := range hosts {
		for _, target := range []string{h.ip + ":8088", "[" + ip6[h.name] + "]:8088"} {
			waitFor(t, 20*time.Second, "the port through "+h.name+" at "+target, func() (bool, string) {
				got, err := ask(client, target)
				return err == nil && got == "echo ping", fmt.Sprintf("%q %v", got, err)
			})
		}
	}
	if err := cnitest.InNS(a.ns, func(ctx context.Context) error { return a.cni.DelNetworkList(ctx, list(a), rt) }); err != nil {
		t.Fatalf("DEL on host-a: %v", err)
	}
	for _, h := range hosts {
		for _, target := range []string{h.ip + ":8088", "[" + ip6[h.name] + "]:8088"} {
			waitFor(t, 20*time.Second, "the port gone from "+target, func() (bool, string) {
				got, err := ask(client, target)
				return err != nil, fmt.Sprintf("still answered %q", got)
			})
		}
	}
	// The forwards themselves are gone too (a forward left behind would
	// only meet A's closed port, so the dials above cannot tell).
	for _, h := range hosts[1:] {
		waitFor(t, 20*time.Second, h.name+" to drop its forward", func() (bool, string) {
			out, err := h.ns.Run("nft", "list", "map", "inet", "ringipam-ingress", "fwd4")
			out6, err6 := h.ns.Run("nft", "list", "map", "inet", "ringipam-ingress", "fwd6")
			return err == nil && strings.Contains(out, "fwd4") && !strings.Contains(out, "8088") &&
				err6 == nil && strings.Contains(out6, "fwd6") && !strings.Contains(out6, "8088"), out + out6
		})
	}
}

// serveEcho answers each TCP line with "echo " and the line, on addr inside
// ns, until the test ends.
func serveEcho(t *testing.T, ns *netns.NS, addr string) {
	var l net.Listener
	if err := ns.Do(func() error {
		var err error
		l, err = net.Listen("tcp", addr)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() { l.Close(); wg.Wait() })
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			conn, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer conn.Close()
				_ = conn.SetDeadline(time.Now().Add(5 * time.Second))
				line, _ := bufio.NewReader(conn).ReadString('\n')
				fmt.Fprint(conn, "echo "+line)
			}()
		}
	}()
}

// ask sends "ping" to target from inside ns and returns the answer.
func ask(ns *netns.NS, target string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	conn, err := ns.DialContext(ctx, "tcp", target)
	if err != nil {
		return "", err
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(2 * time.Second))
	if _, err := fmt.Fprint(conn, "ping\n"); err != nil {
		return "", err
	}
	line, err := bufio.NewReader(conn).ReadString('\n')
	return strings.TrimSpace(line), err
}
