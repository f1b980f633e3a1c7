//go:build integration

package etcdjson_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ringipam/ringipam/internal/testenv"
	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/etcdjson"
	_ "github.com/ringipam/ringipam/pkg/store/etcdjson/etcdtls"
	"github.com/ringipam/ringipam/pkg/store/storetest"
)

var prefixSeq atomic.Int64

func uniquePrefix() string { return fmt.Sprintf("/j%d/", prefixSeq.Add(1)) }

func open(t testing.TB, cfg etcdjson.Config) *etcdjson.Store {
	t.Helper()
	if cfg.RequestTimeout == 0 {
		cfg.RequestTimeout = 30 * time.Second
	}
	s, err := etcdjson.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// The one store contract, on a real etcd: over gRPC (what a plaintext
// endpoint gets) and through the JSON gateway (what a TLS one gets, tested
// below on TLS too).
func TestContract(t *testing.T) {
	srv := testenv.StartEtcd(t)
	for _, wire := range []string{"grpc", "gateway"} {
		t.Run(wire, func(t *testing.T) {
			openWire := func(t *testing.T, prefix string) store.Store {
				s := open(t, etcdjson.Config{Endpoints: srv.Endpoints(), Prefix: prefix})
				if wire == "gateway" {
					etcdjson.UseGateway(s)
				}
				return s
			}
			storetest.Run(t,
				func(t *testing.T) store.Store { return openWire(t, uniquePrefix()) },
				storetest.Persistent(func(t *testing.T) func(t *testing.T) store.Store {
					p := uniquePrefix()
					return func(t *testing.T) store.Store { return openWire(t, p) }
				}))
		})
	}
}

// sniffer is a TCP proxy to target that records how each connection
// began: "PRI *" for HTTP/2 (gRPC), "POST " for the gateway.
type sniffer struct {
	addr   string
	mu     sync.Mutex
	starts []string
}

func sniff(t *testing.T, target string) *sniffer {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	sn := &sniffer{addr: l.Addr().String()}
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				up, err := net.Dial("tcp", target)
				if err != nil {
					return
				}
				defer up.Close()
				head := make([]byte, 5)
				if _, err := io.ReadFull(c, head); err != nil {
					return
				}
				sn.mu.Lock()
				sn.starts = append(sn.starts, string(head))
				sn.mu.Unlock()
				up.Write(head)
				go io.Copy(c, up)
				io.Copy(up, c)
			}()
		}
	}()
	return sn
}

func (sn *sniffer) seen() []string {
	sn.mu.Lock()
	defer sn.mu.Unlock()
	return append([]string(nil), sn.starts...)
}

// A plaintext endpoint is spoken to in gRPC: every call of a Store, one
// connection; the gateway is used only when asked (or for TLS).
func TestSpeaksGRPC(t *testing.T) {
	srv := testenv.StartEtcd(t)
	for _, wire := range []string{"grpc", "gateway"} {
		sn := sniff(t, strings.TrimPrefix(srv.Endpoints()[0], "http://"))
		s := open(t, etcdjson.Config{Endpoints: []string{"http://" + sn.addr}, Prefix: uniquePrefix()})
		want := "PRI *"
		if wire == "gateway" {
			etcdjson.UseGateway(s)
			want = "POST "
		}
		ctx := context.Background()
		if err := s.Commit(ctx, []store.Cond{{Key: "k"}}, []store.Op{store.Put("k", []byte("v"))}); err != nil {
			t.Fatal(err)
		}
		if kvs, err := s.Get(ctx, "k"); err != nil || string(kvs[0].Value) != "v" {
			t.Fatalf("%s: get: %v %v", wire, kvs, err)
		}
		if kvs, err := s.Scan(ctx, "", "\xff", 0); err != nil || len(kvs) != 1 {
			t.Fatalf("%s: scan: %v %v", wire, kvs, err)
		}
		if got := sn.seen(); len(got) != 1 || got[0] != want {
			t.Fatalf("%s: connections began with %q, want one %q", wire, got, want)
		}
	}
}

