package ipam

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"time"

	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/ringipam/ringipam/pkg/names"
	"github.com/ringipam/ringipam/pkg/pool"
)

// MaxConfig is the largest network configuration Load accepts (4 MiB):
// far above any real conflist entry with its prevResult (a few KiB). The
// CNI library's skel reads stdin whole before the verb runs, so the bound
// keeps a huge configuration from being decoded and served, not from
// being read.
const MaxConfig = 4 << 20

// checkSize refuses (code 7) a configuration larger than MaxConfig.
func checkSize(stdin []byte) error {
	if len(stdin) > MaxConfig {
		return badConfig("network configuration of %d bytes is larger than %d bytes", len(stdin), MaxConfig)
	}
	return nil
}

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
	// IPv6ViaGateway ("ipv6ViaGateway": true) adds to the result, for every
	// IPv6 address with a gateway, a route for its subnet through the
	// gateway with metric SubnetViaGatewayMetric, below the kernel's 256
	// of the on-link prefix route: the container then sends every address
	// of the subnet to the host, which delivers its own on the bridge and
	// routes other hosts' through ringipamd --routes (no range-wide proxy
	// NDP exists for IPv6). Bridge networks in gatewayMode shared only.
	IPv6ViaGateway bool
	// Reservation is the stable name the owner's addresses are kept under
	// (CNI_ARGS RESERVATION=, or K8S_POD_NAMESPACE/K8S_POD_NAME when
	// reservationFromPod is set); empty for none.
	Reservation string
	// Pod is the Kubernetes pod of the invocation (CNI_ARGS
	// K8S_POD_NAMESPACE, K8S_POD_NAME, K8S_POD_UID), recorded with a new
	// allocation (pool.Request.Pod); nil when the runtime sent none.
	Pod         *pool.PodRef
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

func badConfig(format string, a ...any) error {
	return fmt.Errorf("%w: %s", ErrBadConfig, fmt.Sprintf(format, a...))
}

type rangeJSON struct {
	Subnet     string `json:"subnet"`
	RangeStart string `json:"rangeStart,omitempty"`
	RangeEnd   string `json:"rangeEnd,omitempty"`
	Gateway    string `json:"gateway,omitempty"`
	// Static marks a range whose addresses go only to static requests
	// ("ips" capability, CNI_ARGS IP=), never to dynamic ones.
	Static bool `json:"static,omitempty"`
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
	ReservationFromPod reservationMode `json:"reservationFromPod"`
	GatewayMode        string          `json:"gatewayMode"`
	PerContainerPrefix string          `json:"perContainerPrefix"`
	Timeout            string          `json:"timeout"`
	ReservationHold    string          `json:"reservationHold"`
	Isolated           bool            `json:"isolated"`
	IPv6ViaGateway     bool            `json:"ipv6ViaGateway"`
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
	RuntimeConfig runtimeJSON     `json:"runtimeConfig"`
	Args          *argsJSON       `json:"args"`
}

type runtimeJSON struct {
	IPs      []string      `json:"ips"`
	IPRanges [][]rangeJSON `json:"ipRanges"`
	// The pod's annotations, sent by containerd and CRI-O when the
	// main plugin declares the capability (ipam-ring gets the main
	// plugin's stdin).
	Annotations map[string]string `json:"io.kubernetes.cri.pod-annotations"`
}

// argsJSON is the conventions' "args" ({"cni": {"ips": [...]}}).
type argsJSON struct {
	CNI *struct {
		IPs []string `json:"ips"`
	} `json:"cni"`
}

// parseTimeout reads "ipam.timeout": DefaultTimeout when empty, else a
// positive duration.
func parseTimeout(s string) (time.Duration, error) {
	if s == "" {
		return DefaultTimeout, nil
	}
	d, err := time.ParseDuration(s)
	if err != nil || d <= 0 {
		return 0, badConfig("timeout %q is not a positive duration such as \"30s\"", s)
	}
	return d, nil
}

// Load parses and validates the plugin's stdin configuration and CNI_ARGS.
// It resolves every default (host name, pool names, gateways, timeout) so
// that the verbs do no parsing of their own. All errors wrap ErrBadConfig.
func Load(stdin []byte, cniArgs string) (*Config, error) {
	return load(stdin, cniArgs, "")
}

// load is Load with the machine's hostname given ("": ask the system).
func load(stdin []byte, cniArgs, hostname string) (*Config, error) {
	if err := checkSize(stdin); err != nil {
		return nil, err
	}
	// The network configuration carries other plugins' and the runtime's
	// keys: decoded leniently, as every CNI plugin does.
	var n netJSON
	if err := json.Unmarshal(stdin, &n); err != nil {
		return nil, badConfig("cannot parse network configuration: %v", err)
	}
	if n.Name == "" {
		return nil, badConfig("missing network name")
	}
	if err := names.Network(n.Name); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadConfig, err)
	}
	if len(n.IPAM) == 0 || string(n.IPAM) == "null" {
		return nil, badConfig("missing \"ipam\" section")
	}
	// The "ipam" object is ipam-ring's own: an unknown key in it (or in
	// one of its ranges) is a typo, refused (README).
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
		IPv6ViaGateway:  im.IPv6ViaGateway,
		ReservationHold: pool.DefaultReservationHold,
		Chained:         n.Chained,
	}
	if c.CNIVersion == "" {
		c.CNIVersion = "0.1.0" // what the CNI spec assumes when it is absent
	}
	if c.Host == "" && hostname != "" {
		c.Host = hostname
	}
	if c.Host == "" {
		h, err := os.Hostname()
		if err != nil || h == "" {
			return nil, badConfig("no \"host\" given and the hostname is unknown: %v", err)
		}
		c.Host = h
	}
	timeout, err := parseTimeout(im.Timeout)
	if err != nil {
		return nil, err
	}
	c.Timeout = timeout
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
	if c.IPv6ViaGateway {
		switch {
		case c.GatewayMode != GatewayShared:
			return nil, badConfig("ipv6ViaGateway needs gatewayMode \"shared\" (a bridge network): per-container gateways send every address to the host already")
		case n.Type == "ptp":
			// ptp deletes "the" on-link prefix route after
			// configuring the interface and would delete this one.
			return nil, badConfig("ipv6ViaGateway is for bridge networks: ptp sends every address to the host already (and would remove this route instead of the on-link one)")
		}
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
	case args.podNamespace != "" && args.podName != "" && im.ReservationFromPod.reserves(n.RuntimeConfig.Annotations):
		c.Reservation = args.podNamespace + "/" + args.podName
	}
	if args.podNamespace != "" && args.podName != "" {
		c.Pod = &pool.PodRef{Namespace: args.podNamespace, Name: args.podName, UID: args.podUID}
	}
	if err := names.Reservation(c.Reservation); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadConfig, err)
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
