// Package etcdjson is the etcd v3 store.Store for short-lived processes
// (the CNI plugins): etcd's gRPC API (KV.Txn, KV.Range, Auth.Authenticate)
// on a small HTTP/2 client of its own (h2.go) with the messages written
// and read by hand (proto.go) for plaintext endpoints, and etcd's JSON
// gateway (/v3/kv/range, /v3/kv/txn) on a small HTTP/1.1 client of its own
// (wire.go, body.go) for TLS endpoints and for a plaintext endpoint that
// answers HTTP/2 with HTTP/1 (a proxy); TLS is linked only into programs
// that import package etcdtls (see TLSSupport). It exists so that
// short-lived plugin processes do not link (and initialise, on every
// invocation) grpc-go, the protobuf runtime and its registries, zap,
// net/http or crypto/tls: see docs/benchmarks.md. The package keeps the
// name it had when it spoke only the gateway.
//
// Contract: the same as package etcd (one store contract suite runs on
// both, over each wire): keys under Config.Prefix (default "/ringipam/");
// Get reads all keys in one transaction at one revision; Scan is a sorted
// range read paged at one revision; Commit is one transaction whose
// conditions are Version(k) = 0 for "absent", ModRevision(k) = rev
// otherwise, and Version = 0 over [k, end) for a range condition (the
// Compare's range_end, field 64 on gRPC), a failed condition writing
// nothing and returning an error
// wrapping store.ErrConflict; CommitOrGet (store.Speculator) adds
// Value(k) = v conditions and reads the keys asked in the transaction's
// failure branch. Every call runs under RequestTimeout (or the caller's
// earlier deadline, which gRPC calls also send as grpc-timeout); an
// unreachable cluster or a timeout wraps store.ErrUnavailable and names
// the endpoints (and a TLS failure says so); oversized transactions wrap
// store.ErrTooLarge. Endpoints are tried in order, the next one when one
// cannot be reached; a commit goes to the next one only when nothing of it
// was acted on. With Username set it authenticates once per Store and
// sends the token. Safe for concurrent use.
package etcdjson

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ringipam/ringipam/pkg/store"
)

// Defaults applied by New to zero Config fields.
const (
	DefaultPrefix         = "/ringipam/"
	DefaultDialTimeout    = 5 * time.Second
	DefaultRequestTimeout = 10 * time.Second
)

// TLS names the PEM files of a TLS client.
type TLS struct{ CAFile, CertFile, KeyFile string }

// Config describes a cluster.
type Config struct {
	Endpoints      []string // http://host:port or https://host:port
	Prefix         string
	TLS            *TLS
	Username       string
	Password       string
	DialTimeout    time.Duration
	RequestTimeout time.Duration
}

// Store is the gateway client. Build it with New.
type Store struct {
	cfg       Config
	client    *httpClient // the gateway's, for TLS endpoints
	h2        *h2Client   // gRPC's, for plaintext ones
	endpoints []endpoint
	gateway   []atomic.Bool // by endpoint: spoken to through the gateway
	names     string        // the endpoints, for messages
	mu        sync.Mutex
	token     string
}

// New returns a Store; it does not touch the network.
func New(cfg Config) (*Store, error) {
	if len(cfg.Endpoints) == 0 {
		return nil, errors.New("etcd store: no endpoints")
	}
	if cfg.Prefix == "" {
		cfg.Prefix = DefaultPrefix
	}
	if cfg.DialTimeout == 0 {
		cfg.DialTimeout = DefaultDialTimeout
	}
	if cfg.RequestTimeout == 0 {
		cfg.RequestTimeout = DefaultRequestTimeout
	}
	client := &httpClient{dialTimeout: cfg.DialTimeout}
	var eps []endpoint
	var names []string
	for _, e := range cfg.Endpoints {
		if !strings.Contains(e, "://") {
			scheme := "http://"
			if cfg.TLS != nil {
				scheme = "https://"
			}
			e = scheme + e
		}
		ep, err := parseEndpoint(e)
		if err != nil {
			return nil, fmt.Errorf("etcd store: %w", err)
		}
		eps = append(eps, ep)
		names = append(names, ep.url)
	}
	needTLS := cfg.TLS != nil
	for _, ep := range eps {
		needTLS = needTLS || ep.tls
	}
	if needTLS {
		if TLSSupport == nil {
			return nil, fmt.Errorf("%w: etcd store %s: %w", store.ErrUnavailable, strings.Join(names, ","), ErrNoTLS)
		}
		dial, err := TLSSupport(cfg.TLS)
		if err != nil {
			return nil, fmt.Errorf("etcd store: %w", err)
		}
		client.tls = dial
	}
	return &Store{
		cfg: cfg, client: client, h2: &h2Client{dialTimeout: cfg.DialTimeout},
		endpoints: eps, gateway: make([]atomic.Bool, len(eps)), names: strings.Join(names, ","),
	}, nil
}

