package cli

import (
	"context"
	"errors"
	"fmt"
	"math/big"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/ringipam/ringipam/pkg/cni/ipam"
	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/store"
)

// ExplainArgs describe the ADD to explain: the network's configuration (its
// pools, as ipam-ring derives them), or pools by name; optionally the
// attachment, a static address and a reservation name it would carry.
type ExplainArgs struct {
	NetConf     []byte
	Pools       []string
	Owner       *pool.Owner
	IP          netip.Addr
	Reservation string
	Host        string // the host the ADD would run on
}

// Verdicts of a finding.
const (
	VerdictOK   = "ok"
	VerdictWarn = "warn"
	VerdictFail = "fail"
)

// Finding is one thing explain checked.
type Finding struct {
	Check   string `json:"check"` // store, host, definition, capacity, static, owner, reservation
	Pool    string `json:"pool,omitempty"`
	Verdict string `json:"verdict"`
	Detail  string `json:"detail"`
	// CNICode is the code ipam-ring's ADD would fail with (0: none).
	CNICode int `json:"cniCode,omitempty"`
}

// Explanation says whether an ADD would succeed now, and why not.
type Explanation struct {
	Network      string    `json:"network,omitempty"`
	Host         string    `json:"host"`
	WouldSucceed bool      `json:"wouldSucceed"`
	Findings     []Finding `json:"findings"`
}

// Explain checks, in the order an ADD meets them, what would make an ADD
// fail now: the store unreachable, a pool recorded with another definition
// or overlapping another, a pool full (or full but for reservation holds),
// a static address or reservation held by another, an owner holding
// something else.
func (c *Ctl) Explain(ctx context.Context, args ExplainArgs) (Explanation, error) {
	ex := Explanation{Host: args.Host, Findings: []Finding{}}
	add := func(f Finding) { ex.Findings = append(ex.Findings, f) }
	var given []pool.Def // definitions the configuration gives; nil: by name only
	need := uint64(1)
	network := ""
	if len(args.NetConf) > 0 {
		cfg, err := ipam.Load(args.NetConf, "")
		if err != nil {
			return ex, fmt.Errorf("%w: %w", errUsage, err)
		}
		given, network = cfg.Defs(), cfg.Network
		if cfg.GatewayMode == ipam.GatewayPerContainer {
			need = 2
		}
	}
	ex.Network = network
	if len(given) == 0 && len(args.Pools) == 0 {
		return ex, usagef("explain needs the network's configuration (--config) or --pool names")
	}

	if err := store.Ping(ctx, c.Store); err != nil {
		add(Finding{Check: "store", Verdict: VerdictFail, CNICode: 11, Detail: fmt.Sprintf("the store (%s) cannot be reached: %v", c.StoreDesc, err)})
		return ex, nil
	}
	add(Finding{Check: "store", Verdict: VerdictOK, Detail: "reachable: " + c.StoreDesc})

	if args.Host != "" {
		if a, err := c.poolAs(args.Host); err == nil {
			if at, err := a.Orphaned(ctx); err != nil {
				return ex, err
			} else if !at.IsZero() {
				add(Finding{Check: "host", Verdict: VerdictWarn, CNICode: 50, Detail: fmt.Sprintf("host %s was orphaned at %s: STATUS fails until `ringctl host ack %s`", args.Host, stamp(at), args.Host)})
			}
		}
	}

	recorded, err := c.Pool.Pools(ctx)
	if err != nil {
		return ex, err
	}
	byName := map[string]pool.Def{}
	for _, d := range recorded {
		byName[d.Name] = d
	}
	var pools []pool.Def
	if given != nil {
		pools = given
	}
	for _, name := range args.Pools {
		d, ok := byName[name]
		if !ok {
			add(Finding{Check: "definition", Pool: name, Verdict: VerdictFail, CNICode: 7, Detail: "not recorded, and no configuration gives its definition"})
			continue
		}
		pools = append(pools, d)
	}
	for _, d := range pools {
		rec, isRecorded := byName[d.Name]
		switch {
		case isRecorded && given != nil && !rec.Equal(d):
			add(Finding{Check: "definition", Pool: d.Name, Verdict: VerdictFail, CNICode: 103, Detail: pool.CheckDefinition(rec, d).Error()})
			continue
		case isRecorded:
			add(Finding{Check: "definition", Pool: d.Name, Verdict: VerdictOK, Detail: "recorded as configured"})
		default:
			if o := overlapping(d, recorded); o != "" {
				add(Finding{Check: "definition", Pool: d.Name, Verdict: VerdictFail, CNICode: 103, Detail: o})
				continue
			}
			add(Finding{Check: "definition", Pool: d.Name, Verdict: VerdictOK, Detail: "not recorded yet: the first ADD records it"})
		}
		f, err := c.capacity(ctx, d, need, args.IP.IsValid() && d.Contains(args.IP))
		if err != nil {
			return ex, err
		}
		add(f)
	}

	if args.IP.IsValid() {
		add(c.explainStatic(ctx, pools, args))
	}
	if args.Owner != nil {
		add(c.explainOwner(ctx, *args.Owner, args.Host, args.IP))
	}
	if args.Reservation != "" && args.Owner != nil {
		add(c.explainReservation(ctx, *args.Owner, args.Reservation))
	}
	ex.WouldSucceed = !slices.ContainsFunc(ex.Findings, func(f Finding) bool { return f.Verdict == VerdictFail })
	return ex, nil
}

