package main

import (
	"context"
	"encoding/pem"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

// TestAsk runs ask against a TLS server standing for the apiserver: the
// request carries the pod's token to its namespace's DaemonSet, and each
// answer maps to the verdict of the package comment.
func TestAsk(t *testing.T) {
	answer := struct {
		status int
		body   string
	}{}
	var gotPath, gotAuth string
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		gotPath, gotAuth = r.URL.Path, r.Header.Get("Authorization")
		w.WriteHeader(answer.status)
		w.Write([]byte(answer.body))
	}))
	defer srv.Close()
	dir := t.TempDir()
	ca := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw})
	for name, content := range map[string]string{"token": "tok\n", "namespace": "ringipam-system", "ca.crt": string(ca)} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	host, port, _ := net.SplitHostPort(strings.TrimPrefix(srv.URL, "https://"))
	env := map[string]string{"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": port}
	c := inCluster{dir: dir, env: func(k string) string { return env[k] }}

	for _, tc := range []struct {
		status    int
		body      string
		uninstall bool
		err       bool
	}{
		{200, `{"metadata":{"name":"ringipam"}}`, false, false},
		{200, `{"metadata":{"name":"ringipam","deletionTimestamp":"2026-11-26T17:00:00Z"}}`, true, false},
		{404, `{"kind":"Status"}`, true, false},
		{401, `{"kind":"Status"}`, true, false},
		{403, `{"kind":"Status"}`, true, false},
		{500, `oops`, false, true},
		{200, `not json`, false, true},
	} {
		answer.status, answer.body = tc.status, tc.body
		v, err := ask(context.Background(), c, "ringipam")
		if (err != nil) != tc.err || v.uninstall != tc.uninstall {
			t.Errorf("%d %s: verdict %+v, error %v; want uninstall %v, error %v", tc.status, tc.body, v, err, tc.uninstall, tc.err)
		}
		if gotPath != "/apis/apps/v1/namespaces/ringipam-system/daemonsets/ringipam" || gotAuth != "Bearer tok" {
			t.Errorf("request %s with %q", gotPath, gotAuth)
		}
	}

	// No apiserver at all: keep (an error).
	srv.Close()
	if v, err := ask(context.Background(), c, "ringipam"); err == nil || v.uninstall {
		t.Errorf("apiserver gone: verdict %+v, error %v; want an error", v, err)
	}
	env = map[string]string{}
	if _, err := ask(context.Background(), c, "ringipam"); err == nil {
		t.Error("no KUBERNETES_SERVICE_HOST: no error")
	}
}

// TestUninstall removes exactly the record's files under the root, then the
// record; a path outside the root is left alone (and the record kept).
func TestUninstall(t *testing.T) {
	dir := t.TempDir()
	root := filepath.Join(dir, "host")
	mk := func(p string) string {
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte("x"), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	ours := []string{mk(filepath.Join(root, "opt/cni/bin/ipam-ring")), mk(filepath.Join(root, "etc/cni/net.d/10-ringipam.conflist"))}
	gone := filepath.Join(root, "opt/cni/bin/loopback") // in the record, already removed
	other := mk(filepath.Join(root, "opt/cni/bin/bridge"))
	record := filepath.Join(dir, "installed")
	if err := os.WriteFile(record, []byte(strings.Join(append(ours, gone), "\n")+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	removed, err := uninstall(record, root+"/")
	if err != nil || !reflect.DeepEqual(removed, ours) {
		t.Fatalf("removed %q, %v; want %q", removed, err, ours)
	}
	for _, p := range append(ours, record) {
		if _, err := os.Stat(p); !os.IsNotExist(err) {
			t.Errorf("%s still there: %v", p, err)
		}
	}
	if _, err := os.Stat(other); err != nil {
		t.Errorf("a file not in the record was removed: %v", err)
	}
	// Again: nothing recorded, nothing to do.
	if removed, err := uninstall(record, root+"/"); err != nil || len(removed) != 0 {
		t.Errorf("second uninstall: %q, %v", removed, err)
	}

	outside := mk(filepath.Join(dir, "etc/passwd"))
	if err := os.WriteFile(record, []byte(outside+"\n"+root+"/../etc/passwd\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := uninstall(record, root+"/"); err == nil {
		t.Error("paths outside the root: no error")
	}
	if _, err := os.Stat(outside); err != nil {
		t.Errorf("a path outside the root was removed: %v", err)
	}
	if _, err := os.Stat(record); err != nil {
		t.Errorf("the record went although some of it was refused: %v", err)
	}
}
