//go:build integration

package chaos

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ringipam/ringipam/pkg/cni/portmap"
	"github.com/ringipam/ringipam/pkg/portalloc"
)

// A host agent is this test binary run again (agentEnv set) inside a host's
// network namespace and a UTS namespace of its own, whose host name it sets:
// one "host" of the cluster, as a separate process with its own name. It
// runs Workers workers, each calling the real plugin binaries once per ADD
// or DEL with the CNI environment, as a container runtime runs a conflist
// of ipam-ring and portmap-ingress (ADD in order, DEL in reverse), and
// writes one JSON line per call to stdout. Before its workers start it
// makes its first attachment (kept to the end) and two ADDs killed for sure
// (firstSteps), reports "ready" and waits for "go" on stdin: the suite
// starts the workers and the faults once every agent is ready, so that
// these steps are certain to happen, without faults and with room in the
// pool and the port range. Then it obeys two more commands on stdin: "stop"
// (finish the calls in progress, then report the attachments still live)
// and "gc" (run both plugins' GC with exactly those attachments, read the
// forwards left in the host's nftables table, report, exit).
const agentEnv = "RINGIPAM_CHAOS_AGENT"

// agentConfig is the agent's whole configuration, passed as JSON in agentEnv.
type agentConfig struct {
	Host   string          `json:"host"`
	Index  int             `json:"index"`
	Plugin string          `json:"plugin"`
	Conf   json.RawMessage `json:"conf"` // the network configuration (CNI 1.1.0), without "host": the plugin uses the host name
	// PortPlugin is portmap-ingress: ADD after every successful ADD of
	// Plugin, with PortConf and Plugin's result as prevResult; DEL before
	// every DEL of Plugin.
	PortPlugin string          `json:"portPlugin"`
	PortConf   json.RawMessage `json:"portConf"` // its configuration, without prevResult and "host"
	Netns      string          `json:"netns"`    // CNI_NETNS of the calls
	Workers    int             `json:"workers"`
	// KillRate is the probability that a new container's ADD of a plugin
	// (drawn for each of the two) is SIGKILLed, after a delay drawn
	// uniformly from [0, d) where d is the shortest of the worker's last
	// four successful ADDs of that plugin: mid-ADD, whatever the load (the
	// shortest, so that one slow ADD, during a leader election, does not
	// push the next kills past the end of their ADDs).
	KillRate float64 `json:"killRate"`
	// CallLimit bounds one invocation; one that runs longer (the plugin
	// overran its own timeout) is killed and reported as unclear.
	CallLimit time.Duration `json:"callLimit"`
	Seed      uint64        `json:"seed"`
	// Race, when set, makes the first attachment a race: a static address
	// and a static ingress port that another agent asks for at the same
	// moment, each plugin's commit held at a barrier of the suite until
	// both agents' plugins have read the store (the broken plugins'
	// package broken; the real plugins ignore it).
	Race *raceConfig `json:"race,omitempty"`
}

// raceConfig is the first attachment of an agent in a race.
type raceConfig struct {
	IP          netip.Addr `json:"ip"`          // ipam-ring's CNI_ARGS IP=
	HostPort    uint16     `json:"hostPort"`    // portmap-ingress's static ingress port
	AddrBarrier string     `json:"addrBarrier"` // the barrier socket of ipam-ring's commit
	PortBarrier string     `json:"portBarrier"` // and of portmap-ingress's
}

// firstTimeout bounds each call of the first steps: a race waits at the
// barrier for the other agent, which may start later on a loaded machine.
// (It stays below the call limit of 30s.)
const firstTimeout = 20 * time.Second

// agentMsg is one line of an agent's stdout.
type agentMsg struct {
	Call  *call      `json:"call,omitempty"` // an ipam-ring call
	Port  *call      `json:"port,omitempty"` // a portmap-ingress call
	Ready bool       `json:"ready,omitempty"`
	Done  *agentDone `json:"done,omitempty"`
	GC    *gcReport  `json:"gc,omitempty"`
	Err   string     `json:"err,omitempty"`
}

