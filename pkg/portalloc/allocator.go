package portalloc

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"maps"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/ringipam/ringipam/pkg/retry"
	"github.com/ringipam/ringipam/pkg/store"
)

// Default dynamic range (the seed's DynamicPortNumber).
const (
	DefaultLo uint16 = 30000
	DefaultHi uint16 = 32767
)

// Kind is the owner kind of published ports, the first part of every
// holder name (as pkg/pool's KindPort), so that a listing of the store tells
// a port's owner from an address's.
const Kind = "port"

// EndpointID names an endpoint: the CNI attachment (network, container ID,
// interface). Parts may not contain '/'.
type EndpointID struct {
	Network, ContainerID, IfName string
}

// String is the holder name: port/<network>/<container>/<interface>.
func (e EndpointID) String() string { return Kind + "/" + e.path() }

func (e EndpointID) path() string { return e.Network + "/" + e.ContainerID + "/" + e.IfName }

// ParseEndpointID reads a holder name made by String.
func ParseEndpointID(s string) (EndpointID, bool) {
	rest, ok := strings.CutPrefix(s, Kind+"/")
	if !ok {
		return EndpointID{}, false
	}
	parts := strings.SplitN(rest, "/", 3)
	if len(parts) != 3 {
		return EndpointID{}, false
	}
	id := EndpointID{Network: parts[0], ContainerID: parts[1], IfName: parts[2]}
	return id, id.Validate() == nil
}

// Validate rejects IDs that would break the key layout.
func (e EndpointID) Validate() error {
	if e.Network == "" || e.ContainerID == "" {
		return fmt.Errorf("%w: endpoint needs a network and a container ID", ErrInvalid)
	}
	for _, p := range []string{e.Network, e.ContainerID, e.IfName} {
		if len(p) > 253 || strings.ContainsAny(p, "/\x00\n\r") {
			return fmt.Errorf("%w: endpoint part %q may not contain '/' or control characters, nor exceed 253 bytes", ErrInvalid, p)
		}
	}
	return nil
}

// Keys: every key of the package starts with "p/".
const (
	prefixEndpoint = "p/e/"
	prefixAddr     = "p/a/"
)

func endpointKey(id EndpointID) string { return prefixEndpoint + id.path() }

// endpointOfKey reads the endpoint a p/e/ key names.
func endpointOfKey(key string) (EndpointID, bool) {
	return ParseEndpointID(Kind + "/" + strings.TrimPrefix(key, prefixEndpoint))
}
func addrKey(a Address) string { return fmt.Sprintf("%s%s/%05d", prefixAddr, a.Protocol, a.Number) }
func addrPrefix(protocol string) string {
	return prefixAddr + protocol + "/"
}

// Allocator publishes ports for the endpoints of one host on a store.
// Every Allocate is one commit; conflicts are retried (bounded).
type Allocator struct {
	st      store.Store
	host    string
	lo, hi  uint16
	policy  retry.Policy
	timeout time.Duration
	indexed atomic.Bool // p/x was seen: the hosts' index is complete
	fault   layoutFault // tests only: a broken layout rule
	rules   Rules       // AllRules; tests switch one off
}

// Option configures an Allocator.
type Option func(*Allocator)

// WithDynamicRange sets the dynamic range (default 30000-32767).
func WithDynamicRange(lo, hi uint16) Option { return func(a *Allocator) { a.lo, a.hi = lo, hi } }

// WithRetry sets the retry policy for store conflicts.
func WithRetry(p retry.Policy) Option { return func(a *Allocator) { a.policy = p } }

// New returns an Allocator for host on st.
func New(st store.Store, host string, opts ...Option) (*Allocator, error) {
	if host == "" || strings.ContainsAny(host, "/ \x00") {
		return nil, fmt.Errorf("%w: host %q", ErrInvalid, host)
	}
	a := &Allocator{st: st, host: host, lo: DefaultLo, hi: DefaultHi, policy: retry.Default, timeout: 30 * time.Second, rules: AllRules}
	for _, o := range opts {
		o(a)
	}
	if a.lo == 0 || a.lo > a.hi {
		return nil, fmt.Errorf("%w: dynamic range %d-%d", ErrInvalid, a.lo, a.hi)
	}
	return a, nil
}

