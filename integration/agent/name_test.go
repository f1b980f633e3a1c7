//go:build integration

package agent_test

import (
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

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
