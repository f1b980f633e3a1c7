package agentapi

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/ringipam/ringipam/pkg/peercred"
)

// Handler runs one plugin's invocations in the agent. Serve runs req
// under ctx (which ends at the request's timeout, when the plugin goes
// away, and when the agent stops) and returns the answer; the server sets
// its Version. An invocation the handler will not run (it does not name
// the agent's store, say) is an Answer with Error set. Serve must be safe
// for concurrent use.
type Handler interface {
	Serve(ctx context.Context, req *Request) Answer
}

// HandlerFunc is a function as a Handler.
type HandlerFunc func(ctx context.Context, req *Request) Answer

// Serve implements Handler.
func (f HandlerFunc) Serve(ctx context.Context, req *Request) Answer { return f(ctx, req) }

// Handlers are the handlers of an agent, by plugin name (PluginIPAM,
// PluginPortmap). As a Handler it runs a request through the handler of
// its plugin (DelQueue.Drain takes it so).
type Handlers map[string]Handler

// Serve implements Handler: a plugin without handler is refused.
func (hs Handlers) Serve(ctx context.Context, req *Request) Answer {
	h := hs[req.Plugin]
	if h == nil {
		return Answer{Error: noPlugin(req.Plugin)}
	}
	return h.Serve(ctx, req)
}

func noPlugin(name string) string { return fmt.Sprintf("this agent serves no plugin %q", name) }

// Listen creates the unix socket at path (mode 0600, its directory 0700 if
// missing). A socket file nobody serves any more is replaced; one that
// another process still serves is an error.
//
// The socket is bound and listening under a temporary name in the same
// directory, made 0600, and only then renamed to path: a plugin that finds
// path is answered (its connection waits in the backlog until the agent
// serves), never refused by a socket bound but not yet listening, and the
// socket is never reachable with a looser mode. Closing the listener
// removes path, unless another socket has replaced it meanwhile (a new
// agent's, during a rolling update).
func Listen(path string) (net.Listener, error) {
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("agent socket %s: %w", path, err)
	}
	if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
		c.Close()
		return nil, fmt.Errorf("agent socket %s: another process serves it", path)
	}
	tmp := filepath.Join(dir, fmt.Sprintf(".%s.%d", filepath.Base(path), os.Getpid()))
	if err := os.Remove(tmp); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("agent socket %s: %w", path, err)
	}
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: tmp, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("agent socket %s: %w", path, err)
	}
	l.SetUnlinkOnClose(false)
	fail := func(err error) (net.Listener, error) {
		l.Close()
		os.Remove(tmp)
		return nil, fmt.Errorf("agent socket %s: %w", path, err)
	}
	if err := os.Chmod(tmp, 0o600); err != nil {
		return fail(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fail(err)
	}
	fi, err := os.Stat(path)
	if err != nil {
		return fail(err)
	}
	return &socketListener{UnixListener: l, path: path, file: fi}, nil
}

// socketListener is Listen's listener: it reports and, on Close, removes
// the socket's final path (if it is still its own socket).
type socketListener struct {
	*net.UnixListener
	path string
	file os.FileInfo
}

func (l *socketListener) Addr() net.Addr { return &net.UnixAddr{Name: l.path, Net: "unix"} }

func (l *socketListener) Close() error {
	err := l.UnixListener.Close()
	if fi, serr := os.Stat(l.path); serr == nil && os.SameFile(fi, l.file) {
		os.Remove(l.path)
	}
	return err
}

// Server serves the plugins' invocations on a listener. Set its fields
// before Serve; do not change them after.
type Server struct {
	// Handlers run the invocations, by Request.Plugin. A request for a
	// plugin without one is refused (Answer.Error).
	Handlers Handlers
	// Version is the protocol version spoken; 0 means Version (tests set
	// others).
	Version int
	// PeerUID is the only uid whose processes are served (package
	// peercred); the zero value serves root only.
	PeerUID uint32
	// Log, if set, receives connection-level problems.
	Log func(msg string, args ...any)
	// OnCall, if set, is told of every invocation that ran: its plugin,
	// command and answer. It must be quick and safe for concurrent use.
	OnCall func(plugin, command string, a *Answer)
	// OnRefused, if set, is told of every connection closed or answered
	// without running anything: reason "peer" (another uid, closed
	// unread), "too-large" (a request line over MaxRequest, closed),
	// "malformed" (an undecodable request, closed), "version" (another
	// protocol version, answered) or "plugin" (no handler, answered). It
	// must be quick and safe for concurrent use.
	OnRefused func(reason string, err error)
}

