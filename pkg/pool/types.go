package pool

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"time"
)

// Range is one subnet of a pool with its optional allocatable sub-range and
// gateway. Start and End default to the first and last usable address of the
// subnet (the network address, and for IPv4 the broadcast address, are never
// handed out). A valid Gateway inside [Start, End] is never handed out either.
//
// A Static range (seed 001's BOSH static IPs) is handed out only to static
// requests (a Want with an Addr): dynamic allocation and claims never touch
// it. A definition recorded before the field existed has no static range.
type Range struct {
	Subnet  netip.Prefix `json:"subnet"`
	Start   netip.Addr   `json:"rangeStart,omitzero"`
	End     netip.Addr   `json:"rangeEnd,omitzero"`
	Gateway netip.Addr   `json:"gateway,omitzero"`
	Static  bool         `json:"static,omitempty"`
}

// Def defines a pool: one or more ranges of one address family, plus
// addresses or CIDRs that are never handed out. Every host that uses a pool
// must be given the same Def; the first user records it in the store.
//
// A store is one address space: a pool whose ranges overlap another
// recorded pool's is refused (*OverlapError), unless one of them is
// Isolated, an explicit opt-out for networks that are truly separate L2
// segments.
type Def struct {
	Name     string         `json:"name"`
	Ranges   []Range        `json:"ranges"`
	Exclude  []netip.Prefix `json:"exclude,omitempty"`
	Isolated bool           `json:"isolated,omitempty"`
}

// Kind is the front end an owner belongs to. Every listing, GC and CHECK is
// scoped to one kind, so one front end never touches another's owners even
// when their network names coincide.
type Kind string

const (
	KindCNI      Kind = "cni"     // the ipam-ring CNI plugin
	KindDocker   Kind = "docker"  // the Docker libnetwork IPAM driver
	KindPort     Kind = "port"    // the portmap-ingress plugin
	KindOperator Kind = "ringctl" // addresses an operator holds by hand
)

// Valid reports whether k is one of the known kinds.
func (k Kind) Valid() bool {
	switch k {
	case KindCNI, KindDocker, KindPort, KindOperator:
		return true
	}
	return false
}

// Owner identifies who holds an allocation: a front end (Kind) and, within
// it, (network, container ID, interface name), the uniqueness key of the
// CNI spec. The Docker driver uses (pool, endpoint MAC, "").
type Owner struct {
	Kind        Kind   `json:"kind"`
	Network     string `json:"network"`
	ContainerID string `json:"containerID"`
	IfName      string `json:"ifName,omitempty"`
}

// String renders the owner as kind/network/containerID/ifName, the form
// stored in address keys and reservation records (parseOwner inverts it).
func (o Owner) String() string {
	return string(o.Kind) + "/" + o.Network + "/" + o.ContainerID + "/" + o.IfName
}

// maxOwnerPart bounds each part of an owner (and a reservation name), so a
// key stays far below every backend's key size limit.
const maxOwnerPart = 253

// Validate rejects owners whose parts would break the store's key layout:
// an unknown kind, an empty network or container ID, a '/' (it would make
// one owner's keys a prefix of another's), control characters, or a part
// longer than 253 bytes.
func (o Owner) Validate() error {
	if !o.Kind.Valid() {
		return fmt.Errorf("%w: owner kind %q is not one of cni, docker, port, ringctl", ErrInvalid, o.Kind)
	}
	for _, part := range []struct{ name, v string }{{"network", o.Network}, {"container ID", o.ContainerID}} {
		if part.v == "" {
			return fmt.Errorf("%w: owner %s is empty", ErrInvalid, part.name)
		}
	}
	for _, v := range []string{o.Network, o.ContainerID, o.IfName} {
		if len(v) > maxOwnerPart {
			return fmt.Errorf("%w: owner part of %d bytes exceeds %d", ErrInvalid, len(v), maxOwnerPart)
		}
		if strings.ContainsRune(v, '/') || hasControl(v) {
			return fmt.Errorf("%w: owner part %q may not contain '/' or control characters", ErrInvalid, v)
		}
	}
	return nil
}

// hasControl reports whether s holds an ASCII control character (NUL,
// newline, ...) or DEL.
func hasControl(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < 0x20 || s[i] == 0x7f {
			return true
		}
	}
	return false
}

