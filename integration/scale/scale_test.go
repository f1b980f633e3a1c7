//go:build scale

package scale_test

import (
	"github.com/ringipam/ringipam/cmd/ringipamd/agent"
	"github.com/ringipam/ringipam/pkg/storeconfig"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ringipam/ringipam/integration/scale/harness"
)

// env reads a variable with a default.
func env(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

func envDuration(t *testing.T, name string, def time.Duration) time.Duration {
	d, err := time.ParseDuration(env(name, def.String()))
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	return d
}

// TestScale is make scale: every phase at each size of SCALE_SIZES
// (default 10,100), the tables, the growth and the verdicts, and the JSON
// (SCALE_OUT). See docs/benchmarks.md, "Scale: what a host costs etcd".
func TestScale(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Fatal("the scale harness needs root: the agent socket serves root only")
	}
	var sizes []int
	for _, s := range strings.Split(env("SCALE_SIZES", "10,100"), ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n < 4 {
			t.Fatalf("SCALE_SIZES: %q is not a size of at least 4", s)
		}
		sizes = append(sizes, n)
	}
	rate, err := strconv.ParseFloat(env("SCALE_CHURN_RATE", "10"), 64)
	if err != nil {
		t.Fatalf("SCALE_CHURN_RATE: %v", err)
	}
	label := env("SCALE_LABEL", "run")
	var results []harness.Result
	for _, n := range sizes {
		ok := t.Run("N="+strconv.Itoa(n), func(t *testing.T) {
			opt := harness.Options{N: n, Idle: envDuration(t, "SCALE_IDLE", time.Minute), Churn: envDuration(t, "SCALE_CHURN", 20*time.Second),
				ChurnRate: rate, OrphanAfter: envDuration(t, "SCALE_ORPHAN_AFTER", 20*time.Second), Log: os.Stdout}
			opt.Chaos = os.Getenv("SCALE_CHAOS") != ""
			if v := os.Getenv("SCALE_FULL"); v != "" {
				full, err := strconv.Atoi(v)
				if err != nil || full < 1 {
					t.Fatalf("SCALE_FULL: %q is not a number of hosts of at least 1", v)
				}
				opt.Full = full
			}
			switch v := os.Getenv("SCALE_POOL"); v {
			case "wide":
				opt.WidePool = true
			case "narrow":
			case "":
				opt.WidePool = n > 512
			default:
				t.Fatalf("SCALE_POOL: %q is neither wide nor narrow", v)
			}
			if v := os.Getenv("SCALE_START"); v != "" {
				opt.StartConcurrency, _ = strconv.Atoi(v)
			}
			if opt.Chaos {
				opt.Members = 3 // the chaos phase kills the leader of three
			}
			if os.Getenv("SCALE_LEASE_TTL") != "" {
				// The agents' --lease-ttl (default: the shipped 15s).
				ttl := envDuration(t, "SCALE_LEASE_TTL", agent.DefaultLeaseTTL)
				opt.Agent = func(cfg *agent.Config) { cfg.LeaseTTL = storeconfig.Duration(ttl) }
			}
			if m := os.Getenv("SCALE_MEMBERS"); m != "" {
				opt.Members, _ = strconv.Atoi(m)
			}
			c := harness.NewCluster(t, opt)
			r, err := harness.Scale(c, label)
			r.Commit = os.Getenv("SCALE_COMMIT")
			harness.PrintTable(os.Stdout, r)
			if len(r.Phases) > 0 {
				results = append(results, r)
			}
			if err != nil {
				t.Error(err)
			}
		})
		if !ok {
			t.Logf("N=%d failed; larger sizes not run", n)
			break
		}
	}
	harness.PrintSummary(os.Stdout, results)
	if out := os.Getenv("SCALE_OUT"); out != "" {
		if err := harness.WriteJSON(out, label, results); err != nil {
			t.Fatal(err)
		}
		t.Logf("results written to %s", out)
	}
}
