package ringctl

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"strings"

	"github.com/ringipam/ringipam/pkg/storeconfig"
)

// StoreFlags are the store and host settings given on the command line or
// in the environment (RINGIPAM_*). Empty fields are not set.
type StoreFlags struct {
	Config    string // --config: a CNI conflist, a network config, the driver's config or a store object
	Store     string // --store: local or etcd
	DataDir   string // --data-dir: the local store is <dir>/store.db
	StorePath string // --store-path: the local store file
	Endpoints string // --etcd-endpoints: comma-separated
	Prefix    string // --etcd-prefix
	CA        string // --etcd-ca
	Cert      string // --etcd-cert
	Key       string // --etcd-key
	Username  string // --etcd-username
	Password  string // RINGIPAM_ETCD_PASSWORD only (never a flag: it would show in ps)
	Host      string // --host
}

// EnvNames maps each StoreFlags field to its environment variable.
var EnvNames = []struct {
	Name  string
	Field func(*StoreFlags) *string
}{
	{"RINGIPAM_CONFIG", func(f *StoreFlags) *string { return &f.Config }},
	{"RINGIPAM_STORE", func(f *StoreFlags) *string { return &f.Store }},
	{"RINGIPAM_DATA_DIR", func(f *StoreFlags) *string { return &f.DataDir }},
	{"RINGIPAM_STORE_PATH", func(f *StoreFlags) *string { return &f.StorePath }},
	{"RINGIPAM_ETCD_ENDPOINTS", func(f *StoreFlags) *string { return &f.Endpoints }},
	{"RINGIPAM_ETCD_PREFIX", func(f *StoreFlags) *string { return &f.Prefix }},
	{"RINGIPAM_ETCD_CA", func(f *StoreFlags) *string { return &f.CA }},
	{"RINGIPAM_ETCD_CERT", func(f *StoreFlags) *string { return &f.Cert }},
	{"RINGIPAM_ETCD_KEY", func(f *StoreFlags) *string { return &f.Key }},
	{"RINGIPAM_ETCD_USERNAME", func(f *StoreFlags) *string { return &f.Username }},
	{"RINGIPAM_ETCD_PASSWORD", func(f *StoreFlags) *string { return &f.Password }},
	{"RINGIPAM_HOST", func(f *StoreFlags) *string { return &f.Host }},
}

// withEnv returns f with every empty field taken from env.
func (f StoreFlags) withEnv(env func(string) string) StoreFlags {
	for _, e := range EnvNames {
		if p := e.Field(&f); *p == "" {
			*p = env(e.Name)
		}
	}
	return f
}

// Settings are the resolved store, host and (when the config file was a
// CNI network configuration) the network it describes.
type Settings struct {
	Store storeconfig.Config
	// Host is the name this ringctl acts as (rmpeer hands space to it);
	// empty means the machine's hostname (storeconfig.HostName).
	Host string
	// Network is the CNI network configuration (one plugin with its
	// "ipam", cniVersion and name) of an ipam-ring or host-local plugin
	// found in the config file; nil if the file was not a CNI config.
	Network []byte
	// NetworkName is that network's name.
	NetworkName string
}

// errUsage marks errors in what the user typed (exit code 2).
var errUsage = errors.New("usage")

func usagef(format string, a ...any) error {
	return fmt.Errorf("%w: %s", errUsage, fmt.Sprintf(format, a...))
}

// Resolve turns flags (already merged with the environment) and the config
// file's bytes (nil when none) into Settings. Precedence: flags and
// environment, then the file, then the defaults of pkg/storeconfig. A
// --store that differs from the file's type starts from an empty store
// object of that type.
func Resolve(f StoreFlags, file []byte) (Settings, error) {
	var s Settings
	if file != nil {
		var err error
		if s, err = parseConfigFile(file); err != nil {
			return Settings{}, err
		}
	}
	c := s.Store
	switch f.Store {
	case "":
		if c.Type == "" && (f.Endpoints != "") {
			c = storeconfig.Config{Type: storeconfig.TypeEtcd}
		}
	case storeconfig.TypeLocal, storeconfig.TypeEtcd:
		if c.Type != f.Store && !(c.Type == "" && f.Store == storeconfig.TypeLocal) {
			c = storeconfig.Config{}
		}
		c.Type = f.Store
	default:
		return Settings{}, usagef("--store %q: want local or etcd", f.Store)
	}
	if f.DataDir != "" {
		c.Path = filepath.Join(f.DataDir, "store.db")
	}
	if f.StorePath != "" {
		c.Path = f.StorePath
	}
	if f.Endpoints != "" {
		c.Endpoints = nil
		for _, e := range strings.Split(f.Endpoints, ",") {
			if e = strings.TrimSpace(e); e != "" {
				c.Endpoints = append(c.Endpoints, e)
			}
		}
	}
	if f.Prefix != "" {
		c.Prefix = f.Prefix
	}
	if f.CA != "" || f.Cert != "" || f.Key != "" {
		if c.TLS == nil {
			c.TLS = &storeconfig.TLS{}
		}
		t := *c.TLS
		if f.CA != "" {
			t.CA = f.CA
		}
		if f.Cert != "" {
			t.Cert = f.Cert
		}
		if f.Key != "" {
			t.Key = f.Key
		}
		c.TLS = &t
	}
	if f.Username != "" {
		c.Username = f.Username
	}
	if f.Password != "" {
		c.Password = f.Password
	}
	if err := c.Validate(); err != nil {
		return Settings{}, fmt.Errorf("%w: %w", errUsage, err)
	}
	s.Store = c
	if f.Host != "" {
		s.Host = f.Host
	}
	return s, nil
}

