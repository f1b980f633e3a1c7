//go:build integration

// Package cni holds the end-to-end tests of the ipam-ring CNI plugin: the
// plugin binary built from this checkout, driven by the reference bridge
// plugin, cnitool and libcni, in real network namespaces, on the embedded
// local store and on a real etcd server.
//
// Topology: every test creates its own "host" namespaces (each with its own
// bridge, made by the bridge plugin) and one namespace per container, so
// nothing touches the machine's own interfaces. The bridge plugin runs in
// the host namespace; ipam-ring, which needs no namespace, is started
// through a wrapper that puts it back into the test's own namespace, where
// the test etcd listens on loopback.
package cni

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/containernetworking/cni/libcni"
	current "github.com/containernetworking/cni/pkg/types/100"

	"github.com/ringipam/ringipam/integration/cnitest"
	"github.com/ringipam/ringipam/integration/netns"
)

var rootNSRef string // a path naming the test process's own network namespace

func TestMain(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	// Keep a handle on our own namespace before any test switches a
	// thread: the nsenter wrapper enters it through /proc/PID/fd/N.
	self, err := os.Open("/proc/self/ns/net")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer self.Close()
	rootNSRef = fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), self.Fd())
	return cnitest.Main(m, nil)
}

// pluginDir makes a CNI_PATH directory with the reference plugins and
// ipam-ring. With wrapIPAM, ipam-ring is a wrapper that runs the real
// binary in the test's own network namespace (so it reaches the test etcd
// on loopback even when the main plugin runs in a host namespace).
func pluginDir(t testing.TB, wrapIPAM bool) string {
	t.Helper()
	refs := []string{"bridge", "ptp", "loopback", "host-local"}
	if !wrapIPAM {
		return cnitest.PluginDir(t, cnitest.IPAMBin, refs...)
	}
	nsenter, err := exec.LookPath("nsenter")
	if err != nil {
		t.Fatalf("nsenter (util-linux) is needed: %v", err)
	}
	wrapper := filepath.Join(t.TempDir(), "ipam-ring")
	script := fmt.Sprintf("#!/bin/sh\nexec %s --net=%s -- %s \"$@\"\n", nsenter, rootNSRef, cnitest.IPAMBin)
	if err := os.WriteFile(wrapper, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return cnitest.PluginDir(t, wrapper, refs...)
}

// localStore is the ipam "store" object of a fresh local store.
func localStore(t testing.TB) map[string]any {
	return map[string]any{"type": "local", "path": filepath.Join(t.TempDir(), "ringipam.db")}
}

// etcdStore is the ipam "store" object for endpoints under a fresh prefix,
// with the product's default timeouts: 100 plugin processes started at once
// on a 2-core machine can see an etcd request take more than a couple of
// seconds, and these tests are about correctness, not speed. It names no
// agent: agentStore adds one.
func etcdStore(endpoints []string, prefix string) map[string]any {
	return map[string]any{"type": "etcd", "endpoints": endpoints, "prefix": prefix}
}

// agentStore starts the host agent of host on etcdStore(endpoints, prefix)
// in the test's own namespace (where the plugins of pluginDir(t, true) and
// execIPAM run) and returns the store object that sends the plugins to it;
// args are more agent flags.
func agentStore(t testing.TB, endpoints []string, prefix, host string, args ...string) map[string]any {
	t.Helper()
	a := cnitest.StartAgent(t, cnitest.AgentOptions{Endpoints: endpoints, Prefix: prefix, Host: host, Args: args})
	return a.Store(etcdStore(endpoints, prefix))
}

// ipamSection is an ipam-ring "ipam" object.
func ipamSection(host string, st map[string]any, rangeSets ...[]map[string]string) map[string]any {
	return map[string]any{"type": "ipam-ring", "host": host, "store": st, "ranges": rangeSets, "timeout": "20s"}
}

func subnet(cidr string) []map[string]string { return []map[string]string{{"subnet": cidr}} }

// bridgeList is a conflist with the bridge plugin delegating to ipam-ring
// (plus any extra plugins).
func bridgeList(t testing.TB, name, bridge string, ipam map[string]any, extra ...map[string]any) *libcni.NetworkConfigList {
	t.Helper()
	plugins := []map[string]any{{
		"type": "bridge", "bridge": bridge, "isGateway": true, "ipMasq": false,
		"capabilities": map[string]bool{"ips": true}, "ipam": ipam,
	}}
	plugins = append(plugins, extra...)
	return cnitest.ConfList(t, name, plugins...)
}

// rt is the runtime configuration of one container attachment.
func rt(c *netns.NS, id string) *libcni.RuntimeConf {
	return &libcni.RuntimeConf{ContainerID: id, NetNS: c.Path, IfName: "eth0"}
}

// execIPAM invokes the ipam-ring binary directly (cnitest.ExecIPAM).
func execIPAM(cmd string, conf []byte, containerID, cniArgs string) (*current.Result, error) {
	return cnitest.ExecIPAM(cmd, conf, containerID, cniArgs)
}

// netConf is a single-plugin network configuration carrying ipam.
func netConf(t testing.TB, name string, ipam map[string]any, extra map[string]any) []byte {
	t.Helper()
	m := map[string]any{"cniVersion": "1.1.0", "name": name, "type": "bridge", "ipam": ipam}
	for k, v := range extra {
		m[k] = v
	}
	b, err := json.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// ipsOf returns the addresses (CIDR form) of a result.
func ipsOf(r *current.Result) []string {
	var s []string
	for _, ip := range r.IPs {
		s = append(s, ip.Address.String())
	}
	return s
}

func joinErrs(errs []error) error { return errors.Join(errs...) }

func contains(list []string, s string) bool {
	for _, x := range list {
		if strings.EqualFold(x, s) {
			return true
		}
	}
	return false
}
