package etcdjson

// A small HTTP/1.1 client for the one thing this package sends: a POST of
// a JSON body to etcd's gateway, and the answer read whole. It replaces
// net/http, whose initialisation and size cost every plugin process about
// half a millisecond of start-up (docs/benchmarks.md) for features the
// gateway does not need (proxies, redirects, HTTP/2, compression, cookies).
//
// What it does: keep-alive connections kept per endpoint for reuse; TLS
// through the TLSDialer (package etcdtls: crypto/tls, the server name
// checked); answers framed by
// Content-Length, chunked transfer coding or the connection's end; the
// caller's context bounding dial, handshake, write and read. A reused
// connection that turns out dead is retried once on a fresh one, but only
// if the request is safe to send twice or nothing of it reached the wire.

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/ringipam/ringipam/pkg/store/internal/connctx"
)

// maxAnswer bounds one answer's body.
const maxAnswer = 64 << 20

// endpoint is one parsed client URL.
type endpoint struct {
	url      string // as configured, for messages: http://host:port
	hostport string // host:port to dial
	host     string // host without port: the TLS server name
	tls      bool
}

func parseEndpoint(raw string) (endpoint, error) {
	scheme, rest, ok := strings.Cut(raw, "://")
	if !ok {
		return endpoint{}, fmt.Errorf("etcd endpoint %q: no scheme", raw)
	}
	if i := strings.IndexByte(rest, '/'); i >= 0 {
		rest = rest[:i]
	}
	ep := endpoint{url: scheme + "://" + rest, hostport: rest}
	switch scheme {
	case "http":
	case "https":
		ep.tls = true
	default:
		return endpoint{}, fmt.Errorf("etcd endpoint %q: scheme must be http or https", raw)
	}
	host, port, err := net.SplitHostPort(rest)
	if err != nil {
		// No port: etcd's client port.
		host, port = strings.Trim(rest, "[]"), "2379"
		ep.hostport = net.JoinHostPort(host, port)
	}
	if host == "" {
		return endpoint{}, fmt.Errorf("etcd endpoint %q: no host", raw)
	}
	ep.host = host
	return ep, nil
}

// httpClient sends requests and keeps idle connections per endpoint.
type httpClient struct {
	dialTimeout time.Duration
	tls         TLSDialer // for https endpoints
	pool        connPool[*wireConn]
}

type wireConn struct {
	net.Conn
	r         *bufio.Reader
	idleSince time.Time
}

func (c *wireConn) setIdle(t time.Time) { c.idleSince = t }
func (c *wireConn) idle() time.Time     { return c.idleSince }

// errNotSent marks a failure before any byte of the request was written.
var errNotSent = errors.New("request not sent")

// post sends body to path on ep with the given extra header lines
// ("Name: value") and returns the answer's status and body.
// idempotent says the request may be sent twice.
func (h *httpClient) post(ctx context.Context, ep endpoint, path string, header []string, body []byte, idempotent bool) (int, []byte, error) {
	req := buildRequest(ep, path, header, body)
	var status int
	var data []byte
	err := h.pool.use(ep.hostport,
		func() (*wireConn, error) { return h.dial(ctx, ep) },
		func(c *wireConn) (bool, error) {
			var reusable bool
			var err error
			status, data, reusable, err = h.exchange(ctx, c, req)
			return err == nil && reusable, err
		},
		func(err error) bool { return ctx.Err() == nil && (idempotent || errors.Is(err, errNotSent)) })
	if err != nil {
		return 0, nil, err
	}
	return status, data, nil
}

func buildRequest(ep endpoint, path string, header []string, body []byte) []byte {
	var b bytes.Buffer
	b.Grow(160 + len(body))
	b.WriteString("POST ")
	b.WriteString(path)
	b.WriteString(" HTTP/1.1\r\nHost: ")
	b.WriteString(ep.hostport)
	b.WriteString("\r\nUser-Agent: ringipam\r\nContent-Type: application/json\r\nContent-Length: ")
	b.WriteString(strconv.Itoa(len(body)))
	b.WriteString("\r\n")
	for _, l := range header {
		b.WriteString(l)
		b.WriteString("\r\n")
	}
	b.WriteString("\r\n")
	b.Write(body)
	return b.Bytes()
}

func (h *httpClient) dial(ctx context.Context, ep endpoint) (*wireConn, error) {
	c, err := dialTCP(ctx, h.dialTimeout, ep.hostport)
	if err != nil {
		return nil, err
	}
	if ep.tls {
		if h.tls == nil {
			c.Close()
			return nil, ErrNoTLS
		}
		hctx, cancel := context.WithTimeout(ctx, h.dialTimeout)
		tc, err := h.tls(hctx, c, ep.host)
		cancel()
		if err != nil {
			c.Close()
			return nil, fmt.Errorf("tls handshake with %s: %w", ep.hostport, err)
		}
		c = tc
	}
	return &wireConn{Conn: c, r: bufio.NewReaderSize(c, 16<<10)}, nil
}

// closeIdle closes every kept connection.
func (h *httpClient) closeIdle() { h.pool.closeIdle() }

