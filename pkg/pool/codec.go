package pool

import (
	"encoding/json"
	"net/netip"

	"github.com/ringipam/ringipam/internal/jsonscan"
)

// The records that every allocation and release reads and writes (a
// host's state in a pool, the ring, the owner's allocation, the pool's
// definition, the history event) are encoded and decoded here without
// encoding/json's reflection, whose first use of each type costs a
// one-call plugin process more than the record itself (docs/benchmarks.md).
// The bytes and values are encoding/json's: each function falls back to it
// for anything the fast path does not handle exactly alike (package
// jsonscan), and codec_test.go compares the two on random records.

// fastCodec is turned off by tests to compare with encoding/json alone.
var fastCodec = true

// unmarshal decodes b into *v like json.Unmarshal (fields absent from b
// keep their values), with fast when it can: fast works on a copy of *v,
// kept only when it succeeds.
func unmarshal[T any](b []byte, v *T, fast func(jsonscan.Value, *T) bool) error {
	if fastCodec {
		if val, ok := jsonscan.Parse(b); ok {
			tmp := *v
			if fast(val, &tmp) {
				*v = tmp
				return nil
			}
		}
	}
	return json.Unmarshal(b, v)
}

// marshal is json.Marshal(v), written by fast when it can.
func marshal[T any](v T, fast func(*jsonscan.Writer, T)) ([]byte, error) {
	if fastCodec {
		var w jsonscan.Writer
		fast(&w, v)
		if b, ok := w.Bytes(); ok {
			return b, nil
		}
	}
	return json.Marshal(v)
}

// textValue decodes a JSON string into an encoding.TextUnmarshaler, as
// encoding/json does (the string's contents passed to UnmarshalText).
func textValue(val jsonscan.Value, dst interface{ UnmarshalText([]byte) error }) bool {
	s, ok := val.String()
	return ok && dst.UnmarshalText([]byte(s)) == nil
}

// decodeList decodes a JSON array into a new slice, one element each by
// elem, as encoding/json decodes into a nil slice (an empty array gives an
// empty, non-nil slice). A slice already filled is refused: encoding/json
// would decode into the elements there.
func decodeList[T any](val jsonscan.Value, dst *[]T, elem func(jsonscan.Value, *T) bool) bool {
	if *dst != nil {
		return false
	}
	out := []T{}
	ok := val.Array(func(e jsonscan.Value) bool {
		out = append(out, *new(T))
		return elem(e, &out[len(out)-1])
	})
	*dst = out
	return ok
}

// writeText writes an encoding.TextMarshaler as encoding/json does.
func writeText(w *jsonscan.Writer, v interface{ MarshalText() ([]byte, error) }) {
	b, err := v.MarshalText()
	if err != nil {
		w.Refuse() // encoding/json reports the error
		return
	}
	w.String(string(b))
}

// --- hostState

var hostStateKeys = []string{"c", "u", "n", "r", "s"}

func decodeHostState(b []byte, h *hostState) error {
	return unmarshal(b, h, func(v jsonscan.Value, h *hostState) bool {
		return v.Members(hostStateKeys, false, func(key string, val jsonscan.Value) bool {
			var ok bool
			switch key {
			case "c":
				ok = textValue(val, &h.Cursor)
			case "u":
				h.Used, ok = val.Uint(64)
			case "n":
				ok = textValue(val, &h.Next)
			case "r":
				h.Run, ok = val.Uint(64)
			case "s":
				h.Seen, ok = val.Int(64)
			}
			return ok
		})
	})
}

func encodeHostState(h hostState) []byte {
	b, _ := marshal(h, func(w *jsonscan.Writer, h hostState) {
		w.Raw("{")
		if h.Cursor != (netip.Addr{}) {
			w.Raw(`"c":`)
			writeText(w, h.Cursor)
			w.Raw(",")
		}
		w.Raw(`"u":`)
		w.Uint(h.Used)
		if h.Next != (netip.Addr{}) {
			w.Raw(`,"n":`)
			writeText(w, h.Next)
		}
		if h.Run != 0 {
			w.Raw(`,"r":`)
			w.Uint(h.Run)
		}
		if h.Seen != 0 {
			w.Raw(`,"s":`)
			w.Int(h.Seen)
		}
		w.Raw("}")
	})
	return b
}

