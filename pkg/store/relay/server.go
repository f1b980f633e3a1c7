package relay

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
	"github.com/ringipam/ringipam/pkg/store"
)

// Limits of the server.
const (
	// maxLine bounds one answer line (the agent's answers: a scan's page).
	maxLine = 64 << 20
	// MaxRequest bounds one request line the server reads: a whole
	// invocation (its stdin at most cnimain.MaxStdin, 4 MiB, base64 in the
	// JSON) or a store call (etcd takes at most 1.5 MiB per request) fits
	// with room to spare. A longer line closes the connection after
	// MaxRequest+1 bytes were read; a client refuses to send one
	// (store.ErrTooLarge) rather than lose its connection.
	MaxRequest = 8 << 20
	// idleTimeout closes a connection that does not send a whole request
	// line within it (a client that stalls half-way included).
	idleTimeout = time.Minute
	// defaultCallTimeout bounds a call that came without a deadline.
	defaultCallTimeout = 30 * time.Second
)

// Listen creates the unix socket at path (mode 0600, its directory 0700 if
// missing). A socket file nobody serves any more is replaced; one that
// another process still serves is an error.
func Listen(path string) (net.Listener, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, fmt.Errorf("store socket %s: %w", path, err)
	}
	if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
		c.Close()
		return nil, fmt.Errorf("store socket %s: another process serves it", path)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("store socket %s: %w", path, err)
	}
	l, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("store socket %s: %w", path, err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		l.Close()
		return nil, fmt.Errorf("store socket %s: %w", path, err)
	}
	return l, nil
}

// Server serves one store on a listener. Make it with NewServer.
type Server struct {
	backend store.Store
	id      Identity
	log     func(msg string, args ...any)
	// OnCall, if set before Serve, is told of every call served: its
	// operation (get, scan, commit, or "invoke-" and the CNI command) and
	// result.
	OnCall func(op string, err error)
	// Invoker, if set before Serve, runs the whole plugin invocations
	// sent to the socket; without it every invocation is refused.
	Invoker Invoker
	// PeerUID is the only uid whose processes the server answers: every
	// accepted connection's peer credentials (SO_PEERCRED) are checked,
	// and a connection of another uid is closed unread (package
	// peercred). The zero value answers root only.
	PeerUID uint32
	// OnRefused, if set before Serve, is told of every connection the
	// server closed without serving: reason "peer" (another uid), "too-large"
	// (a request line over MaxRequest) or "malformed" (an undecodable
	// request). It must be quick and safe for concurrent use.
	OnRefused func(reason string, err error)
}

// refused reports a connection closed unserved.
func (s *Server) refused(reason string, err error) {
	s.log("relay: connection refused", "reason", reason, "err", err)
	if s.OnRefused != nil {
		s.OnRefused(reason, err)
	}
}

// NewServer returns a server of backend, which serves the cluster id.
// logf, if not nil, receives connection-level problems.
func NewServer(backend store.Store, id Identity, logf func(msg string, args ...any)) *Server {
	if logf == nil {
		logf = func(string, ...any) {}
	}
	return &Server{backend: backend, id: id, log: logf}
}

// Serve accepts connections on l (a unix listener: peers are checked
// by their credentials, see PeerUID) until ctx ends, then closes l and
// every connection and returns once their calls have ended. Each
// connection is served on its own goroutine: a client that stalls or
// misbehaves holds up nobody else.
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
			// closed: close this one too, or its read would hold Serve
			// up to the idle timeout.
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