// Through a proxy that speaks only HTTP/1.1, a plaintext endpoint is
// refused HTTP/2 once, before anything is acted on, and spoken to through
// the gateway from then on: a commit is made exactly once.
func TestFallsBackToTheGateway(t *testing.T) {
	srv := testenv.StartEtcd(t)
	target, _ := url.Parse(srv.Endpoints()[0])
	var requests, prefaces atomic.Int64
	proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == "PRI" {
			// net/http hands HTTP/2's preface to the handler as a request.
			prefaces.Add(1)
			http.Error(w, "HTTP/2 is not served here", http.StatusHTTPVersionNotSupported)
			return
		}
		requests.Add(1)
		httputil.NewSingleHostReverseProxy(target).ServeHTTP(w, r)
	}))
	defer proxy.Close()
	s := open(t, etcdjson.Config{Endpoints: []string{proxy.URL}, Prefix: uniquePrefix()})
	ctx := context.Background()
	for i := range 3 {
		rev := int64(0)
		if i > 0 {
			kvs, err := s.Get(ctx, "n")
			if err != nil {
				t.Fatal(err)
			}
			rev = kvs[0].Revision
		}
		if err := s.Commit(ctx, []store.Cond{{Key: "n", Revision: rev}}, []store.Op{store.Put("n", []byte(fmt.Sprint(i)))}); err != nil {
			t.Fatalf("commit %d through an HTTP/1.1 proxy: %v", i, err)
		}
	}
	if kvs, err := s.Get(ctx, "n"); err != nil || string(kvs[0].Value) != "2" {
		t.Fatalf("after three commits: %v %v", kvs, err)
	}
	if n, p := requests.Load(), prefaces.Load(); n != 6 || p != 1 {
		t.Fatalf("the proxy served %d requests and %d HTTP/2 prefaces, want 6 (3 commits, 3 reads) and 1", n, p)
	}
}

// An answer larger than the client's HTTP/2 windows (4 MiB) is read whole:
// the client gives the windows back as it reads.
func TestLargeScanOverGRPC(t *testing.T) {
	srv := testenv.StartEtcd(t)
	s := open(t, etcdjson.Config{Endpoints: srv.Endpoints(), Prefix: uniquePrefix()})
	ctx := context.Background()
	value := bytes.Repeat([]byte("0123456789abcdef"), 2048) // 32 KiB
	const keys = 200                                        // 6.4 MiB in all
	for start := 0; start < keys; start += 20 {
		var ops []store.Op
		for i := start; i < start+20; i++ {
			ops = append(ops, store.Put(fmt.Sprintf("big/%03d", i), value))
		}
		if err := s.Commit(ctx, nil, ops); err != nil {
			t.Fatal(err)
		}
	}
	kvs, err := s.Scan(ctx, "big/", "big0", 0)
	if err != nil || len(kvs) != keys {
		t.Fatalf("scan: %d keys, %v", len(kvs), err)
	}
	for i, kv := range kvs {
		if kv.Key != fmt.Sprintf("big/%03d", i) || !bytes.Equal(kv.Value, value) {
			t.Fatalf("key %d: %q with %d bytes", i, kv.Key, len(kv.Value))
		}
	}
}

// A commit over etcd's request limit (1.5 MiB by default) is ErrTooLarge
// on both wires, whichever limit (etcd's or gRPC's) refuses it.
func TestTooLarge(t *testing.T) {
	srv := testenv.StartEtcd(t)
	for _, wire := range []string{"grpc", "gateway"} {
		for _, size := range []int{1800 << 10, 3 << 20} {
			s := open(t, etcdjson.Config{Endpoints: srv.Endpoints(), Prefix: uniquePrefix()})
			if wire == "gateway" {
				etcdjson.UseGateway(s)
			}
			err := s.Commit(context.Background(), nil, []store.Op{store.Put("huge", bytes.Repeat([]byte("x"), size))})
			if !errors.Is(err, store.ErrTooLarge) {
				t.Errorf("%s, %d bytes: %v", wire, size, err)
			}
		}
	}
}

