//go:build integration

package agent_test

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ringipam/ringipam/cmd/ringipamd/agent"
	"github.com/ringipam/ringipam/integration/cnitest"
	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/portalloc"
)

// Killing the agent (SIGKILL: no chance to revoke its lease) makes its host
// down one lease TTL later, not orphaned, and costs it nothing.
func TestKilledAgentLeavesItsHostDownNotOrphaned(t *testing.T) {
	c := newCluster(t)
	const host = "killed-host"
	listen := freePort(t)
	b := startBinary(t, nil, "--host", host, "--addr", "198.18.40.250", "--store", "etcd", "--etcd-endpoints", c.etcd.Endpoints()[0],
		"--store-prefix", c.prefix, "--lease-ttl", "2s", "--heartbeat", "500ms", "--listen", listen, "--ingress=false")
	waitSocket(t, b.socket)
	conf := ipamConf(t, "ag-kill", host, "198.18.40.0/24", b.store(c.storeObj("")), nil)
	res, err := cnitest.ExecIPAM("ADD", conf, "ctr-1", "")
	if err != nil {
		t.Fatal(err)
	}
	inspect := c.allocator(t, "inspector", nil)
	waitFor(t, 20*time.Second, "the agent's host up", func() (bool, string) {
		h, _ := stateOf(t, inspect, host, 0)
		return h.State == pool.HostUp && h.Agent, fmt.Sprintf("%+v", h)
	})
	if body, code, err := httpGet("http://" + listen + "/healthz"); err != nil || code != 200 || strings.TrimSpace(body) != "ok" {
		t.Fatalf("healthz: %d %q %v", code, body, err)
	}
	killed := time.Now()
	if err := b.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	<-b.done
	var downAfter time.Duration
	waitFor(t, 15*time.Second, "the host down after the lease TTL", func() (bool, string) {
		h, _ := stateOf(t, inspect, host, 0)
		downAfter = time.Since(killed)
		return h.State == pool.HostDown, fmt.Sprintf("%+v", h)
	})
	t.Logf("down %s after SIGKILL (lease TTL 2s)", downAfter.Round(10*time.Millisecond))
	h, _ := stateOf(t, inspect, host, 0)
	if h.State != pool.HostDown || !h.OrphanedAt.IsZero() {
		t.Fatalf("killed agent's host: %+v, want down and never orphaned", h)
	}
	// A sweep now (default orphanAfter, 48h) takes nothing.
	reports, err := inspect.Sweep(context.Background(), pool.DefaultOrphanAfter)
	if err != nil || len(reports) != 0 {
		t.Fatalf("sweep of a host down for seconds: %+v %v", reports, err)
	}
	// Another host's agent checks the down host's container: intact.
	checker := startBinary(t, nil, "--host", "checker-host", "--store", "etcd", "--etcd-endpoints", c.etcd.Endpoints()[0],
		"--store-prefix", c.prefix, "--listen", "off", "--ingress=false", "--sweep=false")
	waitSocket(t, checker.socket)
	conf = ipamConf(t, "ag-kill", host, "198.18.40.0/24", checker.store(c.storeObj("")), nil)
	if _, err := cnitest.ExecIPAM("CHECK", withPrev(t, conf, res.IPs[0].Address.IP.String(), "198.18.40.0/24"), "ctr-1", ""); err != nil {
		t.Fatalf("CHECK of the down host's container: %v", err)
	}
	got, err := inspect.List(context.Background(), pool.Filter{Host: host})
	if err != nil || len(got) != 1 {
		t.Fatalf("the down host's allocations: %+v %v", got, err)
	}
}

