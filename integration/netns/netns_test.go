//go:build integration

package netns

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"testing"
	"time"
)

// serveOnce answers every connection on l with "<tag> <line>".
func serveOnce(l net.Listener, tag string) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			line, _ := bufio.NewReader(c).ReadString('\n')
			fmt.Fprintf(c, "%s %s", tag, line)
		}()
	}
}

func roundTrip(c net.Conn, msg string) (string, error) {
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := fmt.Fprintln(c, msg); err != nil {
		return "", err
	}
	return bufio.NewReader(c).ReadString('\n')
}

// Forward carries the test's connections to a server inside a namespace;
// Relay carries connections made inside a namespace to a server of the
// test. Neither server is reachable the other way without them.
func TestForwardAndRelay(t *testing.T) {
	RequireRoot(t)
	n := New(t, "nst")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	var inner net.Listener
	if err := n.Do(func() error {
		var err error
		inner, err = net.Listen("tcp", "127.0.0.1:0")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer inner.Close()
	go serveOnce(inner, "inner")
	c, err := (&net.Dialer{}).DialContext(ctx, "tcp", n.Forward(t, inner.Addr().String()))
	if err != nil {
		t.Fatal(err)
	}
	if got, err := roundTrip(c, "a"); err != nil || got != "inner a\n" {
		t.Fatalf("through Forward: %q, %v", got, err)
	}

	outer, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer outer.Close()
	go serveOnce(outer, "outer")
	if c, err := n.DialContext(ctx, "tcp", outer.Addr().String()); err == nil {
		c.Close()
		t.Fatalf("the test's loopback server is reachable from inside %s without a relay", n.Name)
	}
	c, err = n.DialContext(ctx, "tcp", n.Relay(t, outer.Addr().String()))
	if err != nil {
		t.Fatal(err)
	}
	if got, err := roundTrip(c, "b"); err != nil || got != "outer b\n" {
		t.Fatalf("through Relay: %q, %v", got, err)
	}
}
