// Package pool is ringipam's allocation core: pool definitions, the ring of
// host-owned ranges, owners and reservations, all kept in a store.Store.
//
// # Model
//
// A pool (Def) is one address family's set of ranges. Its allocatable
// addresses form a ring of ranges; each range is owned by one host, or is
// tombstoned (its host left), and the space between them is unowned. Each
// range is one key (ranges.go), and each host's state lists its own
// ranges, so an allocation reads no range key and hosts never contend on
// the same keys. A claim reads a bounded number of keys (see "Finding
// free space" below). A host with no free address claims unowned space first
// (an aligned block of at most 64 addresses, at a position that differs
// from host to host, so that hosts starting together claim different
// blocks), then tombstoned space, then takes half of the largest free
// hole of the host with the most free space:
// only free addresses ever change hands, and a claim's commit requires that
// the space it takes from a live host holds no address (a range condition,
// store.Cond.End), so no address ever lies, even for a moment, outside a
// range its host owns. A static request for a free address
// in another host's range moves exactly that one address to the requesting
// host. Metadata grows with the number of ranges, never with the size of the
// pool: an IPv6 /48 costs what an IPv4 /24 costs.
//
// Every allocation has an Owner: a front end (Kind: cni, docker, port,
// ringctl) and within it (network, container ID, interface). Listings, GC
// and CHECK are scoped to one kind. Each host's index of its owners lets GC
// and the reclaim of a gone host read that host's owners only (a sweep also
// finds there the owners a reclaim that died half-way left; a host that
// comes back before its owners were released takes them back with
// Readopt). Allocate is idempotent per owner. A
// Reservation name remembers an owner's addresses; after a release they stay
// held for the name (WithReservationHold), then remain a preference.
//
// A store is one address space: a pool whose ranges overlap a recorded
// pool's is refused (*OverlapError) unless one of them is Isolated.
// A host hands out addresses round robin: a released address comes back only
// after the host's other free addresses were used.
//
// # Store layout (keys relative to the backend's prefix)
//
//	v                        layout version ("4"; an older store migrates once)
//	x/pools                  registry of every recorded pool's ranges
//	d/<pool>                 pool definition (immutable once recorded)
//	g/<pool>/<hex last>      one range of the ring: {start, host, tombstone}; none for unowned space
//	g/<pool>                 layout 3's whole ring; since layout 4 a marker layout-3 code cannot read
//	h/<pool>/<host>          host state in the pool: round-robin cursor, addresses used, its live ranges
//	f/<pool>/<host>          empty: the host has a free address to give (free-space index, a hint)
//	t/<pool>/<hex last>      empty: that range is tombstoned (tombstone index, a hint)
//	a/<pool>/<hex address>   "<host> <owner>", or a reservation's hold: the address is taken (uniqueness key)
//	o/<kind>/<net>/<ctr>/<if> the owner's allocation
//	i/<host>/<owner>         empty: the host's index of its owners, written with the record
//	r/<kind>/<network>/<name> a reservation: its holder, remembered addresses, end of hold
//	l/<host>                 present while the host's agent holds its lease (liveness)
//	n/<host>                 host record: address, orphaned mark; written only when it changes (watched)
//	s/<host>                 host status: last seen, the agent's routes summary (never watched)
//	e/...                    the host agents' election of their leader (etcd concurrency)
//
// # Gone hosts
//
// A host is up while its liveness key exists (the lease alone; see
// hosts.go): nothing is written on a timer to say so. Its last-seen time
// (its status record, its host record as older agents wrote it, its
// host states) decides only when a down host is orphaned. Reclaim takes an
// orphaned host's space back, every commit conditioned on its liveness key
// absent; Sweeper (sweeper.go) is the sweep the elected host agent runs and
// the model checks run: reclaim, release of its published ports under the
// same guard (through a PortReleaser), and the removal of a reclaimed
// host's records after a retention.
//
// # Transactions and errors
//
// Every change (all families of a request, owner record and reservation
// included) is one store commit conditioned on what was read; conflicts are
// retried a bounded number of times and then reported as ErrTryAgain. An
// unavailable store is retried while the caller's deadline lasts (a timed-out
// commit is ambiguous; every operation is idempotent), then passed through
// wrapped (store.ErrUnavailable). Nothing is
// half-written: a failed commit writes nothing. An Allocator is safe for
// concurrent use.
//
// An allocation reads (the definition and its host's state, its ranges
// among it; no range key), then commits: two round trips. With WithNotes,
// on a store that can speculate (store.Speculator: etcd), a host keeps a
// note per pool of what its last allocation or release there left (the
// definition and its host state, each with its revision) and the next
// allocation plans on the note and commits in one round trip, conditioned
// on the noted revisions and on its host state's bytes (notes.go). What it
// sends does not grow with the ring, nor with the number of hosts. A claim
// reads the few range keys it needs (one single-key read per block it
// tries) and writes O(1) keys. A note that no longer holds costs nothing
// more than the read it replaced: the failed commit answers the store's
// state, and the allocation goes on from it. Notes change round trips,
// never decisions.
//
// # Finding free space
//
// A claim (claim.go) tries, each step bounded whatever the number of
// hosts: the pool's first block and 8 pseudo-random blocks (one
// single-key read each); the first gap after a pseudo-random position,
// by at most two pages of 32 range keys, wrapping around (claimGap's
// conditions make any gap read safe to claim); at most 8 tombstoned
// ranges the tombstone index names; at most 8 donors the free-space index
// names, from this host's name on (their states in one read). Only when
// all of these offered nothing does it read every range key and every
// host state of the pool (claimLastResort, Stats.LastResort): a full pool
// always gets there before it answers a *CapacityError, and so does free
// space that the indexes do not list.
//
// Both indexes (freeindex.go) are hints rather than a new layout, on
// purpose: every candidate they name is read again and the claim's
// commit conditions on what it read (a donor's state revision and no
// address in the space given; the range key of a tombstone), exactly as
// when the candidate came from a full scan, so a stale entry costs a
// read and a missing one a last resort, never safety. A layout-4 store
// written before them therefore needs no migration step, and layout-4
// code that does not know them may run beside this code: its writes drop
// a host state's index mark (hostState.Free back to freeUnknown), which
// the next write of the state by this code repairs. The threshold of the free-space
// index is one free address (capacity of the host's ranges above its
// used count), so only commits that use a host's last free address or
// free one in a full host (allocations, releases, claims, donations,
// tombstones, readoption, the reclaim's tombstoning and a gone host's
// removal) write or delete its entry; every write of a host state goes
// through putHostState. Audit reports entries that disagree with what
// they summarise (InvFreeIndex).
package pool
