//go:build integration

package etcd_test

import (
	"context"
	"crypto/x509"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ringipam/ringipam/internal/testenv"
	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/etcd"
	"github.com/ringipam/ringipam/pkg/store/storetest"
	"github.com/ringipam/ringipam/pkg/storeconfig"
)

func tlsOf(f testenv.TLSFiles) *etcd.TLS {
	return &etcd.TLS{CAFile: f.CA, CertFile: f.Cert, KeyFile: f.Key}
}

func openTLS(t testing.TB, srv *testenv.Etcd, files testenv.TLSFiles, prefix string) *etcd.Store {
	t.Helper()
	s, err := etcd.New(etcd.Config{Endpoints: srv.Endpoints(), Prefix: prefix, TLS: tlsOf(files),
		DialTimeout: 5 * time.Second, RequestTimeout: 30 * time.Second})
	if err != nil {
		t.Fatalf("etcd.New: %v", err)
	}
	return s
}

// The whole store contract holds over TLS with a client certificate.
func TestTLSContract(t *testing.T) {
	srv, files := testenv.StartEtcdTLS(t)
	if ep := srv.Endpoints()[0]; !strings.HasPrefix(ep, "https://") {
		t.Fatalf("endpoint %s is not https", ep)
	}
	storetest.Run(t,
		func(t *testing.T) store.Store { return openTLS(t, srv, files, uniquePrefix()) },
		storetest.Persistent(func(t *testing.T) func(t *testing.T) store.Store {
			p := uniquePrefix()
			return func(t *testing.T) store.Store { return openTLS(t, srv, files, p) }
		}))
}

// Endpoint spellings that reach the TLS server: the IP and the name in its
// certificate, and a bare host:port (TLS because tls is set).
func TestTLSEndpointForms(t *testing.T) {
	srv, files := testenv.StartEtcdTLS(t)
	ep := srv.Endpoints()[0]
	for _, e := range []string{ep, strings.Replace(ep, "127.0.0.1", "localhost", 1), strings.TrimPrefix(ep, "https://")} {
		cfg := etcd.Config{Endpoints: []string{e}, Prefix: uniquePrefix(), TLS: tlsOf(files), DialTimeout: 5 * time.Second, RequestTimeout: 30 * time.Second}
		if err := etcd.CheckTLS(context.Background(), cfg); err != nil {
			t.Errorf("CheckTLS %s: %v", e, err)
		}
		s, err := etcd.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		ctx := context.Background()
		if err := s.Commit(ctx, []store.Cond{{Key: "k"}}, []store.Op{store.Put("k", []byte(e))}); err != nil {
			t.Errorf("Commit via %s: %v", e, err)
		} else if kvs, err := s.Get(ctx, "k"); err != nil || string(kvs[0].Value) != e {
			t.Errorf("Get via %s: %+v, %v", e, kvs, err)
		}
		s.Close()
	}
}

// Misconfigured clients fail without writing anything. The store's error
// wraps store.ErrUnavailable and names the endpoint, but the etcd client
// only ever says "context deadline exceeded": the TLS cause is lost. That is
// what CheckTLS is for: it names the cause and the fix.
func TestTLSRefused(t *testing.T) {
	srv, files := testenv.StartEtcdTLS(t)
	other := testenv.NewTLSFiles(t, t.TempDir()) // an unrelated CA
	plain := testenv.StartEtcd(t)
	ep := srv.Endpoints()[0]
	httpEP := "http" + strings.TrimPrefix(ep, "https")
	tests := []struct {
		name      string
		endpoint  string
		tls       *etcd.TLS
		checkWant []string // in CheckTLS's error
		unknownCA bool     // CheckTLS's error wraps x509.UnknownAuthorityError
	}{
		{"no client certificate", ep, &etcd.TLS{CAFile: files.CA},
			[]string{"requires a client certificate", "set tls.cert and tls.key"}, false},
		{"client certificate from another CA", ep, &etcd.TLS{CAFile: files.CA, CertFile: other.Cert, KeyFile: other.Key},
			[]string{"refused the client certificate " + other.Cert, "--trusted-ca-file"}, false},
		{"wrong CA", ep, &etcd.TLS{CAFile: other.CA, CertFile: files.Cert, KeyFile: files.Key},
			[]string{"not signed by the CA in " + other.CA, "set tls.ca"}, true},
		{"system roots only", ep, nil,
			[]string{"not signed by the system roots"}, true},
		{"http endpoint with tls set", httpEP, tlsOf(files),
			[]string{"ignores the tls settings", "write https://"}, false},
		{"https to a plain-text server", "https://" + strings.TrimPrefix(plain.Endpoints()[0], "http://"), tlsOf(files),
			[]string{"does not speak TLS", "use http://"}, false},
	}
	good := openTLS(t, srv, files, "/refused/")
	t.Cleanup(func() { good.Close() }) // after the parallel subtests
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			const timeout = 2 * time.Second
			cfg := etcd.Config{Endpoints: []string{tc.endpoint}, Prefix: "/refused/", TLS: tc.tls, DialTimeout: timeout, RequestTimeout: timeout}
			s, err := etcd.New(cfg)
			if err != nil {
				t.Fatalf("New: %v (New does not dial, so it should not fail)", err)
			}
			defer s.Close()
			ctx := context.Background()
			start := time.Now()
			err = s.Commit(ctx, nil, []store.Op{store.Put(tc.name, []byte("must not be written"))})
			took := time.Since(start)
			if !errors.Is(err, store.ErrUnavailable) || !strings.Contains(err.Error(), tc.endpoint) {
				t.Errorf("Commit: err = %v, want ErrUnavailable naming %s", err, tc.endpoint)
			}
			if took > timeout+30*time.Second { // a hang, not a slow machine
				t.Errorf("Commit took %v, RequestTimeout is %v", took, timeout)
			}
			if _, err := s.Get(ctx, "k"); !errors.Is(err, store.ErrUnavailable) {
				t.Errorf("Get: err = %v, want ErrUnavailable", err)
			}
			t.Logf("store error: %v", err)
			// Ping, the health check of STATUS and startup, adds the
			// TLS diagnosis that the client's own error lacks.
			if perr := s.Ping(ctx); perr == nil || !strings.Contains(perr.Error(), tc.checkWant[0]) {
				t.Errorf("Ping: err = %v, want it to carry the TLS check %q", perr, tc.checkWant[0])
			}

			cerr := etcd.CheckTLS(ctx, cfg)
			if cerr == nil {
				t.Fatal("CheckTLS found nothing wrong")
			}
			t.Logf("CheckTLS: %v", cerr)
			for _, w := range append([]string{tc.endpoint}, tc.checkWant...) {
				if !strings.Contains(cerr.Error(), w) {
					t.Errorf("CheckTLS error lacks %q", w)
				}
			}
			var uae x509.UnknownAuthorityError
			if got := errors.As(cerr, &uae); got != tc.unknownCA {
				t.Errorf("CheckTLS wraps x509.UnknownAuthorityError = %v, want %v", got, tc.unknownCA)
			}

			kvs, err := good.Get(ctx, tc.name)
			if err != nil || kvs[0].Exists() {
				t.Errorf("refused commit left %+v, %v", kvs, err)
			}
		})
	}
}

