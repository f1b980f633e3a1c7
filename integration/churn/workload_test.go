//go:build integration

package churn

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/invoke"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/ringipam/ringipam/integration/cnitest"
	"github.com/ringipam/ringipam/integration/netns"
)

// ipam is one IPAM under test, on every host of the world.
type ipam struct {
	name   string // in the tables: "ringipam", "host-local", "whereabouts"
	plugin string // its binary's name in CNI_PATH ("ipam-ring", ...)
	real   string // the binary
	// conf is the "ipam" object of host i's network configuration.
	conf func(i int) map[string]any
	// check compares what the IPAM's store holds on the network with live
	// (container ID -> the address its ADD answered) and returns what
	// differs: a leak (held, not live), a loss (live, not held), a
	// mismatch. With live empty it is the leak check of the end.
	check func(ctx context.Context, network string, live map[string]netip.Addr) ([]string, error)
}

// Modes of a run: through the whole CNI chain (libcni runs the bridge
// plugin, which runs the IPAM plugin), or the IPAM plugin alone, invoked
// as the bridge plugin invokes it (the "IPAM time").
const (
	modeCNI  = "cni"
	modeIPAM = "ipam"
)

// The rounds of a churn: every pod created, deleted, created again (a new
// sandbox, so a new container ID, of the same pod), then deleted for the
// leak check.
var roundNames = []string{"create", "delete", "create again", "delete again"}

// workload is what a churn does: pods per host, CNI calls at a time per
// host, attempts per call (a runtime retries a failed ADD after its DEL,
// and a failed DEL).
type workload struct {
	pods, parallel, attempts int
}

// result is one IPAM's churn in one mode.
type result struct {
	ipam, mode string
	hosts      int
	w          workload
	wall       [4]time.Duration   // per round
	lat        [4][]time.Duration // per round: each successful call's latency, as the runtime waited for it
	ipamLat    [4][]time.Duration // per round (modeCNI): the IPAM plugin's own, from the timing shim
	failed     [4]int             // calls that failed (each attempt)
	errs       []string           // the first few failed calls' errors
	lost       []string           // pods whose every attempt failed
	findings   []string           // duplicates, store differences, leaks
	cpu        cpuUse             // during create, delete, create again
}

// pod is one pod of one host in one generation.
type pod struct {
	host, idx, gen int
}

// name is the pod's name, unique in its Kubernetes namespace across the
// cluster, as a pod's is (whereabouts answers a second ADD of one pod,
// namespace/name, with the first one's address).
func (p pod) name() string { return fmt.Sprintf("h%d-p%d", p.host, p.idx) }

// id is the container (sandbox) ID: one per generation.
func (p pod) id(run string) string { return fmt.Sprintf("%s-h%d-p%d-g%d", run, p.host, p.idx, p.gen) }

// netnsName is the pod's network namespace (modeCNI), under mark for the
// sweep.
func (p pod) netnsName(run string) string {
	return fmt.Sprintf("%sp%s-%d-%d-%d", mark, run, p.host, p.idx, p.gen)
}

// ledger is the runtime's view: which pod holds which address now. An
// address is in use from its ADD's answer until its DEL is sent; an ADD
// that answers an address in use is a duplicate.
type ledger struct {
	mu    sync.Mutex
	inUse map[netip.Addr]string // address -> container ID
	live  map[string]netip.Addr // container ID -> address
	dups  []string
}

func (l *ledger) add(id string, a netip.Addr) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if o, ok := l.inUse[a]; ok {
		l.dups = append(l.dups, fmt.Sprintf("duplicate: %s answered to %s while %s held it", a, id, o))
	}
	l.inUse[a] = id
	l.live[id] = a
}

func (l *ledger) release(id string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if a, ok := l.live[id]; ok && l.inUse[a] == id {
		delete(l.inUse, a)
	}
	delete(l.live, id)
}

func (l *ledger) snapshot() map[string]netip.Addr {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make(map[string]netip.Addr, len(l.live))
	for k, v := range l.live {
		out[k] = v
	}
	return out
}

