//go:build integration

package agent_test

import (
	"context"
	"fmt"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ringipam/ringipam/integration/cnitest"
	"github.com/ringipam/ringipam/pkg/pool"
)

// TestSecondAgentWithTheSameNameIsRefused (issue 33, seed 002: host names
// are unique): with one ringipamd holding host name X on a real etcd, a
// second ringipamd started with --host X exits non-zero at start, saying
// the name is in use; the first keeps its liveness key. Once the first
// stops, an agent with the name starts.
func TestSecondAgentWithTheSameNameIsRefused(t *testing.T) {
	c := newCluster(t)
	const host = "same-name"
	args := func(listen string) []string {
		return []string{"--host", host, "--store", "etcd", "--etcd-endpoints", c.etcd.Endpoints()[0],
			"--store-prefix", c.prefix, "--lease-ttl", "5s", "--heartbeat", "500ms", "--listen", listen, "--ingress=false"}
	}
	firstListen := freePort(t)
	first := startBinary(t, nil, args(firstListen)...)
	inspect := c.allocator(t, "inspector", nil)
	waitFor(t, 20*time.Second, "the first agent's host up", func() (bool, string) {
		h, _ := stateOf(t, inspect, host, 0)
		return h.State == pool.HostUp, fmt.Sprintf("%+v", h)
	})
	before := livenessValue(t, c, host)

	second := startBinary(t, nil, args(freePort(t))...)
	select {
	case <-second.done:
	case <-time.After(60 * time.Second):
		t.Fatalf("the second agent with host name %s still runs after 60s; its output:\n%s", host, second.log.String())
	}
	code := second.cmd.ProcessState.ExitCode()
	out := second.log.String()
	if code == 0 || !strings.Contains(out, `host name "same-name" is in use by another running ringipamd`) {
		t.Fatalf("second agent: exit code %d, output:\n%s\nwant a non-zero exit saying the host name is in use", code, out)
	}
	t.Logf("second agent refused (exit %d): %s", code, lastLine(out))
	if after := livenessValue(t, c, host); after != before {
		t.Fatalf("liveness key changed from %q to %q: the refused agent touched it", before, after)
	}
	if body, code, err := httpGet("http://" + firstListen + "/healthz"); err != nil || code != 200 || strings.TrimSpace(body) != "ok" {
		t.Fatalf("the first agent's healthz after the refusal: %d %q %v", code, body, err)
	}
	select {
	case <-first.done:
		t.Fatalf("the first agent exited:\n%s", first.log.String())
	default:
	}
	// A clean stop revokes the lease: the name is free for a new agent.
	if err := first.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	<-first.done
	thirdListen := freePort(t)
	third := startBinary(t, nil, args(thirdListen)...)
	waitFor(t, 30*time.Second, "a new agent with the name after the first stopped", func() (bool, string) {
		body, code, err := httpGet("http://" + thirdListen + "/healthz")
		select {
		case <-third.done:
			t.Fatalf("the third agent exited:\n%s", third.log.String())
		default:
		}
		return err == nil && code == 200 && strings.TrimSpace(body) == "ok", fmt.Sprintf("%d %q %v", code, body, err)
	})
}

// livenessValue reads host's liveness key as stored.
func livenessValue(t *testing.T, c *cluster, host string) string {
	t.Helper()
	kvs, err := c.openStore(t).Get(t.Context(), pool.LivenessKey(host))
	if err != nil || !kvs[0].Exists() {
		t.Fatalf("liveness key of %s: %+v %v", host, kvs, err)
	}
	return string(kvs[0].Value)
}

func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return lines[len(lines)-1]
}