// TLSDialer wraps a connected TCP connection in TLS, checking that the
// server is serverName.
type TLSDialer func(ctx context.Context, c net.Conn, serverName string) (net.Conn, error)

// TLSSupport builds the TLSDialer of a Config's TLS files (nil: https with
// the system's roots and no client certificate). Package etcdtls sets it;
// a program that does not import that package has no TLS: the CNI plugins,
// which reach a TLS etcd through the host agent's store socket and so do
// not pay for a TLS stack on every invocation (docs/benchmarks.md).
var TLSSupport func(*TLS) (TLSDialer, error)

// ErrNoTLS is wrapped by New when a TLS endpoint is configured in a program
// without TLS support (see TLSSupport); New wraps store.ErrUnavailable with
// it, since the host agent's socket may answer a moment later.
var ErrNoTLS = errors.New("this program carries no TLS: it reaches an etcd over TLS only through ringipamd's store socket")

// Prefix returns the key prefix in use.
func (s *Store) Prefix() string { return s.cfg.Prefix }

// Close releases idle connections.
func (s *Store) Close() error {
	s.client.closeIdle()
	s.h2.pool.closeIdle()
	return nil
}

// rangeAnswer is a range read's answer, in either encoding.
type rangeAnswer struct {
	revision int64
	kvs      []store.KV // keys without the prefix
	more     bool
}

// txnAnswer is a transaction's answer: one entry in reads per response,
// empty for a write's.
type txnAnswer struct {
	revision  int64
	succeeded bool
	reads     []rangeAnswer
}

// wire types of the gateway (int64 fields come as strings).
type kvJSON struct {
	Key         string `json:"key"`
	Value       string `json:"value"`
	ModRevision string `json:"mod_revision"`
}

type rangeResp struct {
	Header struct {
		Revision string `json:"revision"`
	} `json:"header"`
	Kvs  []kvJSON `json:"kvs"`
	More bool     `json:"more"`
}

type txnResp struct {
	Header struct {
		Revision string `json:"revision"`
	} `json:"header"`
	Succeeded bool `json:"succeeded"`
	Responses []struct {
		ResponseRange *rangeResp `json:"response_range"`
	} `json:"responses"`
}

func (s *Store) decodeKV(kv kvJSON) (store.KV, error) {
	k, err := base64.StdEncoding.DecodeString(kv.Key)
	if err != nil {
		return store.KV{}, err
	}
	v, err := base64.StdEncoding.DecodeString(kv.Value)
	if err != nil {
		return store.KV{}, err
	}
	rev, _ := strconv.ParseInt(kv.ModRevision, 10, 64)
	return store.KV{Key: strings.TrimPrefix(string(k), s.cfg.Prefix), Value: v, Revision: rev}, nil
}

func (s *Store) rangeFromJSON(r *rangeResp) (rangeAnswer, error) {
	a := rangeAnswer{more: r.More}
	a.revision, _ = strconv.ParseInt(r.Header.Revision, 10, 64)
	for _, x := range r.Kvs {
		kv, err := s.decodeKV(x)
		if err != nil {
			return rangeAnswer{}, err
		}
		a.kvs = append(a.kvs, kv)
	}
	return a, nil
}

