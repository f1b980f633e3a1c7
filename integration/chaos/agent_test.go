//go:build integration

package chaos

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// A host agent is this test binary run again (agentEnv set) inside a host's
// network namespace and a UTS namespace of its own, whose host name it sets:
// one "host" of the cluster, as a separate process with its own name. It
// runs Workers workers, each calling the real plugin binary once per ADD or
// DEL with the CNI environment, as a container runtime does, and writes one
// JSON line per call to stdout. It obeys two commands on stdin: "stop"
// (finish the calls in progress, then report the attachments still live)
// and "gc" (run the plugin's GC with exactly those attachments, report,
// exit).
const agentEnv = "RINGIPAM_CHAOS_AGENT"

// agentConfig is the agent's whole configuration, passed as JSON in agentEnv.
type agentConfig struct {
	Host    string          `json:"host"`
	Index   int             `json:"index"`
	Plugin  string          `json:"plugin"`
	Conf    json.RawMessage `json:"conf"`  // the network configuration (CNI 1.1.0), without "host": the plugin uses the host name
	Netns   string          `json:"netns"` // CNI_NETNS of the calls
	Workers int             `json:"workers"`
	// KillRate is the probability that a new container's ADD is SIGKILLed,
	// after a delay drawn uniformly from [0, d) where d is how long the
	// worker's last successful ADD took: mid-ADD, whatever the load.
	KillRate float64 `json:"killRate"`
	// CallLimit bounds one invocation; one that runs longer (the plugin
	// overran its own timeout) is killed and reported as unclear.
	CallLimit time.Duration `json:"callLimit"`
	Seed      uint64        `json:"seed"`
}

// agentMsg is one line of an agent's stdout.
type agentMsg struct {
	Call *call      `json:"call,omitempty"`
	Done *agentDone `json:"done,omitempty"`
	GC   *gcReport  `json:"gc,omitempty"`
	Err  string     `json:"err,omitempty"`
}

// agentDone lists the attachments that are live when the agent stopped:
// the runtime's true list for GC.
type agentDone struct {
	Live  map[string]netip.Addr `json:"live"` // container ID -> address
	Kills int                   `json:"kills"`
}

type gcReport struct {
	OK       bool   `json:"ok"`
	Attempts int    `json:"attempts"`
	Msg      string `json:"msg,omitempty"`
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
	a := &agent{cfg: cfg, out: json.NewEncoder(os.Stdout), live: map[string]netip.Addr{}}
	cmds := make(chan string, 4)
	go func() {
		sc := bufio.NewScanner(os.Stdin)
		for sc.Scan() {
			cmds <- strings.TrimSpace(sc.Text())
		}
		close(cmds) // the suite went away: stop, and exit after the report
	}()
	var wg sync.WaitGroup
	for w := range cfg.Workers {
		wg.Go(func() { a.work(w) })
	}
	if c := <-cmds; c != "stop" && c != "" {
		a.emit(agentMsg{Err: "unexpected command " + c})
	}
	a.stopping.Store(true)
	wg.Wait()
	a.emit(agentMsg{Done: &agentDone{Live: a.live, Kills: int(a.kills.Load())}})
	if c, ok := <-cmds; !ok || c != "gc" {
		return 0
	}
	a.emit(agentMsg{GC: a.gc()})
	return 0
}

type agent struct {
	cfg      agentConfig
	mu       sync.Mutex // guards out and live
	out      *json.Encoder
	live     map[string]netip.Addr
	stopping atomic.Bool
	kills    atomic.Int64
}

func (a *agent) emit(m agentMsg) {
	a.mu.Lock()
	defer a.mu.Unlock()
	_ = a.out.Encode(m)
}

// work is one worker: it keeps at most one attachment at a time. With none
// it ADDs a new container; with one it either ADDs it again (which must
// return the same address) or DELs it. After a failed ADD it DELs the
// container, as runtimes do, until a DEL succeeds (a bounded number of
// times). Container IDs are never reused.
func (a *agent) work(w int) {
	rng := rand.New(rand.NewPCG(a.cfg.Seed, uint64(w)))
	client := a.cfg.Index*100 + w
	n := 0
	var cur string
	lastAdd := 20 * time.Millisecond
	for !a.stopping.Load() {
		if cur == "" {
			n++
			id := fmt.Sprintf("c%d-w%d-%d", a.cfg.Index, w, n)
			kill := rng.Float64() < a.cfg.KillRate
			delay := time.Duration(rng.Int64N(int64(lastAdd)))
			c := a.invoke(client, "ADD", id, kill, delay)
			if c.Outcome == outOK {
				lastAdd = max(time.Duration(c.Return-c.Call), time.Millisecond)
				cur = id
				a.setLive(id, c.Addr)
				continue
			}
			a.delUntilDone(client, id)
			continue
		}
		if rng.Float64() < 0.25 {
			a.invoke(client, "ADD", cur, false, 0)
			continue
		}
		a.delUntilDone(client, cur)
		a.setLive(cur, netip.Addr{})
		cur = ""
	}
}