// The orphaning story through the agents, on a real etcd with clocks the
// test moves: host B's agent stops and B is judged 49 hours later by the
// agents of A and C sweeping at the same moment; everything of B is
// reclaimed exactly once (addresses and published ports), A loses nothing
// although its allocations are as old, CHECK fails for B's old container,
// B's returning agent says loudly that B was orphaned, and B's new
// containers get addresses A does not hold.
func TestOrphanedHostIsReclaimedByTheAgents(t *testing.T) {
	c := newCluster(t)
	const subnet = "198.18.41.0/26"
	network := "ag-orphan"
	// The plugins' calls (of every host: the test's hosts are names in the
	// store, their agents run in this process) go through one agent of
	// their own, which sweeps nothing.
	plugins := startBinary(t, nil, "--host", "plugins-host", "--store", "etcd", "--etcd-endpoints", c.etcd.Endpoints()[0],
		"--store-prefix", c.prefix, "--listen", "off", "--ingress=false", "--sweep=false")
	waitSocket(t, plugins.socket)
	conf := func(host string) []byte {
		return ipamConf(t, network, host, subnet, plugins.store(c.storeObj("")), nil)
	}
	held := map[string][]string{}
	for _, h := range []string{"host-a", "host-b"} {
		for i := range 3 {
			res, err := cnitest.ExecIPAM("ADD", conf(h), fmt.Sprintf("%s-%d", h, i), "")
			if err != nil {
				t.Fatal(err)
			}
			held[h] = append(held[h], res.IPs[0].Address.IP.String())
		}
	}
	// B published an ingress port.
	st := c.openStore(t)
	portsB, _ := portalloc.New(st, "host-b")
	epB := portalloc.EndpointID{Network: network, ContainerID: "host-b-0", IfName: "eth0"}
	if _, err := portsB.Allocate(context.Background(), epB, []portalloc.Port{{Mode: portalloc.Ingress, Protocol: "tcp", Number: 8080, Name: "80"}}); err != nil {
		t.Fatal(err)
	}
	bAgent := startAgent(t, c.agentConfig("host-b"))
	aAgent := startAgent(t, c.agentConfig("host-a"))
	inspect := c.allocator(t, "inspector", nil)
	for _, h := range []string{"host-a", "host-b"} {
		waitFor(t, 20*time.Second, h+" up", func() (bool, string) {
			info, _ := stateOf(t, inspect, h, 0)
			return info.State == pool.HostUp, fmt.Sprintf("%+v", info)
		})
	}
	// B's agent stops (its lease is revoked): B is down at once.
	bAgent.stop()
	waitFor(t, 20*time.Second, "host-b down", func() (bool, string) {
		info, _ := stateOf(t, inspect, "host-b", 0)
		return info.State == pool.HostDown, fmt.Sprintf("%+v", info)
	})
	// 49 hours later, as the agents of A and C see it.
	aAgent.stop()
	later := func() time.Time { return time.Now().Add(49 * time.Hour) }
	aAgent = startAgent(t, c.agentConfig("host-a"), agent.WithClock(later))
	cAgent := startAgent(t, c.agentConfig("host-c"), agent.WithClock(later))
	judge := c.allocator(t, "inspector", later)
	waitFor(t, 30*time.Second, "host-b's owners and ports reclaimed", func() (bool, string) {
		left, err := judge.List(context.Background(), pool.Filter{Host: "host-b"})
		if err != nil {
			return false, err.Error()
		}
		_, ok, err := portsB.Lookup(context.Background(), epB)
		return len(left) == 0 && !ok && err == nil, fmt.Sprintf("%d owners of host-b, port endpoint held %v (%v)", len(left), ok, err)
	})
	info, _ := stateOf(t, judge, "host-b", 0)
	if info.State != pool.HostOrphaned || info.OrphanedAt.IsZero() || info.Ranges != 0 {
		t.Fatalf("host-b after the sweeps: %+v", info)
	}
	// Exactly once: the two agents' counts add up to B's owners and port endpoints.
	waitFor(t, 10*time.Second, "the sweeps' counts", func() (bool, string) {
		owners := metric(t, aAgent.url, "ringipam_reclaimed_owners_total") + metric(t, cAgent.url, "ringipam_reclaimed_owners_total")
		ports := metric(t, aAgent.url, "ringipam_reclaimed_port_endpoints_total") + metric(t, cAgent.url, "ringipam_reclaimed_port_endpoints_total")
		return owners == 3 && ports == 1, fmt.Sprintf("owners released %v, port endpoints %v", owners, ports)
	})
	// A, with allocations just as old but a live lease, lost nothing.
	aOwners, err := judge.List(context.Background(), pool.Filter{Host: "host-a"})
	if err != nil || len(aOwners) != 3 {
		t.Fatalf("host-a's owners after the sweep: %+v %v", aOwners, err)
	}
	for i := range 3 {
		if _, err := cnitest.ExecIPAM("CHECK", withPrev(t, conf("host-a"), held["host-a"][i], subnet), fmt.Sprintf("host-a-%d", i), ""); err != nil {
			t.Errorf("CHECK of host-a's container %d: %v", i, err)
		}
	}
	// CHECK fails for B's container whose allocation was taken away.
	if _, err := cnitest.ExecIPAM("CHECK", withPrev(t, conf("host-b"), held["host-b"][0], subnet), "host-b-0", ""); err == nil {
		t.Fatal("CHECK passed for a container of the orphaned host")
	} else {
		t.Logf("CHECK of B's old container: %v", err)
	}
	// B comes back: its agent and STATUS say it was orphaned.
	bAgent = startAgent(t, c.agentConfig("host-b"))
	waitFor(t, 20*time.Second, "host-b's agent reporting it was orphaned", func() (bool, string) {
		page, _, err := httpGet(bAgent.url + "/")
		return err == nil && strings.Contains(page, `id="orphaned"`) && metric(t, bAgent.url, "ringipam_host_orphaned") == 1, "page without the banner"
	})
	if _, err := cnitest.ExecIPAM("STATUS", conf("host-b"), "", ""); err == nil || !strings.Contains(err.Error(), "orphaned") {
		t.Errorf("STATUS on the returned host-b: %v, want an error saying it was orphaned", err)
	}
	// Its new containers get fresh addresses that A does not hold.
	aHeld := map[string]bool{}
	for _, ip := range held["host-a"] {
		aHeld[ip] = true
	}
	for i := range 4 {
		res, err := cnitest.ExecIPAM("ADD", conf("host-b"), fmt.Sprintf("host-b-new-%d", i), "")
		if err != nil {
			t.Fatal(err)
		}
		if ip := res.IPs[0].Address.IP.String(); aHeld[ip] {
			t.Fatalf("host-b's new container got %s, which host-a holds", ip)
		}
	}
	if problems, err := judge.Check(context.Background(), poolName(t, judge, subnet)); err != nil || len(problems) != 0 {
		t.Fatalf("pool check: %v %v", problems, err)
	}
}

// withPrev adds a prevResult holding ip (in subnet) to conf, for CHECK.
func withPrev(t *testing.T, conf []byte, ip, subnet string) []byte {
	t.Helper()
	p := netip.MustParsePrefix(subnet)
	prev := fmt.Sprintf(`,"prevResult":{"cniVersion":"1.1.0","ips":[{"address":"%s/%d"}]}}`, ip, p.Bits())
	return append(conf[:len(conf)-1], prev...)
}

// poolName finds the name of the pool covering subnet.
func poolName(t *testing.T, a *pool.Allocator, subnet string) string {
	t.Helper()
	defs, err := a.Pools(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range defs {
		if _, ok := d.RangeFor(netip.MustParsePrefix(subnet).Addr()); ok {
			return d.Name
		}
	}
	t.Fatalf("no pool covers %s", subnet)
	return ""
}
