package etcdjson

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"reflect"
	"strconv"
	"testing"

	"github.com/ringipam/ringipam/pkg/store"
)

// The requests as encoding/json wrote them from maps before body.go: the
// reference the written requests must equal, once decoded.
func refB64(s string) string { return base64.StdEncoding.EncodeToString([]byte(s)) }

func (s *Store) refRanges(keys []string, rev string) []map[string]any {
	var ops []map[string]any
	for _, k := range keys {
		r := map[string]any{"key": refB64(s.cfg.Prefix + k)}
		if rev != "" {
			r["revision"] = rev
		}
		ops = append(ops, map[string]any{"request_range": r})
	}
	return ops
}

func (s *Store) refTxn(conds []store.Cond, same []store.KV, ops []store.Op, failure []string) map[string]any {
	var cmps []map[string]any
	for _, c := range conds {
		k := refB64(s.cfg.Prefix + c.Key)
		if c.Revision == 0 {
			cmp := map[string]any{"key": k, "target": "VERSION", "result": "EQUAL", "version": "0"}
			if c.IsRange() {
				cmp["range_end"] = refB64(s.cfg.Prefix + c.End)
			}
			cmps = append(cmps, cmp)
		} else {
			cmps = append(cmps, map[string]any{"key": k, "target": "MOD", "result": "EQUAL", "mod_revision": strconv.FormatInt(c.Revision, 10)})
		}
	}
	for _, kv := range same {
		cmps = append(cmps, map[string]any{"key": refB64(s.cfg.Prefix + kv.Key), "target": "VALUE", "result": "EQUAL", "value": base64.StdEncoding.EncodeToString(kv.Value)})
	}
	var writes []map[string]any
	for _, o := range ops {
		if o.Delete {
			writes = append(writes, map[string]any{"request_delete_range": map[string]any{"key": refB64(s.cfg.Prefix + o.Key)}})
		} else {
			writes = append(writes, map[string]any{"request_put": map[string]any{"key": refB64(s.cfg.Prefix + o.Key), "value": base64.StdEncoding.EncodeToString(o.Value)}})
		}
	}
	m := map[string]any{"compare": cmps, "success": writes}
	if failure != nil {
		m["failure"] = s.refRanges(failure, "")
	}
	return m
}

func sameJSON(t *testing.T, what string, got body, want any) {
	t.Helper()
	ref, err := json.Marshal(want)
	if err != nil {
		t.Fatal(err)
	}
	var g, w any
	if err := json.Unmarshal(got, &g); err != nil {
		t.Fatalf("%s: written request is not JSON: %v\n%s", what, err, got)
	}
	if err := json.Unmarshal(ref, &w); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(g, w) {
		t.Fatalf("%s:\nwritten   %s\nreference %s", what, got, ref)
	}
}

func randKey(r *rand.Rand) string {
	b := make([]byte, r.IntN(12))
	for i := range b {
		b[i] = byte(r.IntN(256)) // any byte: keys are binary
	}
	return string(b)
}

func TestRequestsMatchEncodingJSON(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for i := range 3000 {
		s := &Store{cfg: Config{Prefix: randKey(r)}}
		var keys []string
		for range r.IntN(5) {
			keys = append(keys, randKey(r))
		}
		rev := ""
		if r.IntN(2) == 0 {
			rev = strconv.Itoa(r.IntN(1 << 20))
		}
		sameJSON(t, fmt.Sprint("get ", i), s.getBody(keys, rev), map[string]any{"success": s.refRanges(keys, rev)})
		from, to, limit := randKey(r), randKey(r), r.IntN(2000)
		scan := map[string]any{"key": refB64(from), "range_end": refB64(to), "limit": limit}
		if rev != "" {
			scan["revision"] = rev
		}
		sameJSON(t, fmt.Sprint("scan ", i), s.scanBody(from, to, limit, rev), scan)
		var conds []store.Cond
		var same []store.KV
		var ops []store.Op
		for range r.IntN(4) {
			c := store.Cond{Key: randKey(r), Revision: int64(r.IntN(3) * r.IntN(1<<30))}
			if c.Revision == 0 && r.IntN(2) == 0 {
				c.End = randKey(r) // a range condition unless empty
			}
			conds = append(conds, c)
		}
		for range r.IntN(3) {
			same = append(same, store.KV{Key: randKey(r), Value: []byte(randKey(r))})
		}
		for range r.IntN(4) {
			if r.IntN(3) == 0 {
				ops = append(ops, store.Delete(randKey(r)))
			} else {
				ops = append(ops, store.Put(randKey(r), []byte(randKey(r))))
			}
		}
		var failure []string
		if r.IntN(2) == 0 {
			failure = append([]string{}, keys...)
		}
		sameJSON(t, fmt.Sprint("txn ", i), s.txnBody(conds, same, ops, failure), s.refTxn(conds, same, ops, failure))
	}
}

