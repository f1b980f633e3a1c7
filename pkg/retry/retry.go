// Package retry is ringipam's one bounded retry helper.
//
// Do runs an operation until it succeeds, returns an error that is not
// retryable, runs out of attempts, or the context ends. It never loops
// forever: every caller states how many attempts it allows, and the backoff
// between attempts is jittered and capped so that contending processes
// spread out.
package retry

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"
)

// ErrExhausted is wrapped by the error Do returns when every attempt failed
// with a retryable error.
var ErrExhausted = errors.New("retry: attempts exhausted")

// Policy says how often and how patiently to retry.
type Policy struct {
	Attempts  int           // total attempts, at least 1
	BaseDelay time.Duration // first backoff; doubles each attempt
	MaxDelay  time.Duration // cap on one backoff
}

// Default suits store commits that conflict with concurrent writers.
var Default = Policy{Attempts: 20, BaseDelay: 200 * time.Microsecond, MaxDelay: 40 * time.Millisecond}

// Do calls op until it returns nil or an error for which retryable is false.
// The returned error wraps both ErrExhausted and op's last error when the
// attempts ran out, and wraps ctx.Err() when the context ended first.
func Do(ctx context.Context, p Policy, retryable func(error) bool, op func(attempt int) error) error {
	if p.Attempts < 1 {
		p.Attempts = 1
	}
	delay := p.BaseDelay
	var last error
	for attempt := 0; attempt < p.Attempts; attempt++ {
		if err := ctx.Err(); err != nil {
			if last != nil {
				return fmt.Errorf("%w (last error: %w)", err, last)
			}
			return err
		}
		err := op(attempt)
		if err == nil || !retryable(err) {
			if err != nil && last != nil && ctx.Err() != nil && (errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled)) {
				// The deadline ended this attempt: say what the earlier
				// ones met, as when it ends a backoff.
				return fmt.Errorf("%w (last error: %w)", err, last)
			}
			return err
		}
		last = err
		if attempt == p.Attempts-1 {
			break
		}
		sleep := delay
		if sleep > 0 {
			sleep = sleep/2 + rand.N(sleep/2+1)
		}
		t := time.NewTimer(sleep)
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("%w (last error: %w)", ctx.Err(), last)
		case <-t.C:
		}
		delay *= 2
		if p.MaxDelay > 0 && delay > p.MaxDelay {
			delay = p.MaxDelay
		}
	}
	return fmt.Errorf("%w after %d attempts: %w", ErrExhausted, p.Attempts, last)
}
