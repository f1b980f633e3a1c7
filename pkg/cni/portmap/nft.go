package portmap

import (
	"context"
	"fmt"
	"net/netip"

	"sigs.k8s.io/knftables"
)

// The plugin's table (inet family, one for IPv4 and IPv6):
//
//	chain prerouting  nat/prerouting/dstnat: jump ports
//	chain output      nat/output/dstnat:     fib daddr type local jump ports
//	chain ports:      dnat to the container from the maps below
//	chain postrouting nat/postrouting/srcnat: masquerade hairpin and localhost
//	map any4/any6     proto . port : container ip . port (bound to every host address)
//	map addr4/addr6       host ip . proto . port : container ip . port (bound to one address)
//	set hairpin4/6    container ip . container ip (a container reaching itself)
//
// Every element carries the attachment's mark as its comment, so DEL and GC
// remove exactly what ADD added, and ADD costs the same whatever the number
// of mappings (elements are added one by one; nothing is listed).

type nftDataplane struct {
	nft knftables.Interface
}

// NewNFT returns the nftables data path on table.
func NewNFT(table string) (Dataplane, error) {
	nft, err := knftables.New(knftables.InetFamily, table)
	if err != nil {
		return nil, fmt.Errorf("nftables: %w", err)
	}
	return &nftDataplane{nft: nft}, nil
}

func ptr[T any](v T) *T { return &v }

// ensure declares the table's skeleton (idempotent: "add" of an existing
// object is a no-op in nft).
func (d *nftDataplane) ensure(tx *knftables.Transaction) {
	tx.Add(&knftables.Table{Comment: ptr("ringipam portmap-ingress: published ports")})
	tx.Add(&knftables.Chain{Name: "prerouting", Type: ptr(knftables.NATType), Hook: ptr(knftables.PreroutingHook), Priority: ptr(knftables.DNATPriority)})
	tx.Add(&knftables.Chain{Name: "output", Type: ptr(knftables.NATType), Hook: ptr(knftables.OutputHook), Priority: ptr(knftables.DNATPriority)})
	tx.Add(&knftables.Chain{Name: "postrouting", Type: ptr(knftables.NATType), Hook: ptr(knftables.PostroutingHook), Priority: ptr(knftables.SNATPriority)})
	tx.Add(&knftables.Chain{Name: "ports"})
	tx.Add(&knftables.Map{Name: "any4", Type: "inet_proto . inet_service : ipv4_addr . inet_service"})
	tx.Add(&knftables.Map{Name: "any6", Type: "inet_proto . inet_service : ipv6_addr . inet_service"})
	tx.Add(&knftables.Map{Name: "addr4", Type: "ipv4_addr . inet_proto . inet_service : ipv4_addr . inet_service"})
	tx.Add(&knftables.Map{Name: "addr6", Type: "ipv6_addr . inet_proto . inet_service : ipv6_addr . inet_service"})
	tx.Add(&knftables.Set{Name: "hairpin4", Type: "ipv4_addr . ipv4_addr"})
	tx.Add(&knftables.Set{Name: "hairpin6", Type: "ipv6_addr . ipv6_addr"})
	// The chains are flushed and refilled: the same rules every time.
	for _, c := range []string{"prerouting", "output", "postrouting", "ports"} {
		tx.Flush(&knftables.Chain{Name: c})
	}
	tx.Add(&knftables.Rule{Chain: "prerouting", Rule: "jump ports"})
	tx.Add(&knftables.Rule{Chain: "output", Rule: "fib daddr type local jump ports"})
	tx.Add(&knftables.Rule{Chain: "ports", Rule: "meta nfproto ipv4 dnat ip to ip daddr . meta l4proto . th dport map @addr4"})
	tx.Add(&knftables.Rule{Chain: "ports", Rule: "meta nfproto ipv6 dnat ip6 to ip6 daddr . meta l4proto . th dport map @addr6"})
	tx.Add(&knftables.Rule{Chain: "ports", Rule: "meta nfproto ipv4 fib daddr type local dnat ip to meta l4proto . th dport map @any4"})
	tx.Add(&knftables.Rule{Chain: "ports", Rule: "meta nfproto ipv6 fib daddr type local dnat ip6 to meta l4proto . th dport map @any6"})
	tx.Add(&knftables.Rule{Chain: "postrouting", Rule: "ct status dnat ip saddr . ip daddr @hairpin4 masquerade"})
	tx.Add(&knftables.Rule{Chain: "postrouting", Rule: "ct status dnat ip6 saddr . ip6 daddr @hairpin6 masquerade"})
	tx.Add(&knftables.Rule{Chain: "postrouting", Rule: "ct status dnat ip saddr 127.0.0.0/8 masquerade"})
	tx.Add(&knftables.Rule{Chain: "postrouting", Rule: "ct status dnat ip6 saddr ::1 masquerade"})
}

