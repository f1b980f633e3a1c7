package storeconfig

import (
	"errors"
	"strings"
	"testing"
)

// In a program without package etcd (the CNI plugins), an etcd store does
// not open, and the error says where the plugins' etcd calls go instead.
func TestOpenEtcdWithoutTheBackend(t *testing.T) {
	saved := etcdBackend
	t.Cleanup(func() { etcdBackend = saved })
	etcdBackend = nil
	_, err := Open(Config{Type: TypeEtcd, Endpoints: []string{"127.0.0.1:1"}})
	if !errors.Is(err, ErrNoEtcdClient) || !strings.Contains(err.Error(), "ringipamd") {
		t.Fatalf("Open(etcd) without the etcd backend: %v, want ErrNoEtcdClient naming the agent", err)
	}
}
