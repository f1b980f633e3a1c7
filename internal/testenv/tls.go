package testenv

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// TLSFiles are the PEM files of a small test PKI made by NewTLSFiles: one CA
// and a server and a client certificate it signed. CA, Cert and Key are what
// a client needs (etcd.TLS{CAFile, CertFile, KeyFile}, the "tls" object of a
// store config); ServerCert and ServerKey are the server's.
type TLSFiles struct {
	CA         string // CA certificate
	Cert       string // client certificate (CN "ringipam-test-client")
	Key        string // client private key
	ServerCert string // server certificate for 127.0.0.1, ::1 and localhost
	ServerKey  string // server private key
}

// NewTLSFiles creates a fresh CA (ECDSA P-256) with a server and a client
// certificate in dir and returns the file names. Every call makes an
// unrelated CA, so a second call gives a "wrong CA" for negative tests. The
// certificates are valid from an hour ago for a day. It fails tb on error.
func NewTLSFiles(tb testing.TB, dir string) TLSFiles {
	tb.Helper()
	f, err := newTLSFiles(dir)
	if err != nil {
		tb.Fatalf("testenv: TLS files: %v", err)
	}
	return f
}

func newTLSFiles(dir string) (TLSFiles, error) {
	f := TLSFiles{
		CA:         filepath.Join(dir, "ca.pem"),
		Cert:       filepath.Join(dir, "client.pem"),
		Key:        filepath.Join(dir, "client-key.pem"),
		ServerCert: filepath.Join(dir, "server.pem"),
		ServerKey:  filepath.Join(dir, "server-key.pem"),
	}
	now := time.Now()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return f, err
	}
	caTmpl := &x509.Certificate{
		Subject:               pkix.Name{CommonName: "ringipam test CA", Organization: []string{"ringipam tests"}},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	caDER, err := sign(caTmpl, caTmpl, caKey, caKey)
	if err != nil {
		return f, fmt.Errorf("CA: %w", err)
	}
	caCert, err := x509.ParseCertificate(caDER)
	if err != nil {
		return f, err
	}
	if err := writePEM(f.CA, "CERTIFICATE", caDER, 0o644); err != nil {
		return f, err
	}
	leaf := func(cn string, usage []x509.ExtKeyUsage, ips []net.IP, dns []string, certFile, keyFile string) error {
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			return err
		}
		tmpl := &x509.Certificate{
			Subject:               pkix.Name{CommonName: cn, Organization: []string{"ringipam tests"}},
			NotBefore:             now.Add(-time.Hour),
			NotAfter:              now.Add(24 * time.Hour),
			KeyUsage:              x509.KeyUsageDigitalSignature,
			ExtKeyUsage:           usage,
			BasicConstraintsValid: true,
			IPAddresses:           ips,
			DNSNames:              dns,
		}
		der, err := sign(tmpl, caCert, key, caKey)
		if err != nil {
			return fmt.Errorf("%s: %w", cn, err)
		}
		keyDER, err := x509.MarshalPKCS8PrivateKey(key)
		if err != nil {
			return err
		}
		if err := writePEM(certFile, "CERTIFICATE", der, 0o644); err != nil {
			return err
		}
		return writePEM(keyFile, "PRIVATE KEY", keyDER, 0o600)
	}
	// etcd 3.4 also presents its server certificate as a *client*
	// certificate: its HTTP gateway dials its own gRPC port with it. With
	// --client-cert-auth that needs ClientAuth next to ServerAuth.
	if err := leaf("127.0.0.1", []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		[]net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback}, []string{"localhost"}, f.ServerCert, f.ServerKey); err != nil {
		return f, err
	}
	if err := leaf("ringipam-test-client", []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
		nil, nil, f.Cert, f.Key); err != nil {
		return f, err
	}
	return f, nil
}

// ClientConfig returns a TLS client configuration that trusts f.CA and
// presents the client certificate.
func (f TLSFiles) ClientConfig() (*tls.Config, error) {
	pair, err := tls.LoadX509KeyPair(f.Cert, f.Key)
	if err != nil {
		return nil, err
	}
	pemBytes, err := os.ReadFile(f.CA)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pemBytes) {
		return nil, errors.New(f.CA + ": no PEM certificate")
	}
	return &tls.Config{MinVersion: tls.VersionTLS12, RootCAs: pool, Certificates: []tls.Certificate{pair}}, nil
}

func sign(tmpl, parent *x509.Certificate, key, parentKey *ecdsa.PrivateKey) ([]byte, error) {
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return nil, err
	}
	tmpl.SerialNumber = serial.Add(serial, big.NewInt(1)) // serials must be positive
	return x509.CreateCertificate(rand.Reader, tmpl, parent, &key.PublicKey, parentKey)
}

func writePEM(path, typ string, der []byte, mode os.FileMode) error {
	return os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), mode)
}