// decodeTxn reads a transaction's answer in the encoding it came in.
func (s *Store) decodeTxn(data []byte, grpc bool) (txnAnswer, error) {
	if grpc {
		return s.decodeTxnProto(data)
	}
	var r txnResp
	if err := decodeAnswer(data, &r); err != nil {
		return txnAnswer{}, err
	}
	a := txnAnswer{succeeded: r.Succeeded}
	a.revision, _ = strconv.ParseInt(r.Header.Revision, 10, 64)
	for _, x := range r.Responses {
		var read rangeAnswer
		if x.ResponseRange != nil {
			var err error
			if read, err = s.rangeFromJSON(x.ResponseRange); err != nil {
				return txnAnswer{}, err
			}
		}
		a.reads = append(a.reads, read)
	}
	return a, nil
}

// decodeRange reads a range read's answer in the encoding it came in.
func (s *Store) decodeRange(data []byte, grpc bool) (rangeAnswer, error) {
	if grpc {
		return s.decodeRangeProto(data)
	}
	var r rangeResp
	if err := decodeAnswer(data, &r); err != nil {
		return rangeAnswer{}, err
	}
	return s.rangeFromJSON(&r)
}

// etcdError is an error answer of etcd: through the gateway (Status is the
// HTTP status) or over gRPC (Status 0). Code is the gRPC code either way.
type etcdError struct {
	Status  int
	Message string `json:"message"`
	Code    int    `json:"code"`
}

func (e *etcdError) Error() string {
	if e.Status == 0 {
		return fmt.Sprintf("etcd: %s (gRPC code %d)", e.Message, e.Code)
	}
	return fmt.Sprintf("etcd gateway: HTTP %d: %s", e.Status, e.Message)
}

// method is one of etcd's calls, by its gateway path and its gRPC name.
type method struct{ gateway, grpc string }

var (
	txnMethod   = method{"/v3/kv/txn", "/etcdserverpb.KV/Txn"}
	rangeMethod = method{"/v3/kv/range", "/etcdserverpb.KV/Range"}
	authMethod  = method{"/v3/auth/authenticate", "/etcdserverpb.Auth/Authenticate"}
)

// encoder returns a call's request in protobuf (grpc) or the gateway's
// JSON.
type encoder func(grpc bool) []byte

// call makes m on the first endpoint that answers and returns the answer
// and whether it is protobuf (gRPC) or the gateway's JSON. Plaintext
// endpoints are spoken to in gRPC (h2.go), TLS ones through the gateway
// (wire.go), as is a plaintext endpoint found not to speak HTTP/2.
// idempotent says the request may be sent twice (a read); a commit is
// never sent again after any of it was written.
func (s *Store) call(ctx context.Context, m method, req encoder, idempotent bool) ([]byte, bool, error) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
	defer cancel()
	if s.cfg.Username != "" && m != authMethod {
		if err := s.authenticate(ctx); err != nil {
			return nil, false, err
		}
	}
	s.mu.Lock()
	token := s.token
	s.mu.Unlock()
	var errs []error
	for i, ep := range s.endpoints {
		grpc := !ep.tls && !s.gateway[i].Load()
		var data []byte
		var err error
		if grpc {
			data, err = s.h2.unary(ctx, ep, m.grpc, token, req(true), idempotent)
			if errors.Is(err, errNotH2) {
				// Not acted on: say it through the gateway from now on.
				s.gateway[i].Store(true)
				grpc = false
			}
		}
		if !grpc {
			var header []string
			if token != "" {
				header = append(header, "Authorization: "+token)
			}
			var status int
			status, data, err = s.client.post(ctx, ep, m.gateway, header, req(false), idempotent)
			if err == nil && status != 200 {
				ee := &etcdError{Status: status}
				_ = json.Unmarshal(data, ee)
				if ee.Message == "" {
					ee.Message = strings.TrimSpace(string(data))
				}
				err = ee
			}
		}
		var ee *etcdError
		if errors.As(err, &ee) {
			return nil, false, s.classify(ctx, ee)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", ep.url, err))
			if ctx.Err() != nil {
				break
			}
			continue // the next endpoint
		}
		return data, grpc, nil
	}
	if errors.Is(ctx.Err(), context.Canceled) {
		return nil, false, fmt.Errorf("etcd store %s: %w", s.names, ctx.Err())
	}
	return nil, false, fmt.Errorf("%w: etcd at %s not reachable: %w", store.ErrUnavailable, s.names, errors.Join(errs...))
}

