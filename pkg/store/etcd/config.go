package etcd

import (
	"fmt"
	"time"

	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/storeconfig"
)

// Importing this package is what gives a program an etcd client:
// storeconfig.Open of an etcd store comes here. The CNI plugins do not
// import it (they reach etcd through the host agent).
func init() {
	storeconfig.RegisterEtcd(func(c storeconfig.Config) (store.Store, error) {
		s, err := New(ConfigOf(c))
		if err != nil {
			return nil, err // not a typed nil in the interface
		}
		return s, nil
	})
}

// Open is storeconfig.Open for a component that needs more of etcd than the
// store contract (the host agent's leases and watches): it validates c and
// returns the concrete etcd store, or an error wrapping
// storeconfig.ErrInvalid when c is not a valid etcd store.
func Open(c storeconfig.Config) (*Store, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	if c.Type != storeconfig.TypeEtcd {
		return nil, fmt.Errorf("%w: store type %q is not etcd", storeconfig.ErrInvalid, c.Type)
	}
	return New(ConfigOf(c))
}

// ConfigOf is the etcd store's configuration of the store description c
// (New applies the defaults).
func ConfigOf(c storeconfig.Config) Config {
	cfg := Config{
		Endpoints:      c.Endpoints,
		Prefix:         c.Prefix,
		Username:       c.Username,
		Password:       c.Password,
		DialTimeout:    time.Duration(c.DialTimeout),
		RequestTimeout: time.Duration(c.RequestTimeout),
	}
	if c.TLS != nil && *c.TLS != (storeconfig.TLS{}) {
		cfg.TLS = &TLS{CAFile: c.TLS.CA, CertFile: c.TLS.Cert, KeyFile: c.TLS.Key}
	}
	return cfg
}
