package etcd

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"strings"
	"syscall"
	"time"
)

// alertWait is how long CheckTLS waits after a completed handshake for the
// server to reject the client certificate. With TLS 1.3 the client finishes
// its handshake before the server has checked the certificate, so a refusal
// only arrives as an alert on the first read; a server that accepted the
// client sends nothing (it waits for the HTTP/2 preface) and the wait ends.
const alertWait = 300 * time.Millisecond

// CheckTLS opens a TLS connection to every endpoint of cfg with cfg's TLS
// settings, to explain failures that the etcd client reports only as a
// timeout (store.ErrUnavailable with "context deadline exceeded"): an
// unknown CA, a server certificate for another name, a missing or refused
// client certificate, a server without TLS, or an http:// endpoint where
// tls is set (the client then speaks plain text and ignores tls). It returns
// nil if every endpoint accepted the handshake, else one error naming each
// failing endpoint, the cause and what to change. It takes at most
// cfg.DialTimeout (DefaultDialTimeout if zero) or ctx's deadline per
// endpoint, plus a short wait for a post-handshake refusal.
func CheckTLS(ctx context.Context, cfg Config) error {
	tc, err := tlsConfig(cfg.TLS)
	if err != nil {
		return err
	}
	timeout := cfg.DialTimeout
	if timeout <= 0 {
		timeout = DefaultDialTimeout
	}
	var errs []error
	for _, ep := range cfg.Endpoints {
		if err := checkEndpointTLS(ctx, ep, cfg.TLS, tc, timeout); err != nil {
			errs = append(errs, fmt.Errorf("etcd endpoint %s: %w", ep, err))
		}
	}
	return errors.Join(errs...)
}

func checkEndpointTLS(ctx context.Context, ep string, files *TLS, tc *tls.Config, timeout time.Duration) error {
	hostport := ep
	if strings.Contains(ep, "://") {
		u, err := url.Parse(ep)
		if err != nil {
			return err
		}
		switch u.Scheme {
		case "https":
		case "http":
			if files.set() {
				return errors.New("http:// endpoint: the etcd client speaks plain text to it and ignores the tls settings; write https://")
			}
			return nil
		default:
			return nil // unix sockets: nothing to check here
		}
		hostport = u.Host
	} else if !files.set() {
		return nil // bare host:port without tls settings is plain text
	}
	host, _, err := net.SplitHostPort(hostport)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	raw, err := (&net.Dialer{}).DialContext(ctx, "tcp", hostport)
	if err != nil {
		return fmt.Errorf("not reachable: %w", err)
	}
	defer raw.Close()
	c := tc.Clone()
	c.ServerName = host
	c.NextProtos = []string{"h2"}
	conn := tls.Client(raw, c)
	err = conn.HandshakeContext(ctx)
	if err == nil {
		// A refused client certificate (TLS 1.3) shows up on the first read.
		_ = conn.SetReadDeadline(time.Now().Add(alertWait))
		var b [1]byte
		_, err = conn.Read(b[:])
		var ne net.Error
		if err == nil || (errors.As(err, &ne) && ne.Timeout()) {
			return nil
		}
	}
	return explainTLS(err, host, files)
}

// explainTLS turns a handshake error into an error with a hint.
func explainTLS(err error, host string, files *TLS) error {
	ca := "the system roots (no tls.ca given)"
	if files != nil && files.CAFile != "" {
		ca = "the CA in " + files.CAFile
	}
	var (
		unknown  x509.UnknownAuthorityError
		hostname x509.HostnameError
		invalid  x509.CertificateInvalidError
		record   tls.RecordHeaderError
		op       *net.OpError
	)
	switch {
	case errors.As(err, &unknown):
		return fmt.Errorf("server certificate is not signed by %s; set tls.ca to the CA that signed etcd's --cert-file: %w", ca, err)
	case errors.As(err, &hostname):
		return fmt.Errorf("server certificate is not valid for %q; use an endpoint address listed in the certificate, or reissue it: %w", host, err)
	case errors.As(err, &invalid):
		return fmt.Errorf("server certificate rejected: %w", err)
	case errors.As(err, &record):
		return fmt.Errorf("server does not speak TLS on this port; use http:// or enable TLS on etcd: %w", err)
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, syscall.ECONNRESET):
		// etcd without TLS reads the ClientHello as garbage and hangs up.
		return fmt.Errorf("server hung up during the TLS handshake; it probably does not speak TLS on this port (use http://, or enable TLS on etcd): %w", err)
	case errors.As(err, &op) && op.Op == "remote error": // an alert the server sent
		if files == nil || files.CertFile == "" {
			return fmt.Errorf("server refused the connection, most likely because it requires a client certificate (--client-cert-auth); set tls.cert and tls.key: %w", err)
		}
		return fmt.Errorf("server refused the client certificate %s; it must be signed by a CA in etcd's --trusted-ca-file and allow client authentication: %w", files.CertFile, err)
	case errors.Is(err, os.ErrDeadlineExceeded) || errors.Is(err, context.DeadlineExceeded):
		return fmt.Errorf("TLS handshake timed out: %w", err)
	default:
		return fmt.Errorf("TLS handshake failed: %w", err)
	}
}
