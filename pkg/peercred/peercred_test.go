package peercred_test

import (
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/ringipam/ringipam/pkg/peercred"
)

// serve listens on a fresh unix socket through a peercred.Listener with
// opts and returns its path and a channel of the connections it admits.
func serve(t *testing.T, opts peercred.Options) (string, <-chan net.Conn) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "s.sock")
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	pl := peercred.NewListener(l, opts)
	t.Cleanup(func() { pl.Close() })
	admitted := make(chan net.Conn, 4)
	go func() {
		for {
			c, err := pl.Accept()
			if err != nil {
				close(admitted)
				return
			}
			admitted <- c
		}
	}()
	return path, admitted
}

func TestAdmitsTheAllowedUID(t *testing.T) {
	path, admitted := serve(t, peercred.Options{UID: uint32(os.Geteuid())})
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	select {
	case sc := <-admitted:
		cred, err := peercred.Of(sc)
		if err != nil {
			t.Fatal(err)
		}
		if cred.UID != uint32(os.Geteuid()) || cred.PID != int32(os.Getpid()) {
			t.Fatalf("credentials %+v, want uid %d pid %d", cred, os.Geteuid(), os.Getpid())
		}
		sc.Close()
	case <-time.After(10 * time.Second):
		t.Fatal("the allowed peer was not admitted within 10s")
	}
}

// A peer of another uid is closed unread and reported, and the listener
// goes on admitting the next, allowed, peer.
func TestRefusesOtherUIDsAndGoesOn(t *testing.T) {
	refused := make(chan error, 4)
	other := uint32(os.Geteuid()) + 1
	opts := peercred.Options{UID: other, OnRefuse: func(_ peercred.Cred, err error) { refused <- err }}
	path, admitted := serve(t, opts)
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	select {
	case err := <-refused:
		if !errors.Is(err, peercred.ErrRefused) {
			t.Fatalf("refusal %v does not wrap ErrRefused", err)
		}
	case c := <-admitted:
		c.Close()
		t.Fatal("a peer of another uid was admitted")
	case <-time.After(10 * time.Second):
		t.Fatal("no refusal within 10s")
	}
	// The refused connection is closed: the client reads EOF.
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if n, err := c.Read(make([]byte, 1)); err != io.EOF {
		t.Fatalf("read on a refused connection: %d, %v; want EOF", n, err)
	}
	select {
	case c, ok := <-admitted:
		if ok {
			c.Close()
			t.Fatal("admitted after a refusal")
		}
		t.Fatal("the listener stopped after a refusal")
	default:
	}
}

func TestOfNeedsASocket(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	if _, err := peercred.Of(a); err == nil {
		t.Fatal("credentials of a pipe")
	}
}
