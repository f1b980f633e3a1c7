//go:build integration

package cnitest

import (
	"bytes"
	"context"
	"fmt"
	"maps"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ringipam/ringipam/integration/netns"
)

// The host agent (ringipamd) of a test's etcd store.
//
// On an etcd store the plugins do not reach etcd themselves: they send
// their invocations to the host agent's unix socket (the store object's
// "agentSocket"). StartAgent runs the real ringipamd binary, built from
// this checkout once per test binary, for one store (endpoints + prefix)
// and one host name, in the plugin's network namespace when asked, with a
// socket and a DEL queue of its own; Agent.Store puts them into the
// plugin's store object.

// AgentTimeout bounds an agent's start (until its socket answers) and its
// stop (until the process has exited).
const AgentTimeout = 60 * time.Second

var (
	agentOnce sync.Once
	agentBin  string
	agentErr  error
	// agentDelQueue says the built agent takes --del-queue (the DEL queue
	// of package agentapi); the store object then names the queue too.
	agentDelQueue bool
)

// AgentBin returns bin/ringipamd built from this checkout (once, beside
// IPAMBin), failing t if the build fails.
func AgentBin(t testing.TB) string {
	t.Helper()
	agentOnce.Do(func() {
		agentBin = filepath.Join(filepath.Dir(IPAMBin), "ringipamd")
		ctx, cancel := context.WithTimeout(context.Background(), BuildTimeout)
		defer cancel()
		if agentErr = Build(ctx, agentBin, "./cmd/ringipamd"); agentErr != nil {
			return
		}
		help, _ := exec.CommandContext(ctx, agentBin, "-h").CombinedOutput()
		agentDelQueue = bytes.Contains(help, []byte("-del-queue"))
	})
	if agentErr != nil {
		t.Fatalf("building ringipamd: %v", agentErr)
	}
	return agentBin
}

// AgentOptions says which store and host an agent serves and where it runs.
type AgentOptions struct {
	// Endpoints and Prefix name the etcd store, as the plugin's store
	// object does (the endpoints as seen from NS).
	Endpoints []string
	Prefix    string
	// Host is the host name the plugins' configurations use.
	Host string
	// NS is the network namespace the plugins run in (nil: the test's
	// own); the agent runs there too.
	NS *netns.NS
	// Args are more flags, after the defaults (a later flag wins):
	// "--sweep=true", "--listen", addr, "--etcd-request-timeout", "2s", ...
	Args []string
}

// Agent is one ringipamd process serving a test's store (restartable).
type Agent struct {
	// Socket is the agent's unix socket; DelQueue its DEL queue directory.
	Socket, DelQueue string
	// Name says which agent this is in the test's messages.
	Name string

	ns   *netns.NS
	argv []string

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{} // closed when cmd has exited
	log  SyncBuffer
}

// StartAgent starts ringipamd for o (--ingress=false --sweep=false
// --listen off unless o.Args says otherwise) with a fresh socket and DEL
// queue, and returns once the socket accepts connections (the test fails
// after AgentTimeout). The agent is stopped when the test ends, and the
// test fails if it exited with an error.
func StartAgent(t testing.TB, o AgentOptions) *Agent {
	t.Helper()
	bin := AgentBin(t)
	// A short directory: a unix socket's path is limited to 107 bytes.
	dir, err := os.MkdirTemp("", "ra")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	a := &Agent{Socket: filepath.Join(dir, "agent.sock"), DelQueue: filepath.Join(dir, "del-queue"), ns: o.NS,
		Name: fmt.Sprintf("ringipamd %s on %s%s", o.Host, strings.Join(o.Endpoints, ","), o.Prefix)}
	a.argv = []string{bin, "--host", o.Host, "--store", "etcd", "--etcd-endpoints", strings.Join(o.Endpoints, ","),
		"--store-prefix", o.Prefix, "--store-socket", a.Socket,
		"--ingress=false", "--sweep=false", "--listen", "off", "--status-refresh", "1h", "--log-level", "warn"}
	if agentDelQueue {
		a.argv = append(a.argv, "--del-queue", a.DelQueue)
	}
	a.argv = append(a.argv, o.Args...)
	t.Cleanup(func() {
		a.Stop(t)
		if t.Failed() {
			t.Logf("%s output:\n%s", a.Name, a.log.String())
		}
	})
	a.Start(t)
	return a
}