func (a *agent) setLive(id string, addr netip.Addr) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if addr.IsValid() {
		a.live[id] = addr
	} else {
		delete(a.live, id)
	}
}

// delUntilDone DELs id until a DEL succeeds, at most 8 times with a growing
// pause. A container whose DELs all fail is gone for the runtime anyway:
// the final GC must release what it may still hold.
func (a *agent) delUntilDone(client int, id string) {
	for i := range 8 {
		if a.invoke(client, "DEL", id, false, 0).Outcome == outOK {
			return
		}
		time.Sleep(time.Duration(i+1) * 200 * time.Millisecond)
	}
}

// invoke runs the plugin once, records the call and returns it.
func (a *agent) invoke(client int, command, id string, kill bool, killAfter time.Duration) call {
	c := call{Client: client, Host: a.cfg.Host, Verb: strings.ToLower(command), Owner: "cni/" + id}
	inv := a.exec(command, id, a.cfg.Conf, kill, killAfter)
	c.Call, c.Return = inv.call, inv.ret
	inv.classify(&c)
	if c.Unclear != "" && inv.stderr != "" {
		c.Unclear += "; stderr: " + inv.stderr
	}
	if c.Killed {
		a.kills.Add(1)
	}
	a.emit(agentMsg{Call: &c})
	return c
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

// exec runs the plugin with the CNI environment for command on container
// id, feeding conf on stdin, and SIGKILLs it after killAfter when kill is
// set, or when it runs past CallLimit.
func (a *agent) exec(command, id string, conf []byte, kill bool, killAfter time.Duration) invocation {
	cmd := exec.Command(a.cfg.Plugin)
	cmd.Env = []string{
		"CNI_COMMAND=" + command, "CNI_CONTAINERID=" + id, "CNI_NETNS=" + a.cfg.Netns,
		"CNI_IFNAME=eth0", "CNI_PATH=" + filepath.Dir(a.cfg.Plugin), "PATH=/usr/sbin:/usr/bin:/sbin:/bin",
	}
	cmd.Stdin = bytes.NewReader(conf)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	inv := invocation{call: monotonic()}
	if inv.err = cmd.Start(); inv.err != nil {
		inv.ret = monotonic()
		return inv
	}
	var sentKill, sentLimit atomic.Bool
	if kill {
		t := time.AfterFunc(killAfter, func() { sentKill.Store(cmd.Process.Signal(syscall.SIGKILL) == nil) })
		defer t.Stop()
	}
	limit := time.AfterFunc(a.cfg.CallLimit, func() { sentLimit.Store(cmd.Process.Signal(syscall.SIGKILL) == nil) })
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

// classify fills in c's outcome from what the plugin process did.
func (inv invocation) classify(c *call) {
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

// gc runs the plugin's GC (CNI 1.1) with the live attachments as
// cni.dev/valid-attachments, retrying a failure a few times.
func (a *agent) gc() *gcReport {
	var conf map[string]any
	if err := json.Unmarshal(a.cfg.Conf, &conf); err != nil {
		return &gcReport{Msg: err.Error()}
	}
	valid := []map[string]string{}
	for id := range a.live {
		valid = append(valid, map[string]string{"containerID": id, "ifname": "eth0"})
	}
	conf["cni.dev/valid-attachments"] = valid
	b, err := json.Marshal(conf)
	if err != nil {
		return &gcReport{Msg: err.Error()}
	}
	r := &gcReport{}
	for r.Attempts < 5 {
		r.Attempts++
		inv := a.exec("GC", "", b, false, 0)
		if inv.err == nil {
			r.OK, r.Msg = true, ""
			return r
		}
		r.Msg = fmt.Sprintf("%v: %s", inv.err, inv.stdout)
		time.Sleep(time.Second)
	}
	return r
}