// Allocate publishes spec for endpoint id on this host, replacing what it
// had, in one transaction, and returns the ports (in spec order) and any
// findings about inconsistent stored allocations. An empty spec releases
// everything the endpoint holds and never fails on spec grounds.
func (a *Allocator) Allocate(ctx context.Context, id EndpointID, spec []Port) (Result, error) {
	return a.allocate(ctx, id, spec, nil)
}

// reclaimGuard makes a release part of the reclaim of a gone host: the
// endpoint is released only while its record names host, and only while
// every condition of conds holds (pool's guard: the host's liveness key as
// the reclaim read it, absent). The guard's keys are read with the record,
// checked before planning, and carried by the commit.
type reclaimGuard struct {
	host  string
	conds []store.Cond
}

func (a *Allocator) allocate(ctx context.Context, id EndpointID, spec []Port, guard *reclaimGuard) (Result, error) {
	if err := id.Validate(); err != nil {
		return Result{}, err
	}
	if err := ValidateSpec(spec); err != nil {
		return Result{}, err
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, a.timeout)
		defer cancel()
	}
	me := id.String()
	var out Result
	err := retry.Do(ctx, a.policy, func(err error) bool {
		return errors.Is(err, store.ErrConflict) || errors.Is(err, store.ErrUnavailable) && ctx.Err() == nil
	}, func(int) error {
		v := newStoreView(ctx, a.st)
		keys := []string{endpointKey(id)}
		if guard != nil {
			for _, c := range guard.conds {
				keys = append(keys, c.Key)
			}
		}
		kvs, err := a.st.Get(ctx, keys...)
		if err != nil {
			return err
		}
		epKV := kvs[0]
		old, err := decodeEndpoint(id, epKV)
		if err != nil {
			return err
		}
		if guard != nil {
			for i, c := range guard.conds {
				if kvs[1+i].Revision != c.Revision {
					return fmt.Errorf("%w: %s changed since the reclaim of %s began", ErrGuard, c.Key, guard.host)
				}
			}
			if !epKV.Exists() || old.Host != guard.host {
				out = Result{} // released, or taken over by another host, meanwhile
				return nil
			}
		}
		// The hosts whose bindings the request touches: this one, and the
		// endpoint's old host when it moves (or is reclaimed).
		v.hosts = []string{a.host}
		if old.Host != "" && old.Host != a.host && !strings.ContainsAny(old.Host, "/\x00") {
			v.hosts = append(v.hosts, old.Host)
		}
		// One read for every address the plan will look at first.
		var addrs []Address
		for _, p := range append(slices.Clone(old.Ports), spec...) {
			if p.Number != 0 {
				addrs = append(addrs, p.addr())
			}
			if p.Number != 0 && p.Mode == Ingress {
				v.scanFor[p.addr()] = true
			}
		}
		if err := v.prefetch(addrs); err != nil {
			return err
		}
		res, err := Plan(v, Request{Endpoint: me, Host: a.host, Old: old, Spec: spec, Lo: a.lo, Hi: a.hi, Start: a.start(me), Rules: a.rules})
		if err != nil {
			return err
		}
		rec := Endpoint{Kind: Kind, Host: a.host, Spec: spec, Ports: res.Ports}
		var conds []store.Cond
		var ops []store.Op
		for _, addr := range slices.SortedFunc(maps.Keys(res.Changes), compareAddr) {
			r, ok := v.reads[addr]
			if !ok {
				return fmt.Errorf("port %s changed without being read", addr)
			}
			if r.marked && !r.scanned && !boundOn(res.Changes[addr], v.hosts) {
				// The view hosts keep no binding here: the marker goes
				// unless another host has one.
				if err := v.others(addr); err != nil {
					return err
				}
			}
			c, o := r.writes(addr, res.Changes[addr], v.hosts, a.fault)
			conds, ops = append(conds, c...), append(ops, o...)
		}
		if len(ops) == 0 && (len(spec) == 0 && !epKV.Exists() || epKV.Exists() && sameEndpoint(old, rec)) {
			out = res // a repeated request: nothing to write
			return nil
		}
		conds = append(conds, store.Unchanged(epKV))
		if guard != nil {
			conds = append(conds, guard.conds...)
		}
		// The host's index follows the record in the same commit.
		if epKV.Exists() && old.Host != "" && (len(spec) == 0 || old.Host != a.host) {
			ops = append(ops, store.Delete(hostIndexKey(old.Host, id)))
		}
		if len(spec) > 0 {
			ops = append(ops, store.Put(hostIndexKey(a.host, id), []byte{}))
		}
		if len(spec) == 0 {
			ops = append(ops, store.Delete(endpointKey(id)))
		} else {
			b, _ := json.Marshal(rec)
			ops = append(ops, store.Put(endpointKey(id), b))
		}
		if len(conds)+len(ops) > store.MaxOps {
			return fmt.Errorf("%w: %d published ports in one request is more than one store transaction holds", ErrInvalid, len(spec))
		}
		if err := a.st.Commit(ctx, conds, ops); err != nil {
			return err
		}
		out = res
		return nil
	})
	if errors.Is(err, retry.ErrExhausted) {
		return Result{}, errors.Join(ErrTryAgain, err)
	}
	return out, err
}