// runner is one IPAM's churn on the world's hosts in one mode.
type runner struct {
	t       *testing.T
	w       *world
	ip      ipam
	mode    string
	run     string // this run's tag in container IDs and namespace names
	network string
	wl      workload
	dirs    []string // per host: its CNI_PATH (modeCNI: the timing shim's log too)
	cn      []*libcni.CNIConfig
	list    []*libcni.NetworkConfigList
	conf    [][]byte // per host: the network configuration the IPAM plugin gets
	led     *ledger
	exec    invoke.Exec // the plugins' stderr to a file
	mu      sync.Mutex
	res     *result
}

// churn runs the workload for ip on every host of w in mode and checks it:
// no duplicate at any time, the store equal to the ledger while every pod
// is up, nothing left at the end.
func churn(t *testing.T, w *world, ip ipam, mode string, wl workload) *result {
	t.Helper()
	r := &runner{t: t, w: w, ip: ip, mode: mode, run: netns.Unique("")[:6], wl: wl,
		network: "churn-" + ip.plugin + "-" + mode,
		led:     &ledger{inUse: map[netip.Addr]string{}, live: map[string]netip.Addr{}},
		res:     &result{ipam: ip.name, mode: mode, hosts: len(w.hosts), w: wl}}
	// The plugins' stderr (whereabouts logs every leader election there)
	// goes to a file, shown when the churn found something.
	stderr, err := os.Create(filepath.Join(w.dir, ip.plugin+"-"+mode+".stderr"))
	if err != nil {
		t.Fatal(err)
	}
	defer stderr.Close()
	r.exec = &invoke.DefaultExec{RawExec: &invoke.RawExec{Stderr: stderr}, PluginDecoder: version.PluginDecoder{}}
	for i, h := range w.hosts {
		dir := filepath.Join(w.dir, ip.plugin+"-"+mode, h.name)
		for _, d := range []string{dir, filepath.Join(dir, ".real")} {
			if err := os.MkdirAll(d, 0o755); err != nil {
				t.Fatal(err)
			}
		}
		links := map[string]string{"bridge": cnitest.RefBin(t, "bridge"), ".real/" + ip.plugin: ip.real, ip.plugin: shimBin}
		for name, target := range links {
			if err := os.Symlink(target, filepath.Join(dir, name)); err != nil {
				t.Fatal(err)
			}
		}
		r.dirs = append(r.dirs, dir)
		plugin := map[string]any{"type": "bridge", "bridge": "br" + strconv.Itoa(i%10) + ip.plugin[:2] + mode[:1],
			"isGateway": true, "ipam": ip.conf(i)}
		r.list = append(r.list, cnitest.ConfList(t, r.network, plugin))
		b, err := json.Marshal(map[string]any{"cniVersion": "1.1.0", "name": r.network, "type": "bridge", "ipam": ip.conf(i)})
		if err != nil {
			t.Fatal(err)
		}
		r.conf = append(r.conf, b)
		r.cn = append(r.cn, libcni.NewCNIConfigWithCacheDir([]string{dir}, filepath.Join(dir, ".cache"), r.exec))
	}
	for round := range roundNames {
		gen := round / 2
		create := round%2 == 0
		if create && mode == modeCNI {
			r.eachPod(gen, r.addNetns) // the sandbox's namespace, before (and not in) the timed round
		}
		start, cpu0 := time.Now(), sampleCPU()
		if create {
			r.eachPod(gen, r.add)
		} else {
			r.eachPod(gen, r.del)
		}
		r.res.wall[round] = time.Since(start)
		if round < 3 {
			r.res.cpu = r.res.cpu.add(sampleCPU().sub(cpu0))
		}
		if !create && mode == modeCNI {
			r.eachPod(gen, r.delNetns)
		}
		t.Logf("%s %s: %s: %d pods on %d hosts in %v (%d failed calls)", ip.name, mode, roundNames[round],
			wl.pods*len(w.hosts), len(w.hosts), r.res.wall[round].Round(time.Millisecond), r.res.failed[round])
		if round == 2 {
			r.checkStore("every pod up", r.led.snapshot())
		}
	}
	r.checkStore("every pod deleted", nil)
	r.res.findings = append(r.res.findings, r.led.dups...)
	if len(r.res.findings)+len(r.res.lost) > 0 {
		b, _ := os.ReadFile(stderr.Name())
		lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
		t.Logf("%s %s: the plugins' last stderr lines:\n%s", ip.name, mode, strings.Join(lines[max(0, len(lines)-30):], "\n"))
	}
	if mode == modeCNI {
		r.readTimings()
	}
	return r.res
}

