// Package etcd is the multi-host store.Store on an etcd v3 cluster, through
// go.etcd.io/etcd/client/v3.
//
// Contract:
//
//   - Keys: every key is stored under Config.Prefix (default "/ringipam/"),
//     which callers never see. Several installations can share one cluster
//     with different prefixes.
//   - Get reads all keys in one transaction (one round trip, one revision);
//     Scan is a sorted range read, paged at one revision when large;
//     Commit is one transaction whose conditions are Version(k) = 0 for
//     "absent", ModRevision(k) = rev otherwise, and Version = 0 over the
//     range [k, end) for a range condition (etcd compares each key of the
//     range; an empty range passes). A failed condition writes
//     nothing and returns an error wrapping store.ErrConflict. CommitOrGet
//     (store.Speculator) adds Value(k) = v conditions, reads the keys
//     asked in the transaction's failure branch, and on success returns
//     the response header's revision (the written keys' ModRevision).
//   - Revisions are etcd's ModRevision: they only grow, and all keys of one
//     commit share one.
//   - Timeouts: New does not block on the network (the client dials lazily),
//     except with Username set: clientv3 then authenticates in New, within
//     DialTimeout, and wrong credentials fail New with an error naming the
//     user.
//     Every call runs under RequestTimeout (or the caller's earlier deadline),
//     so an unreachable cluster costs at most that long; a Scan of more than
//     one page gives each page its own RequestTimeout, since etcd 3.4 reads
//     the whole rest of the range for every page (a scan of n keys costs it
//     about n²/2000 index visits), so a large store's whole scan can take
//     longer than one request should.
//   - Errors: an unreachable cluster, a missing leader or a timeout returns an
//     error wrapping store.ErrUnavailable that lists the endpoints; a caller's
//     cancellation returns an error wrapping context.Canceled; oversized
//     transactions wrap store.ErrTooLarge.
//   - A Store is safe for concurrent use by many goroutines; it holds one
//     client connection until Close. The zero value is not usable: call New.
package etcd

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/storeconfig"
)

// Defaults applied by New to zero Config fields.
const (
	DefaultPrefix         = storeconfig.DefaultEtcdPrefix
	DefaultDialTimeout    = 5 * time.Second
	DefaultRequestTimeout = 10 * time.Second
)

// scanPage is the page size of a large Scan; pages after the first are read
// at the first page's revision, so the result is one consistent snapshot.
const scanPage = 1000

// TLS names the PEM files for a TLS connection. CAFile verifies the server
// (system roots if empty); CertFile and KeyFile, both or neither, are the
// client certificate.
type TLS struct {
	CAFile   string
	CertFile string
	KeyFile  string
}

func (t *TLS) set() bool { return t != nil && (t.CAFile != "" || t.CertFile != "" || t.KeyFile != "") }

// Config configures an etcd store.
type Config struct {
	Endpoints      []string // required: "https://10.0.0.1:2379", "127.0.0.1:2379", ...
	Prefix         string   // key prefix; DefaultPrefix if empty
	TLS            *TLS     // nil: plain text unless an endpoint is https://
	Username       string   // optional etcd user
	Password       string
	DialTimeout    time.Duration // DefaultDialTimeout if zero
	RequestTimeout time.Duration // per call; DefaultRequestTimeout if zero
}

// Store is a store.Store on etcd. See the package doc.
type Store struct {
	cli       *clientv3.Client
	prefix    string
	timeout   time.Duration
	endpoints string
	cfg       Config // as given, defaults applied; for Ping's TLS diagnosis
	tls       bool   // the client speaks TLS to at least one endpoint
}

var _ store.Store = (*Store)(nil)

