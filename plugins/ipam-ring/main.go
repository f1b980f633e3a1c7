// Command ipam-ring is a CNI IPAM plugin that hands out container addresses
// unique across every host sharing a ringipam store (etcd, or the embedded
// local store for a single host). See README.md for its configuration and
// error codes; the work is done by package pkg/cni/ipam, the CNI library's
// skel dispatches to it.
package main

import (
	"fmt"
	"os"

	"github.com/containernetworking/cni/pkg/skel"

	"github.com/ringipam/ringipam/internal/version"
	"github.com/ringipam/ringipam/pkg/cni/ipam"
)

// main answers --version when run by hand (no CNI_COMMAND); a runtime's
// VERSION command still gets the CNI versions from skel, and the text skel
// prints when run without CNI_COMMAND names the build too.
func main() {
	build := version.Get()
	if os.Getenv("CNI_COMMAND") == "" && version.Requested(os.Args[1:]) {
		fmt.Println(build.Line("ipam-ring"))
		return
	}
	skel.PluginMainFuncs(ipam.Edge{ToAgent: true}.Funcs(), ipam.SupportedVersions, "ipam-ring: cluster-wide CNI IPAM on a ring of host-owned ranges, "+build.Line("ipam-ring"))
}
