package agentapi_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/ringipam/ringipam/pkg/agentapi"
)

// wait bounds every wait of these tests.
const wait = 20 * time.Second

// served is a Server on a fresh socket, with what it reported.
type served struct {
	socket string
	stop   func()

	mu      sync.Mutex
	calls   []string
	refused []string
}

func (s *served) refusals() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.refused...)
}

// serve runs srv (its hooks set here) on a fresh socket until the test
// ends or stop is called.
func serve(t *testing.T, srv *agentapi.Server) *served {
	t.Helper()
	s := &served{socket: filepath.Join(t.TempDir(), "run", "agent.sock")}
	l, err := agentapi.Listen(s.socket)
	if err != nil {
		t.Fatal(err)
	}
	srv.Log = func(msg string, args ...any) { t.Log(append([]any{msg}, args...)...) }
	srv.OnCall = func(plugin, command string, a *agentapi.Answer) {
		s.mu.Lock()
		defer s.mu.Unlock()
		s.calls = append(s.calls, plugin+" "+command)
	}
	srv.OnRefused = func(reason string, _ error) {
		s.mu.Lock()
		defer s.mu.Unlock()
		s.refused = append(s.refused, reason)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx, l) }()
	var once sync.Once
	s.stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("Serve: %v", err)
				}
			case <-time.After(wait):
				t.Errorf("Serve did not return within %s of its context's end", wait)
			}
		})
	}
	t.Cleanup(s.stop)
	return s
}

// uidSelf is this process's uid, which the test servers admit.
func uidSelf() uint32 { return uint32(os.Geteuid()) }

func echoHandler(ctx context.Context, req *agentapi.Request) agentapi.Answer {
	if req.ContainerID == "bad" {
		return agentapi.Answer{CNIError: types.NewError(types.ErrInvalidNetworkConfig, "bad container", "")}
	}
	b, _ := json.Marshal(req)
	return agentapi.Answer{Stdout: b}
}

func addRequest() *agentapi.Request {
	return &agentapi.Request{Plugin: agentapi.PluginIPAM, Command: "ADD", ContainerID: "c1", Netns: "/var/run/netns/x",
		IfName: "eth0", Args: "K=V", Path: "/opt/cni/bin", Hostname: "h1", TimeoutMS: 5000, Stdin: []byte(`{"name":"net1"}`)}
}

func TestCallRunsTheHandlerOfThePlugin(t *testing.T) {
	s := serve(t, &agentapi.Server{PeerUID: uidSelf(), Handlers: map[string]agentapi.Handler{
		agentapi.PluginIPAM: agentapi.HandlerFunc(echoHandler)}})
	req := addRequest()
	a, err := agentapi.Call(context.Background(), s.socket, req)
	if err != nil {
		t.Fatal(err)
	}
	var got agentapi.Request
	if err := json.Unmarshal(a.Stdout, &got); err != nil {
		t.Fatal(err)
	}
	want := *req
	want.Version = agentapi.Version
	if b1, b2 := mustJSON(t, got), mustJSON(t, want); b1 != b2 {
		t.Fatalf("the handler got %s, want %s", b1, b2)
	}
	if a.Version != agentapi.Version || a.Failed() {
		t.Fatalf("answer %+v", a)
	}

	req.ContainerID = "bad"
	a, err = agentapi.Call(context.Background(), s.socket, req)
	if err != nil {
		t.Fatal(err)
	}
	if a.CNIError == nil || a.CNIError.Code != types.ErrInvalidNetworkConfig || a.CNIError.Msg != "bad container" {
		t.Fatalf("the verb's error came back as %+v", a.CNIError)
	}

	// No handler for portmap-ingress on this server: refused, named.
	req.Plugin = agentapi.PluginPortmap
	_, err = agentapi.Call(context.Background(), s.socket, req)
	if !errors.Is(err, agentapi.ErrRefused) || !strings.Contains(err.Error(), `no plugin "portmap-ingress"`) {
		t.Fatalf("a plugin without handler: %v, want ErrRefused naming it", err)
	}
	s.stop()
	if got, want := strings.Join(s.calls, ","), "ipam-ring ADD,ipam-ring ADD"; got != want {
		t.Fatalf("OnCall saw %q, want %q", got, want)
	}
	if got := s.refusals(); len(got) != 1 || got[0] != "plugin" {
		t.Fatalf("OnRefused saw %q, want [plugin]", got)
	}
}

func mustJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// The socket is 0600 in a directory created 0700; a served socket is not
// taken over.
func TestListenModes(t *testing.T) {
	s := serve(t, &agentapi.Server{PeerUID: uidSelf()})
	fi, err := os.Stat(s.socket)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode()&os.ModeSocket == 0 || fi.Mode().Perm() != 0o600 {
		t.Fatalf("socket mode %v, want a socket 0600", fi.Mode())
	}
	di, err := os.Stat(filepath.Dir(s.socket))
	if err != nil {
		t.Fatal(err)
	}
	if di.Mode().Perm() != 0o700 {
		t.Fatalf("directory mode %v, want 0700", di.Mode().Perm())
	}
	if _, err := agentapi.Listen(s.socket); err == nil || !strings.Contains(err.Error(), "another process serves it") {
		t.Fatalf("Listen on a served socket: %v", err)
	}
}

// Listen's socket is listening as soon as its path exists (a dial before
// anything serves waits in the backlog, it is not refused), no temporary
// name is left beside it, and Close removes the path, but not a socket
// that replaced it (a new agent's).
func TestListenAppearsListening(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "agent.sock")
	l, err := agentapi.Listen(path)
	if err != nil {
		t.Fatal(err)
	}
	if got := l.Addr().String(); got != path {
		t.Errorf("Addr %q, want %q", got, path)
	}
	c, err := net.DialTimeout("unix", path, 5*time.Second)
	if err != nil {
		t.Fatalf("dial before Accept: %v", err)
	}
	c.Close()
	if ents, _ := os.ReadDir(dir); len(ents) != 1 {
		t.Errorf("directory holds %v, want the socket alone", ents)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("socket after Close: %v, want removed", err)
	}

	old, err := agentapi.Listen(path)
	if err != nil {
		t.Fatal(err)
	}
	// The next agent's socket replaces it while the old one still runs.
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	next, err := agentapi.Listen(path)
	if err != nil {
		t.Fatal(err)
	}
	defer next.Close()
	old.Close()
	c, err = net.DialTimeout("unix", path, 5*time.Second)
	if err != nil {
		t.Fatalf("the old listener's Close removed its replacement: %v", err)
	}
	c.Close()
}

// A plugin of another version: the agent answers with its own version and
// an error naming both, without running anything (raw JSON: this package
// speaks only Version).
func TestAgentRefusesAnotherVersion(t *testing.T) {
	ran := make(chan struct{}, 1)
	s := serve(t, &agentapi.Server{PeerUID: uidSelf(), Handlers: map[string]agentapi.Handler{
		agentapi.PluginIPAM: agentapi.HandlerFunc(func(context.Context, *agentapi.Request) agentapi.Answer {
			ran <- struct{}{}
			return agentapi.Answer{}
		})}})
	line := rawExchange(t, s.socket, `{"version":2,"plugin":"ipam-ring","command":"ADD","stdin":null}`)
	var a agentapi.Answer
	if err := json.Unmarshal([]byte(line), &a); err != nil {
		t.Fatalf("answer %q: %v", line, err)
	}
	if a.Version != agentapi.Version || !strings.Contains(a.Error, "speaks agent API v1, the plugin sent v2") {
		t.Fatalf("answer %+v, want version 1 and an error naming v1 and v2", a)
	}
	select {
	case <-ran:
		t.Fatal("the handler ran a request of another version")
	default:
	}
	if got := s.refusals(); len(got) != 1 || got[0] != "version" {
		t.Fatalf("OnRefused saw %q, want [version]", got)
	}
}

// rawExchange sends line and returns the answer line.
func rawExchange(t *testing.T, socket, line string) string {
	t.Helper()
	c, err := net.DialTimeout("unix", socket, wait)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(wait))
	if _, err := c.Write([]byte(line + "\n")); err != nil {
		t.Fatal(err)
	}
	ans, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		t.Fatalf("no answer: %v", err)
	}
	return ans
}

// An agent of another version: the plugin reports both versions and the
// socket, never runs anything else; through Forward, ADD fails with 11
// and DEL is queued.
func TestPluginRefusesAnotherVersion(t *testing.T) {
	s := serve(t, &agentapi.Server{Version: 99, PeerUID: uidSelf(), Handlers: map[string]agentapi.Handler{
		agentapi.PluginIPAM: agentapi.HandlerFunc(echoHandler)}})
	_, err := agentapi.Call(context.Background(), s.socket, addRequest())
	var ve *agentapi.VersionError
	if !errors.As(err, &ve) || ve.Agent != 99 || ve.Plugin != agentapi.Version || !errors.Is(err, agentapi.ErrVersion) {
		t.Fatalf("Call to an agent of v99: %v, want a VersionError 99/1", err)
	}
	want := "agent at " + s.socket + " speaks agent API v99, this plugin v1: upgrade"
	if !strings.Contains(err.Error(), want) {
		t.Fatalf("error %q does not say %q", err, want)
	}
	queue := filepath.Join(t.TempDir(), "q")
	_, err = agentapi.Forward(context.Background(), s.socket, queue, addRequest(), nil)
	if code := cniCode(t, err); code != types.ErrTryAgainLater || !strings.Contains(err.Error(), want) {
		t.Fatalf("ADD through Forward: %v (code %d), want 11 saying %q", err, code, want)
	}
	del := addRequest()
	del.Command = "DEL"
	if out, err := agentapi.Forward(context.Background(), s.socket, queue, del, nil); err != nil || len(out) != 0 {
		t.Fatalf("DEL through Forward to an agent of v99: %q, %v; want it queued and nil", out, err)
	}
	if n, err := (agentapi.DelQueue{Dir: queue}).Len(); err != nil || n != 1 {
		t.Fatalf("queued %d, %v; want 1", n, err)
	}
}

