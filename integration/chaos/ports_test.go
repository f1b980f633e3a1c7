//go:build integration

package chaos

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/ringipam/ringipam/integration/cnitest"
	"github.com/ringipam/ringipam/pkg/cni/portmap"
	"github.com/ringipam/ringipam/pkg/portalloc"
)

// Published ports. Every host worker runs portmap-ingress after a
// successful ipam-ring ADD, asking for one dynamic ingress port (unique
// across the cluster) for container port 80/tcp, and before ipam-ring's
// DEL. The dynamic range is small: 16 ports for at most 32 CNI attachments,
// a little fewer than the pool has addresses (24, a few of them held by
// Docker endpoints), so the hosts contend for the same ports all the time
// and now and then find the range full (code 102). (With 20 ports a short
// run never found it full: the pool ran out first.)
const (
	portLo, portHi uint16 = 30000, 30015
	containerPort  uint16 = 80
)

// raceHostPort is the static ingress port the racing first attachments of
// the broken run ask for (outside the dynamic range).
const raceHostPort = portHi + 1

// portRangeSize is how many ports the dynamic range holds.
const portRangeSize = int(portHi-portLo) + 1

// portConf is portmap-ingress's network configuration on every host (the
// agent adds prevResult for ADD and the valid attachments for GC). No
// "host": the plugin takes the host name, as ipam-ring does.
func portConf(network, prefix string, endpoints []string, agent *cnitest.Agent) []byte {
	b, _ := json.Marshal(map[string]any{
		"cniVersion":   "1.1.0",
		"name":         network,
		"type":         "portmap-ingress",
		"capabilities": map[string]bool{"portMappings": true},
		"runtimeConfig": map[string]any{"portMappings": []map[string]any{
			{"hostPort": 0, "containerPort": containerPort, "protocol": "tcp", "mode": string(portalloc.Ingress)},
		}},
		"dynamicRange": fmt.Sprintf("%d-%d", portLo, portHi),
		"timeout":      "6s",
		"store":        storeConf(prefix, endpoints, agent),
	})
	return b
}

// portReading is what the suite read of the published ports at one moment:
// the ports each endpoint record lists and its host (by owner,
// "cni/<container ID>"), and the holders each address key names.
type portReading struct {
	owners map[string][]portalloc.Address
	hosts  map[string]string
	keys   map[portalloc.Address][]string
}

// holderOwner names an endpoint (port/<network>/<container>/<if>) as the
// history does.
func holderOwner(holder string) string {
	if id, ok := portalloc.ParseEndpointID(holder); ok {
		return "cni/" + id.ContainerID
	}
	return holder
}

// readPorts reads every endpoint record of network and every address key.
func readPorts(t *testing.T, ctx context.Context, a *portalloc.Allocator, network string) portReading {
	t.Helper()
	r := portReading{owners: map[string][]portalloc.Address{}, hosts: map[string]string{}, keys: map[portalloc.Address][]string{}}
	eps, err := a.Endpoints(ctx, network)
	if err != nil {
		t.Fatalf("listing published ports: %v", err)
	}
	for id, e := range eps {
		o := holderOwner(id.String())
		ports := []portalloc.Address{}
		for _, p := range e.Ports {
			ports = append(ports, portalloc.Address{Protocol: p.Protocol, Number: p.Number})
		}
		r.owners[o], r.hosts[o] = ports, e.Host
	}
	pubs, err := a.List(ctx)
	if err != nil {
		t.Fatalf("listing port addresses: %v", err)
	}
	for _, p := range pubs {
		if p.State.Ingress != "" {
			r.keys[p.Address] = append(r.keys[p.Address], holderOwner(p.State.Ingress))
		}
		for _, u := range p.State.Hosts {
			r.keys[p.Address] = append(r.keys[p.Address], holderOwner(u.Endpoint))
		}
	}
	return r
}

