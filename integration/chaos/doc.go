//go:build integration

// Package chaos is ringipam's fault suite (issue 14): real parts under
// faults, then proof that nothing was lost or handed out twice.
//
// A run builds a LAN of network namespaces with a real three-member etcd
// cluster (Debian's /usr/bin/etcd, three processes), four hosts (separate
// processes, each in its own network and UTS namespace with its own host
// name) running eight workers that call the real ipam-ring binary, then the
// real portmap-ingress binary (one dynamic ingress port from a small range,
// with ipam-ring's result as prevResult), once per ADD, and both in reverse
// per DEL, as a runtime runs a conflist, and the real Docker driver
// (bin/ringipam-docker) on a fifth host, driven over its plugin socket with
// the libnetwork IPAM protocol. Every front end shares one pool. While the
// workload runs, the suite SIGKILLs plugin processes mid-ADD (either
// plugin), kills the etcd leader and starts it again, cuts a host off from
// etcd with nftables rules in its namespace and heals it, and SIGKILLs the
// driver mid-request and starts it again.
//
// Afterwards it reads every allocation and published port, runs each
// host's GC of both plugins (CNI 1.1, with the true list of live
// attachments) and checks: no address with two owners (neither in the
// history nor in the store), no leak (every held address belongs to a live
// attachment or endpoint), nothing lost (every live attachment still holds
// the address it was given), the ring and the records consistent
// (pool.Allocator.Check, RingOf), every failed call a clear error (CNI code
// 11 for store trouble, 102 for a full pool or port range; never 999), and
// the whole history of address calls linearizable against a model of the
// pool (github.com/anishathalye/porcupine). The same for ports: no port two
// live endpoints hold (history and store), no port record, address key or
// forward left after GC for an attachment that is not live, and every live
// attachment still holding (and forwarding) the port its ADD returned. It
// prints one summary line.
//
// Every count the suite asserts is certain by the workload's construction,
// not by timing: before the workers and the faults start, each host makes
// its first attachment (kept to the end) and two ADDs that are killed for
// sure (they wait for their configuration on stdin); every fault happens
// once a cycle, the driver is killed with the fault's own request held in
// flight.
//
// The same suite run against deliberately broken plugins (testdata/
// brokenplugin and testdata/brokenportmap, on package testdata/broken:
// commits without their revision conditions, never part of a production
// build) must report duplicates of addresses and of ports. Both are
// certain: the first attachments of two hosts ask for one static address
// and one static port, and the broken store holds each plugin's commit at a
// barrier the suite serves until both hosts' plugins have read the store.
//
// `make test` runs the short form (a few hundred calls, one cycle of each
// fault); `make chaos` the full one (10 000 calls, faults in cycles until
// the calls are done).
package chaos
