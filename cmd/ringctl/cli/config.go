package cli

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"

	"github.com/ringipam/ringipam/pkg/storeconfig"
)

// StoreFlags are the store and host settings given on the command line or
// in the environment (RINGIPAM_*). Empty fields are not set.
type StoreFlags struct {
	Config  string // --config: a CNI conflist, a network config, the driver's config or a store object
	DataDir string // --data-dir: the local store is <dir>/store.db
	Host    string // --host
	// Password is RINGIPAM_ETCD_PASSWORD only (never a flag: it would show
	// in ps); --etcd-password-file reads it from a file.
	Password string
	// Store are the store flags every ringipam command shares
	// (storeconfig.Flags), each also read from RINGIPAM_<NAME>:
	// --etcd-endpoints from RINGIPAM_ETCD_ENDPOINTS, ...
	Store storeconfig.Flags
}

// EnvPrefix starts the environment variable of every flag:
// --etcd-endpoints is RINGIPAM_ETCD_ENDPOINTS.
const EnvPrefix = "RINGIPAM_"

// withEnv returns f with every flag not given taken from env.
func (f *StoreFlags) withEnv(env func(string) string) (*StoreFlags, error) {
	for _, e := range []struct {
		name string
		p    *string
	}{{"CONFIG", &f.Config}, {"DATA_DIR", &f.DataDir}, {"HOST", &f.Host}, {"ETCD_PASSWORD", &f.Password}} {
		if *e.p == "" {
			*e.p = env(EnvPrefix + e.name)
		}
	}
	if err := f.Store.FromEnv(EnvPrefix, env); err != nil {
		return nil, usagef("%v", err)
	}
	return f, nil
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
// environment, then the file, then the defaults of pkg/storeconfig; the
// store flags are laid over the file's store by storeconfig.Flags.Apply
// (a --store that differs from the file's type starts from an empty store
// object of that type).
func Resolve(f *StoreFlags, file []byte) (Settings, error) {
	var s Settings
	if file != nil {
		var err error
		if s, err = parseConfigFile(file); err != nil {
			return Settings{}, err
		}
	}
	c := s.Store
	if err := f.Store.Apply(&c); err != nil {
		return Settings{}, fmt.Errorf("%w: %w", errUsage, err)
	}
	if f.DataDir != "" && !f.Store.Given("store-path") {
		c.Path = filepath.Join(f.DataDir, "store.db")
	}
	if f.Password != "" && !f.Store.Given("etcd-password-file") {
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
