package testenv

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"time"
)

// Proc is a long-running process a test started (a Kubernetes component,
// containerd), its output appended to a log file.
type Proc struct {
	Name string
	Cmd  *exec.Cmd
	Log  string
	// Exited is closed once the process has exited (Err is valid then).
	Exited chan struct{}
	Err    error
}

// StartProc starts cmd as name, its stdout and stderr appended to log.
func StartProc(name, log string, cmd *exec.Cmd) (*Proc, error) {
	p := &Proc{Name: name, Cmd: cmd, Log: log, Exited: make(chan struct{})}
	f, err := os.OpenFile(log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	cmd.Stdout, cmd.Stderr = f, f
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting %s: %w", name, err)
	}
	go func() { p.Err = cmd.Wait(); close(p.Exited) }()
	return p, nil
}

// ExitErr is non-nil once the process has exited.
func (p *Proc) ExitErr() error {
	select {
	case <-p.Exited:
		return fmt.Errorf("%s exited: %v", p.Name, p.Err)
	default:
		return nil
	}
}

// Stop sends SIGTERM and waits at most timeout, then kills; it reports
// whether the process ended on SIGTERM (or had ended already). Stopping
// twice, or a nil Proc, is harmless.
func (p *Proc) Stop(timeout time.Duration) bool {
	if p == nil {
		return true
	}
	select {
	case <-p.Exited:
		return true
	default:
	}
	_ = p.Cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.Exited:
		return true
	case <-time.After(timeout):
		_ = p.Cmd.Process.Kill()
		<-p.Exited
		return false
	}
}

// Tail is the last n lines of the process's output, under its name.
func (p *Proc) Tail(n int) string {
	b, _ := os.ReadFile(p.Log)
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return p.Name + " (log tail):\n" + strings.Join(lines, "\n")
}
