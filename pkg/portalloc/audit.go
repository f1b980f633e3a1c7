package portalloc

import (
	"cmp"
	"context"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/ringipam/ringipam/pkg/store"
)

// Invariants Audit checks, one stable name each (Finding.Invariant), as
// `ringctl check` prints them.
const (
	// InvRecords: endpoint records and address records agree both ways:
	// every port an endpoint record claims is listed for it by its
	// address, every holder an address lists has a record claiming the
	// port there (else the port is leaked: no DEL or GC of its endpoint
	// will release it), and a record's ports are its spec allocated.
	InvRecords = "port-records"
	// InvClash: no two holders of one address against the publishing
	// rules, whether the address records or the endpoint records say so:
	// an ingress port has one holder in the whole cluster and shares its
	// address with no host port on any host (it is bound on every host:
	// it would shadow it); host ports of one host on one address bind
	// disjoint host IPs (a port on every address of its host overlaps
	// any other). A record claiming one address twice counts.
	InvClash = "port-clash"
	// InvHolder: every endpoint holding ports exists: its host is one the
	// store knows (else no sweep or gc releases its ports when the host
	// is gone), and where the IPAM serves its network, the attachment has
	// addresses, held on the host that publishes its ports.
	InvHolder = "port-holder"
	// InvCorrupt: every port record can be read (the name pkg/pool's
	// audit gives the same invariant).
	InvCorrupt = "corrupt"
)

// Finding is one broken invariant found by Audit.
type Finding struct {
	Invariant string `json:"invariant"`
	Detail    string `json:"detail"`
}

func (f Finding) String() string { return f.Invariant + ": " + f.Detail }

// Holders is what Audit knows of the holders of ports besides the port
// records (the IPAM's view of the store; pkg/portalloc does not read it
// itself). The zero value checks nothing of InvHolder.
type Holders struct {
	// Hosts is every host the store knows (pool.Allocator.Hosts). Empty:
	// the hosts of endpoints are not checked (a store whose pools know no
	// host at all: ports published beside another IPAM on a local store).
	Hosts map[string]bool
	// Attachments is the host each attachment (network, container ID,
	// interface) the IPAM serves holds its addresses on: the CNI owners
	// of pkg/pool. An endpoint of a network that has any attachment here
	// must be one of them, on the same host.
	Attachments map[EndpointID]string
}

// holding is one holder of one address: an endpoint, its mode, the host
// it is held on and, in host mode, the host IP bound.
type holding struct {
	mode     Mode
	endpoint string
	host     string
	ip       netip.Addr
}

func (h holding) compare(o holding) int {
	return cmp.Or(strings.Compare(string(h.mode), string(o.mode)), strings.Compare(h.endpoint, o.endpoint),
		strings.Compare(h.host, o.host), h.ip.Compare(o.ip))
}

// same reports whether h and o are one holding (an ingress holding is one
// per endpoint, whatever host the two sources name: InvRecords reports a
// disagreement about the host).
func (h holding) same(o holding) bool {
	if h.mode == Ingress {
		return o.mode == Ingress && h.endpoint == o.endpoint
	}
	return h == o
}

// clash says why two holdings of addr break the publishing rules, "" when
// they do not.
func clash(addr Address, a, b holding) string {
	if b.mode == Ingress && a.mode != Ingress {
		a, b = b, a
	}
	switch {
	case a.mode == Ingress && b.mode == Ingress:
		return fmt.Sprintf("%s is held in ingress mode by both %s (host %s) and %s (host %s): an ingress port has one holder in the whole cluster",
			addr, a.endpoint, a.host, b.endpoint, b.host)
	case a.mode == Ingress:
		return fmt.Sprintf("%s is held in ingress mode by %s and in host mode by %s on host %s: the ingress port, bound on every host, shadows the host port",
			addr, a.endpoint, b.endpoint, b.host)
	case a.host == b.host && overlaps(a.ip, b.ip):
		return fmt.Sprintf("%s on host %s is bound by %s and %s on overlapping addresses", addr, a.host, a.endpoint, b.endpoint)
	}
	return ""
}

