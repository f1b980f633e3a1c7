package driver

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"net/netip"
	"os"
	"strings"

	"github.com/ringipam/ringipam/internal/conffile"
	"github.com/ringipam/ringipam/pkg/storeconfig"
)

// EnvPrefix starts the environment variable of every flag:
// --etcd-endpoints is RINGIPAM_DOCKER_ETCD_ENDPOINTS.
const EnvPrefix = "RINGIPAM_DOCKER_"

// Defaults of the configuration.
const (
	DefaultName      = "ringipam"
	DefaultPluginDir = "/run/docker/plugins"
)

// ErrConfig is wrapped by every configuration error.
var ErrConfig = errors.New("invalid ringipam-docker configuration")

// Config is the driver's whole configuration. LoadConfig builds it from
// defaults, a JSON file, the environment and flags, in that order of
// increasing precedence.
type Config struct {
	Name         string               `json:"name"`
	PluginDir    string               `json:"pluginDir"`
	Host         string               `json:"host"`
	Store        storeconfig.Config   `json:"store"`
	DefaultPools []DefaultPool        `json:"defaultPools"`
	MetricsAddr  string               `json:"metricsAddr"`
	Timeout      storeconfig.Duration `json:"timeout"`
	LogLevel     string               `json:"logLevel"`
}

// DefaultConfig is the configuration with nothing set: plugin "ringipam",
// local store, the machine's host name, default pools 198.18.0.0/16 in /24s,
// no metrics listener.
func DefaultConfig() Config {
	return Config{
		Name:         DefaultName,
		PluginDir:    DefaultPluginDir,
		Store:        storeconfig.Config{Type: storeconfig.TypeLocal},
		DefaultPools: []DefaultPool{{Base: netip.MustParsePrefix("198.18.0.0/16"), Size: 24}},
		Timeout:      storeconfig.Duration(DefaultTimeout),
		LogLevel:     "info",
	}
}

// LoadConfig reads the configuration: defaults, then the JSON file named by
// --config (or RINGIPAM_DOCKER_CONFIG), then RINGIPAM_DOCKER_* variables,
// then flags. usage receives the flag help on -h and on errors.
func LoadConfig(args []string, getenv func(string) string, usage io.Writer) (Config, error) {
	cfg := DefaultConfig()
	path := conffile.Path(args, getenv(EnvPrefix+"CONFIG"))
	if err := conffile.Decode(path, &cfg); err != nil {
		return Config{}, fmt.Errorf("%w: %w", ErrConfig, err)
	}

	fs := flag.NewFlagSet("ringipam-docker", flag.ContinueOnError)
	fs.SetOutput(usage)
	fs.String("config", path, "JSON configuration file (see conf/ringipam-docker.json)")
	fs.StringVar(&cfg.Name, "name", cfg.Name, "plugin name: the socket is <plugin-dir>/<name>.sock, networks use --ipam-driver <name>")
	fs.StringVar(&cfg.PluginDir, "plugin-dir", cfg.PluginDir, "directory dockerd discovers plugin sockets in")
	fs.StringVar(&cfg.Host, "host", cfg.Host, "this host's stable name in the ring (default: the machine's hostname)")
	var storeFlags storeconfig.Flags
	storeFlags.Register(fs)
	fs.Var(&poolsFlag{pools: &cfg.DefaultPools}, "default-pool", "default pool for networks without --subnet, as base=CIDR,size=BITS; repeatable")
	fs.StringVar(&cfg.MetricsAddr, "metrics-addr", cfg.MetricsAddr, "serve Prometheus metrics on this address, e.g. 127.0.0.1:9646 (default: off)")
	fs.Var(storeconfig.DurationValue(&cfg.Timeout), "timeout", "deadline of one IPAM request")
	fs.StringVar(&cfg.LogLevel, "log-level", cfg.LogLevel, "debug, info, warn or error")

	var envErr error
	fs.VisitAll(func(f *flag.Flag) {
		key := EnvPrefix + strings.ToUpper(strings.ReplaceAll(f.Name, "-", "_"))
		if v := getenv(key); v != "" && f.Name != "config" {
			if err := f.Value.Set(v); err != nil {
				envErr = errors.Join(envErr, fmt.Errorf("%s: %w", key, err))
			}
		}
	})
	if envErr != nil {
		return Config{}, fmt.Errorf("%w: %w", ErrConfig, envErr)
	}
	fs.VisitAll(func(f *flag.Flag) {
		if p, ok := f.Value.(*poolsFlag); ok {
			p.set = false // flags replace, not extend, what file and environment gave
		}
	})
	if err := fs.Parse(args); err != nil {
		return Config{}, fmt.Errorf("%w: %w", ErrConfig, err)
	}
	if fs.NArg() > 0 {
		return Config{}, fmt.Errorf("%w: unexpected arguments %q", ErrConfig, fs.Args())
	}
	if err := storeFlags.Apply(&cfg.Store); err != nil {
		return Config{}, fmt.Errorf("%w: %w", ErrConfig, err)
	}
	for _, d := range storeFlags.Deprecated() {
		fmt.Fprintf(usage, "%s: warning: %s\n", fs.Name(), d)
	}
	if err := cfg.complete(); err != nil {
		return Config{}, err
	}
	return cfg, nil
}

// complete fills the host name and validates.
func (c *Config) complete() error {
	if c.Host == "" {
		h, err := os.Hostname()
		if err != nil || h == "" {
			return fmt.Errorf("%w: no --host given and the hostname is unknown: %v", ErrConfig, err)
		}
		c.Host = h
	}
	if c.Name == "" || strings.ContainsAny(c.Name, "/\x00") {
		return fmt.Errorf("%w: plugin name %q must be non-empty and contain no '/'", ErrConfig, c.Name)
	}
	if c.Store.Type == "" {
		c.Store.Type = storeconfig.TypeLocal
	}
	if err := c.Store.Validate(); err != nil {
		return fmt.Errorf("%w: store: %w", ErrConfig, err)
	}
	for _, p := range c.DefaultPools {
		if err := p.validate(); err != nil {
			return fmt.Errorf("%w: %w", ErrConfig, err)
		}
	}
	if c.Timeout <= 0 {
		return fmt.Errorf("%w: timeout must be positive", ErrConfig)
	}
	if _, err := parseLevel(c.LogLevel); err != nil {
		return err
	}
	return nil
}

// poolsFlag collects --default-pool values; the first value given replaces
// the list, later ones extend it. Several values in one string (the
// environment) are separated by spaces.
type poolsFlag struct {
	pools *[]DefaultPool
	set   bool
}

func (p *poolsFlag) String() string {
	if p == nil || p.pools == nil {
		return ""
	}
	var s []string
	for _, d := range *p.pools {
		s = append(s, d.String())
	}
	return strings.Join(s, " ")
}

func (p *poolsFlag) Set(v string) error {
	if !p.set {
		*p.pools = nil
		p.set = true
	}
	for _, f := range strings.Fields(v) {
		d, err := ParseDefaultPool(f)
		if err != nil {
			return err
		}
		*p.pools = append(*p.pools, d)
	}
	return nil
}

func parseLevel(s string) (int, error) {
	switch s {
	case "debug":
		return -4, nil
	case "", "info":
		return 0, nil
	case "warn":
		return 4, nil
	case "error":
		return 8, nil
	}
	return 0, fmt.Errorf("%w: log level %q is not debug, info, warn or error", ErrConfig, s)
}