// checkStore compares the IPAM's store with live and records what differs.
func (r *runner) checkStore(when string, live map[string]netip.Addr) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	diff, err := r.ip.check(ctx, r.network, live)
	if err != nil {
		r.res.findings = append(r.res.findings, fmt.Sprintf("%s: the store could not be read: %v", when, err))
	}
	for _, d := range diff {
		r.res.findings = append(r.res.findings, when+": "+d)
	}
}

// eachPod runs fn for every pod of generation gen, wl.parallel at a time
// on each host, every host at once, as each host's runtime would.
func (r *runner) eachPod(gen int, fn func(p pod)) {
	var wg sync.WaitGroup
	for h := range r.w.hosts {
		next := make(chan int)
		for range r.wl.parallel {
			wg.Go(func() {
				for i := range next {
					fn(pod{host: h, idx: i, gen: gen})
				}
			})
		}
		wg.Go(func() {
			for i := range r.wl.pods {
				next <- i
			}
			close(next)
		})
	}
	wg.Wait()
}

func (r *runner) addNetns(p pod) {
	if out, err := netns.Command("ip", "netns", "add", p.netnsName(r.run)); err != nil {
		r.t.Errorf("ip netns add %s: %v: %s", p.netnsName(r.run), err, out)
	}
}

func (r *runner) delNetns(p pod) {
	if out, err := netns.Command("ip", "netns", "delete", p.netnsName(r.run)); err != nil {
		r.t.Errorf("ip netns delete %s: %v: %s", p.netnsName(r.run), err, out)
	}
}

func (r *runner) cniArgs(p pod) [][2]string {
	return [][2]string{{"IgnoreUnknown", "1"}, {"K8S_POD_NAMESPACE", "churn"}, {"K8S_POD_NAME", p.name()},
		{"K8S_POD_INFRA_CONTAINER_ID", p.id(r.run)}}
}

func (r *runner) rt(p pod) *libcni.RuntimeConf {
	return &libcni.RuntimeConf{ContainerID: p.id(r.run), NetNS: "/var/run/netns/" + p.netnsName(r.run), IfName: "eth0", Args: r.cniArgs(p)}
}

// callTimeout bounds each CNI call: kubelet's default
// --runtime-request-timeout (2m), which is also whereabouts' own limit
// on an ADD (a shorter bound would fail whereabouts calls that a kubelet
// waits for).
const callTimeout = 2 * time.Minute

// call runs one verb for p on its host, as the runtime (modeCNI) or as the
// main plugin (modeIPAM) would, and returns the ADD's first address.
func (r *runner) call(verb string, p pod) (netip.Addr, error) {
	h := r.w.hosts[p.host]
	var res types.Result
	err := h.ns.Do(func() error {
		ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
		defer cancel()
		var err error
		switch {
		case r.mode == modeCNI && verb == "ADD":
			res, err = r.cn[p.host].AddNetworkList(ctx, r.list[p.host], r.rt(p))
		case r.mode == modeCNI:
			err = r.cn[p.host].DelNetworkList(ctx, r.list[p.host], r.rt(p))
		default:
			var args []string
			for _, kv := range r.cniArgs(p) {
				args = append(args, kv[0]+"="+kv[1])
			}
			a := &invoke.Args{Command: verb, ContainerID: p.id(r.run), IfName: "eth0", PluginArgsStr: strings.Join(args, ";"),
				Path: r.dirs[p.host]}
			if verb == "ADD" {
				a.NetNS = cnitest.NoNetNS
				res, err = invoke.ExecPluginWithResult(ctx, r.ip.real, r.conf[p.host], a, r.exec)
			} else {
				err = invoke.ExecPluginWithoutResult(ctx, r.ip.real, r.conf[p.host], a, r.exec)
			}
		}
		return err
	})
	if err != nil || verb != "ADD" {
		return netip.Addr{}, err
	}
	cur, err := current.NewResultFromResult(res)
	if err != nil {
		return netip.Addr{}, err
	}
	if len(cur.IPs) == 0 {
		return netip.Addr{}, fmt.Errorf("ADD answered no address: %v", cur)
	}
	a, ok := netip.AddrFromSlice(cur.IPs[0].Address.IP)
	if !ok {
		return netip.Addr{}, fmt.Errorf("ADD answered %v", cur.IPs[0].Address)
	}
	return a.Unmap(), nil
}

