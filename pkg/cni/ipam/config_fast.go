package ipam

import (
	"bytes"
	"encoding/json"

	"github.com/ringipam/ringipam/internal/jsonscan"
)

// fastDecode lets Load read the common configuration without
// encoding/json's reflection (package jsonscan); tests turn it off to
// compare the two.
var fastDecode = true

// The keys of netJSON, ipamJSON and rangeJSON, as their tags name them.
var (
	netKeys     = []string{"cniVersion", "name", "type", "chained", "ipam", "prevResult", "cni.dev/valid-attachments", "cni.dev/attachments", "runtimeConfig", "args"}
	runtimeKeys = []string{"ips", "ipRanges", "io.kubernetes.cri.pod-annotations"}
	ipamKeys    = []string{"type", "ranges", "routes", "dns", "exclude", "store", "host", "pools", "reservationFromPod", "gatewayMode",
		"perContainerPrefix", "timeout", "reservationHold", "isolated", "subnet", "rangeStart", "rangeEnd", "gateway", "dataDir"}
	rangeKeys = []string{"subnet", "rangeStart", "rangeEnd", "gateway", "static"}
)

// decodeNetFast fills n from stdin as json.Unmarshal would, or returns
// false (n then partly filled) for what it leaves to encoding/json: a
// prevResult, a null, an escaped string, a key matched only
// case-insensitively, and anything that is not valid or not of the
// expected type.
func decodeNetFast(stdin []byte, n *netJSON) bool {
	if !fastDecode {
		return false
	}
	return jsonscan.ParseMembers(stdin, netKeys, false, func(key string, val jsonscan.Value) bool {
		var ok bool
		switch key {
		case "cniVersion":
			n.CNIVersion, ok = val.String()
		case "name":
			n.Name, ok = val.String()
		case "type":
			n.Type, ok = val.String()
		case "chained":
			n.Chained, ok = val.Bool()
		case "ipam":
			n.IPAM, ok = rawMessage(val)
		case "cni.dev/valid-attachments":
			n.Valid, ok = rawMessage(val)
		case "cni.dev/attachments":
			n.OldValid, ok = rawMessage(val)
		case "runtimeConfig":
			ok = val.Members(runtimeKeys, false, func(key string, val jsonscan.Value) bool {
				var ok bool
				switch key {
				case "ips":
					n.RuntimeConfig.IPs, ok = val.Strings()
				case "ipRanges":
					n.RuntimeConfig.IPRanges, ok = rangeSets(val, false)
				case "io.kubernetes.cri.pod-annotations":
					n.RuntimeConfig.Annotations, ok = stringMap(val)
				}
				return ok
			})
		case "args":
			n.Args = &argsJSON{}
			ok = val.Members([]string{"cni"}, false, func(_ string, val jsonscan.Value) bool {
				n.Args.CNI = &struct {
					IPs []string `json:"ips"`
				}{}
				return val.Members([]string{"ips"}, false, func(_ string, val jsonscan.Value) bool {
					var ok bool
					n.Args.CNI.IPs, ok = val.Strings()
					return ok
				})
			})
		}
		return ok // prevResult included: left to encoding/json
	})
}

// decodeIPAMFast fills im from the "ipam" object as a decoder with
// DisallowUnknownFields would, or returns false (see decodeNetFast;
// also for routes and dns, and for any unknown key).
func decodeIPAMFast(raw []byte, im *ipamJSON) bool {
	if !fastDecode {
		return false
	}
	return jsonscan.ParseMembers(raw, ipamKeys, true, func(key string, val jsonscan.Value) bool {
		var ok bool
		switch key {
		case "type":
			im.Type, ok = val.String()
		case "ranges":
			im.Ranges, ok = rangeSets(val, true)
		case "exclude":
			im.Exclude, ok = val.Strings()
		case "store":
			im.Store, ok = rawMessage(val)
		case "host":
			im.Host, ok = val.String()
		case "pools":
			im.Pools, ok = val.Strings()
		case "reservationFromPod":
			im.ReservationFromPod, ok = val.Bool()
		case "gatewayMode":
			im.GatewayMode, ok = val.String()
		case "perContainerPrefix":
			im.PerContainerPrefix, ok = val.String()
		case "timeout":
			im.Timeout, ok = val.String()
		case "reservationHold":
			im.ReservationHold, ok = val.String()
		case "isolated":
			im.Isolated, ok = val.Bool()
		case "subnet":
			im.Subnet, ok = val.String()
		case "rangeStart":
			im.RangeStart, ok = val.String()
		case "rangeEnd":
			im.RangeEnd, ok = val.String()
		case "gateway":
			im.Gateway, ok = val.String()
		case "dataDir":
			im.DataDir, ok = val.String()
		}
		return ok // routes and dns: left to encoding/json
	})
}

// rawMessage is what json.RawMessage keeps of a value: a copy of its
// bytes (a null is left to encoding/json).
func rawMessage(v jsonscan.Value) (json.RawMessage, bool) {
	if v.IsNull() {
		return nil, false
	}
	return bytes.Clone(v.Raw()), true
}

// rangeSets reads [][]rangeJSON; strict refuses unknown keys.
func rangeSets(v jsonscan.Value, strict bool) ([][]rangeJSON, bool) {
	sets := [][]rangeJSON{}
	ok := v.Array(func(set jsonscan.Value) bool {
		rs := []rangeJSON{}
		ok := set.Array(func(r jsonscan.Value) bool {
			var rj rangeJSON
			ok := r.Members(rangeKeys, strict, func(key string, val jsonscan.Value) bool {
				var ok bool
				switch key {
				case "subnet":
					rj.Subnet, ok = val.String()
				case "rangeStart":
					rj.RangeStart, ok = val.String()
				case "rangeEnd":
					rj.RangeEnd, ok = val.String()
				case "gateway":
					rj.Gateway, ok = val.String()
				case "static":
					rj.Static, ok = val.Bool()
				}
				return ok
			})
			rs = append(rs, rj)
			return ok
		})
		sets = append(sets, rs)
		return ok
	})
	return sets, ok
}

// stringMap reads map[string]string.
func stringMap(v jsonscan.Value) (map[string]string, bool) {
	m := map[string]string{}
	ok := v.Object(func(key string, val jsonscan.Value) bool {
		s, ok := val.String()
		m[key] = s
		return ok
	})
	return m, ok
}
