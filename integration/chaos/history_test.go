//go:build integration

package chaos

import (
	"cmp"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/anishathalye/porcupine"

	"github.com/ringipam/ringipam/pkg/portalloc"
)

// Verbs of the recorded history.
const (
	verbAdd     = "add"     // CNI ADD, or Docker RequestAddress for an endpoint MAC
	verbDel     = "del"     // CNI DEL
	verbRelease = "release" // Docker ReleaseAddress of Addr
	verbRead    = "read"    // the suite's read of every allocation after the run
)

// Outcomes of a call.
const (
	// outOK: the call succeeded.
	outOK = "ok"
	// outFailed: the call failed with an error that promises it changed
	// nothing (any CNI code but 11; a Docker error that is not "try again
	// later").
	outFailed = "failed"
	// outAmbiguous: the call may or may not have taken effect: the plugin
	// was killed, it answered code 11 (store trouble: a commit sent to etcd
	// may have been applied although no answer came back), or the Docker
	// driver's connection broke.
	outAmbiguous = "ambiguous"
)

// call is one recorded call: who made it, what it asked, when it was
// invoked and when it returned (CLOCK_MONOTONIC nanoseconds, comparable
// across the suite's processes), and what came back.
type call struct {
	Client int        `json:"client"` // one per worker, unique in the run
	Host   string     `json:"host"`
	Verb   string     `json:"verb"`
	Owner  string     `json:"owner"` // "cni/<container ID>" or "docker/<MAC>"
	Addr   netip.Addr `json:"addr,omitzero"`
	// Port is the port a successful portmap-ingress ADD published (the
	// history of ports is kept apart from that of addresses).
	Port    portalloc.Address `json:"port,omitzero"`
	Call    int64             `json:"call"`
	Return  int64             `json:"return"`
	Outcome string            `json:"outcome"`
	Code    uint              `json:"code,omitempty"` // CNI error code
	Msg     string            `json:"msg,omitempty"`  // error message (CNI msg, Docker Err, or how the process ended)
	Killed  bool              `json:"killed,omitempty"`
	// Unclear is set when the failure was not a clear error: code 999,
	// output that is no CNI error, an overrun of the plugin's own timeout.
	Unclear string `json:"unclear,omitempty"`
}

// clearCodes are the CNI codes a failed call may carry in this workload:
// 11 for store trouble (the faults) and 102 for a full pool (ipam-ring) or
// a full dynamic port range (portmap-ingress).
var clearCodes = map[uint]bool{11: true, 102: true}

// holdings maps owners to addresses: the model's state (within one
// address's partition), and what a reading of the store saw. A value is
// never modified: every step makes a new map.
type holdings map[string]netip.Addr

func (h holdings) with(owner string, a netip.Addr) holdings {
	n := maps.Clone(h)
	if n == nil {
		n = holdings{}
	}
	n[owner] = a
	return n
}

func (h holdings) without(owner string) holdings {
	if _, ok := h[owner]; !ok {
		return h
	}
	n := maps.Clone(h)
	delete(n, owner)
	return n
}

func (h holdings) String() string {
	var b strings.Builder
	for _, k := range slices.Sorted(maps.Keys(h)) {
		fmt.Fprintf(&b, "%s=%s ", k, h[k])
	}
	return strings.TrimSpace(b.String())
}

// modelInput and modelOutput are what the porcupine history carries.
type modelInput struct {
	Part  netip.Addr // the address whose partition the operation is checked in
	Verb  string
	Owner string
	Addr  netip.Addr // the address a release names
}

type modelOutput struct {
	Outcome string
	Addr    netip.Addr // what an ADD returned
	Code    uint
	Read    holdings // what the final read saw of this address
}

