package pool

import (
	"encoding/hex"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
	"time"

	"github.com/ringipam/ringipam/pkg/store"
)

// Keys of the store layout (see the package doc). Every key a pool writes is
// built here, so no other file spells a prefix.
const (
	layoutKey   = "v"       // the layout version (layoutVersion)
	registryKey = "x/pools" // every recorded pool's ranges: one address space

	prefixDef        = "d/" // d/<pool>: definition
	prefixRing       = "g/" // g/<pool>/<hex last address>: one range of the ring (ranges.go)
	prefixHost       = "h/" // h/<pool>/<host>: a host's state in a pool
	prefixAddr       = "a/" // a/<pool>/<hex>: an address is taken
	prefixOwner      = "o/" // o/<kind>/<network>/<ctr>/<if>: an owner's allocation
	prefixHostOwner  = "i/" // i/<host>/<kind>/<network>/<ctr>/<if>: the host's owners (index)
	prefixResv       = "r/" // r/<kind>/<network>/<name>: a reservation
	prefixHistory    = "y/" // y/<pool>/<hex>/<hex ns>: one event of an address
	prefixLive       = "l/" // l/<host>: the host's agent holds a lease
	prefixHostRecord = "n/" // n/<host>: the host record (watched: written only when it changes)
	prefixStatus     = "s/" // s/<host>: the host's status (last seen, routes summary; never watched)
	prefixElection   = "e/" // e/...: the agents' election of their leader (etcd concurrency)
)

// Prefixes of keys a watcher outside the package follows: RingKeyPrefix
// holds every pool's range keys (claims, donations, tombstones change
// them; DecodeRingKeys reads them), and layout 3's one ring key per pool
// (g/<pool>, a marker since layout 4: RangeKeyPool tells them apart),
// HostRecordKeyPrefix every host record (its address).
const (
	RingKeyPrefix       = prefixRing
	HostRecordKeyPrefix = prefixHostRecord
)

// ElectionKeyPrefix is the prefix of the host agents' election of the one
// agent that sweeps, compacts the history and computes pool-wide figures
// (go.etcd.io/etcd/client/v3/concurrency's Election; cmd/ringipamd). pool
// never reads it.
const ElectionKeyPrefix = prefixElection

func defKey(pool string) string        { return prefixDef + pool }
func hostKey(pool, host string) string { return prefixHost + pool + "/" + host }
func hostPrefix(pool string) string    { return prefixHost + pool + "/" }
func addrPrefix(pool string) string    { return prefixAddr + pool + "/" }
func ownerKey(o Owner) string          { return ownerKeyOf(o.String()) }

// ownerKeyOf is the key of the owner whose Owner.String is s.
func ownerKeyOf(s string) string { return prefixOwner + s }

// hostOwnerKey is the index key saying that host holds owner's record. It
// exists exactly while o/<owner> does with that host, and is written in the
// same commits, so a host finds its own owners without reading anyone
// else's (GC, reclaim). Its value is empty.
func hostOwnerKey(host string, o Owner) string { return hostOwnersPrefix(host, "", "") + o.String() }

// hostOwnersPrefix is the prefix of host's index keys of owners of kind on
// network; an empty network means every network of the kind, an empty kind
// every owner of the host.
func hostOwnersPrefix(host string, kind Kind, network string) string {
	return prefixHostOwner + host + "/" + strings.TrimPrefix(ownersPrefix(kind, network), prefixOwner)
}

// LivenessKey is the key whose presence says host is up. The host agent
// writes it with a lease (see cmd/ringipamd); pool only reads it.
func LivenessKey(host string) string { return prefixLive + host }

func hostRecordKey(host string) string { return prefixHostRecord + host }

// statusKey is host's status record (hostStatus): what changes on a timer
// (last seen) or with the host's routes, kept out of the watched host
// record.
func statusKey(host string) string { return prefixStatus + host }

// parseHostKey is the inverse of hostKey (pool and host names hold no '/').
func parseHostKey(key string) (pool, host string) {
	pool, host, _ = strings.Cut(strings.TrimPrefix(key, prefixHost), "/")
	return pool, host
}

func historyPrefix(pool string, v u128, is4 bool) string {
	return prefixHistory + pool + "/" + hexOf(v, is4) + "/"
}

// ownersPrefix is the key prefix of every owner of kind on network; an empty
// network means every network of the kind, an empty kind every owner.
func ownersPrefix(kind Kind, network string) string {
	switch {
	case kind == "":
		return prefixOwner
	case network == "":
		return prefixOwner + string(kind) + "/"
	}
	return prefixOwner + string(kind) + "/" + network + "/"
}

