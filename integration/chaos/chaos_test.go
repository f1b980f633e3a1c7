//go:build integration

package chaos

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"

	"github.com/ringipam/ringipam/integration/cnitest"
	"github.com/ringipam/ringipam/integration/netns"
	"github.com/ringipam/ringipam/pkg/cni/portmap"
	"github.com/ringipam/ringipam/pkg/hostlock"
	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/portalloc"
	etcdstore "github.com/ringipam/ringipam/pkg/store/etcd"
)

var keep = flag.Bool("chaos.keep", false, "save every run's history as JSON in the temp directory (a run that does not check out is always saved)")

var full = flag.Bool("chaos.full", false, "run the full fault suite (10 000 calls, faults in cycles) instead of the short one")

// Binaries TestMain builds besides cnitest.IPAMBin.
var driverBin, brokenBin, portmapBin, brokenPortmapBin string

func TestMain(m *testing.M) {
	if cfg := os.Getenv(agentEnv); cfg != "" {
		os.Exit(runAgent(cfg))
	}
	os.Exit(cnitest.Main(m, func(ctx context.Context, dir string) error {
		driverBin = filepath.Join(dir, "ringipam-docker")
		brokenBin = filepath.Join(dir, "ipam-ring-broken")
		portmapBin = filepath.Join(dir, "portmap-ingress")
		brokenPortmapBin = filepath.Join(dir, "portmap-ingress-broken")
		if err := cnitest.Build(ctx, driverBin, "./docker-driver"); err != nil {
			return err
		}
		if err := cnitest.Build(ctx, portmapBin, "./plugins/portmap-ingress"); err != nil {
			return err
		}
		if err := cnitest.Build(ctx, brokenPortmapBin, "./integration/chaos/testdata/brokenportmap"); err != nil {
			return err
		}
		return cnitest.Build(ctx, brokenBin, "./integration/chaos/testdata/brokenplugin")
	}))
}

// profile is one run's size.
type profile struct {
	name          string
	plugin        string  // ipam-ring
	portPlugin    string  // portmap-ingress
	race          bool    // the first attachments of hosts 0 and 1 race (raceConfig)
	direct        bool    // the plugins reach etcd themselves, not through the host's agent (the broken variants)
	ops           int     // at least this many calls (CNI ADD/DEL and Docker requests)
	cniOps        int     // and at least this many of them ADD/DEL through the ipam-ring binary
	cycles        int     // at least this many fault cycles
	hosts         int     // CNI hosts
	workers       int     // per CNI host
	dockerWorkers int     // on the Docker host
	killRate      float64 // share of new containers' ADDs SIGKILLed (of each plugin)
	partitionFor  time.Duration
	workFor       time.Duration // bound on the workload phase
	linTimeout    time.Duration // bound on the linearizability check
}

func shortProfile(plugin, portPlugin string) profile {
	return profile{name: "short", plugin: plugin, portPlugin: portPlugin, ops: 400, cycles: 1, hosts: 4, workers: 8, dockerWorkers: 3,
		killRate: 0.1, partitionFor: 3 * time.Second, workFor: 2 * time.Minute, linTimeout: time.Minute}
}

func fullProfile(plugin, portPlugin string) profile {
	return profile{name: "full", plugin: plugin, portPlugin: portPlugin, ops: 10000, cniOps: 10000, cycles: 1, hosts: 4, workers: 8, dockerWorkers: 3,
		killRate: 0.05, partitionFor: 4 * time.Second, workFor: 40 * time.Minute, linTimeout: 10 * time.Minute}
}

