// Command portmap-ingress is a chained CNI plugin that publishes container
// ports, unique per host (host mode) or across the cluster (ingress mode),
// on a ringipam store. See README.md; the work is done by package
// pkg/cni/portmap, the CNI library's skel dispatches to it.
package main

import (
	"github.com/containernetworking/cni/pkg/skel"

	"github.com/ringipam/ringipam/pkg/cni/portmap"
)

func main() {
	skel.PluginMainFuncs(portmap.Edge{ToAgent: true}.Funcs(), portmap.SupportedVersions, "portmap-ingress: published ports unique across a ringipam cluster")
}
