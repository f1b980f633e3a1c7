//go:build integration

// Package ringctl holds the end-to-end tests of the ringctl binary: a real
// etcd server (internal/testenv) holding allocations made by the real
// ipam-ring binary for three host names and ports published by the real
// portmap-ingress binary, read and repaired through the ringctl binary
// built from this checkout; and the migration from host-local, driven by
// cnitool with the reference bridge and host-local plugins in real network
// namespaces.
package ringctl

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/ringipam/ringipam/integration/cnitest"
	"github.com/ringipam/ringipam/integration/netns"
	"github.com/ringipam/ringipam/internal/testenv"
)

var ringctlBin, portmapBin string

func TestMain(m *testing.M) {
	os.Exit(cnitest.Main(m, func(ctx context.Context, dir string) error {
		ringctlBin = filepath.Join(dir, "ringctl")
		if err := cnitest.Build(ctx, ringctlBin, "./cmd/ringctl"); err != nil {
			return err
		}
		portmapBin = filepath.Join(dir, "portmap-ingress")
		return cnitest.Build(ctx, portmapBin, "./plugins/portmap-ingress")
	}))
}

// cluster is one test's store: a real etcd and a fresh key prefix, and
// the host agents of the hosts whose plugins ran on it.
type cluster struct {
	etcd   *testenv.Etcd
	prefix string

	mu     sync.Mutex
	agents map[string]*cnitest.Agent // by host name
	// agentNS is the namespace the agents run in (made with the first):
	// portmap-ingress's forwards go where its agent runs, so not into the
	// machine's own tables, and each cluster has a table of its own.
	// agentEtcd is the etcd endpoint as seen from there (a relay).
	agentNS   *netns.NS
	agentEtcd string
}

func newCluster(t *testing.T) *cluster {
	t.Helper()
	netns.RequireRoot(t) // etcd and the namespaces of the suite need root
	return &cluster{etcd: testenv.StartEtcd(t), prefix: "/" + netns.Unique("rc-") + "/"}
}

// store is the store object the test reads and ringctl uses.
func (c *cluster) store() map[string]any {
	return map[string]any{"type": "etcd", "endpoints": c.etcd.Endpoints(), "prefix": c.prefix}
}

// agent is host's agent (in the cluster's agent namespace, reaching etcd
// through a relay), started for t when host's plugins first run.
func (c *cluster) agent(t *testing.T, host string) *cnitest.Agent {
	t.Helper()
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.agents == nil {
		c.agents = map[string]*cnitest.Agent{}
	}
	a := c.agents[host]
	if a == nil {
		if c.agentNS == nil {
			c.agentNS = netns.New(t, "rca")
			c.agentEtcd = "http://" + c.agentNS.Relay(t, strings.TrimPrefix(c.etcd.Endpoints()[0], "http://"))
		}
		// The relay first, then the test's endpoint (unreachable from
		// the namespace: etcd's client uses the one it reaches), which
		// the plugins' store object names: the agent serves that store.
		a = cnitest.StartAgent(t, cnitest.AgentOptions{Endpoints: []string{c.agentEtcd, c.etcd.Endpoints()[0]}, Prefix: c.prefix, Host: host, NS: c.agentNS})
		c.agents[host] = a
	}
	return a
}

// stopAgents stops every host agent of c (they restart on the next use).
func (c *cluster) stopAgents(t *testing.T) {
	t.Helper()
	c.mu.Lock()
	defer c.mu.Unlock()
	for host, a := range c.agents {
		a.Stop(t)
		delete(c.agents, host)
	}
}

// hostStore is the "store" object of host's plugins: through its agent.
func (c *cluster) hostStore(t *testing.T, host string) map[string]any {
	t.Helper()
	return c.agent(t, host).Store(c.store())
}

// ipam is an ipam-ring "ipam" object of host with one IPv4 and one IPv6
// range set.
func (c *cluster) ipam(t *testing.T, host string, extra map[string]any) map[string]any {
	t.Helper()
	m := map[string]any{"type": "ipam-ring", "host": host, "store": c.hostStore(t, host), "timeout": "30s",
		"ranges": [][]map[string]string{{{"subnet": "198.18.20.0/24"}}, {{"subnet": "2001:db8:20::/64"}}}}
	for k, v := range extra {
		m[k] = v
	}
	return m
}

const network = "rcnet"

// netConf is the network configuration a main plugin hands ipam-ring.
func netConf(ipam map[string]any) []byte {
	b, _ := json.Marshal(map[string]any{"cniVersion": "1.1.0", "name": network, "type": "bridge", "ipam": ipam})
	return b
}