// parseConfigFile reads a CNI conflist, a single network configuration,
// the Docker driver's configuration, or a bare store object.
func parseConfigFile(b []byte) (Settings, error) {
	var top map[string]json.RawMessage
	if err := json.Unmarshal(b, &top); err != nil {
		return Settings{}, usagef("config file: not a JSON object: %v", err)
	}
	switch {
	case top["plugins"] != nil:
		return fromConfList(top)
	case top["ipam"] != nil:
		return fromNetConf(top, b)
	case top["store"] != nil:
		var d struct {
			Host  string          `json:"host"`
			Store json.RawMessage `json:"store"`
		}
		if err := json.Unmarshal(b, &d); err != nil {
			return Settings{}, usagef("driver config: %v", err)
		}
		st, err := parseStore(d.Store)
		if err != nil {
			return Settings{}, err
		}
		return Settings{Store: st, Host: d.Host}, nil
	}
	st, err := parseStore(b)
	if err != nil {
		return Settings{}, err
	}
	return Settings{Store: st}, nil
}

func parseStore(raw json.RawMessage) (storeconfig.Config, error) {
	if len(bytes.TrimSpace(raw)) == 0 || string(raw) == "null" {
		return storeconfig.Config{}, nil
	}
	c, err := storeconfig.Parse(raw)
	if err != nil {
		return storeconfig.Config{}, fmt.Errorf("%w: config file: %w", errUsage, err)
	}
	return c, nil
}

// ipamTypes are the IPAM plugins whose configuration ringctl reads: its
// own, and host-local's (for import).
var ipamTypes = []string{"ipam-ring", "host-local"}

func fromConfList(top map[string]json.RawMessage) (Settings, error) {
	var plugins []map[string]json.RawMessage
	if err := json.Unmarshal(top["plugins"], &plugins); err != nil {
		return Settings{}, usagef("conflist: \"plugins\": %v", err)
	}
	// Prefer an ipam-ring plugin (it names the store), then host-local.
	for _, want := range ipamTypes {
		for _, p := range plugins {
			if p["ipam"] == nil || ipamType(p["ipam"]) != want {
				continue
			}
			net := map[string]json.RawMessage{"cniVersion": top["cniVersion"], "name": top["name"], "ipam": p["ipam"]}
			if net["cniVersion"] == nil {
				net["cniVersion"] = json.RawMessage(`"1.1.0"`)
			}
			b, _ := json.Marshal(net)
			return fromNetConf(net, b)
		}
	}
	return Settings{}, usagef("conflist: no plugin with an ipam-ring or host-local \"ipam\" section")
}

func ipamType(raw json.RawMessage) string {
	var t struct {
		Type string `json:"type"`
	}
	json.Unmarshal(raw, &t)
	return t.Type
}

func fromNetConf(top map[string]json.RawMessage, b []byte) (Settings, error) {
	var n struct {
		Name string `json:"name"`
		IPAM struct {
			Type  string          `json:"type"`
			Host  string          `json:"host"`
			Store json.RawMessage `json:"store"`
		} `json:"ipam"`
	}
	if err := json.Unmarshal(b, &n); err != nil {
		return Settings{}, usagef("network config: %v", err)
	}
	s := Settings{Network: b, NetworkName: n.Name}
	if n.IPAM.Type == "ipam-ring" {
		st, err := parseStore(n.IPAM.Store)
		if err != nil {
			return Settings{}, err
		}
		s.Store, s.Host = st, n.IPAM.Host
	}
	return s, nil
}
