package storeconfig

import (
	"fmt"
	"math/rand/v2"
	"reflect"
	"strings"
	"testing"
)

// TestFastParseMatchesEncodingJSON parses random store configs with the
// fast path and with encoding/json alone: the same Config or the same
// error, every time.
func TestFastParseMatchesEncodingJSON(t *testing.T) {
	r := rand.New(rand.NewPCG(21, 22))
	pick := func(xs ...string) string { return xs[r.IntN(len(xs))] }
	str := func(xs ...string) string {
		switch r.IntN(30) {
		case 0:
			return "null"
		case 1:
			return "3"
		case 2:
			return `"` + pick(xs...) + `\u0041"`
		}
		return `"` + pick(xs...) + `"`
	}
	dur := func() string {
		return pick(`"5s"`, `"1.5s"`, `"300ms"`, `7`, `"7"`, `""`, `"-1s"`, `-3`, `"x"`, `null`, `1.5`, `"5s"`, `10`, `99999999999999999`)
	}
	key := func(k string) string {
		switch r.IntN(50) {
		case 0:
			return `"` + strings.ToUpper(k[:1]) + k[1:] + `"`
		case 1:
			return `"` + k + `z"`
		}
		return `"` + k + `"`
	}
	fast, parsed := 0, 0
	for range 20000 {
		var m []string
		add := func(p int, k, v string) {
			if r.IntN(p) == 0 {
				m = append(m, key(k)+":"+v)
			}
		}
		add(2, "type", str("local", "etcd", "local", "other"))
		add(3, "path", str("/var/lib/ringipam/store.db", "/tmp/s.db", "rel/s.db"))
		add(5, "openTimeout", dur())
		add(3, "endpoints", pick(`["http://127.0.0.1:2379"]`, `["http://127.0.0.1:2379","https://198.18.0.1:2379"]`, `[]`, `null`, `"x"`, `["ftp://x"]`))
		add(4, "prefix", str("/ringipam/", "/other/"))
		add(12, "tls", pick(`{"ca":"/c.pem"}`, `null`, `{}`))
		add(8, "username", str("u"))
		add(8, "password", str("p"))
		add(6, "dialTimeout", dur())
		add(6, "requestTimeout", dur())
		add(5, "agentSocket", str("off", "/run/ringipam/store.sock", "rel.sock"))
		doc := "{" + strings.Join(m, ",") + "}"
		if r.IntN(40) == 0 {
			doc = doc[1:]
		}
		var c Config
		if parseFast([]byte(doc), &c) {
			fast++
		}
		got, gotErr := Parse([]byte(doc))
		fastParse = false
		want, wantErr := Parse([]byte(doc))
		fastParse = true
		if fmt.Sprint(gotErr) != fmt.Sprint(wantErr) || !reflect.DeepEqual(got, want) {
			t.Fatalf("config %s\nfast: %+v, %v\nencoding/json: %+v, %v", doc, got, gotErr, want, wantErr)
		}
		if wantErr == nil {
			parsed++
		}
	}
	if fast < 3000 || parsed < 2000 {
		t.Fatalf("generator too narrow: %d of 20000 parsed fast, %d valid", fast, parsed)
	}
	t.Logf("%d parsed fast, %d valid", fast, parsed)
}