func (s *Store) classify(ctx context.Context, ee *etcdError) error {
	msg := strings.ToLower(ee.Message)
	switch {
	// gRPC's own limit on a message (ResourceExhausted) is met before
	// etcd's request limit by a request far over it.
	case strings.Contains(msg, "too many operations") || strings.Contains(msg, "request is too large") ||
		ee.Code == 8 && strings.Contains(msg, "larger than max"):
		return fmt.Errorf("%w: etcd store %s: %w", store.ErrTooLarge, s.names, ee)
	// 14 Unavailable, 4 DeadlineExceeded; a deadline that passed inside the
	// server comes back as code 2 (Unknown) "context deadline exceeded".
	case ee.Code == 14 || ee.Code == 4 || strings.Contains(msg, "no leader") || strings.Contains(msg, "timed out") ||
		strings.Contains(msg, "deadline exceeded") || ee.Status == 503 || ctx.Err() != nil:
		return fmt.Errorf("%w: etcd at %s not reachable or without leader: %w", store.ErrUnavailable, s.names, ee)
	}
	return fmt.Errorf("etcd store %s: %w", s.names, ee)
}

func (s *Store) authenticate(ctx context.Context) error {
	s.mu.Lock()
	have := s.token != ""
	s.mu.Unlock()
	if have {
		return nil
	}
	data, grpc, err := s.call(ctx, authMethod, func(grpc bool) []byte {
		if grpc {
			return authProto(s.cfg.Username, s.cfg.Password)
		}
		b, _ := json.Marshal(map[string]string{"name": s.cfg.Username, "password": s.cfg.Password})
		return b
	}, true)
	if err != nil {
		return fmt.Errorf("etcd authentication as %s: %w", s.cfg.Username, err)
	}
	var token string
	if grpc {
		token, err = decodeAuthProto(data)
	} else {
		var out struct {
			Token string `json:"token"`
		}
		err = json.Unmarshal(data, &out)
		token = out.Token
	}
	if err != nil {
		return fmt.Errorf("etcd authentication as %s: undecodable answer: %w", s.cfg.Username, err)
	}
	s.mu.Lock()
	s.token = token
	s.mu.Unlock()
	return nil
}

