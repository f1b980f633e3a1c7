// Package storeconfig is the one place where a store is described in JSON
// (in a CNI network config, the Docker driver's config or ringctl's flags)
// and turned into a store.Store.
//
// The JSON shape is
//
//	{"type": "local", "path": "/var/lib/ringipam/store.db", "openTimeout": "5s"}
//	{"type": "etcd", "endpoints": ["https://10.0.0.1:2379"], "prefix": "/ringipam/",
//	 "tls": {"ca": "/etc/ringipam/ca.pem", "cert": "...", "key": "..."},
//	 "username": "", "password": "", "dialTimeout": "5s", "requestTimeout": "10s"}
//
// Durations are Go duration strings ("1.5s", "300ms") or integer seconds.
// An empty type means "local". Parse decodes with encoding/json and refuses
// unknown keys. Validate reports every problem of a Config at once, as one
// error; Open validates, applies the backends' defaults and returns the
// store: package local for "local", package etcd (etcd's own client,
// go.etcd.io/etcd/client/v3) for "etcd". Neither blocks on the network or
// the file, with one exception: etcd with a username authenticates while
// opening, within dialTimeout.
//
// The etcd backend is linked only into the programs that talk to etcd (the
// host agent, the Docker driver, ringctl): package etcd registers itself
// here (RegisterEtcd) when it is imported, as database/sql drivers do, and
// its etcd.Open returns the concrete store the agent needs for leases and
// watches. The CNI plugins never open etcd (they send their calls to the
// agent, package agentapi), so they do not import it and do not pay for
// gRPC's and the etcd API's initialisation at every call; in a program
// without it, Open of an etcd store fails with ErrNoEtcdClient.
//
// RegisterFlags (flags.go) is the one command-line vocabulary of a store,
// shared by the agent, the Docker driver and ringctl.
//
// Config values are plain data: copy them freely; the zero value is a
// valid local store at the default path.
package storeconfig

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/local"
)

// Store types.
const (
	TypeLocal = "local"
	TypeEtcd  = "etcd"
)

// ErrInvalid is wrapped by every error of Validate (and of Open when the
// config is at fault), so that front ends can map it to "bad config".
var ErrInvalid = errors.New("invalid store config")

// Duration is a time.Duration that reads from JSON as a Go duration string
// or as a number of seconds, and writes as a duration string.
type Duration time.Duration

// UnmarshalJSON implements json.Unmarshaler.
func (d *Duration) UnmarshalJSON(b []byte) error {
	b = bytes.TrimSpace(b)
	if bytes.Equal(b, []byte("null")) {
		return nil
	}
	if len(b) > 0 && b[0] == '"' {
		var s string
		if err := json.Unmarshal(b, &s); err != nil {
			return err
		}
		if s == "" {
			*d = 0
			return nil
		}
		v, err := time.ParseDuration(s)
		if err != nil {
			if n, nerr := strconv.ParseInt(s, 10, 64); nerr == nil {
				*d = Duration(time.Duration(n) * time.Second)
				return nil
			}
			return fmt.Errorf("duration %q: want a Go duration such as \"5s\" or a number of seconds", s)
		}
		*d = Duration(v)
		return nil
	}
	n, err := strconv.ParseInt(string(b), 10, 64)
	if err != nil {
		return fmt.Errorf("duration %s: want a Go duration such as \"5s\" or an integer number of seconds", b)
	}
	if n > int64(time.Duration(1<<63-1)/time.Second) || n < -int64(time.Duration(1<<63-1)/time.Second) {
		return fmt.Errorf("duration %d seconds is out of range", n)
	}
	*d = Duration(time.Duration(n) * time.Second)
	return nil
}

// MarshalJSON implements json.Marshaler.
func (d Duration) MarshalJSON() ([]byte, error) {
	return json.Marshal(time.Duration(d).String())
}

// TLS names the PEM files of an etcd TLS connection.
type TLS struct {
	CA   string `json:"ca,omitempty"`
	Cert string `json:"cert,omitempty"`
	Key  string `json:"key,omitempty"`
}

