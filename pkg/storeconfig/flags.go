package storeconfig

import (
	"flag"
	"fmt"
	"strings"
	"time"
)

// RegisterFlags adds the store flags shared by every long-running ringipam
// command (the Docker driver, the host agent, ringctl) to fs, writing into
// c. Flag names: --store, --store-path, --store-open-timeout,
// --etcd-endpoints, --store-prefix, --etcd-cacert, --etcd-cert, --etcd-key,
// --etcd-dial-timeout, --etcd-request-timeout, --store-socket.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	fs.StringVar(&c.Type, "store", c.Type, "state store: local or etcd")
	fs.StringVar(&c.Path, "store-path", c.Path, "local store: bbolt file (default /var/lib/ringipam/store.db)")
	fs.Var(DurationValue(&c.OpenTimeout), "store-open-timeout", "local store: how long to wait for the file lock (default 5s)")
	fs.Var(ListValue(&c.Endpoints), "etcd-endpoints", "etcd: comma-separated endpoints")
	fs.StringVar(&c.Prefix, "store-prefix", c.Prefix, "key prefix in the store (etcd default /ringipam/)")
	fs.Var(&tlsFlag{cfg: c, field: "ca"}, "etcd-cacert", "etcd: CA bundle verifying the servers")
	fs.Var(&tlsFlag{cfg: c, field: "cert"}, "etcd-cert", "etcd: client certificate")
	fs.Var(&tlsFlag{cfg: c, field: "key"}, "etcd-key", "etcd: client key")
	fs.Var(DurationValue(&c.DialTimeout), "etcd-dial-timeout", "etcd: dial timeout (default 5s)")
	fs.Var(DurationValue(&c.RequestTimeout), "etcd-request-timeout", "etcd: deadline of one store call (default 10s)")
	fs.StringVar(&c.AgentSocket, "store-socket", c.AgentSocket, `etcd: the host agent's store socket (default /run/ringipam/store.sock; "off": none)`)
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
	v, err := time.ParseDuration(s)
	if err != nil {
		return err
	}
	if v < 0 {
		return fmt.Errorf("negative duration %s", s)
	}
	*d = durationFlag(v)
	return nil
}

// ListValue is a flag.Value setting *l from a comma-separated list; each
// use replaces the list.
func ListValue(l *[]string) flag.Value { return (*listFlag)(l) }

type listFlag []string

func (l *listFlag) String() string {
	if l == nil {
		return ""
	}
	return strings.Join(*l, ",")
}

func (l *listFlag) Set(s string) error {
	*l = nil
	for _, e := range strings.Split(s, ",") {
		if e = strings.TrimSpace(e); e != "" {
			*l = append(*l, e)
		}
	}
	return nil
}

// tlsFlag sets one file of the store's TLS settings, creating them.
type tlsFlag struct {
	cfg   *Config
	field string // ca, cert or key
}

func (f *tlsFlag) String() string {
	if f == nil || f.cfg == nil || f.cfg.TLS == nil {
		return ""
	}
	switch f.field {
	case "ca":
		return f.cfg.TLS.CA
	case "cert":
		return f.cfg.TLS.Cert
	}
	return f.cfg.TLS.Key
}

func (f *tlsFlag) Set(s string) error {
	if f.cfg.TLS == nil {
		f.cfg.TLS = &TLS{}
	}
	switch f.field {
	case "ca":
		f.cfg.TLS.CA = s
	case "cert":
		f.cfg.TLS.Cert = s
	default:
		f.cfg.TLS.Key = s
	}
	return nil
}