func elements(owner string, rules []Rule) []*knftables.Element {
	var out []*knftables.Element
	hair := map[netip.Addr]bool{}
	for _, r := range rules {
		v6 := r.ContainerIP.Is6()
		val := []string{r.ContainerIP.String(), fmt.Sprint(r.ContainerPort)}
		key := []string{r.Protocol, fmt.Sprint(r.HostPort)}
		m := "any4"
		if v6 {
			m = "any6"
		}
		if r.HostIP.IsValid() {
			if r.HostIP.Is6() != v6 {
				continue // a host IP of the other family publishes nothing for this address
			}
			key = append([]string{r.HostIP.String()}, key...)
			m = "addr4"
			if v6 {
				m = "addr6"
			}
		}
		out = append(out, &knftables.Element{Map: m, Key: key, Value: val, Comment: ptr(owner)})
		if !hair[r.ContainerIP] {
			hair[r.ContainerIP] = true
			s := "hairpin4"
			if v6 {
				s = "hairpin6"
			}
			out = append(out, &knftables.Element{Set: s, Key: []string{r.ContainerIP.String(), r.ContainerIP.String()}, Comment: ptr(owner)})
		}
	}
	return out
}

func (d *nftDataplane) Add(ctx context.Context, mark string, rules []Rule) error {
	tx := d.nft.NewTransaction()
	d.ensure(tx)
	for _, e := range elements(mark, rules) {
		tx.Add(e)
	}
	if err := d.nft.Run(ctx, tx); err != nil {
		return fmt.Errorf("nftables: %w", err)
	}
	return nil
}

var allObjects = []struct{ kind, name string }{{"map", "any4"}, {"map", "any6"}, {"map", "addr4"}, {"map", "addr6"}, {"set", "hairpin4"}, {"set", "hairpin6"}}

func (d *nftDataplane) list(ctx context.Context) ([]*knftables.Element, error) {
	var out []*knftables.Element
	for _, o := range allObjects {
		els, err := d.nft.ListElements(ctx, o.kind, o.name)
		if knftables.IsNotFound(err) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("nftables: %w", err)
		}
		for _, e := range els {
			if o.kind == "map" {
				e.Map = o.name
			} else {
				e.Set = o.name
			}
		}
		out = append(out, els...)
	}
	return out, nil
}

// Remove deletes mark's elements. Deleting is idempotent: the host
// agent's reconcile of the table may delete the same elements between this
// read and this delete (an endpoint the store no longer holds), and nft
// then refuses the whole transaction ("No such file or directory"); the
// elements are read again and what is left is deleted, once more at most.
func (d *nftDataplane) Remove(ctx context.Context, mark string) error {
	err := d.removeOnce(ctx, mark)
	if knftables.IsNotFound(err) {
		err = d.removeOnce(ctx, mark)
	}
	return err
}

// removeOnce reads the table and deletes mark's elements in one
// transaction.
func (d *nftDataplane) removeOnce(ctx context.Context, mark string) error {
	els, err := d.list(ctx)
	if err != nil {
		return err
	}
	tx := d.nft.NewTransaction()
	n := 0
	for _, e := range els {
		if e.Comment != nil && *e.Comment == mark {
			tx.Delete(&knftables.Element{Map: e.Map, Set: e.Set, Key: e.Key})
			n++
		}
	}
	if n == 0 {
		return nil
	}
	if err := d.nft.Run(ctx, tx); err != nil {
		return fmt.Errorf("nftables: %w", err)
	}
	return nil
}

func (d *nftDataplane) Marks(ctx context.Context) (map[string][]Rule, error) {
	els, err := d.list(ctx)
	if err != nil {
		return nil, err
	}
	out := map[string][]Rule{}
	for _, e := range els {
		if e.Comment == nil {
			continue
		}
		r, ok := ruleOf(e)
		if ok {
			out[*e.Comment] = append(out[*e.Comment], r)
		} else if _, seen := out[*e.Comment]; !seen {
			out[*e.Comment] = nil
		}
	}
	return out, nil
}

// ruleOf reads a map element back (sets yield no rule).
func ruleOf(e *knftables.Element) (Rule, bool) {
	if e.Map == "" || len(e.Value) != 2 {
		return Rule{}, false
	}
	key := e.Key
	var r Rule
	if len(key) == 3 {
		r.HostIP, _ = netip.ParseAddr(key[0])
		key = key[1:]
	}
	if len(key) != 2 {
		return Rule{}, false
	}
	r.Protocol = key[0]
	var hp, cp int
	fmt.Sscan(key[1], &hp)
	fmt.Sscan(e.Value[1], &cp)
	r.HostPort, r.ContainerPort = uint16(hp), uint16(cp)
	r.ContainerIP, _ = netip.ParseAddr(e.Value[0])
	return r, true
}
