// Command ringctl is the operator's view of a ringipam store and its
// repairs: status, ls, ports, history, explain, check, release, hold drop,
// rmpeer, gc, host ack and import host-local. See README.md; the work is
// done by package cli (cmd/ringctl/cli).
package main

import (
	"fmt"
	"os"

	"github.com/ringipam/ringipam/cmd/ringctl/cli"
	"github.com/ringipam/ringipam/internal/version"
)

func main() {
	if version.Requested(os.Args[1:]) {
		fmt.Println(version.Get().Line("ringctl"))
		return
	}
	os.Exit(cli.Main(os.Args[1:], cli.OSEnv()))
}
