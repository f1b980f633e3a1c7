package routes

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"sync"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// Defaults of a Table. Route protocol 212 and table 4212 are not assigned
// in iproute2's rt_protos or rt_tables; an operator whose site uses them
// picks others (TableConfig).
const (
	DefaultTable        = 4212
	DefaultProtocol     = 212
	DefaultRulePriority = 32000
)

// Why a table of its own and a rule, and not the main table: the main
// table belongs to the operator's tools (ifupdown, NetworkManager, DHCP
// clients, other CNI plugins) which list and flush it; a table of ringipam's
// own is never flushed by them and never makes ringipam see theirs, and
// `ip route show table 4212` shows exactly what the agent holds. The rule
// sits before the main table (32766) so a route here wins over main's
// connected route of the same pool's subnet (a bridge's 10.0.0.0/24 dev
// br0: every container bridge on every host carries the whole pool as
// on-link), whatever its prefix length; a destination with no route here
// falls through to main as before. Routes also carry protocol 212, so even
// a route someone else put in the table is left alone.

// TableConfig chooses a Table's numbers; zero fields take the defaults.
type TableConfig struct {
	Table        int // routing table (DefaultTable)
	Protocol     int // route protocol, 1-255 (DefaultProtocol)
	RulePriority int // priority of the policy rule to the table (DefaultRulePriority)
}

// Table installs plans in one routing table through netlink, in the
// network namespace it was opened in. Safe for concurrent use (calls are
// serialised). Close releases the netlink socket; it does not remove
// routes (Clear does).
type Table struct {
	cfg TableConfig
	mu  sync.Mutex
	h   *netlink.Handle
	// proxyARP holds the proxy_arp value each link had before ProxyARP
	// turned it on (Clear puts it back).
	proxyARP map[string]string
}

// Installed is one route the table holds.
type Installed struct {
	Dst netip.Prefix
	Via netip.Addr
}

// Change is what one Apply did.
type Change struct {
	Added, Replaced, Deleted, Kept int
}

// Complete fills the defaults in and checks the numbers.
func (c TableConfig) Complete() (TableConfig, error) {
	if c.Table == 0 {
		c.Table = DefaultTable
	}
	if c.Protocol == 0 {
		c.Protocol = DefaultProtocol
	}
	if c.RulePriority == 0 {
		c.RulePriority = DefaultRulePriority
	}
	switch {
	case c.Table < 0 || c.Table == unix.RT_TABLE_MAIN || c.Table == unix.RT_TABLE_LOCAL || c.Table == unix.RT_TABLE_DEFAULT:
		return c, fmt.Errorf("routing table %d: must be a table of ringipam's own (not main, local or default)", c.Table)
	case c.Protocol < 5 || c.Protocol > 255: // 0-4 are the kernel's (unspec, redirect, kernel, boot, static)
		return c, fmt.Errorf("route protocol %d: must be 5-255", c.Protocol)
	case c.RulePriority < 1 || c.RulePriority >= 32766:
		return c, fmt.Errorf("rule priority %d: must be 1-32765 (before the main table's rule)", c.RulePriority)
	}
	return c, nil
}

// OpenTable opens a netlink handle in the calling thread's network
// namespace.
func OpenTable(cfg TableConfig) (*Table, error) {
	cfg, err := cfg.Complete()
	if err != nil {
		return nil, err
	}
	h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("opening netlink: %w", err)
	}
	return &Table{cfg: cfg, h: h, proxyARP: map[string]string{}}, nil
}

// Close releases the netlink socket.
func (t *Table) Close() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.h.Close()
}

// Config returns the table's numbers (defaults filled in).
func (t *Table) Config() TableConfig { return t.cfg }

// OnLink returns the prefixes directly connected to this host: the global
// and link-scope addresses of every interface with their prefix lengths
// (loopback and host addresses left out).
func (t *Table) OnLink() ([]netip.Prefix, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	addrs, err := t.h.AddrList(nil, netlink.FAMILY_ALL)
	if err != nil {
		return nil, fmt.Errorf("listing addresses: %w", err)
	}
	var out []netip.Prefix
	for _, a := range addrs {
		if a.IPNet == nil || a.Scope == unix.RT_SCOPE_HOST || a.IP.IsLoopback() || a.IP.IsLinkLocalUnicast() {
			continue
		}
		ip, ok := netip.AddrFromSlice(a.IP)
		if !ok {
			continue
		}
		bits, _ := a.Mask.Size()
		out = append(out, netip.PrefixFrom(ip.Unmap(), bits))
	}
	return out, nil
}