// Store returns a copy of the store object obj that sends the plugins to
// this agent (agentSocket, and delQueue when the agent has one).
func (a *Agent) Store(obj map[string]any) map[string]any {
	c := maps.Clone(obj)
	c["agentSocket"] = a.Socket
	if agentDelQueue {
		c["delQueue"] = a.DelQueue
	}
	return c
}

// Start starts the agent (again, after Stop or Kill) and waits until its
// socket accepts connections.
func (a *Agent) Start(t testing.TB) {
	t.Helper()
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.cmd != nil {
		t.Fatalf("%s is already running", a.Name)
	}
	cmd := exec.Command(a.argv[0], a.argv[1:]...)
	cmd.Stdout, cmd.Stderr = &a.log, &a.log
	start := cmd.Start
	var err error
	if a.ns != nil {
		// Started from a thread inside the namespace, the agent lives there.
		err = a.ns.Do(start)
	} else {
		err = start()
	}
	if err != nil {
		t.Fatalf("starting %s: %v", a.Name, err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	a.cmd, a.done = cmd, done
	deadline := time.Now().Add(AgentTimeout)
	for {
		c, err := net.DialTimeout("unix", a.Socket, time.Second)
		if err == nil {
			c.Close()
			return
		}
		select {
		case <-done:
			a.cmd = nil
			t.Fatalf("%s exited before serving %s (%v):\n%s", a.Name, a.Socket, cmd.ProcessState, a.log.String())
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s did not answer on %s within %v: %v\n%s", a.Name, a.Socket, AgentTimeout, err, a.log.String())
		}
	}
}

// Stop stops the agent (SIGTERM) and waits for it to exit, failing the test
// if it does not within AgentTimeout or exits with an error. Stopping a
// stopped agent does nothing.
func (a *Agent) Stop(t testing.TB) {
	t.Helper()
	a.end(t, syscall.SIGTERM)
}

// Kill kills the agent (SIGKILL), as a crash would, and waits for it to go.
func (a *Agent) Kill(t testing.TB) {
	t.Helper()
	a.end(t, syscall.SIGKILL)
}

func (a *Agent) end(t testing.TB, sig syscall.Signal) {
	t.Helper()
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.cmd == nil {
		return
	}
	cmd, done := a.cmd, a.done
	a.cmd = nil
	select {
	case <-done:
		t.Errorf("%s had exited by itself (%v):\n%s", a.Name, cmd.ProcessState, a.log.String())
		return
	default:
	}
	_ = cmd.Process.Signal(sig)
	select {
	case <-done:
	case <-time.After(AgentTimeout):
		_ = cmd.Process.Kill()
		<-done
		t.Errorf("%s did not stop within %v of %v:\n%s", a.Name, AgentTimeout, sig, a.log.String())
		return
	}
	if sig == syscall.SIGTERM && !cmd.ProcessState.Success() {
		t.Errorf("%s exited badly on SIGTERM (%v):\n%s", a.Name, cmd.ProcessState, a.log.String())
	}
}

// Running returns nil while the agent runs, else an error saying how it
// ended (or that it was stopped).
func (a *Agent) Running() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.cmd == nil {
		return fmt.Errorf("%s is stopped", a.Name)
	}
	select {
	case <-a.done:
		return fmt.Errorf("%s exited (%v):\n%s", a.Name, a.cmd.ProcessState, a.log.String())
	default:
		return nil
	}
}

// Log returns what the agent wrote so far (all its runs).
func (a *Agent) Log() string { return a.log.String() }

// SyncBuffer is a bytes.Buffer for a process's output, safe to read while
// the process writes it.
type SyncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *SyncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *SyncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
