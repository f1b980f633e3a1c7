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
// The local side: containers on a bridge whose subnet is the whole pool
// ARP for neighbours on other hosts; Table.ProxyARP turns proxy ARP on for
// the links holding a pool address (the bridges with the gateway), so the
// bridge answers for exactly the addresses routed out of another link.
// Clear puts the previous values back. Containers behind ptp have the host
// as their gateway and need nothing more than the routes.
package routes
