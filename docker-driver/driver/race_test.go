package driver

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/docker/go-plugins-helpers/ipam"

	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/memory"
	"github.com/ringipam/ringipam/pkg/store/storetest"
)

// post sends one plugin call to h as dockerd does and returns the decoded
// answer (Err set on failure).
func post(h http.Handler, path string, body any) (map[string]any, error) {
	b, err := json.Marshal(body)
	if err != nil {
		return nil, err
	}
	req := httptest.NewRequest(http.MethodPost, path, bytes.NewReader(b))
	w := httptest.NewRecorder()
	h.ServeHTTP(w, req)
	out := map[string]any{}
	if err := json.Unmarshal(w.Body.Bytes(), &out); err != nil {
		return nil, fmt.Errorf("%s: answer %q: %w", path, w.Body.Bytes(), err)
	}
	return out, nil
}

// runConcurrentNetworks: four driver instances, one per host, on one store,
// create a network each at once (RequestPool, then the gateway request that
// records the pool) on nested subnets, every pool recording held until all
// four have read the registry (storetest.Barrier). Exactly one network is
// created; the others get a Docker error naming the overlap and the winner.
func runConcurrentNetworks(t *testing.T, st store.Store) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// The store gets its layout, whose first commit writes the registry
	// too, before the race.
	setup, err := pool.New(st, "setup")
	if err != nil {
		t.Fatal(err)
	}
	if err := setup.Define(ctx, pool.Def{Name: "before", Ranges: []pool.Range{{Subnet: netipMust("198.18.69.0/24")}}}); err != nil {
		t.Fatal(err)
	}
	// x/pools is the pool registry (pkg/pool's layout): every recording of
	// a pool commits it, conditioned on it as read.
	b := storetest.NewBarrier(st, 4, storetest.Writing("x/pools"))
	subnets := []string{"198.18.70.0/24", "198.18.70.0/25", "198.18.70.64/26", "198.18.70.96/27"} // each inside the one before
	answers := make([]map[string]any, len(subnets))
	errs := make([]error, len(subnets))
	var wg sync.WaitGroup
	for i, s := range subnets {
		d := newDriver(t, b, fmt.Sprintf("h%d", i))
		h := Handler(d, NewMetrics(), quiet())
		wg.Go(func() {
			res, err := post(h, pathRequestPool, ipam.RequestPoolRequest{AddressSpace: LocalAddressSpace, Pool: s})
			if err != nil || res["Err"] != nil {
				answers[i], errs[i] = res, err
				return
			}
			answers[i], errs[i] = post(h, pathRequestAddress, ipam.RequestAddressRequest{PoolID: res["PoolID"].(string),
				Options: map[string]string{OptAddressType: AddressTypeGateway}})
		})
	}
	wg.Wait()
	if n := b.Arrived(); n != 4 {
		t.Fatalf("%d pool recordings reached the barrier, want 4 (answers %v, errors %v)", n, answers, errs)
	}
	winner := -1
	for i, res := range answers {
		if errs[i] != nil {
			t.Fatalf("network on %s: %v", subnets[i], errs[i])
		}
		if res["Err"] == nil {
			if winner >= 0 {
				t.Errorf("overlapping networks on %s and %s were both created (gateways %v, %v)", subnets[winner], subnets[i], answers[winner]["Address"], res["Address"])
			}
			winner = i
		}
	}
	if winner < 0 {
		t.Fatalf("no network was created: %v", answers)
	}
	for i, res := range answers {
		if i == winner {
			continue
		}
		msg, _ := res["Err"].(string)
		want := "overlaps pool " + PoolName(netipMust(subnets[winner]))
		if !strings.HasPrefix(msg, "ringipam: pool "+PoolName(netipMust(subnets[i]))) || !strings.Contains(msg, want) || !strings.Contains(msg, "--ipam-opt pool=") {
			t.Errorf("network on %s: Docker error %q, want one saying it %s and how to share it", subnets[i], msg, want)
		}
		if _, err := setup.Definition(ctx, PoolName(netipMust(subnets[i]))); err == nil {
			t.Errorf("the pool of the refused network on %s is recorded", subnets[i])
		}
	}
}

func TestConcurrentNetworksMemory(t *testing.T) { runConcurrentNetworks(t, memory.New()) }
