package driver

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/ringipam/ringipam/pkg/hostlock"
	"github.com/ringipam/ringipam/pkg/pool"
	_ "github.com/ringipam/ringipam/pkg/store/etcd" // storeconfig.Open's etcd backend
	"github.com/ringipam/ringipam/pkg/storeconfig"
)

// shutdownGrace bounds the graceful shutdown of the listeners.
const shutdownGrace = 10 * time.Second

// NewLogger returns a text logger on w at cfg's level.
func NewLogger(cfg Config, w interface{ Write([]byte) (int, error) }) *slog.Logger {
	lvl, _ := parseLevel(cfg.LogLevel)
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: slog.Level(lvl)}))
}

// Run serves the driver described by cfg until ctx ends: the plugin socket,
// and the metrics listener if configured. It returns when both have shut
// down, with the first error that stopped them.
func Run(ctx context.Context, cfg Config, log *slog.Logger) error {
	st, err := storeconfig.Open(cfg.Store)
	if err != nil {
		return fmt.Errorf("open store: %w", err)
	}
	defer st.Close()
	// The host lock lets the driver and ipam-ring processes on the same
	// host, sharing a pool, queue instead of conflicting in the store.
	alloc, err := pool.New(st, cfg.Host, pool.WithTimeout(time.Duration(cfg.Timeout)), pool.WithHostLock(hostlock.DefaultDir), pool.WithLastSeen())
	if err != nil {
		return err
	}
	m := NewMetrics()
	d, err := New(alloc, Options{DefaultPools: cfg.DefaultPools, Timeout: time.Duration(cfg.Timeout), Metrics: m, Logger: log})
	if err != nil {
		return err
	}

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var ml net.Listener
	if cfg.MetricsAddr != "" {
		if ml, err = net.Listen("tcp", cfg.MetricsAddr); err != nil {
			return fmt.Errorf("metrics listener: %w", err)
		}
	}
	path := SocketPath(cfg.PluginDir, cfg.Name)
	pl, err := Listen(path)
	if err != nil {
		if ml != nil {
			ml.Close()
		}
		return err
	}
	log.Info("serving", "socket", path, "host", cfg.Host, "store", cfg.Store.Describe(), "metrics", cfg.MetricsAddr, "defaultPools", (&poolsFlag{pools: &cfg.DefaultPools}).String())

	errc := make(chan error, 2)
	n := 1
	go func() { errc <- Serve(ctx, pl, Handler(d, m, log), shutdownGrace) }()
	if ml != nil {
		n++
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(m.Registry, promhttp.HandlerOpts{Registry: m.Registry}))
		go func() { errc <- Serve(ctx, ml, mux, shutdownGrace) }()
	}
	var first error
	for range n {
		if err := <-errc; err != nil && first == nil {
			first = err
		}
		cancel() // one listener failing stops the other
	}
	if first != nil && !errors.Is(first, context.Canceled) {
		return first
	}
	log.Info("stopped")
	return nil
}