// The model of the pool is a set of owner -> address assignments: ADD of
// an owner that holds an address returns that address (idempotent); ADD of
// an owner that holds none returns an address nobody holds; DEL frees what
// the owner holds; a Docker release of an address frees it if the
// releasing endpoint holds it and touches nobody else; a definite failure
// changes nothing; an ambiguous call took effect or did not; the final
// read sees exactly the assignments.
//
// It is checked per address (porcupine's partitions, P-compositionality):
// every call of an owner whose address the history tells (a successful ADD
// or the final read) belongs to that address's partition, where the state
// is who holds that one address. That is exact for those calls. The calls
// of an owner whose address is never told (its only ADDs were ambiguous or
// failed, and the final read does not list it) go into every partition,
// where their ADD may or may not have taken that address: an
// over-approximation, so a partition that fails is a real violation, never
// a false alarm. What spans addresses is checked outside porcupine:
// idempotency (every successful ADD of an owner returns the same address,
// the one the final read shows) by sameAddress, and "no capacity" answered
// only when the pool may have been full by capacityLies.
func poolModel() porcupine.Model {
	nm := porcupine.NondeterministicModel{
		Partition: func(ops []porcupine.Operation) [][]porcupine.Operation {
			by := map[netip.Addr][]porcupine.Operation{}
			for _, op := range ops {
				a := op.Input.(modelInput).Part
				by[a] = append(by[a], op)
			}
			var out [][]porcupine.Operation
			for _, a := range slices.SortedFunc(maps.Keys(by), netip.Addr.Compare) {
				out = append(out, by[a])
			}
			return out
		},
		Init: func() []interface{} { return []interface{}{holdings{}} },
		Step: func(st, in, out interface{}) []interface{} {
			return step(st.(holdings), in.(modelInput), out.(modelOutput))
		},
		Equal: func(a, b interface{}) bool { return maps.Equal(a.(holdings), b.(holdings)) },
		DescribeOperation: func(in, out interface{}) string {
			i, o := in.(modelInput), out.(modelOutput)
			s := i.Verb + "(" + i.Owner
			if i.Addr.IsValid() {
				s += ", " + i.Addr.String()
			}
			s += ") -> " + o.Outcome
			if o.Addr.IsValid() {
				s += " " + o.Addr.String()
			}
			if o.Code != 0 {
				s += fmt.Sprintf(" code %d", o.Code)
			}
			if i.Verb == verbRead {
				s += " {" + o.Read.String() + "}"
			}
			return s
		},
		DescribeState: func(s interface{}) string { return "{" + s.(holdings).String() + "}" },
	}
	return nm.ToModel()
}

// step is the model's step within the partition of address in.Part: h
// holds the owners of that address (one, unless the history is wrong).
func step(h holdings, in modelInput, out modelOutput) []interface{} {
	one := func(s holdings) []interface{} { return []interface{}{s} }
	either := func(a, b holdings) []interface{} { return []interface{}{a, b} }
	a := in.Part
	_, holds := h[in.Owner]
	taken := len(h) > 0 && !holds // held by another owner
	switch in.Verb {
	case verbAdd:
		switch out.Outcome {
		case outOK:
			if out.Addr != a {
				// Another address: an owner holding this one must have
				// got it back; any other owner leaves this one alone (a
				// Docker endpoint asked for again after a release).
				if holds {
					return nil
				}
				return one(h)
			}
			if taken {
				return nil // not this address's to give: a duplicate
			}
			return one(h.with(in.Owner, a))
		case outFailed:
			if holds {
				return nil // an owner that holds an address gets it back
			}
			return one(h)
		default:
			if holds || taken {
				return one(h)
			}
			return either(h, h.with(in.Owner, a))
		}
	case verbDel, verbRelease:
		if !holds || (in.Verb == verbRelease && in.Addr != a) {
			return one(h) // nothing of this owner's here to free
		}
		switch out.Outcome {
		case outOK:
			return one(h.without(in.Owner))
		case outFailed:
			return one(h)
		default:
			return either(h, h.without(in.Owner))
		}
	case verbRead:
		if maps.Equal(h, out.Read) {
			return one(h)
		}
		return nil
	}
	return nil
}