// Audit reads every endpoint record and every published address of the
// store (p/a/ and the host-mode bindings of p/h/), in one read at one
// revision, and returns each broken invariant
// (the Inv* constants), sorted; nil when there is none. It changes
// nothing. h says what is known of the holders beyond the port records
// (InvHolder); keys under p/ other than endpoints, addresses and bindings
// (indexes) are not its business. A binding under p/h/ whose address's
// p/a/ record lacks the marker is an InvRecords finding; a marker with no
// binding left (stale) is harmless and not one (Tidy removes it).
func Audit(ctx context.Context, st store.Store, h Holders) ([]Finding, error) {
	kvs, err := st.Scan(ctx, "p/", store.PrefixEnd("p/"), 0)
	if err != nil {
		return nil, err
	}
	var out []Finding
	bad := func(inv, format string, args ...any) {
		out = append(out, Finding{Invariant: inv, Detail: fmt.Sprintf(format, args...)})
	}
	records := map[string]Endpoint{} // by endpoint (EndpointID.String())
	ids := map[string]EndpointID{}
	states := map[Address]AddrState{} // holders: p/a/'s, then p/h/'s
	marked := map[Address]bool{}      // p/a/ carries the marker
	bound := map[Address]bool{}       // p/h/ holds a binding
	for _, kv := range kvs {
		switch {
		case strings.HasPrefix(kv.Key, prefixEndpoint):
			id, ok := endpointOfKey(kv.Key)
			if !ok {
				bad(InvCorrupt, "key %s names no endpoint", kv.Key)
				continue
			}
			e, err := decodeEndpoint(id, kv)
			if err != nil {
				bad(InvCorrupt, "%v", err)
				continue
			}
			records[id.String()], ids[id.String()] = e, id
		case strings.HasPrefix(kv.Key, prefixAddr):
			addr, ok := addressOfKey(kv.Key)
			if !ok {
				bad(InvCorrupt, "key %s names no address", kv.Key)
				continue
			}
			s, err := decodeState(kv)
			if err != nil {
				bad(InvCorrupt, "%v", err)
				continue
			}
			var m bool
			s.Hosts, m = splitMarker(s)
			s.Hosts = append(s.Hosts, states[addr].Hosts...)
			states[addr], marked[addr] = s, m
		case strings.HasPrefix(kv.Key, prefixHostBind):
			addr, host, ok := parseHostBindKey(kv.Key)
			if !ok {
				bad(InvCorrupt, "key %s names no address and host", kv.Key)
				continue
			}
			us, err := decodeBindings(kv, host)
			if err != nil {
				bad(InvCorrupt, "%v", err)
				continue
			}
			s := states[addr]
			s.Hosts = append(s.Hosts, us...)
			states[addr] = s
			if len(us) > 0 {
				bound[addr] = true
			}
		}
	}
	for addr := range bound {
		if !marked[addr] {
			bad(InvRecords, "%s has host-mode bindings under p/h/ but its p/a/ record lacks the marker: an older ringipam would publish it in ingress mode (ringctl gc writes it)", addr)
		}
	}

	// Records and addresses agree, both ways.
	for me, e := range records {
		if !recordFits(e) {
			bad(InvRecords, "endpoint %s: stored ports %v do not fit its stored spec %v", me, e.Ports, e.Spec)
		}
		for _, p := range e.Ports {
			if !lists(states[p.addr()], me, p, e.Host) {
				bad(InvRecords, "endpoint %s claims %s %s, which its address does not list", me, p.Mode, p.addr())
			}
		}
	}
	for addr, s := range states {
		if s.empty() {
			continue
		}
		if s.Ingress != "" {
			if e, ok := records[s.Ingress]; !ok || !claims(e, Port{Mode: Ingress, Protocol: addr.Protocol, Number: addr.Number}) {
				bad(InvRecords, "%s is held in ingress mode by %s, whose record does not claim it (leaked)", addr, s.Ingress)
			} else if e.Host != s.IngressHost {
				bad(InvRecords, "%s is held in ingress mode by %s on host %s, whose record says host %s", addr, s.Ingress, s.IngressHost, e.Host)
			}
		}
		for _, u := range s.Hosts {
			p := Port{Mode: Host, Protocol: addr.Protocol, Number: addr.Number, HostIP: u.IP}
			if e, ok := records[u.Endpoint]; !ok || e.Host != u.Host || !claims(e, p) {
				bad(InvRecords, "%s on host %s is held in host mode by %s, whose record does not claim it there (leaked)", addr, u.Host, u.Endpoint)
			}
		}
	}

	// The publishing rules, over every holding either source names.
	held := map[Address][]holding{}
	add := func(a Address, x holding) {
		if !slices.ContainsFunc(held[a], x.same) {
			held[a] = append(held[a], x)
		}
	}
	for addr, s := range states {
		if s.Ingress != "" {
			add(addr, holding{mode: Ingress, endpoint: s.Ingress, host: s.IngressHost})
		}
		for i, u := range s.Hosts {
			x := holding{mode: Host, endpoint: u.Endpoint, host: u.Host, ip: u.IP}
			if slices.Contains(s.Hosts[:i], u) {
				bad(InvClash, "%s lists %s on host %s twice", addr, u.Endpoint, u.Host)
			}
			add(addr, x)
		}
	}
	for me, e := range records {
		for i, p := range e.Ports {
			for _, q := range e.Ports[:i] {
				if p.addr() == q.addr() && (p.Mode == Ingress || q.Mode == Ingress || overlaps(p.HostIP, q.HostIP)) {
					bad(InvClash, "endpoint %s claims %s twice (%s and %s mode)", me, p.addr(), q.Mode, p.Mode)
				}
			}
			x := holding{mode: p.Mode, endpoint: me, host: e.Host}
			if p.Mode == Host {
				x.ip = p.HostIP
			}
			add(p.addr(), x)
		}
	}
	for addr, hs := range held {
		slices.SortFunc(hs, holding.compare)
		for i, a := range hs {
			for _, b := range hs[i+1:] {
				if why := clash(addr, a, b); why != "" {
					bad(InvClash, "%s", why)
				}
			}
		}
	}

	// The holders exist.
	attached := map[string]bool{} // networks the IPAM serves
	for id := range h.Attachments {
		attached[id.Network] = true
	}
	for me, e := range records {
		id := ids[me]
		if len(h.Hosts) > 0 && !h.Hosts[e.Host] {
			bad(InvHolder, "endpoint %s is published on host %s, which the store does not know: no sweep or gc releases its ports when that host is gone", me, e.Host)
		}
		switch host, ok := h.Attachments[id]; {
		case ok && host != e.Host:
			bad(InvHolder, "endpoint %s is published on host %s, but its attachment's addresses are held on host %s", me, e.Host, host)
		case !ok && attached[id.Network]:
			bad(InvHolder, "endpoint %s holds ports, but network %s has no attachment %s/%s: its container is gone (leaked ports)", me, id.Network, id.ContainerID, id.IfName)
		}
	}
	slices.SortFunc(out, func(x, y Finding) int {
		return cmp.Or(strings.Compare(x.Invariant, y.Invariant), strings.Compare(x.Detail, y.Detail))
	})
	return slices.Compact(out), nil
}

// claims reports whether record e lists port p (mode, protocol, number and,
// in host mode, host IP).
func claims(e Endpoint, p Port) bool {
	return slices.ContainsFunc(e.Ports, func(q Port) bool {
		return q.Mode == p.Mode && q.addr() == p.addr() && (p.Mode == Ingress || q.HostIP == p.HostIP)
	})
}

// addressOfKey reads the address a p/a/ key names.
func addressOfKey(key string) (Address, bool) {
	proto, num, ok := strings.Cut(strings.TrimPrefix(key, prefixAddr), "/")
	if !ok || proto == "" {
		return Address{}, false
	}
	n, err := strconv.ParseUint(num, 10, 16)
	if err != nil || n == 0 {
		return Address{}, false
	}
	return Address{Protocol: proto, Number: uint16(n)}, true
}
