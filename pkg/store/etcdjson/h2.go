package etcdjson

// A small client of gRPC's unary calls over plaintext HTTP/2 ("h2c with
// prior knowledge", RFC 9113 section 3.3), for the three calls this
// package makes of etcd: KV.Txn, KV.Range and Auth.Authenticate. It exists
// because the gateway's JSON costs etcd a second, internal gRPC call and a
// JSON translation per request (docs/benchmarks.md: about 0.2-0.4 ms of an
// ADD), and because grpc-go and net/http cost every plugin process more at
// start-up than the whole request (the plugins link neither).
//
// What it does: one connection per exchange at a time, kept for reuse like
// the gateway's (wire.go); the preface, the client's SETTINGS, the
// request's HEADERS and its DATA written in one write; flow control both
// ways (a request larger than the peer's windows waits for its
// WINDOW_UPDATEs; the answer's DATA is acknowledged as it is read); the
// peer's SETTINGS acknowledged and applied, its PINGs answered, GOAWAY and
// RST_STREAM mapped to errors (REFUSED_STREAM and streams above a GOAWAY's
// last one are errNotSent: etcd did not act on them); header blocks through
// golang.org/x/net/http2/hpack. Not done, because these calls do not need
// it: TLS (https endpoints use the gateway), server push (disabled in the
// SETTINGS), compression, streams in parallel on one connection.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"strconv"
	"time"

	"golang.org/x/net/http2/hpack"

	"github.com/ringipam/ringipam/pkg/store/internal/connctx"
)

// HTTP/2 frame types and flags (RFC 9113 section 6).
const (
	frameData         = 0x0
	frameHeaders      = 0x1
	frameRSTStream    = 0x3
	frameSettings     = 0x4
	framePushPromise  = 0x5
	framePing         = 0x6
	frameGoAway       = 0x7
	frameWindowUpdate = 0x8
	frameContinuation = 0x9

	flagEndStream  = 0x1
	flagAck        = 0x1
	flagEndHeaders = 0x4
	flagPadded     = 0x8
	flagPriority   = 0x20

	settingHeaderTableSize   = 0x1
	settingEnablePush        = 0x2
	settingInitialWindowSize = 0x4

	errCodeRefusedStream = 0x7

	clientPreface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

	defaultWindow = 65535 // every window's size until SETTINGS or WINDOW_UPDATE say otherwise
	maxFrame      = 16384 // the frame size both ends accept without SETTINGS
	recvWindow    = 4 << 20
	maxStreamID   = 1<<31 - 1
)

// errNotH2 says the server answered the preface with something other than
// HTTP/2 (a proxy or server without gRPC): the request was not acted on.
var errNotH2 = errors.New("the server does not speak HTTP/2 (gRPC) on this port")

// h2Client makes unary gRPC calls and keeps idle connections per endpoint.
type h2Client struct {
	dialTimeout time.Duration
	pool        connPool[*h2Conn]
}

// h2Conn is one HTTP/2 connection, used by one exchange at a time.
type h2Conn struct {
	c   net.Conn
	r   *bufio.Reader
	out []byte // frames written by the next flush

	enc    *hpack.Encoder
	encBuf bytes.Buffer
	dec    *hpack.Decoder

	next        uint32 // the next stream's identifier
	sendWindow  int64  // the connection's, for DATA we send
	peerInitial int64  // the peer's SETTINGS_INITIAL_WINDOW_SIZE
	unacked     int64  // DATA received on the connection and not yet given back
	greeted     bool   // the server's SETTINGS came
	goAway      bool   // the peer sent GOAWAY: no new streams
	lastStream  uint32 // the GOAWAY's last stream acted upon
	broken      bool
	idleSince   time.Time
}

func (c *h2Conn) Close() error        { return c.c.Close() }
func (c *h2Conn) setIdle(t time.Time) { c.idleSince = t }
func (c *h2Conn) idle() time.Time     { return c.idleSince }

// stream is the state of one exchange.
type stream struct {
	id         uint32
	sendWindow int64
	unacked    int64
	status     string // :status
	grpcStatus string
	grpcMsg    string
	data       []byte
	ended      bool
}

// unary calls path with msg (a serialised protobuf message) on ep and
// returns the answer's message. idempotent says the call may be made twice.
func (h *h2Client) unary(ctx context.Context, ep endpoint, path, token string, msg []byte, idempotent bool) ([]byte, error) {
	var answer []byte
	err := h.pool.use(ep.hostport,
		func() (*h2Conn, error) {
			nc, err := dialTCP(ctx, h.dialTimeout, ep.hostport)
			if err != nil {
				return nil, err
			}
			return newH2Conn(nc), nil
		},
		func(c *h2Conn) (bool, error) {
			var err error
			answer, err = c.roundTrip(ctx, ep.hostport, path, token, msg)
			// A gRPC status other than OK leaves the connection usable.
			return !c.broken && !c.goAway && c.next < maxStreamID-2, err
		},
		func(err error) bool {
			var ee *etcdError
			return !errors.As(err, &ee) && ctx.Err() == nil && (idempotent || errors.Is(err, errNotSent))
		})
	return answer, err
}

