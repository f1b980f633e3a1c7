package ipamring

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/ringipam/ringipam/pkg/pool"
)

// DefaultTimeout bounds one plugin invocation (store open plus all store
// calls) when the configuration sets no "timeout".
const DefaultTimeout = 30 * time.Second

// GatewayMode says how a container's gateway is chosen.
type GatewayMode string

const (
	// GatewayShared: one gateway per subnet (the range's "gateway", default
	// the subnet's first usable address), as host-local and bridge use.
	GatewayShared GatewayMode = "shared"
	// GatewayPerContainer: every container gets its own gateway allocated
	// from the pool next to its ip, and the subnet {ip} (Garden "from the
	// pool", see pkg/containernet); or, per container through CNI_ARGS
	// SUBNET=, an ip in a special subnet outside the pool shared by several
	// containers, the gateway again from the pool.
	GatewayPerContainer GatewayMode = "per-container"
)

// PrefixMode says which prefix length the result gives a per-container
// address from the pool. The container network's subnet is {ip} either way
// (store, CHECK); only what the main plugin is told differs.
type PrefixMode string

const (
	// PrefixRange: the prefix length of the range the ip came from (e.g.
	// 198.18.0.5/24 via its own gateway 198.18.0.9). The reference ptp
	// plugin needs it: it deletes the kernel's prefix route of the address
	// and routes that prefix via the gateway, so the container's only
	// on-link neighbour is its own gateway. The default.
	PrefixRange PrefixMode = "range"
	// PrefixHost: ip/32 or ip/128 exactly, for main plugins that wire
	// point-to-point addresses themselves. ptp v1.9.1 fails on an IPv4 /32
	// (it deletes a prefix route the kernel never made).
	PrefixHost PrefixMode = "host"
)

// RangeSet is one configured CNI range set and the pool that serves it. Def
// is in the pool's canonical form (pool.Def.Normalize), so hosts given the
// same configuration record byte-identical definitions.
type RangeSet struct {
	Def pool.Def
	// Static is the address asked for by the runtime ("ips" capability,
	// CNI_ARGS IP= or args.cni.ips) inside this range set; zero if none.
	Static netip.Addr
	// FromRuntime is true for range sets that came from the "ipRanges"
	// capability rather than from the configuration file.
	FromRuntime bool
	// Subnet is the special subnet (outside the pool) asked for by CNI_ARGS
	// SUBNET= for this range set's family; Static is then the ip in it.
	// Only with gatewayMode per-container; zero if none.
	Subnet netip.Prefix
}

// Config is the validated configuration of one invocation. Load builds it;
// nothing else should.
type Config struct {
	CNIVersion string
	Network    string // the CNI network name, first part of every owner
	Host       string // this host's stable name in the ring
	RangeSets  []RangeSet
	Routes     []*types.Route
	DNS        types.DNS
	// Reservation is the stable name the owner's addresses are kept under
	// (CNI_ARGS RESERVATION=, or K8S_POD_NAMESPACE/K8S_POD_NAME when
	// reservationFromPod is set); empty for none.
	Reservation string
	GatewayMode GatewayMode
	// PerContainerPrefix is the prefix mode of per-container results.
	PerContainerPrefix PrefixMode
	Timeout            time.Duration
	// ReservationHold is how long a released address stays held for its
	// reservation name (pool.WithReservationHold).
	ReservationHold time.Duration
	// Store is the raw "store" object, validated by Load (see store.go).
	Store storeSettings
	// Chained marks ipam-ring invoked as a chained plugin of a conflist
	// (top-level "chained": true) only to receive GC and STATUS, which the
	// reference main plugins do not forward to their IPAM plugin.
	Chained bool
	// PrevResult is the parsed prevResult (CHECK, chained ADD), or nil.
	PrevResult *current.Result
	// Valid lists the attachments a GC must keep. HasValid is false when
	// the runtime gave no list, in which case GC releases nothing.
	Valid    []types.GCAttachment
	HasValid bool
}

