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

// Dialer returns the TLS dialer of files (nil: system roots, no client
// certificate); the files are read once, here.
func Dialer(files *etcdjson.TLS) (etcdjson.TLSDialer, error) {
	base := &tls.Config{MinVersion: tls.VersionTLS12}
	if files != nil && files.CAFile != "" {
		pem, err := os.ReadFile(files.CAFile)
		if err != nil {
			return nil, fmt.Errorf("tls ca: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("tls ca %s holds no PEM certificate", files.CAFile)
		}
		base.RootCAs = pool
	}
	if files != nil && files.CertFile != "" {
		cert, err := tls.LoadX509KeyPair(files.CertFile, files.KeyFile)
		if err != nil {
			return nil, fmt.Errorf("tls client certificate: %w", err)
		}
		base.Certificates = []tls.Certificate{cert}
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