// agentDone lists the attachments that are live when the agent stopped:
// the runtime's true list for GC.
type agentDone struct {
	Live  map[string]netip.Addr        `json:"live"`  // container ID -> address
	Ports map[string]portalloc.Address `json:"ports"` // container ID -> published port
	Kills int                          `json:"kills"` // of both plugins
}

// gcReport is ipam-ring's GC; Ports is portmap-ingress's, Forwards what the
// host's nftables table holds after both, by attachment mark.
type gcReport struct {
	OK          bool                      `json:"ok"`
	Attempts    int                       `json:"attempts"`
	Msg         string                    `json:"msg,omitempty"`
	Ports       *gcReport                 `json:"ports,omitempty"`
	Forwards    map[string][]portmap.Rule `json:"forwards,omitempty"`
	ForwardsErr string                    `json:"forwardsErr,omitempty"`
}

// monotonic returns CLOCK_MONOTONIC in nanoseconds: one clock for every
// process of the suite on this machine.
func monotonic() int64 {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		panic(err)
	}
	return ts.Nano()
}

// runAgent is the agent's main; it returns the exit code.
func runAgent(raw string) int {
	var cfg agentConfig
	if err := json.Unmarshal([]byte(raw), &cfg); err != nil {
		fmt.Fprintln(os.Stderr, "agent: config:", err)
		return 2
	}
	if err := unix.Sethostname([]byte(cfg.Host)); err != nil {
		fmt.Fprintln(os.Stderr, "agent: sethostname (needs its own UTS namespace):", err)
		return 2
	}
	if h, err := os.Hostname(); err != nil || h != cfg.Host {
		fmt.Fprintf(os.Stderr, "agent: host name is %q (%v), want %q\n", h, err, cfg.Host)
		return 2
	}
	a := &agent{cfg: cfg, out: json.NewEncoder(os.Stdout), live: map[string]netip.Addr{}, ports: map[string]portalloc.Address{}}
	cmds := make(chan string, 4)
	go func() {
		sc := bufio.NewScanner(os.Stdin)
		for sc.Scan() {
			cmds <- strings.TrimSpace(sc.Text())
		}
		close(cmds) // the suite went away: stop, and exit after the report
	}()
	a.firstSteps()
	a.emit(agentMsg{Ready: true})
	c := <-cmds
	var wg sync.WaitGroup
	if c == "go" {
		for w := range cfg.Workers {
			wg.Go(func() { a.work(w) })
		}
		c = <-cmds
	}
	if c != "stop" && c != "" {
		a.emit(agentMsg{Err: "unexpected command " + c})
	}
	a.stopping.Store(true)
	wg.Wait()
	a.emit(agentMsg{Done: &agentDone{Live: a.live, Ports: a.ports, Kills: int(a.kills.Load())}})
	if c, ok := <-cmds; !ok || c != "gc" {
		return 0
	}
	a.emit(agentMsg{GC: a.gc()})
	return 0
}

type agent struct {
	cfg      agentConfig
	mu       sync.Mutex // guards out, live and ports
	out      *json.Encoder
	live     map[string]netip.Addr
	ports    map[string]portalloc.Address
	stopping atomic.Bool
	kills    atomic.Int64
}

func (a *agent) emit(m agentMsg) {
	a.mu.Lock()
	defer a.mu.Unlock()
	_ = a.out.Encode(m)
}