// addressesOf returns the addresses the history tells for each owner: what
// its successful ADDs returned (more than one only for an owner asked for
// again after a release: a Docker endpoint after an ambiguous release),
// else what the final read shows. mayHold tells the owners that may ever
// have held an address: a successful or an ambiguous ADD, or the final
// read. The others' calls are the identity in every state of the model
// (they never hold anything), so they are left out of the check, which
// changes nothing in its verdict and keeps porcupine from searching the
// orders of thousands of "pool full" answers and the DELs after them.
func addressesOf(calls []call, final holdings) (known map[string][]netip.Addr, mayHold map[string]bool) {
	known, mayHold = map[string][]netip.Addr{}, map[string]bool{}
	for _, c := range calls {
		if c.Verb != verbAdd {
			continue
		}
		switch c.Outcome {
		case outOK:
			mayHold[c.Owner] = true
			if !slices.Contains(known[c.Owner], c.Addr) {
				known[c.Owner] = append(known[c.Owner], c.Addr)
			}
		case outAmbiguous:
			mayHold[c.Owner] = true
		}
	}
	for o, a := range final {
		mayHold[o] = true
		if len(known[o]) == 0 {
			known[o] = []netip.Addr{a}
		}
	}
	return known, mayHold
}

// operations turns the history into porcupine operations, each tagged with
// the partition (address) it is checked in; pool lists every address of
// the pool. An ambiguous call's return is left open: it may take effect at
// any time up to the end of the run (every process of the run has exited
// by then, and etcd has applied or dropped what they sent). The final
// read, one per address, comes after that.
func operations(calls []call, final holdings, pool []netip.Addr) []porcupine.Operation {
	var end int64
	maxClient := 0
	for _, c := range calls {
		end = max(end, c.Call, c.Return)
		maxClient = max(maxClient, c.Client)
	}
	known, mayHold := addressesOf(calls, final)
	var ops []porcupine.Operation
	for _, c := range calls {
		if !mayHold[c.Owner] {
			continue
		}
		ret := c.Return
		if c.Outcome == outAmbiguous {
			ret = end + 1
		}
		parts := pool
		if as, ok := known[c.Owner]; ok {
			parts = as
		}
		for _, a := range parts {
			ops = append(ops, porcupine.Operation{
				ClientId: c.Client,
				Input:    modelInput{Part: a, Verb: c.Verb, Owner: c.Owner, Addr: c.Addr},
				Call:     c.Call,
				Output:   modelOutput{Outcome: c.Outcome, Addr: addrIfAdd(c), Code: c.Code},
				Return:   ret,
			})
		}
	}
	if final != nil {
		for _, a := range pool {
			seen := holdings{}
			for o, x := range final {
				if x == a {
					seen[o] = x
				}
			}
			ops = append(ops, porcupine.Operation{
				ClientId: maxClient + 1,
				Input:    modelInput{Part: a, Verb: verbRead},
				Call:     end + 2,
				Output:   modelOutput{Outcome: outOK, Read: seen},
				Return:   end + 3,
			})
		}
	}
	return ops
}

func addrIfAdd(c call) netip.Addr {
	if c.Verb == verbAdd {
		return c.Addr
	}
	return netip.Addr{}
}

// linearizable checks the history against the pool model within timeout:
// "yes", "no" or "unknown" (timed out), with porcupine's partial
// linearizations for a visualisation and the sentences of the checks that
// span addresses.
func linearizable(pool []netip.Addr, calls []call, final holdings, timeout time.Duration) (string, []string, porcupine.Model, porcupine.LinearizationInfo) {
	m := poolModel()
	res, info := porcupine.CheckOperationsVerbose(m, operations(calls, final, pool), timeout)
	bad := append(sameAddress(calls, final), capacityLies(len(pool), calls)...)
	switch {
	case res == porcupine.Illegal || (res == porcupine.Ok && len(bad) > 0):
		return "no", bad, m, info
	case res == porcupine.Ok:
		return "yes", nil, m, info
	}
	return "unknown", bad, m, info
}

