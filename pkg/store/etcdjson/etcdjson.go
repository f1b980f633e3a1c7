// Package etcdjson is the etcd v3 store.Store spoken through etcd's JSON
// gateway (HTTP/JSON on the client URL: /v3/kv/range, /v3/kv/txn), with
// its own small HTTP/1.1 client (wire.go) and its own writer and reader of
// the gateway's JSON (body.go, encoding/json for what it leaves); TLS is
// linked only into programs that import package etcdtls (see TLSSupport).
// It exists so that short-lived plugin processes do not link (and
// initialise, on every invocation) the gRPC client, its protobuf registries
// and its logger, nor net/http, nor crypto/tls: see docs/benchmarks.md.
//
// Contract: the same as package etcd (one store contract suite runs on
// both): keys under Config.Prefix (default "/ringipam/"); Get reads all keys
// in one transaction at one revision; Scan is a sorted range read paged at
// one revision; Commit is one transaction whose conditions are
// Version(k) = 0 for "absent" and ModRevision(k) = rev otherwise, a failed
// condition writing nothing and returning an error wrapping
// store.ErrConflict; CommitOrGet (store.Speculator) adds Value(k) = v
// conditions and reads the keys asked in the transaction's failure branch. Every call runs under RequestTimeout (or the caller's
// earlier deadline); an unreachable cluster or a timeout wraps
// store.ErrUnavailable and names the endpoints (and a TLS failure says so);
// oversized transactions
// wrap store.ErrTooLarge. Endpoints are tried in order, the next one when
// one cannot be reached. With Username set it authenticates once per Store
// and sends the token. Safe for concurrent use.
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
	client    *httpClient
	endpoints []endpoint
	names     string // the endpoints, for messages
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
	return &Store{cfg: cfg, client: client, endpoints: eps, names: strings.Join(names, ",")}, nil
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
	return nil
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

// gatewayError is an error answer of the gateway.
type gatewayError struct {
	Status  int
	Message string `json:"message"`
	Code    int    `json:"code"`
}

func (e *gatewayError) Error() string {
	return fmt.Sprintf("etcd gateway: HTTP %d: %s", e.Status, e.Message)
}

// call posts body to path on the first endpoint that answers and decodes
// the answer into out. idempotent says the request may be sent twice (a
// read); a commit is never sent again after any of it was written.
func (s *Store) call(ctx context.Context, path string, req, out any, idempotent bool) error {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
	defer cancel()
	payload, encoded := req.(body)
	if !encoded {
		var err error
		if payload, err = json.Marshal(req); err != nil {
			return err
		}
	}
	if s.cfg.Username != "" && path != "/v3/auth/authenticate" {
		if err := s.authenticate(ctx); err != nil {
			return err
		}
	}
	var header []string
	s.mu.Lock()
	if s.token != "" {
		header = append(header, "Authorization: "+s.token)
	}
	s.mu.Unlock()
	var errs []error
	for _, ep := range s.endpoints {
		status, data, err := s.client.post(ctx, ep, path, header, payload, idempotent)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", ep.url, err))
			if ctx.Err() != nil {
				break
			}
			continue // the next endpoint
		}
		if status != 200 {
			ge := &gatewayError{Status: status}
			_ = json.Unmarshal(data, ge)
			if ge.Message == "" {
				ge.Message = strings.TrimSpace(string(data))
			}
			return s.classify(ctx, ge)
		}
		if err := decodeAnswer(data, out); err != nil {
			return fmt.Errorf("etcd gateway %s%s: undecodable answer: %w", ep.url, path, err)
		}
		return nil
	}
	if errors.Is(ctx.Err(), context.Canceled) {
		return fmt.Errorf("etcd store %s: %w", s.names, ctx.Err())
	}
	return fmt.Errorf("%w: etcd at %s not reachable: %w", store.ErrUnavailable, s.names, errors.Join(errs...))
}

func (s *Store) classify(ctx context.Context, ge *gatewayError) error {
	msg := strings.ToLower(ge.Message)
	switch {
	case strings.Contains(msg, "too many operations") || strings.Contains(msg, "request is too large"):
		return fmt.Errorf("%w: etcd store %s: %w", store.ErrTooLarge, s.names, ge)
	// 14 Unavailable, 4 DeadlineExceeded; a deadline that passed inside the
	// server comes back as code 2 (Unknown) "context deadline exceeded".
	case ge.Code == 14 || ge.Code == 4 || strings.Contains(msg, "no leader") || strings.Contains(msg, "timed out") ||
		strings.Contains(msg, "deadline exceeded") || ge.Status == 503 || ctx.Err() != nil:
		return fmt.Errorf("%w: etcd at %s not reachable or without leader: %w", store.ErrUnavailable, s.names, ge)
	}
	return fmt.Errorf("etcd store %s: %w", s.names, ge)
}