// work is one worker: it keeps at most one attachment at a time. With none
// it ADDs a new container (ipam-ring, then portmap-ingress with ipam-ring's
// result); with one it either ADDs it again (both plugins, which must
// return the same address and port) or DELs it. After a failed ADD of
// either plugin, a replay's too, it DELs the container, as runtimes do,
// until a DEL succeeds (a bounded number of times). Container IDs are
// never reused.
func (a *agent) work(w int) {
	rng := rand.New(rand.NewPCG(a.cfg.Seed, uint64(w)))
	client := a.cfg.Index*100 + w
	n := 0
	var cur string
	var addTook, portAddTook recent
	for !a.stopping.Load() {
		if cur == "" {
			n++
			id := fmt.Sprintf("c%d-w%d-%d", a.cfg.Index, w, n)
			kill, killPorts := rng.Float64() < a.cfg.KillRate, rng.Float64() < a.cfg.KillRate
			delay := time.Duration(rng.Int64N(int64(addTook.shortest())))
			portDelay := time.Duration(rng.Int64N(int64(portAddTook.shortest())))
			c, res := a.invoke(client, false, "ADD", id, nil, kill, delay)
			if c.Outcome == outOK {
				addTook.add(c)
				pc, _ := a.invoke(client, true, "ADD", id, res, killPorts, portDelay)
				if pc.Outcome == outOK {
					portAddTook.add(pc)
					cur = id
					a.setLive(id, c.Addr, pc.Port)
					continue
				}
			}
			a.delUntilDone(client, id)
			continue
		}
		if rng.Float64() < 0.25 {
			// A replay that fails is a failed ADD like any other: DELed,
			// as runtimes do (portmap-ingress's failed ADD may have
			// released the ports the first one returned).
			ok := false
			if c, res := a.invoke(client, false, "ADD", cur, nil, false, 0); c.Outcome == outOK {
				pc, _ := a.invoke(client, true, "ADD", cur, res, false, 0)
				ok = pc.Outcome == outOK
			}
			if !ok {
				a.delUntilDone(client, cur)
				a.setLive(cur, netip.Addr{}, portalloc.Address{})
				cur = ""
			}
			continue
		}
		a.delUntilDone(client, cur)
		a.setLive(cur, netip.Addr{}, portalloc.Address{})
		cur = ""
	}
}

// firstSteps runs before the workers, without faults and with room in the
// pool and the range, so that what they do is certain, whatever the timing:
//
//   - the first attachment, first-<index>: ipam-ring and portmap-ingress ADD
//     (Race: a static address and port, at the barriers), kept live to the
//     end; a failure of either is reported as an error of the suite;
//   - an ADD of each plugin for held-<index> whose configuration is never
//     written to its stdin: it waits for it, so the SIGKILL sent then ends
//     it for sure (a kill mid-ADD, if an early one); then held-<index> is
//     DELed, as a runtime does after a failed ADD.
func (a *agent) firstSteps() {
	client := a.cfg.Index*100 + 99
	id := fmt.Sprintf("first-%d", a.cfg.Index)
	var env, portEnv []string
	timeout := map[string]any{"timeout": firstTimeout.String()}
	if r := a.cfg.Race; r != nil {
		env = []string{"CNI_ARGS=IP=" + r.IP.String(), "RINGIPAM_CHAOS_BARRIER=" + r.AddrBarrier}
		portEnv = []string{"RINGIPAM_CHAOS_BARRIER=" + r.PortBarrier}
		timeout["runtimeConfig"] = map[string]any{"portMappings": []map[string]any{
			{"hostPort": r.HostPort, "containerPort": containerPort, "protocol": "tcp", "mode": string(portalloc.Ingress)},
		}}
	}
	conf, err := withIPAMKeys(a.cfg.Conf, map[string]any{"timeout": firstTimeout.String()})
	var portConf []byte
	if err == nil {
		portConf, err = withKeys(a.cfg.PortConf, timeout)
	}
	if err != nil {
		a.emit(agentMsg{Err: "first attachment's configuration: " + err.Error()})
		return
	}
	c, res := a.run(client, false, "ADD", id, conf, nil, env, 0)
	if c.Outcome == outOK {
		pc, _ := a.run(client, true, "ADD", id, portConf, res, portEnv, 0)
		if pc.Outcome == outOK {
			a.setLive(id, c.Addr, pc.Port)
		} else {
			a.emit(agentMsg{Err: fmt.Sprintf("the first attachment %s: portmap-ingress ADD: %+v", id, pc)})
			a.delUntilDone(client, id)
		}
	} else {
		a.emit(agentMsg{Err: fmt.Sprintf("the first attachment %s: ipam-ring ADD: %+v", id, c)})
		a.delUntilDone(client, id)
	}

	held := fmt.Sprintf("held-%d", a.cfg.Index)
	for _, ports := range []bool{false, true} {
		if c, _ := a.run(client, ports, "ADD", held, nil, nil, nil, -1); !c.Killed {
			a.emit(agentMsg{Err: fmt.Sprintf("an ADD of %s held on its stdin was not killed: %+v", held, c)})
		}
	}
	a.delUntilDone(client, held)
}

