package etcdjson

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// fakeH2 is one end of an HTTP/2 connection written frame by frame
// with x/net's Framer, to put the client through what a server may do.
type fakeH2 struct {
	t   *testing.T
	fr  *http2.Framer
	enc *hpack.Encoder
	buf bytes.Buffer
	dec *hpack.Decoder

	pingAcks [][8]byte // seen by request
	conn     net.Conn
}

// startFake runs serve on the server end of a connection and returns a
// client and the endpoint to call. serve's failures fail the test.
func startFake(t *testing.T, serve func(s *fakeH2)) (*h2Client, endpoint) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	t.Cleanup(func() { l.Close(); <-done })
	go func() {
		defer close(done)
		c, err := l.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(20 * time.Second))
		s := &fakeH2{t: t, fr: http2.NewFramer(c, c), dec: hpack.NewDecoder(4096, nil), conn: c}
		s.enc = hpack.NewEncoder(&s.buf)
		preface := make([]byte, len(clientPreface))
		if _, err := io.ReadFull(c, preface); err != nil || string(preface) != clientPreface {
			t.Errorf("preface %q, %v", preface, err)
			return
		}
		// A server's preface is its SETTINGS (RFC 9113 3.4).
		s.fr.WriteSettings(http2.Setting{ID: http2.SettingMaxConcurrentStreams, Val: 100})
		serve(s)
		// Read on until the client closes: closing with its frames unread
		// would reset the connection under the answer's last bytes.
		io.Copy(io.Discard, c)
	}()
	h := &h2Client{dialTimeout: 5 * time.Second}
	t.Cleanup(h.pool.closeIdle)
	return h, endpoint{url: "http://" + l.Addr().String(), hostport: l.Addr().String()}
}

// request reads frames up to a request's end and returns its stream, its
// headers and its message; settings are acknowledged.
func (s *fakeH2) request() (uint32, map[string]string, []byte) {
	s.t.Helper()
	headers := map[string]string{}
	var data []byte
	for {
		f, err := s.fr.ReadFrame()
		if err != nil {
			s.t.Errorf("reading the request: %v", err)
			return 0, nil, nil
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				s.fr.WriteSettingsAck()
			}
		case *http2.PingFrame:
			if f.IsAck() {
				s.pingAcks = append(s.pingAcks, f.Data)
			}
		case *http2.HeadersFrame:
			fields, err := s.dec.DecodeFull(f.HeaderBlockFragment())
			if err != nil {
				s.t.Errorf("request headers: %v", err)
			}
			for _, h := range fields {
				headers[h.Name] = h.Value
			}
			if f.StreamEnded() {
				return f.StreamID, headers, nil
			}
		case *http2.DataFrame:
			data = append(data, f.Data()...)
			if f.StreamEnded() {
				if len(data) < 5 || int(binary.BigEndian.Uint32(data[1:])) != len(data)-5 {
					s.t.Errorf("request body %x is not one gRPC message", data)
					return f.StreamID, headers, nil
				}
				return f.StreamID, headers, data[5:]
			}
		}
	}
}

func (s *fakeH2) block(fields ...string) []byte {
	s.buf.Reset()
	for i := 0; i < len(fields); i += 2 {
		s.enc.WriteField(hpack.HeaderField{Name: fields[i], Value: fields[i+1]})
	}
	return append([]byte(nil), s.buf.Bytes()...)
}

// answer writes a whole successful answer carrying msg.
func (s *fakeH2) answer(id uint32, msg []byte) {
	s.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, EndHeaders: true, BlockFragment: s.block(":status", "200", "content-type", "application/grpc")})
	s.fr.WriteData(id, false, grpcFrame(msg))
	s.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, EndHeaders: true, EndStream: true, BlockFragment: s.block("grpc-status", "0")})
}

func grpcFrame(msg []byte) []byte {
	b := make([]byte, 5, 5+len(msg))
	binary.BigEndian.PutUint32(b[1:], uint32(len(msg)))
	return append(b, msg...)
}

func call(h *h2Client, ep endpoint, msg string, idempotent bool) ([]byte, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return h.unary(ctx, ep, "/etcdserverpb.KV/Txn", "tok", []byte(msg), idempotent)
}

