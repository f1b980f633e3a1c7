//go:build integration

package agent_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"

	"github.com/ringipam/ringipam/integration/cnitest"
	"github.com/ringipam/ringipam/integration/netns"
	"github.com/ringipam/ringipam/internal/testenv"
	"github.com/ringipam/ringipam/pkg/agentapi"
	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/portalloc"
)

// waitSocket waits until something accepts connections on sock.
func waitSocket(t *testing.T, sock string) {
	t.Helper()
	waitFor(t, 30*time.Second, "the agent's socket "+sock, func() (bool, string) {
		c, err := net.DialTimeout("unix", sock, time.Second)
		if err != nil {
			return false, err.Error()
		}
		c.Close()
		return true, ""
	})
}

// stopBinary stops an agent with SIGTERM and waits for it.
func stopBinary(t *testing.T, b *binaryAgent) {
	t.Helper()
	if err := b.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case <-b.done:
	case <-time.After(30 * time.Second):
		t.Fatal("the agent did not stop within 30s of SIGTERM")
	}
}

// The ipam-ring binary sends its whole invocations to the agent's socket
// (the agent counts them); a plugin of another cluster is refused with
// code 11 naming both; a second agent does not take over a served socket;
// a stopped agent removes it, and the plugin then fails with code 11
// naming the socket and the service to start: it never reaches etcd
// itself.
func TestPluginsGoThroughTheAgent(t *testing.T) {
	c := newCluster(t)
	const host = "api-host"
	sock := socketPath(t)
	queue := filepath.Join(filepath.Dir(sock), "del-queue")
	listen := freePort(t)
	b := startBinary(t, nil, "--host", host, "--store", "etcd", "--etcd-endpoints", c.etcd.Endpoints()[0],
		"--store-prefix", c.prefix, "--listen", listen, "--ingress=false", "--store-socket", sock, "--del-queue", queue)
	waitSocket(t, sock)
	url := "http://" + listen
	calls := func(command, result string) float64 {
		return metric(t, url, fmt.Sprintf(`ringipam_agent_calls_total{command=%q,plugin="ipam-ring",result=%q}`, command, result))
	}

	st := c.storeObj("")
	st["agentSocket"], st["delQueue"] = sock, queue
	conf := ipamConf(t, "ag-api", host, "198.18.44.0/24", st, nil)
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
		add(fmt.Sprintf("api-%d", i))
	}
	if n := calls("ADD", "ok"); n != 5 {
		t.Fatalf("the agent ran %v of 5 ADDs", n)
	}
	if _, err := cnitest.ExecIPAM("DEL", conf, "api-0", ""); err != nil {
		t.Fatal(err)
	}
	if n := calls("DEL", "ok"); n != 1 {
		t.Fatalf("the agent ran %v of 1 DEL", n)
	}

	// Another cluster's plugin (another prefix): refused with 11, the
	// agent names the store it serves; nothing is written anywhere.
	other := c.storeObj("")
	other["prefix"] = c.prefix + "other/"
	other["agentSocket"] = sock
	_, err := cnitest.ExecIPAM("ADD", ipamConf(t, "ag-api-other", host, "198.18.45.0/24", other, nil), "api-other", "")
	if cnitest.CNICode(err) != 11 || !strings.Contains(err.Error(), "this host's agent serves etcd") || !strings.Contains(err.Error(), c.prefix) {
		t.Fatalf("ADD of another cluster's plugin: %v (code %d), want 11 naming the agent's store", err, cnitest.CNICode(err))
	}
	if n := calls("ADD", "try-again"); n != 1 {
		t.Fatalf("the agent counted %v refused ADDs, want 1", n)
	}

	// A second agent does not take the socket over.
	second := startBinary(t, nil, "--host", "api-host-2", "--store", "etcd", "--etcd-endpoints", c.etcd.Endpoints()[0],
		"--store-prefix", c.prefix, "--listen", "off", "--ingress=false", "--store-socket", sock)
	select {
	case <-second.done:
		if !strings.Contains(second.log.String(), "another process serves it") {
			t.Fatalf("second agent's output:\n%s", second.log.String())
		}
	case <-time.After(30 * time.Second):
		t.Fatal("a second agent on a served socket kept running")
	}

	// The agent stops: the socket goes, and the plugin fails with 11.
	stopBinary(t, b)
	if _, err := os.Stat(sock); !os.IsNotExist(err) {
		t.Fatalf("the stopped agent left its socket: %v", err)
	}
	_, err = cnitest.ExecIPAM("ADD", conf, "api-after", "")
	if cnitest.CNICode(err) != 11 || !strings.Contains(err.Error(), "no host agent answers at "+sock) || !strings.Contains(err.Error(), "ringipamd") {
		t.Fatalf("ADD with the agent stopped: %v (code %d), want 11 naming %s and ringipamd", err, cnitest.CNICode(err), sock)
	}
}

