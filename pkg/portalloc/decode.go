package portalloc

import (
	"strings"

	"github.com/ringipam/ringipam/pkg/store"
)

// Decoders of raw stored values, for a reader that keeps its own copy of
// the published ports (the host agent's watch cache, package watchcache).
// Keys are relative to the store's prefix, as store.KV gives them.

// PublishedKeyPrefix holds one key per published address (p/a/<proto>/<port>):
// what List returns, one DecodePublished each.
const PublishedKeyPrefix = prefixAddr

// DecodePublished decodes one key under PublishedKeyPrefix and its value
// into what List returns for it; ok is false for a key that names no
// address (List skips those too).
func DecodePublished(key string, value []byte) (p Published, ok bool, err error) {
	if !strings.HasPrefix(key, prefixAddr) {
		return Published{}, false, nil
	}
	// List's own decoding: the ingress holder and old-format host users,
	// the marker of per-host bindings (p/h/) left out.
	// (Revision 1: the value exists; decodeAddress reads no revision.)
	return decodeAddress(store.KV{Key: key, Value: value, Revision: 1})
}

// HostIndexPrefix is the prefix of host's index of its endpoints
// (p/i/<host>/): one key per endpoint recorded on host, present exactly
// while its record exists and names host.
func HostIndexPrefix(host string) string { return hostIndexPrefix(host, "") }

// DecodeHostIndexKey reads the host and endpoint a key under
// HostIndexPrefix names.
func DecodeHostIndexKey(key string) (host string, id EndpointID, ok bool) {
	return parseHostIndexKey(key)
}