// TestChaos runs the fault suite against ipam-ring and portmap-ingress as
// built: no address or port may be handed out twice, leaked or lost, and
// the history of addresses must be linearizable. -chaos.full runs the full
// size.
//
// Every count asserted here is certain by the workload's construction,
// whatever the timing (the CI machine is a loaded 2-core box): the faults
// each happen once a cycle (a leader kill waits for the new leader, the
// driver is killed with the fault's own request held in flight); each host
// makes its first attachment, publishing a port, and two ADDs killed while
// they wait for their configuration before its workers and the faults
// start (agent.firstSteps), and reports an error when one of those did not
// go as it must.
func TestChaos(t *testing.T) {
	p := shortProfile(cnitest.IPAMBin, portmapBin)
	if *full {
		p = fullProfile(cnitest.IPAMBin, portmapBin)
	}
	r := runSuite(t, p)
	if r.duplicates != 0 || r.leaks != 0 || r.lost != 0 || !r.ringIntact || r.unclear != 0 || r.linearizable != "yes" {
		t.Errorf("the fault suite found problems: %s", r.line)
	}
	if r.leaderKills < p.cycles || r.leaderChanges < r.leaderKills || r.partitions < p.cycles || r.driverRestarts < p.cycles || r.midRequest < r.driverRestarts {
		t.Errorf("a fault did not happen (%d leader kills each with a leader change, partitions and driver restarts, each restart mid-request): %s", p.cycles, r.line)
	}
	if r.kills < 2*p.hosts || r.ports.counts["killed"] < p.hosts {
		t.Errorf("fewer kills than each host's two held ADDs, one of each plugin: %s", r.line)
	}
	if !r.ports.clean() {
		t.Errorf("the fault suite found problems with published ports (duplicates must be 0): %s", r.line)
	}
	if r.ports.published < p.hosts {
		t.Errorf("%d attachments published a port, fewer than the hosts' first attachments (%d): %s", r.ports.published, p.hosts, r.line)
	}
}

// TestChaosCatchesBrokenAllocator runs the same suite against plugins whose
// commits drop their revision conditions (ipam-ring's and
// portmap-ingress's): it must report duplicates of addresses and of ports.
// Both are certain: the first attachments of hosts 0 and 1 ask for one
// static address and one static ingress port, and each plugin's commit is
// held at a barrier until both hosts' plugins have read the store
// (raceConfig), so both write; their records stay to the end. The
// workload's own races come on top.
func TestChaosCatchesBrokenAllocator(t *testing.T) {
	p := shortProfile(brokenBin, brokenPortmapBin)
	p.name, p.race, p.direct = "broken", true, true
	p.linTimeout = 10 * time.Second // refuting a history can take porcupine long; the duplicates are the point here
	r := runSuite(t, p)
	if r.duplicates == 0 {
		t.Errorf("the suite did not catch the allocator without revision conditions: %s", r.line)
	}
	if r.ports.duplicates == 0 {
		t.Errorf("the suite did not catch the port allocator without revision conditions: %s", r.line)
	}
}

// startBarrier serves a barrier for n plugin processes on a unix socket
// (package broken's protocol): each connects at its gated commit, which is
// its arrival; once n have, each is told "go". It returns the socket's path.
// A plugin that waits longer than its own timeout fails its call (the
// first steps report it).
func startBarrier(t *testing.T, n int) string {
	path := filepath.Join(t.TempDir(), "barrier.sock")
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		var conns []net.Conn
		defer func() {
			for _, c := range conns {
				c.Close()
			}
		}()
		for len(conns) < n {
			c, err := l.Accept()
			if err != nil {
				return // the test ended first
			}
			conns = append(conns, c)
		}
		for _, c := range conns {
			_ = c.SetWriteDeadline(time.Now().Add(10 * time.Second))
			_, _ = io.WriteString(c, "go\n")
		}
	}()
	t.Cleanup(func() {
		l.Close()
		<-done
	})
	return path
}

// result is what a run found; line is its summary.
type result struct {
	ops, kills                             int
	workerRequest                          int
	leaderChanges, leaderKills             int
	partitions, driverRestarts, midRequest int
	duplicates, leaks, lost, unclear       int
	ringIntact                             bool
	linearizable                           string
	ports                                  portVerdict
	workload                               time.Duration
	line                                   string
}

// The pool every front end shares: 24 addresses (.2 to .25) for at most 32
// CNI and 3 Docker endpoints, so hosts run out of their own ranges and claim
// space from one another all the time, and now and then find the pool full.
// (The commits that race in those claims are what the broken plugin gets
// wrong: with a roomier pool it was caught far less reliably.)
var (
	subnet    = netip.MustParsePrefix("198.19.0.0/26")
	rangeFrom = netip.MustParseAddr("198.19.0.2")
	rangeTo   = netip.MustParseAddr("198.19.0.25")
)

// poolAddrs lists the addresses the pool hands out.
func poolAddrs() []netip.Addr {
	var out []netip.Addr
	for a := rangeFrom; a.Compare(rangeTo) <= 0; a = a.Next() {
		out = append(out, a)
	}
	return out
}

