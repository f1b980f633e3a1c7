package pool

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/ringipam/ringipam/pkg/store"
)

// Inventory: whole-store reads for operators (ringctl). Each scans a prefix
// of the store, so they cost in proportion to what the store holds and are
// never on a front end's hot path.

// Pools returns every recorded pool definition, by name.
func (a *Allocator) Pools(ctx context.Context) ([]Def, error) {
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	if err := a.ensureLayout(ctx); err != nil {
		return nil, err
	}
	kvs, err := a.st.Scan(ctx, prefixDef, store.PrefixEnd(prefixDef), 0)
	if err != nil {
		return nil, err
	}
	out := make([]Def, 0, len(kvs))
	for _, kv := range kvs {
		d, err := parseDef(strings.TrimPrefix(kv.Key, prefixDef), kv.Value)
		if err != nil {
			return nil, err
		}
		out = append(out, d)
	}
	return out, nil
}

// PoolsContaining returns the recorded pools that may hand out addr (more
// than one only when isolated pools overlap).
func (a *Allocator) PoolsContaining(ctx context.Context, addr netip.Addr) ([]Def, error) {
	defs, err := a.Pools(ctx)
	if err != nil {
		return nil, err
	}
	var out []Def
	for _, d := range defs {
		if d.Contains(addr) {
			out = append(out, d)
		}
	}
	return out, nil
}

// HeldAddr is one address key of a pool as stored: an owner's address, or
// an address kept for a released reservation (a hold).
type HeldAddr struct {
	Pool  string
	Addr  netip.Addr
	Host  string
	Owner string // Owner.String(); empty for a hold
	// Set for a hold: the reservation and the end of the hold.
	Hold *Hold
}

// Held returns every address key of pool (every pool when pool is empty),
// in pool and address order. Holds whose time has ended are included (the
// caller compares Hold.Until with its clock).
func (a *Allocator) Held(ctx context.Context, pool string) ([]HeldAddr, error) {
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	if err := a.ensureLayout(ctx); err != nil {
		return nil, err
	}
	prefix := prefixAddr
	if pool != "" {
		if err := validName("pool name", pool); err != nil {
			return nil, err
		}
		prefix = addrPrefix(pool)
	}
	kvs, err := a.st.Scan(ctx, prefix, store.PrefixEnd(prefix), 0)
	if err != nil {
		return nil, err
	}
	out := make([]HeldAddr, 0, len(kvs))
	for _, kv := range kvs {
		h, ok := heldOf(kv)
		if !ok {
			return nil, fmt.Errorf("%s: unparsable address key", kv.Key)
		}
		out = append(out, h)
	}
	return out, nil
}

// heldOf decodes one a/ key.
func heldOf(kv store.KV) (HeldAddr, bool) {
	rest := strings.TrimPrefix(kv.Key, prefixAddr)
	i := strings.LastIndexByte(rest, '/')
	if i <= 0 {
		return HeldAddr{}, false
	}
	v, ok := parseAddrKey(kv.Key)
	if !ok {
		return HeldAddr{}, false
	}
	pool := rest[:i]
	is4 := len(rest)-i-1 == 8
	addr := v.addr(is4)
	h := parseHolder(kv.Value)
	out := HeldAddr{Pool: pool, Addr: addr, Host: h.Host, Owner: h.Owner}
	if h.IsHold() {
		out.Owner = ""
		out.Hold = &Hold{Pool: pool, Addr: addr, Host: h.Host, Kind: h.HoldKind, Network: h.HoldNetwork, Reservation: h.HoldName, Until: h.Until}
	}
	return out, true
}

