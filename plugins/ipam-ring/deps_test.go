package main

import (
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// The plugins are exec'd once per CNI call: they must not link what costs
// every call start-up time and that they do not need (docs/benchmarks.md):
// the gRPC etcd client, net/http, crypto/tls.
func TestPluginsLinkNoHeavyPackages(t *testing.T) {
	goBin, err := exec.LookPath("go")
	if err != nil {
		goBin = filepath.Join(runtime.GOROOT(), "bin", "go")
	}
	for _, pkg := range []string{"github.com/ringipam/ringipam/plugins/ipam-ring", "github.com/ringipam/ringipam/plugins/portmap-ingress"} {
		out, err := exec.Command(goBin, "list", "-deps", pkg).CombinedOutput()
		if err != nil {
			t.Fatalf("go list -deps %s: %v\n%s", pkg, err, out)
		}
		deps := strings.Fields(string(out))
		if len(deps) < 20 {
			t.Fatalf("go list -deps %s listed %d packages", pkg, len(deps))
		}
		for _, d := range deps {
			switch {
			case d == "net/http", d == "crypto/tls", strings.HasPrefix(d, "google.golang.org/grpc"), strings.HasPrefix(d, "go.etcd.io/etcd/client"):
				t.Errorf("%s links %s", pkg, d)
			}
		}
	}
}