// On an etcd over TLS the plugin, which carries no TLS and no etcd
// client, works through the agent (which holds the client certificate);
// with no agent it fails with 11 naming the socket it looked at, and works
// as soon as an agent runs.
func TestTLSEtcdThroughTheAgent(t *testing.T) {
	netns.RequireRoot(t)
	srv, files := testenv.StartEtcdTLS(t)
	prefix := "/" + netns.Unique("agt-") + "/"
	sock := socketPath(t)
	st := map[string]any{"type": "etcd", "endpoints": srv.Endpoints(), "prefix": prefix, "agentSocket": sock,
		"delQueue": filepath.Join(filepath.Dir(sock), "q"),
		"tls":      map[string]string{"ca": files.CA, "cert": files.Cert, "key": files.Key}}
	conf, err := json.Marshal(map[string]any{"cniVersion": "1.1.0", "name": "ag-tls", "type": "bridge",
		"ipam": map[string]any{"type": "ipam-ring", "host": "tls-host", "store": st, "timeout": "3s",
			"ranges": [][]map[string]string{{{"subnet": "198.18.46.0/24"}}}}})
	if err != nil {
		t.Fatal(err)
	}

	_, err = cnitest.ExecIPAM("ADD", conf, "tls-1", "")
	if cnitest.CNICode(err) != 11 || !strings.Contains(err.Error(), "no host agent answers at "+sock) {
		t.Fatalf("ADD on TLS etcd without an agent: %v (code %d), want 11 naming the socket", err, cnitest.CNICode(err))
	}

	startBinary(t, nil, "--host", "tls-host", "--store", "etcd", "--etcd-endpoints", strings.Join(srv.Endpoints(), ","),
		"--etcd-cacert", files.CA, "--etcd-cert", files.Cert, "--etcd-key", files.Key,
		"--store-prefix", prefix, "--listen", "off", "--ingress=false", "--store-socket", sock)
	waitSocket(t, sock)
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

// queued lists the DEL queue's entries.
func queued(t *testing.T, dir string) int {
	t.Helper()
	n, err := agentapi.DelQueue{Dir: dir}.Len()
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// The agent down, through the binaries on a real etcd, with the whole
// chain (bridge, ipam-ring, portmap-ingress with nftables) in a namespace
// host: an ADD (of ipam-ring) fails with 11 naming the socket and the
// service; three
// containers ADDed while the agent runs are DELeted while it is stopped
// (each DEL succeeds, queued: three of ipam-ring and three of
// portmap-ingress); when the agent starts it runs them before it serves:
// no address, no port and no forward of the three is left.
func TestDELsWhileTheAgentIsDownAreRunWhenItStarts(t *testing.T) {
	c := newCluster(t)
	const host = "down-host"
	h := netns.New(t, "agd")
	endpoint := "http://" + h.Relay(t, strings.TrimPrefix(c.etcd.Endpoints()[0], "http://"))
	sock := socketPath(t)
	queue := filepath.Join(filepath.Dir(sock), "del-queue")
	st := c.storeObj(endpoint)
	st["agentSocket"], st["delQueue"] = sock, queue
	dir := cnitest.PluginDir(t, cnitest.IPAMBin, "bridge", "loopback")
	if err := symlink(portmapBin, dir+"/portmap-ingress"); err != nil {
		t.Fatal(err)
	}
	cni := cnitest.NewCNI(t, dir)
	network := netns.Unique("agd-")
	const subnet = "198.18.54.0/24"
	list := cnitest.ConfList(t, network,
		map[string]any{"type": "bridge", "bridge": "agdbr0", "isGateway": true, "ipMasq": false,
			"ipam": map[string]any{"type": "ipam-ring", "host": host, "store": st, "timeout": "30s",
				"ranges": [][]map[string]string{{{"subnet": subnet}}}}},
		map[string]any{"type": "portmap-ingress", "host": host, "store": st, "mode": "host", "timeout": "30s",
			"capabilities": map[string]bool{"portMappings": true}},
	)
	agentArgs := []string{"--host", host, "--store", "etcd", "--etcd-endpoints", endpoint, "--store-prefix", c.prefix,
		"--store-socket", sock, "--del-queue", queue, "--sync-interval", "300ms", "--sweep=false", "--ingress=false",
		"--listen", "off", "--log-level", "debug"}
	ports := map[string]int{"down-1": 8191, "down-2": 8192, "down-3": 8193}
	rts := map[string]*libcni.RuntimeConf{}
	for ctr, port := range ports {
		rts[ctr] = &libcni.RuntimeConf{ContainerID: ctr, NetNS: netns.New(t, "agr").Path, IfName: "eth0",
			CapabilityArgs: map[string]any{"portMappings": []map[string]any{{"hostPort": port, "containerPort": 80, "protocol": "tcp"}}}}
	}

	// No agent: ADD fails with 11, naming the socket and the service.
	_, err := cnitest.ExecIPAM("ADD", ipamConf(t, network, host, subnet, st, nil), "down-0", "")
	if cnitest.CNICode(err) != 11 || !strings.Contains(err.Error(), "no host agent answers at "+sock) || !strings.Contains(err.Error(), "ringipamd") {
		t.Fatalf("ADD with no agent: %v (code %d), want 11 naming %s and ringipamd", err, cnitest.CNICode(err), sock)
	}
	b := startBinary(t, h, agentArgs...)
	waitSocket(t, sock)

	for ctr := range ports {
		if _, err := cnitest.Add(cni, h, list, rts[ctr]); err != nil {
			t.Fatalf("ADD %s through the agent: %v", ctr, err)
		}
	}
	table := func() string {
		out, err := h.Run("nft", "list", "map", "inet", "ringipam-portmap", "any4")
		if err != nil {
			return "no table: " + err.Error()
		}
		return out
	}
	forwarded := func() []string {
		var have []string
		out := table()
		for ctr, port := range ports {
			if strings.Contains(out, fmt.Sprintf("tcp . %d ", port)) {
				have = append(have, ctr)
			}
		}
		return have
	}
	if have := forwarded(); len(have) != 3 {
		t.Fatalf("forwards of %v after the three ADDs, want all three:\n%s", have, table())
	}
	leftInStore := func() (addrs, eps int) {
		s := c.openStore(t)
		defer s.Close()
		a, err := pool.New(s, host)
		if err != nil {
			t.Fatal(err)
		}
		owners, err := a.List(context.Background(), pool.Filter{})
		if err != nil {
			t.Fatal(err)
		}
		pa, err := portalloc.New(s, host)
		if err != nil {
			t.Fatal(err)
		}
		for ctr := range ports {
			_, ok, err := pa.Lookup(context.Background(), portalloc.EndpointID{Network: network, ContainerID: ctr, IfName: "eth0"})
			if err != nil {
				t.Fatal(err)
			}
			if ok {
				eps++
			}
		}
		return len(owners), eps
	}
	if addrs, eps := leftInStore(); addrs != 3 || eps != 3 {
		t.Fatalf("the store holds %d addresses and %d endpoints with ports after three ADDs, want 3 and 3", addrs, eps)
	}

	// The agent stops; the three DELs succeed, queued.
	stopBinary(t, b)
	for ctr := range ports {
		if err := cnitest.InNS(h, func(ctx context.Context) error { return cni.DelNetworkList(ctx, list, rts[ctr]) }); err != nil {
			t.Fatalf("DEL %s with the agent stopped: %v, want it queued and successful", ctr, err)
		}
	}
	if n := queued(t, queue); n != 6 {
		t.Fatalf("%d DELs queued, want 6 (ipam-ring's and portmap-ingress's of three containers)", n)
	}
	if addrs, eps := leftInStore(); addrs != 3 || eps != 3 {
		t.Fatalf("with the agent stopped the store holds %d addresses and %d endpoints, want 3 and 3 still", addrs, eps)
	}

	// The agent starts: it runs the queue before it serves (its socket
	// accepts connections from the start: a call answered says it serves).
	startBinary(t, h, agentArgs...)
	waitSocket(t, sock)
	if _, err := cnitest.ExecIPAM("STATUS", ipamConf(t, network, host, subnet, st, nil), "", ""); err != nil {
		t.Fatalf("STATUS through the restarted agent: %v", err)
	}
	if n := queued(t, queue); n != 0 {
		t.Fatalf("%d DELs still queued once the agent serves, want 0", n)
	}
	if addrs, eps := leftInStore(); addrs != 0 || eps != 0 {
		t.Fatalf("leaked: %d addresses and %d endpoints with ports left after the agent ran the queued DELs, want 0", addrs, eps)
	}
	if have := forwarded(); len(have) != 0 {
		t.Fatalf("forwards of %v left after the queued DELs ran:\n%s", have, table())
	}
}

// An agent of another protocol version on the socket (a test server
// speaking v99) is refused by the plugin binary with a clear error: ADD
// fails with 11 naming both versions; DEL is queued, not sent elsewhere.
// The real agent refuses a plugin of another version (raw JSON of v2) the
// same way, naming both; it then runs the DEL queued meanwhile (counted ok
// in ringipam_del_queue_runs_total, gone) and moves one that can never
// succeed to failed/ (counted dead).
func TestAgentOfAnotherVersionIsRefused(t *testing.T) {
	c := newCluster(t)
	sock := socketPath(t)
	queue := filepath.Join(filepath.Dir(sock), "del-queue")
	l, err := agentapi.Listen(sock)
	if err != nil {
		t.Fatal(err)
	}
	ran := make(chan string, 4)
	srv := &agentapi.Server{Version: 99, Log: func(msg string, args ...any) { t.Log(append([]any{msg}, args...)...) }, Handlers: agentapi.Handlers{
		agentapi.PluginIPAM: agentapi.HandlerFunc(func(_ context.Context, req *agentapi.Request) agentapi.Answer {
			ran <- req.Command
			return agentapi.Answer{}
		})}}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx, l) }()
	st := c.storeObj("")
	st["agentSocket"], st["delQueue"] = sock, queue
	conf := ipamConf(t, "ag-ver", "ver-host", "198.18.47.0/24", st, nil)
	_, err = cnitest.ExecIPAM("ADD", conf, "ver-1", "")
	want := "agent at " + sock + " speaks agent API v99, this plugin v1: upgrade"
	if cnitest.CNICode(err) != 11 || !strings.Contains(err.Error(), want) {
		t.Fatalf("ADD to an agent of v99: %v (code %d), want 11 saying %q", err, cnitest.CNICode(err), want)
	}
	if _, err := cnitest.ExecIPAM("DEL", conf, "ver-1", ""); err != nil {
		t.Fatalf("DEL to an agent of v99: %v, want it queued", err)
	}
	if n := queued(t, queue); n != 1 {
		t.Fatalf("%d DELs queued, want 1", n)
	}
	cancel()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("the test server did not stop")
	}
	select {
	case cmd := <-ran:
		t.Fatalf("the v99 server ran a %s of a v1 plugin", cmd)
	default:
	}

	// Beside it, a DEL no agent can ever run (a container ID no CNI
	// name rule allows: the agent refuses it with code 7), written as a
	// plugin of this version would queue it.
	bad := &agentapi.Request{Version: agentapi.Version, Plugin: agentapi.PluginIPAM, Command: "DEL", ContainerID: "ver bad!",
		IfName: "eth0", Stdin: conf, TimeoutMS: 10000}
	if err := (agentapi.DelQueue{Dir: queue}).Put(bad); err != nil {
		t.Fatal(err)
	}
	if n := queued(t, queue); n != 2 {
		t.Fatalf("%d DELs queued, want 2", n)
	}

	// The real agent, asked in v2.
	listen := freePort(t)
	startBinary(t, nil, "--host", "ver-host", "--store", "etcd", "--etcd-endpoints", c.etcd.Endpoints()[0],
		"--store-prefix", c.prefix, "--listen", listen, "--ingress=false", "--store-socket", sock, "--del-queue", queue)
	waitSocket(t, sock)
	conn, err := net.DialTimeout("unix", sock, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(30 * time.Second))
	if _, err := conn.Write([]byte(`{"version":2,"plugin":"ipam-ring","command":"ADD","stdin":null}` + "\n")); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(conn).ReadString('\n')
	if err != nil {
		t.Fatalf("no answer to a v2 request: %v", err)
	}
	var a agentapi.Answer
	if err := json.Unmarshal([]byte(line), &a); err != nil || a.Version != 1 || !strings.Contains(a.Error, "speaks agent API v1, the plugin sent v2") {
		t.Fatalf("answer to a v2 request: %q (%v), want v1 naming both versions", line, err)
	}
	// The v1 DEL queued while the v99 server held the socket is run (a
	// DEL of nothing succeeds: counted ok, gone from the queue, not in
	// failed/); the hopeless one is moved to failed/ (counted dead).
	url := "http://" + listen
	runs := func(result string) float64 {
		return metric(t, url, fmt.Sprintf(`ringipam_del_queue_runs_total{result=%q}`, result))
	}
	waitFor(t, 30*time.Second, "the agent to drain the queue", func() (bool, string) {
		n, ok, dead := queued(t, queue), runs("ok"), runs("dead")
		return n == 0 && ok+dead == 2, fmt.Sprintf("%d queued, ok %v, dead %v", n, ok, dead)
	})
	if ok, failed, dead := runs("ok"), runs("failed"), runs("dead"); ok != 1 || failed != 0 || dead != 1 {
		t.Fatalf("ringipam_del_queue_runs_total ok %v failed %v dead %v, want the DEL of ver-1 ok and the bad one dead", ok, failed, dead)
	}
	des, err := os.ReadDir(filepath.Join(queue, agentapi.FailedDir))
	if err != nil || len(des) != 1 || des[0].Name() != agentapi.Key(bad)+".json" {
		t.Fatalf("%s holds %v (%v), want only the bad DEL's entry %s.json", agentapi.FailedDir, des, err, agentapi.Key(bad))
	}
}
