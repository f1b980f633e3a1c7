package harness

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"runtime"
	"slices"
	"strings"
	"sync"
	"time"
)

// Phase is one phase's cost, with the hosts running during it.
type Phase struct {
	Name  string  `json:"name"`
	Hosts int     `json:"hosts"`
	Cost  Cost    `json:"cost"`
	Note  string  `json:"note,omitempty"`
	Wait  float64 `json:"waitSeconds,omitempty"` // until the phase's condition held
}

// PerHost divides a phase's count by its hosts.
func (p Phase) PerHost(v float64) float64 { return v / float64(max(p.Hosts, 1)) }

// Result is one size's run.
type Result struct {
	Label   string `json:"label"`
	Commit  string `json:"commit,omitempty"`
	N       int    `json:"n"`
	Members int    `json:"members"`
	PerHost int    `json:"perHost"`
	// Full is how many of the N hosts ran the whole agent (Options.Full;
	// 0: all of them).
	Full int `json:"full,omitempty"`
	// WidePool: the pool was Subnet and WideSubnet (Options.WidePool).
	WidePool bool    `json:"widePool,omitempty"`
	Phases   []Phase `json:"phases"`
	// Start: all N first ADDs at once.
	StartFailed int      `json:"startFailed"`
	StartErrors []string `json:"startErrors,omitempty"`
	StartLast   float64  `json:"startLastSeconds"`
	StartDupes  int      `json:"startDuplicates"`
	// StartStaggered is SCALE_START's concurrency when the first ADDs
	// were not all made at once (0: at once, issue 42's start).
	StartStaggered int `json:"startStaggered,omitempty"`
	// ADD latency (ms) of the fill and the churn.
	FillP50     float64 `json:"fillAddP50ms"`
	FillP99     float64 `json:"fillAddP99ms"`
	FillFailed  int     `json:"fillFailed"`
	ChurnP50    float64 `json:"churnAddP50ms"`
	ChurnP99    float64 `json:"churnAddP99ms"`
	ChurnOps    int     `json:"churnOps"`
	ChurnFailed int     `json:"churnFailed"`
	// AddBytes is the etcd traffic (both ways, through a relay) of one
	// steady-state ADD of the probe host (Cluster.ProbeADDs);
	// AddEtcdBytes etcd's bytes sent+received per ADD over the fill (the
	// agents' background included).
	AddBytes          float64  `json:"addBytes"`
	AddEtcdBytes      float64  `json:"addEtcdBytes"`
	HeapPerHost       float64  `json:"heapPerHostBytes"`
	GoroutinesPerHost float64  `json:"goroutinesPerHost"`
	Findings          Findings `json:"findings"`
	Warnings          int      `json:"agentWarnings"`
	FirstWarnings     []string `json:"firstAgentWarnings,omitempty"`
	Skipped           []string `json:"skipped,omitempty"`
}

// Phase returns the named phase (zero if absent).
func (r Result) Phase(name string) Phase {
	for _, p := range r.Phases {
		if p.Name == name {
			return p
		}
	}
	return Phase{}
}

// IdlePerHostMinute is the idle phase's figure per host per minute.
func (r Result) IdlePerHostMinute(v func(Cost) float64) float64 {
	p := r.Phase("idle")
	if p.Cost.Seconds == 0 {
		return 0
	}
	return p.PerHost(v(p.Cost)) * 60 / p.Cost.Seconds
}

// percentile of sorted latencies, in ms.
func percentile(d []time.Duration, q float64) float64 {
	if len(d) == 0 {
		return 0
	}
	slices.Sort(d)
	i := int(q*float64(len(d))+0.5) - 1
	i = min(max(i, 0), len(d)-1)
	return float64(d[i].Microseconds()) / 1000
}

// latencies collects ADD latencies from goroutines.
type latencies struct {
	mu     sync.Mutex
	d      []time.Duration
	failed int
	errs   []string
}

func (l *latencies) add(d time.Duration, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if err != nil {
		l.failed++
		if len(l.errs) < 10 {
			l.errs = append(l.errs, err.Error())
		}
		return
	}
	l.d = append(l.d, d)
}