// resvKey is the reservation record of name for owners of kind on network.
func resvKey(kind Kind, network, name string) string {
	return prefixResv + string(kind) + "/" + network + "/" + name
}

// addrKey encodes an address so that keys sort in address order.
func addrKey(pool string, v u128, is4 bool) string {
	return addrPrefix(pool) + hexOf(v, is4)
}

// addrKeysEnd is the end of the key range holding exactly the address
// keys of pool from some address up to hi inclusive: the least string
// after hi's key (address keys of one pool all have one length, so none
// lies between).
func addrKeysEnd(pool string, hi u128, is4 bool) string {
	return addrKey(pool, hi, is4) + "\x00"
}

// noAddrIn is the condition that no address of s is held in pool (no
// address key in [addrKey(lo), addrKeysEnd(hi))).
func noAddrIn(pool string, is4 bool, s span) store.Cond {
	return store.AbsentRange(addrKey(pool, s.lo, is4), addrKeysEnd(pool, s.hi, is4))
}

func hexOf(v u128, is4 bool) string {
	a := v.addr(is4)
	if is4 {
		b := a.As4()
		return hex.EncodeToString(b[:])
	}
	b := a.As16()
	return hex.EncodeToString(b[:])
}

// parseAddrKey decodes the address of an a/ key.
func parseAddrKey(key string) (u128, bool) {
	i := strings.LastIndexByte(key, '/')
	b, err := hex.DecodeString(key[i+1:])
	if err != nil {
		return u128{}, false
	}
	a, ok := netip.AddrFromSlice(b)
	if !ok {
		return u128{}, false
	}
	return toU128(a), true
}

// parseOwner is the inverse of Owner.String.
func parseOwner(s string) (Owner, bool) {
	parts := strings.Split(s, "/")
	if len(parts) != 4 {
		return Owner{}, false
	}
	return Owner{Kind: Kind(parts[0]), Network: parts[1], ContainerID: parts[2], IfName: parts[3]}, true
}

// holder is what an a/ key stores: the host in whose ranges the address is
// held, and either the owning Owner (as Owner.String) or, for an address
// kept for a released reservation, the reservation and when the hold ends.
//
// Encoded as "<host> <owner>" or "<host> ~<unix seconds> <kind>/<network>/<name>";
// an owner string starts with its kind, never with '~'.
type holder struct {
	Host  string
	Owner string // set for an owner's address
	// A hold: the reservation (kind, network, name) and its end.
	HoldKind    Kind
	HoldNetwork string
	HoldName    string
	Until       time.Time
}

func ownerHolder(host string, o Owner) holder { return holder{Host: host, Owner: o.String()} }

func holdHolder(host string, kind Kind, network, name string, until time.Time) holder {
	return holder{Host: host, HoldKind: kind, HoldNetwork: network, HoldName: name, Until: until}
}

// IsHold reports whether the address is kept for a released reservation.
func (h holder) IsHold() bool { return h.HoldName != "" }

// expired reports whether a hold has ended at now.
func (h holder) expired(now time.Time) bool { return h.IsHold() && !now.Before(h.Until) }

// heldFor reports whether h is a hold of reservation name of (kind, network).
func (h holder) heldFor(kind Kind, network, name string) bool {
	return h.IsHold() && h.HoldKind == kind && h.HoldNetwork == network && h.HoldName == name
}

func (h holder) encode() []byte {
	if h.IsHold() {
		return []byte(h.Host + " ~" + strconv.FormatInt(h.Until.Unix(), 10) + " " +
			string(h.HoldKind) + "/" + h.HoldNetwork + "/" + h.HoldName)
	}
	return []byte(h.Host + " " + h.Owner)
}

// describe names who holds the address, for errors and listings.
func (h holder) describe() string {
	if h.IsHold() {
		return fmt.Sprintf("reservation %s (%s network %s), held until %s", h.HoldName, h.HoldKind, h.HoldNetwork, h.Until.UTC().Format(time.RFC3339))
	}
	return h.Owner
}

func parseHolder(v []byte) holder {
	s := string(v)
	host, rest, _ := strings.Cut(s, " ")
	if !strings.HasPrefix(rest, "~") {
		return holder{Host: host, Owner: rest}
	}
	until, name, _ := strings.Cut(rest[1:], " ")
	secs, _ := strconv.ParseInt(until, 10, 64)
	kind, rest2, _ := strings.Cut(name, "/")
	network, resv, _ := strings.Cut(rest2, "/")
	if resv == "" {
		resv = "?" // malformed; still a hold, never free
	}
	return holder{Host: host, HoldKind: Kind(kind), HoldNetwork: network, HoldName: resv, Until: time.Unix(secs, 0)}
}
