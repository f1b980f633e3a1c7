// Package pool is ringipam's allocation core: pool definitions, the ring of
// host-owned ranges, owners and reservations, all kept in a store.Store.
//
// # Model
//
// A pool (Def) is one address family's set of ranges. Its allocatable
// addresses form a ring of ranges; each range starts at a token and is owned
// by one host, or is unowned, or is tombstoned (its host left). A host hands
// out addresses only inside ranges it owns, so hosts never contend on the
// same keys. A host with no free address claims unowned space first, then
// takes half of the largest free hole of the host with the most free space:
// only free addresses ever change hands. A static request for a free address
// in another host's range moves exactly that one address to the requesting
// host. Metadata grows with the number of ranges, never with the size of the
// pool: an IPv6 /48 costs what an IPv4 /24 costs.
//
// Every allocation has an Owner (network, container ID, interface). Allocate
// is idempotent per owner. A Reservation name remembers an owner's addresses
// so that a recreated owner with the same name gets them back when free.
// A host hands out addresses round robin: a released address comes back only
// after the host's other free addresses were used.
//
// # Store layout (keys relative to the backend's prefix)
//
//	d/<pool>                 pool definition (immutable once recorded)
//	g/<pool>                 the ring: ordered tokens {start, host, tombstone}
//	h/<pool>/<host>          host state in the pool: round-robin cursor, addresses used
//	a/<pool>/<hex address>   "<host> <owner>": the address is held (uniqueness key)
//	o/<network>/<ctr>/<if>   the owner's allocation
//	r/<network>/<name>       a reservation: its current holder and remembered addresses
//
// # Transactions and errors
//
// Every change (all families of a request, owner record and reservation
// included) is one store commit conditioned on what was read; conflicts are
// retried a bounded number of times and then reported as ErrTryAgain. Store
// unavailability is passed through wrapped (store.ErrUnavailable). Nothing is
// half-written: a failed commit writes nothing. An Allocator is safe for
// concurrent use.
package pool
