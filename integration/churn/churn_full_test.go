//go:build integration && scale

package churn

import (
	"os"
	"strings"
	"testing"
)

// TestChurn is make scale-churn: CHURN_HOSTS (10) hosts x CHURN_PODS (100)
// pods, CHURN_PARALLEL (4) calls at a time per host, for each of
// CHURN_IPAMS (ringipam,host-local,whereabouts) in each of CHURN_MODES
// (cni,ipam).
func TestChurn(t *testing.T) {
	hosts := envInt(t, "CHURN_HOSTS", 10)
	wl := workload{pods: envInt(t, "CHURN_PODS", 100), parallel: envInt(t, "CHURN_PARALLEL", 4), attempts: 3}
	ipams := strings.Split(env("CHURN_IPAMS", "ringipam,host-local,whereabouts"), ",")
	modes := strings.Split(env("CHURN_MODES", modeCNI+","+modeIPAM), ",")
	w := newWorld(t, hosts)
	var rs []*result
	notes := map[string]string{}
	for _, name := range ipams {
		var ip ipam
		stop := func() {}
		switch name {
		case "ringipam":
			ip, stop = w.ringipam(t)
		case "host-local":
			ip = w.hostLocal(t)
		case "whereabouts":
			if missing := whereaboutsMissing(); missing != "" {
				if os.Getenv("CI") != "" {
					t.Fatalf("whereabouts needs %s; CI is set, so this fails instead of skipping", missing)
				}
				notes[name] = "not run: missing " + missing
				t.Logf("whereabouts %s", notes[name])
				continue
			}
			ip = w.whereabouts(t)
		default:
			t.Fatalf("CHURN_IPAMS: unknown IPAM %q", name)
		}
		for _, mode := range modes {
			if mode != modeCNI && mode != modeIPAM {
				t.Fatalf("CHURN_MODES: unknown mode %q", mode)
			}
			rs = append(rs, churn(t, w, ip, mode, wl))
		}
		// Each IPAM runs alone: ringipam's agents stop before the others run.
		stop()
	}
	report(os.Stdout, rs, notes)
	if out := os.Getenv("CHURN_OUT"); out != "" {
		f, err := os.Create(out)
		if err != nil {
			t.Fatal(err)
		}
		report(f, rs, notes)
		f.Close()
	}
	judge(t, rs)
}
