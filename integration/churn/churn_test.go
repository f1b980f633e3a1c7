//go:build integration

// Package churn is the side-by-side churn benchmark of issue 42 item 4
// (make scale-churn; docs/benchmarks.md, "Churn side by side"): real
// network-namespace hosts on a LAN, pods created, deleted and created
// again through the real CNI binaries (libcni runs the reference bridge
// plugin, which runs the IPAM plugin), each host's runtime making a few
// calls at a time, with three IPAMs in turn on the same hosts:
//
//   - ringipam: ipam-ring through each host's ringipamd agent, on an etcd
//     on the LAN;
//   - host-local, the reference plugin, a /24 of its own per host: the
//     uncoordinated floor;
//   - whereabouts v0.9.2 (scripts/build-whereabouts.sh builds it from its
//     Go module), on a kube-apiserver (scripts/build-k8s.sh) with its own
//     etcd, its CRDs from its module; a control plane without nodes.
//
// Each churn runs twice: through the CNI chain (pods per second, latencies
// as the runtime waits for them, and the IPAM plugin's own share of each
// call from a timing shim in CNI_PATH, package cnitime), and with the IPAM
// plugin alone, invoked as the bridge plugin invokes it (the "IPAM time"
// of the 1 000 pods). After each: no address answered twice while in use,
// the store equal to the runtime's view while every pod is up, nothing
// left once every pod is deleted (ringipam: ringctl check clean and no
// owner; host-local: no address file; whereabouts: no allocation, no
// overlapping-range reservation).
//
// TestChurnShort (2 hosts, 6 pods, ringipam and host-local) runs in make
// test; TestChurn is the full size, behind the build tag scale (make
// scale-churn builds it with -tags integration,scale).
// Times are only comparable within one run; the suite asserts none.
package churn

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ringipam/ringipam/integration/cnitest"
)

// shimBin is the timing shim (package cnitime), built by TestMain.
var shimBin string

func TestMain(m *testing.M) {
	os.Exit(cnitest.Main(m, func(ctx context.Context, dir string) error {
		shimBin = filepath.Join(dir, "cnitime")
		return cnitest.Build(ctx, shimBin, "./integration/churn/cnitime")
	}))
}

func envInt(t *testing.T, name string, def int) int {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 {
		t.Fatalf("%s=%q: want a positive number", name, v)
	}
	return n
}

// TestChurnShort is the churn's short form for make test: 2 hosts x 6
// pods, 2 calls at a time per host, ringipam and host-local, both modes,
// every check of the full run.
func TestChurnShort(t *testing.T) {
	w := newWorld(t, 2)
	wl := workload{pods: 6, parallel: 2, attempts: 3}
	ring, stop := w.ringipam(t)
	var rs []*result
	for _, mode := range []string{modeCNI, modeIPAM} {
		rs = append(rs, churn(t, w, ring, mode, wl))
	}
	stop()
	hl := w.hostLocal(t)
	for _, mode := range []string{modeCNI, modeIPAM} {
		rs = append(rs, churn(t, w, hl, mode, wl))
	}
	report(os.Stdout, rs, nil)
	judge(t, rs)
}

