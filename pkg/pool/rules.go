package pool

import (
	"context"
	"encoding/json"
	"errors"
	"net/netip"
	"slices"

	"github.com/ringipam/ringipam/pkg/names"
	"github.com/ringipam/ringipam/pkg/store"
)

// Rules that every front end applies the same way. They live here once, so
// the CNI plugin and the Docker driver can never record two definitions of
// one pool, nor rank an error differently.

// UsableBounds returns the first and last address of subnet a pool may hand
// out: the network address never, nor for IPv4 subnets larger than /31 the
// broadcast address. ok is false when none is left.
func UsableBounds(subnet netip.Prefix) (first, last netip.Addr, ok bool) {
	if !subnet.IsValid() {
		return netip.Addr{}, netip.Addr{}, false
	}
	subnet = subnet.Masked()
	lo, hi := subnetBounds(subnet)
	if lo.cmp(hi) > 0 {
		return netip.Addr{}, netip.Addr{}, false
	}
	is4 := subnet.Addr().Is4()
	return lo.addr(is4), hi.addr(is4), true
}

// LastAddr is the highest address of p (its broadcast address for IPv4).
func LastAddr(p netip.Prefix) netip.Addr {
	p = p.Masked()
	b := p.Addr().AsSlice()
	for i := p.Bits(); i < len(b)*8; i++ {
		b[i/8] |= 0x80 >> (i % 8)
	}
	a, _ := netip.AddrFromSlice(b)
	return a
}

// DefaultGateway is the gateway a range of subnet gets when none is given:
// its first usable address; none (false) for subnets of one or two
// addresses (/31 and /32, /127 and /128), which are point-to-point links
// (RFC 3021) where every address belongs to an end.
func DefaultGateway(subnet netip.Prefix) (netip.Addr, bool) {
	if !subnet.IsValid() || subnet.Bits() >= subnet.Addr().BitLen()-1 {
		return netip.Addr{}, false
	}
	first, _, ok := UsableBounds(subnet)
	return first, ok
}

// Equal reports whether d and o are the same definition once normalized
// (the comparison the store applies when a host gives a pool that is
// already recorded): field by field, which is what comparing their stored
// JSON would say (every field is recorded; netip values encode one way),
// without encoding either.
func (d Def) Equal(o Def) bool {
	a, errA := d.Normalize()
	b, errB := o.Normalize()
	if errA != nil || errB != nil {
		return false
	}
	return a.Name == b.Name && a.Isolated == b.Isolated &&
		slices.Equal(a.Ranges, b.Ranges) && slices.Equal(a.Exclude, b.Exclude)
}

// CheckDefinition returns nil when given is the recorded definition, else
// an error wrapping ErrDefinitionMismatch that shows both.
func CheckDefinition(recorded, given Def) error {
	if recorded.Equal(given) {
		return nil
	}
	r, _ := json.Marshal(recorded)
	g, _ := given.Normalize()
	return mismatch(given.Name, r, g)
}

// Class is what kind of failure an error is, for the front ends to turn
// into their wire codes and for metrics.
type Class int

// Classes, in the order Classify ranks them when an error wraps several
// sentinels: the most specific cause a user can act on first.
const (
	ClassOK          Class = iota
	ClassInUse             // an address or reservation is held by another owner
	ClassExists            // the owner holds something else already
	ClassNoCapacity        // the pool is full
	ClassMismatch          // the pool is recorded otherwise, or overlaps another
	ClassUnknownPool       // the pool was never recorded
	ClassInvalid           // the request or definition is malformed
	ClassUnavailable       // the store could not be reached in time
	ClassTryAgain          // contention outlasted the retries
	ClassTimeout           // the caller's deadline passed
	ClassInternal          // anything else
)

var classNames = [...]string{"ok", "in_use", "exists", "no_capacity", "mismatch", "unknown_pool", "invalid", "unavailable", "try_again", "timeout", "internal"}

// String is the class's metric label.
func (c Class) String() string {
	if c < 0 || int(c) >= len(classNames) {
		return "internal"
	}
	return classNames[c]
}

// Retryable reports whether the operation changed nothing and may simply
// be tried again later (CNI code 11).
func (c Class) Retryable() bool {
	return c == ClassUnavailable || c == ClassTryAgain || c == ClassTimeout
}

// Classify ranks err by the sentinels it wraps (see Class).
func Classify(err error) Class {
	switch {
	case err == nil:
		return ClassOK
	case errors.Is(err, ErrAlreadyInUse):
		return ClassInUse
	case errors.Is(err, ErrAlreadyExists):
		return ClassExists
	case errors.Is(err, ErrNoCapacity):
		return ClassNoCapacity
	case errors.Is(err, ErrDefinitionMismatch), errors.Is(err, ErrLayout):
		return ClassMismatch
	case errors.Is(err, ErrUnknownPool):
		return ClassUnknownPool
	case errors.Is(err, ErrInvalid), errors.Is(err, names.ErrInvalid):
		return ClassInvalid
	case errors.Is(err, store.ErrUnavailable):
		return ClassUnavailable
	case errors.Is(err, ErrTryAgain), errors.Is(err, store.ErrConflict):
		return ClassTryAgain
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, context.Canceled):
		return ClassTimeout
	default:
		return ClassInternal
	}
}
