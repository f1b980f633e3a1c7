package etcd

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/ringipam/ringipam/pkg/store"
)

// Every way a request can time out is "unavailable" (CNI code 11), never an
// unclassified error (999): the chaos suite saw a Scan come back as an
// Unknown status carrying the server's "context deadline exceeded" during a
// leader election.
func TestClassifyTimeouts(t *testing.T) {
	live := context.Background()
	expired, cancel := context.WithTimeout(context.Background(), -time.Second)
	defer cancel()
	serverTimeout := status.Error(codes.Unknown, context.DeadlineExceeded.Error())
	for _, tc := range []struct {
		name string
		ctx  context.Context
		err  error
		want error
	}{
		{"server's deadline, ours still running", live, serverTimeout, store.ErrUnavailable},
		{"server's deadline, ours passed too", expired, serverTimeout, store.ErrUnavailable},
		{"our deadline, whatever the error", expired, errors.New("rpc error: code = Unknown desc = something"), store.ErrUnavailable},
		{"grpc deadline", live, status.Error(codes.DeadlineExceeded, "deadline"), store.ErrUnavailable},
		{"no leader", live, status.Error(codes.Unavailable, "etcdserver: no leader"), store.ErrUnavailable},
		{"wrapped context deadline", live, fmt.Errorf("scan: %w", context.DeadlineExceeded), store.ErrUnavailable},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := classify(tc.ctx, "e1", tc.err); !errors.Is(err, tc.want) {
				t.Errorf("classify(%v) = %v, want %v", tc.err, err, tc.want)
			}
		})
	}
	// An Unknown status about something else stays unclassified, and a
	// cancellation stays a cancellation.
	if err := classify(live, "e1", status.Error(codes.Unknown, "etcdserver: corrupt cluster")); errors.Is(err, store.ErrUnavailable) {
		t.Errorf("an unknown server error became unavailable: %v", err)
	}
	cctx, ccancel := context.WithCancel(context.Background())
	ccancel()
	if err := classify(cctx, "e1", fmt.Errorf("get: %w", context.Canceled)); errors.Is(err, store.ErrUnavailable) || !errors.Is(err, context.Canceled) {
		t.Errorf("a cancellation: %v", err)
	}
}