// Config selects and configures a store.
type Config struct {
	Type string `json:"type,omitempty"` // "local" (default) or "etcd"

	// local
	Path        string   `json:"path,omitempty"`        // default /var/lib/ringipam/store.db
	OpenTimeout Duration `json:"openTimeout,omitempty"` // default 5s

	// etcd
	Endpoints      []string `json:"endpoints,omitempty"`
	Prefix         string   `json:"prefix,omitempty"` // default /ringipam/
	TLS            *TLS     `json:"tls,omitempty"`
	Username       string   `json:"username,omitempty"`
	Password       string   `json:"password,omitempty"`
	DialTimeout    Duration `json:"dialTimeout,omitempty"`    // default 5s
	RequestTimeout Duration `json:"requestTimeout,omitempty"` // default 10s
	// AgentSocket is the unix socket of the host agent (ringipamd) of an
	// etcd store: the agent listens there and the CNI plugins send it
	// their invocations; the plugins reach etcd only through the agent.
	// Default DefaultAgentSocket. The Docker driver, ringctl and the
	// agent itself reach etcd directly.
	AgentSocket string `json:"agentSocket,omitempty"`
	// DelQueue is the directory where the plugins queue a DEL that finds
	// no host agent, and from which the agent runs them (package
	// agentapi, DelQueue). Default /var/lib/ringipam/del-queue.
	DelQueue string `json:"delQueue,omitempty"`
}

// DefaultDelQueue is the DEL queue's directory of an etcd store when
// Config.DelQueue is empty.
const DefaultDelQueue = "/var/lib/ringipam/del-queue"

// DelQueueDir returns the DEL queue's directory of an etcd store, its
// default applied ("" for a local store, which needs no agent).
func (c Config) DelQueueDir() string {
	switch {
	case c.Type != TypeEtcd:
		return ""
	case c.DelQueue == "":
		return DefaultDelQueue
	}
	return c.DelQueue
}

// DefaultAgentSocket is the host agent's socket of an etcd store when
// Config.AgentSocket is empty.
const DefaultAgentSocket = "/run/ringipam/agent.sock"

// Socket returns the host agent's socket of an etcd store, its default
// applied ("" for a local store, which needs no agent).
func (c Config) Socket() string {
	switch {
	case c.Type != TypeEtcd:
		return ""
	case c.AgentSocket == "":
		return DefaultAgentSocket
	}
	return c.AgentSocket
}

// SameStore reports whether c and o describe one store: local files at
// one path (defaults applied) with one key prefix, or etcd clusters with
// one key prefix and an endpoint in common. Credentials, timeouts and
// sockets do not matter.
func (c Config) SameStore(o Config) bool {
	if c.isEtcd() != o.isEtcd() {
		return false
	}
	if c.isEtcd() {
		return c.Identity().Matches(o.Identity())
	}
	return c.localPath() == o.localPath() && c.Prefix == o.Prefix
}

func (c Config) isEtcd() bool { return c.Type == TypeEtcd }

// localPath is a local store's file, its default applied.
func (c Config) localPath() string {
	if c.Path == "" {
		return local.DefaultPath
	}
	return filepath.Clean(c.Path)
}

// Identity is the cluster an etcd store names, as the agent compares it
// with the store of a caller.
func (c Config) Identity() Identity {
	return Identity{Prefix: c.etcdPrefix(), Endpoints: c.Endpoints}
}

// Identity names an etcd cluster and key prefix: the store a caller means,
// or the one an agent serves.
type Identity struct {
	Prefix    string   `json:"prefix"`
	Endpoints []string `json:"endpoints"`
}

// Matches reports whether a caller's identity c names the cluster the
// served identity s names: the same prefix, and one endpoint in common
// (compared without scheme and trailing slash).
func (s Identity) Matches(c Identity) bool {
	if s.Prefix != c.Prefix {
		return false
	}
	for _, a := range s.Endpoints {
		for _, b := range c.Endpoints {
			if normEndpoint(a) == normEndpoint(b) {
				return true
			}
		}
	}
	return false
}

