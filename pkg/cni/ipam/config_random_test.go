package ipam

import (
	"encoding/json"
	"errors"
	"math/rand/v2"
	"reflect"
	"strings"
	"testing"
)

// randConfig writes a random network configuration around the keys Load
// reads: right and wrong types, nulls, escapes, keys differing in case,
// unknown and repeated keys, routes and dns, prevResult.
func randConfig(r *rand.Rand) string {
	pick := func(xs ...string) string { return xs[r.IntN(len(xs))] }
	str := func(xs ...string) string {
		switch r.IntN(60) {
		case 0:
			return "null"
		case 1:
			return "7"
		case 2:
			return `"` + pick(xs...) + `\u0041"`
		}
		return `"` + pick(xs...) + `"`
	}
	strs := func(xs ...string) string {
		if r.IntN(40) == 0 {
			return pick("null", `"x"`, "{}")
		}
		var out []string
		for range r.IntN(3) {
			out = append(out, str(xs...))
		}
		return "[" + strings.Join(out, ",") + "]"
	}
	boolean := func() string {
		if r.IntN(30) == 0 {
			return pick("null", `"true"`, "1")
		}
		return pick("true", "false")
	}
	key := func(k string) string {
		switch r.IntN(80) {
		case 0:
			return `"` + strings.ToUpper(k[:1]) + k[1:] + `"`
		case 1:
			return `"` + k + `x"`
		}
		return `"` + k + `"`
	}
	object := func(members []string) string {
		r.Shuffle(len(members), func(i, j int) { members[i], members[j] = members[j], members[i] })
		if len(members) > 0 && r.IntN(60) == 0 {
			members = append(members, members[0]) // a repeated key
		}
		return "{" + strings.Join(members, pick(",", ", ", ",\n  ")) + "}"
	}
	rangeObj := func() string {
		var m []string
		m = append(m, key("subnet")+":"+str("198.18.0.0/24", "198.18.4.0/22", "198.18.0.0/24", "198.18.0.0/24", "198.18.0.0/24", "198.18.0.0/24", "2001:db8::/64", "198.18.0.0/33"))
		if r.IntN(3) == 0 {
			m = append(m, key("rangeStart")+":"+str("198.18.0.10", "198.18.0.10", "198.18.0.10", "198.18.0.10", "2001:db8::10", "bad"))
		}
		if r.IntN(3) == 0 {
			m = append(m, key("rangeEnd")+":"+str("198.18.0.200", "198.18.0.200", "198.18.0.200", "2001:db8::ff"))
		}
		if r.IntN(3) == 0 {
			m = append(m, key("gateway")+":"+str("198.18.0.1", "198.18.0.1", "198.18.0.1", "2001:db8::1"))
		}
		return object(m)
	}
	rangeSets := func() string {
		if r.IntN(15) == 0 {
			return pick("null", "[]", `[[]]`, `{}`)
		}
		var sets []string
		for range 1 + r.IntN(2) {
			var rs []string
			for range 1 + r.IntN(2) {
				rs = append(rs, rangeObj())
			}
			sets = append(sets, "["+strings.Join(rs, ",")+"]")
		}
		return "[" + strings.Join(sets, ",") + "]"
	}
	var ipam []string
	maybe := func(p int, k, v string) {
		if r.IntN(p) == 0 {
			ipam = append(ipam, key(k)+":"+v)
		}
	}
	maybe(1, "type", str("ipam-ring"))
	maybe(1, "ranges", rangeSets())
	maybe(4, "host", str("h1", "host-2", "h1", ""))
	maybe(3, "store", pick(`{"type":"etcd","endpoints":["http://127.0.0.1:2379"],"agentSocket":"off"}`, `{"type":"etcd","endpoints":["http://127.0.0.1:2379"],"agentSocket":"/run/x.sock"}`, `{"type":"local","path":"/var/lib/ringipam/t.db"}`, `{"type":"local"}`, `{"type":"local"}`, `{"path":"rel"}`, `null`, `{"type":"etcd","endpoints":["http://127.0.0.1:2379"]}`, `"x"`))
	maybe(6, "exclude", strs("198.18.0.5", "198.18.0.64/26", "198.18.0.5", "bad"))
	maybe(6, "pools", strs("p1", "net1-0"))
	maybe(6, "reservationFromPod", boolean())
	maybe(6, "gatewayMode", str("shared", "per-container", "shared", "per-container", "subnet", "x"))
	maybe(8, "perContainerPrefix", str("range", "host"))
	maybe(6, "timeout", str("5s", "1m", "5s", "1m", "-1s", "x"))
	maybe(8, "reservationHold", str("10m", "0s", "x"))
	maybe(8, "isolated", boolean())
	maybe(8, "subnet", str("198.18.8.0/24"))
	maybe(10, "rangeStart", str("198.18.8.10"))
	maybe(10, "rangeEnd", str("198.18.8.20"))
	maybe(10, "gateway", str("198.18.8.1"))
	maybe(10, "dataDir", str("/var/lib/cni"))
	maybe(10, "routes", `[{"dst":"0.0.0.0/0"}]`)
	maybe(10, "dns", `{"nameservers":["198.18.0.53"]}`)
	maybe(20, "unknown", `1`)

	var top []string
	add := func(p int, k, v string) {
		if r.IntN(p) == 0 {
			top = append(top, key(k)+":"+v)
		}
	}
	add(1, "cniVersion", str("1.0.0", "0.4.0", "1.1.0", "1.0.0", ""))
	add(1, "name", str("net1", "n-2", "net1", ""))
	add(2, "type", str("bridge", "ptp"))
	add(8, "chained", boolean())
	add(1, "ipam", pick(object(ipam), object(ipam), object(ipam), object(ipam), object(ipam), object(ipam), "null", `"x"`))
	add(10, "runtimeConfig", object([]string{
		key("ips") + ":" + strs("198.18.0.7/24", "198.18.0.8"),
		key("ipRanges") + ":" + rangeSets(),
		key("io.kubernetes.cri.pod-annotations") + ":" + pick(`{}`, `{"ipam.ringipam.io/ips":"198.18.0.9"}`, `{"a":"b","a":"c"}`, `null`, `{"a":1}`),
		key("other") + ":1",
	}[:r.IntN(5)]))
	add(10, "args", pick(`{"cni":{"ips":["198.18.0.11"]}}`, `{"cni":{}}`, `{}`, `null`, `{"cni":null}`, `{"CNI":{"ips":["198.18.0.12"]}}`, `{"cni":{"ips":null}}`))
	add(10, "cni.dev/valid-attachments", pick(`[{"containerID":"c1","ifname":"eth0"}]`, `[]`, `null`))
	add(15, "prevResult", `{"cniVersion":"1.0.0","ips":[{"address":"198.18.0.2/24"}]}`)
	add(10, "unknownTop", pick(`{"x":[1,2]}`, `"y"`, `null`))
	if r.IntN(30) == 0 {
		return object(top)[1:] // not JSON
	}
	return object(top)
}

