//go:build integration

package agent_test

import (
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ringipam/ringipam/integration/cnitest"
	"github.com/ringipam/ringipam/integration/netns"
	"github.com/ringipam/ringipam/internal/testenv"
)

// The ipam-ring binary sends its whole invocations to the agent's socket
// when the agent serves the cluster its config names (the agent counts
// them), and reaches etcd itself when the agent is gone; a second agent
// does not take over a served socket; a stopped agent removes it.
func TestPluginsReachEtcdThroughTheAgent(t *testing.T) {
	c := newCluster(t)
	const host = "relay-host"
	sock := socketPath(t)
	listen := freePort(t)
	b := startBinary(t, nil, "--host", host, "--store", "etcd", "--etcd-endpoints", c.etcd.Endpoints()[0],
		"--store-prefix", c.prefix, "--listen", listen, "--ingress=false", "--store-socket", sock)
	waitFor(t, 20*time.Second, "the store socket", func() (bool, string) {
		_, err := os.Stat(sock)
		return err == nil, fmt.Sprint(err)
	})
	url := "http://" + listen
	adds := func() float64 {
		return metric(t, url, `ringipam_relayed_calls_total{op="invoke-ADD",result="ok"}`)
	}

	st := c.storeObj("")
	st["agentSocket"] = sock
	conf := ipamConf(t, "ag-relay", host, "198.18.44.0/24", st, nil)
	held := map[string]string{} // address -> container
	add := func(id string) {
		t.Helper()
		res, err := cnitest.ExecIPAM("ADD", conf, id, "")
		if err != nil {
			t.Fatalf("ADD %s: %v", id, err)
		}
		ip := res.IPs[0].Address.String()
		if other, ok := held[ip]; ok {
			t.Fatalf("%s got %s, held by %s", id, ip, other)
		}
		held[ip] = id
	}
	for i := range 5 {
		add(fmt.Sprintf("relay-%d", i))
	}
	if n := adds(); n != 5 {
		t.Fatalf("the agent served %v of 5 ADDs", n)
	}
	if _, err := cnitest.ExecIPAM("DEL", conf, "relay-0", ""); err != nil {
		t.Fatal(err)
	}
	for ip, id := range held {
		if id == "relay-0" {
			delete(held, ip)
		}
	}

	// Another cluster's plugin (another prefix) is refused by this agent
	// and reaches its etcd itself: the agent serves nothing for it.
	before := adds()
	other := c.storeObj("")
	other["prefix"] = c.prefix + "other/"
	other["agentSocket"] = sock
	if _, err := cnitest.ExecIPAM("ADD", ipamConf(t, "ag-relay-other", host, "198.18.45.0/24", other, nil), "relay-other", ""); err != nil {
		t.Fatalf("ADD of another cluster's plugin: %v", err)
	}
	if n := adds(); n != before {
		t.Fatalf("the agent served %v ADDs of another cluster", n-before)
	}
	if body, _, err := httpGet(url + "/metrics"); err != nil || strings.Contains(body, `ringipam_relayed_calls_total{op="commit"`) {
		t.Fatalf("the agent relayed store calls of the plugins (or its metrics failed: %v)", err)
	}

	// A second agent does not take the socket over.
	second := startBinary(t, nil, "--host", "relay-host-2", "--store", "etcd", "--etcd-endpoints", c.etcd.Endpoints()[0],
		"--store-prefix", c.prefix, "--listen", "off", "--ingress=false", "--store-socket", sock)
	select {
	case <-second.done:
		if !strings.Contains(second.log.String(), "another process serves it") {
			t.Fatalf("second agent's output:\n%s", second.log.String())
		}
	case <-time.After(20 * time.Second):
		t.Fatal("a second agent on a served socket kept running")
	}

	// The agent stops: the socket goes, and the plugin reaches etcd itself.
	if err := b.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case <-b.done:
	case <-time.After(20 * time.Second):
		t.Fatal("the agent did not stop on SIGTERM")
	}
	if _, err := os.Stat(sock); !os.IsNotExist(err) {
		t.Fatalf("the stopped agent left its socket: %v", err)
	}
	add("relay-after") // straight to etcd: the same ring, no address given twice
}

// On an etcd over TLS the plugin works through the agent (which holds the
// client certificate). Until the plugins require the agent on etcd (issue
// 34, the agent API), a plugin with no agent answering reaches etcd itself
// with etcd's own client and the configuration's TLS files (storeconfig.Open).
func TestTLSEtcdThroughTheAgent(t *testing.T) {
	netns.RequireRoot(t)
	srv, files := testenv.StartEtcdTLS(t)
	prefix := "/" + netns.Unique("agt-") + "/"
	sock := socketPath(t)
	st := map[string]any{"type": "etcd", "endpoints": srv.Endpoints(), "prefix": prefix, "agentSocket": sock,
		"tls": map[string]string{"ca": files.CA, "cert": files.Cert, "key": files.Key}}
	conf, err := json.Marshal(map[string]any{"cniVersion": "1.1.0", "name": "ag-tls", "type": "bridge",
		"ipam": map[string]any{"type": "ipam-ring", "host": "tls-host", "store": st, "timeout": "3s",
			"ranges": [][]map[string]string{{{"subnet": "198.18.46.0/24"}}}}})
	if err != nil {
		t.Fatal(err)
	}

	if _, err := cnitest.ExecIPAM("ADD", conf, "tls-0", ""); err != nil {
		t.Fatalf("ADD on TLS etcd without an agent: %v (code %d)", err, cnitest.CNICode(err))
	}
	if _, err := cnitest.ExecIPAM("DEL", conf, "tls-0", ""); err != nil {
		t.Fatalf("DEL on TLS etcd without an agent: %v", err)
	}

	startBinary(t, nil, "--host", "tls-host", "--store", "etcd", "--etcd-endpoints", strings.Join(srv.Endpoints(), ","),
		"--etcd-cacert", files.CA, "--etcd-cert", files.Cert, "--etcd-key", files.Key,
		"--store-prefix", prefix, "--listen", "off", "--ingress=false", "--store-socket", sock)
	waitFor(t, 20*time.Second, "the store socket", func() (bool, string) {
		_, err := os.Stat(sock)
		return err == nil, fmt.Sprint(err)
	})
	res, err := cnitest.ExecIPAM("ADD", conf, "tls-1", "")
	if err != nil {
		t.Fatalf("ADD on TLS etcd through the agent: %v", err)
	}
	if _, err := cnitest.ExecIPAM("CHECK", withPrev(t, conf, res.IPs[0].Address.IP.String(), "198.18.46.0/24"), "tls-1", ""); err != nil {
		t.Fatalf("CHECK through the agent: %v", err)
	}
	if _, err := cnitest.ExecIPAM("DEL", conf, "tls-1", ""); err != nil {
		t.Fatalf("DEL through the agent: %v", err)
	}
}
