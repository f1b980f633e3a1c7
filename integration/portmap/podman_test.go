//go:build integration

package portmap

import (
	"archive/tar"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ringipam/ringipam/integration/cnitest"
	"github.com/ringipam/ringipam/integration/netns"
	"github.com/ringipam/ringipam/pkg/portalloc"
)

// podman is Debian's podman 4.3 with its CNI backend, run with private
// storage, state and network configuration directories, inside the test's
// host namespace (nsenter --net only: `ip netns exec` would remount /sys
// and hide the cgroup mounts runc needs).
type podman struct {
	t   *testing.T
	h   *host
	dir string
	env []string
}

func newPodman(t *testing.T, h *host, conflist []byte) *podman {
	if _, err := exec.LookPath("podman"); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("podman is not installed (scripts/install-deps.sh installs it); CI is set, so this fails instead of skipping")
		}
		t.Skip("podman is not installed (scripts/install-deps.sh installs it)")
	}
	dir := t.TempDir()
	p := &podman{t: t, h: h, dir: dir}
	cni, netd := filepath.Join(dir, "cni"), filepath.Join(dir, "net.d")
	for _, d := range []string{cni, netd, filepath.Join(dir, "tmp")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for name, target := range map[string]string{"bridge": cnitest.RefBin(t, "bridge"), "loopback": cnitest.RefBin(t, "loopback"), "ipam-ring": cnitest.IPAMBin, "portmap-ingress": portmapBin} {
		if err := os.Symlink(target, filepath.Join(cni, name)); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(netd, "pmpod.conflist"), conflist, 0o644); err != nil {
		t.Fatal(err)
	}
	containers := fmt.Sprintf(`[network]
network_backend = "cni"
cni_plugin_dirs = [%q]
network_config_dir = %q
[engine]
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = %q
tmp_dir = %q
static_dir = %q
`, cni, netd, filepath.Join(dir, "events.log"), filepath.Join(dir, "tmp"), filepath.Join(dir, "static"))
	storage := fmt.Sprintf("[storage]\ndriver = \"vfs\"\nrunroot = %q\ngraphroot = %q\n", filepath.Join(dir, "run"), filepath.Join(dir, "root"))
	for name, text := range map[string]string{"containers.conf": containers, "storage.conf": storage} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	p.env = append(os.Environ(), "CONTAINERS_CONF="+filepath.Join(dir, "containers.conf"), "CONTAINERS_STORAGE_CONF="+filepath.Join(dir, "storage.conf"))
	t.Cleanup(func() {
		if out, err := p.run("rm", "--all", "--force", "--time", "0"); err != nil {
			t.Errorf("podman rm --all: %v %s", err, out)
		}
	})
	return p
}

// run runs podman with args inside the host namespace.
func (p *podman) run(args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "nsenter", append([]string{"--net=" + p.h.ns.Path, "podman"}, args...)...)
	cmd.Env = p.env
	out, err := cmd.CombinedOutput()
	return strings.TrimSpace(string(out)), err
}