// recent keeps how long a worker's last four successful ADDs of a plugin
// took.
type recent struct {
	took [4]time.Duration
	n    int
}

func (r *recent) add(c call) {
	r.took[r.n%len(r.took)] = max(time.Duration(c.Return-c.Call), time.Millisecond)
	r.n++
}

// shortest is the shortest of them, 20ms before the first.
func (r *recent) shortest() time.Duration {
	if r.n == 0 {
		return 20 * time.Millisecond
	}
	return slices.Min(r.took[:min(r.n, len(r.took))])
}

func (a *agent) setLive(id string, addr netip.Addr, port portalloc.Address) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if addr.IsValid() {
		a.live[id], a.ports[id] = addr, port
	} else {
		delete(a.live, id)
		delete(a.ports, id)
	}
}

// delUntilDone DELs id as a runtime DELs a conflist, in reverse order:
// portmap-ingress, then ipam-ring once portmap-ingress succeeded (libcni
// stops at the first plugin that fails), until both succeed, at most 8
// times with a growing pause. A container whose DELs all fail is gone for
// the runtime anyway: the final GC must release what it may still hold.
func (a *agent) delUntilDone(client int, id string) {
	for i := range 8 {
		if c, _ := a.invoke(client, true, "DEL", id, nil, false, 0); c.Outcome == outOK {
			if c, _ := a.invoke(client, false, "DEL", id, nil, false, 0); c.Outcome == outOK {
				return
			}
		}
		time.Sleep(time.Duration(i+1) * 200 * time.Millisecond)
	}
}

// invoke runs ipam-ring (ports false) or portmap-ingress once, records the
// call and returns it with the plugin's stdout. prev is portmap-ingress's
// prevResult (ADD only).
func (a *agent) invoke(client int, ports bool, command, id string, prev []byte, kill bool, killAfter time.Duration) (call, []byte) {
	conf := []byte(a.cfg.Conf)
	if ports {
		conf = a.cfg.PortConf
	}
	if !kill {
		killAfter = 0
	} else {
		killAfter = max(killAfter, time.Nanosecond) // a delay of 0 drawn is a kill at once
	}
	return a.run(client, ports, command, id, conf, prev, nil, killAfter)
}

// run runs ipam-ring (ports false) or portmap-ingress once with conf (and
// prev as portmap-ingress's prevResult) and env added to the CNI
// environment, records the call and returns it with the plugin's stdout.
// killAfter > 0 SIGKILLs the plugin after that long; < 0 never writes conf
// to its stdin and SIGKILLs it while it waits for it.
func (a *agent) run(client int, ports bool, command, id string, conf, prev []byte, env []string, killAfter time.Duration) (call, []byte) {
	c := call{Client: client, Host: a.cfg.Host, Verb: strings.ToLower(command), Owner: "cni/" + id}
	plugin := a.cfg.Plugin
	if ports {
		var extra map[string]any
		if prev != nil {
			extra = map[string]any{"prevResult": json.RawMessage(prev)}
		}
		var err error
		plugin = a.cfg.PortPlugin
		if conf, err = withKeys(conf, extra); err != nil {
			c.Outcome, c.Unclear = outFailed, "portmap-ingress configuration: "+err.Error()
			a.emit(agentMsg{Port: &c})
			return c, nil
		}
	}
	inv := a.exec(plugin, command, id, conf, env, killAfter)
	c.Call, c.Return = inv.call, inv.ret
	inv.classify(&c, ports)
	if c.Unclear != "" && inv.stderr != "" {
		c.Unclear += "; stderr: " + inv.stderr
	}
	if c.Killed {
		a.kills.Add(1)
	}
	if ports {
		a.emit(agentMsg{Port: &c})
	} else {
		a.emit(agentMsg{Call: &c})
	}
	return c, inv.stdout
}

// withKeys returns the JSON object conf with the keys of extra set.
func withKeys(conf json.RawMessage, extra map[string]any) ([]byte, error) {
	if len(extra) == 0 {
		return conf, nil
	}
	var m map[string]any
	if err := json.Unmarshal(conf, &m); err != nil {
		return nil, err
	}
	maps.Copy(m, extra)
	return json.Marshal(m)
}

