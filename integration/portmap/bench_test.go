//go:build integration

package portmap

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/ringipam/ringipam/integration/cnitest"
	"github.com/ringipam/ringipam/integration/netns"
)

// portBenchSizes are the numbers of mappings already on the host when ADD
// is timed (RINGIPAM_BENCH_PORTMAP_SIZES, comma-separated, overrides them);
// portBenchSample is how many ADDs are timed at each size.
func portBenchSizes(b *testing.B) []int {
	env := os.Getenv("RINGIPAM_BENCH_PORTMAP_SIZES")
	if env == "" {
		return []int{10, 1000, 5000}
	}
	var out []int
	for _, f := range strings.Split(env, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 0 {
			b.Fatalf("RINGIPAM_BENCH_PORTMAP_SIZES: %q is not a count", f)
		}
		out = append(out, n)
	}
	return out
}

const portBenchSample = 40

// portPlugin is one plugin under the benchmark: its binary and the
// configuration of one attachment publishing hostPort.
type portPlugin struct {
	name string
	bin  string
	conf func(id string, hostPort int) map[string]any
}

// BenchmarkPortmapAdd times a chained ADD (one published port) with 10,
// 1 000 and 5 000 mappings already on the host, portmap-ingress beside the
// reference portmap (iptables; built from its module), exec'd as a runtime
// does, inside a namespace of their own, and prints p50/p99 and the ratio.
// The goal is an ADD cost flat in the number of mappings. The mappings are
// made by the plugins themselves (one attachment each), so filling 5 000
// takes minutes; one iteration is the whole run.
func BenchmarkPortmapAdd(b *testing.B) {
	netns.RequireRoot(b)
	ref := cnitest.RefBin(b, "portmap")
	prev := func(id string) map[string]any {
		return map[string]any{"cniVersion": "1.0.0",
			"interfaces": []map[string]any{{"name": "eth0", "sandbox": "/var/run/netns/" + id}},
			"ips":        []map[string]any{{"address": "198.18.160.2/24", "interface": 0}}}
	}
	mapping := func(hostPort int) map[string]any {
		return map[string]any{"portMappings": []map[string]any{{"hostPort": hostPort, "containerPort": 80, "protocol": "tcp"}}}
	}
	plugins := []portPlugin{
		{"portmap (reference)", ref, func(id string, hp int) map[string]any {
			return map[string]any{"cniVersion": "1.0.0", "name": "pmbench", "type": "portmap", "snat": true,
				"capabilities": map[string]bool{"portMappings": true}, "runtimeConfig": mapping(hp), "prevResult": prev(id)}
		}},
		{"portmap-ingress", portmapBin, nil},
	}
	type row struct {
		plugin   string
		existing int
		p50, p99 time.Duration
	}
	var rows []row
	for i := 0; i < b.N; i++ {
		for _, p := range plugins {
			h := netns.New(b, "pmb")
			h.MustRun(b, "ip", "link", "set", "lo", "up")
			if p.conf == nil {
				st := map[string]any{"type": "local", "path": b.TempDir() + "/store.db"}
				p.conf = func(id string, hp int) map[string]any {
					return map[string]any{"cniVersion": "1.0.0", "name": "pmbench", "type": "portmap-ingress", "host": "bench",
						"store": st, "mode": "host", "timeout": "60s",
						"capabilities": map[string]bool{"portMappings": true}, "runtimeConfig": mapping(hp), "prevResult": prev(id)}
				}
			}
			existing := 0
			for _, size := range portBenchSizes(b) {
				start := time.Now()
				for ; existing < size; existing++ {
					if err := portExec(h, p.bin, "ADD", fmt.Sprintf("fill%05d", existing), p.conf(fmt.Sprintf("fill%05d", existing), 10000+existing)); err != nil {
						b.Fatalf("%s: filling to %d: %v", p.name, size, err)
					}
				}
				b.Logf("%s: %d mappings made in %s", p.name, size, time.Since(start).Round(time.Millisecond))
				var lat []time.Duration
				for j := range portBenchSample {
					id := fmt.Sprintf("t%d-%03d", size, j)
					conf := p.conf(id, 20000+j)
					t0 := time.Now()
					if err := portExec(h, p.bin, "ADD", id, conf); err != nil {
						b.Fatalf("%s: ADD at %d: %v", p.name, size, err)
					}
					lat = append(lat, time.Since(t0))
					if err := portExec(h, p.bin, "DEL", id, conf); err != nil {
						b.Fatalf("%s: DEL at %d: %v", p.name, size, err)
					}
				}
				slices.Sort(lat)
				r := row{plugin: p.name, existing: size, p50: lat[len(lat)/2], p99: lat[len(lat)*99/100]}
				rows = append(rows, r)
				b.ReportMetric(float64(r.p50.Microseconds())/1000, fmt.Sprintf("p50-ms/%s@%d", map[bool]string{true: "ref", false: "ours"}[p.bin == ref], size))
			}
		}
	}
	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(w, "\nchained ADD, one published port\tmappings on the host\tp50\tp99\tp50 ratio to portmap")
	for _, r := range rows {
		ratio := ""
		for _, o := range rows {
			if o.plugin == "portmap (reference)" && o.existing == r.existing {
				ratio = fmt.Sprintf("%.2fx", float64(r.p50)/float64(o.p50))
			}
		}
		fmt.Fprintf(w, "%s\t%d\t%s\t%s\t%s\n", r.plugin, r.existing, r.p50.Round(10*time.Microsecond), r.p99.Round(10*time.Microsecond), ratio)
	}
	w.Flush()
}

// portExec runs a chained plugin once inside h, as a runtime does.
func portExec(h *netns.NS, bin, verb, id string, conf map[string]any) error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	body, _ := json.Marshal(conf)
	cmd := exec.CommandContext(ctx, "nsenter", "--net="+h.Path, bin)
	cmd.Env = []string{"CNI_COMMAND=" + verb, "CNI_CONTAINERID=" + id, "CNI_IFNAME=eth0", "CNI_NETNS=/var/run/netns/" + id,
		"CNI_PATH=/nonexistent", "PATH=/usr/sbin:/usr/bin:/sbin:/bin"}
	cmd.Stdin = bytes.NewReader(body)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("%s %s: %v: %s", verb, id, err, out)
	}
	return nil
}