func (p *podman) must(args ...string) string {
	p.t.Helper()
	out, err := p.run(args...)
	if err != nil {
		p.t.Fatalf("podman %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return out
}

// importEcho makes the image localhost/echo:test from a tarball holding the
// static echo binary (no registry is reachable).
func (p *podman) importEcho() {
	tarPath := filepath.Join(p.dir, "echo.tar")
	f, err := os.Create(tarPath)
	if err != nil {
		p.t.Fatal(err)
	}
	body, err := os.ReadFile(echoBin)
	if err != nil {
		p.t.Fatal(err)
	}
	tw := tar.NewWriter(f)
	if err := tw.WriteHeader(&tar.Header{Name: "echo", Mode: 0o755, Size: int64(len(body)), ModTime: time.Now()}); err != nil {
		p.t.Fatal(err)
	}
	if _, err := tw.Write(body); err != nil {
		p.t.Fatal(err)
	}
	if err := tw.Close(); err != nil {
		p.t.Fatal(err)
	}
	f.Close()
	p.must("import", "--change", `CMD ["/echo","-tcp",":80","-udp",":53"]`, tarPath, "localhost/echo:test")
}

// TestPodman: `podman run -p 8080:80 -p 80 -p 5353:53/udp` on a network
// whose conflist chains bridge, ipam-ring and portmap-ingress: traffic from
// a client reaches the container through 8080, 5353 and the port podman
// chose for `-p 80`; the ports are in the store under the container;
// `podman rm` releases them and takes the forwards away.
func TestPodman(t *testing.T) {
	h := newHost(t, "podhost", localStore(t), "198.18.150.0/24")
	before := h.settled(t)
	network := netns.Unique("pmpod-")
	conflist, _ := json.Marshal(map[string]any{"cniVersion": "1.0.0", "name": network, "plugins": []map[string]any{
		{"type": "bridge", "bridge": "pmpod0", "isGateway": true, "hairpinMode": true, "ipMasq": false,
			"ipam": map[string]any{"type": "ipam-ring", "host": h.name, "store": h.store, "timeout": "50s",
				"ranges": [][]map[string]string{{{"subnet": "198.18.151.0/24"}}}, "routes": []map[string]string{{"dst": "0.0.0.0/0"}}}},
		h.portmapConf(),
	}})
	p := newPodman(t, h, conflist)
	p.importEcho()
	// The machine's hard limit of open files is below podman's default
	// (runc fails with "error setting rlimit type 7"): ask for less.
	id := p.must("run", "-d", "--name", "web", "--network", network, "--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096",
		"-p", "8080:80", "-p", "80", "-p", "5353:53/udp", "localhost/echo:test")
	id = id[strings.LastIndexByte(id, '\n')+1:]
	ports := p.must("port", "web")
	m := regexp.MustCompile(`80/tcp -> 0\.0\.0\.0:(\d+)`).FindAllStringSubmatch(ports, -1)
	var chosen int
	for _, x := range m {
		if n, _ := strconv.Atoi(x[1]); n != 8080 {
			chosen = n
		}
	}
	if chosen == 0 {
		t.Fatalf("no port for -p 80 in:\n%s", ports)
	}
	t.Logf("podman chose host port %d for -p 80", chosen)
	for _, target := range []string{"tcp/198.18.130.1:8080", "udp/198.18.130.1:5353", fmt.Sprintf("tcp/198.18.130.1:%d", chosen)} {
		if out, err := dial(h.client, target, 30*time.Second); err != nil || out != "echo ping" {
			t.Fatalf("%s: %q %v\n%s", target, out, err, h.dump())
		}
	}
	st := cnitest.OpenStore(t, h.store)
	a, _ := portalloc.New(st, "inspector")
	e, ok, err := a.Lookup(context.Background(), portalloc.EndpointID{Network: network, ContainerID: id, IfName: "eth0"})
	if err != nil || !ok || len(e.Ports) != 3 {
		t.Fatalf("the container's record: %+v %v %v", e, ok, err)
	}
	st.Close()
	p.must("rm", "--force", "--time", "0", "web")
	if after := h.ruleCount(t); after != before {
		t.Fatalf("rules after podman rm: %d, before podman run: %d\n%s", after, before, h.dump())
	}
	st = cnitest.OpenStore(t, h.store)
	a, _ = portalloc.New(st, "inspector")
	if _, ok, err := a.Lookup(context.Background(), portalloc.EndpointID{Network: network, ContainerID: id, IfName: "eth0"}); ok || err != nil {
		t.Fatalf("podman rm left the ports held (%v)", err)
	}
	st.Close()
	// The ports are free for the next container.
	p.must("run", "-d", "--name", "web2", "--network", network, "--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096",
		"-p", "8080:80", "localhost/echo:test")
	if out, err := dial(h.client, "tcp/198.18.130.1:8080", 30*time.Second); err != nil || out != "echo ping" {
		t.Fatalf("8080 to the second container: %q %v", out, err)
	}
}
