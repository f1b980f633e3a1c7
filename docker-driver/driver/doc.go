// Package driver is the core of ringipam-docker, the Docker libnetwork remote
// IPAM driver, and its HTTP edge.
//
// # Contract
//
// Driver turns the six IPAM calls of the remote protocol into pkg/pool calls
// on a shared store; it keeps no state of its own in memory except an
// in-process lock, so a driver restart or a dockerd restart loses nothing and
// duplicates nothing. Every call runs under a deadline (Options.Timeout, or
// the caller's earlier one), and so does every store call under it.
//
//   - RequestPool with a subnet (--subnet, optional --ip-range, optional
//     --ipam-opt pool=NAME) names a cluster-wide pool: the same subnet (or
//     the same NAME) on several hosts is one pool. The returned PoolID
//     encodes pool name, subnet, allocatable range and, for pools picked
//     from the default pools, a lease token; dockerd keeps it and passes it
//     back, so later calls need no lookup. If the pool is already recorded
//     (by another host, or by the CNI plugin) all its ranges must lie in the
//     same subnet, exactly one of them dynamic (not Static), and that one
//     the same range if --ip-range was given; otherwise the call fails with
//     an error wrapping pool.ErrDefinitionMismatch. With --ip-range the rest
//     of the subnet is recorded as static-only ranges: only --ip gets it.
//   - RequestPool without a subnet leases a subnet of this host's default
//     pools that this host holds no lease on, so repeated calls return
//     different subnets while the earlier ones are held. The lease lives in
//     the store under "docker/lease/<host>/" and is dropped by the matching
//     ReleasePool (the token is in the PoolID); dockerd's replay at start-up
//     asks with an explicit subnet and so takes no second lease.
//   - The gateway request (RequestAddressType=com.docker.network.gateway)
//     records the pool definition on first use, with --gateway or else the
//     subnet's first usable address as the range's gateway, and returns the
//     recorded gateway on every host. pkg/pool never hands a gateway out.
//     Asking for a different gateway than the recorded one is an error.
//   - Container addresses are owned by pool.Owner{Kind: docker, Network:
//     <pool>, ContainerID: <endpoint MAC>}: dockerd sends the MAC
//     (RequiresMACAddress) and replays its endpoints after a restart
//     (RequiresRequestReplay), and a replay by the same owner returns what
//     it holds. The allocation records the host: the same MAC on a second
//     host is refused ("already exists ... on host A"), and only the
//     holding host releases. Owners of kind docker are invisible to the CNI
//     plugin's GC and CHECK, whatever the network names.
//   - An --aux-address arrives as a request without a MAC; an address the
//     pool may hand out is reserved cluster-wide by one shared owner
//     "aux-<addr>" (pool.Allocator.Share) whose record lists every host
//     whose network reserves it, written in the same commit as the claim.
//     A host's ReleaseAddress (Unshare), or the reclaim of a gone host,
//     drops only that host's claim; the last claim frees the address. The
//     claim is per host, not per Docker network: dockerd's release carries
//     no network ID and its start-up replay re-requests every aux address,
//     so two networks of one host on one pool share one claim. Drivers
//     before shared owners kept the hosts as markers under
//     "docker/aux/<pool>/<addr>/<host>"; such a record (no holders) reads
//     as held by its host, and the next request or release of the address
//     on any host adopts the markers' hosts as holders and deletes them.
//     Aux addresses outside the allocatable range need no reservation.
//   - ReleaseAddress and ReleasePool succeed for addresses and pools that
//     are unknown or already released.
//
// Errors are the wrapped errors of pkg/pool and pkg/store; Message turns one
// into the text dockerd shows ("Error response from daemon:
// IpamDriver.RequestAddress: <text>"). Driver is safe for concurrent use.
package driver