// measure runs fn between two snapshots and records the phase.
func (c *Cluster) measure(r *Result, name string, fn func() (string, float64, error)) error {
	hosts := len(c.Running())
	a := c.Take()
	note, wait, err := fn()
	b := c.Take()
	if h := len(c.Running()); h > hosts {
		hosts = h
	}
	p := Phase{Name: name, Hosts: hosts, Cost: Diff(a, b), Note: note, Wait: wait}
	r.Phases = append(r.Phases, p)
	c.Logf("phase %-8s %6.1fs  requests/host %.1f  watch msgs/host %.1f  bytes sent/host %.0f  %s",
		name, p.Cost.Seconds, p.PerHost(p.Cost.RequestsTotal()), p.PerHost(p.Cost.WatchMsgs), p.PerHost(p.Cost.BytesSent), note)
	return err
}

// window keeps a phase open at least d after start (its count is then
// comparable between sizes).
func window(start time.Time, d time.Duration) {
	if rest := d - time.Since(start); rest > 0 {
		time.Sleep(rest)
	}
}

// eventWindow is the least length of an event's phase.
const eventWindow = 5 * time.Second

// Scale runs every phase at size opt.N on c and returns the result.
func Scale(c *Cluster, label string) (Result, error) {
	opt := c.opt
	n := opt.N
	if n < 4 {
		return Result{}, fmt.Errorf("scale: N=%d: the phases need at least 4 hosts", n)
	}
	r := Result{Label: label, N: n, Members: opt.Members, PerHost: opt.PerHost}
	if opt.Full > 0 && opt.Full < n {
		r.Full = opt.Full
	}
	r.WidePool = opt.WidePool
	ctx := context.Background()
	probe := 0
	leaver, orphan := n-1, n-2

	// start: all agents start together; once each listens, all first
	// ADDs are sent at the same moment.
	var hosts []*Host
	err := c.measure(&r, "start", func() (string, float64, error) {
		var err error
		hosts, err = c.AddHosts(n, func(i int) bool { return i == probe }, func(i int) bool { return i == leaver })
		if err != nil {
			return "", 0, err
		}
		var wg sync.WaitGroup
		var mu sync.Mutex
		var last time.Duration
		seen := map[netip.Addr]bool{}
		gate := make(chan struct{})
		// StartConcurrency > 0: at most that many first ADDs at a time
		// (a cluster whose nodes join a few at a time), for measuring
		// what comes after at sizes where simultaneous first claims all
		// meet on the pool's one ring key (issue 42).
		slots := make(chan struct{}, max(opt.StartConcurrency, 0))
		t0 := time.Now()
		for _, h := range hosts {
			wg.Go(func() {
				<-gate
				if opt.StartConcurrency > 0 {
					slots <- struct{}{}
					defer func() { <-slots }()
				}
				actx, cancel := context.WithTimeout(ctx, 5*time.Minute)
				defer cancel()
				_, _, a, err := h.Add(actx)
				d := time.Since(t0)
				mu.Lock()
				defer mu.Unlock()
				if err != nil {
					r.StartFailed++
					if len(r.StartErrors) < 10 {
						r.StartErrors = append(r.StartErrors, err.Error())
					}
					return
				}
				if seen[a] {
					r.StartDupes++
				}
				seen[a] = true
				last = max(last, d)
			})
		}
		t0 = time.Now()
		close(gate)
		wg.Wait()
		r.StartLast = last.Seconds()
		how := "at once"
		if opt.StartConcurrency > 0 {
			how = fmt.Sprintf("at most %d at a time", opt.StartConcurrency)
			r.StartStaggered = opt.StartConcurrency
		}
		// The first errors now, not only in the JSON written at the end:
		// a run stopped later still says why its first ADDs failed.
		for _, e := range r.StartErrors {
			c.Logf("start: first ADD failed: %s", e)
		}
		return fmt.Sprintf("%d first ADDs %s: %d failed, %d duplicates, last success after %.2fs",
			n, how, r.StartFailed, r.StartDupes, r.StartLast), r.StartLast, nil
	})
	if err != nil {
		return r, err
	}

	// fill: PerHost allocations per host, a host-mode port on every host
	// (a hostPort DaemonSet), ingress ports on up to 10 hosts.
	var fillLat latencies
	nAdds := 0
	err = c.measure(&r, "fill", func() (string, float64, error) {
		type job struct {
			h     *Host
			port  int
			mode  string
			first bool
		}
		jobs := make(chan job)
		var wg sync.WaitGroup
		results := map[*Host][]byte{}
		var mu sync.Mutex
		// Two publishes at a time: every simulated host's nftables table
		// lives in the process's one network namespace, where each nft
		// invocation reads all of them and concurrent transactions
		// restart each other (16 at a time at N = 100: 9 of 100 publishes
		// killed at the plugin's 30 s deadline on a quiet machine). On
		// real hosts each has its own kernel; what etcd is sent is the
		// same either way.
		publishing := make(chan struct{}, 2)
		for range 16 {
			wg.Go(func() {
				for j := range jobs {
					actx, cancel := context.WithTimeout(ctx, 5*time.Minute)
					t := time.Now()
					ctr, res, _, err := j.h.Add(actx)
					fillLat.add(time.Since(t), err)
					if err == nil && j.port != 0 {
						publishing <- struct{}{}
						err = j.h.Publish(actx, ctr, res, j.mode, j.port)
						<-publishing
						if err != nil {
							fillLat.add(0, fmt.Errorf("publish: %w", err))
						}
					}
					cancel()
					mu.Lock()
					results[j.h] = res
					mu.Unlock()
				}
			})
		}
		for k := 1; k < opt.PerHost; k++ {
			for i, h := range hosts {
				j := job{h: h}
				switch {
				case k == 1 && !h.Hollow:
					// Not on hollow hosts (Options.Full): nftables.
					j.port, j.mode = 9100, "host"
				case k == 2 && i < 10:
					j.port, j.mode = 30000+i, "ingress"
				}
				jobs <- j
				nAdds++
			}
		}
		close(jobs)
		wg.Wait()
		r.FillFailed = fillLat.failed
		r.FillP50, r.FillP99 = percentile(fillLat.d, 0.5), percentile(fillLat.d, 0.99)
		if fillLat.failed > 0 {
			return fmt.Sprintf("%d ADDs, %d failed: %v", nAdds, fillLat.failed, fillLat.errs), 0, nil
		}
		return fmt.Sprintf("%d ADDs, ADD p50 %.1f ms p99 %.1f ms", nAdds, r.FillP50, r.FillP99), 0, nil
	})
	if err != nil {
		return r, err
	}
	if p := r.Phase("fill"); nAdds > 0 {
		r.AddEtcdBytes = (p.Cost.BytesSent + p.Cost.BytesRecv) / float64(nAdds)
	}
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	r.HeapPerHost = float64(ms.HeapInuse) / float64(n)
	r.GoroutinesPerHost = float64(runtime.NumGoroutine()) / float64(n)

	// addbytes: the probe host's steady-state ADDs on a relayed store
	// of their own (ProbeADDs).
	err = c.measure(&r, "addbytes", func() (string, float64, error) {
		const k = 20
		per, err := c.ProbeADDs(ctx, hosts[probe], k)
		if err != nil {
			return "", 0, err
		}
		r.AddBytes = per
		return fmt.Sprintf("%d ADDs of %s through its agent's handler on a relayed connection of their own: %.0f bytes each", k, hosts[probe].Name, per), 0, nil
	})
	if err != nil {
		return r, err
	}

	// idle.
	if err := c.measure(&r, "idle", func() (string, float64, error) {
		time.Sleep(opt.Idle)
		return "", 0, nil
	}); err != nil {
		return r, err
	}

	// churn: pods created across the cluster at ChurnRate, each deleted
	// again about two seconds later.
	var churnLat latencies
	err = c.measure(&r, "churn", func() (string, float64, error) {
		ops := churn(ctx, hosts[1:n-2], opt.Churn, opt.ChurnRate, uint64(n), &churnLat)
		r.ChurnOps, r.ChurnFailed = ops, churnLat.failed
		r.ChurnP50, r.ChurnP99 = percentile(churnLat.d, 0.5), percentile(churnLat.d, 0.99)
		return fmt.Sprintf("%d pods created and deleted at %.0f/s: ADD p50 %.1f ms p99 %.1f ms, %d failed %v",
			ops, opt.ChurnRate, r.ChurnP50, r.ChurnP99, churnLat.failed, churnLat.errs), 0, nil
	})
	if err != nil {
		return r, err
	}

	// join: a new host's agent starts (its host record and liveness key).
	var joiner *Host
	err = c.measure(&r, "join", func() (string, float64, error) {
		t := time.Now()
		hs, err := c.AddHosts(1, nil, nil)
		if err != nil {
			return "", 0, err
		}
		joiner = hs[0]
		window(t, eventWindow)
		return joiner.Name + " started", time.Since(t).Seconds(), nil
	})
	if err != nil {
		return r, err
	}

	// ring: the new host's first ADD claims space (one ring change),
	// until every agent routes to it.
	err = c.measure(&r, "ring", func() (string, float64, error) {
		t := time.Now()
		actx, cancel := context.WithTimeout(ctx, 5*time.Minute)
		defer cancel()
		if _, _, _, err := joiner.Add(actx); err != nil {
			return "", 0, err
		}
		missing := c.WaitAll(5*time.Minute, joiner, func(h *Host) bool { return h.RoutesTo(joiner.Name) })
		wait := time.Since(t).Seconds()
		window(t, eventWindow)
		if missing > 0 {
			return "", wait, fmt.Errorf("ring change: %d agents never routed to %s", missing, joiner.Name)
		}
		return fmt.Sprintf("claim on %s: every agent routes to it after %.2fs", joiner.Name, wait), wait, nil
	})
	if err != nil {
		return r, err
	}

	// publish: one ingress port, until every agent forwards it.
	err = c.measure(&r, "publish", func() (string, float64, error) {
		t := time.Now()
		actx, cancel := context.WithTimeout(ctx, 5*time.Minute)
		defer cancel()
		ctr, res, _, err := joiner.Add(actx)
		if err == nil {
			err = joiner.Publish(actx, ctr, res, "ingress", 31999)
		}
		if err != nil {
			return "", 0, err
		}
		missing := c.WaitAll(5*time.Minute, joiner, func(h *Host) bool { return h.Forwards(31999) })
		wait := time.Since(t).Seconds()
		window(t, eventWindow)
		if missing > 0 {
			return "", wait, fmt.Errorf("publish: %d agents never forwarded 31999", missing)
		}
		return fmt.Sprintf("ingress port 31999 on %s: every agent forwards it after %.2fs", joiner.Name, wait), wait, nil
	})
	if err != nil {
		return r, err
	}

	// leave: a host stops with LeaveOnStop.
	err = c.measure(&r, "leave", func() (string, float64, error) {
		t := time.Now()
		h := hosts[leaver]
		if err := c.Stop(h); err != nil {
			return "", 0, fmt.Errorf("leave: %w", err)
		}
		h.Forget()
		missing := c.WaitAll(5*time.Minute, nil, func(x *Host) bool { return !x.RoutesTo(h.Name) })
		wait := time.Since(t).Seconds()
		window(t, eventWindow)
		if missing > 0 {
			return "", wait, fmt.Errorf("leave: %d agents still route to %s", missing, h.Name)
		}
		return fmt.Sprintf("%s left; no agent routes to it after %.2fs", h.Name, wait), wait, nil
	})
	if err != nil {
		return r, err
	}

	// orphan: a host's agent stops (its lease goes); after OrphanAfter a
	// sweep reclaims its owners.
	err = c.measure(&r, "orphan", func() (string, float64, error) {
		t := time.Now()
		h := hosts[orphan]
		if err := c.Stop(h); err != nil {
			return "", 0, fmt.Errorf("orphan: %w", err)
		}
		deadline := t.Add(opt.OrphanAfter + 3*opt.SweepInterval + 2*time.Minute)
		for {
			actx, cancel := context.WithTimeout(ctx, time.Minute)
			left, err := c.Pool.List(actx, Filter(h.Name))
			cancel()
			if err == nil && len(left) == 0 {
				break
			}
			if time.Now().After(deadline) {
				return "", 0, fmt.Errorf("orphan: %s still holds %d owners after %s (%v)", h.Name, len(left), time.Since(t), err)
			}
			time.Sleep(2 * time.Second)
		}
		h.Forget()
		wait := time.Since(t).Seconds()
		return fmt.Sprintf("%s stopped; its owners reclaimed after %.1fs (orphanAfter %s, sweep every %s)", h.Name, wait, opt.OrphanAfter, opt.SweepInterval), wait, nil
	})
	if err != nil {
		return r, err
	}

	if opt.Chaos {
		if err := c.chaos(ctx, &r, hosts[probe], hosts[1:n-2]); err != nil {
			return r, err
		}
	}

	cctx, cancel := context.WithTimeout(ctx, 10*time.Minute)
	defer cancel()
	f, err := c.Check(cctx)
	r.Findings = f
	r.Warnings, r.FirstWarnings = c.Warnings()
	if err != nil {
		return r, err
	}
	if !f.OK() {
		return r, errors.New("scale: " + f.String())
	}
	return r, nil
}