func (s *Server) serveConn(ctx context.Context, c net.Conn) {
	r := bufio.NewReaderSize(c, 64<<10)
	w := bufio.NewWriterSize(c, 64<<10)
	greeted := false
	for {
		_ = c.SetReadDeadline(time.Now().Add(idleTimeout))
		line, err := readLineMax(r, MaxRequest)
		if errors.Is(err, errTooLong) {
			s.refused("too-large", err)
			return
		}
		if err != nil {
			return // the client went away, or sent no whole line in time
		}
		var req request
		var ans answer
		if err := json.Unmarshal(line, &req); err != nil {
			s.refused("malformed", fmt.Errorf("undecodable request: %w", err))
			return
		}
		if req.Op == "invoke" && !greeted {
			s.serveInvocation(ctx, c, r, w, req.Invocation)
			return
		}
		switch {
		case req.Op == "hello":
			switch {
			case req.Identity == nil || !s.id.Matches(*req.Identity):
				ans.Error = &wireError{Kind: kindRefused, Message: fmt.Sprintf("this agent serves prefix %q of %v", s.id.Prefix, s.id.Endpoints)}
			default:
				greeted = true
				ans.Features = []string{featureRangeConds}
			}
		case !greeted:
			ans.Error = &wireError{Kind: kindRefused, Message: "hello first"}
		default:
			ans = s.call(ctx, &req)
			if ctx.Err() != nil {
				// The agent is stopping: its store's "canceled" is not the
				// caller's. Close, and let the client see a lost agent.
				return
			}
		}
		if !writeAnswer(c, w, &ans) {
			return
		}
		if ans.Error != nil && ans.Error.Kind == kindRefused {
			return
		}
	}
}

// call runs one store call under the request's deadline.
func (s *Server) call(ctx context.Context, req *request) answer {
	timeout := defaultCallTimeout
	if req.TimeoutMS > 0 {
		timeout = time.Duration(req.TimeoutMS) * time.Millisecond
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var (
		kvs []store.KV
		err error
	)
	switch req.Op {
	case "get":
		keys := make([]string, len(req.Keys))
		for i, k := range req.Keys {
			keys[i] = string(k)
		}
		kvs, err = s.backend.Get(ctx, keys...)
	case "scan":
		kvs, err = s.backend.Scan(ctx, string(req.From), string(req.To), req.Limit)
	case "commit":
		conds := make([]store.Cond, len(req.Conds))
		for i, c := range req.Conds {
			conds[i] = store.Cond{Key: string(c.Key), Revision: c.Revision, End: string(c.End)}
		}
		ops := make([]store.Op, len(req.Ops))
		for i, o := range req.Ops {
			ops[i] = store.Op{Key: string(o.Key), Value: o.Value, Delete: o.Delete}
		}
		err = s.backend.Commit(ctx, conds, ops)
	default:
		err = fmt.Errorf("unknown operation %q", req.Op)
	}
	if s.OnCall != nil {
		s.OnCall(req.Op, err)
	}
	if err != nil {
		return answer{Error: toWire(err)}
	}
	out := answer{KVs: make([]wireKV, len(kvs))}
	for i, kv := range kvs {
		out.KVs[i] = wireKV{Key: []byte(kv.Key), Value: kv.Value, Revision: kv.Revision}
	}
	return out
}

// writeAnswer writes a as one line on c (through w) and reports whether it
// went out.
func writeAnswer(c net.Conn, w *bufio.Writer, a *answer) bool {
	b, err := json.Marshal(a)
	if err != nil {
		return false
	}
	_ = c.SetWriteDeadline(time.Now().Add(idleTimeout))
	w.Write(b)
	w.WriteByte('\n')
	return w.Flush() == nil
}

// errTooLong is returned by readLineMax for a line over its limit.
var errTooLong = errors.New("line too long")

// readLine reads one line of at most maxLine bytes, without its newline.
func readLine(r *bufio.Reader) ([]byte, error) { return readLineMax(r, maxLine) }

// readLineMax reads one line of at most limit bytes, without its newline;
// it stops reading as soon as the line passes the limit.
func readLineMax(r *bufio.Reader, limit int) ([]byte, error) {
	var line []byte
	for {
		part, err := r.ReadSlice('\n')
		line = append(line, part...)
		if len(line) > limit+1 {
			return nil, fmt.Errorf("%w: more than %d bytes", errTooLong, limit)
		}
		switch {
		case err == nil:
			return line[:len(line)-1], nil
		case errors.Is(err, bufio.ErrBufferFull):
			continue
		default:
			return nil, err
		}
	}
}
