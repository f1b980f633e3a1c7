// Package agent is ringipamd, the host agent: one long-running process per
// host, beside the CNI plugins and the Docker driver, sharing their packages
// and store.
//
// Contract:
//
//   - Liveness: on etcd the agent keeps its host's liveness key
//     (pool.LivenessKey) on a lease it renews; the key vanishes one lease
//     TTL after the agent dies (SIGKILL included), at once when it stops
//     cleanly. A host without the key is down; down longer than OrphanAfter
//     (default 48h), orphaned. Every Heartbeat it also writes the host's
//     last-seen time and address (where other hosts forward its ingress
//     ports), and learns whether it was orphaned while away: it then logs
//     it at error level, shows it on its status page and in
//     ringipam_host_orphaned, until an operator acknowledges it.
//   - Reclaim: every SweepInterval it runs pool.Allocator.Sweep (orphaned
//     hosts' ranges tombstoned, their owners released) and releases the
//     published ports of orphaned hosts (portalloc.ReleaseHost, through the
//     host's index, under pool's ReclaimGuard). Agents sweep concurrently
//     without an election: every reclaiming commit, of addresses and of
//     ports, is conditioned on what it read and on the host's liveness key
//     being absent, so each owner is released exactly once and nothing of
//     a live host is touched.
//   - Watch, then apply (informer.go, package watchcache): the Ingress,
//     Own forwards and Routes loops decide from in-memory copies of the
//     prefixes they need: definitions (d/), rings (g/), host records (n/),
//     liveness keys (l/), published ports (p/a/) and this host's endpoint
//     index (p/i/<host>/). On etcd each copy is listed once and then
//     follows a watch from the listed revision, applying every event; it
//     is listed again only when its watch's revision was compacted. No
//     event makes an agent read the store. The loops wake when a copy
//     changes and on a resync every Resync (default 5m, jittered) that
//     re-applies their tables from the copies (hand edits repaired), never
//     from the store. On a local store (one host) the copies are scanned
//     every SyncInterval instead. A host counts as up while its liveness
//     key exists, else as orphaned when its host record carries the
//     orphaned mark (set by the sweep that reclaims it, with its ranges
//     tombstoned), else as down; a host whose last-seen time passed
//     OrphanAfter is down until the sweep marks it.
//   - Ingress: for every ingress port held on another (not orphaned) host,
//     the agent's own nftables table DNATs packets to a local address on
//     that port to the holder's recorded address, and masquerades them so
//     replies return through this host. The forwards are computed from the
//     copies of the published ports, host records and liveness keys; the
//     table is rewritten whole when they change, on every resync, and
//     every SyncInterval after a failed rewrite, and removed when the
//     agent stops.
//   - Own forwards: with Ingress, on start, whenever the copy of this
//     host's endpoint index loses an endpoint, and on every resync it
//     compares portmap-ingress's table on this host (PortmapTable) with
//     the endpoints that index names, and removes the forwards of every
//     attachment it does not hold (reclaimed while the host was away, or
//     released elsewhere), each under the attachment's lock with the store
//     read again there, so an ADD under way is never undone.
//   - Routes (Routes, off by default): every live range of another host
//     that is up or down but not orphaned is routed to that host's
//     recorded address in a routing table of the agent's own (package
//     routes: planned from the copies of the definitions, rings, host
//     records and liveness keys, refused with a logged reason when the
//     next hop is not directly connected), applied when the plan changes
//     and on every resync, with proxy ARP on the pools' bridges (the local
//     side of bridge networks; every SyncInterval the agent also looks,
//     without reading the store, for new bridges, a change of this host's
//     addresses and a failed apply), and removed whole, proxy ARP values
//     put back, when the agent stops.
//   - HTTP (Listen, loopback by default): / is the status page (an SVG ring
//     per pool: ranges coloured by host, fill level, tombstones; one band
//     per host), /status.json the same data, /metrics Prometheus metrics,
//     /livez 200 while the agent's loops turn, whatever the store does
//     (503 when the heartbeat loop has not run for three intervals and
//     three operation deadlines, or the plugins' socket stopped serving:
//     a stuck agent, which a restart fixes), /readyz 200 while it can
//     serve the plugins (live, liveness record held, host name its own;
//     503 during a store outage, when a restart would not help), /healthz
//     the same as /readyz (health.go). Pages are served from
//     a snapshot read every StatusRefresh; a request never waits on the
//     store unless no snapshot exists yet.
//   - Every store operation runs under Timeout; failures are logged,
//     counted in ringipam_store_errors_total and retried on the next tick.
package agent