// overlapping names a recorded pool d's ranges overlap (neither isolated).
func overlapping(d pool.Def, recorded []pool.Def) string {
	if d.Isolated {
		return ""
	}
	for _, o := range recorded {
		if o.Isolated || o.Name == d.Name {
			continue
		}
		for _, a := range d.Ranges {
			for _, b := range o.Ranges {
				if a.Start.Is4() == b.Start.Is4() && a.Start.Compare(b.End) <= 0 && b.Start.Compare(a.End) <= 0 {
					return (&pool.OverlapError{Pool: d.Name, Range: a.Start.String() + "-" + a.End.String(), Other: o.Name, OtherRange: b.Start.String() + "-" + b.End.String()}).Error()
				}
			}
		}
	}
	return ""
}

func (c *Ctl) capacity(ctx context.Context, d pool.Def, need uint64, static bool) (Finding, error) {
	f := Finding{Check: "capacity", Pool: d.Name}
	held, err := c.Pool.Held(ctx, d.Name)
	if err != nil {
		return f, err
	}
	now := c.now()
	var used, holds uint64
	var firstEnd time.Time
	names := map[string]bool{}
	for _, h := range held {
		switch {
		case h.Hold == nil:
			used++
		case now.Before(h.Hold.Until):
			holds++
			names[h.Hold.Reservation+" (network "+h.Hold.Network+")"] = true
			if firstEnd.IsZero() || h.Hold.Until.Before(firstEnd) {
				firstEnd = h.Hold.Until
			}
		}
	}
	size, _ := new(big.Int).SetString(d.Capacity(), 10)
	left := new(big.Int).Sub(size, new(big.Int).SetUint64(used))
	free := new(big.Int).Sub(left, new(big.Int).SetUint64(holds))
	needB := new(big.Int).SetUint64(need)
	if static {
		needB.SetUint64(need - 1) // the static address is checked on its own
	}
	switch {
	case free.Cmp(needB) >= 0:
		f.Verdict, f.Detail = VerdictOK, fmt.Sprintf("%s of %s addresses free (%d used, %d held for reservations)", free, d.Capacity(), used, holds)
	case left.Cmp(needB) >= 0:
		var list []string
		for n := range names {
			list = append(list, n)
		}
		slices.Sort(list)
		if len(list) > 3 {
			list = append(list[:3], fmt.Sprintf("and %d more", len(list)-3))
		}
		f.Verdict, f.CNICode = VerdictFail, 102
		f.Detail = fmt.Sprintf("full but for %d addresses held for released reservations (%s); the first hold ends %s: "+
			"wait, or free them with `ringctl hold drop NAME --network N`", holds, strings.Join(list, ", "), stamp(firstEnd))
	default:
		f.Verdict, f.CNICode = VerdictFail, 102
		f.Detail = (&pool.CapacityError{Pool: d.Name, Used: used, Capacity: d.Capacity()}).Error()
	}
	return f, nil
}