func newH2Conn(nc net.Conn) *h2Conn {
	c := &h2Conn{c: nc, r: bufio.NewReaderSize(nc, 32<<10), next: 1, sendWindow: defaultWindow, peerInitial: defaultWindow}
	c.enc = hpack.NewEncoder(&c.encBuf)
	c.dec = hpack.NewDecoder(4096, nil)
	c.dec.SetMaxStringLength(1 << 20)
	// Written with the first request: nothing needs the server's SETTINGS
	// before a client's first stream.
	c.out = append(c.out, clientPreface...)
	c.out = appendFrame(c.out, frameSettings, 0, 0,
		binary.BigEndian.AppendUint32(binary.BigEndian.AppendUint16(
			binary.BigEndian.AppendUint32(binary.BigEndian.AppendUint16(nil, settingEnablePush), 0),
			settingInitialWindowSize), recvWindow))
	c.out = appendFrame(c.out, frameWindowUpdate, 0, 0, binary.BigEndian.AppendUint32(nil, recvWindow-defaultWindow))
	return c
}

func appendFrame(b []byte, typ, flags byte, streamID uint32, payload []byte) []byte {
	n := len(payload)
	b = append(b, byte(n>>16), byte(n>>8), byte(n), typ, flags)
	b = binary.BigEndian.AppendUint32(b, streamID)
	return append(b, payload...)
}

// grpcTimeout is a gRPC timeout header value for d (at most 8 digits).
func grpcTimeout(d time.Duration) string {
	if ms := d.Milliseconds(); ms < 1e8 {
		return strconv.FormatInt(max(ms, 1), 10) + "m"
	}
	return strconv.FormatInt(min(int64(d/time.Second), 1e8-1), 10) + "S"
}

// roundTrip makes one call on c. An error with c.broken false leaves the
// connection usable (a gRPC status other than OK).
func (c *h2Conn) roundTrip(ctx context.Context, authority, path, token string, msg []byte) ([]byte, error) {
	stop, err := connctx.Bind(ctx, c.c)
	if err != nil {
		c.broken = true
		return nil, fmt.Errorf("%w: %w", errNotSent, err)
	}
	defer stop()
	st := &stream{id: c.next, sendWindow: c.peerInitial}
	c.next += 2

	// The request's header block.
	c.encBuf.Reset()
	fields := []hpack.HeaderField{
		{Name: ":method", Value: "POST"},
		{Name: ":scheme", Value: "http"},
		{Name: ":path", Value: path},
		{Name: ":authority", Value: authority},
		{Name: "content-type", Value: "application/grpc"},
		{Name: "te", Value: "trailers"},
		{Name: "user-agent", Value: "ringipam"},
	}
	if d, ok := ctx.Deadline(); ok {
		fields = append(fields, hpack.HeaderField{Name: "grpc-timeout", Value: grpcTimeout(time.Until(d))})
	}
	if token != "" {
		fields = append(fields, hpack.HeaderField{Name: "token", Value: token, Sensitive: true})
	}
	for _, f := range fields {
		if err := c.enc.WriteField(f); err != nil {
			c.broken = true
			return nil, fmt.Errorf("%w: %w", errNotSent, err)
		}
	}
	block := c.encBuf.Bytes()
	for first := true; first || len(block) > 0; first = false {
		n := min(len(block), maxFrame)
		typ, flags := byte(frameContinuation), byte(0)
		if first {
			typ = frameHeaders
		}
		if n == len(block) {
			flags = flagEndHeaders
		}
		c.out = appendFrame(c.out, typ, flags, st.id, block[:n])
		block = block[n:]
	}

	// The message, length-prefixed (gRPC over HTTP/2: uncompressed flag,
	// then four bytes of length), in DATA frames as the windows allow.
	payload := make([]byte, 5, 5+len(msg))
	binary.BigEndian.PutUint32(payload[1:], uint32(len(msg)))
	payload = append(payload, msg...)
	sent := false
	for len(payload) > 0 && !st.ended {
		n := int64(min(len(payload), maxFrame))
		n = min(n, c.sendWindow, st.sendWindow)
		if n <= 0 {
			// Blocked by flow control: send what there is, then read until
			// a WINDOW_UPDATE (or an early answer) comes.
			if err := c.flush(ctx, &sent); err != nil {
				return nil, err
			}
			if err := c.readFrame(st); err != nil {
				return nil, c.fail(ctx, st, sent, err)
			}
			continue
		}
		flags := byte(0)
		if int(n) == len(payload) {
			flags = flagEndStream
		}
		c.out = appendFrame(c.out, frameData, flags, st.id, payload[:n])
		payload = payload[n:]
		c.sendWindow -= n
		st.sendWindow -= n
	}
	if err := c.flush(ctx, &sent); err != nil {
		return nil, err
	}
	for !st.ended {
		if err := c.readFrame(st); err != nil {
			return nil, c.fail(ctx, st, sent, err)
		}
	}
	return st.answer()
}

