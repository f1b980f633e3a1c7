package portalloc

import (
	"cmp"
	"encoding/json"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/ringipam/ringipam/pkg/store"
)

// The store layout of an address's holders (see the package doc, "Host
// ports per host"):
//
//	p/a/<proto>/<port>          AddrState: the ingress holder; the marker
//	                            while host-mode bindings exist under p/h/;
//	                            old-format host users an older ringipam wrote
//	p/h/<proto>/<port>/<host>   that host's host-mode bindings ([]binding)
const prefixHostBind = "p/h/"

// The marker: the host use an older ringipam reads in p/a/ while host-mode
// bindings of the address exist in p/h/. Its host contains '/', which no
// host name may (New refuses it), so it never collides with a host
// binding in an older ringipam's eyes; it is a host-mode user, so an older
// ringipam refuses an ingress port there.
const (
	markerHost     = "p/h/"
	markerEndpoint = "host-mode ports of several hosts, listed under p/h/"
)

var marker = HostUse{Host: markerHost, Endpoint: markerEndpoint}

func isMarker(u HostUse) bool { return u.Host == markerHost }

// binding is one host-mode use of an address as p/h/ stores it (the host
// is the key's last part).
type binding struct {
	IP       netip.Addr `json:"ip,omitzero"`
	Endpoint string     `json:"e"`
}

func hostBindPrefix(a Address) string {
	return fmt.Sprintf("%s%s/%05d/", prefixHostBind, a.Protocol, a.Number)
}

func hostBindKey(a Address, host string) string { return hostBindPrefix(a) + host }

// parseHostBindKey reads the address and host a p/h/ key names.
func parseHostBindKey(key string) (Address, string, bool) {
	rest, ok := strings.CutPrefix(key, prefixHostBind)
	if !ok {
		return Address{}, "", false
	}
	i := strings.LastIndexByte(rest, '/')
	if i < 0 || i == len(rest)-1 {
		return Address{}, "", false
	}
	a, ok := addressOfKey(prefixAddr + rest[:i])
	if !ok || hostBindKey(a, rest[i+1:]) != key {
		return Address{}, "", false // not a key this package writes
	}
	return a, rest[i+1:], true
}

// decodeBindings reads a p/h/ value as the host uses of host (absent: none).
func decodeBindings(kv store.KV, host string) ([]HostUse, error) {
	if !kv.Exists() {
		return nil, nil
	}
	var bs []binding
	if err := json.Unmarshal(kv.Value, &bs); err != nil {
		return nil, fmt.Errorf("%s: corrupt: %w (%w)", kv.Key, err, ErrCorrupt)
	}
	out := make([]HostUse, len(bs))
	for i, b := range bs {
		out[i] = HostUse{Host: host, IP: b.IP, Endpoint: b.Endpoint}
	}
	return out, nil
}

func encodeBindings(us []HostUse) []byte {
	bs := make([]binding, len(us))
	for i, u := range us {
		bs[i] = binding{IP: u.IP, Endpoint: u.Endpoint}
	}
	b, _ := json.Marshal(bs)
	return b
}

func compareUse(a, b HostUse) int {
	return cmp.Or(strings.Compare(a.Host, b.Host), strings.Compare(a.Endpoint, b.Endpoint), a.IP.Compare(b.IP))
}

func sortedUses(us []HostUse) []HostUse {
	us = slices.Clone(us)
	slices.SortFunc(us, compareUse)
	return us
}

// splitMarker returns a p/a/ record's host users without the marker, and
// whether the marker was there. The users left are old-format bindings (an
// older ringipam's, or not yet moved to p/h/).
func splitMarker(s AddrState) (legacy []HostUse, marked bool) {
	for _, u := range s.Hosts {
		if isMarker(u) {
			marked = true
		} else {
			legacy = append(legacy, u)
		}
	}
	return legacy, marked
}

// decodeAddress is the one decoding of a p/a/ KV, as List and Ingresses
// return it: the address, its ingress holder and the old-format host users
// the record still lists (the marker left out; host-mode bindings kept per
// host under p/h/ are not in it). ok is false for a key that names no
// address.
func decodeAddress(kv store.KV) (p Published, ok bool, err error) {
	addr, ok := addressOfKey(kv.Key)
	if !ok {
		return Published{}, false, nil
	}
	s, err := decodeState(kv)
	if err != nil {
		return Published{}, true, err
	}
	s.Hosts, _ = splitMarker(s)
	return Published{Address: addr, State: s}, true, nil
}

// addrRead is what one Allocate read of an address: its p/a/ record, the
// p/h/ keys of the hosts the request touches (hosts of the storeView) and,
// when the record carries the marker and the view looked, one binding of
// another host.
type addrRead struct {
	kv      store.KV // p/a/
	rec     AddrState
	legacy  []HostUse // rec's old-format host users
	marked  bool
	hostKVs []store.KV // p/h/<addr>/<host>, one per view host, in order
	bound   []HostUse  // the bindings hostKVs hold
	// scanned: p/h/ was scanned for the other hosts' bindings; others is
	// then one host's bindings among them (empty: none).
	scanned bool
	others  []HostUse
}

