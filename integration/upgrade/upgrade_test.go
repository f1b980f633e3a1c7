//go:build integration

package upgrade_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ringipam/ringipam/integration/cnitest"
	"github.com/ringipam/ringipam/integration/netns"
	"github.com/ringipam/ringipam/internal/testenv"
	"github.com/ringipam/ringipam/pkg/agentapi"
)

const (
	hostCount = 3
	subnet    = "198.18.96.0/22"
	// liveMax: a host's driver keeps at most this many containers; each
	// new one beyond it deletes the oldest (a cycle).
	liveMax = 3
	// cyclesPerPhase: after each restart every host completes this many
	// cycles (ADD and DEL, ports published) before the next restart.
	cyclesPerPhase = 2
	// patience bounds every wait (a call retried on 11, an agent's start
	// and stop, a phase's cycles, the drain of the DEL queues).
	patience = 90 * time.Second
	// callTimeout bounds one plugin invocation.
	callTimeout = 60 * time.Second
)

// host is one simulated node: a network namespace for its agent (the
// agent's nftables of portmap-ingress and of ingress forwards stay in it),
// a socket and a DEL queue, and the version its agent and plugins run.
type host struct {
	name, addr  string
	ns          *netns.NS
	endpoint    string // etcd, through a relay inside ns
	prefix      string
	sock, queue string
	mu          sync.Mutex
	ver         version
	cmd         *exec.Cmd
	done        chan struct{}
	log         cnitest.SyncBuffer
	cycles      int // completed by the driver
	tryAgain    int // calls answered 11 (and retried)
}

// store is the plugins' store object on this host.
func (h *host) store() map[string]any {
	return map[string]any{"type": "etcd", "endpoints": []string{h.endpoint}, "prefix": h.prefix,
		"agentSocket": h.sock, "delQueue": h.queue}
}

func (h *host) current() version {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.ver
}

// start runs v's agent (and from now on v's plugins) and waits until its
// socket answers.
func (h *host) start(t *testing.T, v version) {
	t.Helper()
	h.mu.Lock()
	defer h.mu.Unlock()
	cmd := exec.Command(v.agent, "--host", h.name, "--addr", h.addr, "--store", "etcd", "--etcd-endpoints", h.endpoint,
		"--etcd-prefix", h.prefix, "--agent-socket", h.sock, "--del-queue", h.queue,
		"--listen", "off", "--ingress=true", "--log-level", "warn")
	cmd.Stdout, cmd.Stderr = &h.log, &h.log
	fmt.Fprintf(&h.log, "--- %s: starting %s\n", time.Now().Format(time.TimeOnly), v.name)
	if err := h.ns.Do(cmd.Start); err != nil {
		t.Fatalf("%s: starting the %s agent: %v", h.name, v.name, err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	h.cmd, h.done, h.ver = cmd, done, v
	deadline := time.Now().Add(patience)
	for {
		c, err := net.DialTimeout("unix", h.sock, time.Second)
		if err == nil {
			c.Close()
			return
		}
		select {
		case <-done:
			h.cmd = nil
			t.Fatalf("%s: the %s agent exited before serving (%v):\n%s", h.name, v.name, cmd.ProcessState, h.log.String())
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: the %s agent did not serve %s within %v:\n%s", h.name, v.name, h.sock, patience, h.log.String())
		}
	}
}

// stop stops the agent with SIGTERM, as the kubelet stops the DaemonSet's
// pod, and fails the test unless it exits cleanly in time.
func (h *host) stop(t *testing.T) {
	t.Helper()
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.cmd == nil {
		return
	}
	cmd, done := h.cmd, h.done
	h.cmd = nil
	select {
	case <-done:
		t.Errorf("%s: the %s agent had exited by itself (%v):\n%s", h.name, h.ver.name, cmd.ProcessState, h.log.String())
		return
	default:
	}
	_ = cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-done:
	case <-time.After(patience):
		_ = cmd.Process.Kill()
		<-done
		t.Errorf("%s: the %s agent did not stop within %v of SIGTERM:\n%s", h.name, h.ver.name, patience, h.log.String())
		return
	}
	if !cmd.ProcessState.Success() {
		t.Errorf("%s: the %s agent exited badly on SIGTERM (%v):\n%s", h.name, h.ver.name, cmd.ProcessState, h.log.String())
	}
}

// cniError is a plugin's error result.
type cniError struct {
	Code uint   `json:"code"`
	Msg  string `json:"msg"`
	Det  string `json:"details"`
}

// callErr is a failed invocation: code is the CNI code the plugin
// printed, 0 when it printed none (an unclear failure).
type callErr struct {
	code uint
	text string
}

func (e *callErr) Error() string { return e.text }

// invoke runs plugin bin once with command for container id, as a runtime
// would, and returns its stdout.
func invoke(bin, command, id string, conf []byte) ([]byte, error) {
	ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin)
	cmd.Env = []string{"CNI_COMMAND=" + command, "CNI_CONTAINERID=" + id, "CNI_NETNS=/var/run/netns/upgrade-none",
		"CNI_IFNAME=eth0", "CNI_PATH=" + filepath.Dir(bin), "PATH=/usr/sbin:/usr/bin:/sbin:/bin"}
	cmd.Stdin = bytes.NewReader(conf)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		e := &callErr{text: fmt.Sprintf("%s %s %s: %v: %s %s", filepath.Base(bin), command, id, err,
			strings.Join(strings.Fields(out.String()), " "), strings.TrimSpace(errb.String()))}
		var ce cniError
		if json.Unmarshal(out.Bytes(), &ce) == nil {
			e.code = ce.Code
		}
		return nil, e
	}
	return out.Bytes(), nil
}