// ErrBadConfig is wrapped by every configuration error (CNI code 7).
var ErrBadConfig = errors.New("invalid ipam-ring configuration")

// ErrNotSupported is wrapped (together with ErrBadConfig) by settings that
// are recognised but not implemented yet.
var ErrNotSupported = errors.New("not yet supported")

func badConfig(format string, a ...any) error {
	return fmt.Errorf("%w: %s", ErrBadConfig, fmt.Sprintf(format, a...))
}

type rangeJSON struct {
	Subnet     string `json:"subnet"`
	RangeStart string `json:"rangeStart,omitempty"`
	RangeEnd   string `json:"rangeEnd,omitempty"`
	Gateway    string `json:"gateway,omitempty"`
}

type ipamJSON struct {
	Type               string          `json:"type"`
	Ranges             [][]rangeJSON   `json:"ranges"`
	Routes             []*types.Route  `json:"routes"`
	DNS                types.DNS       `json:"dns"`
	Exclude            []string        `json:"exclude"`
	Store              json.RawMessage `json:"store"`
	Host               string          `json:"host"`
	Pools              []string        `json:"pools"`
	ReservationFromPod bool            `json:"reservationFromPod"`
	GatewayMode        string          `json:"gatewayMode"`
	PerContainerPrefix string          `json:"perContainerPrefix"`
	Timeout            string          `json:"timeout"`
	ReservationHold    string          `json:"reservationHold"`
	Isolated           bool            `json:"isolated"`
	// host-local's legacy single range, accepted like host-local does.
	Subnet     string `json:"subnet"`
	RangeStart string `json:"rangeStart"`
	RangeEnd   string `json:"rangeEnd"`
	Gateway    string `json:"gateway"`
	// host-local only; accepted and ignored so that switching "type" works.
	DataDir string `json:"dataDir"`
}

type netJSON struct {
	CNIVersion    string          `json:"cniVersion"`
	Name          string          `json:"name"`
	Type          string          `json:"type"`
	Chained       bool            `json:"chained"`
	IPAM          json.RawMessage `json:"ipam"`
	RawPrevResult map[string]any  `json:"prevResult"`
	Valid         json.RawMessage `json:"cni.dev/valid-attachments"`
	OldValid      json.RawMessage `json:"cni.dev/attachments"`
	RuntimeConfig struct {
		IPs      []string      `json:"ips"`
		IPRanges [][]rangeJSON `json:"ipRanges"`
	} `json:"runtimeConfig"`
	Args *struct {
		CNI *struct {
			IPs []string `json:"ips"`
		} `json:"cni"`
	} `json:"args"`
}

