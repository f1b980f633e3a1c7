// Command ringctl is the operator's view of a ringipam store and its
// repairs: status, ls, ports, history, explain, check, release, hold drop,
// rmpeer, gc, host ack and import host-local. See README.md; the work is
// done by package cli (cmd/ringctl/cli).
package main

import (
	"os"

	"github.com/ringipam/ringipam/cmd/ringctl/cli"
)

func main() {
	os.Exit(cli.Main(os.Args[1:], cli.OSEnv()))
}