// ctr is a container the driver added.
type ctr struct {
	id    string
	h     *host
	addr  netip.Addr
	ipRes json.RawMessage
	mode  string // host or ingress
	ports []uint16
}

// ledger is every address and port held by a live container, and the
// findings of the run.
type ledger struct {
	mu       sync.Mutex
	addrs    map[netip.Addr]string
	ingress  map[uint16]string            // tcp port -> container
	hostMode map[uint16]map[string]string // tcp port -> host -> container
	findings []string
	retried  int // calls answered 11 and retried
	results  int // addresses handed out, all told
	// migrated is set when the first new agent starts: from then on an
	// old host's calls are refused with the layout's error (refused counts
	// them per host).
	migrated bool
	refused  map[string]int
}

// errRefused is an old host's call refused after the migration with the
// layout's error, as it must be.
var errRefused = errors.New("refused: the store has a newer layout")

// layoutRefusal reports whether a failed call of the old plugins is the
// refusal a migrated store answers them: the old code's ErrLayout (code
// 103, "the store has layout \"4\" ... upgrade ringipam"; the old agent
// serves each invocation with an allocator of its own, which reads the
// version first), or, from an allocator that read the version before the
// migration, the marker's text (code 999, "stored ring is corrupt:
// ParseAddr(\"store layout 4: ... upgrade ringipam\")").
func layoutRefusal(ce *callErr) bool {
	return (ce.code == 999 || ce.code == 103) && strings.Contains(ce.text, "upgrade ringipam") && strings.Contains(ce.text, "layout")
}

func newLedger() *ledger {
	return &ledger{addrs: map[netip.Addr]string{}, ingress: map[uint16]string{}, hostMode: map[uint16]map[string]string{}, refused: map[string]int{}}
}

func (l *ledger) find(format string, args ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.findings = append(l.findings, fmt.Sprintf(format, args...))
}

func (l *ledger) holdAddr(c *ctr) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.results++
	if other, ok := l.addrs[c.addr]; ok {
		l.findings = append(l.findings, fmt.Sprintf("duplicate: %s given to %s on %s (%s) while %s holds it", c.addr, c.id, c.h.name, c.h.current().name, other))
		return
	}
	l.addrs[c.addr] = c.id
}

func (l *ledger) holdPorts(c *ctr) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, p := range c.ports {
		if other, ok := l.ingress[p]; ok {
			l.findings = append(l.findings, fmt.Sprintf("duplicate: tcp port %d (%s) given to %s on %s while %s holds it in ingress mode", p, c.mode, c.id, c.h.name, other))
		}
		if c.mode == "ingress" {
			for hn, other := range l.hostMode[p] {
				l.findings = append(l.findings, fmt.Sprintf("duplicate: tcp port %d given in ingress mode to %s while %s holds it in host mode on %s", p, c.id, other, hn))
			}
			l.ingress[p] = c.id
			continue
		}
		if l.hostMode[p] == nil {
			l.hostMode[p] = map[string]string{}
		}
		if other, ok := l.hostMode[p][c.h.name]; ok {
			l.findings = append(l.findings, fmt.Sprintf("duplicate: tcp port %d given in host mode to %s on %s while %s holds it there", p, c.id, c.h.name, other))
		}
		l.hostMode[p][c.h.name] = c.id
	}
}

