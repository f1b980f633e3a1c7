package pool

import "encoding/json"

// The records that every allocation and release reads and writes (a
// host's state in a pool, the ring, the owner's allocation, the pool's
// definition, the history event) are encoding/json's encoding of their
// types; these are the one place that encodes and decodes them.

func decodeHostState(b []byte, h *hostState) error { return json.Unmarshal(b, h) }

func encodeHostState(h hostState) []byte {
	b, _ := json.Marshal(h) // cannot fail: addresses and numbers
	return b
}

func decodeTokens(b []byte, tokens *[]token) error { return json.Unmarshal(b, tokens) }

func encodeTokens(tokens []token) []byte {
	b, _ := json.Marshal(tokens) // cannot fail: addresses and strings
	return b
}

func decodeAllocation(b []byte, a *Allocation) error { return json.Unmarshal(b, a) }

func encodeAllocation(a Allocation) ([]byte, error) { return json.Marshal(a) }

func decodeDefJSON(b []byte, d *Def) error { return json.Unmarshal(b, d) }

// RangesJSON returns json.Marshal(rs), the bytes a pool definition's
// ranges are hashed from (ipam-ring names its pools by that hash).
func RangesJSON(rs []Range) []byte {
	b, _ := json.Marshal(rs) // cannot fail: prefixes, addresses, bools
	return b
}

func encodeEvent(ev Event) []byte {
	b, _ := json.Marshal(ev) // a time outside years 0-9999 cannot be encoded
	return b
}