// flush writes the pending frames. sent records that some reached the wire.
func (c *h2Conn) flush(ctx context.Context, sent *bool) error {
	if len(c.out) == 0 {
		return nil
	}
	n, err := c.c.Write(c.out)
	*sent = *sent || n > 0
	c.out = c.out[:0]
	if err != nil {
		c.broken = true
		if !*sent {
			err = fmt.Errorf("%w: %w", errNotSent, err)
		}
		return ctxErr(ctx, err)
	}
	return nil
}

// fail marks c broken after a failed read and says whether the stream's
// request may have been acted on.
func (c *h2Conn) fail(ctx context.Context, st *stream, sent bool, err error) error {
	c.broken = true
	if !sent || errors.Is(err, errNotH2) || (c.goAway && st.id > c.lastStream) {
		return fmt.Errorf("%w: %w", errNotSent, ctxErr(ctx, err))
	}
	return ctxErr(ctx, err)
}

// frameHeader is a frame's first nine bytes.
type frameHeader [9]byte

func (h frameHeader) length() int      { return int(h[0])<<16 | int(h[1])<<8 | int(h[2]) }
func (h frameHeader) typ() byte        { return h[3] }
func (h frameHeader) flags() byte      { return h[4] }
func (h frameHeader) streamID() uint32 { return binary.BigEndian.Uint32(h[5:]) & maxStreamID }

// nextFrame reads one frame whole.
func (c *h2Conn) nextFrame() (frameHeader, []byte, error) {
	var head frameHeader
	if _, err := io.ReadFull(c.r, head[:]); err != nil {
		return head, nil, unexpected(err)
	}
	if !c.greeted {
		// The server's first frame must be SETTINGS (RFC 9113 3.4); an
		// HTTP/1 server answers the preface with a status line.
		if string(head[:5]) == "HTTP/" || head.typ() != frameSettings || head.flags()&flagAck != 0 {
			return head, nil, errNotH2
		}
		c.greeted = true
	}
	if head.length() > maxFrame {
		return head, nil, fmt.Errorf("http2: frame of %d bytes exceeds %d", head.length(), maxFrame)
	}
	p := make([]byte, head.length())
	if _, err := io.ReadFull(c.r, p); err != nil {
		return head, nil, unexpected(err)
	}
	return head, p, nil
}

