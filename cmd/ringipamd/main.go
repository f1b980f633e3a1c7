// Command ringipamd is the ringipam host agent: liveness, reclaim of hosts
// that are gone, ingress forwarding, metrics and a status page. It only
// reads the configuration and runs package agent until SIGINT or SIGTERM;
// see README.md for flags and examples.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/ringipam/ringipam/cmd/ringipamd/agent"
	"github.com/ringipam/ringipam/internal/version"
)

func main() {
	if version.Requested(os.Args[1:]) {
		fmt.Println(version.Get().Line("ringipamd"))
		return
	}
	cfg, err := agent.LoadConfig(os.Args[1:], os.Getenv, os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		os.Exit(0)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "ringipamd:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := agent.Run(ctx, cfg, agent.NewLogger(cfg, os.Stderr)); err != nil {
		fmt.Fprintln(os.Stderr, "ringipamd:", err)
		os.Exit(1)
	}
}
