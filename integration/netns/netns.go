// Package netns gives integration tests real, named Linux network
// namespaces that are always removed again.
//
// Every namespace New creates is deleted by t.Cleanup, also when the test
// fails; every command runs under a deadline (CommandTimeout) so a stuck
// tool fails the test instead of hanging it. Names carry a random suffix so
// parallel and repeated runs never collide. The package needs root and the
// iproute2 "ip" command; RequireRoot skips a test that lacks them.
//
// DialContext connects from inside a namespace, and Forward relays a
// loopback port of the test process to a server that lives only inside
// one (both end with the test).
//
// Safe for concurrent use: each NS is immutable after New.
package netns

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
)

// CommandTimeout bounds every command this package runs.
const CommandTimeout = 30 * time.Second

// RequireRoot skips t unless it runs as root with the ip command available.
// Under CI (the CI variable set, as .ci/run does) it fails instead: a
// missing privilege or dependency must never turn into a green run.
func RequireRoot(t testing.TB) {
	t.Helper()
	missing := func(what string) {
		t.Helper()
		if os.Getenv("CI") != "" {
			t.Fatalf("%s; CI is set, so this fails instead of skipping", what)
		}
		t.Skip(what)
	}
	if os.Geteuid() != 0 {
		missing("needs root (network namespaces)")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		missing("needs iproute2's ip command")
	}
}

// Unique returns prefix followed by 8 random hex digits. Keep prefix at 7
// characters or less when the result names a network interface (15 max).
func Unique(prefix string) string {
	var b [4]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(err)
	}
	return prefix + hex.EncodeToString(b[:])
}

// NS is one named network namespace (ip netns).
type NS struct {
	Name string // as in `ip netns list`
	Path string // /var/run/netns/Name, the CNI_NETNS of a container
}

// New creates a namespace named Unique(prefix), brings its loopback up and
// deletes it when the test ends.
func New(t testing.TB, prefix string) *NS {
	t.Helper()
	name := Unique(prefix)
	if out, err := Command("ip", "netns", "add", name); err != nil {
		t.Fatalf("ip netns add %s: %v: %s", name, err, out)
	}
	n := &NS{Name: name, Path: "/var/run/netns/" + name}
	t.Cleanup(func() {
		if out, err := Command("ip", "netns", "delete", name); err != nil {
			t.Errorf("ip netns delete %s: %v: %s", name, err, out)
		}
	})
	n.MustRun(t, "ip", "link", "set", "lo", "up")
	return n
}

// Command runs argv in the caller's namespace under CommandTimeout and
// returns its combined output.
func Command(argv ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), CommandTimeout)
	defer cancel()
	out, err := exec.CommandContext(ctx, argv[0], argv[1:]...).CombinedOutput()
	if ctx.Err() != nil {
		err = fmt.Errorf("%s timed out after %v: %w", strings.Join(argv, " "), CommandTimeout, ctx.Err())
	}
	return string(out), err
}

// Run runs argv inside the namespace (ip netns exec) and returns its
// combined output.
func (n *NS) Run(argv ...string) (string, error) {
	return Command(append([]string{"ip", "netns", "exec", n.Name}, argv...)...)
}

// MustRun is Run that fails the test on error.
func (n *NS) MustRun(t testing.TB, argv ...string) string {
	t.Helper()
	out, err := n.Run(argv...)
	if err != nil {
		t.Fatalf("in netns %s: %s: %v: %s", n.Name, strings.Join(argv, " "), err, out)
	}
	return out
}

// RoutingState is what `ip route show table all` and `ip rule` print in
// the namespace, both families, each under a "# <command>" line: its whole
// routing state, to compare before and after a test.
func (n *NS) RoutingState(t testing.TB) string {
	t.Helper()
	var b strings.Builder
	for _, argv := range [][]string{
		{"ip", "-4", "route", "show", "table", "all"},
		{"ip", "-6", "route", "show", "table", "all"},
		{"ip", "-4", "rule"},
		{"ip", "-6", "rule"},
	} {
		b.WriteString("# " + strings.Join(argv, " ") + "\n")
		b.WriteString(n.MustRun(t, argv...))
	}
	return b.String()
}

// Do runs fn on an OS thread switched into the namespace (processes fn
// starts inherit it).
func (n *NS) Do(fn func() error) error {
	h, err := ns.GetNS(n.Path)
	if err != nil {
		return fmt.Errorf("opening netns %s: %w", n.Name, err)
	}
	defer h.Close()
	return h.Do(func(ns.NetNS) error { return fn() })
}

