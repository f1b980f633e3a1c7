package etcdjson

import (
	"errors"
	"strings"

	"github.com/ringipam/ringipam/pkg/store"
)

// etcd's gRPC messages (api/etcdserverpb/rpc.proto and mvccpb/kv.proto),
// written and read by hand in protobuf's wire format for the few fields
// this package uses: TxnRequest, RangeRequest and AuthenticateRequest out;
// TxnResponse, RangeResponse and AuthenticateResponse in. Linking the
// generated code would link the protobuf runtime and its registries, which
// every plugin process would initialise (docs/benchmarks.md).

// Field numbers.
const (
	// TxnRequest
	txnCompare = 1
	txnSuccess = 2
	txnFailure = 3
	// Compare
	cmpTarget      = 2
	cmpKey         = 3
	cmpVersion     = 4
	cmpModRevision = 6
	cmpValue       = 7
	cmpRangeEnd    = 64
	// Compare.CompareTarget values (Compare.result is EQUAL, the default).
	targetMod   = 2
	targetValue = 3
	// RequestOp
	opRange  = 1
	opPut    = 2
	opDelete = 3
	// RangeRequest (key = 1 in Put and DeleteRange requests too)
	rangeKey      = 1
	rangeEnd      = 2
	rangeLimit    = 3
	rangeRevision = 4
	// PutRequest
	putValue = 2
	// AuthenticateRequest
	authName     = 1
	authPassword = 2
)

// Wire types.
const (
	wireVarint  = 0
	wireFixed64 = 1
	wireBytes   = 2
	wireFixed32 = 5
)

func appendVarint(b []byte, v uint64) []byte {
	for v >= 0x80 {
		b = append(b, byte(v)|0x80)
		v >>= 7
	}
	return append(b, byte(v))
}

func appendTag(b []byte, field, wire int) []byte { return appendVarint(b, uint64(field<<3|wire)) }

// appendInt appends a varint field, even when zero (a oneof member).
func appendInt(b []byte, field int, v int64) []byte {
	return appendVarint(appendTag(b, field, wireVarint), uint64(v))
}

// appendBytes appends a length-delimited field of the concatenation of
// parts, even when empty.
func appendBytes(b []byte, field int, parts ...string) []byte {
	n := 0
	for _, p := range parts {
		n += len(p)
	}
	b = appendVarint(appendTag(b, field, wireBytes), uint64(n))
	for _, p := range parts {
		b = append(b, p...)
	}
	return b
}

// appendNested appends a message field whose content build appends.
func appendNested(b []byte, field int, build func([]byte) []byte) []byte {
	b = append(appendTag(b, field, wireBytes), 0) // room for a length under 128
	start := len(b)
	b = build(b)
	n := len(b) - start
	if n < 0x80 {
		b[start-1] = byte(n)
		return b
	}
	length := appendVarint(nil, uint64(n))
	b = append(b, length[1:]...) // grow by the extra bytes of the length
	copy(b[start-1+len(length):], b[start:start+n])
	copy(b[start-1:], length)
	return b
}

// rangeProto appends a RangeRequest's fields: key at the prefix, up to end
// (none when ""), at most limit keys (0: all), at revision rev (0: the
// current one).
func (s *Store) rangeProto(b []byte, key, end string, limit int, rev int64) []byte {
	b = appendBytes(b, rangeKey, s.cfg.Prefix, key)
	if end != "" {
		b = appendBytes(b, rangeEnd, s.cfg.Prefix, end)
	}
	if limit > 0 {
		b = appendInt(b, rangeLimit, int64(limit))
	}
	if rev > 0 {
		b = appendInt(b, rangeRevision, rev)
	}
	return b
}

// appendRangeOp appends, as field branch of a TxnRequest, a RequestOp
// reading key at revision rev (0: the current one).
func (s *Store) appendRangeOp(b []byte, branch int, key string, rev int64) []byte {
	return appendNested(b, branch, func(b []byte) []byte {
		return appendNested(b, opRange, func(b []byte) []byte { return s.rangeProto(b, key, "", 0, rev) })
	})
}

// getProto is the TxnRequest reading keys at revision rev (0: the current
// one).
func (s *Store) getProto(keys []string, rev int64) []byte {
	var b []byte
	for _, k := range keys {
		b = s.appendRangeOp(b, txnSuccess, k, rev)
	}
	return b
}

// scanProto is the RangeRequest of [from, to) under the prefix.
func (s *Store) scanProto(from, to string, limit int, rev int64) []byte {
	return s.rangeProto(nil, from, to, limit, rev)
}

