// Package peercred admits or refuses the peers of a unix stream socket by
// the credentials the kernel recorded when they connected (SO_PEERCRED).
//
// Contract:
//   - Wrap a unix listener with NewListener: its Accept returns only
//     connections whose peer's effective uid is the allowed one (0, root,
//     unless Options.UID says otherwise). Every other connection is closed
//     before a byte of it is read, reported to Options.OnRefuse, and Accept
//     goes on to the next one: a refused peer never ends the serving loop.
//   - The credentials are those of the process at connect(2) time, taken
//     by the kernel; a peer cannot forge them, and a root process that
//     connected and then dropped privileges still counts as root (the
//     kernel's rule). File modes are the first door (a socket 0600 in a
//     0700 directory); this check is the second, for peers that pass the
//     first (CAP_DAC_OVERRIDE, a directory or mode changed by mistake).
//   - A connection whose credentials cannot be read (not a unix socket) is
//     refused, never admitted.
//
// It knows nothing of the protocol spoken on the socket: the agent's API
// server (package agentapi) puts it in front of its accept loop.
package peercred

import (
	"errors"
	"fmt"
	"net"
	"syscall"

	"golang.org/x/sys/unix"
)

// Cred is a peer's identity as the kernel recorded it at connect time.
type Cred struct {
	PID int32
	UID uint32
	GID uint32
}

// ErrRefused is wrapped by the error OnRefuse receives for a peer whose uid
// is not the allowed one.
var ErrRefused = errors.New("peer uid not allowed on this socket")

// Of reads the credentials of c's peer. c must be a unix stream connection
// (a *net.UnixConn, or anything with a SyscallConn of one).
func Of(c net.Conn) (Cred, error) {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return Cred{}, fmt.Errorf("peer credentials: %T is not a socket", c)
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return Cred{}, fmt.Errorf("peer credentials: %w", err)
	}
	var (
		u    *unix.Ucred
		uerr error
	)
	if err := raw.Control(func(fd uintptr) {
		u, uerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return Cred{}, fmt.Errorf("peer credentials: %w", err)
	}
	if uerr != nil {
		return Cred{}, fmt.Errorf("peer credentials: SO_PEERCRED: %w", uerr)
	}
	return Cred{PID: u.Pid, UID: u.Uid, GID: u.Gid}, nil
}

// Options configure a Listener.
type Options struct {
	// UID is the only peer uid admitted. The zero value admits root only.
	UID uint32
	// OnRefuse, if not nil, is told of every refused connection: the
	// peer's credentials (zero when unreadable) and why. It runs in the
	// accept loop: keep it short (a log line, a counter).
	OnRefuse func(Cred, error)
}

// Listener is a net.Listener that admits only peers with the allowed uid.
type Listener struct {
	net.Listener
	opts Options
}

// NewListener wraps l (a unix stream listener).
func NewListener(l net.Listener, opts Options) *Listener {
	return &Listener{Listener: l, opts: opts}
}

// Accept returns the next connection of an admitted peer. Connections of
// other peers are closed and reported; an error of the wrapped listener is
// returned as is.
func (l *Listener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		cred, err := Of(c)
		if err == nil && cred.UID != l.opts.UID {
			err = fmt.Errorf("%w: uid %d (pid %d), only uid %d may connect", ErrRefused, cred.UID, cred.PID, l.opts.UID)
		}
		if err == nil {
			return c, nil
		}
		c.Close()
		if l.opts.OnRefuse != nil {
			l.opts.OnRefuse(cred, err)
		}
	}
}
