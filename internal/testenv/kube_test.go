package testenv_test

import (
	"encoding/csv"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/ringipam/ringipam/internal/testenv"
)

// TestWriteKubeUsers: one line of the token file per user, as
// kube-apiserver's --token-auth-file reads it (CSV: token, user, uid,
// then the groups as one quoted field), and each user's kubeconfig names
// its own token.
func TestWriteKubeUsers(t *testing.T) {
	dir := t.TempDir()
	users := []testenv.KubeUser{
		{Name: "system:node:n1", Groups: []string{"system:nodes", "extra"}, Kubeconfig: "k-n1"},
		{Name: "system:kube-scheduler", Kubeconfig: "k-sched", Namespace: "kube-system"},
	}
	tokens := testenv.WriteKubeUsers(t, dir, "https://192.0.2.1:6443", users...)
	b, err := os.ReadFile(filepath.Join(dir, "tokens.csv"))
	if err != nil {
		t.Fatal(err)
	}
	r := csv.NewReader(strings.NewReader(string(b)))
	r.FieldsPerRecord = -1 // as the apiserver reads it: the groups are optional
	records, err := r.ReadAll()
	if err != nil {
		t.Fatalf("tokens.csv: %v\n%s", err, b)
	}
	want := [][]string{
		{tokens[users[0].Name], "system:node:n1", "system:node:n1", "system:nodes,extra"},
		{tokens[users[1].Name], "system:kube-scheduler", "system:kube-scheduler"},
	}
	if !slices.EqualFunc(records, want, slices.Equal[[]string]) {
		t.Errorf("tokens.csv records %q, want %q", records, want)
	}
	if tokens[users[0].Name] == tokens[users[1].Name] || tokens[users[0].Name] == "" {
		t.Errorf("tokens not distinct: %q", tokens)
	}
	for _, u := range users {
		k, err := os.ReadFile(filepath.Join(dir, u.Kubeconfig))
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(string(k), "token: "+tokens[u.Name]+"\n") {
			t.Errorf("%s does not name %s's token:\n%s", u.Kubeconfig, u.Name, k)
		}
		if hasNS := strings.Contains(string(k), "namespace: kube-system"); hasNS != (u.Namespace != "") {
			t.Errorf("%s: namespace line %v, want %v:\n%s", u.Kubeconfig, hasNS, u.Namespace != "", k)
		}
	}
	for _, f := range []string{"sa.key", "sa.pub"} {
		if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
			t.Error(err)
		}
	}
}
