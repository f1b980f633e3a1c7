// Package portalloc is ringipam's published-port allocator: the Allocate
// operation of SwarmKit's port allocator specification (seed 000), without
// the bugs that specification marks XXX, over the one store contract.
//
// # Model
//
// An address is (protocol, port number). A port is published in one of two
// modes. An ingress port is unique per address across the whole cluster and
// reachable through every host. A host port is unique per (host, host IP,
// address); a host port bound to every address of its host (no host IP)
// collides with any host IP of that host. An ingress port and a host port
// never share an address on any host: the ingress port is bound everywhere.
// A published port of 0 asks for a dynamic number from the dynamic range
// (default 30000-32767).
//
// Allocate(endpoint, spec) replaces an endpoint's ports by the ones spec
// asks for, in one store transaction: the release of the old ports, the new
// ports and the endpoint record commit together, conditioned on every
// address touched and on the endpoint record, so a proposal can never go
// stale. An unchanged spec gets its previous ports back; the k-th of
// several similar dynamic entries recovers the k-th similar old port; an old
// dynamic port that a static entry of the new spec needs is given up, not
// recovered; a dynamic ingress port never takes an address a host port uses
// on any host; a host port hidden by an ingress port is refused. Removal
// (an empty spec) never fails on spec grounds.
//
// # Errors
//
// *InUseError (ErrInUse) names the holder (port/<network>/<container>/<if>)
// and its host, *DuplicateError (ErrDuplicate) the two entries of the
// request, *ExhaustedError (ErrExhausted) the protocol whose dynamic range
// is full; ErrInvalid a malformed spec (or more ports than one store
// transaction holds), ErrCorrupt a stored record that cannot be read. Store
// trouble is passed through (store.ErrUnavailable), contention that
// outlasts the retries is ErrTryAgain. A failed Allocate writes nothing.
// Allocator is safe for concurrent use; its zero value is not usable (New).
//
// # Store layout (keys under the store's prefix; the package writes only p/)
//
//	p/a/<protocol>/<port, 5 digits>   who holds the address: the ingress endpoint and its host, host-mode users (host, host IP, endpoint)
//	p/e/<network>/<container>/<if>     an endpoint: kind "port", host, spec, ports
//	p/i/<host>/<network>/<container>/<if>  empty: the host's index of its endpoints, present exactly while the record exists and names that host
//	p/x                                the index is complete (written once by its first reader)
//
// Every commit that writes or deletes an endpoint record writes or deletes
// its index key, so HostEndpoints (portmap-ingress's GC, the host agent)
// and ReleaseHost read one host's endpoints only. A store written before
// the index existed gains it on first use (the first reader of the index
// enters every record, then writes p/x); Reindex repairs what an older
// writer adds later (ringctl gc).
//
// # Reclaiming a gone host
//
// ReleaseHost(host, guard) releases every endpoint of a gone host, one
// commit each, each carrying guard: pool's reclaim guard (the host's
// liveness key as read, absent). Every attempt reads the guard's keys with
// the endpoint's record, so once the host is back ReleaseHost stops with
// ErrGuard and the host keeps every port not yet released; an endpoint no
// longer recorded on host is skipped. Several processes may run it at
// once: each endpoint is released by exactly one.
//
// Every rule of an address is decided on its one key, so two commits that
// would break a rule always conflict. An Allocate reads the endpoint record
// (one round trip), every address it holds or names (one), scans the
// dynamic range from a per-endpoint start only for dynamic entries (one
// scan per 128 held numbers passed), and commits once: its cost does not
// grow with the number of ports published elsewhere. A repeated request
// commits nothing.
//
// The pure decision (Plan) reads addresses through a View and returns the
// new ports and the address states to write; the Allocator is the store
// edge. Stored allocations are re-validated when read: a port an endpoint
// record claims that its address does not list, or a record whose ports do
// not fit its spec, is reported (Result.Findings) and not recovered from;
// a port its address does not list is not released either. Audit checks
// the whole of p/e/ and p/a/ (ringctl check): the records agree both ways,
// no two holders break the mode rules, and every endpoint's holder exists
// (Holders: the hosts and attachments the IPAM knows).
package portalloc
