package ipam

import (
	"fmt"
	"io"
	"net"
	"strconv"

	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
)

// Printing a result.
//
// types/100's Result.PrintTo encodes the result to JSON, decodes that into
// a map, encodes the map (so every object's keys come out sorted) and
// indents it: about 0.15-0.2 ms of a plugin process's time, most of it
// encoding/json learning the types by reflection, which an ADD otherwise
// does not need. encodeCurrent writes the same bytes directly for the
// results this plugin makes; a result with anything it does not handle
// byte for byte (a string that JSON would escape, a nil entry) goes to
// PrintTo. TestPrintCurrentMatchesPrintTo holds the two to the same output.

func printAs(w io.Writer, r types.Result, ver string) error {
	out, err := r.GetAsVersion(ver)
	if err != nil {
		return fmt.Errorf("%w: cannot express the result as CNI %s: %w", ErrBadConfig, ver, err)
	}
	if cur, ok := out.(*current.Result); ok {
		if b, ok := encodeCurrent(cur); ok {
			_, err := w.Write(b)
			return err
		}
	}
	return out.PrintTo(w)
}

// jsonWriter writes indented JSON as json.MarshalIndent(v, "", "    ")
// does, for objects whose keys the caller gives in sorted order. ok turns
// false at the first string it cannot write verbatim.
type jsonWriter struct {
	b     []byte
	depth int
	first []bool // per open container: no element written yet
	ok    bool
}

func (j *jsonWriter) newline() {
	j.b = append(j.b, '\n')
	for range j.depth {
		j.b = append(j.b, "    "...)
	}
}

// element starts a value inside the open container.
func (j *jsonWriter) element() {
	if n := len(j.first); n > 0 {
		if !j.first[n-1] {
			j.b = append(j.b, ',')
		}
		j.first[n-1] = false
		j.newline()
	}
}

func (j *jsonWriter) open(c byte) {
	j.b = append(j.b, c)
	j.depth++
	j.first = append(j.first, true)
}

func (j *jsonWriter) close(c byte) {
	j.depth--
	empty := j.first[len(j.first)-1]
	j.first = j.first[:len(j.first)-1]
	if !empty {
		j.newline()
	}
	j.b = append(j.b, c)
}

func (j *jsonWriter) key(k string) {
	j.element()
	j.str(k)
	j.b = append(j.b, ':', ' ')
}

// str writes s quoted, if it needs no escaping.
func (j *jsonWriter) str(s string) {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c > 0x7e || c == '"' || c == '\\' || c == '<' || c == '>' || c == '&' {
			j.ok = false
		}
	}
	j.b = append(j.b, '"')
	j.b = append(j.b, s...)
	j.b = append(j.b, '"')
}

func (j *jsonWriter) strField(k, v string) {
	j.key(k)
	j.str(v)
}

// intField writes an integer as PrintTo does, through a float64: exact
// below 2^53, which every field printed here is.
func (j *jsonWriter) intField(k string, v int) {
	if v >= 1<<53 || v <= -(1<<53) {
		j.ok = false
	}
	j.key(k)
	j.b = strconv.AppendInt(j.b, int64(v), 10)
}

// ipField writes a non-empty address; one that is neither 4 nor 16 bytes
// long, which JSON cannot encode, is left to PrintTo to refuse.
func (j *jsonWriter) ipField(k string, ip net.IP) {
	if len(ip) != net.IPv4len && len(ip) != net.IPv6len {
		j.ok = false
		return
	}
	j.strField(k, ip.String())
}

func (j *jsonWriter) strList(k string, vs []string) {
	j.key(k)
	j.open('[')
	for _, v := range vs {
		j.element()
		j.str(v)
	}
	j.close(']')
}

// encodeCurrent returns r as PrintTo prints it; ok is false when it cannot
// be sure to print the same bytes.
func encodeCurrent(r *current.Result) ([]byte, bool) {
	j := &jsonWriter{ok: true}
	j.open('{')
	if r.CNIVersion != "" {
		j.strField("cniVersion", r.CNIVersion)
	}
	if d := r.DNS; !d.IsEmpty() {
		j.key("dns")
		j.open('{')
		if d.Domain != "" {
			j.strField("domain", d.Domain)
		}
		if len(d.Nameservers) > 0 {
			j.strList("nameservers", d.Nameservers)
		}
		if len(d.Options) > 0 {
			j.strList("options", d.Options)
		}
		if len(d.Search) > 0 {
			j.strList("search", d.Search)
		}
		j.close('}')
	}
	if len(r.Interfaces) > 0 {
		j.key("interfaces")
		j.open('[')
		for _, i := range r.Interfaces {
			if i == nil {
				return nil, false
			}
			j.element()
			j.open('{')
			if i.Mac != "" {
				j.strField("mac", i.Mac)
			}
			if i.Mtu != 0 {
				j.intField("mtu", i.Mtu)
			}
			j.strField("name", i.Name)
			if i.PciID != "" {
				j.strField("pciID", i.PciID)
			}
			if i.Sandbox != "" {
				j.strField("sandbox", i.Sandbox)
			}
			if i.SocketPath != "" {
				j.strField("socketPath", i.SocketPath)
			}
			j.close('}')
		}
		j.close(']')
	}
	if len(r.IPs) > 0 {
		j.key("ips")
		j.open('[')
		for _, ip := range r.IPs {
			if ip == nil {
				return nil, false
			}
			j.element()
			j.open('{')
			j.strField("address", ip.Address.String())
			if len(ip.Gateway) > 0 {
				j.ipField("gateway", ip.Gateway)
			}
			if ip.Interface != nil {
				j.intField("interface", *ip.Interface)
			}
			j.close('}')
		}
		j.close(']')
	}
	if len(r.Routes) > 0 {
		j.key("routes")
		j.open('[')
		for _, rt := range r.Routes {
			if rt == nil {
				return nil, false
			}
			j.element()
			j.open('{')
			if rt.AdvMSS != 0 {
				j.intField("advmss", rt.AdvMSS)
			}
			j.strField("dst", rt.Dst.String())
			if len(rt.GW) > 0 {
				j.ipField("gw", rt.GW)
			}
			if rt.MTU != 0 {
				j.intField("mtu", rt.MTU)
			}
			if rt.Priority != 0 {
				j.intField("priority", rt.Priority)
			}
			if rt.Scope != nil {
				j.intField("scope", *rt.Scope)
			}
			if rt.Table != nil {
				j.intField("table", *rt.Table)
			}
			j.close('}')
		}
		j.close(']')
	}
	j.close('}')
	return j.b, j.ok
}
