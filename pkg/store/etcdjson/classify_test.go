package etcdjson

import (
	"context"
	"errors"
	"testing"

	"github.com/ringipam/ringipam/pkg/store"
)

// Gateway errors map to the store's sentinels: a deadline that passed
// inside the server (Unknown, "context deadline exceeded") is unavailable
// (CNI 11), as are Unavailable, DeadlineExceeded and leaderless answers.
func TestClassify(t *testing.T) {
	s := &Store{names: "http://127.0.0.1:2379"}
	for _, tc := range []struct {
		ee   etcdError
		want error
	}{
		{etcdError{Status: 500, Code: 2, Message: "context deadline exceeded"}, store.ErrUnavailable},
		{etcdError{Status: 503, Code: 14, Message: "etcdserver: no leader"}, store.ErrUnavailable},
		{etcdError{Status: 504, Code: 4, Message: "etcdserver: request timed out"}, store.ErrUnavailable},
		{etcdError{Status: 400, Code: 3, Message: "etcdserver: too many operations in txn request"}, store.ErrTooLarge},
		{etcdError{Code: 8, Message: "grpc: received message larger than max (3145780 vs. 2097152)"}, store.ErrTooLarge},
	} {
		ee := tc.ee
		if err := s.classify(context.Background(), &ee); !errors.Is(err, tc.want) {
			t.Errorf("%+v -> %v, want %v", tc.ee, err, tc.want)
		}
	}
	ee := etcdError{Status: 400, Code: 3, Message: "etcdserver: key is not provided"}
	if err := s.classify(context.Background(), &ee); errors.Is(err, store.ErrUnavailable) || errors.Is(err, store.ErrTooLarge) {
		t.Errorf("a plain bad request: %v", err)
	}
}
