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
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

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

// cluster is one test's store: a real etcd and a fresh key prefix.
type cluster struct {
	etcd   *testenv.Etcd
	prefix string
}

func newCluster(t *testing.T) *cluster {
	t.Helper()
	netns.RequireRoot(t) // etcd and the namespaces of the suite need root
	return &cluster{etcd: testenv.StartEtcd(t), prefix: "/" + netns.Unique("rc-") + "/"}
}

// store is the plugins' "store" object.
func (c *cluster) store() map[string]any {
	return map[string]any{"type": "etcd", "endpoints": c.etcd.Endpoints(), "prefix": c.prefix}
}

// ipam is an ipam-ring "ipam" object of host with one IPv4 and one IPv6
// range set.
func (c *cluster) ipam(host string, extra map[string]any) map[string]any {
	m := map[string]any{"type": "ipam-ring", "host": host, "store": c.store(), "timeout": "30s",
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
	if err := json.Unmarshal(ipamExec(t, "ADD", netConf(c.ipam(host, extra)), ctr, cniArgs), &r); err != nil {
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
	ipamExec(t, "DEL", netConf(c.ipam(host, extra)), ctr, "")
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

// relayInto accepts TCP connections on loopback inside n and carries each
// to target in the test's own namespace (the test etcd), until the test
// ends; it returns the address to dial inside n.
func relayInto(t *testing.T, n *netns.NS, target string) string {
	t.Helper()
	var l net.Listener
	if err := n.Do(func() error {
		var err error
		l, err = net.Listen("tcp", "127.0.0.1:0")
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
			in, err := l.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer in.Close()
				out, err := net.DialTimeout("tcp", target, 5*time.Second)
				if err != nil {
					return
				}
				defer out.Close()
				done := make(chan struct{})
				go func() { io.Copy(out, in); out.(*net.TCPConn).CloseWrite(); close(done) }()
				io.Copy(in, out)
				<-done
			}()
		}
	}()
	return l.Addr().String()
}

// publish runs the real portmap-ingress binary inside n for ctr (whose
// address is ip) on host, publishing mappings.
func (c *cluster) publish(t *testing.T, n *netns.NS, endpoint, host, ctr, ip string, mappings ...map[string]any) {
	t.Helper()
	conf := map[string]any{
		"cniVersion": "1.1.0", "name": network, "type": "portmap-ingress", "host": host, "timeout": "30s",
		"store":         map[string]any{"type": "etcd", "endpoints": []string{"http://" + endpoint}, "prefix": c.prefix},
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