// Role names what an allocated address is for. An owner holds at most one
// address per (pool, role).
type Role string

const (
	RoleIP      Role = "ip" // the container's own address
	RoleGateway Role = "gw" // a per-container gateway (pkg/containernet)
)

// Want asks for one address from one pool. A valid Addr makes it a static
// request for exactly that address.
type Want struct {
	Pool string     `json:"pool"`
	Role Role       `json:"role"`
	Addr netip.Addr `json:"addr,omitzero"`
}

// Request is everything one owner asks for in one transaction (for example
// an IPv4 and an IPv6 address, or an address and its own gateway).
type Request struct {
	Owner Owner
	// Reservation is an optional stable name (a pod's namespace/name, a
	// Docker container name) under which the owner's addresses are
	// remembered, so that a recreated owner with the same name gets them
	// back. Names are scoped by the owner's kind and network. After a
	// release the addresses stay held for the name (see WithReservationHold).
	Reservation string
	Wants       []Want
	// Defs, when given, are the definitions of the wanted pools as this
	// host knows them: each is recorded on first use, or verified against
	// the recorded one (ErrDefinitionMismatch), inside the allocation's own
	// read and commit. It saves a caller the round trip of Define.
	Defs []Def
	// Pod is the Kubernetes pod the owner's sandbox belongs to (the CNI
	// arguments K8S_POD_NAMESPACE, K8S_POD_NAME, K8S_POD_UID), recorded
	// with a new allocation so that the host agent can tell an owner
	// whose pod vanished without a DEL; nil: none.
	Pod *PodRef
	// shared: a new record lists this host as its first holder (Share).
	shared bool
}

// Assigned is one address an owner holds.
type Assigned struct {
	Pool string     `json:"pool"`
	Role Role       `json:"role"`
	Addr netip.Addr `json:"addr"`
}

// Allocation is what an owner holds, and on which host it was allocated.
type Allocation struct {
	Owner       Owner      `json:"owner"`
	Host        string     `json:"host"`
	Reservation string     `json:"reservation,omitempty"`
	Addrs       []Assigned `json:"addrs"`
	// Holders lists, for an owner allocated with Share, every host whose
	// network reserves its addresses (Host among them: the one whose count
	// and ranges hold them). Empty for every other owner, and for shared
	// records written before Share existed: those are held by Host alone.
	Holders []string `json:"holders,omitempty"`
	// Pod is the Kubernetes pod of the owner (Request.Pod) and Since when
	// the record was first written (Unix seconds): both absent from
	// records written before they existed, and from owners that are no
	// pod's. The host agent's collection of vanished pods touches only
	// records that carry both.
	Pod   *PodRef `json:"pod,omitempty"`
	Since int64   `json:"since,omitempty"`
}

// PodRef names a Kubernetes pod: namespace, name and UID (empty when the
// runtime sent none). The owner's ContainerID is its sandbox's ID.
type PodRef struct {
	Namespace string `json:"ns"`
	Name      string `json:"name"`
	UID       string `json:"uid,omitempty"`
}

// holders is every host holding a: Holders, or Host when it is empty.
func (a Allocation) holders() []string {
	if len(a.Holders) == 0 {
		return []string{a.Host}
	}
	return a.Holders
}

// HeldBy reports whether host holds a (is its Host, or one of its Holders).
func (a Allocation) HeldBy(host string) bool {
	return a.Host == host || slices.Contains(a.Holders, host)
}

// Addr returns the address held for (pool, role), if any.
func (a Allocation) Addr(pool string, role Role) (netip.Addr, bool) {
	for _, x := range a.Addrs {
		if x.Pool == pool && x.Role == role {
			return x.Addr, true
		}
	}
	return netip.Addr{}, false
}

// Usage is how full a pool is.
type Usage struct {
	Pool     string
	Used     uint64
	Capacity string // decimal, may exceed uint64
	Free     bool   // at least one address left somewhere in the pool
	// Available is how many addresses are left (capacity minus used,
	// capped at the largest uint64). Addresses held for reservations are
	// not subtracted: it is an upper bound.
	Available uint64
	Hosts     []HostUsage
}

// HostUsage is one host's share of a pool.
type HostUsage struct {
	Host     string
	Used     uint64
	LastSeen time.Time // last allocation by the host in the pool; zero if unknown
}