// TestLoadRandomConfigs loads random configurations (the generator's
// inputs once compared a hand-written decoder with encoding/json): Load
// never panics, every error it returns is a code-7 configuration error,
// and a configuration whose "ipam" object carries a key ipam-ring does not
// know is never accepted.
func TestLoadRandomConfigs(t *testing.T) {
	r := rand.New(rand.NewPCG(11, 12))
	loaded := 0
	for i := range 20000 {
		doc := []byte(randConfig(r))
		args := []string{"", "IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p", "IP=198.18.0.20"}[i%3]
		c, err := Load(doc, args)
		if err != nil {
			if !errors.Is(err, ErrBadConfig) || CNIError(err).Code != 7 {
				t.Fatalf("config %s: error %v is not a code-7 configuration error", doc, err)
			}
			continue
		}
		if len(c.RangeSets) == 0 || c.Host == "" || c.Timeout <= 0 {
			t.Fatalf("config %s: accepted an incomplete config: %+v", doc, c)
		}
		if unknownIPAMKey(t, doc) {
			t.Fatalf("config %s: accepted an unknown key in \"ipam\"", doc)
		}
		loaded++
	}
	if loaded < 500 {
		t.Fatalf("generator too narrow: %d of 20000 loaded", loaded)
	}
	t.Logf("%d loaded without error", loaded)
}

// unknownIPAMKey says whether doc's "ipam" object has a key that none of
// ipamJSON's fields takes (encoding/json matches keys regardless of case).
func unknownIPAMKey(t *testing.T, doc []byte) bool {
	var n struct {
		IPAM map[string]json.RawMessage `json:"ipam"`
	}
	if err := json.Unmarshal(doc, &n); err != nil {
		t.Fatalf("config %s loaded but does not decode: %v", doc, err)
	}
	known := map[string]bool{}
	for f := range reflect.TypeFor[ipamJSON]().Fields() {
		known[strings.ToLower(strings.Split(f.Tag.Get("json"), ",")[0])] = true
	}
	for k := range n.IPAM {
		if !known[strings.ToLower(k)] {
			return true
		}
	}
	return false
}