// exchange writes req on c and reads one answer. reusable reports that the
// connection may carry another request.
func (h *httpClient) exchange(ctx context.Context, c *wireConn, req []byte) (status int, body []byte, reusable bool, err error) {
	stop, err := connctx.Bind(ctx, c)
	if err != nil {
		return 0, nil, false, fmt.Errorf("%w: %w", errNotSent, err)
	}
	defer stop()
	n, err := c.Write(req)
	if err != nil {
		if n == 0 {
			err = fmt.Errorf("%w: %w", errNotSent, err)
		}
		return 0, nil, false, ctxErr(ctx, err)
	}
	status, body, reusable, err = readAnswer(c.r)
	return status, body, reusable, ctxErr(ctx, err)
}

// ctxErr prefers the context's own error to the deadline it caused (the
// connection's deadline may fire a moment before the context records it).
func ctxErr(ctx context.Context, err error) error {
	if err == nil {
		return nil
	}
	if ctx.Err() != nil {
		return fmt.Errorf("%w (%w)", ctx.Err(), err)
	}
	var ne net.Error
	if d, ok := ctx.Deadline(); ok && !time.Now().Before(d) && errors.As(err, &ne) && ne.Timeout() {
		return fmt.Errorf("%w (%w)", context.DeadlineExceeded, err)
	}
	return err
}

// readAnswer reads one HTTP/1.1 response.
func readAnswer(r *bufio.Reader) (status int, body []byte, reusable bool, err error) {
	line, err := readLine(r)
	if err != nil {
		return 0, nil, false, fmt.Errorf("reading the answer: %w", err)
	}
	proto, rest, _ := strings.Cut(line, " ")
	code, _, _ := strings.Cut(rest, " ")
	status, err = strconv.Atoi(code)
	if !strings.HasPrefix(proto, "HTTP/1.") || err != nil || status < 100 || status > 999 {
		return 0, nil, false, fmt.Errorf("not an HTTP/1.x answer: %q", line)
	}
	length, chunked, closing := int64(-1), false, proto == "HTTP/1.0"
	for {
		l, err := readLine(r)
		if err != nil {
			return 0, nil, false, fmt.Errorf("reading the answer's header: %w", err)
		}
		if l == "" {
			break
		}
		name, value, ok := strings.Cut(l, ":")
		if !ok {
			return 0, nil, false, fmt.Errorf("malformed header line %q", l)
		}
		value = strings.TrimSpace(value)
		switch strings.ToLower(strings.TrimSpace(name)) {
		case "content-length":
			length, err = strconv.ParseInt(value, 10, 64)
			if err != nil || length < 0 {
				return 0, nil, false, fmt.Errorf("bad Content-Length %q", value)
			}
		case "transfer-encoding":
			chunked = strings.EqualFold(value, "chunked")
			if !chunked {
				return 0, nil, false, fmt.Errorf("unsupported Transfer-Encoding %q", value)
			}
		case "connection":
			closing = closing || strings.EqualFold(value, "close")
		}
	}
	if status < 200 {
		// 1xx answers are not sent for these requests; refuse rather than
		// misread the stream.
		return 0, nil, false, fmt.Errorf("unexpected interim answer %d", status)
	}
	switch {
	case chunked:
		body, err = readChunked(r)
	case length >= 0:
		if length > maxAnswer {
			return 0, nil, false, fmt.Errorf("answer of %d bytes exceeds %d", length, maxAnswer)
		}
		body = make([]byte, length)
		_, err = io.ReadFull(r, body)
	default:
		body, err = io.ReadAll(io.LimitReader(r, maxAnswer+1))
		if err == nil && len(body) > maxAnswer {
			err = fmt.Errorf("answer exceeds %d bytes", maxAnswer)
		}
		closing = true
	}
	if err != nil {
		return 0, nil, false, fmt.Errorf("reading the answer's body: %w", err)
	}
	return status, body, !closing, nil
}

// readLine reads one CRLF- (or LF-) terminated line without its ending.
func readLine(r *bufio.Reader) (string, error) {
	l, err := r.ReadSlice('\n')
	if err == bufio.ErrBufferFull {
		return "", errors.New("header line too long")
	}
	if err != nil {
		if err == io.EOF && len(l) == 0 {
			return "", io.EOF
		}
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return "", err
	}
	return strings.TrimRight(string(l), "\r\n"), nil
}

func readChunked(r *bufio.Reader) ([]byte, error) {
	var body []byte
	for {
		l, err := readLine(r)
		if err != nil {
			return nil, unexpected(err)
		}
		sz, _, _ := strings.Cut(l, ";") // chunk extensions are ignored
		n, err := strconv.ParseInt(strings.TrimSpace(sz), 16, 64)
		if err != nil || n < 0 {
			return nil, fmt.Errorf("bad chunk size %q", l)
		}
		if n == 0 {
			// Trailer lines up to the empty one.
			for {
				t, err := readLine(r)
				if err != nil {
					return nil, unexpected(err)
				}
				if t == "" {
					return body, nil
				}
			}
		}
		if int64(len(body))+n > maxAnswer {
			return nil, fmt.Errorf("answer exceeds %d bytes", maxAnswer)
		}
		start := len(body)
		body = append(body, make([]byte, n)...)
		if _, err := io.ReadFull(r, body[start:]); err != nil {
			return nil, unexpected(err)
		}
		if l, err := readLine(r); err != nil || l != "" {
			if err == nil {
				err = fmt.Errorf("chunk of %d bytes not followed by CRLF", n)
			}
			return nil, unexpected(err)
		}
	}
}

func unexpected(err error) error {
	if err == io.EOF {
		return io.ErrUnexpectedEOF
	}
	return err
}