func (l *ledger) drop(c *ctr) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, p := range c.ports {
		if c.mode == "ingress" {
			delete(l.ingress, p)
		} else {
			delete(l.hostMode[p], c.h.name)
		}
	}
	delete(l.addrs, c.addr)
}

// call invokes the host's current plugin (ipam or portmap) until it
// succeeds, retrying while it answers 11 (its agent is restarting). Any
// other failure, or 11 for longer than patience, is a finding and returns
// an error.
func (l *ledger) call(h *host, plugin, command, id string, conf func(v version) []byte) ([]byte, error) {
	deadline := time.Now().Add(patience)
	for {
		v := h.current()
		bin := v.ipam
		if plugin == agentapi.PluginPortmap {
			bin = v.portmap
		}
		out, err := invoke(bin, command, id, conf(v))
		if err == nil {
			return out, nil
		}
		var ce *callErr
		l.mu.Lock()
		migrated := l.migrated
		l.mu.Unlock()
		switch {
		case errors.As(err, &ce) && v.name == oldVer.name && migrated && layoutRefusal(ce):
			l.mu.Lock()
			l.refused[h.name]++
			l.mu.Unlock()
			return nil, errRefused
		case !errors.As(err, &ce) || ce.code == 0:
			l.find("unclear failure, no CNI error (%s plugins on %s): %v", v.name, h.name, err)
			return nil, err
		case ce.code != 11:
			l.find("failed with CNI code %d, not 11 (%s plugins on %s): %v", ce.code, v.name, h.name, err)
			return nil, err
		}
		if time.Now().After(deadline) {
			l.find("still code 11 after %v (%s on %s): %v", patience, v.name, h.name, err)
			return nil, err
		}
		l.mu.Lock()
		l.retried++
		l.mu.Unlock()
		h.mu.Lock()
		h.tryAgain++
		h.mu.Unlock()
		time.Sleep(100 * time.Millisecond)
	}
}

const network = "upgrade-net"

func ipamConf(h *host) []byte {
	b, _ := json.Marshal(map[string]any{"cniVersion": "1.1.0", "name": network, "type": "bridge",
		"ipam": map[string]any{"type": "ipam-ring", "host": h.name, "store": h.store(), "timeout": "30s",
			"ranges": [][]map[string]string{{{"subnet": subnet}}}}})
	return b
}

func portmapConf(h *host, c *ctr, withPrev bool) []byte {
	m := map[string]any{"cniVersion": "1.1.0", "name": network, "type": "portmap-ingress", "host": h.name, "mode": "host",
		"store": h.store(), "timeout": "30s",
		"runtimeConfig": map[string]any{"portMappings": []map[string]any{{"hostPort": 0, "containerPort": 80, "protocol": "tcp", "mode": c.mode}}}}
	if withPrev {
		m["prevResult"] = c.ipRes
	}
	b, _ := json.Marshal(m)
	return b
}

// add adds container id on h: an address (ipam-ring), then a published
// port (portmap-ingress, prevResult the address).
func (l *ledger) add(h *host, id, mode string) (*ctr, error) {
	c := &ctr{id: id, h: h, mode: mode}
	out, err := l.call(h, agentapi.PluginIPAM, "ADD", id, func(version) []byte { return ipamConf(h) })
	if err != nil {
		return nil, err
	}
	var res struct {
		IPs []struct {
			Address string `json:"address"`
		} `json:"ips"`
	}
	if err := json.Unmarshal(out, &res); err != nil || len(res.IPs) != 1 {
		l.find("ADD %s on %s: result %s (%v), want one address", id, h.name, out, err)
		return nil, fmt.Errorf("bad result")
	}
	pfx, err := netip.ParsePrefix(res.IPs[0].Address)
	if err != nil {
		l.find("ADD %s on %s: address %q: %v", id, h.name, res.IPs[0].Address, err)
		return nil, err
	}
	c.addr, c.ipRes = pfx.Addr(), out
	l.holdAddr(c)
	out, err = l.call(h, agentapi.PluginPortmap, "ADD", id, func(version) []byte { return portmapConf(h, c, true) })
	if err != nil {
		return c, err
	}
	var pm struct {
		PortMappings []struct {
			HostPort uint16 `json:"hostPort"`
			Mode     string `json:"mode"`
		} `json:"portMappings"`
	}
	if err := json.Unmarshal(out, &pm); err != nil || len(pm.PortMappings) != 1 || pm.PortMappings[0].HostPort == 0 {
		l.find("portmap ADD %s on %s: result %s (%v), want one published port", id, h.name, out, err)
		return c, fmt.Errorf("bad result")
	}
	c.ports = []uint16{pm.PortMappings[0].HostPort}
	l.holdPorts(c)
	return c, nil
}

