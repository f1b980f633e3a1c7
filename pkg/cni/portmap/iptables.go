package portmap

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os/exec"
	"strconv"
	"strings"
)

// The iptables data path, for hosts without nftables' nft command. Chains
// of the plugin's own in the nat table of iptables and ip6tables:
//
//	PREROUTING  -m addrtype --dst-type LOCAL -j RINGIPAM-PM-DNAT
//	OUTPUT      -m addrtype --dst-type LOCAL -j RINGIPAM-PM-DNAT
//	POSTROUTING -j RINGIPAM-PM-SNAT
//	RINGIPAM-PM-DNAT  one DNAT rule per forward, commented with its mark
//	RINGIPAM-PM-SNAT  masquerade from localhost; one hairpin rule per container address, commented
//
// Every rule of an attachment carries its mark as a comment, so Remove
// deletes exactly those. Unlike the nftables path, each iptables command
// reads the whole nat table: ADD grows with the number of rules on the host.
const (
	iptDNAT = "RINGIPAM-PM-DNAT"
	iptSNAT = "RINGIPAM-PM-SNAT"
)

type iptDataplane struct {
	bins map[bool]string // is6 -> command, where present
}

// NewIPTables returns the iptables data path. It needs iptables; ip6tables
// only for IPv6 forwards.
func NewIPTables() (Dataplane, error) {
	d := &iptDataplane{bins: map[bool]string{}}
	for is6, name := range map[bool]string{false: "iptables", true: "ip6tables"} {
		if p, err := exec.LookPath(name); err == nil {
			d.bins[is6] = p
		}
	}
	if d.bins[false] == "" {
		return nil, fmt.Errorf("%w: iptables is not installed", ErrNoDataplane)
	}
	return d, nil
}