func (r *runner) note(round int, took time.Duration, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err != nil {
		r.res.failed[round]++
		if len(r.res.errs) < 5 {
			r.res.errs = append(r.res.errs, fmt.Sprintf("%s after %v: %v", roundNames[round], took.Round(time.Millisecond), err))
		}
		return
	}
	r.res.lat[round] = append(r.res.lat[round], took)
}

// add creates p: ADD, and after a failed ADD its DEL and the ADD again,
// up to wl.attempts times.
func (r *runner) add(p pod) {
	round := 2 * p.gen
	var err error
	for range r.wl.attempts {
		start := time.Now()
		var a netip.Addr
		a, err = r.call("ADD", p)
		r.note(round, time.Since(start), err)
		if err == nil {
			r.led.add(p.id(r.run), a)
			return
		}
		_, _ = r.call("DEL", p)
	}
	r.mu.Lock()
	r.res.lost = append(r.res.lost, fmt.Sprintf("%s: ADD failed %d times, last: %v", p.id(r.run), r.wl.attempts, err))
	r.mu.Unlock()
}

// del deletes p: its address leaves the ledger when the DEL is sent, and
// a failed DEL is sent again, up to wl.attempts times.
func (r *runner) del(p pod) {
	round := 2*p.gen + 1
	r.led.release(p.id(r.run))
	var err error
	for range r.wl.attempts {
		start := time.Now()
		_, err = r.call("DEL", p)
		r.note(round, time.Since(start), err)
		if err == nil {
			return
		}
	}
	r.mu.Lock()
	r.res.lost = append(r.res.lost, fmt.Sprintf("%s: DEL failed %d times, last: %v", p.id(r.run), r.wl.attempts, err))
	r.mu.Unlock()
}

// readTimings reads the timing shim's logs (modeCNI): the IPAM plugin's
// own time of every call, by round (from the verb and the generation in
// the container ID). Calls the bridge plugin made on its own (a DEL after
// a failed ADD) count in their round too.
func (r *runner) readTimings() {
	for _, dir := range r.dirs {
		f, err := os.Open(filepath.Join(dir, "timing.log"))
		if err != nil {
			r.t.Errorf("timing shim: %v", err)
			continue
		}
		s := bufio.NewScanner(f)
		for s.Scan() {
			fields := strings.Fields(s.Text())
			if len(fields) != 5 {
				continue
			}
			gen := 0
			if strings.HasSuffix(fields[1], "-g1") {
				gen = 1
			}
			round := 2 * gen
			if fields[0] == "DEL" {
				round++
			} else if fields[0] != "ADD" {
				continue
			}
			ns, _ := strconv.ParseInt(fields[3], 10, 64)
			if fields[4] == "0" {
				r.res.ipamLat[round] = append(r.res.ipamLat[round], time.Duration(ns))
			}
		}
		f.Close()
	}
}

// pct is the p-th percentile of d (nearest rank); 0 for none.
func pct(d []time.Duration, p float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	i := int(float64(len(s))*p/100+0.5) - 1
	return s[min(max(i, 0), len(s)-1)]
}

func join(rounds ...[]time.Duration) []time.Duration {
	var out []time.Duration
	for _, r := range rounds {
		out = append(out, r...)
	}
	return out
}