func env(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

// judge fails t for any finding or lost pod; times are reported, never
// asserted.
func judge(t *testing.T, rs []*result) {
	t.Helper()
	for _, r := range rs {
		for _, l := range [][]string{r.findings, r.lost} {
			for i, f := range l {
				if i == 20 {
					t.Errorf("%s %s: ... %d more", r.ipam, r.mode, len(l)-20)
					break
				}
				t.Errorf("%s %s: %s", r.ipam, r.mode, f)
			}
		}
	}
}

// goal is issue 42's target: 1 000 pods on 10 hosts in under 20 s of IPAM
// time (the IPAM-only churn's wall time: created, deleted, created again).
const goal = 20 * time.Second

func ms(d time.Duration) string { return fmt.Sprintf("%.1f ms", float64(d.Microseconds())/1000) }

func secs(d time.Duration) string { return fmt.Sprintf("%.1f s", d.Seconds()) }

// churnWall is the wall time of create, delete, create again.
func (r *result) churnWall() time.Duration { return r.wall[0] + r.wall[1] + r.wall[2] }

func (r *result) podsPerSecond() float64 {
	return float64(2*r.w.pods*r.hosts) / (r.wall[0] + r.wall[2]).Seconds()
}

func (r *result) failedCalls() int { return r.failed[0] + r.failed[1] + r.failed[2] + r.failed[3] }

func (r *result) checks() string {
	if n := len(r.findings) + len(r.lost); n > 0 {
		return fmt.Sprintf("%d FINDINGS", n)
	}
	return "clean"
}

// report prints the table: per IPAM, the CNI chain's figures and the
// IPAM-only time, the ratios of ringipam to the others, and the verdict.
func report(out io.Writer, rs []*result, notes map[string]string) {
	if len(rs) == 0 {
		return
	}
	wl, hosts := rs[0].w, rs[0].hosts
	pods := wl.pods * hosts
	type row struct{ cni, only *result }
	rows := map[string]*row{}
	var order []string
	for _, r := range rs {
		if rows[r.ipam] == nil {
			rows[r.ipam] = &row{}
			order = append(order, r.ipam)
		}
		if r.mode == modeCNI {
			rows[r.ipam].cni = r
		} else {
			rows[r.ipam].only = r
		}
	}
	fmt.Fprintf(out, "\nchurn: %d hosts x %d pods = %d pods, each created, deleted and created again (then deleted for the leak check), %d CNI calls at a time per host\n",
		hosts, wl.pods, pods, wl.parallel)
	fmt.Fprintf(out, "CNI: libcni -> bridge -> IPAM plugin; ADD/DEL columns are the IPAM plugin's own time in that chain (timing shim), CNI ADD the whole chain's\n")
	fmt.Fprintf(out, "IPAM time: the same churn with the IPAM plugin alone, invoked as bridge invokes it: wall time of create + delete + create again\n\n")
	fmt.Fprintf(out, "| IPAM | pods/s | ADD p50 | ADD p99 | DEL p99 | CNI ADD p99 | CNI churn wall | IPAM time (%d pods) | IPAM-only ADD p99 | failed calls | checks |\n", pods)
	fmt.Fprintf(out, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n")
	for _, name := range order {
		x := rows[name]
		cols := []string{name, "-", "-", "-", "-", "-", "-", "-", "-", "", ""}
		failed, checks := 0, []string{}
		if r := x.cni; r != nil {
			add, del := join(r.ipamLat[0], r.ipamLat[2]), join(r.ipamLat[1], r.ipamLat[3])
			cols[1] = fmt.Sprintf("%.1f", r.podsPerSecond())
			cols[2], cols[3], cols[4] = ms(pct(add, 50)), ms(pct(add, 99)), ms(pct(del, 99))
			cols[5] = ms(pct(join(r.lat[0], r.lat[2]), 99))
			cols[6] = secs(r.churnWall())
			failed += r.failedCalls()
			checks = append(checks, "CNI "+r.checks())
		}
		if r := x.only; r != nil {
			cols[7] = secs(r.churnWall())
			cols[8] = ms(pct(join(r.lat[0], r.lat[2]), 99))
			failed += r.failedCalls()
			checks = append(checks, "IPAM-only "+r.checks())
		}
		cols[9], cols[10] = strconv.Itoa(failed), strings.Join(checks, ", ")
		fmt.Fprintf(out, "| %s |\n", strings.Join(cols, " | "))
	}
	for name, n := range notes {
		fmt.Fprintf(out, "| %s | %s |\n", name, n)
	}
	for _, r := range rs {
		for _, e := range r.errs {
			fmt.Fprintf(out, "failed call, %s %s: %s\n", r.ipam, r.mode, e)
		}
	}
	fmt.Fprintf(out, "\nCPU during create + delete + create again (%d cores; the machine is shared, so other work took the rest):\n", runtime.NumCPU())
	for _, r := range rs {
		fmt.Fprintf(out, "  %-11s %-4s wall %s: %v\n", r.ipam, r.mode, secs(r.churnWall()), r.cpu)
	}
	ring := rows["ringipam"]
	if ring != nil {
		for _, other := range order {
			o := rows[other]
			if other == "ringipam" {
				continue
			}
			var parts []string
			if ring.cni != nil && o.cni != nil {
				parts = append(parts, fmt.Sprintf("pods/s x%.2f", ring.cni.podsPerSecond()/o.cni.podsPerSecond()),
					fmt.Sprintf("ADD p99 x%.2f", ratio(pct(join(ring.cni.ipamLat[0], ring.cni.ipamLat[2]), 99), pct(join(o.cni.ipamLat[0], o.cni.ipamLat[2]), 99))),
					fmt.Sprintf("CNI ADD p99 x%.2f", ratio(pct(join(ring.cni.lat[0], ring.cni.lat[2]), 99), pct(join(o.cni.lat[0], o.cni.lat[2]), 99))))
			}
			if ring.only != nil && o.only != nil {
				parts = append(parts, fmt.Sprintf("IPAM time x%.2f", ratio(ring.only.churnWall(), o.only.churnWall())))
			}
			fmt.Fprintf(out, "\nringipam/%s: %s", other, strings.Join(parts, ", "))
		}
		fmt.Fprintln(out)
		if ring.only != nil {
			t := ring.only.churnWall()
			v := "met"
			if t >= goal {
				v = "NOT MET"
			}
			scale := ""
			if pods != 1000 || hosts != 10 {
				scale = fmt.Sprintf(" (this run: %d pods on %d hosts, not the goal's size)", pods, hosts)
			}
			fmt.Fprintf(out, "goal: 1 000 pods on 10 hosts in under %v of IPAM time: %s, ringipam's IPAM time %s%s\n", goal, v, secs(t), scale)
		}
	}
	fmt.Fprintln(out)
}

func ratio(a, b time.Duration) float64 {
	if b == 0 {
		return 0
	}
	return float64(a) / float64(b)
}
