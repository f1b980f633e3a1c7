// Command portmap-ingress is a chained CNI plugin that publishes container
// ports, unique per host (host mode) or across the cluster (ingress mode),
// on a ringipam store. See README.md; the work is done by package
// pkg/cni/portmap, the CNI library's skel dispatches to it.
package main

import (
	"fmt"
	"os"

	"github.com/containernetworking/cni/pkg/skel"

	"github.com/ringipam/ringipam/internal/version"
	"github.com/ringipam/ringipam/pkg/cni/portmap"
)

// main answers --version when run by hand (no CNI_COMMAND); a runtime's
// VERSION command still gets the CNI versions from skel, and the text skel
// prints when run without CNI_COMMAND names the build too.
func main() {
	build := version.Get()
	if os.Getenv("CNI_COMMAND") == "" && version.Requested(os.Args[1:]) {
		fmt.Println(build.Line("portmap-ingress"))
		return
	}
	skel.PluginMainFuncs(portmap.Edge{ToAgent: true}.Funcs(), portmap.SupportedVersions, "portmap-ingress: published ports unique across a ringipam cluster, "+build.Line("portmap-ingress"))
}