// forwardsByOwner names the forwards a host's table holds (by attachment
// mark) by owner, for the attachments the history knows; a mark of none of
// them keeps its own name (and is no live attachment's).
func forwardsByOwner(network string, calls []call, marks map[string][]portmap.Rule) map[string][]portmap.Rule {
	ownerOf := map[string]string{}
	for _, c := range calls {
		cid := strings.TrimPrefix(c.Owner, "cni/")
		ownerOf[portmap.Mark(portalloc.EndpointID{Network: network, ContainerID: cid, IfName: "eth0"})] = c.Owner
	}
	out := map[string][]portmap.Rule{}
	for m, rules := range marks {
		o, ok := ownerOf[m]
		if !ok {
			o = "mark " + m
		}
		out[o] = append(out[o], rules...)
	}
	return out
}

// livePort is what a live attachment was given: its port, its host, and
// the address its forward must lead to.
type livePort struct {
	port portalloc.Address
	host string
	addr netip.Addr
}

// portRun is what a run gathered about published ports.
type portRun struct {
	calls        []call // portmap-ingress calls
	final, after portReading
	// forwards are the forwards each host's table holds after GC, by host
	// and owner; nil when they were not read.
	forwards map[string]map[string][]portmap.Rule
	live     map[string]livePort
	size     int // ports in the dynamic range
}

// portVerdict is what judgePorts found; notes say why, one line a finding.
type portVerdict struct {
	published                                       int
	duplicates, leaks, lost, unclear, falseExhausts int
	counts                                          map[string]int
	notes                                           []string
}

// judgePorts checks a run's published ports:
//
//   - duplicates: a port two owners held, in the history (an ADD returned a
//     port while another owner certainly held it: from its ADD's return
//     until its DEL, or its next failed ADD, was invoked) or in either reading of
//     the store (two endpoint records list it, its key names two holders,
//     or a record lists it while its key names another);
//   - leaks: an owner that is no live attachment yet after GC still has an
//     endpoint record, is named by an address key, or has a forward in its
//     host's table;
//   - lost: a live attachment that does not hold exactly the port its ADD
//     returned (record, address key, host), whose ADDs since its last
//     failed one returned different ports, or whose forward to its address
//     is missing;
//   - unclear: a failed call that is no clear CNI error (11, 102) and was
//     not killed;
//   - false exhaustion: code 102 answered while fewer owners than the
//     range has ports could have held one.
func judgePorts(pr portRun) portVerdict {
	v := portVerdict{counts: map[string]int{}}
	note := func(format string, args ...any) { v.notes = append(v.notes, fmt.Sprintf(format, args...)) }
	calls := slices.Clone(pr.calls)
	sort.SliceStable(calls, func(i, j int) bool { return calls[i].Call < calls[j].Call })

	// What each owner's successful ADDs returned since its last failed
	// one (which released what the earlier ones returned: clashesSeen).
	given := map[string][]portalloc.Address{}
	seen := map[string]bool{}
	for _, c := range calls {
		v.counts[c.Verb]++
		if c.Killed {
			v.counts["killed"]++
		}
		if c.Outcome != outOK {
			v.counts["failed"]++
			v.counts[fmt.Sprintf("code %d", c.Code)]++
		}
		if c.Unclear != "" {
			v.unclear++
			note("unclear port failure: %+v", c)
		}
		if c.Verb == verbAdd && c.Outcome != outOK {
			delete(given, c.Owner)
		}
		if c.Verb == verbAdd && c.Outcome == outOK {
			if !seen[c.Owner] {
				v.published++
				seen[c.Owner] = true
			}
			if !slices.Contains(given[c.Owner], c.Port) {
				given[c.Owner] = append(given[c.Owner], c.Port)
			}
		}
	}

	dups := append(clashesSeen(calls, func(c call) string { return c.Port.String() }, true), storePortDuplicates(pr.final, pr.after)...)
	for _, d := range dups {
		note("port duplicate: %s", d)
	}
	v.duplicates = distinctDuplicates(dups)

	leaked := map[string]bool{}
	leak := func(o, why string) {
		if _, ok := pr.live[o]; ok {
			return
		}
		leaked[o] = true
		note("port leak: %s is no live attachment but %s after GC", o, why)
	}
	for _, o := range slices.Sorted(maps.Keys(pr.after.owners)) {
		leak(o, fmt.Sprintf("its endpoint record (host %s) lists %v", pr.after.hosts[o], pr.after.owners[o]))
	}
	for _, a := range slices.SortedFunc(maps.Keys(pr.after.keys), comparePorts) {
		for _, o := range pr.after.keys[a] {
			leak(o, "the key of "+a.String()+" names it")
		}
	}
	for _, h := range slices.Sorted(maps.Keys(pr.forwards)) {
		for _, o := range slices.Sorted(maps.Keys(pr.forwards[h])) {
			leak(o, fmt.Sprintf("host %s forwards %v for it", h, pr.forwards[h][o]))
		}
	}
	v.leaks = len(leaked)

	for _, o := range slices.Sorted(maps.Keys(pr.live)) {
		lp := pr.live[o]
		var why []string
		if got := pr.after.owners[o]; len(got) != 1 || got[0] != lp.port {
			why = append(why, fmt.Sprintf("its endpoint record lists %v", got))
		} else if pr.after.hosts[o] != lp.host {
			why = append(why, fmt.Sprintf("its endpoint record names host %q", pr.after.hosts[o]))
		}
		if !slices.Contains(pr.after.keys[lp.port], o) {
			why = append(why, fmt.Sprintf("the key of %s names %v", lp.port, pr.after.keys[lp.port]))
		}
		if g := given[o]; len(g) != 1 || g[0] != lp.port {
			why = append(why, fmt.Sprintf("its ADDs returned %v", g))
		}
		want := portmap.Rule{Protocol: lp.port.Protocol, HostPort: lp.port.Number, ContainerIP: lp.addr, ContainerPort: containerPort}
		if pr.forwards != nil && !slices.Contains(pr.forwards[lp.host][o], want) {
			why = append(why, fmt.Sprintf("host %s forwards %v for it, not %s", lp.host, pr.forwards[lp.host][o], want))
		}
		if len(why) > 0 {
			v.lost++
			note("port lost: live %s was given %s on %s but %v", o, lp.port, lp.host, why)
		}
	}

	for _, s := range capacityLies(pr.size, calls) {
		v.falseExhausts++
		note("port range: %s", s)
	}
	return v
}

