package pool

import (
	"context"
	"testing"
	"time"

	"github.com/ringipam/ringipam/pkg/store/memory"
)

// A new allocation records the pod of its request and when it was made
// (the host agent's collection of vanished pods reads both); a repeated
// ADD keeps them as first written; an owner that is no pod's records
// neither, and List returns them.
func TestAllocationRecordsPod(t *testing.T) {
	ctx := context.Background()
	now := time.Unix(1_000_000, 0)
	a, err := New(memory.New(), "h1", WithClock(func() time.Time { return now }))
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Define(ctx, v4Def("p", "198.18.0.0/29")); err != nil {
		t.Fatal(err)
	}
	pod := &PodRef{Namespace: "default", Name: "web-1", UID: "u-1"}
	if _, err := a.Allocate(ctx, Request{Owner: own("c1"), Wants: ipWant("p"), Pod: pod}); err != nil {
		t.Fatal(err)
	}
	now = now.Add(time.Hour)
	again, err := a.Allocate(ctx, Request{Owner: own("c1"), Wants: ipWant("p"), Pod: &PodRef{Namespace: "default", Name: "web-1", UID: "u-2"}})
	if err != nil {
		t.Fatal(err)
	}
	if again.Pod == nil || *again.Pod != *pod || again.Since != 1_000_000 {
		t.Errorf("repeated ADD: pod %+v since %d, want %+v since 1000000", again.Pod, again.Since, pod)
	}
	if _, err := a.Allocate(ctx, Request{Owner: own("c2"), Wants: ipWant("p")}); err != nil {
		t.Fatal(err)
	}
	recs, err := a.List(ctx, Filter{Kind: KindCNI, Host: "h1"})
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]Allocation{}
	for _, r := range recs {
		got[r.Owner.ContainerID] = r
	}
	if r := got["c1"]; r.Pod == nil || *r.Pod != *pod || r.Since != 1_000_000 {
		t.Errorf("listed c1: pod %+v since %d, want %+v since 1000000", r.Pod, r.Since, pod)
	}
	if r := got["c2"]; r.Pod != nil || r.Since != 0 {
		t.Errorf("listed c2 (no pod): pod %+v since %d, want neither", r.Pod, r.Since)
	}
}
