package relay

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"slices"
	"time"

	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/internal/connctx"
)

// dialTimeout bounds the connection to the agent and its hello: a local
// socket answers in microseconds or not at all.
const dialTimeout = time.Second

// Client is a store.Store that relays its calls to the agent's socket when
// an agent serves the cluster the client means, and otherwise uses its
// direct store. Safe for concurrent use (calls take turns). Make it with
// NewClient.
type Client struct {
	socket string
	id     Identity
	open   func() (store.Store, error)

	turn   chan struct{} // one call at a time
	state  int           // see the constants below
	conn   net.Conn
	r      *bufio.Reader
	direct store.Store
	why    error // why the relay is not used (for Via)
	// ranges: the agent's hello said it carries range conditions.
	ranges bool
}

const (
	stateUnknown = iota // not tried yet
	stateRelay          // connected and greeted
	stateDirect         // no agent, or not ours: the direct store
)

// NewClient returns a client of the agent at socket for the cluster id;
// openDirect makes the store used when no agent serves it (it is called at
// most once, when first needed).
func NewClient(socket string, id Identity, openDirect func() (store.Store, error)) *Client {
	return &Client{socket: socket, id: id, open: openDirect, turn: make(chan struct{}, 1)}
}

var (
	_ store.Store      = (*Client)(nil)
	_ store.Speculator = (*Client)(nil)
)

// Via says where the calls go: "ringipamd at <socket>", or the direct
// store and why the agent is not used; "" before the first call.
func (c *Client) Via() string {
	switch c.state {
	case stateRelay:
		return "ringipamd at " + c.socket
	case stateDirect:
		return fmt.Sprintf("direct (%v)", c.why)
	}
	return ""
}

// Get implements store.Store.
func (c *Client) Get(ctx context.Context, keys ...string) ([]store.KV, error) {
	out, done, err := store.StartGet(ctx, keys)
	if done {
		return out, err
	}
	req := &request{Op: "get", Keys: make([][]byte, len(keys))}
	for i, k := range keys {
		req.Keys[i] = []byte(k)
	}
	return c.run(ctx, req, true, func(d store.Store) ([]store.KV, error) {
		return d.Get(ctx, keys...)
	})
}

// Scan implements store.Store.
func (c *Client) Scan(ctx context.Context, from, to string, limit int) ([]store.KV, error) {
	if to <= from {
		return nil, ctx.Err()
	}
	return c.run(ctx, &request{Op: "scan", From: []byte(from), To: []byte(to), Limit: limit}, true, func(d store.Store) ([]store.KV, error) {
		return d.Scan(ctx, from, to, limit)
	})
}

// Commit implements store.Store.
func (c *Client) Commit(ctx context.Context, conds []store.Cond, ops []store.Op) error {
	if err := store.CheckCommit(conds, ops); err != nil {
		return fmt.Errorf("relayed store: %w", err)
	}
	req := &request{Op: "commit", Conds: make([]wireCond, len(conds)), Ops: make([]wireOp, len(ops))}
	for i, x := range conds {
		req.Conds[i] = wireCond{Key: []byte(x.Key), Revision: x.Revision}
		if x.IsRange() {
			req.Conds[i].End = []byte(x.End)
			req.needsRanges = true
		}
	}
	for i, o := range ops {
		req.Ops[i] = wireOp{Key: []byte(o.Key), Value: o.Value, Delete: o.Delete}
	}
	_, err := c.run(ctx, req, false, func(d store.Store) ([]store.KV, error) {
		return nil, d.Commit(ctx, conds, ops)
	})
	return err
}

// Close implements store.Store.
func (c *Client) Close() error {
	select {
	case c.turn <- struct{}{}:
		defer func() { <-c.turn }()
	case <-time.After(dialTimeout):
		// A call is still running; its own deadline ends it.
	}
	var errs []error
	if c.conn != nil {
		errs = append(errs, c.conn.Close())
		c.conn = nil
	}
	if c.direct != nil {
		errs = append(errs, c.direct.Close())
		c.direct = nil
	}
	c.state = stateUnknown
	return errors.Join(errs...)
}

// run sends req to the agent, or calls direct on the direct store.
// idempotent says a read that lost its agent may be answered directly.
func (c *Client) run(ctx context.Context, req *request, idempotent bool, direct func(store.Store) ([]store.KV, error)) ([]store.KV, error) {
	if err := c.takeTurn(ctx); err != nil {
		return nil, err
	}
	defer func() { <-c.turn }()
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("relayed store: %w", err)
	}
	if c.state == stateUnknown {
		if err := c.connect(ctx); err != nil {
			return nil, err
		}
	}
	if c.state == stateRelay && req.needsRanges && !c.ranges {
		return nil, fmt.Errorf("relayed store: ringipamd at %s is older than this plugin: it does not carry the commit's range condition, which it would check as a condition on one key (nothing was sent; restart ringipamd with the current binary)", c.socket)
	}
	if c.state == stateRelay {
		kvs, callErr, err := c.exchange(ctx, req)
		if err == nil {
			return kvs, callErr
		}
		// The agent went away (or the call outlived its deadline): the
		// connection is closed; the next call looks for the agent again.
		c.conn, c.state = nil, stateUnknown
		if ctx.Err() != nil {
			return nil, fmt.Errorf("relayed store: %w (%w)", ctx.Err(), err)
		}
		if !idempotent {
			return nil, fmt.Errorf("%w: the connection to ringipamd at %s was lost during a commit, which may or may not have happened: %w",
				store.ErrUnavailable, c.socket, err)
		}
		c.state, c.why = stateDirect, fmt.Errorf("ringipamd at %s went away: %w", c.socket, err)
	}
	if err := c.openDirect(); err != nil {
		return nil, err
	}
	return direct(c.direct)
}

