package portalloc

import (
	"errors"
	"testing"
)

// One test per XXX of the seed, on the seed's own example: each runs the
// example on ringipam's allocator and on the SwarmKit variant (that rule
// switched off) and shows the variant's failure.

func ingressDyn(name string) Port { return Port{Mode: Ingress, Name: name, Protocol: "tcp"} }
func ingressAt(name string, n uint16) Port {
	return Port{Mode: Ingress, Name: name, Protocol: "tcp", Number: n}
}

// apply runs spec for endpoint id on host against v and returns the stored
// endpoint and the new view.
func applySpec(v memView, old Endpoint, id, host string, spec []Port, r Rules) (Endpoint, memView, error) {
	res, err := Plan(v, Request{Endpoint: id, Host: host, Old: old, Spec: spec, Lo: 30000, Hi: 32767, Start: 30000, Rules: r})
	if err != nil {
		return old, v, err
	}
	return Endpoint{Host: host, Spec: spec, Ports: res.Ports}, v.apply(res.Changes), nil
}

func swarmkit(off func(*Rules)) Rules {
	r := AllRules
	off(&r)
	return r
}

// XXX 1: [foo dynamic] then [foo dynamic, bar published 30000]: SwarmKit
// reuses 30000 for foo although bar now needs it, and rejects the update.
func TestXXX1OldDynamicPortGivenUpForAStaticEntry(t *testing.T) {
	run := func(r Rules) (Endpoint, error) {
		e, v, err := applySpec(memView{}, Endpoint{}, "e", "h1", []Port{ingressDyn("foo")}, r)
		if err != nil || e.Ports[0].Number != 30000 {
			t.Fatalf("first spec: %+v %v", e, err)
		}
		e, _, err = applySpec(v, e, "e", "h1", []Port{ingressDyn("foo"), ingressAt("bar", 30000)}, r)
		return e, err
	}
	if _, err := run(swarmkit(func(r *Rules) { r.GiveUpForcedOld = false })); !errors.Is(err, ErrDuplicate) {
		t.Fatalf("SwarmKit's behaviour: %v, want the rejection the seed describes", err)
	}
	e, err := run(AllRules)
	if err != nil || e.Ports[1].Number != 30000 || e.Ports[0].Number == 30000 {
		t.Fatalf("ringipam: %+v %v; want bar on 30000 and foo on another port", e.Ports, err)
	}
}

// XXX 2: [foo dynamic, foo dynamic]: SwarmKit tries 30000 for both and
// rejects.
func TestXXX2SimilarDynamicEntriesGetDistinctNumbers(t *testing.T) {
	spec := []Port{ingressDyn("foo"), ingressDyn("foo")}
	if _, _, err := applySpec(memView{}, Endpoint{}, "e", "h1", spec, swarmkit(func(r *Rules) { r.DistinctSimilar = false })); !errors.Is(err, ErrDuplicate) {
		t.Fatalf("SwarmKit's behaviour: %v, want a rejection", err)
	}
	e, _, err := applySpec(memView{}, Endpoint{}, "e", "h1", spec, AllRules)
	if err != nil || e.Ports[0].Number == e.Ports[1].Number {
		t.Fatalf("ringipam: %+v %v", e.Ports, err)
	}
}

// XXX 3: a host port on 30000 on some host; a new service asks for a
// dynamic ingress port: SwarmKit gives it 30000 and the host port's service
// becomes unreachable.
func TestXXX3DynamicIngressNeverShadowsAHostPort(t *testing.T) {
	run := func(r Rules) uint16 {
		_, v, err := applySpec(memView{}, Endpoint{}, "web", "h2", []Port{{Mode: Host, Name: "web", Protocol: "tcp", Number: 30000}}, r)
		if err != nil {
			t.Fatal(err)
		}
		e, _, err := applySpec(v, Endpoint{}, "api", "h1", []Port{ingressDyn("api")}, r)
		if err != nil {
			t.Fatal(err)
		}
		return e.Ports[0].Number
	}
	if n := run(swarmkit(func(r *Rules) { r.IngressAvoidsHostPorts = false })); n != 30000 {
		t.Fatalf("SwarmKit's behaviour gave %d, want the shadowing 30000", n)
	}
	if n := run(AllRules); n == 30000 {
		t.Fatal("ringipam gave the dynamic ingress port the host port's 30000")
	}
}