// AllocatedAt returns, per address of pool, the latest recorded alloc event
// (from the address's history): when its current holder got it, as far as
// the bounded history still tells.
func (a *Allocator) AllocatedAt(ctx context.Context, pool string) (map[netip.Addr]Event, error) {
	if err := validName("pool name", pool); err != nil {
		return nil, err
	}
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	if err := a.ensureLayout(ctx); err != nil {
		return nil, err
	}
	prefix := prefixHistory + pool + "/"
	kvs, err := a.st.Scan(ctx, prefix, store.PrefixEnd(prefix), 0)
	if err != nil {
		return nil, err
	}
	out := map[netip.Addr]Event{}
	for _, kv := range kvs {
		rest := strings.TrimPrefix(kv.Key, prefix)
		hexAddr, _, ok := strings.Cut(rest, "/")
		if !ok {
			continue
		}
		v, ok := parseAddrKey(addrPrefix(pool) + hexAddr)
		if !ok {
			continue
		}
		var ev Event
		if json.Unmarshal(kv.Value, &ev) != nil || ev.What != EventAlloc {
			continue
		}
		ev.Addr = v.addr(len(hexAddr) == 8)
		if old, ok := out[ev.Addr]; !ok || ev.Time.After(old.Time) {
			out[ev.Addr] = ev
		}
	}
	return out, nil
}

// PlanDropHold returns what DropHold(kind, network, name) would drop now,
// and whether it would forget the reservation name too (no owner holds it),
// without changing anything.
func (a *Allocator) PlanDropHold(ctx context.Context, kind Kind, network, name string) ([]Hold, bool, error) {
	if !kind.Valid() || network == "" || name == "" {
		return nil, false, fmt.Errorf("%w: a hold is named by a kind, a network and a reservation name", ErrInvalid)
	}
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	kvs, err := a.get(ctx, resvKey(kind, network, name))
	if err != nil || !kvs[0].Exists() {
		return nil, false, err
	}
	var r reservation
	if err := json.Unmarshal(kvs[0].Value, &r); err != nil {
		return nil, false, fmt.Errorf("reservation %s: corrupt: %w", name, err)
	}
	var keys []string
	for _, x := range r.Addrs {
		keys = append(keys, addrKey(x.Pool, toU128(x.Addr), x.Addr.Is4()))
	}
	held, err := a.st.Get(ctx, keys...)
	if err != nil {
		return nil, false, err
	}
	var out []Hold
	for i, kv := range held {
		h := parseHolder(kv.Value)
		if kv.Exists() && h.heldFor(kind, network, name) {
			out = append(out, Hold{Pool: r.Addrs[i].Pool, Addr: r.Addrs[i].Addr, Host: h.Host, Kind: kind, Network: network, Reservation: name, Until: h.Until})
		}
	}
	return out, r.Owner == "", nil
}

// EndedHolds returns the holds whose time has ended at the allocator's
// clock: dynamic allocation already treats them as free, but their keys
// stay until an allocation reuses them or DropEndedHold removes them.
func (a *Allocator) EndedHolds(ctx context.Context) ([]Hold, error) {
	held, err := a.Held(ctx, "")
	if err != nil {
		return nil, err
	}
	now := a.now()
	var out []Hold
	for _, h := range held {
		if h.Hold != nil && !now.Before(h.Hold.Until) {
			out = append(out, *h.Hold)
		}
	}
	return out, nil
}

// DropEndedHold deletes the address key of h if it is still that hold and
// its time has ended; it reports whether it deleted it. The reservation
// record keeps the address as a preference for the name.
func (a *Allocator) DropEndedHold(ctx context.Context, h Hold) (bool, error) {
	if err := validName("pool name", h.Pool); err != nil {
		return false, err
	}
	if !h.Addr.IsValid() {
		return false, fmt.Errorf("%w: no address given", ErrInvalid)
	}
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	dropped := false
	err := a.run(ctx, func(int) error {
		dropped = false
		kvs, err := a.get(ctx, addrKey(h.Pool, toU128(h.Addr), h.Addr.Is4()))
		if err != nil {
			return err
		}
		cur := parseHolder(kvs[0].Value)
		if !kvs[0].Exists() || !cur.heldFor(h.Kind, h.Network, h.Reservation) || !cur.expired(a.now()) {
			return nil
		}
		if err := a.st.Commit(ctx, []store.Cond{store.Unchanged(kvs[0])}, []store.Op{store.Delete(kvs[0].Key)}); err != nil {
			return err
		}
		dropped = true
		return nil
	})
	return dropped, err
}