// sameAddress reports owners whose successful ADDs returned different
// addresses with no DEL or release asked for in between, or an address
// other than the one the final read shows. (A CNI owner is never added
// again after a DEL; a Docker endpoint is asked for again after an
// ambiguous release, and may then get another address.)
func sameAddress(calls []call, final holdings) []string {
	got := map[string]netip.Addr{}
	var out []string
	sorted := slices.Clone(calls)
	slices.SortStableFunc(sorted, func(a, b call) int { return cmp.Compare(a.Call, b.Call) })
	for _, c := range sorted {
		if c.Verb == verbDel || c.Verb == verbRelease {
			delete(got, c.Owner)
			continue
		}
		if c.Verb != verbAdd || c.Outcome != outOK {
			continue
		}
		if a, ok := got[c.Owner]; ok && a != c.Addr {
			out = append(out, fmt.Sprintf("ADD of %s returned %s after %s: not idempotent", c.Owner, c.Addr, a))
		}
		got[c.Owner] = c.Addr
	}
	for o, a := range final {
		if g, ok := got[o]; ok && g != a {
			out = append(out, fmt.Sprintf("%s was given %s but the store shows %s", o, g, a))
		}
	}
	return out
}

// capacityLies reports every "no capacity" (code 102) answered while fewer
// owners than the pool's size could possibly have held an address: an
// owner possibly holds one from the call of its first ADD until the return
// of its first successful DEL or release (for ever if none, or if one of
// its ADDs was ambiguous: that one may take effect later).
func capacityLies(size int, calls []call) []string {
	type span struct {
		from, till int64
		late       bool // an ambiguous ADD may take effect after the release
	}
	spans := map[string]*span{}
	for _, c := range calls {
		s, ok := spans[c.Owner]
		if !ok {
			s = &span{from: -1, till: -1}
			spans[c.Owner] = s
		}
		switch {
		case c.Verb == verbAdd && c.Outcome != outFailed:
			if s.from < 0 || c.Call < s.from {
				s.from = c.Call
			}
			s.late = s.late || c.Outcome == outAmbiguous
		case (c.Verb == verbDel || c.Verb == verbRelease) && c.Outcome == outOK && (s.till < 0 || c.Return < s.till):
			s.till = c.Return
		}
	}
	for _, s := range spans {
		if s.late {
			s.till = -1
		}
	}
	var out []string
	for _, c := range calls {
		if c.Verb != verbAdd || c.Code != 102 {
			continue
		}
		n := 0
		for o, s := range spans {
			if o != c.Owner && s.from >= 0 && s.from <= c.Return && (s.till < 0 || s.till >= c.Call) {
				n++
			}
		}
		if n < size {
			out = append(out, fmt.Sprintf("ADD of %s answered no capacity while at most %d of %d addresses could be held", c.Owner, n, size))
		}
	}
	return out
}

// duplicate is one address (or published port: "tcp/30001") found with
// two owners, and where.
type duplicate struct {
	what   string
	owners [2]string // sorted
	where  string
}

func newDuplicate(what, o1, o2, where string) duplicate {
	if o2 < o1 {
		o1, o2 = o2, o1
	}
	return duplicate{what: what, owners: [2]string{o1, o2}, where: where}
}

func (d duplicate) String() string {
	return fmt.Sprintf("%s held by %s and %s (%s)", d.what, d.owners[0], d.owners[1], d.where)
}

// distinctDuplicates counts the (address, owners) cases among ds, however
// many times they were found.
func distinctDuplicates(ds []duplicate) int {
	seen := map[[3]string]bool{}
	for _, d := range ds {
		seen[[3]string{d.what, d.owners[0], d.owners[1]}] = true
	}
	return len(seen)
}