// state is the address as Plan sees it: the ingress holder, every host
// use known (old-format users, the view hosts' bindings, another host's
// bindings when scanned, else the marker standing for them).
func (r *addrRead) state() AddrState {
	s := AddrState{Ingress: r.rec.Ingress, IngressHost: r.rec.IngressHost}
	s.Hosts = append(s.Hosts, r.legacy...)
	s.Hosts = append(s.Hosts, r.bound...)
	if r.scanned {
		s.Hosts = append(s.Hosts, r.others...)
	} else if r.marked {
		s.Hosts = append(s.Hosts, marker)
	}
	return s
}

// layoutFault switches off one rule of the layout's commits, for the tests
// that show the layout model check catches it. Zero in production.
type layoutFault int

const (
	faultNone       layoutFault = iota
	faultNoAbsent               // no AbsentRange over p/h/ (new ingress holder, marker removed)
	faultNoMarker               // a first host binding writes no marker
	faultNoAddrCond             // a host-mode commit forgets p/a/ as read
)

// writes returns the conditions and operations that store s (what Plan
// wants address a to hold) over what r read, for a request touching hosts:
// the ingress holder and the old-format users of other hosts stay in p/a/;
// the bindings of the touched hosts go to their p/h/ keys (old-format
// users of those hosts are moved there: the online migration); the marker
// is in p/a/ exactly while p/h/ holds a binding of the address. No
// operation when nothing changes; the conditions are those of the keys
// read (a decision to keep an address as it is rests on them too).
func (r *addrRead) writes(a Address, s AddrState, hosts []string, fault layoutFault) ([]store.Cond, []store.Op) {
	var ops []store.Op
	perHost := make([][]HostUse, len(hosts))
	var keep []HostUse // old-format users of other hosts, still listed
	for _, u := range s.Hosts {
		if isMarker(u) {
			continue
		}
		if i := slices.Index(hosts, u.Host); i >= 0 {
			perHost[i] = append(perHost[i], u)
		} else if slices.Contains(r.legacy, u) {
			keep = append(keep, u)
		}
		// else: another host's binding under p/h/ (scanned): untouched.
	}
	bound := false
	for i, h := range hosts {
		cur, _ := decodeBindings(r.hostKVs[i], h)
		next := sortedUses(perHost[i])
		bound = bound || len(next) > 0
		switch {
		case len(next) == 0 && r.hostKVs[i].Exists():
			ops = append(ops, store.Delete(r.hostKVs[i].Key))
		case len(next) > 0 && !slices.Equal(sortedUses(cur), next):
			ops = append(ops, store.Put(r.hostKVs[i].Key, encodeBindings(next)))
		}
	}
	if r.scanned {
		bound = bound || len(r.others) > 0
	} else {
		bound = bound || r.marked // unscanned: others may exist
	}
	rec := AddrState{Ingress: s.Ingress, IngressHost: s.IngressHost, Hosts: keep}
	if bound && (fault != faultNoMarker || r.marked) {
		rec.Hosts = append(rec.Hosts, marker)
	}
	switch {
	case rec.empty() && r.kv.Exists():
		ops = append(ops, store.Delete(r.kv.Key))
	case !rec.empty() && !sameState(rec, r.rec):
		b, _ := json.Marshal(rec)
		ops = append(ops, store.Put(r.kv.Key, b))
	}
	var conds []store.Cond
	if fault != faultNoAddrCond || s.Ingress != "" {
		conds = append(conds, store.Unchanged(r.kv))
	}
	for _, kv := range r.hostKVs {
		conds = append(conds, store.Unchanged(kv))
	}
	prefix := hostBindPrefix(a)
	switch {
	case fault == faultNoAbsent:
	case s.Ingress != "" && s.Ingress != r.rec.Ingress, r.marked && !bound:
		// A new ingress holder, or the marker goes: no binding of another
		// host under p/h/ at commit (the view hosts' keys are conditioned
		// on as read and written here; an older reader never sees p/h/).
		conds = append(conds, absentBut(prefix, r.hostKVs)...)
	}
	return conds, ops
}

// absentBut returns the conditions that no key under prefix exists but
// those of except (which sort under prefix).
func absentBut(prefix string, except []store.KV) []store.Cond {
	keys := make([]string, 0, len(except))
	for _, kv := range except {
		keys = append(keys, kv.Key)
	}
	slices.Sort(keys)
	keys = slices.Compact(keys)
	var out []store.Cond
	from := prefix
	for _, k := range keys {
		if from < k {
			out = append(out, store.AbsentRange(from, k))
		}
		from = k + "\x00"
	}
	return append(out, store.AbsentRange(from, store.PrefixEnd(prefix)))
}

// decodeState reads a p/a/ record (absent: no holder).
func decodeState(kv store.KV) (AddrState, error) {
	var s AddrState
	if kv.Exists() {
		if err := json.Unmarshal(kv.Value, &s); err != nil {
			return AddrState{}, fmt.Errorf("%s: corrupt: %w (%w)", kv.Key, err, ErrCorrupt)
		}
	}
	return s, nil
}