// netConf is the CNI network configuration every host uses (the IPAM part
// as a main plugin would hand it over). host "" leaves the plugin to use
// the host name; agent is the host's agent, nil for a plugin that reaches
// etcd itself (storeConf).
func netConf(network, poolName, host, prefix string, endpoints []string, agent *cnitest.Agent) []byte {
	ipamConf := map[string]any{
		"type":    "ipam-ring",
		"ranges":  [][]map[string]string{{{"subnet": subnet.String(), "rangeStart": rangeFrom.String(), "rangeEnd": rangeTo.String()}}},
		"pools":   []string{poolName},
		"timeout": "6s",
		"store":   storeConf(prefix, endpoints, agent),
	}
	if host != "" {
		ipamConf["host"] = host
	}
	b, _ := json.Marshal(map[string]any{"cniVersion": "1.1.0", "name": network, "type": "bridge", "ipam": ipamConf})
	return b
}

// storeConf is the store object of both plugins' configurations: through
// the host's agent, or (agent nil) without one, for the broken variants,
// which reach etcd themselves on purpose.
func storeConf(prefix string, endpoints []string, agent *cnitest.Agent) map[string]any {
	st := map[string]any{"type": "etcd", "endpoints": endpoints, "prefix": prefix, "dialTimeout": "1s", "requestTimeout": "2s"}
	if agent != nil {
		st = agent.Store(st)
	}
	return st
}

// history collects the calls of every worker of the run: those of
// ipam-ring and the Docker driver (calls), and those of portmap-ingress
// (ports), each judged on its own.
type history struct {
	mu    sync.Mutex
	calls []call
	ports []call
}

func (h *history) add(c call) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.calls = append(h.calls, c)
}

func (h *history) addPort(c call) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.ports = append(h.ports, c)
}

// snapshot returns a copy of the calls so far.
func (h *history) snapshot() (calls, ports []call) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.calls), slices.Clone(h.ports)
}

func (h *history) len() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.calls)
}

// cniLen is how many of the calls were ipam-ring's (the CNI owners' ADDs
// and DELs).
func (h *history) cniLen() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := 0
	for _, c := range h.calls {
		if strings.HasPrefix(c.Owner, "cni/") {
			n++
		}
	}
	return n
}

// agentProc is a running host agent, as the suite sees it.
type agentProc struct {
	host   *host
	stdin  io.WriteCloser
	exited <-chan struct{}
	ready  chan struct{}
	done   chan *agentDone
	gc     chan *gcReport
	log    string
	mu     sync.Mutex
	errs   []string
}

func (l *lab) startAgent(t *testing.T, i int, h *host, cfg agentConfig, hist *history) *agentProc {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	raw, err := json.Marshal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	a := &agentProc{host: h, ready: make(chan struct{}, 1), done: make(chan *agentDone, 1), gc: make(chan *gcReport, 1),
		log: filepath.Join(t.TempDir(), fmt.Sprintf("agent%d.log", i))}
	logf, err := os.Create(a.log)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	// ip netns exec puts the agent in the host's network namespace; the
	// clone flag gives it a UTS namespace of its own for its host name.
	cmd := exec.Command("ip", "netns", "exec", h.ns.Name, self)
	cmd.Env = append(os.Environ(), agentEnv+"="+string(raw))
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWUTS}
	cmd.Stderr = logf
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if a.stdin, err = cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	if a.exited, err = spawn(cmd); err != nil {
		t.Fatalf("agent %s: %v", h.name, err)
	}
	t.Cleanup(func() {
		select {
		case <-a.exited:
		default:
			_ = cmd.Process.Kill()
			select {
			case <-a.exited:
			case <-time.After(30 * time.Second):
				t.Errorf("agent %s did not exit after SIGKILL", h.name)
			}
		}
	})
	go func() {
		sc := bufio.NewScanner(stdout)
		sc.Buffer(make([]byte, 1<<20), 16<<20)
		for sc.Scan() {
			var m agentMsg
			if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
				a.fail("agent %s wrote %q: %v", h.name, sc.Bytes(), err)
				continue
			}
			switch {
			case m.Call != nil:
				hist.add(*m.Call)
			case m.Port != nil:
				hist.addPort(*m.Port)
			case m.Ready:
				a.ready <- struct{}{}
			case m.Done != nil:
				a.done <- m.Done
			case m.GC != nil:
				a.gc <- m.GC
			case m.Err != "":
				a.fail("agent %s: %s", h.name, m.Err)
			}
		}
	}()
	return a
}

