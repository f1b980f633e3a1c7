package pool

import (
	"errors"
	"fmt"
	"net/netip"
	"time"
)

// Sentinel errors. Callers test them with errors.Is; the CNI plugin and the
// Docker driver turn them into wire codes at their edges.
var (
	// ErrInvalid: the request or definition is malformed (bad CIDR, an
	// address outside the pool, a range start after its end, ...).
	ErrInvalid = errors.New("invalid request")
	// ErrDefinitionMismatch: the pool is recorded in the store with a
	// different definition than this host was given.
	ErrDefinitionMismatch = errors.New("pool definition differs from the recorded one")
	// ErrUnknownPool: the pool has never been defined.
	ErrUnknownPool = errors.New("unknown pool")
	// ErrAlreadyInUse: a static address (or reservation) is held by another owner.
	ErrAlreadyInUse = errors.New("already in use")
	// ErrAlreadyExists: the owner already holds a different allocation on
	// this network.
	ErrAlreadyExists = errors.New("already exists")
	// ErrNoCapacity: no free address is left in the pool.
	ErrNoCapacity = errors.New("not enough capacity")
	// ErrTryAgain: the store kept conflicting with concurrent writers; the
	// operation changed nothing and can be retried.
	ErrTryAgain = errors.New("try again later")
)

// InUseError says which owner holds a requested address or reservation.
type InUseError struct {
	Pool   string
	Addr   netip.Addr // invalid when a reservation name is what is held
	Name   string     // reservation name, when that is what is held
	Holder string     // the holding owner, as Owner.String(), or a description of the hold
	Host   string     // host of the holder, when known
	Until  time.Time  // when Addr is held for reservation Name: the end of the hold
}

func (e *InUseError) Error() string {
	if e.Addr.IsValid() && e.Name != "" {
		return fmt.Sprintf("%s in pool %s is held for reservation %s until %s (released by its last owner; "+
			"only an owner with that reservation name gets it before then, or an operator drops the hold)",
			e.Addr, e.Pool, e.Name, e.Until.UTC().Format(time.RFC3339))
	}
	what := e.Addr.String()
	if !e.Addr.IsValid() {
		what = "reservation " + e.Name
	}
	if e.Host != "" {
		return fmt.Sprintf("%s in pool %s is already in use by %s on host %s", what, e.Pool, e.Holder, e.Host)
	}
	return fmt.Sprintf("%s in pool %s is already in use by %s", what, e.Pool, e.Holder)
}

// Unwrap makes errors.Is(err, ErrAlreadyInUse) hold.
func (e *InUseError) Unwrap() error { return ErrAlreadyInUse }

// ExistsError says what an owner already holds when asked for something else.
type ExistsError struct {
	Owner string
	Holds []netip.Addr
	Asked netip.Addr
	Host  string // set when the owner's allocation was made on another host
}

func (e *ExistsError) Error() string {
	if e.Host != "" {
		return fmt.Sprintf("%s already holds %v, allocated on host %s; release it there first", e.Owner, e.Holds, e.Host)
	}
	return fmt.Sprintf("%s already holds %v on this network; asked for %v (release it first)", e.Owner, e.Holds, e.Asked)
}

// Unwrap makes errors.Is(err, ErrAlreadyExists) hold.
func (e *ExistsError) Unwrap() error { return ErrAlreadyExists }

// CapacityError says how full a pool is.
type CapacityError struct {
	Pool     string
	Used     uint64
	Capacity string // decimal; may exceed uint64 for IPv6
}

func (e *CapacityError) Error() string {
	return fmt.Sprintf("pool %s has no free address: %d of %s addresses in use", e.Pool, e.Used, e.Capacity)
}

// Unwrap makes errors.Is(err, ErrNoCapacity) hold.
func (e *CapacityError) Unwrap() error { return ErrNoCapacity }
