// Package ipam is the verb code of the ipam-ring CNI IPAM plugin, imported
// by the plugin's main (plugins/ipam-ring), the host agent (which runs
// the plugin's invocations with it on etcd) and ringctl. It parses and validates the
// plugin's configuration once, at the door (Load, encoding/json), and runs
// the five CNI verbs (Add, Del, Check, GC, Status) against a pool
// allocator, returning results instead of printing them. Edge is the thin
// edge that the CNI library's dispatcher (skel.PluginMainFuncs) calls with
// *skel.CmdArgs: its verbs load the configuration, open the store, call
// the core, print the result (the library's PrintTo) and turn every error
// into a CNI error (CNIError), so that the dispatcher never has to invent
// code 999.
//
// Contracts:
//   - Load decodes the network configuration leniently (it carries other
//     plugins' and the runtime's keys) and the "ipam" object strictly: an
//     unknown key there or in a range is refused. A configuration larger
//     than MaxConfig is refused before it is decoded.
//   - Load never touches the store or the network. Every error it returns
//     wraps ErrBadConfig (CNI code 7).
//   - Add is idempotent per owner (network, container ID, interface name) and
//     asks for all of an owner's addresses (IPv4 and IPv6) in one Allocate,
//     which the pool commits in one store transaction: either every address
//     is held afterwards or none is.
//   - Del and GC are idempotent and succeed when there is nothing to release.
//     GC with no list of valid attachments releases nothing.
//   - In gatewayMode per-container, Add creates the owner's container
//     networks through pkg/containernet (ip and its own gateway, or an ip in
//     a special subnet from CNI_ARGS SUBNET= with a gateway from the pool),
//     still in one transaction; Del releases ip and gateway; Check compares
//     both.
//   - Check fails (code 104) when the owner's allocation is gone or differs
//     from prevResult.
//   - Status fails with code 50 when the store cannot be reached, a pool's
//     recorded definition differs, or a pool has no free address.
//   - Every store call runs under the configured timeout (default 30s).
//   - Through the host agent (forward.go, package agentapi): an Edge with
//     ToAgent set sends an etcd configuration's whole invocation to the
//     agent's socket, and the agent (AgentHandler) runs the same verb on its
//     own store; what the plugin prints is the agent's answer. The plugin
//     never reaches etcd itself: without an agent ADD, CHECK, GC and STATUS
//     fail with code 11 naming the socket, and DEL is queued on disk for the
//     agent. A local store needs no agent: the plugin runs the verb itself.
//
// The functions are safe for concurrent use; the configuration values they
// take are not modified.
package ipam
