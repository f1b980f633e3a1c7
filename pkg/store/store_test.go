package store

import (
	"context"
	"errors"
	"testing"
)

func TestStartGet(t *testing.T) {
	ctx := context.Background()
	out, done, err := StartGet(ctx, []string{"a", "b", "a"})
	if done || err != nil || len(out) != 3 {
		t.Fatalf("StartGet(a, b, a) = %v, %v, %v; want three KVs to fill in", out, done, err)
	}
	for i, k := range []string{"a", "b", "a"} {
		if out[i].Key != k || out[i].Value != nil || out[i].Revision != 0 {
			t.Errorf("out[%d] = %+v, want absent %q", i, out[i], k)
		}
	}
	out, done, err = StartGet(ctx, nil)
	if !done || err != nil || out == nil || len(out) != 0 {
		t.Fatalf("StartGet() = %#v, %v, %v; want done with an empty answer", out, done, err)
	}
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	out, done, err = StartGet(cancelled, nil)
	if !done || !errors.Is(err, context.Canceled) || out != nil {
		t.Fatalf("StartGet() on a cancelled context = %v, %v, %v; want done with context.Canceled", out, done, err)
	}
	// With keys the backend's read reports the context's state.
	if out, done, err = StartGet(cancelled, []string{"a"}); done || err != nil || len(out) != 1 {
		t.Fatalf("StartGet(a) on a cancelled context = %v, %v, %v; want one KV to fill in", out, done, err)
	}
}
