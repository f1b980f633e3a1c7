package etcdjson

import (
	"context"
	"net"
	"sync"
	"time"
)

// pooled is a connection that connPool keeps.
type pooled interface {
	Close() error
	setIdle(time.Time)
	idle() time.Time
}

// connPool keeps idle connections per endpoint (host:port) for reuse, at
// most maxIdlePerEndpoint of them, each for at most maxIdleAge.
type connPool[C pooled] struct {
	mu   sync.Mutex
	idle map[string][]C
}

// maxIdleAge is how long a kept connection may wait for reuse. Plugin
// processes reuse theirs within milliseconds; a long-running user opens a
// new one after a pause rather than find out that the server closed it.
const maxIdleAge = 5 * time.Second

// maxIdlePerEndpoint bounds the connections kept for reuse.
const maxIdlePerEndpoint = 16

// take returns a kept connection to hostport that is young enough.
func (p *connPool[C]) take(hostport string) (C, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for l := p.idle[hostport]; len(l) > 0; l = p.idle[hostport] {
		c := l[len(l)-1]
		p.idle[hostport] = l[:len(l)-1]
		if time.Since(c.idle()) < maxIdleAge {
			return c, true
		}
		c.Close()
	}
	var none C
	return none, false
}

// use runs send on a kept connection to hostport, or on a fresh one from
// dial when none is kept or when the kept one failed with an error that
// retry allows to be sent again (the server may have closed it while it
// was idle). send reports whether its connection may be kept; one it does
// not keep is closed.
func (p *connPool[C]) use(hostport string, dial func() (C, error), send func(C) (keep bool, err error), retry func(error) bool) error {
	run := func(c C) error {
		keep, err := send(c)
		p.release(hostport, c, keep)
		return err
	}
	if c, ok := p.take(hostport); ok {
		err := run(c)
		if err == nil || !retry(err) {
			return err
		}
	}
	c, err := dial()
	if err != nil {
		return err
	}
	return run(c)
}

// dialTCP connects to hostport within timeout (and ctx).
func dialTCP(ctx context.Context, timeout time.Duration, hostport string) (net.Conn, error) {
	d := net.Dialer{Timeout: timeout, KeepAlive: 30 * time.Second}
	return d.DialContext(ctx, "tcp", hostport)
}

// release keeps c for reuse when reusable and there is room, else closes it.
func (p *connPool[C]) release(hostport string, c C, reusable bool) {
	if reusable {
		p.mu.Lock()
		if p.idle == nil {
			p.idle = map[string][]C{}
		}
		if len(p.idle[hostport]) < maxIdlePerEndpoint {
			c.setIdle(time.Now())
			p.idle[hostport] = append(p.idle[hostport], c)
			p.mu.Unlock()
			return
		}
		p.mu.Unlock()
	}
	c.Close()
}

// closeIdle closes every kept connection.
func (p *connPool[C]) closeIdle() {
	p.mu.Lock()
	idle := p.idle
	p.idle = nil
	p.mu.Unlock()
	for _, l := range idle {
		for _, c := range l {
			c.Close()
		}
	}
}
