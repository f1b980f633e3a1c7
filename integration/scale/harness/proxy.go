package harness

import (
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
)

// Proxy is a TCP relay on loopback to one etcd member that counts the
// bytes each way (one host's whole etcd traffic, framing included) and
// can be cut (every connection closed, new ones refused) and healed.
type Proxy struct {
	l        net.Listener
	target   string
	Up, Down atomic.Int64 // bytes to etcd, bytes from etcd
	cut      atomic.Bool
	mu       sync.Mutex
	conns    map[net.Conn]bool
	wg       sync.WaitGroup
}

// NewProxy relays a new loopback port to endpoint (http://host:port).
func NewProxy(endpoint string) (*Proxy, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &Proxy{l: l, target: strings.TrimPrefix(endpoint, "http://"), conns: map[net.Conn]bool{}}
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// Endpoint is the proxy's client URL.
func (p *Proxy) Endpoint() string { return "http://" + p.l.Addr().String() }

// Bytes is the traffic so far, both ways.
func (p *Proxy) Bytes() int64 { return p.Up.Load() + p.Down.Load() }

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.l.Accept()
		if err != nil {
			return
		}
		if p.cut.Load() {
			c.Close()
			continue
		}
		p.wg.Add(1)
		go p.relay(c)
	}
}

func (p *Proxy) track(c net.Conn, on bool) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if on && p.cut.Load() {
		return false
	}
	if on {
		p.conns[c] = true
	} else {
		delete(p.conns, c)
	}
	return true
}

func (p *Proxy) relay(c net.Conn) {
	defer p.wg.Done()
	u, err := net.Dial("tcp", p.target)
	if err != nil {
		c.Close()
		return
	}
	if !p.track(c, true) || !p.track(u, true) {
		c.Close()
		u.Close()
		return
	}
	var wg sync.WaitGroup
	cp := func(dst, src net.Conn, n *atomic.Int64) {
		defer wg.Done()
		buf := make([]byte, 32<<10)
		for {
			k, err := src.Read(buf)
			if k > 0 {
				n.Add(int64(k))
				if _, werr := dst.Write(buf[:k]); werr != nil {
					break
				}
			}
			if err != nil {
				if err != io.EOF {
					break
				}
				break
			}
		}
		dst.Close()
		src.Close()
	}
	wg.Add(2)
	go cp(u, c, &p.Up)
	go cp(c, u, &p.Down)
	wg.Wait()
	p.track(c, false)
	p.track(u, false)
}

// Cut closes every connection and refuses new ones until Heal.
func (p *Proxy) Cut() {
	p.mu.Lock()
	p.cut.Store(true)
	for c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
}

// Heal lets connections through again.
func (p *Proxy) Heal() { p.cut.Store(false) }

// Close stops the proxy and closes every connection.
func (p *Proxy) Close() {
	p.l.Close()
	p.Cut()
	p.wg.Wait()
}
