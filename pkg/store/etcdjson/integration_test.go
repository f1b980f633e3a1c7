//go:build integration

package etcdjson_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
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

// The one store contract, on a real etcd through its JSON gateway.
func TestContract(t *testing.T) {
	srv := testenv.StartEtcd(t)
	storetest.Run(t,
		func(t *testing.T) store.Store {
			return open(t, etcdjson.Config{Endpoints: srv.Endpoints(), Prefix: uniquePrefix()})
		},
		storetest.Persistent(func(t *testing.T) func(t *testing.T) store.Store {
			p := uniquePrefix()
			return func(t *testing.T) store.Store { return open(t, etcdjson.Config{Endpoints: srv.Endpoints(), Prefix: p}) }
		}))
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
