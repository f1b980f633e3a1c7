// Package portmap is the verb code of the portmap-ingress CNI plugin,
// imported by the plugin's main (plugins/portmap-ingress, through
// skel.PluginMainFuncs) and the host agent: a chained plugin that
// publishes a container's ports, unique per host (host mode) or across the
// cluster (ingress mode), through pkg/portalloc, and programs the host's
// packet filter (one nftables table of its own, or iptables chains where
// nftables is missing) to reach them.
//
// Contract: ADD allocates every requested port in one store transaction and
// then installs the forwards; if the forwards fail, the ports are released
// again. DEL releases what the attachment holds (its store record says
// what, so DEL needs no portMappings) and removes exactly the forwards ADD
// added (each carries the attachment's mark); it succeeds when there is
// nothing left. CHECK verifies the allocation and the forwards. GC removes
// forwards and allocations of this network's attachments that are gone, on
// this host only. The verbs' cores (core.go) take their store and data path
// as small interfaces and return values; Edge (cmd.go) does the I/O and
// maps errors to CNI codes (errors.go). Load decodes the configuration with
// encoding/json, leniently: it is the plugin's entry of a conflist, whose
// keys include the runtime's.
//
// On etcd the plugin does no store or packet-filter work itself: an Edge
// with ToAgent set sends the whole invocation to the host agent (package
// agentapi; agent.go), whose AgentHandler runs the same verb on the
// agent's store and data path (the agent runs in the host's network
// namespace) and answers what the plugin prints and logs. Without an agent
// ADD, CHECK, GC and STATUS fail with code 11 naming the socket, and DEL is
// queued on disk for the agent. A local store needs no agent.
package portmap

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
	"time"

	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"

	"github.com/ringipam/ringipam/pkg/names"
	"github.com/ringipam/ringipam/pkg/portalloc"
	"github.com/ringipam/ringipam/pkg/storeconfig"
)

// ErrBadConfig is wrapped by every configuration error (CNI code 7).
var ErrBadConfig = errors.New("invalid portmap-ingress configuration")

func badConfig(format string, a ...any) error {
	return fmt.Errorf("%w: %s", ErrBadConfig, fmt.Sprintf(format, a...))
}

// Mapping is one requested published port.
type Mapping struct {
	HostPort      uint16
	ContainerPort uint16
	Protocol      string
	HostIP        netip.Addr
	Mode          portalloc.Mode
}

// Dataplane kinds (the "dataplane" key).
const (
	DataplaneAuto     = "auto"     // nftables when the nft command is there, else iptables
	DataplaneNFTables = "nftables" // one inet table of the plugin's own (knftables)
	DataplaneIPTables = "iptables" // chains of the plugin's own in the nat tables of iptables and ip6tables
)

// Config is the validated configuration of one invocation.
type Config struct {
	CNIVersion string
	Network    string
	Host       string
	Mode       portalloc.Mode // the default mode of mappings
	Lo, Hi     uint16
	Timeout    time.Duration
	Table      string
	Dataplane  string
	Store      storeconfig.Config
	Mappings   []Mapping
	// MappingsErr is why the requested mappings (or prevResult) could not
	// be read: ADD and CHECK fail with it, DEL and GC need neither.
	MappingsErr error
	PrevResult  *current.Result
	Valid       []types.GCAttachment
	HasValid    bool
}

// mappingJSON accepts both spellings: the CNI convention (hostPort) and
// containerd's Go field case (HostPort).
type mappingJSON struct {
	HostPort      *int   `json:"hostPort"`
	ContainerPort *int   `json:"containerPort"`
	Protocol      string `json:"protocol"`
	HostIP        string `json:"hostIP"`
	Mode          string `json:"mode"`
	// containerd's spelling
	HostPortG      *int   `json:"HostPort"`
	ContainerPortG *int   `json:"ContainerPort"`
	ProtocolG      string `json:"Protocol"`
	HostIPG        string `json:"HostIP"`
}

type netJSON struct {
	CNIVersion    string          `json:"cniVersion"`
	Name          string          `json:"name"`
	Mode          string          `json:"mode"`
	Host          string          `json:"host"`
	DynamicRange  string          `json:"dynamicRange"`
	Timeout       string          `json:"timeout"`
	Table         string          `json:"table"`
	Dataplane     string          `json:"dataplane"`
	Store         json.RawMessage `json:"store"`
	RawPrevResult map[string]any  `json:"prevResult"`
	RuntimeConfig struct {
		PortMappings []mappingJSON     `json:"portMappings"`
		Annotations  map[string]string `json:"io.kubernetes.cri.pod-annotations"`
	} `json:"runtimeConfig"`
	Valid json.RawMessage `json:"cni.dev/valid-attachments"`
}

