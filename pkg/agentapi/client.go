package agentapi

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"time"
)

// Call sends req to the agent at socket and waits for its answer until
// req's timeout and AnswerGrace have passed, or ctx ends. req.Version is
// set to Version. Errors: ErrNoAgent (no connection), ErrNoAnswer (sent,
// no answer: the call may have run), *VersionError (the agent speaks
// another version), ErrRefused (the agent did not run it: Answer.Error).
// A verb that ran and failed is not an error of Call: its answer has
// CNIError set.
func Call(ctx context.Context, socket string, req *Request) (*Answer, error) {
	return call(ctx, socket, req, Version)
}

// call is Call speaking protocol version v (tests speak others).
func call(ctx context.Context, socket string, req *Request, v int) (*Answer, error) {
	q := *req
	q.Version = v
	line, err := json.Marshal(&q)
	if err != nil {
		return nil, fmt.Errorf("encoding the request: %w", err)
	}
	if len(line) > MaxRequest {
		return nil, fmt.Errorf("the request is %d bytes, over the agent's limit of %d", len(line), MaxRequest)
	}
	d := net.Dialer{Timeout: DialTimeout}
	c, err := d.DialContext(ctx, "unix", socket)
	if err != nil {
		return nil, fmt.Errorf("%w at %s: %w", ErrNoAgent, socket, err)
	}
	defer c.Close()
	wait := q.Timeout() + AnswerGrace
	deadline := time.Now().Add(wait)
	if dl, ok := ctx.Deadline(); ok && dl.Before(deadline) {
		deadline = dl
	}
	_ = c.SetDeadline(deadline)
	stop := context.AfterFunc(ctx, func() { _ = c.SetDeadline(time.Now()) })
	defer stop()
	if _, err := c.Write(append(line, '\n')); err != nil {
		// Part of the request may have gone out; a whole line did not,
		// so the agent has not started it.
		return nil, fmt.Errorf("%w at %s: sending the request: %w", ErrNoAgent, socket, err)
	}
	b, err := readLine(bufio.NewReader(c), MaxAnswer)
	if err != nil {
		if ctx.Err() != nil {
			err = fmt.Errorf("%w: %w", ctx.Err(), err)
		}
		return nil, fmt.Errorf("%w at %s (waited up to %s): %w", ErrNoAnswer, socket, wait, err)
	}
	var a Answer
	if err := json.Unmarshal(b, &a); err != nil {
		return nil, fmt.Errorf("%w at %s: undecodable answer: %w", ErrNoAnswer, socket, err)
	}
	if a.Version != v {
		return nil, &VersionError{Socket: socket, Agent: a.Version, Plugin: v, Detail: a.Error}
	}
	if a.Error != "" {
		return &a, fmt.Errorf("%w at %s: %s", ErrRefused, socket, a.Error)
	}
	return &a, nil
}

// errTooLong is returned by readLine for a line over its limit.
var errTooLong = errors.New("line too long")

// readLine reads one line of at most limit bytes, without its newline; it
// stops reading as soon as the line passes the limit.
func readLine(r *bufio.Reader, limit int) ([]byte, error) {
	var line []byte
	for {
		part, err := r.ReadSlice('\n')
		line = append(line, part...)
		if len(line) > limit+1 { // limit bytes and the newline
			return nil, fmt.Errorf("%w: more than %d bytes", errTooLong, limit)
		}
		switch {
		case err == nil:
			return line[:len(line)-1], nil
		case errors.Is(err, bufio.ErrBufferFull):
			continue
		default:
			return nil, err
		}
	}
}
