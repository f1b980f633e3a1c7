package harness

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// Series is one scrape of Prometheus text: the full series ("name{labels}")
// to its value, summed over the members scraped.
type Series map[string]float64

// ParseMetrics reads Prometheus text exposition format into s (adding to
// what s holds: one Series sums several members).
func ParseMetrics(r io.Reader, s Series) error {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<16), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		if i < 0 {
			continue
		}
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			return fmt.Errorf("metrics line %q: %w", line, err)
		}
		s[line[:i]] += v
	}
	return sc.Err()
}

// Sum adds every series of metric name whose labels include each of the
// label="value" pairs given (in the order the exposition prints them or
// not: each is looked for on its own).
func (s Series) Sum(name string, labels ...string) float64 {
	var t float64
	for k, v := range s {
		n, ls, _ := strings.Cut(k, "{")
		if n != name {
			continue
		}
		ok := true
		for _, l := range labels {
			if !strings.Contains(ls, l) {
				ok = false
				break
			}
		}
		if ok {
			t += v
		}
	}
	return t
}

// ByLabel sums metric name's series (filtered as Sum) per value of label.
func (s Series) ByLabel(name, label string, filter ...string) map[string]float64 {
	out := map[string]float64{}
	for k, v := range s {
		n, ls, _ := strings.Cut(k, "{")
		if n != name {
			continue
		}
		ok := true
		for _, l := range filter {
			if !strings.Contains(ls, l) {
				ok = false
				break
			}
		}
		if !ok {
			continue
		}
		_, rest, found := strings.Cut(ls, label+`="`)
		if !found {
			continue
		}
		val, _, _ := strings.Cut(rest, `"`)
		out[val] += v
	}
	return out
}

// Scrape reads /metrics of every endpoint (an etcd client URL serves
// them) and returns the sum, and per member the gauges that every member
// holds alike (their maximum is the cluster's figure: proposals
// committed, db size).
func Scrape(ctx context.Context, endpoints []string) (Series, Series, error) {
	sum, max := Series{}, Series{}
	c := &http.Client{Timeout: 30 * time.Second}
	for _, ep := range endpoints {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, ep+"/metrics", nil)
		if err != nil {
			return nil, nil, err
		}
		resp, err := c.Do(req)
		if err != nil {
			return nil, nil, fmt.Errorf("scraping %s: %w", ep, err)
		}
		one := Series{}
		err = ParseMetrics(resp.Body, one)
		resp.Body.Close()
		if err != nil {
			return nil, nil, fmt.Errorf("scraping %s: %w", ep, err)
		}
		for k, v := range one {
			sum[k] += v
			if v > max[k] {
				max[k] = v
			}
		}
	}
	return sum, max, nil
}

// childCPU is the CPU time (user+system) of this process's children named
// comm (the etcd members testenv started), read from /proc.
func childCPU(comm string) time.Duration {
	self := os.Getpid()
	dirs, _ := filepath.Glob("/proc/[0-9]*/stat")
	var ticks int64
	for _, p := range dirs {
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		s := string(b)
		open, close := strings.IndexByte(s, '('), strings.LastIndexByte(s, ')')
		if open < 0 || close < open || s[open+1:close] != comm {
			continue
		}
		f := strings.Fields(s[close+1:])
		// f[0] state, f[1] ppid, ..., f[11] utime, f[12] stime.
		if len(f) < 13 {
			continue
		}
		if ppid, _ := strconv.Atoi(f[1]); ppid != self {
			continue
		}
		u, _ := strconv.ParseInt(f[11], 10, 64)
		st, _ := strconv.ParseInt(f[12], 10, 64)
		ticks += u + st
	}
	return time.Duration(ticks) * time.Second / 100 // USER_HZ
}
