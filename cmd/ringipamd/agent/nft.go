package agent

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strings"

	"sigs.k8s.io/knftables"
)

// The agent's ingress table (inet family), apart from portmap-ingress's own:
//
//	chain prerouting  nat/prerouting, after portmap-ingress: to a local address -> dnat by fwd4/fwd6
//	chain output      nat/output, the same for connections made on this host
//	chain postrouting nat/postrouting: masquerade what was forwarded, so replies come back here
//	map fwd4/fwd6     proto . port : holder host's address (same port)
//	set dst4/dst6     holder address . proto . port, the forwarded destinations
//
// A sync replaces the maps' and sets' contents in one transaction, so a
// forward is never half installed. Loopback destinations are not forwarded
// (a local client uses the host's own address).
type nftForwarder struct {
	nft knftables.Interface
}

func newNFTForwarder(table string) (*nftForwarder, error) {
	nft, err := knftables.New(knftables.InetFamily, table)
	if err != nil {
		return nil, fmt.Errorf("nftables: %w", err)
	}
	return &nftForwarder{nft: nft}, nil
}

func ptr[T any](v T) *T { return &v }

// forwardPriority puts the agent's DNAT after portmap-ingress's (dstnat), so
// a port held on this host is always served here.
const forwardPriority = knftables.DNATPriority + "+10"

// Sync makes the table forward exactly fs.
func (n *nftForwarder) Sync(ctx context.Context, fs []Forward) error {
	tx := n.nft.NewTransaction()
	tx.Add(&knftables.Table{Comment: ptr("ringipamd: ingress ports held on other hosts")})
	tx.Add(&knftables.Chain{Name: "prerouting", Type: ptr(knftables.NATType), Hook: ptr(knftables.PreroutingHook), Priority: ptr(forwardPriority)})
	tx.Add(&knftables.Chain{Name: "output", Type: ptr(knftables.NATType), Hook: ptr(knftables.OutputHook), Priority: ptr(forwardPriority)})
	tx.Add(&knftables.Chain{Name: "postrouting", Type: ptr(knftables.NATType), Hook: ptr(knftables.PostroutingHook), Priority: ptr(knftables.SNATPriority)})
	tx.Add(&knftables.Map{Name: "fwd4", Type: "inet_proto . inet_service : ipv4_addr"})
	tx.Add(&knftables.Map{Name: "fwd6", Type: "inet_proto . inet_service : ipv6_addr"})
	tx.Add(&knftables.Set{Name: "dst4", Type: "ipv4_addr . inet_proto . inet_service"})
	tx.Add(&knftables.Set{Name: "dst6", Type: "ipv6_addr . inet_proto . inet_service"})
	for _, c := range []string{"prerouting", "output", "postrouting"} {
		tx.Flush(&knftables.Chain{Name: c})
	}
	for _, c := range []string{"prerouting", "output"} {
		tx.Add(&knftables.Rule{Chain: c, Rule: "meta nfproto ipv4 ip daddr != 127.0.0.0/8 fib daddr type local dnat ip to meta l4proto . th dport map @fwd4"})
		tx.Add(&knftables.Rule{Chain: c, Rule: "meta nfproto ipv6 ip6 daddr != ::1 fib daddr type local dnat ip6 to meta l4proto . th dport map @fwd6"})
	}
	tx.Add(&knftables.Rule{Chain: "postrouting", Rule: "ct status dnat ip daddr . meta l4proto . th dport @dst4 masquerade"})
	tx.Add(&knftables.Rule{Chain: "postrouting", Rule: "ct status dnat ip6 daddr . meta l4proto . th dport @dst6 masquerade"})
	for _, o := range []string{"fwd4", "fwd6"} {
		tx.Flush(&knftables.Map{Name: o})
	}
	for _, o := range []string{"dst4", "dst6"} {
		tx.Flush(&knftables.Set{Name: o})
	}
	for _, f := range fs {
		m, s := "fwd4", "dst4"
		if f.To.Is6() {
			m, s = "fwd6", "dst6"
		}
		port := fmt.Sprint(f.Port)
		comment := ptr(f.Endpoint)
		tx.Add(&knftables.Element{Map: m, Key: []string{f.Protocol, port}, Value: []string{f.To.String()}, Comment: comment})
		tx.Add(&knftables.Element{Set: s, Key: []string{f.To.String(), f.Protocol, port}, Comment: comment})
	}
	if err := n.nft.Run(ctx, tx); err != nil {
		return fmt.Errorf("nftables: %w", err)
	}
	return enableForwarding(fs)
}

// enableForwarding turns on IP forwarding for the families fs forward to:
// forwarded packets leave through the host's routing, as Docker's ingress
// and Kubernetes' NodePorts need it too.
func enableForwarding(fs []Forward) error {
	var v4, v6 bool
	for _, f := range fs {
		v4, v6 = v4 || f.To.Is4(), v6 || f.To.Is6()
	}
	for _, c := range []struct {
		on   bool
		path string
	}{{v4, "/proc/sys/net/ipv4/ip_forward"}, {v6, "/proc/sys/net/ipv6/conf/all/forwarding"}} {
		if !c.on {
			continue
		}
		if b, err := os.ReadFile(c.path); err == nil && strings.TrimSpace(string(b)) == "1" {
			continue
		}
		if err := os.WriteFile(c.path, []byte("1\n"), 0o644); err != nil {
			return fmt.Errorf("enabling forwarding (%s): %w", c.path, err)
		}
	}
	return nil
}

// Installed lists the forwards in the table, as "proto/port -> addr".
func (n *nftForwarder) Installed(ctx context.Context) ([]string, error) {
	var out []string
	for _, m := range []string{"fwd4", "fwd6"} {
		els, err := n.nft.ListElements(ctx, "map", m)
		if knftables.IsNotFound(err) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("nftables: %w", err)
		}
		for _, e := range els {
			if len(e.Key) == 2 && len(e.Value) == 1 {
				out = append(out, fmt.Sprintf("%s/%s -> %s", e.Key[0], e.Key[1], e.Value[0]))
			}
		}
	}
	slices.Sort(out)
	return out, nil
}

// Remove deletes the table (the agent stopping with --ingress-cleanup).
func (n *nftForwarder) Remove(ctx context.Context) error {
	tx := n.nft.NewTransaction()
	tx.Delete(&knftables.Table{})
	err := n.nft.Run(ctx, tx)
	if err != nil && !knftables.IsNotFound(err) {
		return fmt.Errorf("nftables: %w", err)
	}
	return nil
}