// withIPAMKeys returns the network configuration conf with the keys of
// extra set in its "ipam" object.
func withIPAMKeys(conf json.RawMessage, extra map[string]any) ([]byte, error) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(conf, &m); err != nil {
		return nil, err
	}
	ipam, err := withKeys(m["ipam"], extra)
	if err != nil {
		return nil, err
	}
	m["ipam"] = ipam
	return json.Marshal(m)
}

// invocation is what one run of the plugin did.
type invocation struct {
	stdout    []byte // the result or the CNI error
	stderr    string // kept for unclear failures
	call, ret int64  // monotonic nanoseconds
	err       error  // from starting or waiting for the process
	status    syscall.WaitStatus
	killed    bool // our mid-call SIGKILL ended it
	overran   bool // it ran past CallLimit and was killed for that
}

// exec runs plugin with the CNI environment (and env) for command on
// container id, feeding conf on stdin, and SIGKILLs it after killAfter when
// that is > 0, or when it runs past CallLimit. With killAfter < 0, conf is
// never written: the plugin waits for its stdin and is SIGKILLed at once.
func (a *agent) exec(plugin, command, id string, conf []byte, env []string, killAfter time.Duration) invocation {
	cmd := exec.Command(plugin)
	cmd.Env = append([]string{
		"CNI_COMMAND=" + command, "CNI_CONTAINERID=" + id, "CNI_NETNS=" + a.cfg.Netns,
		"CNI_IFNAME=eth0", "CNI_PATH=" + filepath.Dir(plugin), "PATH=/usr/sbin:/usr/bin:/sbin:/bin",
	}, env...)
	var held io.WriteCloser // the held call's stdin, open until it is dead
	if killAfter < 0 {
		var err error
		if held, err = cmd.StdinPipe(); err != nil {
			return invocation{err: err}
		}
		defer held.Close()
		killAfter = 0
	} else {
		cmd.Stdin = bytes.NewReader(conf)
	}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	inv := invocation{call: monotonic()}
	if inv.err = cmd.Start(); inv.err != nil {
		inv.ret = monotonic()
		return inv
	}
	kill := killAfter > 0 || held != nil
	// A flag is set before its signal is sent: the process may die and
	// Wait return before Signal does.
	var sentKill, sentLimit atomic.Bool
	sigkill := func(sent *atomic.Bool) func() {
		return func() {
			sent.Store(true)
			if cmd.Process.Signal(syscall.SIGKILL) != nil {
				sent.Store(false) // it had exited already
			}
		}
	}
	if kill {
		t := time.AfterFunc(killAfter, sigkill(&sentKill))
		defer t.Stop()
	}
	limit := time.AfterFunc(a.cfg.CallLimit, sigkill(&sentLimit))
	defer limit.Stop()
	inv.err = cmd.Wait()
	inv.ret = monotonic()
	if cmd.ProcessState != nil {
		inv.status, _ = cmd.ProcessState.Sys().(syscall.WaitStatus)
	}
	// A kill that reached a process already exiting changes nothing: only
	// a death by SIGKILL counts.
	byKill := inv.status.Signaled() && inv.status.Signal() == syscall.SIGKILL
	inv.overran = byKill && sentLimit.Load()
	inv.killed = byKill && sentKill.Load() && !inv.overran
	inv.stdout, inv.stderr = stdout.Bytes(), stderr.String()
	return inv
}