// randomAnswer is a gateway answer as etcd writes them: int64 fields as
// strings, defaults left out, fields this client does not read included.
func randomAnswer(r *rand.Rand) []byte {
	kvs := func() []any {
		var out []any
		for range r.IntN(4) {
			kv := map[string]any{"key": refB64(randKey(r)), "create_revision": "3", "version": "1"}
			if r.IntN(4) > 0 {
				kv["value"] = refB64(randKey(r))
			}
			if r.IntN(4) > 0 {
				kv["mod_revision"] = strconv.Itoa(r.IntN(1 << 30))
			}
			out = append(out, kv)
		}
		return out
	}
	header := map[string]any{"cluster_id": "14841639068965178418", "member_id": "10276657743932975437", "revision": strconv.Itoa(r.IntN(1 << 30)), "raft_term": "2"}
	rng := func() map[string]any {
		m := map[string]any{"header": header}
		if k := kvs(); k != nil {
			m["kvs"] = k
			m["count"] = strconv.Itoa(len(k))
		}
		if r.IntN(3) == 0 {
			m["more"] = true
		}
		return m
	}
	var doc map[string]any
	if r.IntN(3) == 0 {
		doc = rng()
	} else {
		doc = map[string]any{"header": header}
		if r.IntN(2) == 0 {
			doc["succeeded"] = true
		}
		var resp []any
		for range r.IntN(4) {
			switch r.IntN(3) {
			case 0:
				resp = append(resp, map[string]any{"response_put": map[string]any{"header": header}})
			case 1:
				resp = append(resp, map[string]any{"response_delete_range": map[string]any{"header": header, "deleted": "1"}})
			default:
				resp = append(resp, map[string]any{"response_range": rng()})
			}
		}
		if resp != nil {
			doc["responses"] = resp
		}
	}
	b, _ := json.Marshal(doc)
	return b
}

// mutate changes an answer in ways encoding/json reads differently from a
// naive reader: case-folded keys, escapes, nulls, wrong types, repeats.
func mutate(r *rand.Rand, b []byte) []byte {
	subs := [][2]string{
		{`"revision"`, `"Revision"`}, {`"kvs"`, `"KVS"`}, {`"succeeded":true`, `"succeeded":null`},
		{`"succeeded":true`, `"succeeded":"true"`}, {`"mod_revision":"`, `"mod_revision":"\u0031`},
		{`"responses":[`, `"responses":null,"responses":[`}, {`"more":true`, `"more":1`},
		{`"kvs":[`, `"kvs":null,"x":[`}, {`"response_range":{`, `"response_range":null,"y":{`},
		{`"header":{`, `"header":null,"z":{`}, {`"key":"`, `"key":"\/`}, {`{`, `{"ſucceeded":true,`},
	}
	sub := subs[r.IntN(len(subs))]
	return bytes.Replace(b, []byte(sub[0]), []byte(sub[1]), 1)
}

func TestAnswersDecodeAsEncodingJSON(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	fast := 0
	for i := range 20000 {
		doc := randomAnswer(r)
		if i%2 == 1 {
			doc = mutate(r, doc)
		}
		for _, kind := range []string{"txn", "range"} {
			var got, want any
			var gotOK bool
			var wantErr error
			switch kind {
			case "txn":
				var g, w txnResp
				gotOK = decodeTxn(doc, &g)
				wantErr = json.Unmarshal(doc, &w)
				got, want = g, w
			default:
				var g, w rangeResp
				gotOK = decodeRangeDoc(doc, &g)
				wantErr = json.Unmarshal(doc, &w)
				got, want = g, w
			}
			if !gotOK {
				continue // left to encoding/json
			}
			fast++
			if wantErr != nil {
				t.Fatalf("%s: the fast reader took what encoding/json refuses (%v):\n%s", kind, wantErr, doc)
			}
			if !reflect.DeepEqual(got, want) {
				t.Fatalf("%s: decoded differently:\nfast %+v\njson %+v\n%s", kind, got, want, doc)
			}
		}
	}
	if fast < 15000 {
		t.Fatalf("the fast reader took only %d of 40000 decodings", fast)
	}
}