// Installed lists the routes of the table that carry its protocol, both
// families.
func (t *Table) Installed() ([]Installed, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	rs, err := t.list()
	if err != nil {
		return nil, err
	}
	out := make([]Installed, 0, len(rs))
	for _, r := range rs {
		if in, ok := installedOf(r); ok {
			out = append(out, in)
		}
	}
	slices.SortFunc(out, func(a, b Installed) int {
		if c := a.Dst.Addr().Compare(b.Dst.Addr()); c != 0 {
			return c
		}
		return a.Dst.Bits() - b.Dst.Bits()
	})
	return out, nil
}

func (t *Table) list() ([]netlink.Route, error) {
	filter := &netlink.Route{Table: t.cfg.Table, Protocol: netlink.RouteProtocol(t.cfg.Protocol)}
	rs, err := t.h.RouteListFiltered(netlink.FAMILY_ALL, filter, netlink.RT_FILTER_TABLE|netlink.RT_FILTER_PROTOCOL)
	if err != nil {
		return nil, fmt.Errorf("listing routes of table %d: %w", t.cfg.Table, err)
	}
	return rs, nil
}

func installedOf(r netlink.Route) (Installed, bool) {
	if r.Dst == nil {
		return Installed{}, false
	}
	ip, ok := netip.AddrFromSlice(r.Dst.IP)
	if !ok {
		return Installed{}, false
	}
	bits, _ := r.Dst.Mask.Size()
	via, _ := netip.AddrFromSlice(r.Gw)
	return Installed{Dst: netip.PrefixFrom(ip.Unmap(), bits), Via: via.Unmap()}, true
}

// Apply makes the table hold exactly routes: it adds the missing ones,
// replaces those whose next hop changed, deletes its own routes that are
// no longer wanted, and makes sure the policy rule of each family is
// there. Each route is one netlink request, so a route is either installed
// whole or not at all; a failed route (the kernel refuses a next hop that
// is not directly reachable, ENETUNREACH) does not stop the others: the
// errors come back joined, with what was done.
func (t *Table) Apply(routes []Route) (Change, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	var ch Change
	have, err := t.list()
	if err != nil {
		return ch, err
	}
	current := map[netip.Prefix]netip.Addr{}
	for _, r := range have {
		if in, ok := installedOf(r); ok {
			current[in.Dst] = in.Via
		}
	}
	want := map[netip.Prefix]bool{}
	var errs []error
	for _, r := range routes {
		want[r.Dst] = true
		via, ok := current[r.Dst]
		if ok && via == r.Via {
			ch.Kept++
			continue
		}
		if err := t.h.RouteReplace(t.route(r.Dst, r.Via)); err != nil {
			errs = append(errs, fmt.Errorf("route %s via %s in table %d: %w", r.Dst, r.Via, t.cfg.Table, err))
			continue
		}
		if ok {
			ch.Replaced++
		} else {
			ch.Added++
		}
	}
	for dst, via := range current {
		if want[dst] {
			continue
		}
		if err := t.h.RouteDel(t.route(dst, via)); err != nil && !errors.Is(err, unix.ESRCH) {
			errs = append(errs, fmt.Errorf("deleting route %s via %s from table %d: %w", dst, via, t.cfg.Table, err))
			continue
		}
		ch.Deleted++
	}
	if err := t.ensureRules(); err != nil {
		errs = append(errs, err)
	}
	return ch, errors.Join(errs...)
}

// Clear deletes every route of the table that carries its protocol and
// the policy rules to the table, and nothing else. It goes through all of
// them and joins the errors; nothing left to remove is success.
func (t *Table) Clear() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	var errs []error
	rules, err := t.rules()
	if err != nil {
		errs = append(errs, err)
	}
	for _, r := range rules {
		if err := t.h.RuleDel(&r); err != nil && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, fmt.Errorf("deleting rule %s: %w", r, err))
		}
	}
	for link, prev := range t.proxyARP {
		err := writeSysctl(proxyARPPath(link), prev)
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, fmt.Errorf("restoring proxy_arp of %s: %w", link, err))
			continue
		}
		delete(t.proxyARP, link)
	}
	have, err := t.list()
	if err != nil {
		return errors.Join(append(errs, err)...)
	}
	for _, r := range have {
		if err := t.h.RouteDel(&r); err != nil && !errors.Is(err, unix.ESRCH) {
			errs = append(errs, fmt.Errorf("deleting route %s from table %d: %w", r.Dst, t.cfg.Table, err))
		}
	}
	return errors.Join(errs...)
}

