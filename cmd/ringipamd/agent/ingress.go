package agent

import (
	"cmp"
	"fmt"
	"net/netip"
	"slices"

	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/portalloc"
)

// Forward is one ingress port held on another host, as this host forwards
// it: packets to any local address on (Protocol, Port) go to To, same port.
type Forward struct {
	Protocol string
	Port     uint16
	To       netip.Addr
	Host     string // the holder's host
	Endpoint string // the holder (port/<network>/<container>/<interface>)
}

func (f Forward) String() string {
	return fmt.Sprintf("%s/%d -> %s (%s on %s)", f.Protocol, f.Port, f.To, f.Endpoint, f.Host)
}

// DesiredForwards is the pure core of ingress forwarding: from every
// published port and every host the store knows, the forwards host me
// installs. A port is forwarded when it is held in ingress mode by an
// endpoint on another host that is not orphaned and has recorded an
// address: one forward per family of the holder's addresses (a dual-stack
// host's --addr has one per family), so a packet goes to the holder's
// address of its own family. The second result says, for operators, which
// ingress ports cannot be forwarded and why.
func DesiredForwards(me string, ports []portalloc.Published, hosts []pool.HostInfo) ([]Forward, []string) {
	byName := make(map[string]pool.HostInfo, len(hosts))
	for _, h := range hosts {
		byName[h.Name] = h
	}
	var out []Forward
	var problems []string
	for _, p := range ports {
		st := p.State
		if st.Ingress == "" || st.IngressHost == me {
			continue
		}
		h, known := byName[st.IngressHost]
		switch {
		case !known:
			problems = append(problems, fmt.Sprintf("%s held by %s on unknown host %s", p.Address, st.Ingress, st.IngressHost))
			continue
		case h.State == pool.HostOrphaned:
			continue // its ports are being released
		case len(h.AddrList()) == 0:
			problems = append(problems, fmt.Sprintf("%s held by %s on %s: that host has no recorded address (its agent runs without --addr)", p.Address, st.Ingress, h.Name))
			continue
		}
		var v4, v6 bool
		for _, s := range h.AddrList() {
			to, err := netip.ParseAddr(s)
			if err != nil {
				problems = append(problems, fmt.Sprintf("%s on %s: recorded address %q is not an IP", p.Address, h.Name, s))
				continue
			}
			to = to.Unmap()
			if (to.Is4() && v4) || (to.Is6() && v6) {
				continue // one per family; the agent records no more
			}
			v4, v6 = v4 || to.Is4(), v6 || to.Is6()
			out = append(out, Forward{Protocol: p.Address.Protocol, Port: p.Address.Number, To: to, Host: h.Name, Endpoint: st.Ingress})
		}
	}
	slices.SortFunc(out, func(a, b Forward) int {
		return cmp.Or(cmp.Compare(a.Protocol, b.Protocol), cmp.Compare(a.Port, b.Port), a.To.Compare(b.To))
	})
	return out, problems
}
