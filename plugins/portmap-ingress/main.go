// Command portmap-ingress is a chained CNI plugin that publishes container
// ports, unique per host (host mode) or across the cluster (ingress mode),
// on a ringipam store. See README.md; the work is done by package portmap.
package main

import (
	"github.com/ringipam/ringipam/internal/cnimain"
	"github.com/ringipam/ringipam/plugins/portmap-ingress/portmap"
)

func main() {
	cnimain.Run(portmap.Edge{}.Funcs(), portmap.SupportedVersions, "portmap-ingress: published ports unique across a ringipam cluster")
}