// txnProto is the TxnRequest of txnBody.
func (s *Store) txnProto(conds []store.Cond, same []store.KV, ops []store.Op, failureReads []string) []byte {
	var b []byte
	for _, c := range conds {
		b = appendNested(b, txnCompare, func(b []byte) []byte {
			if c.Revision == 0 {
				// target VERSION and result EQUAL are the zero values.
				b = appendInt(appendBytes(b, cmpKey, s.cfg.Prefix, c.Key), cmpVersion, 0)
				if c.IsRange() {
					b = appendBytes(b, cmpRangeEnd, s.cfg.Prefix, c.End)
				}
				return b
			}
			b = appendInt(b, cmpTarget, targetMod)
			return appendInt(appendBytes(b, cmpKey, s.cfg.Prefix, c.Key), cmpModRevision, c.Revision)
		})
	}
	for _, kv := range same {
		b = appendNested(b, txnCompare, func(b []byte) []byte {
			b = appendInt(b, cmpTarget, targetValue)
			return appendBytes(appendBytes(b, cmpKey, s.cfg.Prefix, kv.Key), cmpValue, string(kv.Value))
		})
	}
	for _, o := range ops {
		b = appendNested(b, txnSuccess, func(b []byte) []byte {
			if o.Delete {
				return appendNested(b, opDelete, func(b []byte) []byte { return appendBytes(b, rangeKey, s.cfg.Prefix, o.Key) })
			}
			return appendNested(b, opPut, func(b []byte) []byte {
				return appendBytes(appendBytes(b, rangeKey, s.cfg.Prefix, o.Key), putValue, string(o.Value))
			})
		})
	}
	for _, k := range failureReads {
		b = s.appendRangeOp(b, txnFailure, k, 0)
	}
	return b
}

// authProto is an AuthenticateRequest.
func authProto(name, password string) []byte {
	return appendBytes(appendBytes(nil, authName, name), authPassword, password)
}

var errProto = errors.New("malformed protobuf message")

// eachField calls f for each field of a message: v for varints, data for
// length-delimited fields (fixed-size fields are skipped). It stops at
// f's false and reports whether the message was well formed and f never
// returned false.
func eachField(b []byte, f func(field int, v uint64, data []byte) bool) bool {
	for len(b) > 0 {
		tag, n := readVarint(b)
		if n == 0 || tag>>3 == 0 {
			return false
		}
		b = b[n:]
		field := int(tag >> 3)
		switch tag & 7 {
		case wireVarint:
			v, n := readVarint(b)
			if n == 0 || !f(field, v, nil) {
				return false
			}
			b = b[n:]
		case wireBytes:
			l, n := readVarint(b)
			if n == 0 || l > uint64(len(b)-n) {
				return false
			}
			if !f(field, 0, b[n:n+int(l)]) {
				return false
			}
			b = b[n+int(l):]
		case wireFixed64:
			if len(b) < 8 {
				return false
			}
			b = b[8:]
		case wireFixed32:
			if len(b) < 4 {
				return false
			}
			b = b[4:]
		default: // groups: not in etcd's messages
			return false
		}
	}
	return true
}

// readVarint returns a varint and its length (0: malformed).
func readVarint(b []byte) (uint64, int) {
	var v uint64
	for i := 0; i < len(b) && i < 10; i++ {
		v |= uint64(b[i]&0x7f) << (7 * i)
		if b[i] < 0x80 {
			return v, i + 1
		}
	}
	return 0, 0
}

// headerRevision reads a ResponseHeader's revision (field 3).
func headerRevision(b []byte, rev *int64) bool {
	return eachField(b, func(field int, v uint64, _ []byte) bool {
		if field == 3 {
			*rev = int64(v)
		}
		return true
	})
}

// decodeRangeProto reads a RangeResponse.
func (s *Store) decodeRangeProto(b []byte) (rangeAnswer, error) {
	var a rangeAnswer
	ok := eachField(b, func(field int, v uint64, data []byte) bool {
		switch field {
		case 1:
			return data != nil && headerRevision(data, &a.revision)
		case 2: // KeyValue
			var kv store.KV
			ok := data != nil && eachField(data, func(field int, v uint64, data []byte) bool {
				switch field {
				case 1:
					kv.Key = strings.TrimPrefix(string(data), s.cfg.Prefix)
				case 3:
					kv.Revision = int64(v)
				case 5:
					kv.Value = data
				}
				return true
			})
			a.kvs = append(a.kvs, kv)
			return ok
		case 3:
			a.more = v != 0
		}
		return true
	})
	if !ok {
		return rangeAnswer{}, errProto
	}
	return a, nil
}

// decodeTxnProto reads a TxnResponse: each response a range read's
// answer, or nothing for a write's.
func (s *Store) decodeTxnProto(b []byte) (txnAnswer, error) {
	var a txnAnswer
	ok := eachField(b, func(field int, v uint64, data []byte) bool {
		switch field {
		case 1:
			return data != nil && headerRevision(data, &a.revision)
		case 2:
			a.succeeded = v != 0
		case 3: // ResponseOp
			var r rangeAnswer
			ok := data != nil && eachField(data, func(field int, _ uint64, data []byte) bool {
				if field != opRange {
					return true
				}
				var err error
				r, err = s.decodeRangeProto(data)
				return err == nil
			})
			a.reads = append(a.reads, r)
			return ok
		}
		return true
	})
	if !ok {
		return txnAnswer{}, errProto
	}
	return a, nil
}

// decodeAuthProto reads an AuthenticateResponse's token (field 2).
func decodeAuthProto(b []byte) (string, error) {
	var token string
	if !eachField(b, func(field int, _ uint64, data []byte) bool {
		if field == 2 {
			token = string(data)
		}
		return true
	}) {
		return "", errProto
	}
	return token, nil
}