// Load parses and validates the plugin's stdin configuration and CNI_ARGS.
// It resolves every default (host name, pool names, gateways, timeout) so
// that the verbs do no parsing of their own. All errors wrap ErrBadConfig.
func Load(stdin []byte, cniArgs string) (*Config, error) {
	var n netJSON
	if err := json.Unmarshal(stdin, &n); err != nil {
		return nil, badConfig("cannot parse network configuration: %v", err)
	}
	if n.Name == "" {
		return nil, badConfig("missing network name")
	}
	if len(n.IPAM) == 0 || string(n.IPAM) == "null" {
		return nil, badConfig("missing \"ipam\" section")
	}
	var im ipamJSON
	dec := json.NewDecoder(bytes.NewReader(n.IPAM))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&im); err != nil {
		return nil, badConfig("cannot parse \"ipam\": %v", err)
	}
	c := &Config{
		CNIVersion:      n.CNIVersion,
		Network:         n.Name,
		Host:            im.Host,
		Routes:          im.Routes,
		DNS:             im.DNS,
		GatewayMode:     GatewayMode(im.GatewayMode),
		Timeout:         DefaultTimeout,
		ReservationHold: pool.DefaultReservationHold,
		Chained:         n.Chained,
	}
	if c.CNIVersion == "" {
		c.CNIVersion = "0.1.0" // what the CNI spec assumes when it is absent
	}
	if c.Host == "" {
		h, err := os.Hostname()
		if err != nil || h == "" {
			return nil, badConfig("no \"host\" given and the hostname is unknown: %v", err)
		}
		c.Host = h
	}
	if im.Timeout != "" {
		d, err := time.ParseDuration(im.Timeout)
		if err != nil || d <= 0 {
			return nil, badConfig("timeout %q is not a positive duration such as \"30s\"", im.Timeout)
		}
		c.Timeout = d
	}
	if im.ReservationHold != "" {
		d, err := time.ParseDuration(im.ReservationHold)
		if err != nil || d < 0 {
			return nil, badConfig("reservationHold %q is not a duration such as \"10m\" (\"0s\": no hold)", im.ReservationHold)
		}
		c.ReservationHold = d
	}
	switch c.GatewayMode {
	case "":
		c.GatewayMode = GatewayShared
	case GatewayShared, GatewayPerContainer:
	case "subnet":
		return nil, badConfig("gatewayMode \"subnet\" is not a mode: use \"per-container\" and ask for the special subnet per container with CNI_ARGS SUBNET=<cidr>;IP=<ip>")
	default:
		return nil, badConfig("gatewayMode %q is unknown; use \"shared\" or \"per-container\"", im.GatewayMode)
	}
	switch PrefixMode(im.PerContainerPrefix) {
	case "", PrefixRange:
		c.PerContainerPrefix = PrefixRange
	case PrefixHost:
		if c.GatewayMode != GatewayPerContainer {
			return nil, badConfig("perContainerPrefix %q needs gatewayMode \"per-container\"", im.PerContainerPrefix)
		}
		c.PerContainerPrefix = PrefixHost
	default:
		return nil, badConfig("perContainerPrefix %q is unknown; use \"range\" or \"host\"", im.PerContainerPrefix)
	}
	for i, r := range c.Routes {
		if r == nil || r.Dst.IP == nil {
			return nil, badConfig("route %d has no \"dst\"", i)
		}
	}
	st, err := parseStore(im.Store)
	if err != nil {
		return nil, err
	}
	c.Store = st

	if err := c.loadRangeSets(&n, &im); err != nil {
		return nil, err
	}
	args, err := parseCNIArgs(cniArgs)
	if err != nil {
		return nil, err
	}
	if err := c.loadSubnets(args); err != nil {
		return nil, err
	}
	if err := c.loadStatics(&n, args); err != nil {
		return nil, err
	}
	switch {
	case args.reservation != "":
		c.Reservation = args.reservation
	case im.ReservationFromPod && args.podNamespace != "" && args.podName != "":
		c.Reservation = args.podNamespace + "/" + args.podName
	}
	if err := c.loadValid(&n); err != nil {
		return nil, err
	}
	if n.RawPrevResult != nil {
		pc := types.PluginConf{CNIVersion: c.CNIVersion, RawPrevResult: n.RawPrevResult}
		if err := version.ParsePrevResult(&pc); err != nil {
			return nil, badConfig("cannot parse prevResult: %v", err)
		}
		prev, err := current.NewResultFromResult(pc.PrevResult)
		if err != nil {
			return nil, badConfig("cannot convert prevResult: %v", err)
		}
		c.PrevResult = prev
	}
	return c, nil
}

