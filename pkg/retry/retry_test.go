package retry

import (
	"context"
	"errors"
	"testing"
	"time"
)

var errBusy = errors.New("busy")

func isBusy(err error) bool { return errors.Is(err, errBusy) }

func TestDo(t *testing.T) {
	ctx := context.Background()
	p := Policy{Attempts: 3, BaseDelay: time.Microsecond}

	calls := 0
	err := Do(ctx, p, isBusy, func(int) error { calls++; return errBusy })
	if !errors.Is(err, ErrExhausted) || !errors.Is(err, errBusy) || calls != 3 {
		t.Fatalf("always busy: %v after %d calls", err, calls)
	}

	final := errors.New("final")
	calls = 0
	err = Do(ctx, p, isBusy, func(int) error { calls++; return final })
	if err != final || calls != 1 {
		t.Fatalf("not retryable: %v after %d calls", err, calls)
	}

	calls = 0
	err = Do(ctx, p, isBusy, func(a int) error {
		calls++
		if a < 2 {
			return errBusy
		}
		return nil
	})
	if err != nil || calls != 3 {
		t.Fatalf("busy twice then done: %v after %d calls", err, calls)
	}
}

// A deadline that ends an attempt, or a backoff, still reports what the
// earlier attempts met.
func TestDeadlineKeepsTheLastError(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	err := Do(ctx, Policy{Attempts: 10, BaseDelay: time.Microsecond}, isBusy, func(a int) error {
		if a == 0 {
			return errBusy
		}
		cancel()
		return ctx.Err()
	})
	if !errors.Is(err, context.Canceled) || !errors.Is(err, errBusy) {
		t.Fatalf("deadline during an attempt: %v", err)
	}

	ctx, cancel = context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	err = Do(ctx, Policy{Attempts: 10, BaseDelay: time.Hour}, isBusy, func(int) error { return errBusy })
	if !errors.Is(err, context.DeadlineExceeded) || !errors.Is(err, errBusy) {
		t.Fatalf("deadline during a backoff: %v", err)
	}

	// Without an earlier error the context's own error comes back alone.
	ctx, cancel = context.WithCancel(context.Background())
	cancel()
	if err := Do(ctx, Policy{Attempts: 3}, isBusy, func(int) error { return errBusy }); !errors.Is(err, context.Canceled) || errors.Is(err, errBusy) {
		t.Fatalf("cancelled before the first attempt: %v", err)
	}
}
