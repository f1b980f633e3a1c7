package testenv

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

// WriteKubeCredentials writes into dir what a test's kube-apiserver and
// its clients need: tokens.csv (one admin token, system:masters; for
// --token-auth-file), the service-account signing key pair sa.key and
// sa.pub, and a kubeconfig for server (its certificate not verified) with
// that token, in namespace when it is not empty. It returns the token.
func WriteKubeCredentials(t testing.TB, dir, server, namespace string) string {
	t.Helper()
	var b [16]byte
	rand.Read(b[:])
	token := fmt.Sprintf("%x", b)
	write := func(name, content string) {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("tokens.csv", token+",admin,admin,system:masters\n")
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	der, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	write("sa.key", string(pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der})))
	pub, err := x509.MarshalPKIXPublicKey(&key.PublicKey)
	if err != nil {
		t.Fatal(err)
	}
	write("sa.pub", string(pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pub})))
	ns := ""
	if namespace != "" {
		ns = ", namespace: " + namespace
	}
	write("kubeconfig", fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: test
  cluster:
    server: %s
    insecure-skip-tls-verify: true
users:
- name: admin
  user:
    token: %s
contexts:
- name: test
  context: {cluster: test, user: admin%s}
current-context: test
`, server, token, ns))
	return token
}
