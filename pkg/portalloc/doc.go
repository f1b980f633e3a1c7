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
//	p/a/<protocol>/<port, 5 digits>   the address: its ingress endpoint and host; the marker while host-mode bindings exist; old-format host users
//	p/h/<protocol>/<port>/<host>      one host's host-mode bindings of the address (host IP, endpoint)
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
// # Host ports per host
//
// A host-mode binding lives in its host's key p/h/<proto>/<port>/<host>,
// not in the address's key: a hostPort DaemonSet on N hosts writes N small
// keys and the address's p/a/ key once, where one p/a/ value listing every
// host grew with N and each of its N writes reached every agent watching
// p/a/ (O(N²) bytes). p/a/ keeps the ingress holder, and while any binding
// of the address exists under p/h/ a marker: a host use whose host is
// "p/h/" (no host name contains '/'), written in the commit of the first
// binding when p/a/ lacks it, never rewritten per host.
//
// Every rule is still decided so that two commits that would break it
// conflict. A host-mode commit conditions on p/a/ as read (no ingress
// holder; the marker there, or written by this commit) and on its host's
// p/h/ key as read (the collisions on one host). A commit that makes a new
// ingress holder, or removes the marker, conditions on p/a/ as read and on
// no p/h/ key of the address existing but those of the hosts it read and
// writes (store.AbsentRange around them). The marker makes the p/a/
// condition enough in the common case: a first binding writes p/a/, so an
// ingress commit that read p/a/ without a marker conflicts; the range
// condition covers a marker read stale (its bindings released meanwhile,
// or left by two last releases at once) and a marker removal racing a new
// binding of another host (the layout model check's broken variants show
// both). A release that leaves its hosts no binding of the address looks
// for another host's binding (a scan of at most 3 keys) and removes the
// marker when there is none; two last releases at once may each see the
// other and leave a stale marker, which is harmless (a static ingress port
// takes the address and drops it; a dynamic ingress search passes it) and
// removed by Tidy (ringctl gc).
//
// The dynamic-range search still scans p/a/ only: a number with no p/a/
// key is used by no host (the marker would be there), a marked number is
// host-used (a dynamic ingress port passes it, a host-mode entry reads its
// own host's p/h/ key, one Get per page of marked numbers), so its cost
// does not grow with the number of hosts binding other ports.
//
// Mixed versions (a rolling restart from 082f606, which keeps every host
// user inside p/a/): the old code reads only p/a/. It decodes the marker as
// a host-mode user of a host it never is, so it refuses an ingress port on
// an address bound in p/h/ (and its dynamic ingress search passes it) and
// finds no collision with it for a host binding of its own, which it
// appends to p/a/ keeping the marker (its releases keep it too: it removes
// only its endpoint's users, and deletes p/a/ only when empty). The new
// code honours every old-format user in p/a/ as a binding of its host
// (Plan sees them with the p/h/ bindings), and moves those of the hosts a
// commit touches (its own host; the endpoint's old host for a move or a
// reclaim) to their p/h/ keys in that commit: online, conditioned on p/a/
// and the p/h/ keys as read, idempotent. Tidy (ringctl gc) moves the rest
// once the restart is over. What is not covered: the old code does not see
// p/h/, so an old plugin on a host whose new plugin already bound the same
// port there may bind it again (only while both versions run on one host,
// for calls in flight across the binary's replacement), and an old plugin
// releasing an endpoint whose user its host's new code moved meanwhile
// leaves the binding (Audit reports it leaked, Tidy releases it), as does
// an old sweep reclaiming a gone host whose new code moved its bindings.
// An old Audit reports the marker as a leaked host user. A downgrade after
// p/h/ is in use has the same limits.
//
// # Cost
//
// An Allocate reads the endpoint record (one round trip), every address it
// holds or names with its hosts' p/h/ keys (one), looks for another host's
// binding only where a marker may go or an ingress port asks (one small
// scan each), scans the dynamic range from a per-endpoint start only for
// dynamic entries (one scan per 128 held numbers passed), and commits
// once: its cost does not grow with the number of ports published
// elsewhere, nor with the hosts that bind the same port. A repeated
// request commits nothing (unless it moves old-format users).
//
// The pure decision (Plan) reads addresses through a View and returns the
// new ports and the address states to write; the Allocator is the store
// edge. Stored allocations are re-validated when read: a port an endpoint
// record claims that its address does not list, or a record whose ports do
// not fit its spec, is reported (Result.Findings) and not recovered from;
// a port its address does not list is not released either. Audit checks
// the whole of p/e/, p/a/ and p/h/ (ringctl check): the records agree both
// ways, no two holders break the mode rules, every binding under p/h/ is
// marked in p/a/, and every endpoint's holder exists (Holders: the hosts
// and attachments the IPAM knows).
//
// List returns every address with all its holders (p/a/ and p/h/: ringctl
// ports); Ingresses only the ingress holders, from p/a/ alone (what the
// agents forward). Both decode a p/a/ key with decodeAddress.
package portalloc
