//go:build integration

package watchcache_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ringipam/ringipam/internal/testenv"
	"github.com/ringipam/ringipam/pkg/watchcache"
)

const trim = "/wc/"

func client(t *testing.T, endpoint string) *clientv3.Client {
	t.Helper()
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{endpoint}, DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}

func newCache(cli *clientv3.Client, t *testing.T) *watchcache.Cache[string] {
	return watchcache.New(watchcache.Config[string]{Client: cli, Trim: trim, Prefix: "n/",
		Decode:     func(_ string, v []byte) (string, error) { return string(v), nil },
		MinBackoff: 50 * time.Millisecond, MaxBackoff: time.Second,
		Log: func(msg string, args ...any) { t.Logf(msg+" %v", args) }})
}

func run(t *testing.T, c *watchcache.Cache[string]) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = c.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	select {
	case <-c.Synced():
	case <-time.After(30 * time.Second):
		t.Fatal("the cache never listed")
	}
}

// want waits (30s at most) until the cache holds exactly kv.
func want(t *testing.T, c *watchcache.Cache[string], kv map[string]string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		s := c.Snapshot()
		ok := len(s.Entries) == len(kv)
		for k, v := range kv {
			ok = ok && s.Entries[k].Value == v
		}
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("cache %v, want %v", s.Entries, kv)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func put(t *testing.T, cli *clientv3.Client, k, v string) int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	r, err := cli.Put(ctx, trim+k, v)
	if err != nil {
		t.Fatal(err)
	}
	return r.Header.Revision
}

func del(t *testing.T, cli *clientv3.Client, k string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := cli.Delete(ctx, trim+k); err != nil {
		t.Fatal(err)
	}
}

// The cache lists once, then follows PUTs and DELETEs through its watch
// alone (one List in all), signals its subscriber, ignores keys outside
// its prefix, and resumes its watch after the server restarted without
// listing again.
func TestFollowsTheStore(t *testing.T) {
	srv := testenv.StartEtcd(t)
	w := client(t, srv.Endpoints()[0])
	put(t, w, "n/a", "1")
	put(t, w, "g/ring", "x")
	c := newCache(client(t, srv.Endpoints()[0]), t)
	sub := c.Subscribe()
	run(t, c)
	want(t, c, map[string]string{"n/a": "1"})
	<-sub
	put(t, w, "n/b", "2")
	put(t, w, "n/a", "3")
	del(t, w, "n/b")
	rev := put(t, w, "n/c", "4")
	put(t, w, "g/ring", "y")
	want(t, c, map[string]string{"n/a": "3", "n/c": "4"})
	select {
	case <-sub:
	case <-time.After(30 * time.Second):
		t.Fatal("no signal")
	}
	if c.Revision() < rev {
		t.Fatalf("revision %d, want >= %d", c.Revision(), rev)
	}
	srv.Stop()
	srv.Start()
	put(t, w, "n/d", "5")
	want(t, c, map[string]string{"n/a": "3", "n/c": "4", "n/d": "5"})
	if s := c.Stats(); s.Lists != 1 || s.Compacts != 0 {
		t.Fatalf("stats %+v: want one List, no compaction", s)
	}
}

// A watch cut off while the store changed and was compacted past the
// cache's revision lists again (ErrCompacted) and ends up equal to the
// store; cut off without compaction, it resumes with no new List.
func TestRelistsWhenCompacted(t *testing.T) {
	srv := testenv.StartEtcd(t)
	w := client(t, srv.Endpoints()[0])
	p := newProxy(t, srv.Endpoints()[0])
	put(t, w, "n/a", "1")
	put(t, w, "n/b", "2")
	c := newCache(client(t, "http://"+p.addr()), t)
	run(t, c)
	want(t, c, map[string]string{"n/a": "1", "n/b": "2"})

	// Cut off, no compaction: resumed from the cached revision.
	p.cut(true)
	put(t, w, "n/c", "3")
	p.cut(false)
	want(t, c, map[string]string{"n/a": "1", "n/b": "2", "n/c": "3"})
	if s := c.Stats(); s.Lists != 1 {
		t.Fatalf("stats %+v: a watch resumed without compaction listed again", s)
	}

	// Cut off, changes, compaction: listed again.
	p.cut(true)
	del(t, w, "n/a")
	put(t, w, "n/b", "22")
	rev := put(t, w, "n/d", "4")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := w.Compact(ctx, rev, clientv3.WithCompactPhysical()); err != nil {
		t.Fatal(err)
	}
	p.cut(false)
	want(t, c, map[string]string{"n/b": "22", "n/c": "3", "n/d": "4"})
	if s := c.Stats(); s.Lists != 2 || s.Compacts != 1 {
		t.Fatalf("stats %+v: want a second List after one compaction", s)
	}
	// And it follows the store again.
	put(t, w, "n/e", "5")
	want(t, c, map[string]string{"n/b": "22", "n/c": "3", "n/d": "4", "n/e": "5"})
}

// proxy is a TCP relay to etcd that the test can cut: while cut, every
// connection is closed and new ones are refused, so the cache's client
// loses its watch.
type proxy struct {
	l      net.Listener
	target string
	mu     sync.Mutex
	off    bool
	conns  []net.Conn
}

func newProxy(t *testing.T, endpoint string) *proxy {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var host string
	if _, err := fmt.Sscanf(endpoint, "http://%s", &host); err != nil {
		t.Fatal(err)
	}
	p := &proxy{l: l, target: host}
	t.Cleanup(func() { l.Close(); p.cut(true) })
	go p.serve()
	return p
}

func (p *proxy) addr() string { return p.l.Addr().String() }

func (p *proxy) serve() {
	for {
		in, err := p.l.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		off := p.off
		p.mu.Unlock()
		if off {
			in.Close()
			continue
		}
		out, err := net.DialTimeout("tcp", p.target, 5*time.Second)
		if err != nil {
			in.Close()
			continue
		}
		p.mu.Lock()
		p.conns = append(p.conns, in, out)
		p.mu.Unlock()
		go func() { _, _ = io.Copy(out, in); out.Close() }()
		go func() { _, _ = io.Copy(in, out); in.Close() }()
	}
}

func (p *proxy) cut(off bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.off = off
	if off {
		for _, c := range p.conns {
			c.Close()
		}
		p.conns = nil
	}
}
