package ipamring

import (
	"context"
	"encoding/json"

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
