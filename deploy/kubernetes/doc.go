// Package kubernetes holds ringipam's Kubernetes manifest, ringipam.yaml,
// and the test that keeps it honest; it has no code of its own.
//
// Contract (checked by the package's test; integration/k8s applies it to a
// real cluster):
//   - Every document of ringipam.yaml decodes strictly (unknown fields
//     refused) into the Kubernetes API type of its kind: a Namespace, a
//     ServiceAccount, a Role and its RoleBinding, a ConfigMap and a
//     DaemonSet.
//   - The ConfigMap's CNI list is accepted by ipam-ring's and
//     portmap-ingress's configuration loaders once the installer put the
//     node's name in it, and names the same store as the agent's flags.
//   - The DaemonSet runs on every node (every taint tolerated,
//     system-node-critical, host network), installs the plugins and the
//     list by write-then-rename from an init container that knows its node
//     from the downward API, and probes the agent's /livez (liveness) and
//     /readyz (readiness).
//   - Both containers run ringipam/ringipam pinned to a release tag
//     (vX.Y.Z, never :dev), the newest release of CHANGELOG.md.
//   - The installer records what it wrote; the agent's preStop hook
//     (cmd/ringipam-uninstall) removes exactly that, only when the
//     DaemonSet is being deleted.
package kubernetes