func (s *Store) authenticate(ctx context.Context) error {
	s.mu.Lock()
	have := s.token != ""
	s.mu.Unlock()
	if have {
		return nil
	}
	var out struct {
		Token string `json:"token"`
	}
	if err := s.call(ctx, "/v3/auth/authenticate", map[string]string{"name": s.cfg.Username, "password": s.cfg.Password}, &out, true); err != nil {
		return fmt.Errorf("etcd authentication as %s: %w", s.cfg.Username, err)
	}
	s.mu.Lock()
	s.token = out.Token
	s.mu.Unlock()
	return nil
}

// Get implements store.Store: one transaction of range reads.
func (s *Store) Get(ctx context.Context, keys ...string) ([]store.KV, error) {
	out, done, err := store.StartGet(ctx, keys)
	if done {
		return out, err
	}
	var rev string
	for start := 0; start < len(keys); start += store.MaxOps {
		end := min(start+store.MaxOps, len(keys))
		var resp txnResp
		if err := s.call(ctx, "/v3/kv/txn", s.getBody(keys[start:end], rev), &resp, true); err != nil {
			return nil, fmt.Errorf("get: %w", err)
		}
		if rev == "" {
			rev = resp.Header.Revision
		}
		if err := s.fill(out[start:end], resp); err != nil {
			return nil, err
		}
	}
	return out, nil
}

const scanPage = 1000

// Scan implements store.Store: a sorted range read, paged at one revision.
func (s *Store) Scan(ctx context.Context, from, to string, limit int) ([]store.KV, error) {
	if to <= from {
		return nil, ctx.Err()
	}
	var out []store.KV
	var rev string
	key, end := s.cfg.Prefix+from, s.cfg.Prefix+to
	for {
		page := scanPage
		if limit > 0 && limit-len(out) < page {
			page = limit - len(out)
		}
		// No sort_order: a range comes back in key order already, and an
		// explicit sort makes etcd 3.4 read the whole range for every page.
		var resp rangeResp
		if err := s.call(ctx, "/v3/kv/range", s.scanBody(key, end, page, rev), &resp, true); err != nil {
			return nil, fmt.Errorf("scan: %w", err)
		}
		if rev == "" {
			rev = resp.Header.Revision
		}
		for _, x := range resp.Kvs {
			kv, err := s.decodeKV(x)
			if err != nil {
				return nil, err
			}
			out = append(out, kv)
		}
		if !resp.More || len(resp.Kvs) == 0 || (limit > 0 && len(out) >= limit) {
			return out, nil
		}
		key = s.cfg.Prefix + out[len(out)-1].Key + "\x00"
	}
}

// Commit implements store.Store.
func (s *Store) Commit(ctx context.Context, conds []store.Cond, ops []store.Op) error {
	if err := store.CheckCommit(conds, ops); err != nil {
		return fmt.Errorf("etcd store: %w", err)
	}
	var resp txnResp
	if err := s.call(ctx, "/v3/kv/txn", s.txnBody(conds, nil, ops, nil), &resp, false); err != nil {
		return fmt.Errorf("commit: %w", err)
	}
	if !resp.Succeeded {
		return fmt.Errorf("%w (etcd revision %s)", store.ErrConflict, resp.Header.Revision)
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
	var resp txnResp
	if err := s.call(ctx, "/v3/kv/txn", s.txnBody(conds, same, ops, read), &resp, false); err != nil {
		return nil, fmt.Errorf("commit: %w", err)
	}
	if resp.Succeeded {
		return nil, nil
	}
	if err := s.fill(out, resp); err != nil {
		return nil, err
	}
	return out, fmt.Errorf("%w (etcd revision %s)", store.ErrConflict, resp.Header.Revision)
}

// fill sets out's values and revisions from a transaction of range reads,
// one per entry of out.
func (s *Store) fill(out []store.KV, resp txnResp) error {
	for i, r := range resp.Responses {
		if i >= len(out) {
			return fmt.Errorf("etcd gateway: %d answers to %d reads", len(resp.Responses), len(out))
		}
		if r.ResponseRange == nil || len(r.ResponseRange.Kvs) == 0 {
			continue
		}
		kv, err := s.decodeKV(r.ResponseRange.Kvs[0])
		if err != nil {
			return err
		}
		out[i].Value, out[i].Revision = kv.Value, kv.Revision
	}
	return nil
}

// Ping checks that the cluster answers a linearizable read within the
// request timeout.
func (s *Store) Ping(ctx context.Context) error {
	var resp rangeResp
	if err := s.call(ctx, "/v3/kv/range", s.scanBody(s.cfg.Prefix+"\x00ping", "", 0, ""), &resp, true); err != nil {
		return fmt.Errorf("ping: %w", err)
	}
	return nil
}
