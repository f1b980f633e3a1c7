//go:build integration

package portmap

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ringipam/ringipam/integration/cnitest"
)

// The same chain through cnitool, as an operator tries a conflist by hand:
// `cnitool add` with CAP_ARGS carrying portMappings publishes the port
// (TCP and UDP from a client reach the container), `cnitool check` passes,
// and `cnitool del` brings the rules back to what they were and frees the
// port.
func TestPublishedThroughCnitool(t *testing.T) {
	h := newHost(t, "pmhost", localStore(t), "198.18.133.0/24")
	before := h.settled(t)
	confDir := t.TempDir()
	if err := os.WriteFile(filepath.Join(confDir, h.network+".conflist"), h.list(t).Bytes, 0o644); err != nil {
		t.Fatal(err)
	}
	cnitest.CleanCNICache(t, h.network)
	caps, _ := json.Marshal(map[string]any{"portMappings": []map[string]any{
		{"hostPort": 8081, "containerPort": 80, "protocol": "tcp"},
		{"hostPort": 5354, "containerPort": 53, "protocol": "udp"},
	}})
	ctr := h.container(t)
	env := []string{"NETCONFPATH=" + confDir, "CNI_PATH=" + pluginDirWith(t), "CAP_ARGS=" + string(caps)}
	cnitool := func(verb string) (string, error) { return cnitest.Cnitool(t, h.ns, env, verb, h.network, ctr.Path) }
	out, err := cnitool("add")
	if err != nil || !strings.Contains(out, "198.18.133.") {
		t.Fatalf("cnitool add: %v\n%s", err, out)
	}
	startEcho(t, ctr)
	for _, target := range []string{"tcp/198.18.130.1:8081", "udp/198.18.130.1:5354"} {
		if got, err := dial(h.client, target, 20*time.Second); err != nil || got != "echo ping" {
			t.Fatalf("%s from a client after cnitool add: %q %v\n%s", target, got, err, h.dump())
		}
	}
	if out, err := cnitool("check"); err != nil {
		t.Fatalf("cnitool check: %v\n%s", err, out)
	}
	if out, err := cnitool("del"); err != nil {
		t.Fatalf("cnitool del: %v\n%s", err, out)
	}
	if after := h.ruleCount(t); after != before {
		t.Fatalf("rules after cnitool del: %d, before add: %d\n%s", after, before, h.dump())
	}
	if got, err := dial(h.client, "tcp/198.18.130.1:8081", 2*time.Second); err == nil {
		t.Fatalf("port 8081 still answers after cnitool del: %q", got)
	}
	// The port is free for another attachment.
	other := h.container(t)
	if _, err := h.add(t, rt(other, "next", map[string]any{"hostPort": 8081, "containerPort": 80})); err != nil {
		t.Fatalf("8081 after cnitool del: %v", err)
	}
}