// loadRangeSets builds one pool definition per range set: the "ipRanges"
// capability's sets first (as host-local does), then the configured
// "ranges" (after host-local's legacy single range, if any).
func (c *Config) loadRangeSets(n *netJSON, im *ipamJSON) error {
	configured := im.Ranges
	if im.Subnet != "" {
		legacy := []rangeJSON{{Subnet: im.Subnet, RangeStart: im.RangeStart, RangeEnd: im.RangeEnd, Gateway: im.Gateway}}
		configured = append([][]rangeJSON{legacy}, configured...)
	}
	if len(im.Pools) > 0 && len(im.Pools) != len(configured) {
		return badConfig("\"pools\" names %d pools but there are %d range sets", len(im.Pools), len(configured))
	}
	var excl []netip.Prefix
	for _, e := range im.Exclude {
		p, err := parsePrefixOrAddr(e)
		if err != nil {
			return badConfig("exclude %q: %v", e, err)
		}
		excl = append(excl, p)
	}
	for i, rs := range n.RuntimeConfig.IPRanges {
		def, err := buildDef("", rs, excl)
		if err != nil {
			return badConfig("runtimeConfig ipRanges[%d]: %v", i, err)
		}
		// Runtime ranges are usually per node (a node's pod CIDR): name the
		// pool after its content so different nodes get different pools.
		def.Name = c.Network + "-rt-" + defHash(def)
		if def, err = def.Normalize(); err != nil {
			return badConfig("runtimeConfig ipRanges[%d]: %v", i, err)
		}
		c.RangeSets = append(c.RangeSets, RangeSet{Def: def, FromRuntime: true})
	}
	for i, rs := range configured {
		name := fmt.Sprintf("%s-%d", c.Network, i)
		if len(im.Pools) > 0 {
			name = im.Pools[i]
		}
		def, err := buildDef(name, rs, excl)
		if err != nil {
			return badConfig("ranges[%d]: %v", i, err)
		}
		if def, err = def.Normalize(); err != nil {
			return badConfig("ranges[%d]: %v", i, err)
		}
		c.RangeSets = append(c.RangeSets, RangeSet{Def: def})
	}
	for i := range c.RangeSets {
		c.RangeSets[i].Def.Isolated = im.Isolated
	}
	if len(c.RangeSets) == 0 {
		return badConfig("no IP ranges specified (\"ranges\" is empty)")
	}
	seen := map[string]bool{}
	for i, a := range c.RangeSets {
		if seen[a.Def.Name] {
			return badConfig("pool name %q is used by two range sets", a.Def.Name)
		}
		seen[a.Def.Name] = true
		for _, b := range c.RangeSets[i+1:] {
			for _, ra := range a.Def.Ranges {
				for _, rb := range b.Def.Ranges {
					if ra.Subnet.Overlaps(rb.Subnet) {
						return badConfig("range sets of pools %s and %s overlap (%s, %s)", a.Def.Name, b.Def.Name, ra.Subnet, rb.Subnet)
					}
				}
			}
		}
	}
	return nil
}

// buildDef turns one range set into a pool definition, defaulting each
// range's gateway to the subnet's first usable address like host-local.
// Exclusions of the set's family go into the definition.
func buildDef(name string, rs []rangeJSON, excl []netip.Prefix) (pool.Def, error) {
	if len(rs) == 0 {
		return pool.Def{}, errors.New("empty range set")
	}
	def := pool.Def{Name: name}
	for j, r := range rs {
		var pr pool.Range
		sub, err := netip.ParsePrefix(r.Subnet)
		if err != nil {
			return pool.Def{}, fmt.Errorf("range %d: subnet %q: %v", j, r.Subnet, err)
		}
		pr.Subnet = sub.Masked()
		for _, f := range []struct {
			key string
			s   string
			dst *netip.Addr
		}{{"rangeStart", r.RangeStart, &pr.Start}, {"rangeEnd", r.RangeEnd, &pr.End}, {"gateway", r.Gateway, &pr.Gateway}} {
			if f.s == "" {
				continue
			}
			a, err := netip.ParseAddr(f.s)
			if err != nil {
				return pool.Def{}, fmt.Errorf("range %d: %s %q: %v", j, f.key, f.s, err)
			}
			*f.dst = a.Unmap()
		}
		if !pr.Gateway.IsValid() {
			pr.Gateway, _ = pool.DefaultGateway(pr.Subnet)
		}
		def.Ranges = append(def.Ranges, pr)
	}
	is4 := def.Ranges[0].Subnet.Addr().Is4()
	for _, p := range excl {
		if p.Addr().Is4() == is4 {
			def.Exclude = append(def.Exclude, p)
		}
	}
	return def, nil
}