// churn creates pods on hosts at rate a second for d, each deleted again
// about two seconds later; it returns how many it created.
func churn(ctx context.Context, hosts []*Host, d time.Duration, rate float64, seed uint64, lat *latencies) int {
	rng := rand.New(rand.NewPCG(seed, 42))
	var wg sync.WaitGroup
	sem := make(chan struct{}, 64)
	tick := time.NewTicker(time.Duration(float64(time.Second) / rate))
	defer tick.Stop()
	end := time.Now().Add(d)
	ops := 0
	for time.Now().Before(end) {
		<-tick.C
		h := hosts[rng.IntN(len(hosts))]
		ops++
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			actx, cancel := context.WithTimeout(ctx, 5*time.Minute)
			defer cancel()
			t := time.Now()
			ctr, _, _, err := h.Add(actx)
			lat.add(time.Since(t), err)
			if err != nil {
				return
			}
			time.Sleep(2 * time.Second)
			// A failed DEL is tried again, as a runtime does (a DEL
			// answered 11 during a fault may have released already: a
			// DEL of nothing succeeds).
			for try := 1; ; try++ {
				err := h.Del(actx, ctr)
				if err == nil {
					break
				}
				lat.add(0, fmt.Errorf("DEL (try %d; tried again, as a runtime does): %w", try, err))
				if try == 10 || actx.Err() != nil {
					h.cleanup(ctr, false)
					break
				}
				time.Sleep(time.Second)
			}
		})
	}
	wg.Wait()
	return ops
}

