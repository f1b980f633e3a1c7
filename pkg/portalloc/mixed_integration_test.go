//go:build integration

package portalloc

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ringipam/ringipam/internal/testenv"
	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/etcd"
)

// oldCommit is the last commit before the per-host keys: its allocator
// keeps every host user inside p/a/.
const oldCommit = "082f606"

// oldPortsMain is a command built in oldCommit's tree: one Allocate of that
// version's portalloc on an etcd store, as its portmap-ingress makes it.
const oldPortsMain = `package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/ringipam/ringipam/pkg/portalloc"
	"github.com/ringipam/ringipam/pkg/store/etcd"
)

// oldports ENDPOINT PREFIX HOST CONTAINER SPEC: exit 3 when in use.
func main() {
	st, err := etcd.New(etcd.Config{Endpoints: []string{os.Args[1]}, Prefix: os.Args[2], DialTimeout: 5 * time.Second, RequestTimeout: 30 * time.Second})
	if err != nil {
		fmt.Println(err)
		os.Exit(1)
	}
	defer st.Close()
	a, err := portalloc.New(st, os.Args[3])
	if err != nil {
		fmt.Println(err)
		os.Exit(1)
	}
	var spec []portalloc.Port
	if err := json.Unmarshal([]byte(os.Args[5]), &spec); err != nil {
		fmt.Println(err)
		os.Exit(1)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	res, err := a.Allocate(ctx, portalloc.EndpointID{Network: "net", ContainerID: os.Args[4], IfName: "eth0"}, spec)
	if errors.Is(err, portalloc.ErrInUse) {
		fmt.Println(err)
		os.Exit(3)
	}
	if err != nil {
		fmt.Println(err)
		os.Exit(1)
	}
	json.NewEncoder(os.Stdout).Encode(res.Ports)
}
`

// buildOldPorts builds oldPortsMain in oldCommit's tree (git archive of
// this repository's history).
func buildOldPorts(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	archive := exec.Command("sh", "-c", fmt.Sprintf("git -C ../.. archive %s | tar -x -C %s", oldCommit, dir))
	if out, err := archive.CombinedOutput(); err != nil {
		t.Fatalf("extracting %s (the repository's history is needed): %v\n%s", oldCommit, err, out)
	}
	if err := os.MkdirAll(filepath.Join(dir, "cmd", "oldports"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "cmd", "oldports", "main.go"), []byte(oldPortsMain), 0o644); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(t.TempDir(), "oldports")
	build := exec.Command("go", "build", "-o", bin, "./cmd/oldports")
	build.Dir = dir
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("building %s's allocator: %v\n%s", oldCommit, err, out)
	}
	return bin
}

// Mixed versions on one etcd, the old side being the real code of
// 082f606: the old code refuses an ingress port on an address the new code
// binds per host (the marker), the new code honours the old code's users
// and moves them when their host's new code touches the address, and the
// store audits clean at every step.
func TestMixedVersionsEtcd(t *testing.T) {
	old := buildOldPorts(t)
	srv := testenv.StartEtcd(t)
	const prefix = "/mixed/"
	st, err := etcd.New(etcd.Config{Endpoints: srv.Endpoints(), Prefix: prefix, DialTimeout: 5 * time.Second, RequestTimeout: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	oldAllocate := func(host, ctr string, spec ...Port) (string, int) {
		t.Helper()
		b, _ := json.Marshal(spec)
		cmd := exec.CommandContext(ctx, old, srv.Endpoints()[0], prefix, host, ctr, string(b))
		out, err := cmd.Output()
		var exit *exec.ExitError
		if errors.As(err, &exit) {
			return string(out), exit.ExitCode()
		}
		if err != nil {
			t.Fatal(err)
		}
		return string(out), 0
	}
	clean := func(when string) {
		t.Helper()
		if f, err := Audit(ctx, st, Holders{}); err != nil || f != nil {
			t.Fatalf("%s: audit %v %v", when, f, err)
		}
	}
	h1, _ := New(st, "h1")
	h2, _ := New(st, "h2")
	hostPort := func(n uint16) Port { return Port{Mode: Host, Protocol: "tcp", Number: n} }

	// The new code on h1 binds 8080: p/h/ and the marker.
	if _, err := h1.Allocate(ctx, ep("new1"), []Port{hostPort(8080)}); err != nil {
		t.Fatal(err)
	}
	// The old code refuses an ingress port there, static or not.
	if out, code := oldAllocate("h2", "oldi", Port{Mode: Ingress, Protocol: "tcp", Number: 8080}); code != 3 {
		t.Fatalf("old code's ingress 8080 beside the new code's binding: exit %d %s, want in use", code, out)
	}
	// The old code on h2 binds 8080 too (another host): inside p/a/,
	// the marker kept.
	if out, code := oldAllocate("h2", "old2", hostPort(8080)); code != 0 {
		t.Fatalf("old code's host port 8080 on h2: exit %d %s", code, out)
	}
	clean("after the old code's binding")
	kvs, _ := st.Get(ctx, addrKey(Address{"tcp", 8080}))
	var rec oldAddrState
	_ = json.Unmarshal(kvs[0].Value, &rec)
	if len(rec.Hosts) != 2 || rec.Hosts[0].Host != markerHost && rec.Hosts[1].Host != markerHost {
		t.Fatalf("p/a/tcp/08080 after the old code's binding: %s, want the marker and h2's user", kvs[0].Value)
	}
	// The new code honours it: h2's new code cannot bind 8080 over it,
	// and nobody can take it in ingress mode.
	var inUse *InUseError
	if _, err := h2.Allocate(ctx, ep("new2"), []Port{hostPort(8080)}); !errors.As(err, &inUse) || inUse.Holder != ep("old2").String() {
		t.Fatalf("new code on h2 over the old code's binding: %v, want in use by old2", err)
	}
	if _, err := h1.Allocate(ctx, ep("newi"), []Port{{Mode: Ingress, Protocol: "tcp", Number: 8080}}); !errors.As(err, &inUse) {
		t.Fatalf("new code's ingress 8080: %v, want in use", err)
	}
	// h2 restarts on the new code and touches 8080 (old2 republished):
	// its user moves to p/h/tcp/08080/h2.
	if _, err := h2.Allocate(ctx, ep("old2"), []Port{hostPort(8080)}); err != nil {
		t.Fatal(err)
	}
	kvs, _ = st.Get(ctx, addrKey(Address{"tcp", 8080}), hostBindKey(Address{"tcp", 8080}, "h2"))
	if string(kvs[0].Value) != string(mustJSON(AddrState{Hosts: []HostUse{marker}})) || !strings.Contains(string(kvs[1].Value), "old2") {
		t.Fatalf("after h2's new code touched 8080: p/a/ %s, h2's key %s; want the marker alone, old2 in h2's key", kvs[0].Value, kvs[1].Value)
	}
	clean("after the move")
	// Everything released by the new code: nothing left.
	for _, x := range []struct {
		a  *Allocator
		id string
	}{{h1, "new1"}, {h2, "old2"}} {
		if _, err := x.a.Release(ctx, ep(x.id)); err != nil {
			t.Fatal(err)
		}
	}
	if left, _ := st.Scan(ctx, "p/a/", "p/i/", 0); len(left) > 0 {
		t.Errorf("left: %v", left)
	}
	if left, _ := st.Scan(ctx, prefixHostBind, store.PrefixEnd(prefixHostBind), 0); len(left) > 0 {
		t.Errorf("left: %v", left)
	}
}

func mustJSON(v any) []byte {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return b
}