func (a *agentProc) fail(format string, args ...any) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.errs = append(a.errs, fmt.Sprintf(format, args...))
}

func (a *agentProc) send(cmd string) error {
	_, err := io.WriteString(a.stdin, cmd+"\n")
	return err
}

// wait returns the next value of ch, or fails after d (or when the agent
// exits without sending it).
func wait[T any](t *testing.T, a *agentProc, ch chan T, what string, d time.Duration) (T, bool) {
	t.Helper()
	var zero T
	select {
	case v := <-ch:
		return v, true
	case <-a.exited:
		select {
		case v := <-ch:
			return v, true
		case <-time.After(time.Second):
		}
		t.Errorf("agent %s exited without %s; log:\n%s", a.host.name, what, tail(a.log, 3000))
	case <-time.After(d):
		t.Errorf("agent %s: no %s within %s; log:\n%s", a.host.name, what, d, tail(a.log, 3000))
	}
	return zero, false
}

// runPlugin runs the plugin once from the test process.
func runPlugin(t *testing.T, plugin, command, id string, conf []byte) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, plugin)
	cmd.Env = []string{"CNI_COMMAND=" + command, "CNI_CONTAINERID=" + id, "CNI_NETNS=/var/run/netns/unused",
		"CNI_IFNAME=eth0", "CNI_PATH=" + filepath.Dir(plugin), "PATH=/usr/sbin:/usr/bin:/sbin:/bin"}
	cmd.Stdin = bytes.NewReader(conf)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%s %s: %v: %s", command, id, err, out)
	}
}