// del deletes c: its port, then its address, as a runtime runs a list's
// DEL in reverse order.
func (l *ledger) del(c *ctr) error {
	if _, err := l.call(c.h, agentapi.PluginPortmap, "DEL", c.id, func(version) []byte { return portmapConf(c.h, c, false) }); err != nil {
		return err
	}
	if _, err := l.call(c.h, agentapi.PluginIPAM, "DEL", c.id, func(version) []byte { return ipamConf(c.h) }); err != nil {
		return err
	}
	l.drop(c)
	return nil
}

// driver adds and deletes containers on every host until stopped, keeping
// at most liveMax per host; it returns the containers still live.
type driver struct {
	l    *ledger
	stop chan struct{}
	wg   sync.WaitGroup
	mu   sync.Mutex
	live map[*host][]*ctr
	gen  int // the driver's generation, in its container IDs
}

func (d *driver) run(h *host) {
	defer d.wg.Done()
	for n := 0; ; n++ {
		select {
		case <-d.stop:
			return
		default:
		}
		mode := "host"
		if n%2 == 1 {
			mode = "ingress"
		}
		c, err := d.l.add(h, fmt.Sprintf("%s-g%d-c%d", h.name, d.gen, n), mode)
		if c != nil {
			d.mu.Lock()
			d.live[h] = append(d.live[h], c)
			d.mu.Unlock()
		}
		if errors.Is(err, errRefused) {
			// An old host on a migrated store: it adds nothing until
			// its node is upgraded (its containers' DELs still work).
			select {
			case <-d.stop:
				return
			case <-time.After(100 * time.Millisecond):
			}
			continue
		}
		if err != nil {
			return // a finding: the test fails
		}
		d.mu.Lock()
		var oldest *ctr
		if len(d.live[h]) > liveMax {
			oldest, d.live[h] = d.live[h][0], d.live[h][1:]
		}
		d.mu.Unlock()
		if oldest != nil {
			err := d.l.del(oldest)
			if errors.Is(err, errRefused) {
				// Deleted once its node runs the new code (a runtime
				// retries a failed DEL).
				d.mu.Lock()
				d.live[h] = append([]*ctr{oldest}, d.live[h]...)
				d.mu.Unlock()
				continue
			}
			if err != nil {
				return
			}
		}
		h.mu.Lock()
		h.cycles++
		h.mu.Unlock()
	}
}

// restart replaces h's agent and plugins by v's, as a rolling update of
// the DaemonSet does: the agent stops; while none answers, a container is
// deleted through the plugins of the version going away (its DELs are
// queued) and the driver's next ADD on h fails with 11 (retried); then
// v's plugins and agent take over, and the agent runs the queue.
func (d *driver) restart(t *testing.T, h *host, v version) {
	t.Helper()
	h.mu.Lock()
	tried := h.tryAgain
	h.mu.Unlock()
	h.stop(t)
	d.mu.Lock()
	var c *ctr
	if len(d.live[h]) > 0 {
		c, d.live[h] = d.live[h][0], d.live[h][1:]
	}
	d.mu.Unlock()
	if c != nil {
		if err := d.l.del(c); err != nil {
			t.Fatalf("DEL of %s on %s with its agent stopped: %v, want it queued", c.id, h.name, err)
		}
		if n, err := (agentapi.DelQueue{Dir: h.queue}).Len(); err != nil || n == 0 {
			t.Fatalf("DEL of %s on %s with its agent stopped: %d queued (%v), want its DELs queued", c.id, h.name, n, err)
		}
	}
	deadline := time.Now().Add(patience)
	for {
		h.mu.Lock()
		n := h.tryAgain
		h.mu.Unlock()
		if n > tried {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: no call answered 11 within %v of its agent's stop", h.name, patience)
		}
		time.Sleep(20 * time.Millisecond)
	}
	h.start(t, v)
}

