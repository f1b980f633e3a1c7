// Package connctx ties a network connection's blocking reads and writes to a
// context, for the stores' own wire clients (etcd's JSON gateway, the
// agent's store socket).
//
// Contract: after Bind, a read or write on the connection ends no later than
// the context's deadline, and at once when the context is cancelled; the
// returned stop ends the latter (the deadline stays until set again).
package connctx

import (
	"context"
	"net"
	"time"
)

// Bind sets conn's deadline to ctx's (none when ctx has none) and arranges
// for a cancellation of ctx to end a blocked read or write at once. Call
// stop when the exchange is over. An error means the deadline could not be
// set; nothing was arranged then.
func Bind(ctx context.Context, conn net.Conn) (stop func() bool, err error) {
	deadline, _ := ctx.Deadline() // the zero time (no deadline) when none
	if err := conn.SetDeadline(deadline); err != nil {
		return nil, err
	}
	return context.AfterFunc(ctx, func() { _ = conn.SetDeadline(time.Unix(1, 0)) }), nil
}
