package relay

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// Whole invocations. Besides store calls, the agent's socket takes whole
// plugin invocations: the plugin sends its CNI command, its arguments and
// its stdin, and the agent runs the same verb with the same code on its
// own open store and answers with what the plugin would have printed. The
// plugin then does no store work at all: no file to open and map, no etcd
// connection to make. The agent decides whether it serves an invocation
// (its Invoker reads the plugin's configuration: same store, readable);
// when it does not, or nothing answers on the socket, the plugin runs the
// call itself.
//
// On the wire, one invocation per connection:
//
//	plugin: {"op":"invoke","timeoutMs":N,"invocation":{...}}
//	agent:  {"outcome":{"stdout":...,"error":...}}  or  {"error":{"kind":"refused",...}}
//
// N is the plugin's configured timeout, which the agent's Invoker reads
// from the configuration too: the agent runs an accepted invocation under
// that timeout, and cancels it when the plugin's connection closes first
// (the runtime killed the plugin), so that a plugin that is gone commits
// nothing it had not committed yet, as when it ran the call itself.

// dialTimeout bounds the connection to the agent: a local socket answers
// in microseconds or not at all.
const dialTimeout = time.Second

// Invocation is one plugin call as the plugin received it.
type Invocation struct {
	// Command is CNI_COMMAND: ADD, DEL, CHECK, GC or STATUS.
	Command     string `json:"command"`
	ContainerID string `json:"containerId,omitempty"`
	Netns       string `json:"netns,omitempty"`
	IfName      string `json:"ifName,omitempty"`
	// Args is CNI_ARGS.
	Args string `json:"args,omitempty"`
	// Path is CNI_PATH.
	Path string `json:"path,omitempty"`
	// Hostname is the plugin's hostname: the host name a configuration
	// without one means (the agent may run in another UTS namespace).
	Hostname string `json:"hostname,omitempty"`
	Stdin    []byte `json:"stdin"`
}

// Outcome is what an invocation printed: its result on stdout, or its
// CNI error object (which the plugin prints and exits 1 with).
type Outcome struct {
	Stdout []byte          `json:"stdout,omitempty"`
	Error  json.RawMessage `json:"error,omitempty"`
}

// An Invoker runs invocations for the server.
type Invoker interface {
	// Accept decides whether the agent serves inv. If it does, it returns
	// the function that runs it and the longest that may take (the
	// plugin's configured timeout); the server calls run at most once,
	// with a context that ends at that timeout or when the plugin goes
	// away. ok is false when inv is not the agent's (another store) or
	// cannot be read: the plugin then runs it itself and reports what it
	// finds.
	Accept(inv *Invocation) (run func(ctx context.Context) Outcome, timeout time.Duration, ok bool)
}

// outcomeGrace is added to the invocation's timeout for the answer's way
// back.
const outcomeGrace = 2 * time.Second

// ErrNoOutcome is wrapped by Invoke's error when the invocation was sent
// but no outcome came back: whether the call ran is unknown.
var ErrNoOutcome = errors.New("the host agent did not answer the call")

// Invoke sends inv to the agent at socket and waits for its outcome until
// timeout (the plugin's configured timeout) and a grace have passed.
// served is false, with a nil error, when nothing serves the socket or the
// agent refused inv: the caller then runs the call itself. With served
// true, an error wrapping ErrNoOutcome means the outcome was lost: the
// connection closed (the agent stopped) or the wait ended (the error then
// also wraps os.ErrDeadlineExceeded).
//
// The plugin's side uses plain blocking system calls with socket timeouts:
// a process that makes one exchange gains nothing from the runtime's
// network poller but its set-up, and a thread asleep in read is woken by
// the agent's write directly.
func Invoke(socket string, timeout time.Duration, inv *Invocation) (out Outcome, served bool, err error) {
	req, err := json.Marshal(&request{Op: "invoke", TimeoutMS: timeout.Milliseconds(), Invocation: inv})
	if err != nil || len(req) > MaxRequest {
		// Over the agent's limit: it would close the connection unserved.
		return Outcome{}, false, nil
	}
	conn, err := dialBlocking(socket, dialTimeout)
	if err != nil {
		return Outcome{}, false, nil
	}
	defer conn.close()
	if err := conn.writeAll(append(req, '\n')); err != nil {
		return Outcome{}, false, nil
	}
	wait := timeout + outcomeGrace
	line, err := conn.readLine(wait)
	if err != nil {
		// Before an answer: the agent may have started the call.
		return Outcome{}, true, fmt.Errorf("%w (waited up to %s): %w", ErrNoOutcome, wait, err)
	}
	var ans answer
	if err := json.Unmarshal(line, &ans); err != nil {
		return Outcome{}, true, fmt.Errorf("%w: undecodable answer: %w", ErrNoOutcome, err)
	}
	switch {
	case ans.Outcome != nil:
		return *ans.Outcome, true, nil
	case ans.Error != nil && ans.Error.Kind == kindRefused:
		return Outcome{}, false, nil
	}
	return Outcome{}, true, fmt.Errorf("%w: an answer with no outcome", ErrNoOutcome)
}