// Key is s in one canonical string: the prefix, then the endpoints compared
// as Matches compares them (without scheme and trailing slash), sorted, each
// after a NUL. Identities naming the same endpoints in any order, spelled
// with or without scheme, have the same Key.
func (s Identity) Key() string {
	eps := make([]string, len(s.Endpoints))
	for i, e := range s.Endpoints {
		eps[i] = normEndpoint(e)
	}
	slices.Sort(eps)
	var b strings.Builder
	b.WriteString(s.Prefix)
	for _, e := range eps {
		b.WriteByte(0)
		b.WriteString(e)
	}
	return b.String()
}

func normEndpoint(e string) string {
	if _, rest, ok := strings.Cut(e, "://"); ok {
		e = rest
	}
	return strings.TrimRight(e, "/")
}

// etcdPrefix is an etcd store's key prefix, its default applied.
func (c Config) etcdPrefix() string {
	if c.Prefix == "" {
		return DefaultEtcdPrefix
	}
	return c.Prefix
}

// Parse decodes a JSON store config with encoding/json, rejecting unknown
// fields, and validates it.
func Parse(data []byte) (Config, error) {
	var c Config
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&c); err != nil {
		return Config{}, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	if dec.More() {
		return Config{}, fmt.Errorf("%w: data after the store object", ErrInvalid)
	}
	if err := c.Validate(); err != nil {
		return Config{}, err
	}
	return c, nil
}

// Validate reports all problems of c in one error wrapping ErrInvalid.
func (c Config) Validate() error {
	var errs []error
	bad := func(format string, a ...any) { errs = append(errs, fmt.Errorf(format, a...)) }
	for _, d := range []struct {
		name  string
		value Duration
	}{{"openTimeout", c.OpenTimeout}, {"dialTimeout", c.DialTimeout}, {"requestTimeout", c.RequestTimeout}} {
		if d.value < 0 {
			bad("%s %s is negative", d.name, time.Duration(d.value))
		}
	}
	switch c.Type {
	case "", TypeLocal:
		if len(c.Endpoints) > 0 || (c.TLS != nil && *c.TLS != (TLS{})) || c.Username != "" || c.Password != "" || c.AgentSocket != "" || c.DelQueue != "" {
			bad(`endpoints, tls, username, password, agentSocket and delQueue belong to type "etcd", not "local"`)
		}
		if strings.ContainsRune(c.Path, 0) {
			bad("path contains a NUL byte")
		} else if c.Path != "" && !filepath.IsAbs(c.Path) {
			bad("path %q must be absolute (plugins run with an unknown working directory)", c.Path)
		}
	case TypeEtcd:
		if c.Path != "" {
			bad(`path belongs to type "local", not "etcd"`)
		}
		if len(c.Endpoints) == 0 {
			bad(`type "etcd" needs at least one endpoint, e.g. "endpoints": ["https://10.0.0.1:2379"]`)
		}
		for _, e := range c.Endpoints {
			if err := checkEndpoint(e); err != nil {
				bad("endpoint %q: %v", e, err)
			}
			// The etcd client speaks plain text to an http:// endpoint
			// and silently ignores the tls settings.
			if c.TLS != nil && strings.HasPrefix(e, "http://") {
				bad("endpoint %q is plain http but tls is set: write https://", e)
			}
		}
		if c.TLS != nil && (c.TLS.Cert == "") != (c.TLS.Key == "") {
			bad("tls: cert and key must be given together")
		}
		if c.Password != "" && c.Username == "" {
			bad("password given without username")
		}
		switch a := c.AgentSocket; {
		case a == "off":
			bad(`agentSocket "off" is no longer accepted: on etcd the CNI plugins reach etcd only through the host agent (ringipamd); leave agentSocket out (default %s) or name the agent's socket`, DefaultAgentSocket)
		case a != "" && (!filepath.IsAbs(a) || strings.ContainsRune(a, 0)):
			bad("agentSocket %q must be an absolute path", a)
		}
		if d := c.DelQueue; d != "" && (!filepath.IsAbs(d) || strings.ContainsRune(d, 0)) {
			bad("delQueue %q must be an absolute path", d)
		}
	default:
		bad(`unknown type %q: want "local" or "etcd"`, c.Type)
	}
	if len(errs) == 0 {
		return nil
	}
	return fmt.Errorf("%w: %w", ErrInvalid, errors.Join(errs...))
}