func defHash(d pool.Def) string {
	b, _ := json.Marshal(d.Ranges)
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:6])
}

func parsePrefixOrAddr(s string) (netip.Prefix, error) {
	if strings.Contains(s, "/") {
		p, err := netip.ParsePrefix(s)
		if err != nil {
			return netip.Prefix{}, err
		}
		return p.Masked(), nil
	}
	a, err := netip.ParseAddr(s)
	if err != nil {
		return netip.Prefix{}, err
	}
	a = a.Unmap()
	return netip.PrefixFrom(a, a.BitLen()), nil
}

// parseAddrMaybeCIDR accepts "198.18.0.5" or "198.18.0.5/24" (the prefix is
// ignored: the range set decides the subnet).
func parseAddrMaybeCIDR(s string) (netip.Addr, error) {
	if i := strings.IndexByte(s, '/'); i >= 0 {
		p, err := netip.ParsePrefix(s)
		if err != nil {
			return netip.Addr{}, err
		}
		return p.Addr().Unmap(), nil
	}
	a, err := netip.ParseAddr(s)
	return a.Unmap(), err
}

// loadStatics assigns every requested static address to the one range set
// whose subnets contain it.
func (c *Config) loadStatics(n *netJSON, args cniArgs) error {
	type src struct{ from, s string }
	var all []src
	for _, s := range args.ips {
		all = append(all, src{"CNI_ARGS IP", s})
	}
	if n.Args != nil && n.Args.CNI != nil {
		for _, s := range n.Args.CNI.IPs {
			all = append(all, src{"args.cni.ips", s})
		}
	}
	for _, s := range n.RuntimeConfig.IPs {
		all = append(all, src{"runtimeConfig ips", s})
	}
	for _, x := range all {
		a, err := parseAddrMaybeCIDR(strings.TrimSpace(x.s))
		if err != nil {
			return badConfig("%s %q: %v", x.from, x.s, err)
		}
		idx := slices.IndexFunc(c.RangeSets, func(rs RangeSet) bool {
			return rs.Subnet.Contains(a)
		})
		if idx < 0 {
			idx = slices.IndexFunc(c.RangeSets, func(rs RangeSet) bool {
				return slices.ContainsFunc(rs.Def.Ranges, func(r pool.Range) bool { return r.Subnet.Contains(a) })
			})
		}
		if idx < 0 {
			return badConfig("requested IP %s (%s) is not in any configured range or requested SUBNET", a, x.from)
		}
		rs := &c.RangeSets[idx]
		if rs.Static.IsValid() && rs.Static != a {
			return badConfig("two IPs requested in pool %s: %s and %s", rs.Def.Name, rs.Static, a)
		}
		rs.Static = a
	}
	for _, rs := range c.RangeSets {
		if rs.Subnet.IsValid() && !rs.Static.IsValid() {
			return badConfig("CNI_ARGS SUBNET=%s needs the container's ip in it (CNI_ARGS IP=, or the \"ips\" capability)", rs.Subnet)
		}
	}
	return nil
}

