// Package harness is ringipam's scale harness: N simulated hosts in one
// process, each running the host agent's real code (cmd/ringipamd/agent:
// New and Run, each agent with its own etcd client, lease and watches, its
// own agent socket and DEL queue under a temporary directory), against a
// real etcd (internal/testenv: one member, or three for the big sizes),
// and what that costs etcd, read from etcd's own /metrics before and after
// each phase.
//
// What a simulated host is: the agent with --routes and --ingress on, its
// router and ingress forwarder replaced by fakes that record what the
// agent installs (no kernel state: thousands of agents share one
// network namespace), portmap-ingress's table left alone (PortmapTable
// "off"), HTTP off. Its containers are allocated as the plugins allocate
// them: whole ipam-ring and portmap-ingress invocations sent to the
// agent's socket with the agentapi client, so that an ADD's latency
// includes the agent API. portmap-ingress's verbs run in the agents, with
// nftables: the harness's process runs in a network namespace of its own
// (Main re-executes the test binary under unshare --net, loopback up), each
// simulated host with its own table ("rp-<host>"), so that nothing reaches
// the machine's own tables.
//
// Run (Scale) runs the phases of issues 41 and 42 for one size N: start
// (all hosts start together and each makes its first ADD at the same
// moment), fill (allocations per host, a host-mode port on every host, a
// few ingress ports), per-ADD bytes (ProbeADDs: one host's ADDs through
// its agent's handler on a connection of their own through a counting
// TCP relay), idle, churn, join, ring change,
// port publish, leave, orphan and reclaim, and with Options.Chaos a churn
// while the etcd leader is killed and one agent's etcd connection is cut
// (three members); then the checks (no duplicate address, nothing
// leaked: ringctl check's library and the harness's own ledger). Cost
// reads the metrics; Report prints the tables and the verdicts and writes
// JSON; SVG draws cost per host against N.
//
// Counts (requests, watch messages, bytes) do not depend on the machine;
// times (ADD latency, CPU) are only comparable within one run.
package harness