func checkEndpoint(e string) error {
	if e == "" || strings.TrimSpace(e) != e {
		return errors.New("empty or padded with spaces")
	}
	if strings.HasPrefix(e, "unix://") || strings.HasPrefix(e, "unixs://") {
		return nil
	}
	hostport := e
	if strings.Contains(e, "://") {
		u, err := url.Parse(e)
		if err != nil {
			return err
		}
		if u.Scheme != "http" && u.Scheme != "https" {
			return fmt.Errorf("scheme %q: want http, https or unix", u.Scheme)
		}
		if u.Path != "" && u.Path != "/" {
			return fmt.Errorf("unexpected path %q", u.Path)
		}
		hostport = u.Host
	}
	i := strings.LastIndexByte(hostport, ':')
	if i <= 0 {
		return errors.New("want host:port")
	}
	if p, err := strconv.Atoi(hostport[i+1:]); err != nil || p < 1 || p > 65535 {
		return fmt.Errorf("bad port %q", hostport[i+1:])
	}
	return nil
}

// Open validates c and opens the store it describes: package local's
// store for "local", package etcd's (etcd's own client) for "etcd". A
// local store opens no file until its first call; an etcd store holds a
// client until Close and does not wait for the cluster (except to
// authenticate a username, within dialTimeout): its first call does,
// under the caller's ctx and requestTimeout.
func Open(c Config) (store.Store, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	if c.Type == TypeEtcd {
		if etcdBackend == nil {
			return nil, fmt.Errorf("opening %s: %w", c.Describe(), ErrNoEtcdClient)
		}
		return etcdBackend(c)
	}
	return local.New(local.Config{Path: c.Path, OpenTimeout: time.Duration(c.OpenTimeout), Prefix: c.Prefix})
}

// DefaultEtcdPrefix is the key prefix of an etcd store that names none.
const DefaultEtcdPrefix = "/ringipam/"

// ErrNoEtcdClient is wrapped by Open's error for an etcd store in a
// program that does not link package etcd (the CNI plugins).
var ErrNoEtcdClient = errors.New("this program has no etcd client: the CNI plugins reach etcd only through the host agent (ringipamd)")

// etcdBackend opens an etcd store; set by package etcd when it is linked.
var etcdBackend func(Config) (store.Store, error)

// RegisterEtcd is called by package etcd (from its init) with the function
// that opens an etcd store from a validated Config. It is not for other
// callers.
func RegisterEtcd(open func(Config) (store.Store, error)) { etcdBackend = open }

// Describe returns a one-line description for logs and STATUS messages,
// without secrets.
func (c Config) Describe() string {
	if c.Type == TypeEtcd {
		return fmt.Sprintf("etcd %s prefix %s", strings.Join(c.Endpoints, ","), c.etcdPrefix())
	}
	p := c.Path
	if p == "" {
		p = local.DefaultPath
	}
	return "local " + p
}

// HostName is this host's stable name in the store, as every front end
// resolves it: the configured name when there is one, else the machine's
// hostname (Kubernetes nodes are named after it by default).
func HostName(configured string) (string, error) {
	if configured != "" {
		return configured, nil
	}
	h, err := os.Hostname()
	if err != nil || h == "" {
		return "", fmt.Errorf("no host name configured and the machine's hostname is unknown: %v", err)
	}
	return h, nil
}