// TestAgentThatLostItsNameFailsItsPlugins (issue 33, seed 002): an agent
// whose host name another instance took while it ran (its lease lost, the
// liveness key then written by that instance) serves its plugins no more:
// ipam-ring's STATUS and ADD through its socket fail with "try again
// later" (11) saying that another ringipamd holds the name, while a DEL
// still runs (removing a container never blocks). The takeover is made
// with etcd's own client, as a second agent would make it: the key is
// moved onto that instance's lease, then the first agent's lease revoked.
func TestAgentThatLostItsNameFailsItsPlugins(t *testing.T) {
	c := newCluster(t)
	const host = "lost-name"
	sock := socketPath(t)
	startBinary(t, nil, "--host", host, "--store", "etcd", "--etcd-endpoints", c.etcd.Endpoints()[0],
		"--store-prefix", c.prefix, "--lease-ttl", "5s", "--heartbeat", "500ms", "--listen", "off",
		"--ingress=false", "--store-socket", sock)
	waitFor(t, 30*time.Second, "the agent's liveness key and socket", func() (bool, string) {
		_, err := os.Stat(sock)
		kvs, gerr := c.openStore(t).Get(t.Context(), pool.LivenessKey(host))
		return err == nil && gerr == nil && kvs[0].Exists(), fmt.Sprint(err, gerr)
	})
	st := c.storeObj("")
	st["agentSocket"] = sock
	conf := ipamConf(t, "ag-lost", host, "198.18.46.0/24", st, nil)
	if _, err := cnitest.ExecIPAM("ADD", conf, "before", ""); err != nil {
		t.Fatalf("ADD while the agent holds its name: %v", err)
	}

	cli, err := clientv3.New(clientv3.Config{Endpoints: c.etcd.Endpoints(), DialTimeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	key := c.prefix + pool.LivenessKey(host)
	got, err := cli.Get(ctx, key)
	if err != nil || len(got.Kvs) != 1 || got.Kvs[0].Lease == 0 {
		t.Fatalf("liveness key %s: %+v %v", key, got, err)
	}
	theirs, err := cli.Grant(ctx, 600)
	if err != nil {
		t.Fatal(err)
	}
	other := fmt.Sprintf(`{"addr":"198.18.46.250","pid":%d,"started":%d,"instance":"0123456789abcdef"}`, os.Getpid(), time.Now().Unix())
	moved, err := cli.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(key), "=", got.Kvs[0].ModRevision)).
		Then(clientv3.OpPut(key, other, clientv3.WithLease(theirs.ID))).Commit()
	if err != nil || !moved.Succeeded {
		t.Fatalf("moving the key to the other instance: %+v %v", moved, err)
	}
	if _, err := cli.Revoke(ctx, clientv3.LeaseID(got.Kvs[0].Lease)); err != nil {
		t.Fatal(err)
	}

	const want = "another ringipamd holds this host's name"
	waitFor(t, 60*time.Second, "STATUS through the agent to fail once its name is lost", func() (bool, string) {
		_, err := cnitest.ExecIPAM("STATUS", conf, "", "")
		return cnitest.CNICode(err) == 11 && strings.Contains(fmt.Sprint(err), want), fmt.Sprintf("code %d: %v", cnitest.CNICode(err), err)
	})
	if _, err := cnitest.ExecIPAM("ADD", conf, "after", ""); cnitest.CNICode(err) != 11 || !strings.Contains(err.Error(), want) {
		t.Fatalf("ADD through an agent that lost its name: %v (code %d), want 11 saying %q", err, cnitest.CNICode(err), want)
	}
	if _, err := cnitest.ExecIPAM("DEL", conf, "before", ""); err != nil {
		t.Fatalf("DEL through an agent that lost its name: %v, want it to run", err)
	}
	if after, err := cli.Get(ctx, key); err != nil || len(after.Kvs) != 1 || string(after.Kvs[0].Value) != other {
		t.Fatalf("the other instance's liveness key after the refusals: %+v %v", after, err)
	}
}

// TestAgentRestartedAfterAKillTakesItsNameBack: an agent killed without
// revoking its lease (SIGKILL, as kubelet's or systemd's restart after a
// crash finds it) leaves its liveness key until the lease expires; the
// agent started again at once with the same --host waits that long for
// the key to go and then holds it, instead of exiting with "host name in
// use" (which cost every crash on Kubernetes one more restart).
func TestAgentRestartedAfterAKillTakesItsNameBack(t *testing.T) {
	c := newCluster(t)
	const host = "killed-name"
	args := func(listen string) []string {
		return []string{"--host", host, "--store", "etcd", "--etcd-endpoints", c.etcd.Endpoints()[0],
			"--store-prefix", c.prefix, "--lease-ttl", "5s", "--heartbeat", "500ms", "--listen", listen, "--ingress=false"}
	}
	first := startBinary(t, nil, args(freePort(t))...)
	inspect := c.allocator(t, "inspector", nil)
	waitFor(t, 30*time.Second, "the first agent's host up", func() (bool, string) {
		h, _ := stateOf(t, inspect, host, 0)
		return h.State == pool.HostUp, fmt.Sprintf("%+v", h)
	})
	before := livenessValue(t, c, host)
	if err := first.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	<-first.done
	if after := livenessValue(t, c, host); after != before {
		t.Fatalf("liveness key %q after the kill, want the killed agent's %q still there (its lease not expired yet)", after, before)
	}
	listen := freePort(t)
	second := startBinary(t, nil, args(listen)...)
	waitFor(t, 60*time.Second, "the restarted agent holding the name and ready", func() (bool, string) {
		select {
		case <-second.done:
			t.Fatalf("the restarted agent exited (exit %d):\n%s", second.cmd.ProcessState.ExitCode(), second.log.String())
		default:
		}
		body, code, err := httpGet("http://" + listen + "/readyz")
		return err == nil && code == 200 && strings.TrimSpace(body) == "ok", fmt.Sprintf("%d %q %v", code, body, err)
	})
	if after := livenessValue(t, c, host); after == before || !strings.Contains(after, fmt.Sprintf(`"pid":%d`, second.cmd.Process.Pid)) {
		t.Fatalf("liveness key %q, want the restarted agent's (pid %d)", after, second.cmd.Process.Pid)
	}
}