func cniCode(t *testing.T, err error) uint {
	t.Helper()
	var te *types.Error
	if !errors.As(err, &te) {
		t.Fatalf("error %v (%T) is not a *types.Error", err, err)
	}
	return te.Code
}

// Nothing at the socket path, and a socket file nobody listens on, are
// both ErrNoAgent; through Forward ADD fails with 11 naming the socket and
// the service to start, and DEL is queued and succeeds.
func TestNoAgent(t *testing.T) {
	dir := t.TempDir()
	missing := filepath.Join(dir, "missing.sock")
	dead := filepath.Join(dir, "dead.sock")
	l, err := net.Listen("unix", dead)
	if err != nil {
		t.Fatal(err)
	}
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	l.Close()
	for _, sock := range []string{missing, dead} {
		_, err := agentapi.Call(context.Background(), sock, addRequest())
		if !errors.Is(err, agentapi.ErrNoAgent) || !strings.Contains(err.Error(), sock) {
			t.Fatalf("Call to %s: %v, want ErrNoAgent naming the socket", sock, err)
		}
		for _, cmd := range []string{"ADD", "CHECK", "GC", "STATUS"} {
			req := addRequest()
			req.Command = cmd
			_, err := agentapi.Forward(context.Background(), sock, filepath.Join(dir, "q"), req, nil)
			if code := cniCode(t, err); code != types.ErrTryAgainLater || !strings.Contains(err.Error(), sock) || !strings.Contains(err.Error(), "ringipamd") ||
				!strings.Contains(err.Error(), "(CNI code 11: try again later)") {
				t.Fatalf("%s without agent: %v (code %d), want 11 naming %s, ringipamd and the code (runtimes show only the message)", cmd, err, code, sock)
			}
		}
	}
	var notes strings.Builder
	for _, id := range []string{"a", "b", "a"} {
		req := addRequest()
		req.Command, req.ContainerID = "DEL", id
		if _, err := agentapi.Forward(context.Background(), missing, filepath.Join(dir, "q"), req, &notes); err != nil {
			t.Fatalf("DEL without agent: %v, want it queued", err)
		}
	}
	if n, err := (agentapi.DelQueue{Dir: filepath.Join(dir, "q")}).Len(); err != nil || n != 2 {
		t.Fatalf("queued %d, %v; want 2 (a repeated DEL replaces)", n, err)
	}
	if !strings.Contains(notes.String(), "the DEL is queued in "+filepath.Join(dir, "q")) {
		t.Fatalf("notes %q do not say where the DEL was queued", notes.String())
	}
	// What Forward queued is what an agent of this version runs.
	h := &recorder{}
	rep, err := agentapi.DelQueue{Dir: filepath.Join(dir, "q")}.Drain(context.Background(), h)
	if err != nil || rep.Done != 2 || rep.Failed != 0 {
		t.Fatalf("drain of what Forward queued: %+v, %v; want 2 done", rep, err)
	}
}

// A peer of another uid is closed unread (the server admits only PeerUID).
func TestPeerOfAnotherUIDIsClosedUnread(t *testing.T) {
	ran := make(chan struct{}, 1)
	s := serve(t, &agentapi.Server{PeerUID: uidSelf() + 4242, Handlers: map[string]agentapi.Handler{
		agentapi.PluginIPAM: agentapi.HandlerFunc(func(context.Context, *agentapi.Request) agentapi.Answer {
			ran <- struct{}{}
			return agentapi.Answer{}
		})}})
	_, err := agentapi.Call(context.Background(), s.socket, addRequest())
	if !errors.Is(err, agentapi.ErrNoAnswer) && !errors.Is(err, agentapi.ErrNoAgent) {
		t.Fatalf("Call as a refused peer: %v, want no answer", err)
	}
	select {
	case <-ran:
		t.Fatal("the handler ran for a refused peer")
	default:
	}
	s.stop()
	if got := s.refusals(); len(got) != 1 || got[0] != "peer" {
		t.Fatalf("OnRefused saw %q, want [peer]", got)
	}
}

