//go:build integration

package testenv_test

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ringipam/ringipam/internal/testenv"
)

// get fetches ep/health with the given TLS client config (nil: plain http).
func get(t *testing.T, ep string, tc *tls.Config) (string, error) {
	t.Helper()
	tr := &http.Transport{TLSClientConfig: tc}
	defer tr.CloseIdleConnections()
	hc := &http.Client{Timeout: 5 * time.Second, Transport: tr}
	resp, err := hc.Get(ep + "/health")
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 1024))
	return resp.Status + " " + string(b), err
}

// The TLS server speaks https only, wants a client certificate from its CA,
// and survives Stop/Start with the same certificates.
func TestEtcdTLS(t *testing.T) {
	e, files := testenv.StartEtcdTLS(t)
	ep := e.Endpoints()[0]
	if !strings.HasPrefix(ep, "https://127.0.0.1:") {
		t.Fatalf("endpoint %q, want https://127.0.0.1:port", ep)
	}
	for _, f := range []string{files.CA, files.Cert, files.Key, files.ServerCert, files.ServerKey} {
		if _, err := os.Stat(f); err != nil {
			t.Fatal(err)
		}
	}
	good, err := files.ClientConfig()
	if err != nil {
		t.Fatal(err)
	}
	if body, err := get(t, ep, good); err != nil || !strings.Contains(body, `"health":"true"`) {
		t.Fatalf("health with client certificate: %q, %v", body, err)
	}

	// The JSON gateway works too: etcd dials its own gRPC port with the
	// server certificate as a client certificate (see NewTLSFiles).
	tr := &http.Transport{TLSClientConfig: good}
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Timeout: 10 * time.Second, Transport: tr}).Post(ep+"/v3/kv/range", "application/json", strings.NewReader(`{"key":"Zm9v"}`))
	if err != nil {
		t.Fatalf("gateway: %v", err)
	}
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1024))
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(b), `"revision"`) {
		t.Fatalf("gateway /v3/kv/range: %s %s", resp.Status, b)
	}

	// No client certificate: the server ends the handshake.
	noCert := good.Clone()
	noCert.Certificates = nil
	if body, err := get(t, ep, noCert); err == nil {
		t.Errorf("health without client certificate answered %q", body)
	} else {
		t.Logf("without client certificate: %v", err)
	}

	// A client certificate from another CA is refused as well.
	other := testenv.NewTLSFiles(t, t.TempDir())
	otherCfg, err := other.ClientConfig()
	if err != nil {
		t.Fatal(err)
	}
	foreign := good.Clone()
	foreign.Certificates = otherCfg.Certificates
	if body, err := get(t, ep, foreign); err == nil {
		t.Errorf("health with a foreign client certificate answered %q", body)
	} else {
		t.Logf("with a foreign client certificate: %v", err)
	}

	// The client does not trust a server certificate from another CA.
	var uae x509.UnknownAuthorityError
	if body, err := get(t, ep, otherCfg); !errors.As(err, &uae) {
		t.Errorf("client trusting another CA: %q, %v; want x509.UnknownAuthorityError", body, err)
	}

	// Plain http on the TLS port gets no health answer.
	if body, err := get(t, "http"+strings.TrimPrefix(ep, "https"), nil); err == nil && strings.Contains(body, `"health":"true"`) {
		t.Errorf("plain http answered %q", body)
	}

	e.Stop()
	if _, err := get(t, ep, good); err == nil {
		t.Fatal("stopped etcd still answers")
	}
	e.Start()
	if e.Endpoints()[0] != ep {
		t.Fatalf("restart moved from %s to %s", ep, e.Endpoints()[0])
	}
	if body, err := get(t, ep, good); err != nil || !strings.Contains(body, `"health":"true"`) {
		t.Fatalf("health after restart: %q, %v", body, err)
	}
}
