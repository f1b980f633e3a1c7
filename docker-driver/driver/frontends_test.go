package driver

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"testing"

	"github.com/docker/go-plugins-helpers/ipam"

	cniipam "github.com/ringipam/ringipam/pkg/cni/ipam"
	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/store/memory"
)

// The Docker driver and the CNI plugin given the same subnet under the same
// pool name record one definition: whichever front end records it first,
// the other uses it (issue 8, item 3: the /31 gateway used to differ).
func TestBothFrontEndsRecordOneDefinition(t *testing.T) {
	for _, tc := range []struct {
		subnet, v6 string
		gw         string // --gateway and the CNI range's gateway; "" for the default
	}{
		{subnet: "198.18.70.0/24"},
		{subnet: "198.18.71.0/31", gw: "198.18.71.0"},
		{subnet: "198.18.72.8/30"},
		{subnet: "2001:db8:70::/64", v6: "v6"},
		{subnet: "2001:db8:71::/127", v6: "v6", gw: "2001:db8:71::"},
	} {
		for _, dockerFirst := range []bool{true, false} {
			t.Run(fmt.Sprintf("%s/docker-first=%v", tc.subnet, dockerFirst), func(t *testing.T) {
				ctx := context.Background()
				st := memory.New()
				d := newDriver(t, st, "dockerhost")
				a, _ := pool.New(st, "cnihost")
				rng := fmt.Sprintf(`{"subnet":%q}`, tc.subnet)
				if tc.gw != "" {
					rng = fmt.Sprintf(`{"subnet":%q,"gateway":%q}`, tc.subnet, tc.gw)
				}
				conf := fmt.Sprintf(`{"cniVersion":"1.0.0","name":"cninet","ipam":{"type":"ipam-ring","host":"cnihost","pools":["shared"],"ranges":[[%s]]}}`, rng)
				c, err := cniipam.Load([]byte(conf), "")
				if err != nil {
					t.Fatal(err)
				}
				cni := func() error {
					_, err := cniipam.Add(ctx, a, c, cniipam.Attachment{ContainerID: "c1", IfName: "eth0"})
					return err
				}
				docker := func() error {
					res, err := d.RequestPool(ctx, &ipam.RequestPoolRequest{Pool: tc.subnet, V6: tc.v6 != "", Options: map[string]string{OptPool: "shared"}})
					if err != nil {
						return err
					}
					_, err = d.RequestAddress(ctx, &ipam.RequestAddressRequest{PoolID: res.PoolID, Address: tc.gw, Options: map[string]string{OptAddressType: AddressTypeGateway}})
					return err
				}
				first, second := cni, docker
				if dockerFirst {
					first, second = docker, cni
				}
				if err := first(); err != nil {
					t.Fatal(err)
				}
				if err := second(); err != nil {
					t.Fatalf("the second front end: %v", err)
				}
				rec, err := a.Definition(ctx, "shared")
				if err != nil {
					t.Fatal(err)
				}
				if !rec.Equal(c.RangeSets[0].Def) {
					t.Fatalf("recorded %+v, the plugin's is %+v", rec, c.RangeSets[0].Def)
				}
			})
		}
	}
}

// A point-to-point subnet has no default gateway in either front end; the
// driver says so instead of inventing one the plugin would not.
func TestPointToPointNeedsAnExplicitGateway(t *testing.T) {
	for _, subnet := range []string{"198.18.73.0/31", "2001:db8:73::/127"} {
		d := newDriver(t, memory.New(), "h")
		res, err := d.RequestPool(context.Background(), &ipam.RequestPoolRequest{Pool: subnet, V6: strings.Contains(subnet, ":")})
		if err != nil {
			t.Fatal(err)
		}
		_, err = d.RequestAddress(context.Background(), &ipam.RequestAddressRequest{PoolID: res.PoolID, Options: map[string]string{OptAddressType: AddressTypeGateway}})
		if !errors.Is(err, pool.ErrInvalid) || !strings.Contains(err.Error(), "--gateway") {
			t.Fatalf("%s without --gateway: %v", subnet, err)
		}
		if _, ok := pool.DefaultGateway(netipMust(subnet)); ok {
			t.Fatalf("pool.DefaultGateway(%s) gives one", subnet)
		}
	}
}

// Both edges rank an error by the same rule: a table of errors wrapping
// one or two sentinels maps to the same class in the driver's metrics and
// to the matching CNI code in the plugin.
func TestBothFrontEndsClassifyAlike(t *testing.T) {
	inUse := &pool.InUseError{Pool: "p", Name: "r"}
	for _, tc := range []struct {
		err   error
		class string
		code  uint
	}{
		{fmt.Errorf("x: %w", inUse), "in_use", 100},
		{errors.Join(pool.ErrInvalid, pool.ErrAlreadyInUse), "in_use", 100},
		{errors.Join(pool.ErrAlreadyExists, pool.ErrInvalid), "exists", 101},
		{&pool.CapacityError{Pool: "p"}, "no_capacity", 102},
		{&pool.OverlapError{Pool: "a", Other: "b"}, "mismatch", 103},
		{fmt.Errorf("%w: x", pool.ErrUnknownPool), "unknown_pool", 7},
		{fmt.Errorf("%w: bad", pool.ErrInvalid), "invalid", 7},
		{fmt.Errorf("%w: down", pool.ErrTryAgain), "try_again", 11},
		{context.DeadlineExceeded, "timeout", 11},
		{errors.New("boom"), "internal", 999},
	} {
		if got := Class(tc.err); got != tc.class {
			t.Errorf("driver class of %v = %s, want %s", tc.err, got, tc.class)
		}
		if got := cniipam.CNIError(tc.err).Code; got != tc.code {
			t.Errorf("plugin code of %v = %d, want %d", tc.err, got, tc.code)
		}
	}
}

func netipMust(s string) netip.Prefix { return netip.MustParsePrefix(s) }
