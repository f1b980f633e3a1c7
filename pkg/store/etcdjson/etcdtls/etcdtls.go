// Package etcdtls gives package etcdjson its TLS: importing it (for its
// side effect) sets etcdjson.TLSSupport to crypto/tls with the PEM files of
// a store config: TLS 1.2 or later, the servers verified against the CA
// bundle (the system's roots when none is named) and by name, and the
// client certificate presented when one is named.
//
// The long-running programs (the Docker driver, ringctl, the agent) import
// it; the CNI plugins do not, so that a plugin process does not load and
// initialise a TLS stack on every invocation: they reach an etcd over TLS
// through the host agent's store socket (package relay).
package etcdtls

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"os"

	"github.com/ringipam/ringipam/pkg/store/etcdjson"
)

func init() { etcdjson.TLSSupport = Dialer }

// Config is the TLS client configuration of files (nil: the system's
// roots, no client certificate): TLS 1.2 or later; the files are read
// here. The gRPC store (package etcd) builds its configuration with it too.
func Config(files *etcdjson.TLS) (*tls.Config, error) {
	tc := &tls.Config{MinVersion: tls.VersionTLS12}
	if files == nil {
		return tc, nil
	}
	if files.CertFile != "" {
		pair, err := tls.LoadX509KeyPair(files.CertFile, files.KeyFile)
		if err != nil {
			return nil, fmt.Errorf("tls: client certificate %s / key %s: %w", files.CertFile, files.KeyFile, err)
		}
		tc.Certificates = []tls.Certificate{pair}
	}
	if files.CAFile != "" {
		pem, err := os.ReadFile(files.CAFile)
		if err != nil {
			return nil, fmt.Errorf("tls: CA: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("tls: CA %s: no PEM certificate found", files.CAFile)
		}
		tc.RootCAs = pool
	}
	return tc, nil
}

// Dialer returns the TLS dialer of files (see Config): each connection
// checks the server's name.
func Dialer(files *etcdjson.TLS) (etcdjson.TLSDialer, error) {
	base, err := Config(files)
	if err != nil {
		return nil, err
	}
	return func(ctx context.Context, c net.Conn, serverName string) (net.Conn, error) {
		cfg := base.Clone()
		cfg.ServerName = serverName
		tc := tls.Client(c, cfg)
		if err := tc.HandshakeContext(ctx); err != nil {
			return nil, err
		}
		return tc, nil
	}, nil
}
