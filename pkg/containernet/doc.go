// Package containernet implements the container network of the Garden
// container networking specification (seed 003, a Z specification) on top of
// pkg/pool.
//
// # The value
//
// A ContainerNet is an IP address, the subnet it belongs to and the gateway it
// routes through. It cannot exist unless ip ∈ subnet, ip ≠ gw and gw ∉ subnet,
// all of one address family: New is the only way to build one. The zero
// value is "no container network" (IsValid reports false). Conversions to the
// net package's types happen only at the edges (IPNet, GatewayIP).
//
// # The network
//
// A Manager creates container networks over one store through a
// pool.Allocator. Every container network belongs to a main pool, and a
// container is a pool.Owner. The three ways of creating one are chosen by the
// fields of a Spec, as the specification distinguishes them by their inputs:
//
//   - Spec{Pool}: ip and gateway both allocated from the pool in one
//     transaction, subnet = {ip} (a /32 or /128, as the CNI ptp plugin wires);
//   - Spec{Pool, IP}: the same with that specific ip, which must be free;
//   - Spec{Pool, Subnet, IP}: ip in a special subnet outside the pool, shared
//     by several containers with distinct ips and distinct gateways; the
//     gateway is allocated from the pool.
//
// A special subnet S of main pool P is itself a pool, named
// SpecialPoolName(P, S) and defined on first use; the container's ip is a
// static request in it, made in the same transaction as the gateway request
// in P. Uniqueness of ips within a special subnet is therefore exactly the
// pool's address uniqueness: cluster-wide and atomic. A special subnet must
// not overlap any subnet of P's ranges (ErrInvalid), and must be equal to or
// disjoint from every special subnet of P that live containers use
// (ErrSubnetConflict). Since store layout 2 the pool registry makes this
// hold at definition time too: a special subnet's pool that overlaps any
// recorded pool (another special subnet included, in use or not) is refused
// in the commit that would record it (ErrSubnetConflict wrapping the
// *pool.OverlapError). Create still reads the live containers before and
// after its transaction and backs off (releasing, ErrSubnetConflict) if a
// container of another, overlapping special subnet appeared meanwhile, for
// pools recorded by an older layout; Check reports such a state (see
// "Limitations").
//
// Destroy releases everything the owner holds (ip and gateway) and succeeds
// when there is nothing left to release.
//
// # Invariants
//
// CheckNet is the seed's Net schema as a pure function over the stored state
// of one main pool (records decoded from allocations, plus the pool's
// allocated set): CNetValid (CNetPooled ∨ CNetSubnet) for every container
// and CNetPairValid for every pair, plus one invariant the seed leaves
// implicit (no address is both one container's ip and another's gateway).
// Manager.Check applies it to what the store holds for one main pool;
// CheckStore to every main pool of a whole store (ringctl check: pools
// in which an owner holds a gateway, or that have a special subnet pool).
// The exhaustive model
// check in this package's tests runs the Manager itself (its planning,
// decoding and error paths) over a nondeterministic model of the pool, so
// the model cannot drift from the code.
//
// # Errors
//
// ErrInvalid (a bad Spec or value; it wraps pool.ErrInvalid), ErrSubnetConflict
// (it wraps pool.ErrAlreadyInUse) and ErrViolation (Check found a broken
// invariant) are this package's sentinels. Errors from the pool
// (pool.ErrAlreadyInUse with a *pool.InUseError naming the holder,
// pool.ErrAlreadyExists, pool.ErrNoCapacity, pool.ErrTryAgain,
// pool.ErrUnknownPool, store.ErrUnavailable) are passed through wrapped with
// %w and a message saying which part of the container network failed.
//
// # Concurrency and partial failure
//
// A Manager is safe for concurrent use; it keeps no state but an immutable
// cache of special subnet pool definitions. Create is all or nothing: every
// address of a create is one pool transaction, and a create that backs off
// after it releases what it took. Defining a special subnet pool is a
// separate, idempotent step before it; a definition left behind by a failed
// create holds no address. Create is idempotent per owner (a repeated create
// returns the owner's network); concurrent creates of one owner with
// different specs are not supported (the runtime never issues them).
//
// # Limitations
//
// Special subnet pools are never deleted (a definition holds no address).
// The overlap check between different special subnets is not one atomic
// transaction (above): a creator that crashes right after committing can
// leave two overlapping special subnets in use, which Check reports. Check
// expects the main pool to be used only by this package (per-container
// gateways); an owner holding only an ip in the pool, as the shared-gateway
// mode allocates, is reported as a container without a gateway.
package containernet
