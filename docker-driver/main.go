// Command ringipam-docker is the ringipam Docker libnetwork remote IPAM
// driver. It only reads the configuration and runs package driver until
// SIGINT or SIGTERM; see README.md for flags and examples.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/ringipam/ringipam/docker-driver/driver"
	"github.com/ringipam/ringipam/internal/version"
)

func main() {
	if version.Requested(os.Args[1:]) {
		fmt.Println(version.Get().Line("ringipam-docker"))
		return
	}
	cfg, err := driver.LoadConfig(os.Args[1:], os.Getenv, os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		os.Exit(0)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "ringipam-docker:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := driver.Run(ctx, cfg, driver.NewLogger(cfg, os.Stderr)); err != nil {
		fmt.Fprintln(os.Stderr, "ringipam-docker:", err)
		os.Exit(1)
	}
}