// duplicatesSeen finds, in the history, every time a call handed an owner an
// address that another owner certainly held then: the other's ADD had
// returned it before this call was invoked, and the other had not yet been
// asked to give it up (DEL or release) when this call returned.
func duplicatesSeen(calls []call) []duplicate {
	return clashesSeen(calls, func(c call) string { return c.Addr.String() }, false)
}

// clashesSeen is duplicatesSeen for what key names of a successful ADD (an
// address, or a published port). With failedAddEnds, an owner's tenure
// also ends when a failed ADD of it is invoked, and a successful ADD after
// that starts a new one: portmap-ingress's ADD that cannot install its
// forwards releases the attachment's ports, those of an earlier ADD of
// the same attachment too (a failed ADD leaves nothing; the runtime DELs
// it next), so after a failed ADD the owner no longer certainly holds
// what an earlier one returned. ipam-ring's failed ADD releases nothing
// it held before: addresses keep the stricter rule.
func clashesSeen(calls []call, key func(call) string, failedAddEnds bool) []duplicate {
	type tenure struct {
		owner      string
		from, till int64 // from: first definite ADD return; till: first DEL/release call
		what       string
	}
	var tenures []*tenure
	current := map[string]*tenure{} // each owner's latest tenure
	sorted := slices.Clone(calls)
	sort.SliceStable(sorted, func(i, j int) bool { return sorted[i].Call < sorted[j].Call })
	end := func(owner string, at int64) {
		if t, ok := current[owner]; ok && (t.till < 0 || at < t.till) {
			t.till = at
		}
	}
	for _, c := range sorted {
		switch {
		case c.Verb == verbAdd && c.Outcome == outOK:
			t, ok := current[c.Owner]
			switch {
			case !ok || failedAddEnds && t.till >= 0:
				t = &tenure{owner: c.Owner, from: c.Return, till: -1, what: key(c)}
				current[c.Owner] = t
				tenures = append(tenures, t)
			case c.Return < t.from:
				t.from = c.Return
			}
		case c.Verb == verbAdd && failedAddEnds:
			end(c.Owner, c.Call)
		case c.Verb == verbDel || c.Verb == verbRelease:
			end(c.Owner, c.Call)
		}
	}
	byWhat := map[string][]*tenure{}
	for _, t := range tenures {
		byWhat[t.what] = append(byWhat[t.what], t)
	}
	var out []duplicate
	for _, c := range calls {
		if c.Verb != verbAdd || c.Outcome != outOK {
			continue
		}
		k := key(c)
		for _, t := range byWhat[k] {
			if t.owner != c.Owner && t.from < c.Call && (t.till < 0 || c.Return < t.till) {
				out = append(out, newDuplicate(k, c.Owner, t.owner, "the history: "+c.Owner+" was given it while "+t.owner+" held it"))
			}
		}
	}
	return out
}

// reading is what the suite read of the store at one moment: who holds
// what according to the owner records, and which owner each address's own
// key names (nil when not read).
type reading struct {
	owners holdings
	keys   map[netip.Addr]string
}

// storeDuplicates finds the addresses two owners hold in any of the
// readings: listed by two owner records, or listed by one owner's record
// while the address's key names another.
func storeDuplicates(readings ...reading) []duplicate {
	var out []duplicate
	for i, r := range readings {
		by := map[netip.Addr][]string{}
		for o, a := range r.owners {
			by[a] = append(by[a], o)
		}
		for a, owners := range by {
			slices.Sort(owners)
			for j := 1; j < len(owners); j++ {
				out = append(out, newDuplicate(a.String(), owners[0], owners[j], fmt.Sprintf("store reading %d: two owner records", i)))
			}
			if k := r.keys[a]; k != "" {
				for _, o := range owners {
					if o != k {
						out = append(out, newDuplicate(a.String(), o, k, fmt.Sprintf("store reading %d: %s's record lists it, its key names %s", i, o, k)))
					}
				}
			}
		}
	}
	return out
}