// New validates cfg, applies defaults and creates the client. It does not
// wait for the cluster (unless Username is set).
func New(cfg Config) (*Store, error) {
	if len(cfg.Endpoints) == 0 {
		return nil, errors.New("etcd store: no endpoints")
	}
	for _, e := range cfg.Endpoints {
		if strings.TrimSpace(e) == "" {
			return nil, errors.New("etcd store: empty endpoint")
		}
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
	if cfg.DialTimeout < 0 || cfg.RequestTimeout < 0 {
		return nil, errors.New("etcd store: negative timeout")
	}
	eps := strings.Join(cfg.Endpoints, ",")
	ccfg := clientv3.Config{
		Endpoints:            cfg.Endpoints,
		DialTimeout:          cfg.DialTimeout,
		DialKeepAliveTime:    10 * time.Second,
		DialKeepAliveTimeout: cfg.DialTimeout,
		Username:             cfg.Username,
		Password:             cfg.Password,
		// The CNI plugin's stdout/stderr belong to the runtime: errors are
		// returned, never logged by the client.
		Logger: zap.NewNop(),
	}
	https := false
	for _, e := range cfg.Endpoints {
		if strings.HasPrefix(e, "https://") {
			https = true
		}
	}
	if cfg.TLS.set() || https {
		tc, err := tlsConfig(cfg.TLS)
		if err != nil {
			return nil, fmt.Errorf("etcd store %s: %w", eps, err)
		}
		ccfg.TLS = tc
	}
	cli, err := clientv3.New(ccfg)
	if errors.Is(err, rpctypes.ErrAuthFailed) {
		return nil, fmt.Errorf("etcd store %s: authentication as user %q refused: check the username and password: %w", eps, cfg.Username, err)
	}
	if err != nil {
		return nil, classify(context.Background(), eps, fmt.Errorf("connect: %w", err))
	}
	return &Store{cli: cli, prefix: cfg.Prefix, timeout: cfg.RequestTimeout, endpoints: eps, cfg: cfg, tls: ccfg.TLS != nil}, nil
}

// tlsConfig is the TLS client configuration of t (nil: the system's roots,
// no client certificate): TLS 1.2 or later, the servers verified against
// the CA bundle and by name (the client sets the name per endpoint), the
// client certificate presented when one is named. The files are read here.
func tlsConfig(t *TLS) (*tls.Config, error) {
	tc := &tls.Config{MinVersion: tls.VersionTLS12}
	if t == nil {
		return tc, nil
	}
	if (t.CertFile == "") != (t.KeyFile == "") {
		return nil, errors.New("tls: cert and key must be given together")
	}
	if t.CertFile != "" {
		pair, err := tls.LoadX509KeyPair(t.CertFile, t.KeyFile)
		if err != nil {
			return nil, fmt.Errorf("tls: client certificate %s / key %s: %w", t.CertFile, t.KeyFile, err)
		}
		tc.Certificates = []tls.Certificate{pair}
	}
	if t.CAFile != "" {
		pem, err := os.ReadFile(t.CAFile)
		if err != nil {
			return nil, fmt.Errorf("tls: CA: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("tls: CA %s: no PEM certificate found", t.CAFile)
		}
		tc.RootCAs = pool
	}
	return tc, nil
}

// Client returns the underlying etcd client, for components that need more
// than the store contract (leases, watches). The Store still owns it.
func (s *Store) Client() *clientv3.Client { return s.cli }

// Prefix returns the key prefix in use.
func (s *Store) Prefix() string { return s.prefix }

// Get implements store.Store.
func (s *Store) Get(ctx context.Context, keys ...string) ([]store.KV, error) {
	out, done, err := store.StartGet(ctx, keys)
	if done {
		return out, err
	}
	ctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	var rev int64
	for start := 0; start < len(keys); start += store.MaxOps {
		end := min(start+store.MaxOps, len(keys))
		gets := make([]clientv3.Op, 0, end-start)
		for _, k := range keys[start:end] {
			var opts []clientv3.OpOption
			if rev != 0 {
				opts = append(opts, clientv3.WithRev(rev))
			}
			gets = append(gets, clientv3.OpGet(s.prefix+k, opts...))
		}
		resp, err := s.cli.Txn(ctx).Then(gets...).Commit()
		if err != nil {
			return nil, classify(ctx, s.endpoints, fmt.Errorf("get: %w", err))
		}
		if rev == 0 {
			rev = resp.Header.Revision
		}
		for i, r := range resp.Responses {
			rr := r.GetResponseRange()
			if rr == nil || len(rr.Kvs) == 0 {
				continue
			}
			kv := rr.Kvs[0]
			out[start+i].Value, out[start+i].Revision = kv.Value, kv.ModRevision
		}
	}
	return out, nil
}

// Scan implements store.Store.
func (s *Store) Scan(ctx context.Context, from, to string, limit int) ([]store.KV, error) {
	if to <= from {
		return nil, ctx.Err() // an empty range: nothing to read
	}
	var out []store.KV
	var rev int64
	key, end := s.prefix+from, s.prefix+to
	for {
		page := scanPage
		if limit > 0 && limit-len(out) < page {
			page = limit - len(out)
		}
		// No WithSort: a range comes back in key order already, and etcd
		// 3.4 answers any explicit sort by reading the whole range for
		// every page (the limit applies after sorting), which made a scan
		// of a large store quadratic.
		opts := []clientv3.OpOption{
			clientv3.WithRange(end),
			clientv3.WithLimit(int64(page)),
		}
		if rev != 0 {
			opts = append(opts, clientv3.WithRev(rev))
		}
		pctx, cancel := context.WithTimeout(ctx, s.timeout)
		resp, err := s.cli.Get(pctx, key, opts...)
		if err != nil {
			err = classify(pctx, s.endpoints, fmt.Errorf("scan: %w", err))
			cancel()
			return nil, err
		}
		cancel()
		if rev == 0 {
			rev = resp.Header.Revision
		}
		for _, kv := range resp.Kvs {
			out = append(out, store.KV{Key: string(kv.Key[len(s.prefix):]), Value: kv.Value, Revision: kv.ModRevision})
		}
		if !resp.More || len(resp.Kvs) == 0 || (limit > 0 && len(out) >= limit) {
			return out, nil
		}
		key = string(resp.Kvs[len(resp.Kvs)-1].Key) + "\x00"
	}
}

// Commit implements store.Store.
func (s *Store) Commit(ctx context.Context, conds []store.Cond, ops []store.Op) error {
	if err := store.CheckCommit(conds, ops); err != nil {
		return fmt.Errorf("etcd store: %w", err)
	}
	ctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	resp, err := s.cli.Txn(ctx).If(s.compares(conds, nil)...).Then(s.writes(ops)...).Commit()
	if err != nil {
		return classify(ctx, s.endpoints, fmt.Errorf("commit: %w", err))
	}
	if !resp.Succeeded {
		return fmt.Errorf("%w (etcd revision %d)", store.ErrConflict, resp.Header.Revision)
	}
	return nil
}

// CommitOrGet implements store.Speculator: one transaction whose failure
// branch reads the keys of read. The revision of a commit is its
// response's header revision (etcd's store revision after the
// transaction, the ModRevision of every key it wrote).
func (s *Store) CommitOrGet(ctx context.Context, conds []store.Cond, same []store.KV, ops []store.Op, read []string) (int64, []store.KV, error) {
	if err := store.CheckSpeculation(conds, same, ops, read); err != nil {
		return 0, nil, fmt.Errorf("etcd store: %w", err)
	}
	out, _, _ := store.StartGet(ctx, read)
	gets := make([]clientv3.Op, 0, len(read))
	for _, k := range read {
		gets = append(gets, clientv3.OpGet(s.prefix+k))
	}
	ctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	resp, err := s.cli.Txn(ctx).If(s.compares(conds, same)...).Then(s.writes(ops)...).Else(gets...).Commit()
	if err != nil {
		return 0, nil, classify(ctx, s.endpoints, fmt.Errorf("commit: %w", err))
	}
	if resp.Succeeded {
		return resp.Header.Revision, nil, nil
	}
	for i, r := range resp.Responses {
		if rr := r.GetResponseRange(); i < len(out) && rr != nil && len(rr.Kvs) > 0 {
			out[i].Value, out[i].Revision = rr.Kvs[0].Value, rr.Kvs[0].ModRevision
		}
	}
	return 0, out, fmt.Errorf("%w (etcd revision %d)", store.ErrConflict, resp.Header.Revision)
}

// compares are a transaction's conditions: revisions (0: absent) and
// ranges without keys, then values (etcd fails a value comparison on an absent key, as the contract
// asks).
func (s *Store) compares(conds []store.Cond, same []store.KV) []clientv3.Cmp {
	cmps := make([]clientv3.Cmp, 0, len(conds)+len(same))
	for _, c := range conds {
		k := s.prefix + c.Key
		switch {
		case c.IsRange():
			// etcd compares every key of the range, and an empty range
			// passes a comparison of its version with 0.
			cmps = append(cmps, clientv3.Compare(clientv3.Version(k).WithRange(s.prefix+c.End), "=", 0))
		case c.Revision == 0:
			cmps = append(cmps, clientv3.Compare(clientv3.Version(k), "=", 0))
		default:
			cmps = append(cmps, clientv3.Compare(clientv3.ModRevision(k), "=", c.Revision))
		}
	}
	for _, kv := range same {
		cmps = append(cmps, clientv3.Compare(clientv3.Value(s.prefix+kv.Key), "=", string(kv.Value)))
	}
	return cmps
}

func (s *Store) writes(ops []store.Op) []clientv3.Op {
	writes := make([]clientv3.Op, 0, len(ops))
	for _, o := range ops {
		if o.Delete {
			writes = append(writes, clientv3.OpDelete(s.prefix+o.Key))
		} else {
			writes = append(writes, clientv3.OpPut(s.prefix+o.Key, string(o.Value)))
		}
	}
	return writes
}

// Ping checks that the cluster answers a linearizable read (so it has a
// leader and a quorum) within the request timeout.
//
// The etcd client reports every TLS failure as a bare timeout, so when TLS
// is in use and the server cannot be reached, Ping adds what CheckTLS finds
// (wrong CA, missing or refused client certificate, ...). That costs a
// handshake per endpoint, on the failure path only.
func (s *Store) Ping(ctx context.Context) error {
	pctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	_, err := s.cli.Get(pctx, s.prefix, clientv3.WithCountOnly())
	if err == nil {
		return nil
	}
	err = classify(pctx, s.endpoints, fmt.Errorf("ping: %w", err))
	if s.tls && errors.Is(err, store.ErrUnavailable) {
		cctx, ccancel := context.WithTimeout(context.WithoutCancel(ctx), s.cfg.DialTimeout+time.Second)
		defer ccancel()
		if terr := CheckTLS(cctx, s.cfg); terr != nil {
			return fmt.Errorf("%w; TLS check: %w", err, terr)
		}
	}
	return err
}

// Close implements store.Store: it closes the client connection.
func (s *Store) Close() error {
	if err := s.cli.Close(); err != nil && !errors.Is(err, context.Canceled) {
		return fmt.Errorf("etcd store %s: close: %w", s.endpoints, err)
	}
	return nil
}

// classify wraps err with the store's sentinels: unreachable, timed out
// (on either side: ctx's deadline, or the server's under the deadline the
// client sent) or leaderless clusters become store.ErrUnavailable; too many operations or too
// large a request become store.ErrTooLarge; a caller's cancellation stays a
// context.Canceled error.
func classify(ctx context.Context, endpoints string, err error) error {
	if errors.Is(err, context.Canceled) || (ctx.Err() != nil && errors.Is(ctx.Err(), context.Canceled)) {
		return fmt.Errorf("etcd store %s: %w", endpoints, err)
	}
	code := codes.Unknown
	msg := ""
	var ee rpctypes.EtcdError
	if errors.As(err, &ee) {
		code = ee.Code()
	} else if st, ok := status.FromError(err); ok {
		code, msg = st.Code(), st.Message()
	}
	// The server runs a request under the deadline the client sends along;
	// when that passes inside the server, the answer is an Unknown status
	// whose message is the context error, which can arrive just before the
	// client's own deadline fires (found by integration/chaos).
	serverTimedOut := code == codes.Unknown && strings.Contains(msg, context.DeadlineExceeded.Error())
	switch {
	case errors.Is(err, rpctypes.ErrPermissionDenied):
		return fmt.Errorf("etcd store %s: %w (the etcd user needs a role granting readwrite on the key prefix)", endpoints, err)
	case errors.Is(err, rpctypes.ErrTooManyOps), errors.Is(err, rpctypes.ErrRequestTooLarge):
		return fmt.Errorf("%w: etcd store %s: %w", store.ErrTooLarge, endpoints, err)
	case errors.Is(err, context.DeadlineExceeded), errors.Is(ctx.Err(), context.DeadlineExceeded), serverTimedOut,
		code == codes.Unavailable, code == codes.DeadlineExceeded, code == codes.ResourceExhausted:
		return fmt.Errorf("%w: etcd at %s not reachable or without leader: %w", store.ErrUnavailable, endpoints, err)
	default:
		return fmt.Errorf("etcd store %s: %w", endpoints, err)
	}
}