// Release frees every port of endpoint id (Allocate with an empty spec).
func (a *Allocator) Release(ctx context.Context, id EndpointID) (Result, error) {
	return a.Allocate(ctx, id, nil)
}

// decodeEndpoint reads an endpoint record (absent: the zero Endpoint).
func decodeEndpoint(id EndpointID, kv store.KV) (Endpoint, error) {
	var e Endpoint
	if !kv.Exists() {
		return e, nil
	}
	if err := json.Unmarshal(kv.Value, &e); err != nil {
		return Endpoint{}, fmt.Errorf("%w: endpoint %s: stored record is corrupt: %w", ErrCorrupt, id, err)
	}
	if e.Kind != Kind {
		return Endpoint{}, fmt.Errorf("%w: endpoint %s: stored record has kind %q, not %q", ErrCorrupt, id, e.Kind, Kind)
	}
	return e, nil
}

// boundOn reports whether s keeps a host binding on one of hosts.
func boundOn(s AddrState, hosts []string) bool {
	return slices.ContainsFunc(s.Hosts, func(u HostUse) bool { return slices.Contains(hosts, u.Host) })
}

func compareAddr(x, y Address) int {
	return cmp.Or(strings.Compare(x.Protocol, y.Protocol), cmp.Compare(x.Number, y.Number))
}

func sameState(a, b AddrState) bool {
	return a.Ingress == b.Ingress && a.IngressHost == b.IngressHost && slices.Equal(a.Hosts, b.Hosts)
}

func sameEndpoint(a, b Endpoint) bool {
	return a.Kind == b.Kind && a.Host == b.Host && slices.Equal(a.Spec, b.Spec) && slices.Equal(a.Ports, b.Ports)
}

// Lookup returns what endpoint id holds, false when it holds nothing.
func (a *Allocator) Lookup(ctx context.Context, id EndpointID) (Endpoint, bool, error) {
	if err := id.Validate(); err != nil {
		return Endpoint{}, false, err
	}
	kvs, err := a.st.Get(ctx, endpointKey(id))
	if err != nil || !kvs[0].Exists() {
		return Endpoint{}, false, err
	}
	e, err := decodeEndpoint(id, kvs[0])
	return e, err == nil, err
}

// Published is one held address with its holders, for listings.
type Published struct {
	Address Address
	State   AddrState
}

