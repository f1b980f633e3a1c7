// Package relay carries store.Store calls over a local unix socket: the
// host agent (ringipamd) serves its etcd store on the socket (Serve), and
// the short-lived plugins send their Get, Scan and Commit calls there
// (Client) instead of opening a connection to etcd of their own.
//
// Why: a plugin process lives for one CNI call. Reaching etcd itself costs
// it a TCP (and TLS) connection and two requests through etcd's JSON
// gateway; through the agent it costs one unix connection, and the agent's
// long-lived gRPC connection to etcd does the rest. The etcd round trips
// per call are the same: every store call is relayed as one call of the
// agent's store, with the same conditions.
//
// Contract:
//   - The Client is a store.Store with the same contract as the store it
//     reaches (one store contract suite runs on it). Errors come back
//     wrapping the same sentinels: store.ErrConflict, store.ErrUnavailable,
//     store.ErrTooLarge, context.Canceled and context.DeadlineExceeded.
//   - A Client first says which cluster it means (Identity: the key prefix
//     and the etcd endpoints of its configuration). The server accepts only
//     if the prefix is its own and the endpoint lists share one endpoint;
//     otherwise, and when nothing listens on the socket, the Client uses
//     its direct store instead (the configured etcd, as without an agent),
//     for the rest of its life. Nothing is configured for the relay on the
//     plugin's side: the socket's default path is DefaultSocket.
//   - Every call carries the caller's deadline; the server runs the call
//     under it, and the client stops waiting at it. A connection lost after
//     a Commit was sent is reported as store.ErrUnavailable: the commit may
//     or may not have happened, as with a lost etcd connection. A lost
//     connection during a read is retried on the direct store.
//   - The socket is created mode 0600: whoever may use it may use the
//     agent's etcd credentials. The server also checks every connection's
//     peer credentials (SO_PEERCRED, package internal/peercred): only
//     Server.PeerUID (root by default) is served, others are closed
//     unread. A request line over MaxRequest, or one that does not decode,
//     closes its connection; each connection has its own goroutine and a
//     read deadline, so a stalled or hostile client holds up nobody else.
//   - Range conditions (store.Cond with End) are relayed only to an agent
//     that said in its hello answer that it carries them (featureRangeConds):
//     an agent from before ignores the field and would check "the first key
//     is absent" instead. To such an agent a commit with a range condition
//     is refused, nothing sent, with an error saying the agent is older
//     than the plugin; every other call goes on as before.
//   - Whole invocations (Invoke, Invoker; invoke.go): a plugin may instead
//     send its whole CNI call, which the agent runs on its own store, the
//     local store included, when its Invoker accepts it. The plugin runs
//     the call itself when nothing answers or the agent refuses.
//
// Wire format: one JSON object per line each way, a request then its
// answer; one call at a time per connection; an invocation is alone on
// its connection.
package relay

import (
	"context"
	"errors"
	"fmt"

	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/storeconfig"
)

// DefaultSocket is where the agent serves its store and where clients look
// for it: storeconfig.DefaultAgentSocket.
const DefaultSocket = storeconfig.DefaultAgentSocket

// Identity names the cluster a client means, or a server serves.
type Identity = storeconfig.Identity

// request is one call on the wire.
type request struct {
	Op string `json:"op"` // hello, get, scan, commit, invoke
	// Deadline of the call in milliseconds from when the server reads it
	// (0: none).
	TimeoutMS int64     `json:"timeoutMs,omitempty"`
	Identity  *Identity `json:"identity,omitempty"`
	// Keys are bytes, not JSON strings: a key need not be UTF-8.
	Keys  [][]byte   `json:"keys,omitempty"`
	From  []byte     `json:"from,omitempty"`
	To    []byte     `json:"to,omitempty"`
	Limit int        `json:"limit,omitempty"`
	Conds []wireCond `json:"conds,omitempty"`
	Ops   []wireOp   `json:"ops,omitempty"`
	// Invocation is the whole plugin call of an "invoke" (invoke.go).
	Invocation *Invocation `json:"invocation,omitempty"`
	// needsRanges: a commit with a range condition (not sent).
	needsRanges bool
}

// wireCond is a store.Cond; End is set for a range condition, which only
// an agent whose hello answered featureRangeConds is sent (an agent from
// before would ignore the field and check the wrong condition).
type wireCond struct {
	Key      []byte `json:"k"`
	Revision int64  `json:"r"`
	End      []byte `json:"e,omitempty"`
}

// featureRangeConds is the feature of an agent that carries range
// conditions (store.Cond.End) to its store.
const featureRangeConds = "range-conds"

type wireOp struct {
	Key    []byte `json:"k"`
	Value  []byte `json:"v,omitempty"`
	Delete bool   `json:"d,omitempty"`
}

type wireKV struct {
	Key      []byte `json:"k"`
	Value    []byte `json:"v"`
	Revision int64  `json:"r,omitempty"`
}

// answer is one call's result on the wire.
type answer struct {
	KVs   []wireKV   `json:"kvs,omitempty"`
	Error *wireError `json:"error,omitempty"`
	// Outcome answers an "invoke" (invoke.go).
	Outcome *Outcome `json:"outcome,omitempty"`
	// Features answers a "hello": what the agent understands beyond the
	// first protocol (featureRangeConds).
	Features []string `json:"features,omitempty"`
}

// wireError is an error with the sentinel it wrapped, by name.
type wireError struct {
	Kind    string `json:"kind,omitempty"`
	Message string `json:"message"`
}

// Kinds of wire errors.
const (
	kindConflict    = "conflict"
	kindUnavailable = "unavailable"
	kindTooLarge    = "too-large"
	kindCanceled    = "canceled"
	kindDeadline    = "deadline"
	kindRefused     = "refused" // hello: not the cluster the client means
)

var kinds = []struct {
	kind string
	err  error
}{
	{kindConflict, store.ErrConflict},
	{kindUnavailable, store.ErrUnavailable},
	{kindTooLarge, store.ErrTooLarge},
	{kindCanceled, context.Canceled},
	{kindDeadline, context.DeadlineExceeded},
}

func toWire(err error) *wireError {
	if err == nil {
		return nil
	}
	we := &wireError{Message: err.Error()}
	for _, k := range kinds {
		if errors.Is(err, k.err) {
			we.Kind = k.kind
			break
		}
	}
	return we
}

// remoteError is an error of the agent's store, as the agent described it.
type remoteError struct {
	msg  string
	kind error // the sentinel, or nil
}

func (e *remoteError) Error() string { return "via ringipamd: " + e.msg }
func (e *remoteError) Unwrap() error { return e.kind }

func fromWire(we *wireError) error {
	if we == nil {
		return nil
	}
	e := &remoteError{msg: we.Message}
	for _, k := range kinds {
		if we.Kind == k.kind {
			e.kind = k.err
		}
	}
	if e.kind == nil && we.Kind != "" && we.Kind != kindRefused {
		return fmt.Errorf("%w (unknown error kind %q)", e, we.Kind)
	}
	return e
}