// --- the ring's tokens

var tokenKeys = []string{"s", "h", "t"}

func decodeTokens(b []byte, tokens *[]token) error {
	return unmarshal(b, tokens, func(v jsonscan.Value, tokens *[]token) bool {
		return decodeList(v, tokens, func(e jsonscan.Value, p *token) bool {
			return e.Members(tokenKeys, false, func(key string, val jsonscan.Value) bool {
				var ok bool
				switch key {
				case "s":
					ok = textValue(val, &p.Start)
				case "h":
					p.Host, ok = val.String()
				case "t":
					p.Tomb, ok = val.Bool()
				}
				return ok
			})
		})
	})
}

func encodeTokens(tokens []token) []byte {
	b, _ := marshal(tokens, func(w *jsonscan.Writer, tokens []token) {
		if tokens == nil {
			w.Raw("null")
			return
		}
		w.Raw("[")
		for i, t := range tokens {
			if i > 0 {
				w.Raw(",")
			}
			w.Raw(`{"s":`)
			writeText(w, t.Start)
			if t.Host != "" {
				w.Raw(`,"h":`)
				w.String(t.Host)
			}
			if t.Tomb {
				w.Raw(`,"t":true`)
			}
			w.Raw("}")
		}
		w.Raw("]")
	})
	return b
}

// --- Allocation

var (
	allocationKeys = []string{"owner", "host", "reservation", "addrs", "holders"}
	ownerKeys      = []string{"kind", "network", "containerID", "ifName"}
	assignedKeys   = []string{"pool", "role", "addr"}
)

func decodeAllocation(b []byte, a *Allocation) error {
	return unmarshal(b, a, func(v jsonscan.Value, a *Allocation) bool {
		return v.Members(allocationKeys, false, func(key string, val jsonscan.Value) bool {
			var ok bool
			switch key {
			case "owner":
				o := &a.Owner
				ok = val.Members(ownerKeys, false, func(key string, val jsonscan.Value) bool {
					var s string
					var ok bool
					s, ok = val.String()
					switch key {
					case "kind":
						o.Kind = Kind(s)
					case "network":
						o.Network = s
					case "containerID":
						o.ContainerID = s
					case "ifName":
						o.IfName = s
					}
					return ok
				})
			case "host":
				a.Host, ok = val.String()
			case "reservation":
				a.Reservation, ok = val.String()
			case "holders":
				ok = decodeList(val, &a.Holders, func(e jsonscan.Value, h *string) bool {
					var ok bool
					*h, ok = e.String()
					return ok
				})
			case "addrs":
				ok = decodeList(val, &a.Addrs, func(e jsonscan.Value, x *Assigned) bool {
					return e.Members(assignedKeys, false, func(key string, val jsonscan.Value) bool {
						var ok bool
						switch key {
						case "pool":
							x.Pool, ok = val.String()
						case "role":
							var s string
							s, ok = val.String()
							x.Role = Role(s)
						case "addr":
							ok = textValue(val, &x.Addr)
						}
						return ok
					})
				})
			}
			return ok
		})
	})
}

func encodeAllocation(a Allocation) ([]byte, error) {
	return marshal(a, func(w *jsonscan.Writer, a Allocation) {
		w.Raw(`{"owner":{"kind":`)
		w.String(string(a.Owner.Kind))
		w.Raw(`,"network":`)
		w.String(a.Owner.Network)
		w.Raw(`,"containerID":`)
		w.String(a.Owner.ContainerID)
		if a.Owner.IfName != "" {
			w.Raw(`,"ifName":`)
			w.String(a.Owner.IfName)
		}
		w.Raw(`},"host":`)
		w.String(a.Host)
		if a.Reservation != "" {
			w.Raw(`,"reservation":`)
			w.String(a.Reservation)
		}
		w.Raw(`,"addrs":`)
		defer writeHolders(w, a.Holders)
		if a.Addrs == nil {
			w.Raw("null")
			return
		}
		w.Raw("[")
		for i, x := range a.Addrs {
			if i > 0 {
				w.Raw(",")
			}
			w.Raw(`{"pool":`)
			w.String(x.Pool)
			w.Raw(`,"role":`)
			w.String(string(x.Role))
			w.Raw(`,"addr":`)
			writeText(w, x.Addr)
			w.Raw("}")
		}
		w.Raw("]")
	})
}

