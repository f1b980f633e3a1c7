package storeconfig

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"
)

// Flags is the one command-line vocabulary of a store, shared by the host
// agent, the Docker driver and ringctl:
//
//	--store local|etcd        --store-path FILE        --store-open-timeout D
//	--etcd-endpoints URLS     --etcd-prefix P          --etcd-ca FILE
//	--etcd-cert FILE          --etcd-key FILE          --etcd-username USER
//	--etcd-password-file FILE --etcd-dial-timeout D    --etcd-request-timeout D
//	--agent-socket PATH
//
// and, as deprecated aliases, --store-prefix (--etcd-prefix), --etcd-cacert
// (--etcd-ca) and --store-socket (--agent-socket).
//
// Register adds them to a flag.FlagSet; setting a flag (from the command
// line, or from the environment through the same flag.Value) only records
// its value, the last one given winning, and refuses a malformed one
// (an unknown store type, a bad or negative duration). Apply then lays
// the recorded values over a Config read from a file or from defaults.
// The zero value is ready to use.
type Flags struct {
	given      map[string]string // canonical name -> value
	deprecated []string          // aliases used, as "--old (use --new)"
}

// storeFlag is one flag of the vocabulary.
type storeFlag struct {
	name, alias string
	usage       string
	check       func(string) error // nil: any value
}

var storeFlags = []storeFlag{
	{name: "store", usage: "state store `type`: local or etcd", check: func(s string) error {
		if s != TypeLocal && s != TypeEtcd {
			return fmt.Errorf("store type %q: want local or etcd", s)
		}
		return nil
	}},
	{name: "store-path", usage: "local store: the bbolt `FILE` (default /var/lib/ringipam/store.db)"},
	{name: "store-open-timeout", usage: "local store: longest wait for the file lock (default 5s)", check: checkDuration},
	{name: "etcd-endpoints", usage: "etcd: client `URLs`, comma-separated"},
	{name: "etcd-prefix", alias: "store-prefix", usage: "key `prefix` in the store (etcd default /ringipam/)"},
	{name: "etcd-ca", alias: "etcd-cacert", usage: "etcd: CA bundle `FILE` verifying the servers (default: the system's roots)"},
	{name: "etcd-cert", usage: "etcd: client certificate `FILE`"},
	{name: "etcd-key", usage: "etcd: client key `FILE`"},
	{name: "etcd-username", usage: "etcd: `USER` to authenticate as"},
	{name: "etcd-password-file", usage: "etcd: `FILE` holding the user's password (one line)"},
	{name: "etcd-dial-timeout", usage: "etcd: connection set-up timeout (default 5s)", check: checkDuration},
	{name: "etcd-request-timeout", usage: "etcd: deadline of one store call (default 10s)", check: checkDuration},
	{name: "agent-socket", alias: "store-socket", usage: "etcd: the host agent's `socket` (default " + DefaultAgentSocket + ")"},
}

// FlagNames are the canonical names of the store flags, in the order of
// the package doc (aliases not included).
func FlagNames() []string {
	names := make([]string, len(storeFlags))
	for i, f := range storeFlags {
		names[i] = f.name
	}
	return names
}

func checkDuration(s string) error {
	_, err := parseFlagDuration(s)
	return err
}

func parseFlagDuration(s string) (time.Duration, error) {
	v, err := time.ParseDuration(s)
	if err != nil {
		return 0, err
	}
	if v < 0 {
		return 0, fmt.Errorf("negative duration %s", s)
	}
	return v, nil
}

// Register adds the store flags and their deprecated aliases to fs.
func (f *Flags) Register(fs *flag.FlagSet) {
	for _, sf := range storeFlags {
		fs.Var(&flagValue{f: f, def: sf, name: sf.name}, sf.name, sf.usage)
		if sf.alias != "" {
			fs.Var(&flagValue{f: f, def: sf, name: sf.alias}, sf.alias, "deprecated: use --"+sf.name)
		}
	}
}

// Given reports whether the flag of canonical name was set (by its own
// name or its alias).
func (f *Flags) Given(name string) bool {
	_, ok := f.given[name]
	return ok
}

// Deprecated lists the deprecated aliases that were used, each as
// "--old is deprecated: use --new", for a warning.
func (f *Flags) Deprecated() []string { return slices.Clone(f.deprecated) }