// blockingConn is a connected unix stream socket in blocking mode.
type blockingConn struct{ fd int }

// dialBlocking connects to the unix socket at path; the connect waits at
// most timeout (a full accept queue).
func dialBlocking(path string, timeout time.Duration) (*blockingConn, error) {
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	c := &blockingConn{fd: fd}
	if err := c.setTimeout(unix.SO_SNDTIMEO, timeout); err != nil {
		c.close()
		return nil, err
	}
	for {
		err = unix.Connect(fd, &unix.SockaddrUnix{Name: path})
		if err != unix.EINTR {
			break
		}
	}
	if err != nil {
		c.close()
		return nil, err
	}
	return c, nil
}

func (c *blockingConn) close() { unix.Close(c.fd) }

func (c *blockingConn) setTimeout(opt int, d time.Duration) error {
	tv := unix.NsecToTimeval(d.Nanoseconds())
	return unix.SetsockoptTimeval(c.fd, unix.SOL_SOCKET, opt, &tv)
}

func (c *blockingConn) writeAll(b []byte) error {
	for len(b) > 0 {
		n, err := unix.Write(c.fd, b)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return err
		}
		b = b[n:]
	}
	return nil
}

// readLine reads one line (without its newline) of at most maxLine bytes,
// waiting at most wait in all.
func (c *blockingConn) readLine(wait time.Duration) ([]byte, error) {
	deadline := time.Now().Add(wait)
	buf := make([]byte, 0, 4096)
	for {
		left := time.Until(deadline)
		if left <= 0 {
			return nil, os.ErrDeadlineExceeded
		}
		if err := c.setTimeout(unix.SO_RCVTIMEO, left); err != nil {
			return nil, err
		}
		if len(buf) == cap(buf) {
			buf = append(buf, 0)[:len(buf)]
		}
		n, err := unix.Read(c.fd, buf[len(buf):cap(buf)])
		switch {
		case err == unix.EINTR:
			continue
		case err == unix.EAGAIN:
			return nil, os.ErrDeadlineExceeded
		case err != nil:
			return nil, err
		case n == 0:
			return nil, io.ErrUnexpectedEOF
		}
		buf = buf[:len(buf)+n]
		if i := bytes.IndexByte(buf, '\n'); i >= 0 {
			return buf[:i], nil
		}
		if len(buf) > maxLine {
			return nil, errors.New("answer line too long")
		}
	}
}

// serveInvocation answers one invocation on c (the connection is closed
// after it).
func (s *Server) serveInvocation(ctx context.Context, c net.Conn, r *bufio.Reader, w *bufio.Writer, inv *Invocation) {
	var (
		run     func(context.Context) Outcome
		timeout time.Duration
		ok      bool
	)
	if s.Invoker != nil && inv != nil {
		run, timeout, ok = s.Invoker.Accept(inv)
	}
	if !ok {
		writeAnswer(c, w, &answer{Error: &wireError{Kind: kindRefused, Message: "this agent does not serve this invocation"}})
		return
	}
	if timeout <= 0 {
		// The Invoker reads the timeout from the configuration as the
		// plugin did; the request's figure is not needed.
		timeout = defaultCallTimeout
	}
	stopping := ctx
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	// The plugin sends nothing more: a read that ends means it closed
	// the connection (it was killed), and the call is cancelled.
	gone := make(chan struct{})
	_ = c.SetReadDeadline(time.Time{})
	go func() {
		defer close(gone)
		if _, err := r.ReadByte(); err != nil {
			cancel()
		}
	}()
	defer func() {
		// Unblock the watcher and wait for it, so that no goroutine
		// outlives the connection.
		_ = c.SetReadDeadline(time.Now())
		<-gone
	}()
	out := run(ctx)
	if stopping.Err() != nil {
		// The agent is stopping: the call's "canceled" is not the
		// plugin's. Close without an answer; the plugin runs the call
		// itself.
		return
	}
	if s.OnCall != nil {
		var err error
		if len(out.Error) > 0 {
			err = errors.New("the invocation failed")
		}
		s.OnCall("invoke-"+inv.Command, err)
	}
	writeAnswer(c, w, &answer{Outcome: &out})
}