func comparePorts(a, b portalloc.Address) int {
	return cmp.Or(cmp.Compare(a.Protocol, b.Protocol), cmp.Compare(a.Number, b.Number))
}

// clean says that the ports came through without a finding.
func (v portVerdict) clean() bool {
	return v.duplicates == 0 && v.leaks == 0 && v.lost == 0 && v.unclear == 0 && v.falseExhausts == 0
}

// storePortDuplicates finds the ports two owners hold in any of the
// readings: listed by two endpoint records, named by one address key
// twice over (every port of the run is an ingress port: one holder), or
// listed by one owner's record while its key names another.
func storePortDuplicates(readings ...portReading) []duplicate {
	var out []duplicate
	for i, r := range readings {
		by := map[portalloc.Address][]string{}
		for o, ports := range r.owners {
			for _, p := range ports {
				by[p] = append(by[p], o)
			}
		}
		for _, a := range slices.SortedFunc(maps.Keys(by), comparePorts) {
			owners := by[a]
			slices.Sort(owners)
			for j := 1; j < len(owners); j++ {
				out = append(out, newDuplicate(a.String(), owners[0], owners[j], fmt.Sprintf("port reading %d: two endpoint records", i)))
			}
			for _, o := range owners {
				for _, k := range r.keys[a] {
					if k != o {
						out = append(out, newDuplicate(a.String(), o, k, fmt.Sprintf("port reading %d: %s's record lists it, its key names %s", i, o, k)))
					}
				}
			}
		}
		for _, a := range slices.SortedFunc(maps.Keys(r.keys), comparePorts) {
			hs := r.keys[a]
			for j := 1; j < len(hs); j++ {
				out = append(out, newDuplicate(a.String(), hs[0], hs[j], fmt.Sprintf("port reading %d: its key names both", i)))
			}
		}
	}
	return out
}