// PublishAnnotation asks for ports that a runtime would drop as
// "hostPort: 0" (containerd and podman drop such mappings): a list like
// "80/tcp, 53/udp, 443/tcp=ingress, 8080/tcp:9000" (container port /
// protocol [: host port] [= mode]). CNI_ARGS PUBLISH= takes the same list.
const PublishAnnotation = "ringipam.io/publish"

// DefaultTable is the nftables table the plugin owns.
const DefaultTable = "ringipam-portmap"

// DefaultTimeout bounds one invocation when the configuration sets none.
const DefaultTimeout = 30 * time.Second

// MaxConfig is the largest configuration Load accepts (4 MiB), as
// ipam-ring's: skel has read stdin whole by then, so the bound keeps a huge
// one from being decoded and served.
const MaxConfig = 4 << 20

// Load parses and validates stdin and CNI_ARGS.
func Load(stdin []byte, cniArgs string) (*Config, error) { return load(stdin, cniArgs, "") }

// load is Load with the plugin's hostname given, the host a configuration
// without one means ("": this machine's).
func load(stdin []byte, cniArgs, hostname string) (*Config, error) {
	if len(stdin) > MaxConfig {
		return nil, badConfig("network configuration of %d bytes is larger than %d bytes", len(stdin), MaxConfig)
	}
	var n netJSON
	if err := json.Unmarshal(stdin, &n); err != nil {
		return nil, badConfig("cannot parse network configuration: %v", err)
	}
	if n.Name == "" {
		return nil, badConfig("the network has no name")
	}
	c := &Config{CNIVersion: n.CNIVersion, Network: n.Name, Mode: portalloc.Host,
		Lo: portalloc.DefaultLo, Hi: portalloc.DefaultHi, Timeout: DefaultTimeout, Table: DefaultTable, Dataplane: DataplaneAuto}
	if err := names.Network(c.Network); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadConfig, err)
	}
	switch portalloc.Mode(n.Mode) {
	case "":
	case portalloc.Host, portalloc.Ingress:
		c.Mode = portalloc.Mode(n.Mode)
	default:
		return nil, badConfig("mode %q: want host or ingress", n.Mode)
	}
	host := n.Host
	if host == "" {
		host = hostname
	}
	host, err := storeconfig.HostName(host)
	if err != nil {
		return nil, badConfig("host: %v", err)
	}
	c.Host = host
	if n.DynamicRange != "" {
		lo, hi, ok := strings.Cut(n.DynamicRange, "-")
		l, err1 := strconv.ParseUint(strings.TrimSpace(lo), 10, 16)
		h, err2 := strconv.ParseUint(strings.TrimSpace(hi), 10, 16)
		if !ok || err1 != nil || err2 != nil || l == 0 || l > h {
			return nil, badConfig("dynamicRange %q: want LOW-HIGH within 1-65535", n.DynamicRange)
		}
		c.Lo, c.Hi = uint16(l), uint16(h)
	}
	if n.Timeout != "" {
		d, err := time.ParseDuration(n.Timeout)
		if err != nil || d <= 0 {
			return nil, badConfig("timeout %q is not a positive duration", n.Timeout)
		}
		c.Timeout = d
	}
	if n.Table != "" {
		if !validTable(n.Table) {
			return nil, badConfig("table %q: want 1-32 letters, digits, '-' or '_'", n.Table)
		}
		c.Table = n.Table
	}
	switch n.Dataplane {
	case "":
	case DataplaneAuto, DataplaneNFTables, DataplaneIPTables:
		c.Dataplane = n.Dataplane
	default:
		return nil, badConfig("dataplane %q: want auto, nftables or iptables", n.Dataplane)
	}
	if len(n.Store) > 0 && string(n.Store) != "null" {
		s, err := storeconfig.Parse(n.Store)
		if err != nil {
			return nil, badConfig("store: %v", err)
		}
		c.Store = s
	}
	c.MappingsErr = c.loadMappings(&n, cniArgs)
	if c.MappingsErr == nil && n.RawPrevResult != nil {
		b, _ := json.Marshal(n.RawPrevResult)
		r, err := current.NewResult(b)
		if err == nil {
			c.PrevResult, err = current.GetResult(r)
		}
		if err != nil {
			c.MappingsErr = badConfig("prevResult: %v", err)
		}
	}
	if len(n.Valid) > 0 {
		if err := json.Unmarshal(n.Valid, &c.Valid); err != nil {
			return nil, badConfig("cni.dev/valid-attachments: %v", err)
		}
		c.HasValid = true
	}
	return c, nil
}