func (d *iptDataplane) run(ctx context.Context, is6 bool, args ...string) (string, error) {
	bin := d.bins[is6]
	if bin == "" {
		return "", fmt.Errorf("%w: ip6tables is not installed", ErrNoDataplane)
	}
	// -w: wait for the xtables lock (bounded by ctx) instead of failing.
	out, err := exec.CommandContext(ctx, bin, append([]string{"-w", "-t", "nat"}, args...)...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("%s %s: %w: %s", bin, strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return string(out), nil
}

// ensure makes the chains and jumps of one family (idempotent).
func (d *iptDataplane) ensure(ctx context.Context, is6 bool) error {
	for _, c := range []string{iptDNAT, iptSNAT} {
		if _, err := d.run(ctx, is6, "-S", c); err != nil {
			if _, err := d.run(ctx, is6, "-N", c); err != nil {
				// made meanwhile by a concurrent ADD?
				if _, err2 := d.run(ctx, is6, "-S", c); err2 != nil {
					return err
				}
			}
		}
	}
	lo := "127.0.0.0/8"
	if is6 {
		lo = "::1"
	}
	for _, r := range [][]string{
		{"PREROUTING", "-m", "addrtype", "--dst-type", "LOCAL", "-j", iptDNAT},
		{"OUTPUT", "-m", "addrtype", "--dst-type", "LOCAL", "-j", iptDNAT},
		{"POSTROUTING", "-j", iptSNAT},
		{iptSNAT, "-s", lo, "-m", "conntrack", "--ctstate", "DNAT", "-j", "MASQUERADE"},
	} {
		if _, err := d.run(ctx, is6, append([]string{"-C"}, r...)...); err == nil {
			continue
		}
		if _, err := d.run(ctx, is6, append([]string{"-A"}, r...)...); err != nil {
			return err
		}
	}
	return nil
}

// ruleArgs are the iptables rules (chain first) of one attachment.
func iptRules(mark string, rules []Rule) map[bool][][]string {
	out := map[bool][][]string{}
	hair := map[netip.Addr]bool{}
	for _, r := range rules {
		is6 := r.ContainerIP.Is6()
		if r.HostIP.IsValid() && r.HostIP.Is6() != is6 {
			continue
		}
		to := netip.AddrPortFrom(r.ContainerIP, r.ContainerPort).String()
		args := []string{iptDNAT, "-p", r.Protocol}
		if r.HostIP.IsValid() {
			args = append(args, "-d", r.HostIP.String())
		}
		args = append(args, "-m", r.Protocol, "--dport", strconv.Itoa(int(r.HostPort)), "-m", "comment", "--comment", mark, "-j", "DNAT", "--to-destination", to)
		out[is6] = append(out[is6], args)
		if !hair[r.ContainerIP] {
			hair[r.ContainerIP] = true
			ip := r.ContainerIP.String()
			out[is6] = append(out[is6], []string{iptSNAT, "-s", ip, "-d", ip, "-m", "conntrack", "--ctstate", "DNAT", "-m", "comment", "--comment", mark, "-j", "MASQUERADE"})
		}
	}
	return out
}

func (d *iptDataplane) Add(ctx context.Context, mark string, rules []Rule) error {
	for is6, rs := range iptRules(mark, rules) {
		if err := d.ensure(ctx, is6); err != nil {
			return err
		}
		for _, r := range rs {
			if _, err := d.run(ctx, is6, append([]string{"-A"}, r...)...); err != nil {
				return err
			}
		}
	}
	return nil
}

// listed is one rule of the plugin's chains as iptables -S prints it.
type listed struct {
	is6  bool
	args []string // without the leading -A
	mark string
}

func (d *iptDataplane) list(ctx context.Context) ([]listed, error) {
	var out []listed
	for is6 := range d.bins {
		for _, c := range []string{iptDNAT, iptSNAT} {
			text, err := d.run(ctx, is6, "-S", c)
			if err != nil {
				continue // no chain: nothing installed
			}
			for _, line := range strings.Split(text, "\n") {
				f := splitRule(line)
				if len(f) < 2 || f[0] != "-A" {
					continue
				}
				l := listed{is6: is6, args: f[1:]}
				for i := 0; i+1 < len(f); i++ {
					if f[i] == "--comment" {
						l.mark = f[i+1]
					}
				}
				out = append(out, l)
			}
		}
	}
	return out, nil
}

// splitRule splits a line of iptables -S on spaces, honouring its double
// quotes (comments are printed quoted).
func splitRule(line string) []string {
	var out []string
	var cur strings.Builder
	quoted, any := false, false
	for _, r := range line {
		switch {
		case r == '"':
			quoted, any = !quoted, true
		case r == ' ' && !quoted:
			if any {
				out = append(out, cur.String())
			}
			cur.Reset()
			any = false
		default:
			cur.WriteRune(r)
			any = true
		}
	}
	if any {
		out = append(out, cur.String())
	}
	return out
}

func (d *iptDataplane) Remove(ctx context.Context, mark string) error {
	rules, err := d.list(ctx)
	if err != nil {
		return err
	}
	var errs []error
	for _, l := range rules {
		if l.mark != mark {
			continue
		}
		if _, err := d.run(ctx, l.is6, append([]string{"-D"}, l.args...)...); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

func (d *iptDataplane) Marks(ctx context.Context) (map[string][]Rule, error) {
	rules, err := d.list(ctx)
	if err != nil {
		return nil, err
	}
	out := map[string][]Rule{}
	for _, l := range rules {
		if l.mark == "" {
			continue
		}
		if _, seen := out[l.mark]; !seen {
			out[l.mark] = nil
		}
		if l.args[0] != iptDNAT {
			continue
		}
		var r Rule
		for i := 1; i+1 < len(l.args); i++ {
			v := l.args[i+1]
			switch l.args[i] {
			case "-p":
				r.Protocol = v
			case "-d":
				p, err := netip.ParsePrefix(v)
				if err != nil {
					a, aerr := netip.ParseAddr(v)
					p, err = netip.PrefixFrom(a, a.BitLen()), aerr
				}
				if err == nil {
					r.HostIP = p.Addr()
				}
			case "--dport":
				n, _ := strconv.Atoi(v)
				r.HostPort = uint16(n)
			case "--to-destination":
				if ap, err := netip.ParseAddrPort(v); err == nil {
					r.ContainerIP, r.ContainerPort = ap.Addr(), ap.Port()
				}
			}
		}
		out[l.mark] = append(out[l.mark], r)
	}
	return out, nil
}