// readFrame reads and handles one frame; an error is the connection's or
// st's end.
func (c *h2Conn) readFrame(st *stream) error {
	head, p, err := c.nextFrame()
	if err != nil {
		return err
	}
	length, typ, flags, id := len(p), head.typ(), head.flags(), head.streamID()
	switch typ {
	case frameData:
		c.unacked += int64(length)
		if id == st.id {
			st.unacked += int64(length)
		}
		data, err := unpad(p, flags)
		if err != nil {
			return err
		}
		if id == st.id {
			if len(st.data)+len(data) > maxAnswer+5 {
				return fmt.Errorf("answer exceeds %d bytes", maxAnswer)
			}
			st.data = append(st.data, data...)
			st.ended = flags&flagEndStream != 0
		}
		c.giveBack(st)
	case frameHeaders:
		block, err := unpad(p, flags)
		if err != nil {
			return err
		}
		if flags&flagPriority != 0 {
			if len(block) < 5 {
				return errors.New("http2: short HEADERS frame")
			}
			block = block[5:]
		}
		for flags&flagEndHeaders == 0 {
			var more []byte
			if more, flags, err = c.continuation(id); err != nil {
				return err
			}
			block = append(block, more...)
		}
		fields, err := c.dec.DecodeFull(block)
		if err != nil {
			return fmt.Errorf("http2: header block: %w", err)
		}
		if id == st.id {
			st.take(fields)
			st.ended = head.flags()&flagEndStream != 0
		}
	case frameRSTStream:
		if id == st.id {
			if len(p) != 4 {
				return errors.New("http2: RST_STREAM of the wrong size")
			}
			code := binary.BigEndian.Uint32(p)
			err := fmt.Errorf("http2: stream reset by the server (error code %d)", code)
			if code == errCodeRefusedStream {
				err = fmt.Errorf("%w: %w", errNotSent, err)
			}
			return err
		}
	case frameSettings:
		if flags&flagAck != 0 {
			return nil
		}
		if len(p)%6 != 0 {
			return errors.New("http2: SETTINGS of the wrong size")
		}
		for i := 0; i < len(p); i += 6 {
			v := binary.BigEndian.Uint32(p[i+2:])
			switch binary.BigEndian.Uint16(p[i:]) {
			case settingHeaderTableSize:
				c.enc.SetMaxDynamicTableSizeLimit(v)
			case settingInitialWindowSize:
				if v > maxStreamID {
					return errors.New("http2: initial window size too large")
				}
				st.sendWindow += int64(v) - c.peerInitial
				c.peerInitial = int64(v)
			}
		}
		c.out = appendFrame(c.out, frameSettings, flagAck, 0, nil)
	case framePing:
		if flags&flagAck == 0 && len(p) == 8 {
			c.out = appendFrame(c.out, framePing, flagAck, 0, p)
		}
	case frameGoAway:
		if len(p) < 8 {
			return errors.New("http2: short GOAWAY")
		}
		c.goAway = true
		c.lastStream = binary.BigEndian.Uint32(p) & maxStreamID
		if st.id > c.lastStream {
			return fmt.Errorf("http2: the server is going away (error code %d): %s", binary.BigEndian.Uint32(p[4:]), p[8:])
		}
	case frameWindowUpdate:
		if len(p) != 4 {
			return errors.New("http2: WINDOW_UPDATE of the wrong size")
		}
		inc := int64(binary.BigEndian.Uint32(p) & maxStreamID)
		switch id {
		case 0:
			c.sendWindow += inc
		case st.id:
			st.sendWindow += inc
		}
	case framePushPromise:
		return errors.New("http2: PUSH_PROMISE though push is disabled")
	case frameContinuation:
		return errors.New("http2: CONTINUATION without HEADERS")
	}
	// PRIORITY and unknown frames are ignored (RFC 9113 4.1, 5.5).
	return nil
}

// continuation reads the CONTINUATION frame that must follow on id.
func (c *h2Conn) continuation(id uint32) ([]byte, byte, error) {
	head, p, err := c.nextFrame()
	if err != nil {
		return nil, 0, err
	}
	if head.typ() != frameContinuation || head.streamID() != id {
		return nil, 0, errors.New("http2: header block not continued")
	}
	return p, head.flags(), nil
}

// giveBack returns received DATA to the windows once half of one is used.
func (c *h2Conn) giveBack(st *stream) {
	if c.unacked >= recvWindow/2 {
		c.out = appendFrame(c.out, frameWindowUpdate, 0, 0, binary.BigEndian.AppendUint32(nil, uint32(c.unacked)))
		c.unacked = 0
	}
	if !st.ended && st.unacked >= recvWindow/2 {
		c.out = appendFrame(c.out, frameWindowUpdate, 0, st.id, binary.BigEndian.AppendUint32(nil, uint32(st.unacked)))
		st.unacked = 0
	}
	if len(c.out) > 0 {
		// Best effort: a failed write shows as the next read's error.
		if _, err := c.c.Write(c.out); err != nil {
			c.broken = true
		}
		c.out = c.out[:0]
	}
}

func unpad(p []byte, flags byte) ([]byte, error) {
	if flags&flagPadded == 0 {
		return p, nil
	}
	if len(p) == 0 || int(p[0]) >= len(p) {
		return nil, errors.New("http2: bad padding")
	}
	return p[1 : len(p)-int(p[0])], nil
}

// take records a header block of the stream: the response's headers, then
// its trailers (or a trailers-only answer).
func (st *stream) take(fields []hpack.HeaderField) {
	for _, f := range fields {
		switch f.Name {
		case ":status":
			st.status = f.Value
		case "grpc-status":
			st.grpcStatus = f.Value
		case "grpc-message":
			if m, err := url.PathUnescape(f.Value); err == nil {
				st.grpcMsg = m
			} else {
				st.grpcMsg = f.Value
			}
		}
	}
}

// answer is the stream's message, or its error.
func (st *stream) answer() ([]byte, error) {
	if st.status != "200" {
		return nil, fmt.Errorf("gRPC call answered with HTTP status %q", st.status)
	}
	if st.grpcStatus != "0" {
		code, err := strconv.Atoi(st.grpcStatus)
		if err != nil {
			return nil, fmt.Errorf("gRPC call ended without a status (%q)", st.grpcStatus)
		}
		return nil, &etcdError{Code: code, Message: st.grpcMsg}
	}
	d := st.data
	if len(d) < 5 || d[0] != 0 || int(binary.BigEndian.Uint32(d[1:5])) != len(d)-5 {
		return nil, fmt.Errorf("gRPC answer is not one uncompressed message (%d bytes)", len(d))
	}
	return d[5:], nil
}