// loadMappings reads the requested mappings: the portMappings capability,
// the publish annotation and CNI_ARGS PUBLISH, in that order.
func (c *Config) loadMappings(n *netJSON, cniArgs string) error {
	for i, m := range n.RuntimeConfig.PortMappings {
		mp, err := m.mapping(c.Mode)
		if err != nil {
			return badConfig("portMappings[%d]: %v", i, err)
		}
		c.Mappings = append(c.Mappings, mp)
	}
	if s := n.RuntimeConfig.Annotations[PublishAnnotation]; s != "" {
		ms, err := parsePublish(s, c.Mode)
		if err != nil {
			return badConfig("annotation %s: %v", PublishAnnotation, err)
		}
		c.Mappings = append(c.Mappings, ms...)
	}
	for _, kv := range strings.Split(cniArgs, ";") {
		k, v, _ := strings.Cut(kv, "=")
		if k == "PUBLISH" && v != "" {
			ms, err := parsePublish(v, c.Mode)
			if err != nil {
				return badConfig("CNI_ARGS PUBLISH: %v", err)
			}
			c.Mappings = append(c.Mappings, ms...)
		}
	}
	if err := portalloc.ValidateSpec(c.spec()); err != nil {
		return badConfig("%v", err)
	}
	return nil
}

func validTable(s string) bool {
	if len(s) == 0 || len(s) > 32 {
		return false
	}
	for _, r := range s {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_') {
			return false
		}
	}
	return true
}

func (m mappingJSON) mapping(def portalloc.Mode) (Mapping, error) {
	hp, cp, proto, hip := m.HostPort, m.ContainerPort, m.Protocol, m.HostIP
	if hp == nil {
		hp = m.HostPortG
	}
	if cp == nil {
		cp = m.ContainerPortG
	}
	if proto == "" {
		proto = m.ProtocolG
	}
	if hip == "" {
		hip = m.HostIPG
	}
	out := Mapping{Protocol: strings.ToLower(proto), Mode: def}
	if out.Protocol == "" {
		out.Protocol = "tcp"
	}
	if cp == nil || *cp < 1 || *cp > 65535 {
		return Mapping{}, fmt.Errorf("containerPort missing or outside 1-65535")
	}
	out.ContainerPort = uint16(*cp)
	if hp != nil {
		if *hp < 0 || *hp > 65535 {
			return Mapping{}, fmt.Errorf("hostPort %d outside 0-65535", *hp)
		}
		out.HostPort = uint16(*hp)
	}
	if hip != "" && hip != "0.0.0.0" && hip != "::" {
		a, err := netip.ParseAddr(hip)
		if err != nil {
			return Mapping{}, fmt.Errorf("hostIP %q: %v", hip, err)
		}
		out.HostIP = a
	}
	if m.Mode != "" {
		out.Mode = portalloc.Mode(m.Mode)
	}
	if out.Mode != portalloc.Host && out.Mode != portalloc.Ingress {
		return Mapping{}, fmt.Errorf("mode %q: want host or ingress", m.Mode)
	}
	return out, nil
}

// parsePublish reads "80/tcp, 53/udp:5353, 443/tcp=ingress".
func parsePublish(s string, def portalloc.Mode) ([]Mapping, error) {
	var out []Mapping
	for _, item := range strings.Split(s, ",") {
		item = strings.TrimSpace(item)
		if item == "" {
			continue
		}
		mode := def
		if x, md, ok := strings.Cut(item, "="); ok {
			item, mode = x, portalloc.Mode(md)
		}
		hostPort := 0
		if x, hp, ok := strings.Cut(item, ":"); ok {
			n, err := strconv.Atoi(hp)
			if err != nil {
				return nil, fmt.Errorf("%q: host port %q", item, hp)
			}
			item, hostPort = x, n
		}
		port, proto, _ := strings.Cut(item, "/")
		if proto == "" {
			proto = "tcp"
		}
		cp, err := strconv.Atoi(port)
		if err != nil {
			return nil, fmt.Errorf("%q: container port %q", item, port)
		}
		m, err := mappingJSON{HostPort: &hostPort, ContainerPort: &cp, Protocol: proto, Mode: string(mode)}.mapping(def)
		if err != nil {
			return nil, fmt.Errorf("%q: %v", item, err)
		}
		out = append(out, m)
	}
	return out, nil
}

// spec is the allocator's spec for the mappings.
func (c *Config) spec() []portalloc.Port {
	var out []portalloc.Port
	for _, m := range c.Mappings {
		out = append(out, portalloc.Port{Mode: m.Mode, Name: fmt.Sprint(m.ContainerPort), Protocol: m.Protocol, Number: m.HostPort, HostIP: m.HostIP})
	}
	return out
}
