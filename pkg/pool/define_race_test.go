package pool

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/memory"
	"github.com/ringipam/ringipam/pkg/store/storetest"
)

// runConcurrentDefine: four hosts record four overlapping pools (different
// names, nested subnets) through Define at once, all of them reading the
// registry before any commits (storetest.Barrier on the registry's
// commits). Only the commit's condition on the registry stops all four from
// recording: exactly one wins, the others get an *OverlapError naming it,
// and only the winner is recorded.
func runConcurrentDefine(t *testing.T, st store.Store) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// The store gets its layout (whose first commit writes the registry
	// too) and one pool apart before the race.
	setup, err := New(st, "setup")
	if err != nil {
		t.Fatal(err)
	}
	if err := setup.Define(ctx, v4Def("before", "198.18.59.0/24")); err != nil {
		t.Fatal(err)
	}
	b := storetest.NewBarrier(st, 4, storetest.Writing(registryKey))
	subnets := []string{"198.18.60.0/24", "198.18.60.0/25", "198.18.60.64/26", "198.18.60.96/27"} // each inside the one before
	defs := make([]Def, len(subnets))
	errs := make([]error, len(subnets))
	var wg sync.WaitGroup
	for i, s := range subnets {
		defs[i] = v4Def(fmt.Sprintf("race%d", i), s)
		a, err := New(b, fmt.Sprintf("h%d", i))
		if err != nil {
			t.Fatal(err)
		}
		wg.Go(func() { errs[i] = a.Define(ctx, defs[i]) })
	}
	wg.Wait()
	if n := b.Arrived(); n != 4 {
		t.Fatalf("%d registry commits reached the barrier, want 4 (%v)", n, errs)
	}
	winner := -1
	for i, err := range errs {
		if err == nil {
			if winner >= 0 {
				t.Errorf("overlapping pools %s (%s) and %s (%s) were both recorded", defs[winner].Name, subnets[winner], defs[i].Name, subnets[i])
			}
			winner = i
		}
	}
	if winner < 0 {
		t.Fatalf("no Define won: %v", errs)
	}
	a, _ := New(st, "checker")
	for i, err := range errs {
		_, derr := a.Definition(ctx, defs[i].Name)
		if i == winner {
			if derr != nil {
				t.Errorf("the winner %s is not recorded: %v", defs[i].Name, derr)
			}
			continue
		}
		var ov *OverlapError
		if err != nil && (!errors.As(err, &ov) || ov.Other != defs[winner].Name) {
			t.Errorf("%s: %v, want an overlap with %s", defs[i].Name, err, defs[winner].Name)
		}
		if !errors.Is(derr, ErrUnknownPool) && (err != nil || derr != nil) {
			t.Errorf("%s lost (%v) but is recorded: %v", defs[i].Name, err, derr)
		}
	}
	// The registry holds the one winner: a fifth overlapping pool is
	// refused against it, a disjoint one is recorded.
	var ov *OverlapError
	if err := a.Define(ctx, v4Def("late", "198.18.60.0/23")); !errors.As(err, &ov) || ov.Other != defs[winner].Name {
		t.Errorf("a later overlapping pool: %v, want an overlap with %s", err, defs[winner].Name)
	}
	if err := a.Define(ctx, Def{Name: "apart", Ranges: []Range{{Subnet: netip.MustParsePrefix("198.18.61.0/24")}}}); err != nil {
		t.Errorf("a disjoint pool: %v", err)
	}
}

func TestConcurrentDefineMemory(t *testing.T) { runConcurrentDefine(t, memory.New()) }
