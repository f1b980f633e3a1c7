//go:build integration

// Package crinode holds what the integration suites that run a private
// containerd 1.6 as a CRI node (integration/cri, integration/k8s) share:
// its configuration.
//
// Contract: only integration-tagged tests import it; ContainerdConfig is
// pure.
package crinode

import (
	"fmt"
	"path/filepath"
)

// Paths are a node's containerd directories and files.
type Paths struct {
	Root, State  string // containerd's root and state directories
	Socket       string // its gRPC socket; the ttrpc one is Socket+".ttrpc"
	SandboxImage string // the pause image (already imported)
	CNIBin       string // the CNI plugins' directory
	CNIConf      string // the CNI configuration directory (one list read)
}

// ContainerdConfig is a containerd 1.6 configuration (format version 2)
// for p. restrict_oom_score_adj: the test machines lack CAP_SYS_RESOURCE,
// without which runc fails. The snapshotters and plugins the suites do not
// need are off; network namespaces are mounted under the state directory.
func ContainerdConfig(p Paths) string {
	return fmt.Sprintf(`version = 2
root = %q
state = %q
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.internal.v1.opt", "io.containerd.tracing.processor.v1.otlp"]

[grpc]
  address = %q

[ttrpc]
  address = %q

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %q
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = %q
    conf_dir = %q
    max_conf_num = 1
`, filepath.Clean(p.Root), filepath.Clean(p.State), p.Socket, p.Socket+".ttrpc", p.SandboxImage, p.CNIBin, p.CNIConf)
}
