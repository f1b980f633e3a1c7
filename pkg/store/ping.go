package store

import "context"

// Pinger is implemented by backends that can check cheaply whether they are
// reachable (etcd: a quorum read; local: the file can be opened and locked).
// Ping returns nil or an error that wraps ErrUnavailable when the backend
// cannot be reached in time.
type Pinger interface {
	Ping(ctx context.Context) error
}

// Ping checks that s is reachable: through Pinger when s implements it, else
// with a read of one key.
func Ping(ctx context.Context, s Store) error {
	if p, ok := s.(Pinger); ok {
		return p.Ping(ctx)
	}
	_, err := s.Get(ctx, "\x00ping")
	return err
}