// ReleasePlan is what Release(owner) would do now.
type ReleasePlan struct {
	Allocation Allocation
	// Hold: the owner holds its reservation name, so its addresses would
	// stay held for it (for the allocator's reservation hold) instead of
	// becoming free.
	Hold bool
}

// PlanRelease returns what Release(owner) would release now, false when
// the owner holds nothing; it changes nothing.
func (a *Allocator) PlanRelease(ctx context.Context, owner Owner) (ReleasePlan, bool, error) {
	if err := owner.Validate(); err != nil {
		return ReleasePlan{}, false, err
	}
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	rec, ok, err := a.lookup(ctx, owner)
	if err != nil || !ok {
		return ReleasePlan{}, ok, err
	}
	p := ReleasePlan{Allocation: rec}
	if rec.Reservation != "" && a.hold > 0 {
		kvs, err := a.st.Get(ctx, resvKey(owner.Kind, owner.Network, rec.Reservation))
		if err != nil {
			return ReleasePlan{}, false, err
		}
		var r reservation
		p.Hold = kvs[0].Exists() && json.Unmarshal(kvs[0].Value, &r) == nil && r.Owner == owner.String()
	}
	return p, true, nil
}

// ReservationHold is how long this allocator keeps a released reservation's
// addresses held (WithReservationHold).
func (a *Allocator) ReservationHold() time.Duration { return a.hold }

// ReclaimPlan is what Reclaim(host) would do now (without ToCaller).
type ReclaimPlan struct {
	Host HostInfo
	// Pools whose ranges of the host would be tombstoned, by name.
	Pools []string
	// Owners that would be released (their addresses lie in ranges of the
	// host), by owner key.
	Owners []Allocation
}

// PlanReclaim returns what Reclaim(host) would tombstone and release now,
// changing nothing. It refuses what Reclaim refuses: this allocator's own
// host, and a host whose liveness key exists unless force.
func (a *Allocator) PlanReclaim(ctx context.Context, host string, force bool) (ReclaimPlan, error) {
	if host == a.host {
		return ReclaimPlan{}, fmt.Errorf("%w: a host cannot reclaim itself (%s)", ErrInvalid, host)
	}
	return a.PlanLeave(ctx, host, force)
}

// PlanLeave is PlanReclaim for a host leaving (Reclaim with Leave), which
// may be this allocator's own host.
func (a *Allocator) PlanLeave(ctx context.Context, host string, force bool) (ReclaimPlan, error) {
	if err := validName("host", host); err != nil {
		return ReclaimPlan{}, err
	}
	hosts, err := a.Hosts(ctx, 0)
	if err != nil {
		return ReclaimPlan{}, err
	}
	info := HostInfo{Name: host}
	for _, h := range hosts {
		if h.Name == host {
			info = h
		}
	}
	if info.State == HostUp && !force {
		return ReclaimPlan{}, fmt.Errorf("%w: %s has a live liveness record; stop its agent, wait for its lease to expire, or force", ErrHostLive, host)
	}
	return a.planReclaim(ctx, info)
}

func (a *Allocator) planReclaim(ctx context.Context, info HostInfo) (ReclaimPlan, error) {
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	host := info.Name
	p := ReclaimPlan{Host: info}
	defs, err := a.st.Scan(ctx, prefixDef, store.PrefixEnd(prefixDef), 0)
	if err != nil {
		return p, err
	}
	rings := map[string]ring{}
	for _, kv := range defs {
		name := strings.TrimPrefix(kv.Key, prefixDef)
		def, err := parseDef(name, kv.Value)
		if err != nil {
			return p, err
		}
		r, err := a.poolRing(ctx, name, def)
		if err != nil {
			return p, err
		}
		rings[name] = r
		if !slices.Equal(r.tombstone(host).tokens, r.tokens) {
			p.Pools = append(p.Pools, name)
		}
	}
	held, _, err := a.hostOwners(ctx, host, "", "")
	if err != nil {
		return p, err
	}
	for _, h := range held {
		rec := h.rec
		for _, x := range rec.Addrs {
			r, ok := rings[x.Pool]
			if ok && r.ownerOf(toU128(x.Addr)).Host == host {
				p.Owners = append(p.Owners, rec)
				break
			}
		}
	}
	return p, nil
}

