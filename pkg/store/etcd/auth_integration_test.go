//go:build integration

package etcd_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ringipam/ringipam/internal/testenv"
	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/etcd"
	"github.com/ringipam/ringipam/pkg/store/storetest"
	"github.com/ringipam/ringipam/pkg/storeconfig"
)

// Users of the etcd server that startEtcdWithAuth makes.
const (
	authUser     = "ringipam"
	authPassword = "s3cret-ringipam"
	authPrefix   = "/auth/" // the prefix authUser's role may read and write
)

// startEtcdWithAuth starts an etcd with authentication on, through
// clientv3's Auth API: a root user, and authUser whose only role grants
// readwrite on the keys under authPrefix.
func startEtcdWithAuth(t *testing.T) *testenv.Etcd {
	t.Helper()
	srv := testenv.StartEtcd(t)
	cli, err := clientv3.New(clientv3.Config{Endpoints: srv.Endpoints(), DialTimeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for _, step := range []struct {
		what string
		do   func() error
	}{
		{"add root", func() error { _, err := cli.UserAdd(ctx, "root", "root-pw"); return err }},
		{"grant root", func() error { _, err := cli.UserGrantRole(ctx, "root", "root"); return err }},
		{"add role", func() error { _, err := cli.RoleAdd(ctx, "ringipam-rw"); return err }},
		{"grant the prefix", func() error {
			_, err := cli.RoleGrantPermission(ctx, "ringipam-rw", authPrefix, clientv3.GetPrefixRangeEnd(authPrefix), clientv3.PermissionType(clientv3.PermReadWrite))
			return err
		}},
		{"add user", func() error { _, err := cli.UserAdd(ctx, authUser, authPassword); return err }},
		{"grant user", func() error { _, err := cli.UserGrantRole(ctx, authUser, "ringipam-rw"); return err }},
		{"enable auth", func() error { _, err := cli.AuthEnable(ctx); return err }},
	} {
		if err := step.do(); err != nil {
			t.Fatalf("%s: %v", step.what, err)
		}
	}
	return srv
}

func openAuth(t testing.TB, srv *testenv.Etcd, user, password, prefix string) (*etcd.Store, error) {
	t.Helper()
	return etcd.New(etcd.Config{Endpoints: srv.Endpoints(), Prefix: prefix, Username: user, Password: password,
		DialTimeout: 10 * time.Second, RequestTimeout: 30 * time.Second})
}

// The whole store contract holds as a user that has a role on the prefix
// only, on a server with authentication on.
func TestAuthContract(t *testing.T) {
	srv := startEtcdWithAuth(t)
	open := func(t *testing.T, prefix string) store.Store {
		s, err := openAuth(t, srv, authUser, authPassword, prefix)
		if err != nil {
			t.Fatalf("etcd.New as %s: %v", authUser, err)
		}
		return s
	}
	sub := func() string { return authPrefix + strings.TrimPrefix(uniquePrefix(), "/") }
	storetest.Run(t,
		func(t *testing.T) store.Store { return open(t, sub()) },
		storetest.Persistent(func(t *testing.T) func(t *testing.T) store.Store {
			p := sub()
			return func(t *testing.T) store.Store { return open(t, p) }
		}))
}

// Wrong credentials fail the open with an error that names the user and
// says what to check; a user without a role on the prefix gets a
// permission error naming the fix; a store config with username and
// password (storeconfig.Open) reaches the store.
func TestAuthRefused(t *testing.T) {
	srv := startEtcdWithAuth(t)
	ctx := context.Background()

	for _, tc := range []struct{ name, user, password string }{
		{"wrong password", authUser, "not-the-password"},
		{"unknown user", "nobody", authPassword},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, err := openAuth(t, srv, tc.user, tc.password, authPrefix)
			if err == nil {
				s.Close()
				t.Fatal("opened with wrong credentials")
			}
			if !errors.Is(err, rpctypes.ErrAuthFailed) || errors.Is(err, store.ErrUnavailable) {
				t.Errorf("err = %v, want ErrAuthFailed and not unavailable", err)
			}
			for _, w := range []string{fmt.Sprintf("user %q", tc.user), "check the username and password", srv.Endpoints()[0]} {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q lacks %q", err, w)
				}
			}
		})
	}

	t.Run("no role on the prefix", func(t *testing.T) {
		s, err := openAuth(t, srv, authUser, authPassword, "/elsewhere/")
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		err = s.Commit(ctx, nil, []store.Op{store.Put("k", []byte("v"))})
		if !errors.Is(err, rpctypes.ErrPermissionDenied) || !strings.Contains(err.Error(), "needs a role granting readwrite") {
			t.Errorf("Commit outside the role: %v", err)
		}
	})

	t.Run("without credentials", func(t *testing.T) {
		s, err := openAuth(t, srv, "", "", authPrefix)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		if _, err := s.Get(ctx, "k"); err == nil {
			t.Error("Get without credentials succeeded on a server with auth on")
		}
	})

	t.Run("storeconfig", func(t *testing.T) {
		cfg := storeconfig.Config{Type: storeconfig.TypeEtcd, Endpoints: srv.Endpoints(), Prefix: authPrefix + "cfg/",
			Username: authUser, Password: authPassword, RequestTimeout: storeconfig.Duration(30 * time.Second)}
		s, err := storeconfig.Open(cfg)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		if err := s.Commit(ctx, []store.Cond{{Key: "k"}}, []store.Op{store.Put("k", []byte("v"))}); err != nil {
			t.Fatalf("Commit: %v", err)
		}
		kvs, err := s.Get(ctx, "k")
		if err != nil || string(kvs[0].Value) != "v" {
			t.Fatalf("Get: %+v, %v", kvs, err)
		}
		cfg.Password = "wrong"
		if _, err := storeconfig.Open(cfg); !errors.Is(err, rpctypes.ErrAuthFailed) {
			t.Errorf("storeconfig.Open with a wrong password: %v", err)
		}
	})
}