// XXX 4: an ingress port holds 30000; a host-mode port on 30000 would be
// unreachable on every host: SwarmKit accepts it.
func TestXXX4HostPortHiddenByIngressIsRefused(t *testing.T) {
	run := func(r Rules) error {
		_, v, err := applySpec(memView{}, Endpoint{}, "ing", "h1", []Port{ingressAt("ing", 30000)}, r)
		if err != nil {
			t.Fatal(err)
		}
		_, _, err = applySpec(v, Endpoint{}, "hp", "h2", []Port{{Mode: Host, Name: "hp", Protocol: "tcp", Number: 30000}}, r)
		return err
	}
	if err := run(swarmkit(func(r *Rules) { r.RefuseHiddenHostPorts = false })); err != nil {
		t.Fatalf("SwarmKit's behaviour: %v, want the hidden port accepted", err)
	}
	err := run(AllRules)
	var inUse *InUseError
	if !errors.As(err, &inUse) || inUse.Holder != "ing" || inUse.Mode != Ingress {
		t.Fatalf("ringipam: %v, want in use by the ingress port of ing", err)
	}
}

// XXX 5 (host/host collisions "need to be avoided by the scheduler"):
// two host-mode ports 8080 on one host.
func TestXXX5HostPortsOnOneHostNeverCollide(t *testing.T) {
	hp := func(name string) []Port { return []Port{{Mode: Host, Name: name, Protocol: "tcp", Number: 8080}} }
	run := func(r Rules) error {
		_, v, err := applySpec(memView{}, Endpoint{}, "a", "h1", hp("a"), r)
		if err != nil {
			t.Fatal(err)
		}
		if _, _, err := applySpec(v, Endpoint{}, "other-host", "h2", hp("b"), r); err != nil {
			t.Fatalf("the same host port on another host: %v", err)
		}
		_, _, err = applySpec(v, Endpoint{}, "b", "h1", hp("b"), r)
		return err
	}
	if err := run(swarmkit(func(r *Rules) { r.HostPortsUnique = false })); err != nil {
		t.Fatalf("SwarmKit's behaviour: %v, want the collision accepted", err)
	}
	if err := run(AllRules); !errors.Is(err, ErrInUse) {
		t.Fatalf("ringipam: %v, want in use", err)
	}
}

// XXX 6: "if we have two similar specs then we only copy the existing
// allocation for the first one": re-applying an identical spec changes the
// second port.
func TestXXX6IdenticalSpecKeepsItsPorts(t *testing.T) {
	run := func(r Rules) (before, after []Port) {
		v := memView{}
		// 30000 is taken while e allocates, so e's ports are 30001 and 30002;
		// then 30000 is freed.
		blocker, v, err := applySpec(v, Endpoint{}, "blocker", "h1", []Port{ingressDyn("x")}, r)
		if err != nil {
			t.Fatal(err)
		}
		spec := []Port{ingressDyn("foo"), ingressDyn("foo")}
		e, v, err := applySpec(v, Endpoint{}, "e", "h1", spec, r)
		if err != nil {
			t.Fatal(err)
		}
		if _, v, err = applySpec(v, blocker, "blocker", "h1", nil, r); err != nil {
			t.Fatal(err)
		}
		again, _, err := applySpec(v, e, "e", "h1", spec, r)
		if err != nil {
			t.Fatal(err)
		}
		return e.Ports, again.Ports
	}
	if b, a := run(swarmkit(func(r *Rules) { r.StableRecovery = false })); a[1] == b[1] {
		t.Fatalf("SwarmKit's behaviour kept %v -> %v, want the second port to move", b, a)
	}
	if b, a := run(AllRules); a[0] != b[0] || a[1] != b[1] {
		t.Fatalf("ringipam: re-applying the spec moved %v -> %v", b, a)
	}
}