// Two calls on one connection (the header tables carried from one to the
// next), the server's PING answered, its SETTINGS acknowledged, its
// answer's header block continued in a CONTINUATION frame.
func TestH2Calls(t *testing.T) {
	pinged := make(chan bool, 1)
	authority := make(chan string, 1)
	h, ep := startFake(t, func(s *fakeH2) {
		authority := <-authority
		for i, want := range []string{"first", "second"} {
			id, headers, msg := s.request()
			if string(msg) != want || id != uint32(1+2*i) {
				t.Errorf("stream %d carried %q, want %q on %d", id, msg, want, 1+2*i)
			}
			for k, v := range map[string]string{":method": "POST", ":scheme": "http", ":path": "/etcdserverpb.KV/Txn", ":authority": authority,
				"content-type": "application/grpc", "te": "trailers", "token": "tok"} {
				if headers[k] != v {
					t.Errorf("stream %d: %s = %q, want %q", id, k, headers[k], v)
				}
			}
			if !strings.HasSuffix(headers["grpc-timeout"], "m") {
				t.Errorf("grpc-timeout %q", headers["grpc-timeout"])
			}
			if i == 0 {
				s.fr.WritePing(false, [8]byte{1, 2, 3, 4, 5, 6, 7, 8})
				s.answer(id, []byte("answer one"))
				continue
			}
			block := s.block(":status", "200", "content-type", "application/grpc", "x-long", strings.Repeat("y", 100))
			s.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: block[:10]})
			s.fr.WriteContinuation(id, true, block[10:])
			s.fr.WriteData(id, false, grpcFrame([]byte("answer two")))
			s.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, EndHeaders: true, EndStream: true, BlockFragment: s.block("grpc-status", "0")})
		}
		// The PING's answer came with the second request at the latest.
		pinged <- len(s.pingAcks) == 1 && s.pingAcks[0] == [8]byte{1, 2, 3, 4, 5, 6, 7, 8}
	})
	authority <- ep.hostport
	for _, c := range [][2]string{{"first", "answer one"}, {"second", "answer two"}} {
		got, err := call(h, ep, c[0], false)
		if err != nil || string(got) != c[1] {
			t.Fatalf("call %q: %q, %v", c[0], got, err)
		}
	}
	h.pool.closeIdle()
	if !<-pinged {
		t.Error("the server's PING was not answered")
	}
}

// A gRPC error comes back as etcdError with the message decoded, and the
// connection stays usable.
func TestH2Status(t *testing.T) {
	h, ep := startFake(t, func(s *fakeH2) {
		id, _, _ := s.request()
		s.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, EndHeaders: true, EndStream: true,
			BlockFragment: s.block(":status", "200", "content-type", "application/grpc", "grpc-status", "14", "grpc-message", "etcdserver: no leader %E2%9C%93")})
		id, _, _ = s.request()
		s.answer(id, []byte("ok"))
	})
	_, err := call(h, ep, "x", false)
	var ee *etcdError
	if !errors.As(err, &ee) || ee.Code != 14 || ee.Message != "etcdserver: no leader ✓" || ee.Status != 0 {
		t.Fatalf("trailers-only error: %#v", err)
	}
	if got, err := call(h, ep, "y", false); err != nil || string(got) != "ok" {
		t.Fatalf("after the error, on the same connection: %q %v", got, err)
	}
}

// A stream refused, or above a GOAWAY's last stream, was not acted on:
// errNotSent, which lets a commit go to the next endpoint. A reset of
// another kind may have been acted on.
func TestH2NotActedOn(t *testing.T) {
	for _, tc := range []struct {
		name    string
		do      func(s *fakeH2, id uint32)
		notSent bool
	}{
		{"refused", func(s *fakeH2, id uint32) { s.fr.WriteRSTStream(id, http2.ErrCodeRefusedStream) }, true},
		{"goaway below", func(s *fakeH2, id uint32) { s.fr.WriteGoAway(0, http2.ErrCodeNo, []byte("bye")) }, true},
		{"reset", func(s *fakeH2, id uint32) { s.fr.WriteRSTStream(id, http2.ErrCodeInternal) }, false},
		{"closed", func(s *fakeH2, id uint32) { s.conn.Close() }, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h, ep := startFake(t, func(s *fakeH2) {
				id, _, _ := s.request()
				tc.do(s, id)
			})
			_, err := call(h, ep, "commit", false)
			if err == nil || errors.Is(err, errNotSent) != tc.notSent {
				t.Fatalf("err = %v, want errNotSent %v", err, tc.notSent)
			}
		})
	}
}

