package ipam

import (
	"context"
	"strings"
	"testing"

	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/store/memory"
)

// STATUS answers for the network's mode: with one free address left a
// shared-mode ADD can be served, a per-container ADD (address plus its own
// gateway) cannot (issue 8, item 6).
func TestStatusAnswersForTheNetworksMode(t *testing.T) {
	ctx := context.Background()
	a := newAlloc(t, memory.New(), "h1")
	// .1 is the gateway; .2-.4 are three allocatable addresses.
	const ranges = `"ranges":[[{"subnet":"198.18.80.0/29","rangeEnd":"198.18.80.4"}]],"pools":["p80"]`
	per := mustLoad(t, `{"host":"h1","gatewayMode":"per-container",`+ranges+`}`, "")
	shared := mustLoad(t, `{"host":"h1",`+ranges+`}`, "")
	if _, err := Add(ctx, a, per, Attachment{ContainerID: "c1", IfName: "eth0"}); err != nil {
		t.Fatal(err) // takes two: one is left
	}
	if u, _ := a.Usage(ctx, "p80"); u.Available != 1 {
		t.Fatalf("available %d, want 1", u.Available)
	}
	if err := Status(ctx, a, shared); err != nil {
		t.Fatalf("shared-mode STATUS with one free address: %v", err)
	}
	err := Status(ctx, a, per)
	if err == nil || !strings.Contains(err.Error(), "needs 2") {
		t.Fatalf("per-container STATUS with one free address: %v, want not ready", err)
	}
	if statusError(err).Code != CodePluginNotAvailable {
		t.Fatalf("code %d", statusError(err).Code)
	}
	// And the ADD it predicts does fail.
	if _, err := Add(ctx, a, per, Attachment{ContainerID: "c2", IfName: "eth0"}); err == nil {
		t.Fatal("per-container ADD with one free address succeeded")
	}
}

// STATUS of a host that was orphaned while away fails loudly until it is
// acknowledged.
func TestStatusSaysTheHostWasOrphaned(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	b := newAlloc(t, st, "h1")
	c := mustLoad(t, `{"host":"h1","ranges":[[{"subnet":"198.18.81.0/24"}]]}`, "")
	if _, err := Add(ctx, b, c, Attachment{ContainerID: "c1", IfName: "eth0"}); err != nil {
		t.Fatal(err)
	}
	other, _ := pool.New(st, "h2")
	if _, err := other.Reclaim(ctx, "h1", pool.ReclaimOptions{}); err != nil {
		t.Fatal(err)
	}
	err := Status(ctx, b, c)
	if err == nil || !strings.Contains(err.Error(), "was orphaned") {
		t.Fatalf("STATUS of an orphaned host: %v", err)
	}
	if err := Check(ctx, b, c, Attachment{ContainerID: "c1", IfName: "eth0"}); err == nil {
		t.Fatal("CHECK of an attachment whose allocation was reclaimed passed")
	}
	if _, err := b.AckOrphaned(ctx); err != nil {
		t.Fatal(err)
	}
	if err := Status(ctx, b, c); err != nil {
		t.Fatalf("STATUS after the acknowledgement: %v", err)
	}
}
