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
//     (default 48h), orphaned. Liveness is the lease alone: nothing is
//     written on a timer to say the host is up. Every Heartbeat the agent
//     reads its host record (n/<host>, watched by every routing agent) and
//     its status record (s/<host>, watched by nobody) in one round trip:
//     it writes the host record only when its content changes (absent, or
//     another --addr; orphaning and acknowledgement are written by the
//     reclaim and by ringctl), and the status record's last-seen time at
//     most every pool.SeenEvery(OrphanAfter) (OrphanAfter/48 within
//     [1m, 1h]: 1h at 48h). It learns whether it was orphaned while away:
//     it then logs it at error level, shows it on its status page and in
//     ringipam_host_orphaned, until an operator acknowledges it. The
//     plugins' last-seen touch and the routes summary go to the status
//     record too.
//   - Leader (leader.go): the agents with Sweep elect one of them through
//     etcd's concurrency.Election on e/ (a session of LeaseTTL of its own;
//     each candidate waits on its predecessor only). Only the leader
//     sweeps, compacts the history and computes the pool-wide figures;
//     ringipam_leader and the status page say which agent leads. A leader
//     whose session ends stops all of it and campaigns again; a clean stop
//     resigns at once. On the local store the agent leads alone.
//   - Reclaim: every SweepInterval the leader runs pool.Sweeper: orphaned
//     hosts' ranges tombstoned and owners released (pool.Allocator's
//     Reclaim), their published ports released (portalloc.ReleaseHost,
//     through the host's index, under pool's ReclaimGuard); a host found
//     with nothing left is not read again, and its records (host record,
//     status record, host states) are removed Retention(OrphanAfter) (=
//     OrphanAfter) after its orphaning, in one commit conditioned on them
//     as read and on its liveness key absent. Every reclaiming commit is
//     conditioned on what it read and on the host's liveness key being
//     absent, so two leaders for a moment release each owner once and
//     touch nothing of a live host.
//   - Kubernetes (kube.go, vanished.go; off unless asked): with
//     KubeReclaimNodes the agent marks its host record a Kubernetes node
//     (pool.Allocator.MarkKubeNode, once) and the leader follows Node
//     objects (a metadata-only informer): a deleted Node's host, if marked,
//     is reclaimed at once by the sweep's fenced reclaim once its liveness
//     key is gone (a watch of that key while it exists); at the informer's
//     sync, marked hosts without a Node too. With KubeVanishedPods every
//     agent follows its own node's pods (field selector spec.nodeName) and
//     releases, as a DEL, an owner whose recorded pod is gone and whose
//     sandbox the runtime (CRI ListPodSandbox) does not list, VanishedGrace
//     after both the allocation and the pod's disappearance; the decision
//     is the pure function vanished.
//   - What an idle host costs etcd: its lease's keep-alives (two: the
//     liveness lease and the election session), one read per Heartbeat
//     (two a minute at 30s), one unwatched write per SeenEvery, no watched
//     write; the leader alone reads every host (Hosts) once per
//     SweepInterval and the pools' host states and rings once per
//     StatusRefresh.
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
//     the same as /readyz (health.go). The status page and /status.json
//     (every host, every pool with the use of each range: every owner
//     listed) are read on demand, when a request comes and the last read
//     is older than StatusRefresh (one read at a time, shared by the
//     requests waiting for it). /metrics shows this host's own figures
//     (its host state in each pool: its own keys, read at scrape time at
//     most once per StatusRefresh) and, on the leader only, the pool-wide
//     ones (the hosts and every pool's host states, read the same way: at
//     scrape time, at most once per StatusRefresh).
//   - Every store operation runs under Timeout; failures are logged,
//     counted in ringipam_store_errors_total and retried on the next tick.
package agent