// loadSubnets assigns every special subnet of CNI_ARGS SUBNET= to the one
// range set of its family. A special subnet lies outside the pool: it may
// not overlap any configured range.
func (c *Config) loadSubnets(args cniArgs) error {
	if len(args.subnets) > 0 && c.GatewayMode != GatewayPerContainer {
		return badConfig("CNI_ARGS SUBNET= needs gatewayMode \"per-container\" (this network's is %q)", c.GatewayMode)
	}
	for _, s := range args.subnets {
		p, err := netip.ParsePrefix(s)
		if err != nil {
			return badConfig("CNI_ARGS SUBNET %q: %v", s, err)
		}
		if p.Addr().Is4In6() || p.Addr().Zone() != "" {
			return badConfig("CNI_ARGS SUBNET %q: use a plain IPv4 or IPv6 prefix", s)
		}
		p = p.Masked()
		var idx []int
		for i, rs := range c.RangeSets {
			for _, r := range rs.Def.Ranges {
				if r.Subnet.Overlaps(p) {
					return badConfig("CNI_ARGS SUBNET %s overlaps range %s of pool %s; a special subnet must lie outside the pool", p, r.Subnet, rs.Def.Name)
				}
			}
			if rs.Def.Ranges[0].Subnet.Addr().Is4() == p.Addr().Is4() {
				idx = append(idx, i)
			}
		}
		switch {
		case len(idx) == 0:
			return badConfig("CNI_ARGS SUBNET %s: no range set of its address family gives it a gateway", p)
		case len(idx) > 1:
			return badConfig("CNI_ARGS SUBNET %s: several range sets of its address family (pools %s, %s); which one gives the gateway is ambiguous", p, c.RangeSets[idx[0]].Def.Name, c.RangeSets[idx[1]].Def.Name)
		}
		rs := &c.RangeSets[idx[0]]
		if rs.Subnet.IsValid() && rs.Subnet != p {
			return badConfig("CNI_ARGS: two SUBNETs of one address family: %s and %s", rs.Subnet, p)
		}
		rs.Subnet = p
	}
	return nil
}

func (c *Config) loadValid(n *netJSON) error {
	raw := n.Valid
	key := "cni.dev/valid-attachments"
	if len(raw) == 0 || string(raw) == "null" {
		raw, key = n.OldValid, "cni.dev/attachments"
	}
	if len(raw) == 0 || string(raw) == "null" {
		return nil
	}
	if err := json.Unmarshal(raw, &c.Valid); err != nil {
		return badConfig("cannot parse %q: %v", key, err)
	}
	c.HasValid = true
	return nil
}

type cniArgs struct {
	ips                   []string
	subnets               []string
	reservation           string
	podNamespace, podName string
	ignoreUnknown         bool
}

// parseCNIArgs reads CNI_ARGS ("K=V;K=V"). Known keys: IP (comma-separated
// addresses), SUBNET (comma-separated special subnets), RESERVATION, K8S_POD_NAMESPACE, K8S_POD_NAME, and the other
// K8S_* keys runtimes send. Unknown keys are an error unless
// IgnoreUnknown=1 (or true) is present, as in CNI's CommonArgs.
func parseCNIArgs(s string) (cniArgs, error) {
	var a cniArgs
	if s == "" {
		return a, nil
	}
	var unknown []string
	for _, pair := range strings.Split(s, ";") {
		if pair == "" {
			continue
		}
		k, v, ok := strings.Cut(pair, "=")
		if !ok {
			return a, badConfig("CNI_ARGS: %q is not KEY=VALUE", pair)
		}
		switch k {
		case "IP":
			for _, ip := range strings.Split(v, ",") {
				if ip = strings.TrimSpace(ip); ip != "" {
					a.ips = append(a.ips, ip)
				}
			}
		case "SUBNET":
			for _, sn := range strings.Split(v, ",") {
				if sn = strings.TrimSpace(sn); sn != "" {
					a.subnets = append(a.subnets, sn)
				}
			}
		case "RESERVATION":
			a.reservation = v
		case "K8S_POD_NAMESPACE":
			a.podNamespace = v
		case "K8S_POD_NAME":
			a.podName = v
		case "K8S_POD_INFRA_CONTAINER_ID", "K8S_POD_UID":
		case "IgnoreUnknown":
			a.ignoreUnknown = v == "1" || strings.EqualFold(v, "true")
		default:
			unknown = append(unknown, k)
		}
	}
	if len(unknown) > 0 && !a.ignoreUnknown {
		return a, badConfig("CNI_ARGS: unknown keys %v (add IgnoreUnknown=1 to ignore them)", unknown)
	}
	return a, nil
}