// An HTTP/1 server's answer to the preface is errNotH2 (so call turns to
// the gateway) and not acted on.
func TestH2NotH2(t *testing.T) {
	l, _ := net.Listen("tcp", "127.0.0.1:0")
	defer l.Close()
	go func() {
		c, err := l.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		c.Read(make([]byte, 100))
		io.WriteString(c, "HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
	}()
	h := &h2Client{dialTimeout: time.Second}
	_, err := call(h, endpoint{hostport: l.Addr().String()}, "x", false)
	if !errors.Is(err, errNotH2) || !errors.Is(err, errNotSent) {
		t.Fatalf("err = %v", err)
	}
}

// Flow control: a request larger than the server's window waits for its
// WINDOW_UPDATEs and no DATA frame exceeds the window; an answer larger
// than half the client's window is acknowledged as it is read (the fake
// server honours the client's windows and would stall otherwise).
func TestH2FlowControl(t *testing.T) {
	big := bytes.Repeat([]byte("0123456789"), 30000) // 300 000 bytes
	answer := bytes.Repeat([]byte("abcdefghij"), 900000)
	h, ep := startFake(t, func(s *fakeH2) {
		// The client may send on the default windows until it has read
		// these SETTINGS; the server's accounting follows them once it
		// has the client's acknowledgement.
		const window = 1000
		s.fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: window})
		var got []byte
		var id uint32
		streamWin, connWin, target := int64(defaultWindow), int64(defaultWindow), int64(defaultWindow)
		clientConn, clientStream := int64(defaultWindow), int64(0)
		acks := 0
		for id == 0 {
			f, err := s.fr.ReadFrame()
			if err != nil {
				t.Errorf("read: %v", err)
				return
			}
			switch f := f.(type) {
			case *http2.SettingsFrame:
				if f.IsAck() {
					acks++
					if acks == 2 { // startFake's SETTINGS, then these
						streamWin += window - defaultWindow
						target = window
					}
				} else {
					v, _ := f.Value(http2.SettingInitialWindowSize)
					clientStream = int64(v)
					s.fr.WriteSettingsAck()
				}
			case *http2.WindowUpdateFrame:
				clientConn += int64(f.Increment)
			case *http2.DataFrame:
				n := int64(len(f.Data()))
				if n > streamWin || n > connWin {
					t.Errorf("DATA of %d bytes with windows %d/%d", n, streamWin, connWin)
				}
				streamWin -= n
				connWin -= n
				got = append(got, f.Data()...)
				if f.StreamEnded() {
					id = f.StreamID
				}
			}
			if id == 0 && streamWin < target/2 {
				s.fr.WriteWindowUpdate(1, uint32(target-streamWin))
				streamWin = target
			}
			if connWin < defaultWindow/2 {
				s.fr.WriteWindowUpdate(0, uint32(defaultWindow-connWin))
				connWin = defaultWindow
			}
		}
		if !bytes.Equal(got, grpcFrame(big)) {
			t.Errorf("request arrived with %d bytes, want %d", len(got), len(big)+5)
		}
		// The answer, within the client's windows.
		s.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, EndHeaders: true, BlockFragment: s.block(":status", "200", "content-type", "application/grpc")})
		rest := grpcFrame(answer)
		for len(rest) > 0 {
			n := min(int64(len(rest)), maxFrame, clientConn, clientStream)
			if n <= 0 {
				f, err := s.fr.ReadFrame()
				if err != nil {
					t.Errorf("waiting for the client's WINDOW_UPDATE: %v", err)
					return
				}
				if w, ok := f.(*http2.WindowUpdateFrame); ok {
					if w.StreamID == 0 {
						clientConn += int64(w.Increment)
					} else {
						clientStream += int64(w.Increment)
					}
				}
				continue
			}
			s.fr.WriteData(id, false, rest[:n])
			rest = rest[n:]
			clientConn -= n
			clientStream -= n
		}
		s.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, EndHeaders: true, EndStream: true, BlockFragment: s.block("grpc-status", "0")})
	})
	got, err := call(h, ep, string(big), false)
	if err != nil || !bytes.Equal(got, answer) {
		t.Fatalf("%d bytes, %v", len(got), err)
	}
}

// A server that never answers: the call ends at the context's deadline.
func TestH2Deadline(t *testing.T) {
	h, ep := startFake(t, func(s *fakeH2) {
		s.request()
		time.Sleep(time.Second)
	})
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := h.unary(ctx, ep, "/etcdserverpb.KV/Txn", "", []byte("x"), true)
	if !errors.Is(err, context.DeadlineExceeded) || time.Since(start) > 2*time.Second {
		t.Fatalf("err = %v after %v", err, time.Since(start))
	}
}