// Get implements store.Store: one transaction of range reads.
func (s *Store) Get(ctx context.Context, keys ...string) ([]store.KV, error) {
	out, done, err := store.StartGet(ctx, keys)
	if done {
		return out, err
	}
	var rev int64
	for start := 0; start < len(keys); start += store.MaxOps {
		end := min(start+store.MaxOps, len(keys))
		page := keys[start:end]
		data, grpc, err := s.call(ctx, txnMethod, func(grpc bool) []byte {
			if grpc {
				return s.getProto(page, rev)
			}
			return s.getBody(page, revString(rev))
		}, true)
		if err != nil {
			return nil, fmt.Errorf("get: %w", err)
		}
		resp, err := s.decodeTxn(data, grpc)
		if err != nil {
			return nil, s.undecodable(txnMethod, err)
		}
		if rev == 0 {
			rev = resp.revision
		}
		if err := fill(out[start:end], resp); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// revString is a revision as the gateway's requests carry it ("": none).
func revString(rev int64) string {
	if rev == 0 {
		return ""
	}
	return strconv.FormatInt(rev, 10)
}

func (s *Store) undecodable(m method, err error) error {
	return fmt.Errorf("etcd %s: undecodable answer to %s: %w", s.names, m.grpc, err)
}

const scanPage = 1000

// Scan implements store.Store: a sorted range read, paged at one revision.
func (s *Store) Scan(ctx context.Context, from, to string, limit int) ([]store.KV, error) {
	if to <= from {
		return nil, ctx.Err()
	}
	var out []store.KV
	var rev int64
	key := from
	for {
		page := scanPage
		if limit > 0 && limit-len(out) < page {
			page = limit - len(out)
		}
		// No sort_order: a range comes back in key order already, and an
		// explicit sort makes etcd 3.4 read the whole range for every page.
		data, grpc, err := s.call(ctx, rangeMethod, func(grpc bool) []byte {
			if grpc {
				return s.scanProto(key, to, page, rev)
			}
			return s.scanBody(s.cfg.Prefix+key, s.cfg.Prefix+to, page, revString(rev))
		}, true)
		if err != nil {
			return nil, fmt.Errorf("scan: %w", err)
		}
		resp, err := s.decodeRange(data, grpc)
		if err != nil {
			return nil, s.undecodable(rangeMethod, err)
		}
		if rev == 0 {
			rev = resp.revision
		}
		out = append(out, resp.kvs...)
		if !resp.more || len(resp.kvs) == 0 || (limit > 0 && len(out) >= limit) {
			return out, nil
		}
		key = out[len(out)-1].Key + "\x00"
	}
}

// commit sends a transaction and decodes its answer.
func (s *Store) commit(ctx context.Context, conds []store.Cond, same []store.KV, ops []store.Op, read []string) (txnAnswer, error) {
	data, grpc, err := s.call(ctx, txnMethod, func(grpc bool) []byte {
		if grpc {
			return s.txnProto(conds, same, ops, read)
		}
		return s.txnBody(conds, same, ops, read)
	}, false)
	if err != nil {
		return txnAnswer{}, fmt.Errorf("commit: %w", err)
	}
	resp, err := s.decodeTxn(data, grpc)
	if err != nil {
		return txnAnswer{}, s.undecodable(txnMethod, err)
	}
	return resp, nil
}

// Commit implements store.Store.
func (s *Store) Commit(ctx context.Context, conds []store.Cond, ops []store.Op) error {
	if err := store.CheckCommit(conds, ops); err != nil {
		return fmt.Errorf("etcd store: %w", err)
	}
	resp, err := s.commit(ctx, conds, nil, ops, nil)
	if err != nil {
		return err
	}
	if !resp.succeeded {
		return fmt.Errorf("%w (etcd revision %d)", store.ErrConflict, resp.revision)
	}
	return nil
}

// CommitOrGet implements store.Speculator: one transaction whose failure
// branch reads the keys of read.
func (s *Store) CommitOrGet(ctx context.Context, conds []store.Cond, same []store.KV, ops []store.Op, read []string) ([]store.KV, error) {
	if err := store.CheckSpeculation(conds, same, ops, read); err != nil {
		return nil, fmt.Errorf("etcd store: %w", err)
	}
	out, _, _ := store.StartGet(ctx, read)
	resp, err := s.commit(ctx, conds, same, ops, read)
	if err != nil {
		return nil, err
	}
	if resp.succeeded {
		return nil, nil
	}
	if err := fill(out, resp); err != nil {
		return nil, err
	}
	return out, fmt.Errorf("%w (etcd revision %d)", store.ErrConflict, resp.revision)
}

// fill sets out's values and revisions from a transaction of range reads,
// one per entry of out.
func fill(out []store.KV, resp txnAnswer) error {
	if len(resp.reads) > len(out) {
		return fmt.Errorf("etcd: %d answers to %d reads", len(resp.reads), len(out))
	}
	for i, r := range resp.reads {
		if len(r.kvs) > 0 {
			out[i].Value, out[i].Revision = r.kvs[0].Value, r.kvs[0].Revision
		}
	}
	return nil
}

// Ping checks that the cluster answers a linearizable read within the
// request timeout.
func (s *Store) Ping(ctx context.Context) error {
	_, _, err := s.call(ctx, rangeMethod, func(grpc bool) []byte {
		if grpc {
			return s.rangeProto(nil, "\x00ping", "", 0, 0)
		}
		return s.scanBody(s.cfg.Prefix+"\x00ping", "", 0, "")
	}, true)
	if err != nil {
		return fmt.Errorf("ping: %w", err)
	}
	return nil
}
