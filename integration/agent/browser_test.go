//go:build integration

package agent_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/ringipam/ringipam/integration/cnitest"
	"github.com/ringipam/ringipam/pkg/pool"
)

// screenshotEnv names a directory where the browser test leaves its
// screenshot of the status page (for a person to look at).
const screenshotEnv = "RINGIPAM_SCREENSHOT_DIR"

// The status page served by the agent, loaded in a real browser (Debian's
// headless Chromium): each pool's SVG ring shows one band per host owning
// ranges in it, the arcs of every host, and the tombstones of a host
// removed by rmpeer.
func TestStatusPageInABrowser(t *testing.T) {
	browser, err := exec.LookPath("chromium")
	if err != nil {
		t.Fatalf("chromium is not installed (scripts/install-deps.sh installs it): %v", err)
	}
	c := newCluster(t)
	pools := map[string]string{"ag-web": "198.18.60.0/25", "ag-db": "198.18.61.0/26"}
	hostsOf := map[string][]string{"ag-web": {"node-1", "node-2", "node-3"}, "ag-db": {"node-1", "node-2", "gone-4"}}
	// node-1's agent runs the plugins' calls (of every host: the test's
	// hosts are names in the store).
	ag := startAgent(t, c.agentConfig("node-1"))
	for network, subnet := range pools {
		for i, h := range hostsOf[network] {
			for j := range i + 2 {
				if _, err := cnitest.ExecIPAM("ADD", ipamConf(t, network, h, subnet, ag.store(c.storeObj("")), nil), fmt.Sprintf("%s-%s-%d", network, h, j), ""); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	// gone-4 is removed by an operator, its ranges tombstoned.
	op := c.allocator(t, "node-1", nil)
	if _, err := op.Reclaim(context.Background(), "gone-4", pool.ReclaimOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "a snapshot", func() (bool, string) {
		page, code, err := httpGet(ag.url + "/")
		return err == nil && code == 200 && strings.Count(page, `<svg class="ring"`) == 2, page
	})
	dir := t.TempDir()
	run := func(args ...string) string {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		argv := append([]string{"--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
			"--user-data-dir=" + filepath.Join(dir, "profile"), "--window-size=1000,1500"}, args...)
		cmd := exec.CommandContext(ctx, browser, append(argv, ag.url+"/")...)
		cmd.Env = append(os.Environ(), "HOME="+dir)
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("chromium %v: %v", args, err)
		}
		return string(out)
	}
	dom := run("--dump-dom")
	sections := regexp.MustCompile(`(?s)<svg class="ring" data-pool="([^"]+)".*?</svg>`).FindAllStringSubmatch(dom, -1)
	if len(sections) != 2 {
		t.Fatalf("the browser's DOM has %d pool rings, want 2:\n%s", len(sections), dom)
	}
	band := regexp.MustCompile(`<g class="band" data-host="([^"]+)"`)
	for _, s := range sections {
		network := strings.TrimSuffix(s[1], "-0") // ipam-ring names a range set <network>-<index>
		want := map[string]bool{}
		for _, h := range hostsOf[network] {
			if h != "gone-4" {
				want[h] = true
			}
		}
		var got []string
		for _, m := range band.FindAllStringSubmatch(s[0], -1) {
			got = append(got, m[1])
			if !want[m[1]] {
				t.Errorf("pool %s: band of %s", network, m[1])
			}
			if !strings.Contains(s[0], `class="range" data-host="`+m[1]+`"`) {
				t.Errorf("pool %s: no arc of %s", network, m[1])
			}
		}
		if len(got) != len(want) {
			t.Errorf("pool %s: bands %v, want one per host of %v", network, got, want)
		}
		tomb := strings.Contains(s[0], `class="range tomb"`)
		if tomb != (network == "ag-db") {
			t.Errorf("pool %s: tombstoned arcs drawn: %v", network, tomb)
		}
	}
	shot := filepath.Join(dir, "status.png")
	run("--screenshot=" + shot)
	if fi, err := os.Stat(shot); err != nil || fi.Size() < 10_000 {
		t.Fatalf("screenshot: %v %v", fi, err)
	}
	if out := os.Getenv(screenshotEnv); out != "" {
		b, _ := os.ReadFile(shot)
		if err := os.WriteFile(filepath.Join(out, "ringipamd-status.png"), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
}