// PlanSweep returns what Sweep(orphanAfter) would reclaim now: one plan per
// orphaned host that still has something to take back, changing nothing.
func (a *Allocator) PlanSweep(ctx context.Context, orphanAfter time.Duration) ([]ReclaimPlan, error) {
	hosts, err := a.Hosts(ctx, orphanAfter)
	if err != nil {
		return nil, err
	}
	var out []ReclaimPlan
	for _, h := range hosts {
		ok, byIndex, err := a.sweepable(ctx, h)
		if err != nil {
			return nil, err
		}
		if !ok {
			continue
		}
		p, err := a.planReclaim(ctx, h)
		if err != nil {
			return nil, err
		}
		if byIndex && len(p.Pools) == 0 && len(p.Owners) == 0 {
			continue // what is left is not its reclaim's (see Sweep)
		}
		out = append(out, p)
	}
	return out, nil
}

// sweepable is Sweep's choice of the hosts it reclaims: an orphaned host
// (not this one) that was not reclaimed since it was orphaned, or that
// has a live range, a used count or an owner left. The owners are looked
// for last, in the host's index (one scan limited to one key), only for an
// orphaned host that was reclaimed and shows nothing else (byIndex): a
// reclaim that died after tombstoning a host that had claimed new ranges
// since it was orphaned (and so dropped its state with its count) leaves
// the owners there in tombstoned ranges, and the next sweep must find
// them. An ADD costs nothing more.
func (a *Allocator) sweepable(ctx context.Context, h HostInfo) (ok, byIndex bool, err error) {
	if h.State != HostOrphaned || h.Name == a.host {
		return false, false, nil
	}
	if h.OrphanedAt.IsZero() || h.Ranges != 0 || h.Used != 0 {
		return true, false, nil
	}
	ok, err = a.ownersLeft(ctx, h.Name)
	return ok, ok, err
}

// ownersLeft reports whether host's index names any owner.
func (a *Allocator) ownersLeft(ctx context.Context, host string) (bool, error) {
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	prefix := hostOwnersPrefix(host, "", "")
	kvs, err := a.st.Scan(ctx, prefix, store.PrefixEnd(prefix), 1)
	return len(kvs) > 0, err
}

// ReservationInfo is a reservation record as operators see it.
type ReservationInfo struct {
	Kind    Kind
	Network string
	Name    string
	Owner   string     // the owner holding the name now (Owner.String()); "" when released
	Addrs   []Assigned // the addresses the name remembers
	Until   time.Time  // end of the hold after the last release; zero if none
}

// Reservation returns the record of reservation name of (kind, network),
// false when the name is unknown.
func (a *Allocator) Reservation(ctx context.Context, kind Kind, network, name string) (ReservationInfo, bool, error) {
	if !kind.Valid() || network == "" || name == "" {
		return ReservationInfo{}, false, fmt.Errorf("%w: a reservation is named by a kind, a network and a name", ErrInvalid)
	}
	ctx, cancel := a.ctx(ctx)
	defer cancel()
	kvs, err := a.get(ctx, resvKey(kind, network, name))
	if err != nil || !kvs[0].Exists() {
		return ReservationInfo{}, false, err
	}
	var r reservation
	if err := json.Unmarshal(kvs[0].Value, &r); err != nil {
		return ReservationInfo{}, false, fmt.Errorf("reservation %s: corrupt: %w", name, err)
	}
	info := ReservationInfo{Kind: kind, Network: network, Name: name, Owner: r.Owner, Addrs: r.Addrs}
	if r.Until != 0 {
		info.Until = time.Unix(r.Until, 0)
	}
	return info, true, nil
}
