package ipam

import (
	"context"
	"strings"
	"testing"

	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/memory"
)

// A store written by a newer ringipam (layout version after this code's)
// is refused with CodeDefinitionMismatch and a message that says what to
// do, never 999 or 11: the runtime must not retry a node that needs an
// upgrade.
func TestNewerStoreLayoutIsAClearError(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	if err := st.Commit(ctx, nil, []store.Op{store.Put("v", []byte("999"))}); err != nil {
		t.Fatal(err)
	}
	a, err := pool.New(st, "h1")
	if err != nil {
		t.Fatal(err)
	}
	_, err = a.Allocate(ctx, pool.Request{Owner: pool.Owner{Kind: pool.KindCNI, Network: "n", ContainerID: "c"},
		Wants: []pool.Want{{Pool: "p", Role: pool.RoleIP}}})
	ce := CNIError(err)
	if ce == nil || ce.Code != CodeDefinitionMismatch || !strings.Contains(ce.Msg, "upgrade ringipam") || !strings.Contains(ce.Msg, `"999"`) {
		t.Fatalf("allocation on a layout-999 store: %+v (%v), want code %d naming the layout and the upgrade", ce, err, CodeDefinitionMismatch)
	}
}
