// Package routes plans and installs the routes that let containers on one
// host reach containers on another: every live range of every pool that
// another host owns is routed to that host's address (its agent's --addr).
//
// # Planning (pure)
//
// Plan takes the pools (definition and ring), the hosts (name, state,
// addresses), this host's name and its directly connected prefixes, and
// returns the desired routes, both families, and the ranges it refuses to
// route with the reason. Rules:
//
//   - a range owned by another host that is up, or down but not orphaned
//     (its containers may still answer), gets a route to that host's
//     address of the pool's family;
//   - tombstoned and unowned ranges, ranges of orphaned hosts, and this
//     host's own ranges get none (the local side is the bridge's or ptp's);
//   - a range is clipped to the pool's allocatable addresses (its ranges'
//     [rangeStart, rangeEnd] minus gateways and exclusions: a gateway lives
//     on every host's own bridge) and split into the fewest CIDR prefixes;
//   - a range whose host has no address of the pool's family, whose next hop
//     is not inside a prefix directly connected to this host, or whose next
//     hop is one of this host's own addresses, is refused, not installed:
//     hosts on different L2 segments need an overlay or BGP, which ringipam
//     does not provide;
//   - two pools (Isolated ones may overlap) that want one prefix through
//     different next hops: the first pool in name order keeps it, the other
//     is refused.
//
// Plan never fails: what cannot be routed is a Refusal. The output is sorted
// and deterministic.
//
// # Installing (Linux, netlink)
//
// Table installs a plan in a routing table of its own (DefaultTable, 4212)
// with a route protocol of its own (DefaultProtocol, 212) and points the
// kernel at it with one policy rule per family (DefaultRulePriority,
// 32000: before the main table's 32766). It only ever lists, changes or
// deletes routes carrying both its table and its protocol, and rules
// carrying its table and priority, so routes and rules it did not make are
// never touched. See table_linux.go for why a table of its own.
//
// # Both families
//
// A host has at most one address per family (its agent's --addr
// "198.18.0.1,fd00::1"; HostsFrom reads the host record's list, and a
// record of one address as agents wrote it before dual-stack hosts); a
// pool's ranges go through the host's address of the pool's family, and a
// host with none of that family is refused for that pool only.
//
// The local side: containers on a bridge whose subnet is the whole pool
// see every address of it as on-link and ask for neighbours on other hosts
// (ARP, or neighbour discovery for IPv6). IPv4: Table.ProxyARP turns proxy
// ARP on for the links holding a pool address (the bridges with the
// gateway), so the bridge answers for exactly the addresses routed out of
// another link. Clear puts the previous values back. IPv6: Linux has no
// range-wide proxy NDP (only one entry per address), so the container
// must not see other hosts' addresses as on-link: ipam-ring's
// "ipv6ViaGateway" gives it a route for the subnet through the gateway
// with metric 100, below the 256 of the kernel's on-link prefix route, and
// the host delivers its own containers on the bridge (its connected route)
// and routes other hosts' ranges through this table. (IPv4's on-link route
// has metric 0 and always wins, hence proxy ARP there.) Per-address proxy
// NDP entries, kept by the agent from every allocation, were not chosen:
// they follow every container, not the rare range moves, and a container
// started on another host is unreachable until every agent saw it.
// Containers behind ptp have the host as their gateway and need nothing
// more than the routes, in either family. Docker's bridge networks get
// IPv4 only: the Docker IPAM API returns no routes, so nothing gives their
// containers the IPv6 subnet route (the agent logs this).
package routes
