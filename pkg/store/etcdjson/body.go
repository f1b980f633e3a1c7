package etcdjson

import (
	"encoding/base64"
	"encoding/json"
	"strconv"

	"github.com/ringipam/ringipam/internal/jsonscan"
	"github.com/ringipam/ringipam/pkg/store"
)

// The gateway's requests are written and its answers read here without
// encoding/json's reflection: a plugin process makes one or two requests
// in its life, and building encoding/json's type caches for them cost more
// than the requests' own encoding (see DESIGN-NOTES, "Hot-path JSON
// without reflection"). Requests hold only base64 strings, decimal
// strings and fixed names, which need no escaping; answers that this
// reader does not take exactly as encoding/json would are decoded by
// encoding/json.

// body is an encoded request; call sends it as it is.
type body []byte

// appendB64 appends raw's base64 encoding as a JSON string.
func appendB64(b []byte, raw []byte) []byte {
	b = append(b, '"')
	b = base64.StdEncoding.AppendEncode(b, raw)
	return append(b, '"')
}

// appendList appends "name": followed by the items built by item, or null
// when there are none (as encoding/json writes a nil slice).
func appendList(b []byte, name string, n int, item func(b []byte, i int) []byte) []byte {
	b = append(b, '"')
	b = append(b, name...)
	b = append(b, `":`...)
	if n == 0 {
		return append(b, "null"...)
	}
	b = append(b, '[')
	for i := range n {
		if i > 0 {
			b = append(b, ',')
		}
		b = item(b, i)
	}
	return append(b, ']')
}

// appendRange appends a transaction's range read of key, at revision rev
// when it is not "".
func (s *Store) appendRange(b []byte, key, rev string) []byte {
	b = append(b, `{"request_range":{"key":`...)
	b = appendB64(b, []byte(s.cfg.Prefix+key))
	if rev != "" {
		b = append(b, `,"revision":"`...)
		b = append(b, rev...)
		b = append(b, '"')
	}
	return append(b, "}}"...)
}

// getBody is a transaction reading keys at revision rev ("" for the
// current one).
func (s *Store) getBody(keys []string, rev string) body {
	b := []byte{'{'}
	b = appendList(b, "success", len(keys), func(b []byte, i int) []byte { return s.appendRange(b, keys[i], rev) })
	return append(b, '}')
}

// scanBody is a range read of [key, end), at most limit keys, at revision
// rev ("" for the current one).
func (s *Store) scanBody(key, end string, limit int, rev string) body {
	b := []byte(`{"key":`)
	b = appendB64(b, []byte(key))
	b = append(b, `,"limit":`...)
	b = strconv.AppendInt(b, int64(limit), 10)
	b = append(b, `,"range_end":`...)
	b = appendB64(b, []byte(end))
	if rev != "" {
		b = append(b, `,"revision":"`...)
		b = append(b, rev...)
		b = append(b, '"')
	}
	return append(b, '}')
}

// txnBody is a transaction: conditions on revisions (0: absent) and on
// ranges holding no key (version 0 over [key, range_end)), then on values
// (etcd fails a value comparison on an absent key, as store.Speculator
// asks); the writes of ops when they hold; range reads of failureReads
// when they do not.
func (s *Store) txnBody(conds []store.Cond, same []store.KV, ops []store.Op, failureReads []string) body {
	b := []byte{'{'}
	b = appendList(b, "compare", len(conds)+len(same), func(b []byte, i int) []byte {
		if i >= len(conds) {
			kv := same[i-len(conds)]
			b = append(b, `{"key":`...)
			b = appendB64(b, []byte(s.cfg.Prefix+kv.Key))
			b = append(b, `,"result":"EQUAL","target":"VALUE","value":`...)
			b = appendB64(b, kv.Value)
			return append(b, '}')
		}
		c := conds[i]
		b = append(b, `{"key":`...)
		b = appendB64(b, []byte(s.cfg.Prefix+c.Key))
		if c.IsRange() {
			// Every key of [key, range_end) must have version 0: none
			// may exist (an empty range passes).
			b = append(b, `,"range_end":`...)
			b = appendB64(b, []byte(s.cfg.Prefix+c.End))
		}
		if c.Revision == 0 {
			return append(b, `,"result":"EQUAL","target":"VERSION","version":"0"}`...)
		}
		b = append(b, `,"mod_revision":"`...)
		b = strconv.AppendInt(b, c.Revision, 10)
		return append(b, `","result":"EQUAL","target":"MOD"}`...)
	})
	if failureReads != nil {
		b = append(b, ',')
		b = appendList(b, "failure", len(failureReads), func(b []byte, i int) []byte { return s.appendRange(b, failureReads[i], "") })
	}
	b = append(b, ',')
	b = appendList(b, "success", len(ops), func(b []byte, i int) []byte {
		o := ops[i]
		if o.Delete {
			b = append(b, `{"request_delete_range":{"key":`...)
			b = appendB64(b, []byte(s.cfg.Prefix+o.Key))
			return append(b, "}}"...)
		}
		b = append(b, `{"request_put":{"key":`...)
		b = appendB64(b, []byte(s.cfg.Prefix+o.Key))
		b = append(b, `,"value":`...)
		b = appendB64(b, o.Value)
		return append(b, "}}"...)
	})
	return append(b, '}')
}