// classify fills in c's outcome from what the plugin process did; ports
// tells a portmap-ingress call, whose ADD result must also list the one
// published port.
func (inv invocation) classify(c *call, ports bool) {
	ws := inv.status
	switch {
	case inv.overran:
		c.Outcome, c.Unclear, c.Msg = outAmbiguous, "overran the call limit (the plugin's own timeout did not end it)", "killed at the call limit"
		return
	case inv.killed:
		c.Outcome, c.Killed, c.Msg = outAmbiguous, true, "SIGKILLed mid-call"
		return
	case inv.err == nil:
		c.Outcome = outOK
		if c.Verb == verbAdd {
			var res struct {
				IPs []struct {
					Address string `json:"address"`
				} `json:"ips"`
				// portmap-ingress's key beside the CNI result.
				PortMappings []struct {
					HostPort uint16 `json:"hostPort"`
					Protocol string `json:"protocol"`
					Mode     string `json:"mode"`
				} `json:"portMappings"`
			}
			if jerr := json.Unmarshal(inv.stdout, &res); jerr != nil || len(res.IPs) != 1 {
				c.Outcome, c.Unclear = outAmbiguous, fmt.Sprintf("ADD succeeded without one address in its result: %q", inv.stdout)
				return
			}
			p, perr := netip.ParsePrefix(res.IPs[0].Address)
			if perr != nil {
				c.Outcome, c.Unclear = outAmbiguous, fmt.Sprintf("ADD result address %q: %v", res.IPs[0].Address, perr)
				return
			}
			c.Addr = p.Addr()
			if ports {
				if len(res.PortMappings) != 1 || res.PortMappings[0].HostPort == 0 || res.PortMappings[0].Mode != string(portalloc.Ingress) {
					c.Outcome, c.Unclear = outAmbiguous, fmt.Sprintf("ADD succeeded without one published ingress port in its result: %q", inv.stdout)
					return
				}
				c.Port = portalloc.Address{Protocol: res.PortMappings[0].Protocol, Number: res.PortMappings[0].HostPort}
			}
		}
		return
	}
	var ee *exec.ExitError
	if !errors.As(inv.err, &ee) {
		c.Outcome, c.Unclear = outFailed, "plugin did not run: "+inv.err.Error()
		return
	}
	if ws.Signaled() {
		c.Outcome, c.Unclear = outAmbiguous, "plugin died of "+ws.Signal().String()
		return
	}
	var cniErr struct {
		Code uint   `json:"code"`
		Msg  string `json:"msg"`
	}
	if jerr := json.Unmarshal(inv.stdout, &cniErr); jerr != nil || cniErr.Code == 0 {
		c.Outcome, c.Unclear = outAmbiguous, fmt.Sprintf("exit %d without a CNI error on stdout: %q", ws.ExitStatus(), inv.stdout)
		return
	}
	c.Code, c.Msg = cniErr.Code, cniErr.Msg
	if cniErr.Code == 11 {
		c.Outcome = outAmbiguous
	} else {
		c.Outcome = outFailed
	}
	if !clearCodes[cniErr.Code] {
		c.Unclear = fmt.Sprintf("CNI code %d", cniErr.Code)
	}
}

// gc runs each plugin's GC (CNI 1.1) with the live attachments as
// cni.dev/valid-attachments, portmap-ingress first (the conflist in
// reverse), retrying a failure a few times, then reads the forwards left in
// the host's nftables table.
func (a *agent) gc() *gcReport {
	valid := []map[string]string{}
	for id := range a.live {
		valid = append(valid, map[string]string{"containerID": id, "ifname": "eth0"})
	}
	extra := map[string]any{"cni.dev/valid-attachments": valid}
	ports := a.gcOne(a.cfg.PortPlugin, a.cfg.PortConf, extra)
	r := a.gcOne(a.cfg.Plugin, a.cfg.Conf, extra)
	r.Ports = ports
	var err error
	if r.Forwards, err = forwards(); err != nil {
		r.ForwardsErr = err.Error()
	}
	return r
}

func (a *agent) gcOne(plugin string, conf json.RawMessage, extra map[string]any) *gcReport {
	b, err := withKeys(conf, extra)
	if err != nil {
		return &gcReport{Msg: err.Error()}
	}
	r := &gcReport{}
	for r.Attempts < 5 {
		r.Attempts++
		inv := a.exec(plugin, "GC", "", b, nil, 0)
		if inv.err == nil {
			r.OK, r.Msg = true, ""
			return r
		}
		r.Msg = fmt.Sprintf("%v: %s", inv.err, inv.stdout)
		time.Sleep(time.Second)
	}
	return r
}

// forwards reads portmap-ingress's nftables table in this namespace: the
// forwards installed, by attachment mark (its own reader, as CHECK and GC
// use it).
func forwards() (map[string][]portmap.Rule, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dp, err := portmap.NewNFT(portmap.DefaultTable)
	if err != nil {
		return nil, err
	}
	return dp.Marks(ctx)
}
