// Package portmap is the portmap-ingress CNI plugin: a chained plugin that
// publishes a container's ports, unique per host (host mode) or across the
// cluster (ingress mode), through pkg/portalloc, and programs the host's
// packet filter (one nftables table of its own) to reach them.
//
// Contract: ADD allocates every requested port in one store transaction and
// then installs the rules; if the rules fail, the ports are released again.
// DEL releases what the attachment holds (its record says what, so DEL
// needs no portMappings) and removes exactly the rules ADD added; it
// succeeds when there is nothing left. CHECK verifies the allocation and the
// rules. GC removes rules and allocations of attachments that are gone, on
// this host only. Errors map to CNI codes at the edge (errors.go).
package portmap

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"

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

// Config is the validated configuration of one invocation.
type Config struct {
	CNIVersion string
	Network    string
	Host       string
	Mode       portalloc.Mode // the default mode of mappings
	Lo, Hi     uint16
	Timeout    time.Duration
	Table      string
	Store      storeconfig.Config
	Mappings   []Mapping
	PrevResult *current.Result
	Valid      []types.GCAttachment
	HasValid   bool
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

// Load parses and validates stdin and CNI_ARGS.
func Load(stdin []byte, cniArgs string) (*Config, error) {
	var n netJSON
	if err := json.Unmarshal(stdin, &n); err != nil {
		return nil, badConfig("cannot parse network configuration: %v", err)
	}
	if n.Name == "" {
		return nil, badConfig("the network has no name")
	}
	c := &Config{CNIVersion: n.CNIVersion, Network: n.Name, Host: n.Host, Mode: portalloc.Host,
		Lo: portalloc.DefaultLo, Hi: portalloc.DefaultHi, Timeout: 30 * time.Second, Table: DefaultTable}
	if strings.ContainsRune(c.Network, '/') {
		return nil, badConfig("network name %q may not contain '/'", c.Network)
	}
	switch portalloc.Mode(n.Mode) {
	case "":
	case portalloc.Host, portalloc.Ingress:
		c.Mode = portalloc.Mode(n.Mode)
	default:
		return nil, badConfig("mode %q: want host or ingress", n.Mode)
	}
	if c.Host == "" {
		h, err := os.Hostname()
		if err != nil || h == "" {
			return nil, badConfig("no \"host\" given and the hostname is unknown")
		}
		c.Host = h
	}
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
		c.Table = n.Table
	}
	if len(n.Store) > 0 && string(n.Store) != "null" {
		s, err := storeconfig.Parse(n.Store)
		if err != nil {
			return nil, badConfig("store: %v", err)
		}
		c.Store = s
	}
	for i, m := range n.RuntimeConfig.PortMappings {
		mp, err := m.mapping(c.Mode)
		if err != nil {
			return nil, badConfig("portMappings[%d]: %v", i, err)
		}
		c.Mappings = append(c.Mappings, mp)
	}
	if s := n.RuntimeConfig.Annotations[PublishAnnotation]; s != "" {
		ms, err := parsePublish(s, c.Mode)
		if err != nil {
			return nil, badConfig("annotation %s: %v", PublishAnnotation, err)
		}
		c.Mappings = append(c.Mappings, ms...)
	}
	for _, kv := range strings.Split(cniArgs, ";") {
		k, v, _ := strings.Cut(kv, "=")
		if k == "PUBLISH" && v != "" {
			ms, err := parsePublish(v, c.Mode)
			if err != nil {
				return nil, badConfig("CNI_ARGS PUBLISH: %v", err)
			}
			c.Mappings = append(c.Mappings, ms...)
		}
	}
	if n.RawPrevResult != nil {
		b, _ := json.Marshal(n.RawPrevResult)
		r, err := current.NewResult(b)
		if err != nil {
			return nil, badConfig("prevResult: %v", err)
		}
		if c.PrevResult, err = current.GetResult(r); err != nil {
			return nil, badConfig("prevResult: %v", err)
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