// List returns every published address with all its holders, by protocol
// and number: the ingress holder, and every host's host-mode bindings
// (p/h/, and old-format users still listed in p/a/). It reads the whole of
// p/a/ and p/h/ (ringctl ports); what forwards ingress ports needs only
// Ingresses.
func (a *Allocator) List(ctx context.Context) ([]Published, error) {
	out, err := a.scanAddresses(ctx)
	if err != nil {
		return nil, err
	}
	kvs, err := a.st.Scan(ctx, prefixHostBind, store.PrefixEnd(prefixHostBind), 0)
	if err != nil {
		return nil, err
	}
	at := map[Address]int{}
	for i, p := range out {
		at[p.Address] = i
	}
	for _, kv := range kvs {
		addr, host, ok := parseHostBindKey(kv.Key)
		if !ok {
			continue
		}
		us, err := decodeBindings(kv, host)
		if err != nil {
			return nil, err
		}
		i, ok := at[addr]
		if !ok {
			i = len(out)
			at[addr] = i
			out = append(out, Published{Address: addr})
		}
		out[i].State.Hosts = append(out[i].State.Hosts, us...)
	}
	slices.SortFunc(out, func(x, y Published) int { return compareAddr(x.Address, y.Address) })
	return out, nil
}

// Ingresses returns every address held in ingress mode, by protocol and
// number, from one scan of p/a/ (whose size does not grow with the hosts
// that bind host-mode ports): what the agents forward.
func (a *Allocator) Ingresses(ctx context.Context) ([]Published, error) {
	all, err := a.scanAddresses(ctx)
	if err != nil {
		return nil, err
	}
	return slices.DeleteFunc(all, func(p Published) bool { return p.State.Ingress == "" }), nil
}

// scanAddresses decodes every p/a/ key (decodeAddress).
func (a *Allocator) scanAddresses(ctx context.Context) ([]Published, error) {
	kvs, err := a.st.Scan(ctx, prefixAddr, store.PrefixEnd(prefixAddr), 0)
	if err != nil {
		return nil, err
	}
	out := make([]Published, 0, len(kvs))
	for _, kv := range kvs {
		p, ok, err := decodeAddress(kv)
		if err != nil {
			return nil, err
		}
		if ok {
			out = append(out, p)
		}
	}
	return out, nil
}

// start spreads dynamic searches: each endpoint starts at its own place in
// the range, so hosts allocating at once rarely want the same number.
func (a *Allocator) start(me string) uint16 {
	h := fnv.New32a()
	h.Write([]byte(me))
	return a.lo + uint16(h.Sum32()%uint32(int(a.hi-a.lo)+1))
}

// storeView is the Plan's View over the store: addresses read once and
// kept, with their revisions for the commit's conditions. Each address is
// its p/a/ record and the p/h/ keys of hosts (the request's host, and the
// endpoint's old one when it moves); the other hosts' bindings are looked
// up (one scan, at most len(hosts)+1 keys) only where a decision needs
// them: an ingress entry's static address (scanFor), and a marked address
// the view hosts bind (the marker may be theirs alone: a release may
// remove it, and an ingress entry of the same request may take it).
// Elsewhere the marker stands for them.
type storeView struct {
	ctx     context.Context
	st      store.Store
	hosts   []string
	scanFor map[Address]bool
	reads   map[Address]*addrRead
}

func newStoreView(ctx context.Context, st store.Store) *storeView {
	return &storeView{ctx: ctx, st: st, scanFor: map[Address]bool{}, reads: map[Address]*addrRead{}}
}

// prefetch reads every address of addrs not read yet, in one Get.
func (v *storeView) prefetch(addrs []Address) error {
	var missing []Address
	var keys []string
	for _, a := range addrs {
		if _, ok := v.reads[a]; ok || slices.Contains(missing, a) {
			continue
		}
		missing = append(missing, a)
		keys = append(keys, addrKey(a))
		for _, h := range v.hosts {
			keys = append(keys, hostBindKey(a, h))
		}
	}
	if len(missing) == 0 {
		return nil
	}
	got, err := v.st.Get(v.ctx, keys...)
	if err != nil {
		return err
	}
	n := 1 + len(v.hosts)
	for i, a := range missing {
		if err := v.enter(a, got[i*n], got[i*n+1:(i+1)*n]); err != nil {
			return err
		}
	}
	return nil
}