func (s *Server) version() int {
	if s.Version == 0 {
		return Version
	}
	return s.Version
}

func (s *Server) refused(reason string, err error) {
	if s.Log != nil {
		s.Log("agent socket: connection refused", "reason", reason, "err", err)
	}
	if s.OnRefused != nil {
		s.OnRefused(reason, err)
	}
}

// Serve accepts connections on l (a unix listener: peers are checked by
// their credentials, see PeerUID) until ctx ends, then closes l and every
// connection and returns once their invocations have ended (their
// contexts are cancelled).
func (s *Server) Serve(ctx context.Context, l net.Listener) error {
	l = peercred.NewListener(l, peercred.Options{UID: s.PeerUID, OnRefuse: func(_ peercred.Cred, err error) {
		s.refused("peer", err)
	}})
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		conns = map[net.Conn]struct{}{}
	)
	stop := context.AfterFunc(ctx, func() {
		l.Close()
		mu.Lock()
		for c := range conns {
			c.Close()
		}
		mu.Unlock()
	})
	defer stop()
	var err error
	for {
		c, aerr := l.Accept()
		if aerr != nil {
			if ctx.Err() == nil {
				err = aerr
			}
			break
		}
		mu.Lock()
		conns[c] = struct{}{}
		if ctx.Err() != nil {
			// Accepted as the server stops, after the connections were
			// closed.
			c.Close()
		}
		mu.Unlock()
		wg.Add(1)
		go func() {
			defer wg.Done()
			s.serveConn(ctx, c)
			mu.Lock()
			delete(conns, c)
			mu.Unlock()
			c.Close()
		}()
	}
	l.Close()
	wg.Wait()
	return err
}

// serveConn answers the one request of c.
func (s *Server) serveConn(ctx context.Context, c net.Conn) {
	r := bufio.NewReaderSize(c, 64<<10)
	_ = c.SetReadDeadline(time.Now().Add(RequestTimeout))
	line, err := readLine(r, MaxRequest)
	if errors.Is(err, errTooLong) {
		s.refused("too-large", err)
		return
	}
	if err != nil {
		return // the client went away, or sent no whole line in time
	}
	var req Request
	if err := json.Unmarshal(line, &req); err != nil {
		s.refused("malformed", fmt.Errorf("undecodable request: %w", err))
		return
	}
	v := s.version()
	if req.Version != v {
		err := errors.New(versionRefusal(v, req.Version))
		s.refused("version", err)
		s.answer(c, &Answer{Error: err.Error()})
		return
	}
	h := s.Handlers[req.Plugin]
	if h == nil {
		err := errors.New(noPlugin(req.Plugin))
		s.refused("plugin", err)
		s.answer(c, &Answer{Error: err.Error()})
		return
	}
	callCtx, cancel := context.WithTimeout(ctx, req.Timeout())
	defer cancel()
	// The plugin sends nothing more (bytes it sends anyway are dropped): a
	// read that ends means it closed the connection (the runtime killed
	// it), and the call is cancelled. After the call the deferred deadline
	// ends the read; that cancel comes too late to matter.
	gone := make(chan struct{})
	_ = c.SetReadDeadline(time.Time{})
	go func() {
		defer close(gone)
		for {
			if _, err := r.ReadByte(); err != nil {
				cancel()
				return
			}
		}
	}()
	defer func() {
		// Unblock the watcher and wait for it: no goroutine outlives the
		// connection.
		_ = c.SetReadDeadline(time.Now())
		<-gone
	}()
	a := h.Serve(callCtx, &req)
	if ctx.Err() != nil {
		// The agent is stopping: the call's "canceled" is not the
		// plugin's. Close without an answer (the plugin sees ErrNoAnswer).
		return
	}
	if s.OnCall != nil {
		s.OnCall(req.Plugin, req.Command, &a)
	}
	s.answer(c, &a)
}

// answer writes a, of the server's version, as one line on c.
func (s *Server) answer(c net.Conn, a *Answer) {
	a.Version = s.version()
	b, err := json.Marshal(a)
	if err != nil {
		b, _ = json.Marshal(&Answer{Version: a.Version, Error: fmt.Sprintf("encoding the answer: %v", err)})
	}
	_ = c.SetWriteDeadline(time.Now().Add(RequestTimeout))
	if _, err := c.Write(append(b, '\n')); err != nil && s.Log != nil {
		s.Log("agent socket: the answer did not go out", "err", err)
	}
}
