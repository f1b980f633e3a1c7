package storeconfig_test

import (
	"errors"
	"flag"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/ringipam/ringipam/pkg/storeconfig"
)

// parseFlags registers the store flags on a fresh FlagSet and parses args.
func parseFlags(t *testing.T, args ...string) (*storeconfig.Flags, error) {
	t.Helper()
	var f storeconfig.Flags
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	f.Register(fs)
	return &f, fs.Parse(args)
}

// The vocabulary is exactly the shared one, plus today's names as
// deprecated aliases.
func TestFlagNames(t *testing.T) {
	want := []string{"store", "store-path", "store-open-timeout", "etcd-endpoints", "etcd-prefix", "etcd-ca", "etcd-cert", "etcd-key",
		"etcd-username", "etcd-password-file", "etcd-dial-timeout", "etcd-request-timeout", "agent-socket"}
	if diff := cmp.Diff(want, storeconfig.FlagNames()); diff != "" {
		t.Errorf("names (-want +got):\n%s", diff)
	}
	var f storeconfig.Flags
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	f.Register(fs)
	var registered []string
	fs.VisitAll(func(fl *flag.Flag) {
		registered = append(registered, fl.Name)
		if slices.Contains([]string{"store-prefix", "etcd-cacert", "store-socket"}, fl.Name) && !strings.HasPrefix(fl.Usage, "deprecated: use --") {
			t.Errorf("alias --%s: usage %q", fl.Name, fl.Usage)
		}
	})
	for _, n := range append(want, "store-prefix", "etcd-cacert", "store-socket") {
		if !slices.Contains(registered, n) {
			t.Errorf("--%s not registered", n)
		}
	}
	if len(registered) != len(want)+3 {
		t.Errorf("registered %v", registered)
	}
}