func (c *Ctl) explainStatic(ctx context.Context, pools []pool.Def, args ExplainArgs) Finding {
	f := Finding{Check: "static", Detail: args.IP.String()}
	var in *pool.Def
	for i := range pools {
		if pools[i].Contains(args.IP) {
			in = &pools[i]
		}
	}
	if in == nil {
		f.Verdict, f.CNICode = VerdictFail, 7
		f.Detail = fmt.Sprintf("%s is an address none of the pools hands out", args.IP)
		return f
	}
	f.Pool = in.Name
	h, ok, err := c.Pool.HolderOf(ctx, in.Name, args.IP)
	switch {
	case err != nil && errors.Is(err, pool.ErrUnknownPool):
		ok = false
	case err != nil:
		f.Verdict, f.Detail = VerdictFail, fmt.Sprintf("looking up %s: %v", args.IP, err)
		return f
	}
	switch {
	case !ok:
		f.Verdict, f.Detail = VerdictOK, fmt.Sprintf("%s is free", args.IP)
	case h.Owner.ContainerID == "" && args.Owner != nil && h.Reservation == args.Reservation && h.Owner.Kind == args.Owner.Kind && h.Owner.Network == args.Owner.Network:
		f.Verdict, f.Detail = VerdictOK, fmt.Sprintf("%s is held for reservation %s, which this ADD carries", args.IP, h.Reservation)
	case h.Owner.ContainerID == "":
		f.Verdict, f.CNICode = VerdictFail, 100
		f.Detail = fmt.Sprintf("%s is held for reservation %s (%s network %s) after its owner's release: "+
			"only an owner with that name gets it, or `ringctl hold drop %s --kind %s --network %s`",
			args.IP, h.Reservation, h.Owner.Kind, h.Owner.Network, h.Reservation, h.Owner.Kind, h.Owner.Network)
	case args.Owner != nil && h.Owner == *args.Owner:
		f.Verdict, f.Detail = VerdictOK, fmt.Sprintf("%s is already this owner's: ADD returns it", args.IP)
	default:
		f.Verdict, f.CNICode = VerdictFail, 100
		f.Detail = fmt.Sprintf("%s is already in use by %s on host %s", args.IP, h.Owner, h.Host)
	}
	return f
}

func (c *Ctl) explainOwner(ctx context.Context, o pool.Owner, host string, ip netip.Addr) Finding {
	f := Finding{Check: "owner", Detail: o.String()}
	al, ok, err := c.Pool.Lookup(ctx, o)
	switch {
	case err != nil:
		f.Verdict, f.Detail = VerdictFail, fmt.Sprintf("looking up %s: %v", o, err)
	case !ok:
		f.Verdict, f.Detail = VerdictOK, fmt.Sprintf("%s holds nothing: ADD allocates", o)
	case host != "" && al.Host != host:
		f.Verdict, f.CNICode = VerdictFail, int(ipam.CodeAlreadyExists)
		f.Detail = fmt.Sprintf("%s already holds %v, allocated on host %s: release it there first (ringctl release --owner %s)", o, addrsOf(al), al.Host, o)
	case ip.IsValid() && !slices.Contains(addrsOf(al), ip):
		f.Verdict, f.CNICode = VerdictFail, int(ipam.CodeAlreadyExists)
		f.Detail = fmt.Sprintf("%s already holds %v; asked for %s (release it first)", o, addrsOf(al), ip)
	default:
		f.Verdict, f.Detail = VerdictOK, fmt.Sprintf("%s already holds %v: ADD returns it", o, addrsOf(al))
	}
	return f
}

func (c *Ctl) explainReservation(ctx context.Context, o pool.Owner, name string) Finding {
	f := Finding{Check: "reservation", Detail: name}
	r, ok, err := c.Pool.Reservation(ctx, o.Kind, o.Network, name)
	switch {
	case err != nil:
		f.Verdict, f.Detail = VerdictFail, fmt.Sprintf("reading reservation %s: %v", name, err)
	case !ok:
		f.Verdict, f.Detail = VerdictOK, fmt.Sprintf("reservation %s is new", name)
	case r.Owner != "" && r.Owner != o.String():
		f.Verdict, f.CNICode = VerdictFail, 100
		f.Detail = fmt.Sprintf("reservation %s is in use by %s (a live owner holds the name)", name, r.Owner)
	default:
		var addrs []string
		for _, x := range r.Addrs {
			addrs = append(addrs, x.Addr.String())
		}
		f.Verdict, f.Detail = VerdictOK, fmt.Sprintf("reservation %s remembers %s: ADD asks for them", name, strings.Join(addrs, ", "))
	}
	return f
}