// chaos runs a churn while the etcd leader is killed (and started again)
// and the partitioned host's etcd relay is cut (and healed): issue 41
// item 5 at this size. Its figures are not read (a killed member serves
// no metrics); the checks after it must find nothing.
func (c *Cluster) chaos(ctx context.Context, r *Result, partitioned *Host, hosts []*Host) error {
	if c.Members == nil || len(partitioned.Proxy) == 0 {
		return fmt.Errorf("chaos: needs 3 etcd members (SCALE_MEMBERS=3) and a relayed host")
	}
	d := max(c.opt.Churn, 40*time.Second)
	var lat latencies
	done := make(chan int)
	t0 := time.Now()
	go func() { done <- churn(ctx, hosts, d, c.opt.ChurnRate, 7, &lat) }()
	var faults []string
	time.Sleep(d / 4)
	lctx, cancel := context.WithTimeout(ctx, time.Minute)
	leader, _, err := c.Members.Leader(lctx)
	cancel()
	if err != nil {
		return fmt.Errorf("chaos: finding the leader: %w", err)
	}
	m := c.Members.Members()[leader]
	m.Stop()
	for _, p := range partitioned.Proxy {
		p.Cut()
	}
	faults = append(faults, fmt.Sprintf("%.0fs: killed etcd leader %s, cut %s's etcd connection", time.Since(t0).Seconds(), m.Name(), partitioned.Name))
	time.Sleep(10 * time.Second)
	for _, p := range partitioned.Proxy {
		p.Heal()
	}
	faults = append(faults, fmt.Sprintf("%.0fs: healed %s", time.Since(t0).Seconds(), partitioned.Name))
	time.Sleep(5 * time.Second)
	if err := m.Restart(); err != nil {
		return fmt.Errorf("chaos: %w", err)
	}
	faults = append(faults, fmt.Sprintf("%.0fs: started %s again", time.Since(t0).Seconds(), m.Name()))
	ops := <-done
	note := fmt.Sprintf("%d pods created and deleted under faults (%s): ADD p50 %.1f ms p99 %.1f ms, %d failed %v",
		ops, strings.Join(faults, "; "), percentile(lat.d, 0.5), percentile(lat.d, 0.99), lat.failed, lat.errs)
	r.Phases = append(r.Phases, Phase{Name: "chaos", Hosts: len(c.Running()), Note: note})
	c.Logf("phase chaos    %s", note)
	return nil
}
