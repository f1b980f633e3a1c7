package etcd_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/etcd"
)

// No server is needed to show that an unreachable cluster is an
// ErrUnavailable naming the endpoints, reached within the timeouts.
func TestUnreachableIsUnavailable(t *testing.T) {
	s, err := etcd.New(etcd.Config{
		Endpoints:      []string{"127.0.0.1:1"},
		DialTimeout:    200 * time.Millisecond,
		RequestTimeout: 300 * time.Millisecond,
	})
	if err != nil {
		t.Fatalf("New must not need the server: %v", err)
	}
	defer s.Close()
	ctx := context.Background()
	calls := map[string]func() error{
		"Get":    func() error { _, err := s.Get(ctx, "k"); return err },
		"Scan":   func() error { _, err := s.Scan(ctx, "", "z", 0); return err },
		"Commit": func() error { return s.Commit(ctx, nil, []store.Op{store.Put("k", nil)}) },
		"Ping":   func() error { return s.Ping(ctx) },
	}
	for name, call := range calls {
		err := call()
		if !errors.Is(err, store.ErrUnavailable) {
			t.Errorf("%s: err = %v, want ErrUnavailable", name, err)
			continue
		}
		if !strings.Contains(err.Error(), "127.0.0.1:1") {
			t.Errorf("%s: error %q does not name the endpoint", name, err)
		}
	}
	// The caller's cancellation is not "unavailable".
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := s.Get(cctx, "k"); !errors.Is(err, context.Canceled) || errors.Is(err, store.ErrUnavailable) {
		t.Errorf("Get with canceled ctx: err = %v, want context.Canceled only", err)
	}
}

func TestConfigErrors(t *testing.T) {
	dir := t.TempDir()
	notPEM := filepath.Join(dir, "ca.pem")
	if err := os.WriteFile(notPEM, []byte("not a certificate"), 0o600); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		cfg  etcd.Config
		want string
	}{
		{"no endpoints", etcd.Config{}, "no endpoints"},
		{"empty endpoint", etcd.Config{Endpoints: []string{" "}}, "empty endpoint"},
		{"negative timeout", etcd.Config{Endpoints: []string{"127.0.0.1:2379"}, RequestTimeout: -1}, "negative"},
		{"cert without key", etcd.Config{Endpoints: []string{"127.0.0.1:2379"}, TLS: &etcd.TLS{CertFile: "c.pem"}}, "together"},
		{"missing cert files", etcd.Config{Endpoints: []string{"127.0.0.1:2379"}, TLS: &etcd.TLS{CertFile: filepath.Join(dir, "c.pem"), KeyFile: filepath.Join(dir, "k.pem")}}, "c.pem"},
		{"missing CA", etcd.Config{Endpoints: []string{"127.0.0.1:2379"}, TLS: &etcd.TLS{CAFile: filepath.Join(dir, "none.pem")}}, "none.pem"},
		{"CA not PEM", etcd.Config{Endpoints: []string{"127.0.0.1:2379"}, TLS: &etcd.TLS{CAFile: notPEM}}, "no PEM"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s, err := etcd.New(tc.cfg)
			if err == nil {
				s.Close()
				t.Fatalf("New accepted %+v", tc.cfg)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %q does not mention %q", err, tc.want)
			}
		})
	}
}