// FromEnv sets every store flag not given from the environment variable
// prefix+NAME (NAME: the flag's canonical name in upper case, '-' as '_':
// RINGIPAM_ETCD_ENDPOINTS for --etcd-endpoints with prefix "RINGIPAM_"),
// when set and not empty. A malformed value is an error naming the
// variable.
func (f *Flags) FromEnv(prefix string, getenv func(string) string) error {
	var errs []error
	for _, sf := range storeFlags {
		if f.Given(sf.name) {
			continue
		}
		key := prefix + strings.ToUpper(strings.ReplaceAll(sf.name, "-", "_"))
		if v := getenv(key); v != "" {
			if err := (&flagValue{f: f, def: sf, name: sf.name}).Set(v); err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", key, err))
			}
		}
	}
	return errors.Join(errs...)
}

// Apply lays the given flags over c: a --store other than c's type (empty
// counts as local) starts from an empty store object of that type; with
// no --store, --etcd-endpoints makes a store of no type an etcd store;
// then every other flag given replaces its field (--etcd-endpoints the
// whole list, --etcd-ca/--etcd-cert/--etcd-key one file each). The
// password file is read here. Apply does not validate c: call Validate
// (or Open) after it.
func (f *Flags) Apply(c *Config) error {
	get := func(name string) (string, bool) {
		v, ok := f.given[name]
		return v, ok
	}
	if t, ok := get("store"); ok {
		cur := c.Type
		if cur == "" {
			cur = TypeLocal
		}
		if t != cur {
			*c = Config{}
		}
		c.Type = t
	} else if _, ok := get("etcd-endpoints"); ok && c.Type == "" {
		c.Type = TypeEtcd
	}
	var errs []error
	duration := func(name string, d *Duration) {
		if v, ok := get(name); ok {
			p, err := parseFlagDuration(v)
			if err != nil {
				errs = append(errs, fmt.Errorf("--%s: %w", name, err))
				return
			}
			*d = Duration(p)
		}
	}
	if v, ok := get("store-path"); ok {
		c.Path = v
	}
	duration("store-open-timeout", &c.OpenTimeout)
	if v, ok := get("etcd-endpoints"); ok {
		c.Endpoints = splitList(v)
	}
	if v, ok := get("etcd-prefix"); ok {
		c.Prefix = v
	}
	for _, tf := range []struct {
		name  string
		field func(*TLS) *string
	}{
		{"etcd-ca", func(t *TLS) *string { return &t.CA }},
		{"etcd-cert", func(t *TLS) *string { return &t.Cert }},
		{"etcd-key", func(t *TLS) *string { return &t.Key }},
	} {
		if v, ok := get(tf.name); ok {
			t := TLS{}
			if c.TLS != nil {
				t = *c.TLS
			}
			*tf.field(&t) = v
			c.TLS = &t
		}
	}
	if v, ok := get("etcd-username"); ok {
		c.Username = v
	}
	if v, ok := get("etcd-password-file"); ok {
		b, err := os.ReadFile(v)
		if err != nil {
			errs = append(errs, fmt.Errorf("--etcd-password-file: %w", err))
		} else {
			c.Password = strings.TrimRight(string(b), "\r\n")
		}
	}
	duration("etcd-dial-timeout", &c.DialTimeout)
	duration("etcd-request-timeout", &c.RequestTimeout)
	if v, ok := get("agent-socket"); ok {
		c.AgentSocket = v
	}
	if len(errs) > 0 {
		return fmt.Errorf("%w: %w", ErrInvalid, errors.Join(errs...))
	}
	return nil
}

func splitList(s string) []string {
	var l []string
	for _, e := range strings.Split(s, ",") {
		if e = strings.TrimSpace(e); e != "" {
			l = append(l, e)
		}
	}
	return l
}

// flagValue is one registered name (canonical or alias) of a store flag.
type flagValue struct {
	f    *Flags
	def  storeFlag
	name string // as registered
}

func (v *flagValue) String() string {
	if v == nil || v.f == nil {
		return ""
	}
	return v.f.given[v.def.name]
}

func (v *flagValue) Set(s string) error {
	if v.def.check != nil {
		if err := v.def.check(s); err != nil {
			return err
		}
	}
	if v.f.given == nil {
		v.f.given = map[string]string{}
	}
	v.f.given[v.def.name] = s
	if v.name != v.def.name {
		msg := "--" + v.name + " is deprecated: use --" + v.def.name
		if !slices.Contains(v.f.deprecated, msg) {
			v.f.deprecated = append(v.f.deprecated, msg)
		}
	}
	return nil
}

// DurationValue is a flag.Value setting *d from a Go duration ("90s",
// "48h"); negative durations are refused.
func DurationValue(d *Duration) flag.Value { return (*durationFlag)(d) }

type durationFlag Duration

func (d *durationFlag) String() string {
	if d == nil || *d == 0 {
		return ""
	}
	return time.Duration(*d).String()
}

func (d *durationFlag) Set(s string) error {
	v, err := parseFlagDuration(s)
	if err != nil {
		return err
	}
	*d = durationFlag(v)
	return nil
}
