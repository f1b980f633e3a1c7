package portmap

import (
	"context"
	"errors"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/ringipam/ringipam/pkg/portalloc"
	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/storeconfig"
)

// Plugin-specific CNI error codes, numbered as ipam-ring's (100 and up).
// They are part of the plugin's documented interface: do not renumber.
const (
	// CodeInUse: a requested host port is published by another attachment
	// (or hidden by an ingress port, or would shadow a host port); the
	// message names the holder and its host.
	CodeInUse uint = 100
	// CodeExhausted: no free port left in the dynamic range for the
	// protocol the message names.
	CodeExhausted uint = 102
	// CodeCheckFailed: CHECK found the ports or forwards gone or different.
	CodeCheckFailed uint = 104
	// CodeDuplicate: the request asks for one port twice.
	CodeDuplicate uint = 105
)

// CodePluginNotAvailable is the CNI spec's code 50, returned by STATUS.
const CodePluginNotAvailable uint = 50

// ErrCheckFailed is wrapped by CHECK's findings.
var ErrCheckFailed = errors.New("published ports check failed")

// CNIError maps an error of this package, pkg/portalloc or pkg/store to the
// CNI error the runtime sees. A *types.Error passes through; anything else
// unclaimed is code 999 with its message.
func CNIError(err error) *types.Error {
	var te *types.Error
	code := types.ErrInternal
	switch {
	case err == nil:
		return nil
	case errors.As(err, &te):
		return te
	case errors.Is(err, ErrBadConfig), errors.Is(err, portalloc.ErrInvalid), errors.Is(err, storeconfig.ErrInvalid):
		code = types.ErrInvalidNetworkConfig
	case errors.Is(err, ErrCheckFailed):
		code = CodeCheckFailed
	case errors.Is(err, portalloc.ErrInUse):
		code = CodeInUse
	case errors.Is(err, portalloc.ErrDuplicate):
		code = CodeDuplicate
	case errors.Is(err, portalloc.ErrExhausted):
		code = CodeExhausted
	case errors.Is(err, store.ErrUnavailable), errors.Is(err, portalloc.ErrTryAgain),
		errors.Is(err, store.ErrConflict), errors.Is(err, context.DeadlineExceeded):
		code = types.ErrTryAgainLater
	}
	return types.NewError(code, err.Error(), "")
}

func wire(err error) error {
	if err == nil {
		return nil
	}
	return CNIError(err)
}