// takeTurn waits for the previous call to end (one call at a time), or
// for ctx; the caller gives the turn back with <-c.turn.
func (c *Client) takeTurn(ctx context.Context) error {
	select {
	case c.turn <- struct{}{}:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("relayed store: waiting for the previous call: %w", ctx.Err())
	}
}

// openDirect opens the direct store if it is not open yet. The caller
// holds the turn.
func (c *Client) openDirect() error {
	if c.direct != nil {
		return nil
	}
	d, err := c.open()
	if err != nil {
		if errors.Is(err, store.ErrUnavailable) {
			// No direct way now (a TLS etcd in a plugin, which has no
			// TLS of its own): the next call looks for the agent
			// again, so that a restarting agent is waited for.
			c.state = stateUnknown
		}
		return fmt.Errorf("%w (%v)", err, c.why)
	}
	c.direct = d
	return nil
}

// CommitOrGet implements store.Speculator: on the direct store when the
// calls go there and it can speculate (one round trip); through the agent
// as a read then a commit (store.CommitOrGetByReading: the agent's
// protocol has no such call, and a plugin whose agent serves it sends the
// agent its whole invocation instead).
func (c *Client) CommitOrGet(ctx context.Context, conds []store.Cond, same []store.KV, ops []store.Op, read []string) ([]store.KV, error) {
	d, err := c.directStore(ctx)
	if err != nil {
		return nil, err
	}
	if sp, ok := d.(store.Speculator); ok {
		return sp.CommitOrGet(ctx, conds, same, ops, read)
	}
	return store.CommitOrGetByReading(ctx, c, conds, same, ops, read)
}

// directStore finds where calls go, as the next call would: the direct
// store, or nil when they are relayed.
func (c *Client) directStore(ctx context.Context) (store.Store, error) {
	if err := c.takeTurn(ctx); err != nil {
		return nil, err
	}
	defer func() { <-c.turn }()
	if c.state == stateUnknown {
		if err := c.connect(ctx); err != nil {
			return nil, err
		}
	}
	if c.state == stateRelay {
		return nil, nil
	}
	if err := c.openDirect(); err != nil {
		return nil, err
	}
	return c.direct, nil
}

// connect dials the agent and says hello; on any failure the client goes
// direct, unless the caller's context ended (that error is returned, and
// the next call tries again).
func (c *Client) connect(ctx context.Context) error {
	dctx, cancel := context.WithTimeout(ctx, dialTimeout)
	defer cancel()
	conn, err := (&net.Dialer{}).DialContext(dctx, "unix", c.socket)
	if ctx.Err() != nil {
		if conn != nil {
			conn.Close()
		}
		return fmt.Errorf("relayed store: %w", ctx.Err())
	}
	if err != nil {
		c.state, c.why = stateDirect, fmt.Errorf("no ringipamd at %s", c.socket)
		return nil
	}
	c.conn, c.r = conn, bufio.NewReaderSize(conn, 64<<10)
	id := c.id
	c.ranges = false
	_, callErr, err := c.exchange(dctx, &request{Op: "hello", Identity: &id})
	if err == nil {
		err = callErr
	}
	if err != nil {
		conn.Close()
		c.conn = nil
		if ctx.Err() != nil {
			return fmt.Errorf("relayed store: %w", ctx.Err())
		}
		c.state, c.why = stateDirect, fmt.Errorf("ringipamd at %s: %w", c.socket, err)
		return nil
	}
	c.state = stateRelay
	return nil
}

// exchange sends one request and reads its answer: the call's result
// (callErr: the store's own error), or ioErr when the connection failed
// (it is then closed).
func (c *Client) exchange(ctx context.Context, req *request) (kvs []store.KV, callErr, ioErr error) {
	conn := c.conn
	if d, ok := ctx.Deadline(); ok {
		req.TimeoutMS = max(1, time.Until(d).Milliseconds())
	}
	if stop, err := connctx.Bind(ctx, conn); err == nil {
		defer stop()
	}
	b, err := json.Marshal(req)
	if err != nil {
		return nil, err, nil
	}
	if len(b) > MaxRequest {
		// The agent would close the connection unserved.
		return nil, fmt.Errorf("%w: a request of %d bytes is over the agent's limit of %d", store.ErrTooLarge, len(b), MaxRequest), nil
	}
	b = append(b, '\n')
	if _, err := conn.Write(b); err != nil {
		conn.Close()
		return nil, nil, err
	}
	line, err := readLine(c.r)
	if err != nil {
		conn.Close()
		return nil, nil, err
	}
	var ans answer
	if err := json.Unmarshal(line, &ans); err != nil {
		conn.Close()
		return nil, nil, fmt.Errorf("undecodable answer: %w", err)
	}
	if ans.Error != nil {
		return nil, fromWire(ans.Error), nil
	}
	if req.Op == "hello" {
		c.ranges = slices.Contains(ans.Features, featureRangeConds)
	}
	kvs = make([]store.KV, len(ans.KVs))
	for i, kv := range ans.KVs {
		kvs[i] = store.KV{Key: string(kv.Key), Value: kv.Value, Revision: kv.Revision}
	}
	return kvs, nil, nil
}