func TestFlagsApply(t *testing.T) {
	pw := filepath.Join(t.TempDir(), "pw")
	if err := os.WriteFile(pw, []byte("s3cret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	etcdFile := storeconfig.Config{Type: "etcd", Endpoints: []string{"https://a:2379"}, Prefix: "/file/", TLS: &storeconfig.TLS{CA: "/file-ca.pem", Cert: "/c.pem", Key: "/k.pem"}}
	for _, tc := range []struct {
		name string
		base storeconfig.Config
		args []string
		want storeconfig.Config
		dep  []string
	}{
		{name: "nothing given", base: etcdFile, want: etcdFile},
		{name: "every flag", args: []string{"--store", "etcd", "--etcd-endpoints", "https://a:2379, https://b:2379", "--etcd-prefix", "/p/",
			"--etcd-ca", "/ca.pem", "--etcd-cert", "/c.pem", "--etcd-key", "/k.pem", "--etcd-username", "u", "--etcd-password-file", pw,
			"--etcd-dial-timeout", "2s", "--etcd-request-timeout", "3s", "--agent-socket", "/run/a.sock"},
			want: storeconfig.Config{Type: "etcd", Endpoints: []string{"https://a:2379", "https://b:2379"}, Prefix: "/p/",
				TLS: &storeconfig.TLS{CA: "/ca.pem", Cert: "/c.pem", Key: "/k.pem"}, Username: "u", Password: "s3cret",
				DialTimeout: storeconfig.Duration(2 * time.Second), RequestTimeout: storeconfig.Duration(3 * time.Second), AgentSocket: "/run/a.sock"}},
		{name: "local flags", args: []string{"--store", "local", "--store-path", "/s.db", "--store-open-timeout", "1s"},
			want: storeconfig.Config{Type: "local", Path: "/s.db", OpenTimeout: storeconfig.Duration(time.Second)}},
		{name: "deprecated aliases", args: []string{"--etcd-endpoints", "h:1", "--store-prefix", "/old/", "--etcd-cacert", "/ca.pem", "--store-socket", "/run/s.sock"},
			want: storeconfig.Config{Type: "etcd", Endpoints: []string{"h:1"}, Prefix: "/old/", TLS: &storeconfig.TLS{CA: "/ca.pem"}, AgentSocket: "/run/s.sock"},
			dep:  []string{"--store-prefix is deprecated: use --etcd-prefix", "--etcd-cacert is deprecated: use --etcd-ca", "--store-socket is deprecated: use --agent-socket"}},
		{name: "the last of a name and its alias wins", args: []string{"--etcd-endpoints", "h:1", "--etcd-prefix", "/new/", "--store-prefix", "/old/"},
			want: storeconfig.Config{Type: "etcd", Endpoints: []string{"h:1"}, Prefix: "/old/"}, dep: []string{"--store-prefix is deprecated: use --etcd-prefix"}},
		{name: "over a file: one TLS file replaced, the others kept", base: etcdFile, args: []string{"--etcd-ca", "/ca.pem"},
			want: storeconfig.Config{Type: "etcd", Endpoints: []string{"https://a:2379"}, Prefix: "/file/", TLS: &storeconfig.TLS{CA: "/ca.pem", Cert: "/c.pem", Key: "/k.pem"}}},
		{name: "another type starts afresh", base: etcdFile, args: []string{"--store", "local"}, want: storeconfig.Config{Type: "local"}},
		{name: "the same type keeps the file", base: etcdFile, args: []string{"--store", "etcd", "--etcd-prefix", "/q/"},
			want: storeconfig.Config{Type: "etcd", Endpoints: []string{"https://a:2379"}, Prefix: "/q/", TLS: &storeconfig.TLS{CA: "/file-ca.pem", Cert: "/c.pem", Key: "/k.pem"}}},
		{name: "--store etcd after endpoints, from the driver's default local", base: storeconfig.Config{Type: "local"}, args: []string{"--etcd-endpoints", "h:1", "--store", "etcd"},
			want: storeconfig.Config{Type: "etcd", Endpoints: []string{"h:1"}}},
		{name: "endpoints make an untyped store etcd", args: []string{"--etcd-endpoints", "h:1"}, want: storeconfig.Config{Type: "etcd", Endpoints: []string{"h:1"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, err := parseFlags(t, tc.args...)
			if err != nil {
				t.Fatal(err)
			}
			c := tc.base
			if c.TLS != nil {
				tls := *c.TLS
				c.TLS = &tls
			}
			if err := f.Apply(&c); err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(tc.want, c); diff != "" {
				t.Errorf("config (-want +got):\n%s", diff)
			}
			if diff := cmp.Diff(tc.dep, f.Deprecated()); diff != "" {
				t.Errorf("deprecations (-want +got):\n%s", diff)
			}
			if tc.base.TLS != nil && *tc.base.TLS != *etcdFile.TLS {
				t.Errorf("Apply changed the file's TLS object in place")
			}
		})
	}
}

func TestFlagsRefused(t *testing.T) {
	for _, args := range [][]string{
		{"--store", "zk"},
		{"--etcd-dial-timeout", "soon"},
		{"--etcd-request-timeout", "-1s"},
		{"--store-open-timeout", "5"},
	} {
		if _, err := parseFlags(t, args...); err == nil {
			t.Errorf("%q accepted", args)
		}
	}
	f, err := parseFlags(t, "--etcd-endpoints", "h:1", "--etcd-password-file", filepath.Join(t.TempDir(), "missing"))
	if err != nil {
		t.Fatal(err)
	}
	var c storeconfig.Config
	if err := f.Apply(&c); !errors.Is(err, storeconfig.ErrInvalid) || !strings.Contains(err.Error(), "--etcd-password-file") {
		t.Errorf("missing password file: %v", err)
	}
	// "off" passes the flag but not validation: the plugins reach etcd
	// only through the agent.
	f, err = parseFlags(t, "--etcd-endpoints", "h:1", "--agent-socket", "off")
	if err != nil {
		t.Fatal(err)
	}
	c = storeconfig.Config{}
	if err := f.Apply(&c); err != nil {
		t.Fatal(err)
	}
	if err := c.Validate(); !errors.Is(err, storeconfig.ErrInvalid) || !strings.Contains(err.Error(), "only through the host agent") {
		t.Errorf("--agent-socket off: %v", err)
	}
}

func TestFlagsFromEnv(t *testing.T) {
	env := map[string]string{"X_STORE": "etcd", "X_ETCD_ENDPOINTS": "h:1", "X_ETCD_PREFIX": "/env/", "X_AGENT_SOCKET": "/run/env.sock", "X_STORE_PREFIX": "/alias-not-read/"}
	f, err := parseFlags(t, "--etcd-prefix", "/flag/")
	if err != nil {
		t.Fatal(err)
	}
	if err := f.FromEnv("X_", func(k string) string { return env[k] }); err != nil {
		t.Fatal(err)
	}
	var c storeconfig.Config
	if err := f.Apply(&c); err != nil {
		t.Fatal(err)
	}
	want := storeconfig.Config{Type: "etcd", Endpoints: []string{"h:1"}, Prefix: "/flag/", AgentSocket: "/run/env.sock"}
	if diff := cmp.Diff(want, c); diff != "" {
		t.Errorf("config (-want +got):\n%s", diff)
	}
	var g storeconfig.Flags
	if err := g.FromEnv("X_", func(k string) string { return map[string]string{"X_ETCD_DIAL_TIMEOUT": "soon"}[k] }); err == nil || !strings.Contains(err.Error(), "X_ETCD_DIAL_TIMEOUT") {
		t.Errorf("bad duration in the environment: %v", err)
	}
}
