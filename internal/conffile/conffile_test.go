package conffile

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestPath(t *testing.T) {
	for _, tc := range []struct {
		args []string
		env  string
		want string
	}{
		{nil, "", ""},
		{nil, "/env.json", "/env.json"},
		{[]string{"--config", "/a.json"}, "/env.json", "/a.json"},
		{[]string{"-config=/b.json", "--host", "x"}, "", "/b.json"},
		{[]string{"--host", "config"}, "/env.json", "/env.json"},
		{[]string{"--config"}, "/env.json", "/env.json"}, // the flag set reports the missing value
	} {
		if got := Path(tc.args, tc.env); got != tc.want {
			t.Errorf("Path(%q, %q) = %q, want %q", tc.args, tc.env, got, tc.want)
		}
	}
}

func TestDecode(t *testing.T) {
	type conf struct {
		Host string `json:"host"`
		Keep string `json:"keep"`
	}
	dir := t.TempDir()
	good := filepath.Join(dir, "good.json")
	bad := filepath.Join(dir, "bad.json")
	os.WriteFile(good, []byte(`{"host": "h1"}`), 0o600)
	os.WriteFile(bad, []byte(`{"host": "h1", "hots": "typo"}`), 0o600)

	c := conf{Host: "default", Keep: "kept"}
	if err := Decode("", &c); err != nil || c.Host != "default" {
		t.Fatalf("no file: %v %+v", err, c)
	}
	if err := Decode(good, &c); err != nil || c.Host != "h1" || c.Keep != "kept" {
		t.Fatalf("good file: %v %+v, want host h1 over the defaults", err, c)
	}
	if err := Decode(bad, &c); err == nil || !strings.Contains(err.Error(), "bad.json") || !strings.Contains(err.Error(), "hots") {
		t.Fatalf("unknown key: %v, want an error naming the file and the key", err)
	}
	if err := Decode(filepath.Join(dir, "missing.json"), &c); err == nil {
		t.Fatal("a missing file decoded")
	}
}
