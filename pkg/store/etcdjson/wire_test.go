package etcdjson

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ringipam/ringipam/pkg/store"
)

func testEndpoint(t *testing.T, url string) endpoint {
	t.Helper()
	ep, err := parseEndpoint(url)
	if err != nil {
		t.Fatal(err)
	}
	return ep
}

// Answers of net/http's own server, framed each way it frames them, come
// back whole, and the connection is reused while the server keeps it.
func TestPostAgainstNetHTTPServer(t *testing.T) {
	var conns atomic.Int64
	big := strings.Repeat("x", 100<<10)
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if r.Method != http.MethodPost || r.Header.Get("Content-Type") != "application/json" || r.Header.Get("Authorization") != "tok" {
			http.Error(w, "bad request "+r.Method, http.StatusBadRequest)
			return
		}
		switch r.URL.Path {
		case "/echo":
			w.Write(body)
		case "/chunked":
			for i := 0; i < 4; i++ {
				w.Write([]byte(big))
				w.(http.Flusher).Flush()
			}
		case "/close":
			w.Header().Set("Connection", "close")
			w.Write([]byte("bye"))
		default:
			http.NotFound(w, r)
		}
	}))
	srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			conns.Add(1)
		}
	}
	srv.Start()
	defer srv.Close()
	ep := testEndpoint(t, srv.URL)
	h := &httpClient{dialTimeout: time.Second}
	defer h.closeIdle()
	ctx := context.Background()
	hdr := []string{"Authorization: tok"}
	for i := 0; i < 3; i++ {
		st, data, err := h.post(ctx, ep, "/echo", hdr, []byte(`{"n":1}`), false)
		if err != nil || st != 200 || string(data) != `{"n":1}` {
			t.Fatalf("echo: %d %q %v", st, data, err)
		}
	}
	if n := conns.Load(); n != 1 {
		t.Fatalf("three requests used %d connections, want 1", n)
	}
	st, data, err := h.post(ctx, ep, "/chunked", hdr, nil, true)
	if err != nil || st != 200 || string(data) != strings.Repeat(big, 4) {
		t.Fatalf("chunked: %d, %d bytes, %v", st, len(data), err)
	}
	st, data, err = h.post(ctx, ep, "/missing", hdr, nil, true)
	if err != nil || st != 404 || !strings.Contains(string(data), "not found") {
		t.Fatalf("404: %d %q %v", st, data, err)
	}
	before := conns.Load()
	if st, data, err = h.post(ctx, ep, "/close", hdr, nil, true); err != nil || string(data) != "bye" {
		t.Fatalf("close: %d %q %v", st, data, err)
	}
	if _, _, err = h.post(ctx, ep, "/echo", hdr, []byte("{}"), false); err != nil {
		t.Fatal(err)
	}
	if n := conns.Load(); n != before+1 {
		t.Fatalf("after Connection: close, %d new connections, want 1", n-before)
	}
}

// fakeServer answers each connection with the scripted handler.
func fakeServer(t *testing.T, handle func(n int, c net.Conn)) endpoint {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for n := 0; ; n++ {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				handle(n, c)
			}()
		}
	}()
	return testEndpoint(t, "http://"+l.Addr().String())
}

// readRequest consumes one request of this client.
func readRequest(r *bufio.Reader) (string, error) {
	req, err := http.ReadRequest(r)
	if err != nil {
		return "", err
	}
	b, err := io.ReadAll(req.Body)
	return string(b), err
}

// A kept connection the server closed is retried on a fresh one for a
// read; a commit is not sent twice.
func TestDeadIdleConnection(t *testing.T) {
	var served atomic.Int64
	ep := fakeServer(t, func(n int, c net.Conn) {
		r := bufio.NewReader(c)
		if _, err := readRequest(r); err != nil {
			return
		}
		served.Add(1)
		io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
		// Then close, as a restarted server would: the client still
		// holds the connection as idle.
	})
	h := &httpClient{dialTimeout: time.Second}
	defer h.closeIdle()
	ctx := context.Background()
	if _, _, err := h.post(ctx, ep, "/a", nil, nil, true); err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond) // the close reaches the client
	if st, data, err := h.post(ctx, ep, "/b", nil, nil, true); err != nil || st != 200 || string(data) != "ok" {
		t.Fatalf("read on a dead kept connection: %d %q %v", st, data, err)
	}
	if served.Load() != 2 {
		t.Fatalf("served %d", served.Load())
	}
	time.Sleep(50 * time.Millisecond)
	_, _, err := h.post(ctx, ep, "/commit", nil, nil, false)
	if err == nil {
		t.Fatal("a commit on a dead kept connection was sent again")
	}
	if served.Load() != 2 {
		t.Fatalf("served %d after the commit", served.Load())
	}
}