// enter records what was read of a: its p/a/ KV and the view hosts' p/h/
// KVs (nil: absent, as the marker's absence says).
func (v *storeView) enter(a Address, kv store.KV, hostKVs []store.KV) error {
	s, err := decodeState(kv)
	if err != nil {
		return err
	}
	r := &addrRead{kv: kv, rec: s}
	r.legacy, r.marked = splitMarker(s)
	for i, h := range v.hosts {
		hkv := store.KV{Key: hostBindKey(a, h)}
		if hostKVs != nil {
			hkv = hostKVs[i]
		}
		us, err := decodeBindings(hkv, h)
		if err != nil {
			return err
		}
		r.hostKVs = append(r.hostKVs, hkv)
		r.bound = append(r.bound, us...)
	}
	v.reads[a] = r
	return nil
}

// others looks up one binding of a host other than the view's under p/h/
// (one scan), once per address.
func (v *storeView) others(a Address) error {
	r := v.reads[a]
	if r.scanned {
		return nil
	}
	prefix := hostBindPrefix(a)
	kvs, err := v.st.Scan(v.ctx, prefix, store.PrefixEnd(prefix), len(v.hosts)+1)
	if err != nil {
		return err
	}
	for _, kv := range kvs {
		_, host, ok := parseHostBindKey(kv.Key)
		if !ok || slices.Contains(v.hosts, host) {
			continue
		}
		if r.others, err = decodeBindings(kv, host); err != nil {
			return err
		}
		break
	}
	r.scanned = true
	return nil
}

func (v *storeView) State(a Address) (AddrState, error) {
	if err := v.prefetch([]Address{a}); err != nil {
		return AddrState{}, err
	}
	if r := v.reads[a]; r.marked && (v.scanFor[a] || len(r.bound) > 0) {
		if err := v.others(a); err != nil {
			return AddrState{}, err
		}
	}
	return v.reads[a].state(), nil
}

// scanPage is how many held numbers one scan of a dynamic search reads.
const scanPage = 128

// NextFree walks [from, hi] then [lo, from) with ordered scans of p/a/: a
// number with no key is free unless free says otherwise; held numbers are
// judged by free on their state (a marked one with the view hosts'
// bindings, read in one Get per page; the marker stands for the other
// hosts', looked up only where the view hosts bind the number too). Cost:
// one scan, and at most one Get, per scanPage held numbers passed, and one
// small scan per number the view hosts bind, whatever the number of hosts.
func (v *storeView) NextFree(protocol string, lo, hi, from uint16, free func(uint16, AddrState) bool) (uint16, bool, error) {
	for _, r := range [][2]uint16{{from, hi}, {lo, from - 1}} {
		if from == lo && r[0] == lo && r[1] == from-1 || r[0] > r[1] {
			continue
		}
		n, ok, err := v.walk(protocol, r[0], r[1], free)
		if err != nil || ok {
			return n, ok, err
		}
	}
	return 0, false, nil
}

// known returns the state of number n of protocol for a walk: as read, or
// (no p/a/ key) free of holders, with the view hosts' p/h/ keys absent as
// the marker's absence says.
func (v *storeView) known(protocol string, n uint16) (AddrState, error) {
	a := Address{protocol, n}
	if _, ok := v.reads[a]; !ok {
		if err := v.enter(a, store.KV{Key: addrKey(a)}, nil); err != nil {
			return AddrState{}, err
		}
	}
	if r := v.reads[a]; r.marked && len(r.bound) > 0 {
		// The marker may be the view hosts' own (bindings this request
		// may release): look whether another host has one.
		if err := v.others(a); err != nil {
			return AddrState{}, err
		}
	}
	return v.reads[a].state(), nil
}

