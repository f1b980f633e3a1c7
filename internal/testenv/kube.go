package testenv

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/csv"
	"encoding/pem"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// KubeUser is one identity of a test's kube-apiserver: a line of its
// static token file (--token-auth-file) and a kubeconfig of its own.
type KubeUser struct {
	// Name is the user name the apiserver sees ("system:node:node-a").
	Name string
	// Groups are the user's groups ("system:nodes"); none when empty.
	Groups []string
	// Kubeconfig is the name of the user's kubeconfig file in the
	// directory WriteKubeUsers writes to.
	Kubeconfig string
	// Namespace is the kubeconfig's namespace; none when empty.
	Namespace string
}

// WriteKubeCredentials writes into dir what a test's kube-apiserver and
// its clients need: tokens.csv (one admin token, system:masters; for
// --token-auth-file), the service-account signing key pair sa.key and
// sa.pub, and a kubeconfig for server (its certificate not verified) with
// that token, in namespace when it is not empty. It returns the token.
func WriteKubeCredentials(t testing.TB, dir, server, namespace string) string {
	t.Helper()
	admin := KubeUser{Name: "admin", Groups: []string{"system:masters"}, Kubeconfig: "kubeconfig", Namespace: namespace}
	return WriteKubeUsers(t, dir, server, admin)[admin.Name]
}

// WriteKubeUsers writes into dir tokens.csv with a random token for each
// user (token,user,uid,"group1,group2", the uid the user's name), the
// service-account signing key pair sa.key and sa.pub, and each user's
// kubeconfig (WriteKubeconfig). It returns the tokens by user name. The
// token file is read once, when the apiserver starts: every identity the
// test will use must be in it.
func WriteKubeUsers(t testing.TB, dir, server string, users ...KubeUser) map[string]string {
	t.Helper()
	tokens := map[string]string{}
	var lines strings.Builder
	w := csv.NewWriter(&lines)
	for _, u := range users {
		if _, dup := tokens[u.Name]; dup {
			t.Fatalf("WriteKubeUsers: user %s twice", u.Name)
		}
		var b [16]byte
		rand.Read(b[:])
		tokens[u.Name] = fmt.Sprintf("%x", b)
		record := []string{tokens[u.Name], u.Name, u.Name}
		if len(u.Groups) > 0 {
			record = append(record, strings.Join(u.Groups, ","))
		}
		if err := w.Write(record); err != nil {
			t.Fatal(err)
		}
	}
	w.Flush()
	writeFile(t, filepath.Join(dir, "tokens.csv"), lines.String())
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	der, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(dir, "sa.key"), string(pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der})))
	pub, err := x509.MarshalPKIXPublicKey(&key.PublicKey)
	if err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(dir, "sa.pub"), string(pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pub})))
	for _, u := range users {
		WriteKubeconfig(t, filepath.Join(dir, u.Kubeconfig), server, tokens[u.Name], u.Namespace)
	}
	return tokens
}

// WriteKubeconfig writes the kubeconfig file path for server (its
// certificate not verified) with the bearer token, in namespace when it
// is not empty: a user of the token file, or a service account's token
// from the TokenRequest API.
func WriteKubeconfig(t testing.TB, path, server, token, namespace string) {
	t.Helper()
	ns := ""
	if namespace != "" {
		ns = ", namespace: " + namespace
	}
	writeFile(t, path, fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: test
  cluster:
    server: %s
    insecure-skip-tls-verify: true
users:
- name: user
  user:
    token: %s
contexts:
- name: test
  context: {cluster: test, user: user%s}
current-context: test
`, server, token, ns))
}

func writeFile(t testing.TB, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
}