// writeHolders ends an allocation: its holders, if any, and the brace.
func writeHolders(w *jsonscan.Writer, holders []string) {
	if len(holders) > 0 {
		w.Raw(`,"holders":[`)
		for i, h := range holders {
			if i > 0 {
				w.Raw(",")
			}
			w.String(h)
		}
		w.Raw("]")
	}
	w.Raw("}")
}

// --- Def

var (
	defKeys   = []string{"name", "ranges", "exclude", "isolated"}
	rangeKeys = []string{"subnet", "rangeStart", "rangeEnd", "gateway", "static"}
)

func decodeDefJSON(b []byte, d *Def) error {
	return unmarshal(b, d, func(v jsonscan.Value, d *Def) bool {
		return v.Members(defKeys, false, func(key string, val jsonscan.Value) bool {
			var ok bool
			switch key {
			case "name":
				d.Name, ok = val.String()
			case "ranges":
				ok = decodeList(val, &d.Ranges, func(e jsonscan.Value, r *Range) bool {
					return e.Members(rangeKeys, false, func(key string, val jsonscan.Value) bool {
						switch key {
						case "subnet":
							return textValue(val, &r.Subnet)
						case "rangeStart":
							return textValue(val, &r.Start)
						case "rangeEnd":
							return textValue(val, &r.End)
						case "static":
							var ok bool
							r.Static, ok = val.Bool()
							return ok
						default:
							return textValue(val, &r.Gateway)
						}
					})
				})
			case "exclude":
				ok = decodeList(val, &d.Exclude, func(e jsonscan.Value, p *netip.Prefix) bool { return textValue(e, p) })
			case "isolated":
				d.Isolated, ok = val.Bool()
			}
			return ok
		})
	})
}

// RangesJSON returns json.Marshal(rs), the bytes a pool definition's
// ranges are hashed from (ipam-ring names its pools by that hash).
func RangesJSON(rs []Range) []byte {
	b, _ := marshal(rs, writeRanges)
	return b
}

func writeRanges(w *jsonscan.Writer, rs []Range) {
	if rs == nil {
		w.Raw("null")
		return
	}
	w.Raw("[")
	for i, r := range rs {
		if i > 0 {
			w.Raw(",")
		}
		w.Raw(`{"subnet":`)
		writeText(w, r.Subnet)
		for _, f := range []struct {
			key  string
			addr netip.Addr
		}{{`,"rangeStart":`, r.Start}, {`,"rangeEnd":`, r.End}, {`,"gateway":`, r.Gateway}} {
			if f.addr != (netip.Addr{}) {
				w.Raw(f.key)
				writeText(w, f.addr)
			}
		}
		if r.Static {
			w.Raw(`,"static":true`)
		}
		w.Raw("}")
	}
	w.Raw("]")
}

// --- Event

func encodeEvent(ev Event) []byte {
	b, _ := marshal(ev, func(w *jsonscan.Writer, ev Event) {
		t, err := ev.Time.MarshalJSON()
		if err != nil {
			w.Refuse() // encoding/json reports the error
			return
		}
		w.Raw(`{"t":`)
		w.Raw(string(t))
		w.Raw(`,"e":`)
		w.String(ev.What)
		w.Raw(`,"o":`)
		w.String(ev.Owner)
		w.Raw(`,"h":`)
		w.String(ev.Host)
		if ev.Reserv != "" {
			w.Raw(`,"r":`)
			w.String(ev.Reserv)
		}
		w.Raw("}")
	})
	return b
}
