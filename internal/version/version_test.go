package version

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strings"
	"testing"
	"time"
)

func TestGet(t *testing.T) {
	vcs := func(rev, modified string) func() (*debug.BuildInfo, bool) {
		return func() (*debug.BuildInfo, bool) {
			return &debug.BuildInfo{GoVersion: "go1.99", Settings: []debug.BuildSetting{
				{Key: "vcs.revision", Value: rev}, {Key: "vcs.modified", Value: modified}}}, true
		}
	}
	none := func() (*debug.BuildInfo, bool) { return nil, false }
	for _, c := range []struct {
		name            string
		version, commit string
		read            func() (*debug.BuildInfo, bool)
		want            Info
	}{
		{"stamped", "v1.2.3-4-gabcdef0", "abcdef0123", vcs("ffff", "false"), Info{"v1.2.3-4-gabcdef0", "abcdef0123", runtime.Version()}},
		{"unstamped, vcs recorded", "", "", vcs("abcdef0123", "false"), Info{Dev, "abcdef0123", "go1.99"}},
		{"unstamped, dirty tree", "", "", vcs("abcdef0123", "true"), Info{Dev, "abcdef0123-dirty", "go1.99"}},
		{"unstamped, nothing recorded", "", "", none, Info{Dev, "", runtime.Version()}},
		{"version only", "v2", "", vcs("abc", "false"), Info{"v2", "abc", "go1.99"}},
	} {
		if got := get(c.version, c.commit, c.read); got != c.want {
			t.Errorf("%s: %+v, want %+v", c.name, got, c.want)
		}
	}
	if got := (Info{"v1", "", "go1"}).Line("x"); got != "x v1 (commit unknown, go1)" {
		t.Errorf("Line: %q", got)
	}
}

func TestRequested(t *testing.T) {
	for _, c := range []struct {
		args []string
		want bool
	}{
		{nil, false},
		{[]string{"--version"}, true},
		{[]string{"-version"}, true},
		{[]string{"--host=a", "--version"}, true},
		{[]string{"--", "--version"}, false},
		{[]string{"--versions"}, false},
		{[]string{"version"}, false},
	} {
		if got := Requested(c.args); got != c.want {
			t.Errorf("Requested(%q) = %v, want %v", c.args, got, c.want)
		}
	}
}

// repoRoot is the module's root, two directories up.
func repoRoot(t *testing.T) string {
	t.Helper()
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(root, "go.mod")); err != nil {
		t.Fatal(err)
	}
	return root
}

func goTool(t *testing.T) string {
	t.Helper()
	if p, err := exec.LookPath("go"); err == nil {
		return p
	}
	p := filepath.Join(runtime.GOROOT(), "bin", "go")
	if _, err := os.Stat(p); err != nil {
		t.Fatalf("no go tool on PATH nor at %s", p)
	}
	return p
}

// Every binary the Makefile builds, built with the -ldflags of
// scripts/version.sh (the version made up through RINGIPAM_VERSION, the
// commit this checkout's HEAD), answers --version with them; built
// without, with "dev". The CNI plugins answer it only when run by hand
// (no CNI_COMMAND).
func TestStampedBinaries(t *testing.T) {
	root := repoRoot(t)
	const stampV = "v9.8.7-6-gfeedbee-dirty"
	script := exec.Command(filepath.Join(root, "scripts", "version.sh"), "--ldflags")
	script.Env = append(os.Environ(), "RINGIPAM_VERSION="+stampV)
	b, err := script.Output()
	if err != nil {
		t.Fatalf("scripts/version.sh --ldflags: %v", err)
	}
	ldflags := strings.TrimSpace(string(b))
	head := exec.Command("git", "rev-parse", "HEAD")
	head.Dir = root
	b, err = head.Output()
	if err != nil {
		t.Fatalf("git rev-parse HEAD: %v", err)
	}
	stampC := strings.TrimSpace(string(b))
	// Program name (as --version says it) -> package; go build -o DIR
	// names each binary after its directory.
	mains := map[string]string{
		"ipam-ring":          "./plugins/ipam-ring",
		"portmap-ingress":    "./plugins/portmap-ingress",
		"ringipamd":          "./cmd/ringipamd",
		"ringctl":            "./cmd/ringctl",
		"ringipam-uninstall": "./cmd/ringipam-uninstall",
		"ringipam-docker":    "./docker-driver",
	}
	// Every main directory of the repository is in the table (a new one
	// must answer --version too).
	dirs, _ := filepath.Glob(filepath.Join(root, "cmd", "*"))
	more, _ := filepath.Glob(filepath.Join(root, "plugins", "*"))
	for _, d := range append(dirs, more...) {
		if _, ok := mains[filepath.Base(d)]; !ok {
			if gos, _ := filepath.Glob(filepath.Join(d, "*.go")); len(gos) > 0 {
				t.Errorf("main %s is not checked here", d)
			}
		}
	}
	out := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	// One go build for several packages links them in parallel.
	build := func(dir, ldflags string, pkgs ...string) {
		cmd := exec.CommandContext(ctx, goTool(t), append([]string{"build", "-trimpath", "-ldflags", ldflags, "-o", dir + "/"}, pkgs...)...)
		cmd.Dir = root
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if b, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("go build %s: %v\n%s", pkgs, err, b)
		}
	}
	run := func(bin string, env ...string) string {
		cmd := exec.CommandContext(ctx, bin, "--version")
		cmd.Env = append(os.Environ(), env...)
		b, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("%s --version: %v\n%s", bin, err, b)
		}
		return strings.TrimSpace(string(b))
	}
	var pkgs []string
	for _, pkg := range mains {
		pkgs = append(pkgs, pkg)
	}
	build(out, ldflags, pkgs...)
	for name, pkg := range mains {
		bin := filepath.Join(out, filepath.Base(pkg))
		want := name + " " + stampV + " (commit " + stampC + ", " + runtime.Version() + ")"
		// CNI_COMMAND cleared: a runtime's environment must not leak in.
		if got := run(bin, "CNI_COMMAND="); got != want {
			t.Errorf("%s --version: %q, want %q", name, got, want)
		}
	}
	unstamped := filepath.Join(out, "unstamped")
	build(unstamped, "", "./cmd/ringipam-uninstall")
	if got := run(filepath.Join(unstamped, "ringipam-uninstall")); !strings.HasPrefix(got, "ringipam-uninstall dev (commit ") {
		t.Errorf("unstamped --version: %q, want version dev", got)
	}
}
