package ipam

import (
	"errors"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/ringipam/ringipam/pkg/containernet"
	"github.com/ringipam/ringipam/pkg/pool"
)

// Plugin-specific CNI error codes (the CNI spec reserves 100 and up for
// plugins). They are part of the plugin's documented interface: do not
// renumber.
const (
	// CodeAlreadyInUse: a requested static address (or reservation name) is
	// held by another owner; the message names the holder.
	CodeAlreadyInUse uint = 100
	// CodeAlreadyExists: this owner already holds a different address on
	// the network; release it (DEL) first.
	CodeAlreadyExists uint = 101
	// CodeNoCapacity: the pool has no free address; the message says how
	// many of how many are in use.
	CodeNoCapacity uint = 102
	// CodeDefinitionMismatch: the pool is recorded in the store with a
	// different definition than this host's configuration.
	CodeDefinitionMismatch uint = 103
	// CodeCheckFailed: CHECK found the allocation gone or different from
	// prevResult.
	CodeCheckFailed uint = 104
)

// CodePluginNotAvailable is the CNI spec's code 50 ("the plugin is not
// available"), returned by STATUS; pkg/types has no constant for it.
const CodePluginNotAvailable uint = 50

// ErrCheckFailed is wrapped by Check's findings.
var ErrCheckFailed = errors.New("allocation check failed")

// CNIError maps any error of this package, pkg/pool or pkg/store to the CNI
// error the runtime sees. A *types.Error passes through unchanged; errors
// nothing else claims become code 999 with their message.
func CNIError(err error) *types.Error {
	if err == nil {
		return nil
	}
	var te *types.Error
	switch {
	case errors.As(err, &te):
		return te
	case errors.Is(err, ErrCheckFailed):
		return types.NewError(CodeCheckFailed, err.Error(), "")
	case errors.Is(err, containernet.ErrViolation):
		// The owner holds something this mode cannot read as a container
		// network (e.g. a shared-mode address after the network switched to
		// per-container; the finding wraps ErrInvalid too): it must be
		// released (DEL) first.
		return types.NewError(CodeAlreadyExists, err.Error(), "")
	case errors.Is(err, ErrBadConfig):
		return types.NewError(types.ErrInvalidNetworkConfig, err.Error(), "")
	}
	return types.NewError(wireCode[pool.Classify(err)], err.Error(), "")
}

// wireCode is the CNI code of each pool.Class (pool.Classify ranks them the
// same way for every front end).
var wireCode = map[pool.Class]uint{
	pool.ClassInUse:       CodeAlreadyInUse,
	pool.ClassExists:      CodeAlreadyExists,
	pool.ClassNoCapacity:  CodeNoCapacity,
	pool.ClassMismatch:    CodeDefinitionMismatch,
	pool.ClassUnknownPool: types.ErrInvalidNetworkConfig,
	pool.ClassInvalid:     types.ErrInvalidNetworkConfig,
	pool.ClassUnavailable: types.ErrTryAgainLater,
	pool.ClassTryAgain:    types.ErrTryAgainLater,
	pool.ClassTimeout:     types.ErrTryAgainLater,
	pool.ClassInternal:    types.ErrInternal,
}

// statusError maps a STATUS failure: bad configuration stays code 7,
// everything else means "cannot serve ADD now" (code 50).
func statusError(err error) *types.Error {
	if err == nil {
		return nil
	}
	if errors.Is(err, ErrBadConfig) {
		return CNIError(err)
	}
	return types.NewError(CodePluginNotAvailable, err.Error(), "")
}
