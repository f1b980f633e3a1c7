package pool

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/ringipam/ringipam/pkg/store"
)

// A store is one address space: the registry (one key, registryKey) lists
// the allocatable ranges of every recorded pool, and a pool is recorded only
// in the commit that also adds it to the registry, conditioned on the
// registry being unchanged. Two hosts recording overlapping pools at the same
// moment therefore cannot both succeed: the second commit conflicts, its
// retry reads the first pool and is refused. Pools are recorded rarely (once
// per pool), so this one shared key is never hot.

// registry is the stored list of recorded pools.
type registry struct {
	Pools []registered `json:"pools"`
}

// registered is one pool as the registry lists it.
type registered struct {
	Name     string          `json:"n"`
	Ranges   [][2]netip.Addr `json:"r"` // [rangeStart, rangeEnd] of each range
	Isolated bool            `json:"i,omitempty"`
}

func registeredOf(d Def) registered {
	r := registered{Name: d.Name, Isolated: d.Isolated}
	for _, x := range d.Ranges {
		r.Ranges = append(r.Ranges, [2]netip.Addr{x.Start, x.End})
	}
	return r
}

func decodeRegistry(kv store.KV) (registry, error) {
	var r registry
	if !kv.Exists() {
		return r, nil
	}
	if err := json.Unmarshal(kv.Value, &r); err != nil {
		return registry{}, fmt.Errorf("pool registry %s is corrupt: %w", kv.Key, err)
	}
	return r, nil
}

// admit returns the registry with d added, or an *OverlapError when d's
// ranges overlap those of a pool already listed (unless either is isolated).
// A pool already listed under d's name is returned unchanged.
func (r registry) admit(d Def) (registry, error) {
	for _, p := range r.Pools {
		if p.Name == d.Name {
			return r, nil
		}
	}
	mine := registeredOf(d)
	if !mine.Isolated {
		for _, p := range r.Pools {
			if p.Isolated {
				continue
			}
			if a, b, ok := overlap(mine, p); ok {
				return registry{}, &OverlapError{Pool: d.Name, Range: a, Other: p.Name, OtherRange: b}
			}
		}
	}
	out := registry{Pools: append(slices.Clone(r.Pools), mine)}
	slices.SortFunc(out.Pools, func(a, b registered) int { return strings.Compare(a.Name, b.Name) })
	return out, nil
}

// overlaps returns every pair of listed pools whose ranges overlap (neither
// isolated), as sentences, for Check and operators.
func (r registry) overlaps() []string {
	var out []string
	for i, p := range r.Pools {
		for _, q := range r.Pools[i+1:] {
			if p.Isolated || q.Isolated {
				continue
			}
			if a, b, ok := overlap(p, q); ok {
				out = append(out, fmt.Sprintf("pools %s (%s) and %s (%s) overlap", p.Name, a, q.Name, b))
			}
		}
	}
	return out
}

func overlap(p, q registered) (string, string, bool) {
	for _, a := range p.Ranges {
		for _, b := range q.Ranges {
			if a[0].Is4() != b[0].Is4() {
				continue
			}
			if a[0].Compare(b[1]) <= 0 && b[0].Compare(a[1]) <= 0 {
				return a[0].String() + "-" + a[1].String(), b[0].String() + "-" + b[1].String(), true
			}
		}
	}
	return "", "", false
}

// OverlapError says that a pool's ranges overlap a pool already recorded in
// the store, and how to share or separate them. It wraps
// ErrDefinitionMismatch: the definition conflicts with the recorded ones.
type OverlapError struct {
	Pool, Range       string
	Other, OtherRange string
}

func (e *OverlapError) Error() string {
	return fmt.Sprintf("pool %s (%s) overlaps pool %s (%s) already recorded in this store, which is one address space: "+
		"to share these addresses name the same pool in both places (CNI: \"pools\": [%q]; Docker: --ipam-opt pool=%s); "+
		"for a truly separate L2 segment mark the pools \"isolated\": true",
		e.Pool, e.Range, e.Other, e.OtherRange, e.Other, e.Other)
}

// Unwrap makes errors.Is(err, ErrDefinitionMismatch) hold.
func (e *OverlapError) Unwrap() error { return ErrDefinitionMismatch }
