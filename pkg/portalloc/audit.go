package portalloc

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/ringipam/ringipam/pkg/store"
)

// Audit reads every endpoint record and every published address of the
// store, in one read at one revision, and returns each disagreement between
// them and each address whose holders break the publishing rules, sorted;
// nil when there is none. It changes nothing. It reports:
//   - a key under the endpoints or the addresses that cannot be read;
//   - a record whose ports do not fit its spec;
//   - a port a record claims that its address does not list for it;
//   - a holder an address lists whose record is missing or does not claim
//     the port there (a leaked port: no DEL or GC of its endpoint will
//     release it);
//   - an address held in ingress mode and in host mode at once, or by two
//     host bindings on one host whose IPs overlap (both on every address,
//     or one of them, or the same IP).
func Audit(ctx context.Context, st store.Store) ([]string, error) {
	kvs, err := st.Scan(ctx, "p/", store.PrefixEnd("p/"), 0)
	if err != nil {
		return nil, err
	}
	var out []string
	records := map[string]Endpoint{} // by endpoint (EndpointID.String())
	states := map[Address]AddrState{}
	for _, kv := range kvs {
		switch {
		case strings.HasPrefix(kv.Key, prefixEndpoint):
			id, ok := endpointOfKey(kv.Key)
			if !ok {
				out = append(out, fmt.Sprintf("key %s names no endpoint", kv.Key))
				continue
			}
			e, err := decodeEndpoint(id, kv)
			if err != nil {
				out = append(out, err.Error())
				continue
			}
			records[id.String()] = e
		case strings.HasPrefix(kv.Key, prefixAddr):
			addr, ok := addressOfKey(kv.Key)
			if !ok {
				out = append(out, fmt.Sprintf("key %s names no address", kv.Key))
				continue
			}
			s, err := decodeState(kv)
			if err != nil {
				out = append(out, err.Error())
				continue
			}
			states[addr] = s
		}
	}
	for me, e := range records {
		if !recordFits(e) {
			out = append(out, fmt.Sprintf("endpoint %s: stored ports %v do not fit its stored spec %v", me, e.Ports, e.Spec))
		}
		for _, p := range e.Ports {
			if !lists(states[p.addr()], me, p, e.Host) {
				out = append(out, fmt.Sprintf("endpoint %s claims %s %s, which its address does not list", me, p.Mode, p.addr()))
			}
		}
	}
	for addr, s := range states {
		if s.Ingress != "" {
			if e, ok := records[s.Ingress]; !ok || !claims(e, Port{Mode: Ingress, Protocol: addr.Protocol, Number: addr.Number}) {
				out = append(out, fmt.Sprintf("%s is held in ingress mode by %s, whose record does not claim it (leaked)", addr, s.Ingress))
			} else if e.Host != s.IngressHost {
				out = append(out, fmt.Sprintf("%s is held in ingress mode by %s on host %s, whose record says host %s", addr, s.Ingress, s.IngressHost, e.Host))
			}
			if len(s.Hosts) > 0 {
				out = append(out, fmt.Sprintf("%s is held in ingress mode by %s and in host mode by %s", addr, s.Ingress, s.Hosts[0].Endpoint))
			}
		}
		for i, u := range s.Hosts {
			p := Port{Mode: Host, Protocol: addr.Protocol, Number: addr.Number, HostIP: u.IP}
			if e, ok := records[u.Endpoint]; !ok || e.Host != u.Host || !claims(e, p) {
				out = append(out, fmt.Sprintf("%s on host %s is held in host mode by %s, whose record does not claim it there (leaked)", addr, u.Host, u.Endpoint))
			}
			for _, v := range s.Hosts[i+1:] {
				if u.Host == v.Host && overlaps(u.IP, v.IP) {
					out = append(out, fmt.Sprintf("%s on host %s is bound by %s and %s on overlapping addresses", addr, u.Host, u.Endpoint, v.Endpoint))
				}
			}
		}
	}
	slices.Sort(out)
	return out, nil
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
