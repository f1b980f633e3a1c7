package driver

import (
	"context"
	"strings"
	"testing"

	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/memory"
)

// The Docker driver answers a store of a newer layout with a message
// dockerd prints as it is: the cause and "upgrade ringipam", classed as a
// mismatch (not retryable, not internal).
func TestNewerStoreLayoutMessage(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	if err := st.Commit(ctx, nil, []store.Op{store.Put("v", []byte("999"))}); err != nil {
		t.Fatal(err)
	}
	a, _ := pool.New(st, "h1")
	_, err := a.Allocate(ctx, pool.Request{Owner: pool.Owner{Kind: pool.KindDocker, Network: "n", ContainerID: "02:42:c6:12:00:02"},
		Wants: []pool.Want{{Pool: "p", Role: pool.RoleIP}}})
	if msg := Message(err); Class(err) != "mismatch" || !strings.HasPrefix(msg, "ringipam: unsupported store layout") || !strings.Contains(msg, "upgrade ringipam") {
		t.Fatalf("class %q, message %q; want a mismatch that names the layout and the upgrade", Class(err), msg)
	}
}