// With etcd's authentication on, a Store with a user and password works on
// both wires, and a wrong password is refused with a message that says so.
func TestAuthentication(t *testing.T) {
	srv := testenv.StartEtcd(t)
	ep := srv.Endpoints()[0]
	for _, step := range [][2]string{
		{"/v3/auth/user/add", `{"name":"root","password":"rootpw"}`},
		{"/v3/auth/role/add", `{"name":"root"}`},
		{"/v3/auth/user/grant", `{"user":"root","role":"root"}`},
		{"/v3/auth/enable", `{}`},
	} {
		resp, err := http.Post(ep+step[0], "application/json", strings.NewReader(step[1]))
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("%s: %s %s", step[0], resp.Status, body)
		}
	}
	ctx := context.Background()
	for _, wire := range []string{"grpc", "gateway"} {
		s := open(t, etcdjson.Config{Endpoints: srv.Endpoints(), Prefix: uniquePrefix(), Username: "root", Password: "rootpw"})
		anonymous := open(t, etcdjson.Config{Endpoints: srv.Endpoints(), Prefix: uniquePrefix()})
		wrong := open(t, etcdjson.Config{Endpoints: srv.Endpoints(), Prefix: uniquePrefix(), Username: "root", Password: "nope"})
		if wire == "gateway" {
			etcdjson.UseGateway(s)
			etcdjson.UseGateway(anonymous)
			etcdjson.UseGateway(wrong)
		}
		if err := s.Commit(ctx, []store.Cond{{Key: "a"}}, []store.Op{store.Put("a", []byte("1"))}); err != nil {
			t.Fatalf("%s: commit as root: %v", wire, err)
		}
		if kvs, err := s.Get(ctx, "a"); err != nil || string(kvs[0].Value) != "1" {
			t.Fatalf("%s: get as root: %v %v", wire, kvs, err)
		}
		if _, err := anonymous.Get(ctx, "a"); err == nil {
			t.Fatalf("%s: a read without a token was allowed", wire)
		}
		if _, err := wrong.Get(ctx, "a"); err == nil || !strings.Contains(err.Error(), "authentication") {
			t.Fatalf("%s: wrong password: %v", wire, err)
		}
	}
}

// The same contract over TLS with client certificates.
func TestContractTLS(t *testing.T) {
	srv, files := testenv.StartEtcdTLS(t)
	tlsCfg := &etcdjson.TLS{CAFile: files.CA, CertFile: files.Cert, KeyFile: files.Key}
	storetest.Run(t, func(t *testing.T) store.Store {
		return open(t, etcdjson.Config{Endpoints: srv.Endpoints(), Prefix: uniquePrefix(), TLS: tlsCfg})
	})
	// Without the client certificate the server refuses, and the error
	// says it is a TLS matter, at once.
	s := open(t, etcdjson.Config{Endpoints: srv.Endpoints(), TLS: &etcdjson.TLS{CAFile: files.CA}, RequestTimeout: 5 * time.Second})
	err := s.Ping(context.Background())
	if !errors.Is(err, store.ErrUnavailable) || !strings.Contains(strings.ToLower(err.Error()), "certificate") && !strings.Contains(strings.ToLower(err.Error()), "tls") {
		t.Fatalf("without a client certificate: %v", err)
	}
}

// An unreachable cluster is ErrUnavailable naming the endpoint, within the
// request timeout.
func TestUnreachable(t *testing.T) {
	l, _ := net.Listen("tcp", "127.0.0.1:0")
	addr := l.Addr().String()
	l.Close()
	s := open(t, etcdjson.Config{Endpoints: []string{"http://" + addr}, RequestTimeout: 2 * time.Second, DialTimeout: time.Second})
	_, err := s.Get(context.Background(), "k")
	if !errors.Is(err, store.ErrUnavailable) || !strings.Contains(err.Error(), addr) {
		t.Fatalf("unreachable: %v", err)
	}
	// The next endpoint is tried when one is down.
	srv := testenv.StartEtcd(t)
	s = open(t, etcdjson.Config{Endpoints: append([]string{"http://" + addr}, srv.Endpoints()...)})
	if _, err := s.Get(context.Background(), "k"); err != nil {
		t.Fatalf("with one endpoint down: %v", err)
	}
}