// A line over MaxRequest and an undecodable one close their connections
// unanswered; the server serves the next client.
func TestHostileLines(t *testing.T) {
	s := serve(t, &agentapi.Server{PeerUID: uidSelf(), Handlers: map[string]agentapi.Handler{
		agentapi.PluginIPAM: agentapi.HandlerFunc(echoHandler)}})
	for _, tc := range []struct {
		name string
		line []byte
	}{
		{"too-large", append([]byte(`{"version":1,"stdin":"`), make([]byte, agentapi.MaxRequest+10)...)},
		{"malformed", []byte(`{"version":1,"plugin":`)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := net.DialTimeout("unix", s.socket, wait)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			_ = c.SetDeadline(time.Now().Add(wait))
			// The server may close while we write (too-large): ignore the
			// write's error, the read tells.
			go func() { _, _ = c.Write(append(tc.line, '\n')) }()
			b := make([]byte, 1)
			if n, err := c.Read(b); n != 0 || err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
				t.Fatalf("read %d bytes, %v; want the connection closed unanswered", n, err)
			}
		})
	}
	if _, err := agentapi.Call(context.Background(), s.socket, addRequest()); err != nil {
		t.Fatalf("a good client after the hostile ones: %v", err)
	}
	s.stop()
	if got := strings.Join(s.refusals(), ","); got != "too-large,malformed" {
		t.Fatalf("OnRefused saw %q, want too-large,malformed", got)
	}
}

// The invocation runs under the request's timeout and is cancelled when
// the plugin closes its connection.
func TestInvocationEndsWithThePlugin(t *testing.T) {
	started := make(chan time.Time, 1)
	ended := make(chan error, 1)
	s := serve(t, &agentapi.Server{PeerUID: uidSelf(), Handlers: map[string]agentapi.Handler{
		agentapi.PluginIPAM: agentapi.HandlerFunc(func(ctx context.Context, req *agentapi.Request) agentapi.Answer {
			dl, _ := ctx.Deadline()
			started <- dl
			select {
			case <-ctx.Done():
				ended <- ctx.Err()
			case <-time.After(wait):
				ended <- errors.New("not cancelled")
			}
			return agentapi.Answer{}
		})}})
	c, err := net.DialTimeout("unix", s.socket, wait)
	if err != nil {
		t.Fatal(err)
	}
	before := time.Now()
	b, _ := json.Marshal(&agentapi.Request{Version: agentapi.Version, Plugin: agentapi.PluginIPAM, Command: "ADD", TimeoutMS: 60_000})
	if _, err := c.Write(append(b, '\n')); err != nil {
		t.Fatal(err)
	}
	select {
	case dl := <-started:
		if dl.IsZero() || dl.Before(before.Add(59*time.Second)) || dl.After(time.Now().Add(61*time.Second)) {
			t.Fatalf("the call's deadline is %v, want about 60s from the request", dl)
		}
	case <-time.After(wait):
		t.Fatal("the handler did not start")
	}
	c.Close()
	select {
	case err := <-ended:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("the call ended with %v, want it cancelled", err)
		}
	case <-time.After(2 * wait):
		t.Fatal("the handler did not end")
	}
}

// An agent that stops during a call closes without an answer: the plugin
// sees ErrNoAnswer (and Forward queues a DEL).
func TestAgentStopsDuringACall(t *testing.T) {
	started := make(chan struct{})
	s := serve(t, &agentapi.Server{PeerUID: uidSelf(), Handlers: map[string]agentapi.Handler{
		agentapi.PluginIPAM: agentapi.HandlerFunc(func(ctx context.Context, req *agentapi.Request) agentapi.Answer {
			close(started)
			<-ctx.Done()
			return agentapi.Answer{CNIError: types.NewError(types.ErrTryAgainLater, ctx.Err().Error(), "")}
		})}})
	go func() {
		select {
		case <-started:
			s.stop()
		case <-time.After(wait):
		}
	}()
	req := addRequest()
	req.Command = "DEL"
	queue := filepath.Join(t.TempDir(), "q")
	if _, err := agentapi.Forward(context.Background(), s.socket, queue, req, nil); err != nil {
		t.Fatalf("DEL through an agent that stopped: %v, want it queued", err)
	}
	if n, err := (agentapi.DelQueue{Dir: queue}).Len(); err != nil || n != 1 {
		t.Fatalf("queued %d, %v; want 1", n, err)
	}
}