// Malformed answers are errors, never a misread body.
func TestMalformedAnswers(t *testing.T) {
	for _, answer := range []string{
		"SMTP ready\r\n\r\n",
		"HTTP/1.1 abc OK\r\n\r\n",
		"HTTP/1.1 200 OK\r\nContent-Length: -3\r\n\r\n",
		"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
		"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
		"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
		"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcX",
		"HTTP/1.1 200 OK\r\nno colon\r\n\r\n",
		"HTTP/1.1 100 Continue\r\n\r\n",
	} {
		_, _, _, err := readAnswer(bufio.NewReader(strings.NewReader(answer)))
		if err == nil {
			t.Errorf("%q: no error", answer)
		}
	}
	st, body, reusable, err := readAnswer(bufio.NewReader(strings.NewReader(
		"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3;ext=1\r\nabc\r\n2\r\nde\r\n0\r\nTrailer: x\r\n\r\n")))
	if err != nil || st != 200 || string(body) != "abcde" || !reusable {
		t.Fatalf("chunked with extension and trailer: %d %q %v %v", st, body, reusable, err)
	}
	st, body, reusable, err = readAnswer(bufio.NewReader(strings.NewReader("HTTP/1.0 500 Oops\r\n\r\nall of it")))
	if err != nil || st != 500 || string(body) != "all of it" || reusable {
		t.Fatalf("HTTP/1.0 to the end: %d %q %v %v", st, body, reusable, err)
	}
}

// A server that never answers is cut off by the caller's deadline, and a
// cancelled context ends the wait at once.
func TestDeadlineAndCancel(t *testing.T) {
	ep := fakeServer(t, func(n int, c net.Conn) { io.Copy(io.Discard, c) })
	h := &httpClient{dialTimeout: time.Second}
	defer h.closeIdle()
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, _, err := h.post(ctx, ep, "/", nil, nil, true)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("deadline: %v", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("deadline of 200ms took %v", d)
	}
	ctx, cancel = context.WithCancel(context.Background())
	time.AfterFunc(100*time.Millisecond, cancel)
	if _, _, err := h.post(ctx, ep, "/", nil, nil, true); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancel: %v", err)
	}
}

func TestParseEndpoint(t *testing.T) {
	for in, want := range map[string]endpoint{
		"http://127.0.0.1:2379":     {url: "http://127.0.0.1:2379", hostport: "127.0.0.1:2379", host: "127.0.0.1"},
		"https://etcd.example/":     {url: "https://etcd.example", hostport: "etcd.example:2379", host: "etcd.example", tls: true},
		"https://[2001:db8::1]:23":  {url: "https://[2001:db8::1]:23", hostport: "[2001:db8::1]:23", host: "2001:db8::1", tls: true},
		"http://[2001:db8::1]/path": {url: "http://[2001:db8::1]", hostport: "[2001:db8::1]:2379", host: "2001:db8::1"},
	} {
		got, err := parseEndpoint(in)
		if err != nil || got != want {
			t.Errorf("%s: %+v %v, want %+v", in, got, err, want)
		}
	}
	for _, bad := range []string{"127.0.0.1:2379", "unix:///run/etcd.sock", "http://:2379"} {
		if _, err := parseEndpoint(bad); err == nil {
			t.Errorf("%s: no error", bad)
		}
	}
}

// Without TLS support linked (a CNI plugin), a TLS endpoint is
// unavailable with ErrNoTLS; plain http needs none.
func TestNoTLSSupport(t *testing.T) {
	saved := TLSSupport
	TLSSupport = nil
	defer func() { TLSSupport = saved }()
	for _, cfg := range []Config{
		{Endpoints: []string{"https://198.18.0.1:2379"}},
		{Endpoints: []string{"198.18.0.1:2379"}, TLS: &TLS{CAFile: "/ca.pem"}},
	} {
		_, err := New(cfg)
		if !errors.Is(err, ErrNoTLS) || !errors.Is(err, store.ErrUnavailable) {
			t.Errorf("%+v: %v", cfg, err)
		}
	}
	if _, err := New(Config{Endpoints: []string{"http://198.18.0.1:2379"}}); err != nil {
		t.Errorf("plain http: %v", err)
	}
}