// Addrs returns the global addresses of link dev inside the namespace, in
// CIDR form, as `ip -o addr show` lists them.
func (n *NS) Addrs(t testing.TB, dev string) []string {
	t.Helper()
	out := n.MustRun(t, "ip", "-o", "addr", "show", "dev", dev, "scope", "global")
	var addrs []string
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		for i := 0; i+1 < len(f); i++ {
			if f[i] == "inet" || f[i] == "inet6" {
				addrs = append(addrs, f[i+1])
			}
		}
	}
	return addrs
}

// DialContext connects to addr from inside the namespace. The socket
// belongs to the namespace for its whole life, whichever goroutine uses it
// afterwards, so the test process can talk to servers that live only in
// namespaces it made (an etcd cluster on a namespace LAN, say).
func (n *NS) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	var c net.Conn
	err := n.Do(func() error {
		var err error
		c, err = (&net.Dialer{}).DialContext(ctx, network, addr)
		return err
	})
	return c, err
}

// forwardDialTimeout bounds each connection Forward makes into the namespace.
const forwardDialTimeout = 5 * time.Second

// Forward listens on a free loopback port of the test's own namespace and
// relays every connection to target ("ip:port") inside n, for clients that
// take only an address (the etcd store of pkg/store/etcd, say). A target
// that does not answer closes the accepted connection. The listener and
// every relayed connection are closed when the test ends. It returns the
// loopback address ("127.0.0.1:port").
func (n *NS) Forward(t testing.TB, target string) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("forward to %s in %s: %v", target, n.Name, err)
	}
	return relay(t, l, func(ctx context.Context) (net.Conn, error) { return n.DialContext(ctx, "tcp", target) })
}

// Relay is Forward the other way round: it listens on a free loopback port
// inside n and relays every connection to target ("ip:port") dialled from
// the test's own namespace, so processes in n reach servers on the test's
// loopback (an etcd started by the test, say). It returns the address
// inside n ("127.0.0.1:port"); everything is closed when the test ends.
func (n *NS) Relay(t testing.TB, target string) string {
	t.Helper()
	return n.RelayOn(t, "127.0.0.1:0", target)
}

// RelayOn is Relay listening on listen ("127.0.0.1:port") inside n: the
// same loopback address in several namespaces (hosts that share one
// configuration naming it).
func (n *NS) RelayOn(t testing.TB, listen, target string) string {
	t.Helper()
	var l net.Listener
	if err := n.Do(func() error {
		var err error
		l, err = net.Listen("tcp", listen)
		return err
	}); err != nil {
		t.Fatalf("relay in %s to %s: %v", n.Name, target, err)
	}
	return relay(t, l, func(ctx context.Context) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "tcp", target)
	})
}

// relay accepts on l and carries each connection to what dial returns.
func relay(t testing.TB, l net.Listener, dial func(ctx context.Context) (net.Conn, error)) string {
	var mu sync.Mutex
	conns := map[net.Conn]bool{}
	track := func(c net.Conn, on bool) bool {
		mu.Lock()
		defer mu.Unlock()
		if on && conns == nil {
			return false // closing
		}
		if on {
			conns[c] = true
		} else {
			delete(conns, c)
		}
		return true
	}
	var wg sync.WaitGroup
	t.Cleanup(func() {
		l.Close()
		mu.Lock()
		for c := range conns {
			c.Close()
		}
		conns = nil
		mu.Unlock()
		wg.Wait()
	})
	relay := func(in net.Conn) {
		defer wg.Done()
		ctx, cancel := context.WithTimeout(context.Background(), forwardDialTimeout)
		out, err := dial(ctx)
		cancel()
		if err != nil || !track(in, true) {
			in.Close()
			if out != nil {
				out.Close()
			}
			return
		}
		if !track(out, true) {
			track(in, false)
			in.Close()
			out.Close()
			return
		}
		done := make(chan struct{}, 2)
		pipe := func(dst, src net.Conn) {
			_, _ = io.Copy(dst, src)
			done <- struct{}{}
		}
		go pipe(out, in)
		go pipe(in, out)
		<-done // one side ended: end both
		in.Close()
		out.Close()
		<-done
		track(in, false)
		track(out, false)
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go relay(c)
		}
	}()
	return l.Addr().String()
}
