package portmap

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ringipam/ringipam/pkg/portalloc"
)

// Rule is one port forward: traffic to (HostIP or any local address,
// Protocol, HostPort) goes to ContainerIP:ContainerPort.
type Rule struct {
	Protocol      string
	HostPort      uint16
	HostIP        netip.Addr // invalid: every local address
	ContainerIP   netip.Addr
	ContainerPort uint16
}

func (r Rule) String() string {
	on := "*"
	if r.HostIP.IsValid() {
		on = r.HostIP.String()
	}
	return fmt.Sprintf("%s %s:%d -> %s", r.Protocol, on, r.HostPort, netip.AddrPortFrom(r.ContainerIP, r.ContainerPort))
}

// Dataplane programs the forwards of attachments. Every forward carries its
// attachment's mark (Mark), so Remove takes away exactly what Add added.
type Dataplane interface {
	// Add installs rules for the attachment marked mark.
	Add(ctx context.Context, mark string, rules []Rule) error
	// Remove deletes every forward marked mark; nothing there is success.
	Remove(ctx context.Context, mark string) error
	// Marks lists the forwards installed, by mark.
	Marks(ctx context.Context) (map[string][]Rule, error)
}

// maxMark keeps marks within nftables' 128-byte comments.
const maxMark = 120

// Mark is the attachment's mark on its forwards: its holder name
// (port/<network>/<container>/<if>) when that is short and plain, else
// "port/#<hash of the network>/<hash of the name>", so a mark is always a
// valid nftables and iptables comment and GC can still tell its network.
func Mark(id portalloc.EndpointID) string {
	s := id.String()
	if len(s) <= maxMark && plainMark(s) {
		return s
	}
	return portalloc.Kind + "/#" + shortHash(id.Network, 8) + "/" + shortHash(s, 32)
}

// markOfNetwork reports whether mark is an attachment of network.
func markOfNetwork(mark, network string) bool {
	if id, ok := portalloc.ParseEndpointID(mark); ok && !strings.HasPrefix(mark, portalloc.Kind+"/#") {
		return id.Network == network
	}
	return strings.HasPrefix(mark, portalloc.Kind+"/#"+shortHash(network, 8)+"/")
}

func shortHash(s string, n int) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:])[:n]
}

func plainMark(s string) bool {
	for _, r := range s {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("._:/-", r)) {
			return false
		}
	}
	return true
}

// ErrNoDataplane: neither nft nor iptables can be run on this host.
var ErrNoDataplane = errors.New("no packet filter tool (nft or iptables) found")

// NewDataplane returns the data path kind asks for ("auto": nftables when
// the nft command exists, else iptables).
func NewDataplane(kind, table string) (Dataplane, error) {
	if kind == DataplaneAuto || kind == "" {
		switch {
		case haveCommand("nft"):
			kind = DataplaneNFTables
		case haveCommand("iptables"):
			kind = DataplaneIPTables
		default:
			return nil, ErrNoDataplane
		}
	}
	if kind == DataplaneIPTables {
		return NewIPTables()
	}
	return NewNFT(table)
}

func haveCommand(name string) bool {
	_, err := exec.LookPath(name)
	return err == nil
}

// flushUDP drops the conntrack entries of newly published UDP ports: a
// client that sent to the port before the forward existed (or while it led
// elsewhere) would otherwise stay on its stale flow.
func flushUDP(rules []Rule) error {
	var errs []error
	done := map[[2]int]bool{}
	for _, r := range rules {
		fam := netlink.FAMILY_V4
		if r.ContainerIP.Is6() {
			fam = netlink.FAMILY_V6
		}
		if r.Protocol != "udp" || done[[2]int{fam, int(r.HostPort)}] {
			continue
		}
		done[[2]int{fam, int(r.HostPort)}] = true
		f := &netlink.ConntrackFilter{}
		if err := f.AddProtocol(unix.IPPROTO_UDP); err != nil {
			return err
		}
		if err := f.AddPort(netlink.ConntrackOrigDstPort, r.HostPort); err != nil {
			return err
		}
		if _, err := netlink.ConntrackDeleteFilters(netlink.ConntrackTable, netlink.InetFamily(fam), f); err != nil {
			errs = append(errs, fmt.Errorf("flushing conntrack of udp/%d: %w", r.HostPort, err))
		}
	}
	return errors.Join(errs...)
}

// enableRouteLocalnet lets traffic to 127.0.0.1 be DNATed out through the
// host-side interfaces of the attachment (the bridge), as the reference
// portmap does.
func enableRouteLocalnet(ifnames []string) error {
	var errs []error
	for _, name := range ifnames {
		if name == "" || strings.ContainsAny(name, "/.") || name == "." {
			continue
		}
		p := filepath.Join("/proc/sys/net/ipv4/conf", name, "route_localnet")
		if _, err := os.Stat(p); err != nil {
			continue
		}
		if err := os.WriteFile(p, []byte("1"), 0o644); err != nil {
			errs = append(errs, fmt.Errorf("route_localnet on %s: %w", name, err))
		}
	}
	return errors.Join(errs...)
}
