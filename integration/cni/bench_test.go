//go:build integration

package cni

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/containernetworking/cni/pkg/invoke"

	"github.com/ringipam/ringipam/integration/cnitest"
	"github.com/ringipam/ringipam/integration/netns"
	"github.com/ringipam/ringipam/internal/testenv"
)

// benchADDs is the workload: this many IPAM ADDs, each for a new container,
// invoked as a main plugin invokes its IPAM plugin (exec, config on stdin,
// no network namespace needed).
const benchADDs = 2000

type benchRow struct {
	plugin   string
	parallel int
	p50, p99 time.Duration
	total    time.Duration
}

// BenchmarkIPAMAdd runs host-local and ipam-ring on its local store side by
// side on the same workload, sequentially and 8 at a time, and prints
// p50/p99 latency per ADD and ipam-ring's ratio to host-local. With
// RINGIPAM_BENCH_ETCD=1 it also runs ipam-ring on a real etcd (a few more
// minutes). One iteration is the whole workload, so the default benchtime
// runs each case once.
func BenchmarkIPAMAdd(b *testing.B) {
	hostLocal := cnitest.RefBin(b, "host-local")
	var rows []benchRow
	variants := []struct {
		name string
		bin  string
		ipam func(b *testing.B) map[string]any
	}{
		{"host-local", hostLocal, func(b *testing.B) map[string]any {
			return map[string]any{"type": "host-local", "dataDir": b.TempDir()}
		}},
		{"ipam-ring/local", cnitest.IPAMBin, func(b *testing.B) map[string]any {
			return map[string]any{"type": "ipam-ring", "host": "bench", "store": localStore(b)}
		}},
		{"ipam-ring/etcd", cnitest.IPAMBin, func(b *testing.B) map[string]any {
			e := testenv.StartEtcd(b)
			return map[string]any{"type": "ipam-ring", "host": "bench", "store": etcdStore(e.Endpoints(), "/"+netns.Unique("bench-"))}
		}},
	}
	if os.Getenv("RINGIPAM_BENCH_ETCD") != "1" {
		variants = variants[:2]
	}
	for _, parallel := range []int{1, 8} {
		for _, v := range variants {
			b.Run(fmt.Sprintf("%s/parallel=%d", v.name, parallel), func(b *testing.B) {
				for i := 0; i < b.N; i++ {
					ipam := v.ipam(b)
					ipam["ranges"] = [][]map[string]string{subnet("198.18.64.0/20")}
					name := netns.Unique("bench-")
					conf, err := json.Marshal(map[string]any{"cniVersion": "1.1.0", "name": name, "type": "bridge", "ipam": ipam})
					if err != nil {
						b.Fatal(err)
					}
					lat, total := addWorkload(b, v.bin, conf, parallel)
					row := benchRow{plugin: v.name, parallel: parallel, p50: pct(lat, 50), p99: pct(lat, 99), total: total}
					rows = append(rows, row)
					b.ReportMetric(float64(row.p50.Microseconds())/1000, "p50-ms")
					b.ReportMetric(float64(row.p99.Microseconds())/1000, "p99-ms")
					b.ReportMetric(float64(benchADDs)/total.Seconds(), "adds/s")
				}
			})
		}
	}
	printTable(rows)
}

// addWorkload execs bin for benchADDs ADDs with parallel workers and
// returns every ADD's latency and the wall time.
func addWorkload(b *testing.B, bin string, conf []byte, parallel int) ([]time.Duration, time.Duration) {
	b.Helper()
	lat := make([]time.Duration, benchADDs)
	next := make(chan int)
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		first error
	)
	start := time.Now()
	for w := 0; w < parallel; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				ctx, cancel := context.WithTimeout(context.Background(), cnitest.OpTimeout)
				args := &invoke.Args{Command: "ADD", ContainerID: fmt.Sprintf("bench-%05d", i), NetNS: cnitest.NoNetNS, IfName: "eth0", Path: filepath.Dir(bin)}
				t0 := time.Now()
				_, err := invoke.ExecPluginWithResult(ctx, bin, conf, args, nil)
				lat[i] = time.Since(t0)
				cancel()
				if err != nil {
					mu.Lock()
					if first == nil {
						first = fmt.Errorf("ADD %d with %s: %w", i, filepath.Base(bin), err)
					}
					mu.Unlock()
				}
			}
		}()
	}
	for i := 0; i < benchADDs; i++ {
		next <- i
	}
	close(next)
	wg.Wait()
	total := time.Since(start)
	if first != nil {
		b.Fatal(first)
	}
	return lat, total
}

func pct(lat []time.Duration, p int) time.Duration {
	s := slices.Clone(lat)
	slices.Sort(s)
	i := (len(s)*p + 99) / 100
	if i > 0 {
		i--
	}
	return s[i]
}

func printTable(rows []benchRow) {
	if len(rows) == 0 {
		return
	}
	base := map[int]benchRow{}
	for _, r := range rows {
		if r.plugin == "host-local" {
			base[r.parallel] = r
		}
	}
	var sb strings.Builder
	tw := tabwriter.NewWriter(&sb, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "plugin\tparallel\tADDs\tp50\tp99\tADDs/s\tp50 vs host-local\tp99 vs host-local\t\n")
	for _, r := range rows {
		ratio50, ratio99 := "-", "-"
		if h, ok := base[r.parallel]; ok && h.p50 > 0 && h.p99 > 0 {
			ratio50 = fmt.Sprintf("%.2fx", float64(r.p50)/float64(h.p50))
			ratio99 = fmt.Sprintf("%.2fx", float64(r.p99)/float64(h.p99))
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%s\t%s\t%.0f\t%s\t%s\t\n", r.plugin, r.parallel, benchADDs,
			r.p50.Round(10*time.Microsecond), r.p99.Round(10*time.Microsecond), float64(benchADDs)/r.total.Seconds(), ratio50, ratio99)
	}
	tw.Flush()
	fmt.Fprintf(os.Stdout, "\nIPAM ADD latency, %d ADDs per run (exec per ADD, as a runtime invokes IPAM):\n%s\n", benchADDs, sb.String())
}
