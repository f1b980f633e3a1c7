package pool

import (
	"encoding/hex"
	"net/netip"
	"strings"
)

func defKey(pool string) string        { return "d/" + pool }
func ringKey(pool string) string       { return "g/" + pool }
func hostKey(pool, host string) string { return "h/" + pool + "/" + host }
func hostPrefix(pool string) string    { return "h/" + pool + "/" }
func addrPrefix(pool string) string    { return "a/" + pool + "/" }
func ownerKey(o Owner) string          { return "o/" + o.Network + "/" + o.ContainerID + "/" + o.IfName }
func ownerPrefix(network string) string {
	if network == "" {
		return "o/"
	}
	return "o/" + network + "/"
}
func resvKey(network, name string) string { return "r/" + network + "/" + name }

// addrKey encodes an address so that keys sort in address order.
func addrKey(pool string, v u128, is4 bool) string {
	return addrPrefix(pool) + hexOf(v, is4)
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

// holderValue is what an a/ key stores: the host and the owner.
func holderValue(host string, o Owner) []byte { return []byte(host + " " + o.String()) }

func parseHolder(v []byte) (host, owner string) {
	s := string(v)
	if i := strings.IndexByte(s, ' '); i >= 0 {
		return s[:i], s[i+1:]
	}
	return "", s
}