// decodeAnswer decodes an answer into out (a *txnResp or *rangeResp)
// without reflection when it can, else with encoding/json.
func decodeAnswer(data []byte, out any) error {
	ok := false
	switch o := out.(type) {
	case *txnResp:
		var r txnResp
		if ok = fastDecode && decodeTxn(data, &r); ok {
			*o = r
		}
	case *rangeResp:
		var r rangeResp
		if ok = fastDecode && decodeRangeDoc(data, &r); ok {
			*o = r
		}
	}
	if ok {
		return nil
	}
	return json.Unmarshal(data, out)
}

// fastDecode turns the reflection-free reader on (tests compare both).
var fastDecode = true

func decodeTxn(data []byte, out *txnResp) bool {
	return jsonscan.ParseMembers(data, []string{"header", "succeeded", "responses"}, false, func(key string, v jsonscan.Value) bool {
		switch key {
		case "header":
			return decodeHeader(v, &out.Header.Revision)
		case "succeeded":
			var ok bool
			out.Succeeded, ok = v.Bool()
			return ok
		}
		out.Responses = nil
		return eachItem(v, func(item jsonscan.Value) bool {
			var r struct {
				ResponseRange *rangeResp `json:"response_range"`
			}
			ok := item.Members([]string{"response_range"}, false, func(_ string, rv jsonscan.Value) bool {
				if rv.IsNull() {
					return false // encoding/json's nil-pointer rules: leave them to it
				}
				r.ResponseRange = &rangeResp{}
				return decodeRange(rv, r.ResponseRange)
			})
			out.Responses = append(out.Responses, r)
			return ok
		})
	})
}

// eachItem calls item for each element of an array; null is no element
// (encoding/json leaves the slice nil).
func eachItem(v jsonscan.Value, item func(jsonscan.Value) bool) bool {
	return v.IsNull() || v.Array(item)
}

func decodeHeader(v jsonscan.Value, rev *string) bool {
	return v.Members([]string{"revision"}, false, func(_ string, rv jsonscan.Value) bool {
		var ok bool
		*rev, ok = rv.String()
		return ok
	})
}

func decodeRangeDoc(data []byte, out *rangeResp) bool {
	v, ok := jsonscan.Parse(data)
	return ok && decodeRange(v, out)
}

func decodeRange(v jsonscan.Value, out *rangeResp) bool {
	return v.Members([]string{"header", "kvs", "more"}, false, func(key string, v jsonscan.Value) bool {
		switch key {
		case "header":
			return decodeHeader(v, &out.Header.Revision)
		case "more":
			var ok bool
			out.More, ok = v.Bool()
			return ok
		}
		out.Kvs = nil
		return eachItem(v, func(item jsonscan.Value) bool {
			var kv kvJSON
			ok := item.Members([]string{"key", "value", "mod_revision"}, false, func(key string, f jsonscan.Value) bool {
				s, ok := f.String()
				switch key {
				case "key":
					kv.Key = s
				case "value":
					kv.Value = s
				default:
					kv.ModRevision = s
				}
				return ok
			})
			out.Kvs = append(out.Kvs, kv)
			return ok
		})
	})
}