// cycles returns how many cycles each host completed.
func cycles(hosts []*host) []int {
	out := make([]int, len(hosts))
	for i, h := range hosts {
		h.mu.Lock()
		out[i] = h.cycles
		h.mu.Unlock()
	}
	return out
}

// settle waits until every host completed n more cycles than at since,
// failing the test when the driver found something or after patience.
func settle(t *testing.T, l *ledger, hosts []*host, since []int, n int, what string) {
	t.Helper()
	deadline := time.Now().Add(patience)
	for {
		l.mu.Lock()
		found := len(l.findings)
		l.mu.Unlock()
		if found > 0 {
			t.Fatalf("%s: the driver found trouble (see the findings)", what)
		}
		now, ok := cycles(hosts), true
		for i := range now {
			ok = ok && now[i] >= since[i]+n
		}
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: hosts completed %v cycles since %v within %v, want %d more each", what, now, since, patience, n)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestRollingRestart: hostCount hosts start on the pinned commit (layout
// 3); a driver adds and deletes containers on all of them, publishing a
// port each (host and ingress modes in turn). Subtest "old to new": one
// host at a time, the agent and plugins are replaced by the working
// tree's. The first new agent migrates the store to layout 4 while the
// old agents run: from then on every old host's ADD and DEL fails with
// the layout's error and nothing else (each host is seen to; its
// containers are deleted once it runs the new code, as a runtime retries
// a failed DEL), and the new hosts work (mixed versions on one etcd; README, "Version skew": the
// rollout must finish). Subtest "old code refuses the migrated store": one
// host goes back to the old code (a rollback): its calls fail with the
// layout's error and nothing else, then it goes forward again. At the end
// every container is deleted: no address or port was ever held twice, the
// DEL queues are drained with nothing in failed/, ringctl (new) lists no
// address and no port, and its check is clean.
func TestRollingRestart(t *testing.T) {
	netns.RequireRoot(t)
	etcd := testenv.StartEtcd(t)
	prefix := "/" + netns.Unique("upg-") + "/"
	var hosts []*host
	for i := range hostCount {
		dir, err := os.MkdirTemp("", "rup") // short: a socket path has at most 107 bytes
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.RemoveAll(dir) })
		ns := netns.New(t, "upg")
		h := &host{name: fmt.Sprintf("up-%c", 'a'+i), addr: fmt.Sprintf("198.18.99.%d", i+1), ns: ns, prefix: prefix,
			endpoint: "http://" + ns.Relay(t, strings.TrimPrefix(etcd.Endpoints()[0], "http://")),
			sock:     filepath.Join(dir, "agent.sock"), queue: filepath.Join(dir, "del-queue")}
		hosts = append(hosts, h)
		t.Cleanup(func() {
			h.stop(t)
			if t.Failed() {
				t.Logf("%s agent output (all runs):\n%s", h.name, h.log.String())
			}
		})
		h.start(t, oldVer)
	}

	l := newLedger()
	var d *driver
	stopped := true
	startDriver := func(gen int) {
		d = &driver{l: l, stop: make(chan struct{}), live: map[*host][]*ctr{}, gen: gen}
		stopped = false
		for _, h := range hosts {
			d.wg.Add(1)
			go d.run(h)
		}
	}
	stopDriver := func() {
		if !stopped {
			stopped = true
			close(d.stop)
			d.wg.Wait()
		}
	}
	defer func() {
		stopDriver()
		l.mu.Lock()
		defer l.mu.Unlock()
		for _, f := range l.findings {
			t.Error(f)
		}
		t.Logf("%d addresses handed out, %d calls answered 11 and retried", l.results, l.retried)
	}()
	base := []string{"--store", "etcd", "--etcd-endpoints", etcd.Endpoints()[0], "--etcd-prefix", prefix, "--host", "admin"}
	ringctl := func(args ...string) (string, int) {
		ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
		defer cancel()
		cmd := exec.CommandContext(ctx, ringctlBin, append(base, args...)...)
		var out, errb bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &errb
		err := cmd.Run()
		var ee *exec.ExitError
		if err != nil && !errors.As(err, &ee) {
			t.Fatalf("ringctl %v: %v", args, err)
		}
		return out.String() + errb.String(), cmd.ProcessState.ExitCode()
	}
	// finish stops the driver, deletes every container it left, waits for
	// the DEL queues and checks that nothing is left: ringctl (new) lists
	// no address and no port and its check is clean.
	finish := func(t *testing.T) {
		t.Helper()
		stopDriver()
		for h, cs := range d.live {
			for _, c := range cs {
				if err := l.del(c); err != nil {
					t.Errorf("deleting %s on %s at the end: %v", c.id, h.name, err)
				}
			}
		}
		for _, h := range hosts {
			q := agentapi.DelQueue{Dir: h.queue}
			deadline := time.Now().Add(patience)
			for {
				n, err := q.Len()
				if err != nil {
					t.Fatal(err)
				}
				if n == 0 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("%s: %d DELs still queued after %v", h.name, n, patience)
				}
				time.Sleep(50 * time.Millisecond)
			}
			if des, err := os.ReadDir(filepath.Join(h.queue, agentapi.FailedDir)); err == nil && len(des) > 0 {
				t.Errorf("%s: %d queued DELs moved to %s (never run: leaked)", h.name, len(des), agentapi.FailedDir)
			}
		}
		for _, what := range []string{"ls", "ports"} {
			out, code := ringctl("--json", what)
			var rows []json.RawMessage
			if code != 0 || json.Unmarshal([]byte(out), &rows) != nil || len(rows) != 0 {
				t.Errorf("ringctl --json %s once every container is deleted (exit %d): %s; want nothing listed", what, code, out)
			}
		}
		if out, code := ringctl("check"); code != 0 || !strings.HasPrefix(out, "ok:") {
			t.Errorf("ringctl check (exit %d):\n%s", code, out)
		}
	}

	startDriver(0)
	settle(t, l, hosts, cycles(hosts), cyclesPerPhase, "all hosts on "+oldVer.name)
	// newHosts are the hosts on the new code (settle waits for them only
	// once the store is migrated: the old ones add nothing then).
	onNew := func() []*host {
		var out []*host
		for _, h := range hosts {
			if h.current().name == newVer.name {
				out = append(out, h)
			}
		}
		return out
	}
	// refusedOnOld waits until every old host's ADD was refused with the
	// layout's error at least once more than at since.
	refusedOnOld := func(t *testing.T, since map[string]int, what string) {
		t.Helper()
		deadline := time.Now().Add(patience)
		for {
			l.mu.Lock()
			ok, found := true, len(l.findings)
			for _, h := range hosts {
				if h.current().name == oldVer.name && l.refused[h.name] <= since[h.name] {
					ok = false
				}
			}
			l.mu.Unlock()
			if found > 0 {
				t.Fatalf("%s: the driver found trouble (see the findings)", what)
			}
			if ok {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: an old host's ADD was not refused with the layout's error within %v (refused %v)", what, patience, l.refused)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	refusals := func() map[string]int {
		l.mu.Lock()
		defer l.mu.Unlock()
		out := map[string]int{}
		for k, v := range l.refused {
			out[k] = v
		}
		return out
	}
	t.Run("old to new", func(t *testing.T) {
		for i, h := range hosts {
			since := cycles(hosts)
			before := refusals()
			if i == 0 {
				l.mu.Lock()
				l.migrated = true // the new agent migrates the store as it starts
				l.mu.Unlock()
			}
			d.restart(t, h, newVer)
			settle(t, l, onNew(), pick(since, hosts, onNew()), cyclesPerPhase, h.name+" restarted onto "+newVer.name)
			refusedOnOld(t, before, h.name+" restarted onto "+newVer.name)
		}
		if v, code := ringctl("check"); code != 0 || !strings.HasPrefix(v, "ok:") {
			t.Errorf("ringctl check once every host runs the new code (exit %d):\n%s", code, v)
		}
		// A rollout forward leaves nothing behind, with no repair.
		finish(t)
	})
	if t.Failed() {
		return
	}
	t.Run("old code refuses the migrated store", func(t *testing.T) {
		startDriver(1)
		h := hosts[0]
		before := refusals()
		d.restart(t, h, oldVer)
		refusedOnOld(t, before, h.name+" rolled back to "+oldVer.name)
		since := cycles(hosts)
		d.restart(t, h, newVer)
		settle(t, l, hosts, since, cyclesPerPhase, h.name+" forward again to "+newVer.name)
		finish(t)
	})
}

// pick returns the cycle counts of since (of all hosts, in order) for the
// hosts of sub.
func pick(since []int, all, sub []*host) []int {
	var out []int
	for _, s := range sub {
		for i, h := range all {
			if h == s {
				out = append(out, since[i])
			}
		}
	}
	return out
}
