package driver

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"github.com/docker/go-plugins-helpers/ipam"
	"github.com/docker/go-plugins-helpers/sdk"
)

// Paths of the plugin protocol the driver serves.
const (
	pathActivate       = "/Plugin.Activate"
	pathCapabilities   = "/IpamDriver.GetCapabilities"
	pathAddressSpaces  = "/IpamDriver.GetDefaultAddressSpaces"
	pathRequestPool    = "/IpamDriver.RequestPool"
	pathReleasePool    = "/IpamDriver.ReleasePool"
	pathRequestAddress = "/IpamDriver.RequestAddress"
	pathReleaseAddress = "/IpamDriver.ReleaseAddress"
)

// maxBody bounds a request body; IPAM requests are a few hundred bytes.
const maxBody = 1 << 20

// Handler serves the remote IPAM protocol for d. It uses the request and
// response types and the encoding of docker/go-plugins-helpers, but its own
// mux: the helper's handler cannot advertise RequiresRequestReplay and
// gives its driver interface no context, so no request deadline.
// m may be nil.
func Handler(d *Driver, m *Metrics, log *slog.Logger) http.Handler {
	if log == nil {
		log = slog.Default()
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST "+pathActivate, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", sdk.DefaultContentTypeV1_1)
		_ = json.NewEncoder(w).Encode(map[string][]string{"Implements": {"IpamDriver"}})
	})
	mux.HandleFunc("POST "+pathCapabilities, func(w http.ResponseWriter, r *http.Request) {
		done := m.begin("GetCapabilities")
		sdk.EncodeResponse(w, d.Capabilities(), false)
		done(nil)
	})
	mux.HandleFunc("POST "+pathAddressSpaces, func(w http.ResponseWriter, r *http.Request) {
		done := m.begin("GetDefaultAddressSpaces")
		sdk.EncodeResponse(w, d.AddressSpaces(), false)
		done(nil)
	})
	handle(mux, pathRequestPool, "RequestPool", m, log, func(ctx context.Context, req *ipam.RequestPoolRequest) (any, error) {
		return d.RequestPool(ctx, req)
	})
	handle(mux, pathReleasePool, "ReleasePool", m, log, func(ctx context.Context, req *ipam.ReleasePoolRequest) (any, error) {
		return struct{}{}, d.ReleasePool(ctx, req)
	})
	handle(mux, pathRequestAddress, "RequestAddress", m, log, func(ctx context.Context, req *ipam.RequestAddressRequest) (any, error) {
		return d.RequestAddress(ctx, req)
	})
	handle(mux, pathReleaseAddress, "ReleaseAddress", m, log, func(ctx context.Context, req *ipam.ReleaseAddressRequest) (any, error) {
		return struct{}{}, d.ReleaseAddress(ctx, req)
	})
	return mux
}

// handle registers one JSON call: decode, serve, map the error at the edge.
func handle[Req any](mux *http.ServeMux, path, method string, m *Metrics, log *slog.Logger, serve func(context.Context, *Req) (any, error)) {
	mux.HandleFunc("POST "+path, func(w http.ResponseWriter, r *http.Request) {
		done := m.begin(method)
		req := new(Req)
		r.Body = http.MaxBytesReader(w, r.Body, maxBody)
		if err := json.NewDecoder(r.Body).Decode(req); err != nil {
			// dockerd reads the Err field of a JSON body on failures.
			sdk.EncodeResponse(w, ipam.NewErrorResponse("ringipam: cannot decode "+method+" request: "+err.Error()), true)
			done(fmt.Errorf("decode: %w", err))
			return
		}
		res, err := serve(r.Context(), req)
		done(err)
		if err != nil {
			log.Warn("request failed", "method", method, "request", fmt.Sprintf("%+v", *req), "class", Class(err), "err", err)
			sdk.EncodeResponse(w, ipam.NewErrorResponse(Message(err)), true)
			return
		}
		log.Debug("request served", "method", method, "request", fmt.Sprintf("%+v", *req), "response", fmt.Sprintf("%+v", res))
		sdk.EncodeResponse(w, res, false)
	})
}

// SocketPath is where dockerd discovers a plugin named name in dir.
func SocketPath(dir, name string) string { return filepath.Join(dir, name+".sock") }

// Listen creates the plugin socket at path (mode 0600: dockerd runs as
// root, and nobody else may allocate or release addresses), replacing a stale
// socket file left by a driver that died, but refusing to take over the
// socket of a driver that still answers.
func Listen(path string) (net.Listener, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, fmt.Errorf("plugin socket directory: %w", err)
	}
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode()&os.ModeSocket == 0 {
			return nil, fmt.Errorf("plugin socket path %s exists and is not a socket; refusing to replace it", path)
		}
		c, err := net.DialTimeout("unix", path, time.Second)
		if err == nil {
			c.Close()
			return nil, fmt.Errorf("plugin socket %s is served by another process; stop it or choose another --name", path)
		}
		if err := os.Remove(path); err != nil {
			return nil, fmt.Errorf("remove stale plugin socket: %w", err)
		}
	}
	// The socket is created with mode 0600 already (umask), so there is no
	// moment in which another user could connect.
	old := syscall.Umask(0o177)
	l, err := net.Listen("unix", path)
	syscall.Umask(old)
	if err != nil {
		return nil, fmt.Errorf("plugin socket: %w", err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		l.Close()
		return nil, fmt.Errorf("plugin socket: %w", err)
	}
	return l, nil
}

// Serve serves h on l until ctx ends, then shuts down gracefully within
// grace: requests in flight finish (each has its own deadline), new
// connections are refused. It removes a unix socket file on the way out.
func Serve(ctx context.Context, l net.Listener, h http.Handler, grace time.Duration) error {
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 2 * time.Minute}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(l) }()
	var err error
	select {
	case err = <-errc:
	case <-ctx.Done():
		sctx, cancel := context.WithTimeout(context.Background(), grace)
		err = srv.Shutdown(sctx)
		cancel()
		if serr := <-errc; !errors.Is(serr, http.ErrServerClosed) {
			err = errors.Join(err, serr)
		}
	}
	if ua, ok := l.Addr().(*net.UnixAddr); ok {
		if rerr := os.Remove(ua.Name); rerr != nil && !errors.Is(rerr, os.ErrNotExist) {
			err = errors.Join(err, rerr)
		}
	}
	if errors.Is(err, http.ErrServerClosed) {
		err = nil
	}
	return err
}