// CheckTLS passes a correct configuration and reports every bad endpoint of
// a list, not just the first.
func TestCheckTLSSeveralEndpoints(t *testing.T) {
	srv, files := testenv.StartEtcdTLS(t)
	ep := srv.Endpoints()[0]
	ctx := context.Background()
	if err := etcd.CheckTLS(ctx, etcd.Config{Endpoints: srv.Endpoints(), TLS: tlsOf(files)}); err != nil {
		t.Fatalf("good config: %v", err)
	}
	httpEP := "http" + strings.TrimPrefix(ep, "https")
	err := etcd.CheckTLS(ctx, etcd.Config{Endpoints: []string{ep, httpEP, "https://127.0.0.1:1"}, TLS: tlsOf(files), DialTimeout: 2 * time.Second})
	if err == nil {
		t.Fatal("no error")
	}
	msg := err.Error()
	if strings.Contains(msg, ep+":") || !strings.Contains(msg, httpEP+":") || !strings.Contains(msg, "https://127.0.0.1:1: not reachable") {
		t.Errorf("CheckTLS: %v", err)
	}
}

// A store config in JSON with a "tls" object opens a working TLS store.
func TestTLSStoreConfig(t *testing.T) {
	srv, files := testenv.StartEtcdTLS(t)
	raw, err := json.Marshal(map[string]any{
		"type":           "etcd",
		"endpoints":      srv.Endpoints(),
		"prefix":         "/cfg/",
		"tls":            map[string]string{"ca": files.CA, "cert": files.Cert, "key": files.Key},
		"dialTimeout":    "5s",
		"requestTimeout": "30s",
	})
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := storeconfig.Parse(raw)
	if err != nil {
		t.Fatalf("Parse %s: %v", raw, err)
	}
	s, err := storeconfig.Open(cfg)
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	defer s.Close()
	ctx := context.Background()
	if err := store.Ping(ctx, s); err != nil {
		t.Fatalf("Ping: %v", err)
	}
	if err := s.Commit(ctx, []store.Cond{{Key: "k"}}, []store.Op{store.Put("k", []byte("v"))}); err != nil {
		t.Fatalf("Commit: %v", err)
	}
	kvs, err := s.Get(ctx, "k")
	if err != nil || string(kvs[0].Value) != "v" || !kvs[0].Exists() {
		t.Fatalf("Get: %+v, %v", kvs, err)
	}
	// The key is under the configured prefix on the server, as etcd's
	// client sees it without a prefix.
	grpcStore, err := etcd.New(etcd.Config{Endpoints: srv.Endpoints(), Prefix: "/", RequestTimeout: 30 * time.Second,
		TLS: &etcd.TLS{CAFile: files.CA, CertFile: files.Cert, KeyFile: files.Key}})
	if err != nil {
		t.Fatal(err)
	}
	defer grpcStore.Close()
	resp, err := grpcStore.Client().Get(ctx, "/cfg/k")
	if err != nil || len(resp.Kvs) != 1 || string(resp.Kvs[0].Value) != "v" || resp.Kvs[0].ModRevision != kvs[0].Revision {
		t.Fatalf("raw /cfg/k: %+v, %v", resp, err)
	}
}