// ipamExec runs the real ipam-ring binary once, as a main plugin does.
func ipamExec(t *testing.T, verb string, conf []byte, ctr, cniArgs string) []byte {
	t.Helper()
	out, err := ipamExecErr(verb, conf, ctr, cniArgs)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func ipamExecErr(verb string, conf []byte, ctr, cniArgs string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(context.Background(), cnitest.OpTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, cnitest.IPAMBin)
	cmd.Env = []string{"CNI_COMMAND=" + verb, "CNI_CONTAINERID=" + ctr, "CNI_NETNS=/var/run/netns/ipam-only", "CNI_IFNAME=eth0",
		"CNI_ARGS=" + cniArgs, "CNI_PATH=" + filepath.Dir(cnitest.IPAMBin), "PATH=/usr/sbin:/usr/bin:/sbin:/bin"}
	cmd.Stdin = bytes.NewReader(conf)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		return out.Bytes(), fmt.Errorf("ipam-ring %s %s: %v: %s %s", verb, ctr, err, out.Bytes(), errb.Bytes())
	}
	return out.Bytes(), nil
}

// addResult is what ipam-ring's ADD printed.
type addResult struct {
	IPs []struct {
		Address string `json:"address"`
	} `json:"ips"`
}

// add allocates for ctr on host and returns its addresses (no prefix).
func (c *cluster) add(t *testing.T, host, ctr, cniArgs string, extra map[string]any) []string {
	t.Helper()
	var r addResult
	if err := json.Unmarshal(ipamExec(t, "ADD", netConf(c.ipam(t, host, extra)), ctr, cniArgs), &r); err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, ip := range r.IPs {
		out = append(out, strings.Split(ip.Address, "/")[0])
	}
	return out
}

func (c *cluster) del(t *testing.T, host, ctr string, extra map[string]any) {
	t.Helper()
	ipamExec(t, "DEL", netConf(c.ipam(t, host, extra)), ctr, "")
}

// run is one ringctl invocation's outcome.
type run struct {
	stdout, stderr string
	code           int
}

// ringctl runs the binary against the cluster's store as host "admin"
// (flags may add to or override that).
func (c *cluster) ringctl(t *testing.T, args ...string) run {
	t.Helper()
	base := []string{"--store", "etcd", "--etcd-endpoints", strings.Join(c.etcd.Endpoints(), ","), "--etcd-prefix", c.prefix, "--host", "admin"}
	return ringctlRun(t, nil, append(base, args...)...)
}

func ringctlRun(t *testing.T, env []string, args ...string) run {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), cnitest.OpTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, ringctlBin, args...)
	cmd.Env = append([]string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin"}, env...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	r := run{stdout: out.String(), stderr: errb.String()}
	if ee, ok := err.(*exec.ExitError); ok {
		r.code = ee.ExitCode()
	} else if err != nil {
		t.Fatalf("ringctl %v: %v", args, err)
	}
	return r
}

// ok runs ringctl and fails the test unless it exits 0.
func (c *cluster) ok(t *testing.T, args ...string) string {
	t.Helper()
	r := c.ringctl(t, args...)
	if r.code != 0 {
		t.Fatalf("ringctl %v: exit %d\n%s%s", args, r.code, r.stdout, r.stderr)
	}
	return r.stdout
}

// jsonOf runs ringctl with --json and decodes its output into v.
func (c *cluster) jsonOf(t *testing.T, v any, args ...string) run {
	t.Helper()
	r := c.ringctl(t, append(args, "--json")...)
	if err := json.Unmarshal([]byte(r.stdout), v); err != nil {
		t.Fatalf("ringctl %v --json printed %q (exit %d, %s): %v", args, r.stdout, r.code, r.stderr, err)
	}
	return r
}

func checkWidth(t *testing.T, out string) {
	t.Helper()
	for _, l := range strings.Split(out, "\n") {
		if n := len([]rune(l)); n > 100 {
			t.Errorf("line of %d columns: %q", n, l)
		}
	}
}

// publish runs the real portmap-ingress binary inside n for ctr (whose
// address is ip) on host, publishing mappings; its store calls go through
// host's agent (whose socket n reaches through the file system).
func (c *cluster) publish(t *testing.T, n *netns.NS, host, ctr, ip string, mappings ...map[string]any) {
	t.Helper()
	conf := map[string]any{
		"cniVersion": "1.1.0", "name": network, "type": "portmap-ingress", "host": host, "timeout": "30s",
		"store":         c.hostStore(t, host),
		"runtimeConfig": map[string]any{"portMappings": mappings},
		"prevResult":    map[string]any{"cniVersion": "1.1.0", "ips": []map[string]any{{"address": ip + "/24"}}},
	}
	b, _ := json.Marshal(conf)
	ctx, cancel := context.WithTimeout(context.Background(), cnitest.OpTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, "ip", "netns", "exec", n.Name, portmapBin)
	cmd.Env = []string{"CNI_COMMAND=ADD", "CNI_CONTAINERID=" + ctr, "CNI_NETNS=/var/run/netns/unused", "CNI_IFNAME=eth0",
		"CNI_PATH=/nonexistent", "PATH=/usr/sbin:/usr/bin:/sbin:/bin"}
	cmd.Stdin = bytes.NewReader(b)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("portmap-ingress ADD %s on %s: %v: %s", ctr, host, err, out)
	}
}
