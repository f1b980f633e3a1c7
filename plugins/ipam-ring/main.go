// Command ipam-ring is a CNI IPAM plugin that hands out container addresses
// unique across every host sharing a ringipam store (etcd, or the embedded
// local store for a single host). See README.md for its configuration and
// error codes; the work is done by package pkg/cni/ipam, the CNI library's
// skel dispatches to it.
package main

import (
	"github.com/containernetworking/cni/pkg/skel"

	"github.com/ringipam/ringipam/pkg/cni/ipam"
)

func main() {
	skel.PluginMainFuncs(ipam.Edge{ToAgent: true}.Funcs(), ipam.SupportedVersions, "ipam-ring: cluster-wide CNI IPAM on a ring of host-owned ranges")
}