// page enters the p/a/ KVs of one scan: the marked ones with their view
// hosts' p/h/ keys (one Get), the others as their unmarked record says.
func (v *storeView) page(kvs []store.KV) error {
	var marked []Address
	for _, kv := range kvs {
		a, ok := addressOfKey(kv.Key)
		if !ok {
			continue
		}
		if _, seen := v.reads[a]; seen {
			continue
		}
		s, err := decodeState(kv)
		if err != nil {
			return err
		}
		if _, m := splitMarker(s); m {
			marked = append(marked, a)
		} else if err := v.enter(a, kv, nil); err != nil {
			return err
		}
	}
	return v.prefetch(marked)
}

func (v *storeView) walk(protocol string, from, to uint16, free func(uint16, AddrState) bool) (uint16, bool, error) {
	cur := int(from)
	for cur <= int(to) {
		kvs, err := v.st.Scan(v.ctx, addrKey(Address{protocol, uint16(cur)}), addrKey(Address{protocol, to})+"\x00", scanPage)
		if err != nil {
			return 0, false, err
		}
		if err := v.page(kvs); err != nil {
			return 0, false, err
		}
		for _, kv := range kvs {
			a, ok := addressOfKey(kv.Key)
			if !ok || a.Protocol != protocol {
				continue
			}
			n := int(a.Number)
			for ; cur <= n; cur++ {
				st, err := v.known(protocol, uint16(cur))
				if err != nil {
					return 0, false, err
				}
				if free(uint16(cur), st) {
					return uint16(cur), true, nil
				}
			}
		}
		if len(kvs) < scanPage {
			for ; cur <= int(to); cur++ {
				st, err := v.known(protocol, uint16(cur))
				if err != nil {
					return 0, false, err
				}
				if free(uint16(cur), st) {
					return uint16(cur), true, nil
				}
			}
			return 0, false, nil
		}
	}
	return 0, false, nil
}

// Endpoints returns every endpoint of network with its record.
func (a *Allocator) Endpoints(ctx context.Context, network string) (map[EndpointID]Endpoint, error) {
	prefix := prefixEndpoint + network + "/"
	kvs, err := a.st.Scan(ctx, prefix, store.PrefixEnd(prefix), 0)
	if err != nil {
		return nil, err
	}
	out := map[EndpointID]Endpoint{}
	var errs []error
	for _, kv := range kvs {
		id, ok := endpointOfKey(kv.Key)
		if !ok {
			errs = append(errs, fmt.Errorf("%w: key %q names no endpoint", ErrCorrupt, kv.Key))
			continue
		}
		e, err := decodeEndpoint(id, kv)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		out[id] = e
	}
	return out, errors.Join(errs...)
}

// Verify reads endpoint id's record and checks it against the addresses it
// claims: the findings name every port the record claims that its address
// does not list, and a record whose ports do not fit its spec. ok is false
// when the endpoint holds nothing.
func (a *Allocator) Verify(ctx context.Context, id EndpointID) (e Endpoint, ok bool, findings []string, err error) {
	e, ok, err = a.Lookup(ctx, id)
	if err != nil || !ok {
		return e, ok, nil, err
	}
	if !recordFits(e) {
		findings = append(findings, fmt.Sprintf("endpoint %s: stored ports %v do not fit its stored spec %v", id, e.Ports, e.Spec))
	}
	v := newStoreView(ctx, a.st)
	v.hosts = []string{e.Host}
	var addrs []Address
	for _, p := range e.Ports {
		addrs = append(addrs, p.addr())
	}
	if err := v.prefetch(addrs); err != nil {
		return e, ok, nil, err
	}
	for _, p := range e.Ports {
		if !lists(v.reads[p.addr()].state(), id.String(), p, e.Host) {
			findings = append(findings, fmt.Sprintf("endpoint %s claims %s %s, which its address does not list", id, p.Mode, p.addr()))
		}
	}
	return e, ok, findings, nil
}
