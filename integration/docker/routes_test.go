//go:build integration

package docker

import (
	"fmt"
	"net/netip"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/ringipam/ringipam/integration/cnitest"
	"github.com/ringipam/ringipam/integration/netns"
	"github.com/ringipam/ringipam/internal/testenv"
)

// TestTwoHostsRoutes is issue 35's item 3: two private dockerds, each in a
// namespace host on one LAN with its agent --routes, a bridge network
// created through the driver on one shared ringipam pool on each; a
// container on each host pings the other's by address (the agents route
// each other's ranges and answer ARP for them on the Docker bridges).
func TestTwoHostsRoutes(t *testing.T) {
	requireDocker(t)
	if _, err := exec.LookPath("ping"); err != nil {
		t.Fatalf("ping (iputils-ping) missing: %v", err)
	}
	e := testenv.StartEtcd(t)
	st := storeSpec{endpoints: e.Endpoints(), prefix: "/" + netns.Unique("rrt") + "/"}
	lan := netns.New(t, "dklan")
	lan.MustRun(t, "ip", "link", "add", "br0", "type", "bridge")
	lan.MustRun(t, "ip", "link", "set", "br0", "up")
	type host struct {
		name string
		ip   string
		drv  *drv
		d    *dockerd
		ctr  string
		addr netip.Addr
	}
	var hosts []*host
	for i, name := range []string{"hostA", "hostB"} {
		// The driver first: cleanups run last first, so dockerd removes
		// its containers while the driver still serves.
		h := &host{name: name, ip: fmt.Sprintf("198.18.66.%d", i+1), drv: startDriver(t, name, st)}
		h.d = startDockerd(t, name, false)
		port := fmt.Sprintf("d%d", i)
		lan.MustRun(t, "ip", "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", h.d.ns.Name)
		lan.MustRun(t, "ip", "link", "set", port, "master", "br0", "up")
		h.d.ns.MustRun(t, "ip", "addr", "add", h.ip+"/24", "dev", "eth0")
		h.d.ns.MustRun(t, "ip", "link", "set", "eth0", "up")
		// dockerd --iptables=false leaves forwarding as it is.
		h.d.ns.MustRun(t, "sysctl", "-w", "net.ipv4.ip_forward=1")
		cnitest.StartAgent(t, cnitest.AgentOptions{
			Endpoints: []string{"http://" + h.d.ns.Relay(t, strings.TrimPrefix(e.Endpoints()[0], "http://"))},
			Prefix:    st.prefix, Host: name, NS: h.d.ns,
			Args: []string{"--addr", h.ip, "--routes", "--sync-interval", "300ms", "--heartbeat", "1s", "--log-level", "info"},
		})
		hosts = append(hosts, h)
	}
	subnet := netip.MustParsePrefix("198.18.67.0/24")
	for _, h := range hosts {
		h.d.must("network", "create", "-d", "bridge", "--ipam-driver", h.drv.name, "--subnet", subnet.String(), "--gateway", "198.18.67.254", "lan")
		h.ctr = "c-" + h.name
		h.d.must("run", "-d", "--name", h.ctr, "--network", "lan", image)
		h.addr = h.d.ip(h.ctr, "lan")
	}
	if hosts[0].addr == hosts[1].addr {
		t.Fatalf("both containers got %s", hosts[0].addr)
	}
	for _, from := range hosts {
		pid := strings.TrimSpace(from.d.must("inspect", "-f", "{{.State.Pid}}", from.ctr))
		for _, to := range hosts {
			if to == from {
				continue
			}
			deadline := time.Now().Add(30 * time.Second)
			for {
				out, err := exec.Command("nsenter", "--net=/proc/"+pid+"/ns/net", "--", "ping", "-c", "1", "-W", "1", to.addr.String()).CombinedOutput()
				if err == nil {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("%s's container (%s) does not reach %s's (%s) within 30s: %v\n%s\n--- %s:\n%s\n%s", from.name, from.addr, to.name, to.addr, err, out,
						from.name, from.d.ns.MustRun(t, "ip", "route", "show", "table", "all"), from.d.ns.MustRun(t, "ip", "addr"))
				}
				time.Sleep(300 * time.Millisecond)
			}
		}
	}
}
