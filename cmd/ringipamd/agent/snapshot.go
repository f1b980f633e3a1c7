package agent

import (
	"context"
	"math/big"
	"net/netip"
	"sort"
	"time"

	"github.com/ringipam/ringipam/pkg/pool"
)

// Snapshot is what the status page and /status.json show: the
// cluster-wide view, read from the store when a request comes and the
// last one is older than StatusRefresh (never on a timer).
type Snapshot struct {
	Version  BuildVersion    `json:"version"` // this agent's build (build_info.go)
	Taken    time.Time       `json:"taken"`
	Host     string          `json:"host"`
	Addr     string          `json:"addr,omitempty"`
	Liveness bool            `json:"liveness"` // this agent holds its liveness record
	Leader   bool            `json:"leader"`   // this agent is the elected leader (leader.go)
	Orphaned time.Time       `json:"orphaned,omitzero"`
	Hosts    []pool.HostInfo `json:"hosts"`
	Pools    []PoolView      `json:"pools"`
	Forwards []Forward       `json:"forwards"`
	Routes   *RoutesView     `json:"routes,omitempty"` // with --routes
	Problems []string        `json:"problems,omitempty"`
}

// PoolView is one pool's ring with how full each range is.
type PoolView struct {
	Name  string     `json:"name"`
	Usage pool.Usage `json:"usage"`
	Ring  pool.Ring  `json:"ring"`
	// Used[i] is how many addresses are held in Ring.Ranges[i].
	Used []uint64 `json:"used"`
	// Size[i] is how many addresses Ring.Ranges[i] spans (as a float: IPv6
	// ranges do not fit an integer).
	Size []float64 `json:"size"`
}

// poolReader is what a snapshot needs of the pool library.
type poolReader interface {
	Pools(ctx context.Context) ([]pool.Def, error)
	Usage(ctx context.Context, pool string) (pool.Usage, error)
	RingOf(ctx context.Context, pool string) (pool.Ring, error)
	List(ctx context.Context, f pool.Filter) ([]pool.Allocation, error)
}

// readPools reads every pool's view: its usage and ring, and with
// withUse the use of each of its ranges (every owner of the pool listed:
// the status page, on demand); without, no owner is read (the leader's
// pool-wide figures).
func readPools(ctx context.Context, r poolReader, withUse bool) ([]PoolView, error) {
	defs, err := r.Pools(ctx)
	if err != nil {
		return nil, err
	}
	var out []PoolView
	for _, d := range defs {
		u, err := r.Usage(ctx, d.Name)
		if err != nil {
			return nil, err
		}
		ring, err := r.RingOf(ctx, d.Name)
		if err != nil {
			return nil, err
		}
		if !withUse {
			out = append(out, PoolView{Name: d.Name, Usage: u, Ring: ring})
			continue
		}
		allocs, err := r.List(ctx, pool.Filter{Pool: d.Name})
		if err != nil {
			return nil, err
		}
		out = append(out, viewOf(d.Name, u, ring, allocs))
	}
	return out, nil
}

// viewOf counts the held addresses of each range (pure).
func viewOf(name string, u pool.Usage, ring pool.Ring, allocs []pool.Allocation) PoolView {
	v := PoolView{Name: name, Usage: u, Ring: ring, Used: make([]uint64, len(ring.Ranges)), Size: make([]float64, len(ring.Ranges))}
	for i, r := range ring.Ranges {
		v.Size[i] = spanSize(r.Start, r.End)
	}
	for _, a := range allocs {
		for _, x := range a.Addrs {
			if x.Pool != name {
				continue
			}
			if i := rangeIndex(ring, x.Addr); i >= 0 {
				v.Used[i]++
			}
		}
	}
	return v
}

// rangeIndex finds the range holding addr (ranges are sorted by start).
func rangeIndex(ring pool.Ring, addr netip.Addr) int {
	i := sort.Search(len(ring.Ranges), func(i int) bool { return ring.Ranges[i].End.Compare(addr) >= 0 })
	if i < len(ring.Ranges) && ring.Ranges[i].Start.Compare(addr) <= 0 {
		return i
	}
	return -1
}

// spanSize is end-start+1 as a float.
func spanSize(start, end netip.Addr) float64 {
	s := new(big.Int).SetBytes(start.AsSlice())
	e := new(big.Int).SetBytes(end.AsSlice())
	f, _ := new(big.Float).SetInt(e.Sub(e, s).Add(e, big.NewInt(1))).Float64()
	return f
}