// runSuite runs one fault-suite run of profile p and reports what it found.
func runSuite(t *testing.T, p profile) result {
	netns.RequireRoot(t)
	l := newLab(t, p.hosts)
	run := netns.Unique("")
	network, poolName, prefix := "chaosnet-"+run, "chaos-"+run, "/chaos-"+run+"/"
	seed := uint64(time.Now().UnixNano())
	t.Logf("run %s: seed %d, hosts %d x %d workers, Docker workers %d, at least %d calls and %d fault cycles",
		p.name, seed, p.hosts, p.workers, p.dockerWorkers, p.ops, p.cycles)
	// The plugin and the driver keep a lock file per (pool, host) in the
	// machine's lock directory.
	for _, h := range append(slices.Clone(l.hosts), l.docker) {
		t.Cleanup(func() { _ = os.Remove(filepath.Join(string(hostlock.DefaultDir), poolName+"@"+h.name+".lock")) })
	}

	// The suite's own view of the store, through the loopback relays.
	st, err := etcdstore.New(etcdstore.Config{Endpoints: l.relays, Prefix: prefix, DialTimeout: 2 * time.Second, RequestTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	checker, err := pool.New(st, "chaos-checker", pool.WithTimeout(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	portChecker, err := portalloc.New(st, "chaos-checker")
	if err != nil {
		t.Fatal(err)
	}

	// Every host's agent (ringipamd), in the host's namespace: the
	// plugins there send their calls to it, so a partition of the host
	// cuts its agent off from etcd, and a leader kill is the agent's to
	// ride out. Its etcd client fails as fast as the plugins' did.
	daemons := map[*host]*cnitest.Agent{}
	for _, h := range l.hosts {
		daemons[h] = cnitest.StartAgent(t, cnitest.AgentOptions{Endpoints: l.endpoints(), Prefix: prefix, Host: h.name, NS: h.ns,
			Args: []string{"--etcd-dial-timeout", "1s", "--etcd-request-timeout", "2s"}})
	}
	// agentOf is the agent h's plugins use: none for the broken variants.
	agentOf := func(h *host) *cnitest.Agent {
		if p.direct {
			return nil
		}
		return daemons[h]
	}

	// The CNI definition of the pool is recorded first (one ADD and DEL as
	// host 0, through host 0's agent; the broken plugin through the
	// loopback relays), so that the Docker network adopts its range.
	setupEndpoints := l.endpoints()
	if p.direct {
		setupEndpoints = l.relays
	}
	setup := netConf(network, poolName, l.hosts[0].name, prefix, setupEndpoints, agentOf(l.hosts[0]))
	runPlugin(t, p.plugin, "ADD", "setup", setup)
	runPlugin(t, p.plugin, "DEL", "setup", setup)

	drv, err := l.startDriver(driverBin, prefix)
	if err != nil {
		t.Fatal(err)
	}
	dc := newDockerClient(drv.sock)
	poolID, err := dc.network(poolName, subnet)
	if err != nil {
		t.Fatalf("Docker network on pool %s: %v; driver log:\n%s", poolName, err, tail(drv.log, 3000))
	}

	// The containers' network namespace (CNI_NETNS): the plugin refuses
	// its own.
	ctr := netns.New(t, "chctr")

	hist := &history{}
	start := time.Now()
	var agents []*agentProc
	var race *raceConfig
	if p.race {
		race = &raceConfig{IP: rangeTo, HostPort: raceHostPort, AddrBarrier: startBarrier(t, 2), PortBarrier: startBarrier(t, 2)}
	}
	for i, h := range l.hosts {
		cfg := agentConfig{
			Host: h.name, Index: i, Plugin: p.plugin, Conf: netConf(network, poolName, "", prefix, l.endpoints(), agentOf(h)),
			PortPlugin: p.portPlugin, PortConf: portConf(network, prefix, l.endpoints(), agentOf(h)),
			Netns: ctr.Path, Workers: p.workers, KillRate: p.killRate,
			CallLimit: 30 * time.Second, Seed: seed + uint64(i),
		}
		if i < 2 {
			cfg.Race = race
		}
		agents = append(agents, l.startAgent(t, i, h, cfg, hist))
	}
	// The workers and the faults start once every host has made its first
	// steps (agent.firstSteps).
	for _, a := range agents {
		wait(t, a, a.ready, "report of its first steps", 3*time.Minute)
	}
	if t.Failed() {
		t.FailNow()
	}
	for _, a := range agents {
		if err := a.send("go"); err != nil {
			t.Fatalf("agent %s: %v", a.host.name, err)
		}
	}
	dw := &dockerWorkers{c: dc, poolID: poolID, record: hist.add, host: l.docker.name}
	dw.start(p.dockerWorkers, seed)
	t.Cleanup(func() { dw.stop() }) // when the test ends early; stopping twice is fine

	f := &faults{lab: l, drv: drv, docker: dc, partitionFor: p.partitionFor, logf: t.Logf}
	fctx, stopFaults := context.WithCancel(context.Background())
	cyclesDone := make(chan struct{})
	var fwg sync.WaitGroup
	fwg.Go(func() { f.monitorLeader(fctx) })
	fwg.Go(func() { f.run(fctx, p.cycles, cyclesDone) })
	t.Cleanup(func() { stopFaults(); fwg.Wait() })

	deadline := time.After(p.workFor)
	progress := time.NewTicker(time.Minute)
	defer progress.Stop()
	enough := false
	for !enough {
		select {
		case <-deadline:
			t.Errorf("workload did not reach %d calls (%d of ipam-ring) and %d fault cycles within %s (%d calls, %d of ipam-ring)",
				p.ops, p.cniOps, p.cycles, p.workFor, hist.len(), hist.cniLen())
			enough = true
		case <-progress.C:
			t.Logf("%d calls (%d of ipam-ring) after %s", hist.len(), hist.cniLen(), time.Since(start).Round(time.Second))
		case <-time.After(200 * time.Millisecond):
			select {
			case <-cyclesDone:
				enough = hist.len() >= p.ops && hist.cniLen() >= p.cniOps
			default:
			}
		}
	}
	stopFaults()
	fwg.Wait()
	for _, a := range agents {
		if err := a.send("stop"); err != nil {
			t.Errorf("agent %s: %v", a.host.name, err)
		}
	}
	live := holdings{}                 // the attachments and endpoints the workers still hold
	livePorts := map[string]livePort{} // the ports the live attachments were given
	kills := 0
	for _, a := range agents {
		if d, ok := wait(t, a, a.done, "report of live attachments", 2*time.Minute); ok {
			for id, addr := range d.Live {
				live["cni/"+id] = addr
				livePorts["cni/"+id] = livePort{port: d.Ports[id], host: a.host.name, addr: addr}
			}
			kills += d.Kills
		}
	}
	for mac, addr := range dw.stop() {
		live["docker/"+mac] = addr
	}
	workload := time.Since(start)
	if t.Failed() {
		t.FailNow()
	}

	// What the store holds after the run, before GC: the history's end.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	final := readStore(t, ctx, checker, network, poolName)
	finalPorts := readPorts(t, ctx, portChecker, network)
	calls, portCalls := hist.snapshot()

	for _, a := range agents {
		if err := a.send("gc"); err != nil {
			t.Errorf("agent %s: %v", a.host.name, err)
		}
	}
	fwd := map[string]map[string][]portmap.Rule{} // host -> owner -> forwards left after GC
	for _, a := range agents {
		r, ok := wait(t, a, a.gc, "GC report", 2*time.Minute)
		switch {
		case !ok:
		case !r.OK:
			t.Errorf("GC on %s failed after %d attempts: %s", a.host.name, r.Attempts, r.Msg)
		case r.Ports == nil || !r.Ports.OK:
			t.Errorf("portmap-ingress GC on %s failed: %+v", a.host.name, r.Ports)
		case r.ForwardsErr != "":
			t.Errorf("reading the forwards on %s: %s", a.host.name, r.ForwardsErr)
		default:
			fwd[a.host.name] = forwardsByOwner(network, portCalls, r.Forwards)
			t.Logf("host %s: %d attachments' forwards left after GC", a.host.name, len(r.Forwards))
		}
		a.mu.Lock()
		for _, e := range a.errs {
			t.Error(e)
		}
		a.mu.Unlock()
	}
	after := readStore(t, ctx, checker, network, poolName)
	afterPorts := readPorts(t, ctx, portChecker, network)

	f.mu.Lock()
	for _, e := range f.errs {
		t.Errorf("fault injection: %s", e)
	}
	r := result{kills: kills, leaderChanges: f.leaderChanges, leaderKills: f.leaderKills, partitions: f.partitions,
		driverRestarts: f.driverRestarts, midRequest: f.midRequest, workerRequest: f.workerRequest, workload: workload}
	f.mu.Unlock()
	ports := portRun{calls: portCalls, final: finalPorts, after: afterPorts, forwards: fwd, live: livePorts, size: portRangeSize}
	judge(t, ctx, &r, p, run, checker, poolName, calls, final, after, live, ports)
	fmt.Println(r.line)
	t.Log(r.line)
	return r
}

// judge checks a finished run: the history calls, the readings of the
// store before (final) and after GC, the attachments and endpoints still
// live, and what the run gathered of published ports. It fills in r, with
// its summary line.
func judge(t *testing.T, ctx context.Context, r *result, p profile, run string, checker *pool.Allocator, poolName string,
	calls []call, final, after reading, live holdings, ports portRun) {
	sort.SliceStable(calls, func(i, j int) bool { return calls[i].Call < calls[j].Call })
	r.ops = len(calls)

	dups := append(duplicatesSeen(calls), storeDuplicates(final, after)...)
	for _, d := range dups {
		t.Logf("duplicate: %s", d)
	}
	r.duplicates = distinctDuplicates(dups)

	for o, a := range after.owners {
		if _, ok := live[o]; !ok {
			r.leaks++
			t.Logf("leak: %s holds %s after GC but is no live attachment", o, a)
		}
	}
	for o, a := range live {
		if got, ok := after.owners[o]; !ok || got != a {
			r.lost++
			t.Logf("lost: live %s was given %s but holds %v", o, a, got)
		}
	}

	problems, err := checker.Check(ctx, poolName)
	if err != nil {
		t.Errorf("Check: %v", err)
	}
	ring, rerr := checker.RingOf(ctx, poolName)
	if rerr != nil {
		problems = append(problems, "RingOf: "+rerr.Error())
	}
	for _, pr := range problems {
		t.Logf("store: %s", pr)
	}
	r.ringIntact = err == nil && len(problems) == 0
	t.Logf("ring after the run: %+v", ring)

	counts := map[string]int{}
	for _, c := range calls {
		counts[c.Verb]++
		if c.Unclear != "" {
			r.unclear++
			if r.unclear <= 10 {
				t.Logf("unclear failure: %+v", c)
			}
		}
		if c.Killed {
			counts["killed"]++
		}
		if c.Outcome != outOK {
			counts["failed"]++
			counts[fmt.Sprintf("code %d", c.Code)]++
		}
	}

	linStart := time.Now()
	var model porcupine.Model
	var info porcupine.LinearizationInfo
	var spanning []string
	r.linearizable, spanning, model, info = linearizable(poolAddrs(), calls, final.owners, p.linTimeout)
	linTook := time.Since(linStart)
	for _, s := range spanning {
		t.Logf("linearizability: %s", s)
	}
	if r.linearizable != "yes" {
		path := filepath.Join(os.TempDir(), fmt.Sprintf("ringipam-chaos-%s-%s.html", p.name, run))
		if err := porcupine.VisualizePath(model, info, path); err == nil {
			t.Logf("porcupine's view of the history: %s", path)
		}
	}
	r.ports = judgePorts(ports)
	for i, n := range r.ports.notes {
		if i == 50 {
			t.Logf("... %d more port findings", len(r.ports.notes)-i)
			break
		}
		t.Log(n)
	}
	pv := r.ports
	if r.linearizable != "yes" || !pv.clean() || *keep {
		saveHistory(t, filepath.Join(os.TempDir(), fmt.Sprintf("ringipam-chaos-%s-%s.json", p.name, run)), calls, final.owners, ports.calls)
	}

	r.line = fmt.Sprintf("chaos %s: operations %d (ADD %d, DEL %d, Docker release %d; failed %d: code 11 %d, code 102 %d, killed %d), "+
		"kills %d, leader changes %d (leader kills %d), partitions %d, driver restarts %d (mid-request %d, a worker's request too %d), "+
		"duplicates %d, leaks %d, lost %d, ring intact %s, unclear errors %d, linearizable %s (workload %s, check %s); "+
		"ports: calls %d (ADD %d, DEL %d; failed %d: code 11 %d, code 102 %d, killed %d), published %d, "+
		"duplicates %d, leaks %d, lost %d, false exhaustion %d, unclear errors %d",
		p.name, r.ops, counts[verbAdd], counts[verbDel], counts[verbRelease], counts["failed"], counts["code 11"], counts["code 102"], counts["killed"],
		r.kills, r.leaderChanges, r.leaderKills, r.partitions, r.driverRestarts, r.midRequest, r.workerRequest,
		r.duplicates, r.leaks, r.lost, yesNo(r.ringIntact), r.unclear, r.linearizable,
		r.workload.Round(time.Second), linTook.Round(time.Millisecond),
		len(ports.calls), pv.counts[verbAdd], pv.counts[verbDel], pv.counts["failed"], pv.counts["code 11"], pv.counts["code 102"], pv.counts["killed"],
		pv.published, pv.duplicates, pv.leaks, pv.lost, pv.falseExhausts, pv.unclear)
}

// saveHistory writes the calls, the final reading and the portmap-ingress
// calls as JSON, for a closer look at a history that did not check out.
func saveHistory(t *testing.T, path string, calls []call, final holdings, ports []call) {
	b, err := json.Marshal(struct {
		Calls []call   `json:"calls"`
		Final holdings `json:"final"`
		Ports []call   `json:"ports"`
	}{calls, final, ports})
	if err == nil {
		err = os.WriteFile(path, b, 0o600)
	}
	if err != nil {
		t.Logf("saving the history: %v", err)
		return
	}
	t.Logf("history saved: %s", path)
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

// readStore reads every allocation of the pool, CNI and Docker owners, as
// the model names them, and the owner each address's key names.
func readStore(t *testing.T, ctx context.Context, a *pool.Allocator, network, poolName string) reading {
	t.Helper()
	r := reading{owners: holdings{}, keys: map[netip.Addr]string{}}
	for _, f := range []pool.Filter{{Kind: pool.KindCNI, Network: network}, {Kind: pool.KindDocker, Network: poolName}} {
		allocs, err := a.List(ctx, f)
		if err != nil {
			t.Fatalf("listing %s allocations: %v", f.Kind, err)
		}
		for _, al := range allocs {
			addr, ok := al.Addr(poolName, pool.RoleIP)
			if !ok {
				t.Errorf("%s holds nothing in pool %s: %+v", al.Owner, poolName, al)
				continue
			}
			r.owners[string(f.Kind)+"/"+al.Owner.ContainerID] = addr
		}
	}
	for _, addr := range poolAddrs() {
		al, held, err := a.HolderOf(ctx, poolName, addr)
		if err != nil {
			t.Fatalf("holder of %s: %v", addr, err)
		}
		if held {
			r.keys[addr] = string(al.Owner.Kind) + "/" + al.Owner.ContainerID
		}
	}
	return r
}
