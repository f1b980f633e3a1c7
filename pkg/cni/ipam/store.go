package ipam

import (
	"context"
	"encoding/json"
	"fmt"
	"hash/fnv"

	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/storeconfig"
)

// storeSettings is the validated "store" object.
type storeSettings = storeconfig.Config

// parseStore validates the "store" object at the door; absent means the
// local store at its default path.
func parseStore(raw json.RawMessage) (storeSettings, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return storeconfig.Config{}, nil
	}
	c, err := storeconfig.Parse(raw)
	if err != nil {
		return c, badConfig("store: %v", err)
	}
	return c, nil
}

// openStore opens the configured store. Neither backend blocks on the
// network or the file here: the first store call does, under ctx.
func openStore(_ context.Context, s storeSettings) (store.Store, error) {
	return storeconfig.Open(s)
}

// clusterNotes keeps the pool notes (pool.WithNotes) of one store under
// names tagged with it, beside the host locks of the same pools.
type clusterNotes struct {
	notes pool.NoteKeeper
	tag   string
}

func (n clusterNotes) ReadNote(name string) []byte { return n.notes.ReadNote(name + "." + n.tag) }

func (n clusterNotes) WriteNote(name string, note []byte) {
	n.notes.WriteNote(name+"."+n.tag, note)
}

// clusterTag names an etcd store's cluster and prefix in eight hex digits,
// from its identity as the agent compares it (storeconfig.Identity.Key).
func clusterTag(s storeSettings) string {
	h := fnv.New32a()
	h.Write([]byte(s.Identity().Key()))
	return fmt.Sprintf("%08x", h.Sum32())
}