func (t *Table) route(dst netip.Prefix, via netip.Addr) *netlink.Route {
	fam := netlink.FAMILY_V6
	if dst.Addr().Is4() {
		fam = netlink.FAMILY_V4
	}
	return &netlink.Route{
		Family:   fam,
		Dst:      &net.IPNet{IP: dst.Addr().AsSlice(), Mask: net.CIDRMask(dst.Bits(), dst.Addr().BitLen())},
		Gw:       via.AsSlice(),
		Table:    t.cfg.Table,
		Protocol: netlink.RouteProtocol(t.cfg.Protocol),
	}
}

// rules returns the policy rules of both families that look up the table
// at the table's priority (the ones ensureRules adds).
func (t *Table) rules() ([]netlink.Rule, error) {
	var out []netlink.Rule
	for _, fam := range []int{netlink.FAMILY_V4, netlink.FAMILY_V6} {
		rs, err := t.h.RuleList(fam)
		if err != nil {
			return nil, fmt.Errorf("listing rules: %w", err)
		}
		for _, r := range rs {
			if r.Table == t.cfg.Table && r.Priority == t.cfg.RulePriority {
				r.Family = fam
				out = append(out, r)
			}
		}
	}
	return out, nil
}

// ensureRules adds "from all lookup <table>" at the table's priority for
// each family that lacks it.
func (t *Table) ensureRules() error {
	have, err := t.rules()
	if err != nil {
		return err
	}
	var errs []error
	for _, fam := range []int{netlink.FAMILY_V4, netlink.FAMILY_V6} {
		if slices.ContainsFunc(have, func(r netlink.Rule) bool { return r.Family == fam }) {
			continue
		}
		r := netlink.NewRule()
		r.Family, r.Table, r.Priority = fam, t.cfg.Table, t.cfg.RulePriority
		if err := t.h.RuleAdd(r); err != nil && !errors.Is(err, unix.EEXIST) {
			errs = append(errs, fmt.Errorf("adding rule %s: %w", r, err))
		}
	}
	return errors.Join(errs...)
}

// ProxyARP turns IPv4 proxy ARP on for every link holding an address
// inside one of subnets (the pools' IPv4 subnets: a bridge whose gateway
// address is in a pool, as the bridge plugin with isGateway sets it up)
// and returns their names. Containers on such a bridge see the whole
// subnet as on-link and ARP for neighbours that live on other hosts; with
// proxy_arp the bridge answers for exactly the addresses the kernel routes
// out of another link (other hosts' ranges, through this table), never for
// the containers on the bridge itself. Clear puts back each link's
// previous value. The sysctls are those of the calling thread's network
// namespace (the one the Table was opened in, for the agent). (IPv6 has no
// range-wide proxy NDP: not done here.)
func (t *Table) ProxyARP(subnets []netip.Prefix) ([]string, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	addrs, err := t.h.AddrList(nil, netlink.FAMILY_V4)
	if err != nil {
		return nil, fmt.Errorf("listing addresses: %w", err)
	}
	var links []string
	var errs []error
	for _, a := range addrs {
		ip, ok := netip.AddrFromSlice(a.IP)
		if !ok || !slices.ContainsFunc(subnets, func(p netip.Prefix) bool { return p.Contains(ip.Unmap()) }) {
			continue
		}
		l, err := t.h.LinkByIndex(a.LinkIndex)
		if err != nil {
			errs = append(errs, fmt.Errorf("link %d: %w", a.LinkIndex, err))
			continue
		}
		name := l.Attrs().Name
		if slices.Contains(links, name) {
			continue
		}
		path := proxyARPPath(name)
		cur, err := os.ReadFile(path)
		if err != nil {
			errs = append(errs, fmt.Errorf("reading proxy_arp of %s: %w", name, err))
			continue
		}
		links = append(links, name)
		if strings.TrimSpace(string(cur)) == "1" {
			continue
		}
		if _, ok := t.proxyARP[name]; !ok {
			t.proxyARP[name] = strings.TrimSpace(string(cur))
		}
		if err := writeSysctl(path, "1"); err != nil {
			errs = append(errs, fmt.Errorf("turning proxy_arp on for %s: %w", name, err))
		}
	}
	return links, errors.Join(errs...)
}

func proxyARPPath(link string) string { return "/proc/sys/net/ipv4/conf/" + link + "/proxy_arp" }

func writeSysctl(path, v string) error {
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	_, err = f.WriteString(v)
	return errors.Join(err, f.Close())
}
