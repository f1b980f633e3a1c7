// Package watchcache keeps an in-memory copy of the keys under one etcd key
// prefix, the way client-go's informers keep one of a resource: list once,
// then watch from the listed revision and apply each event, so that a
// reader never reads the store to learn what changed.
//
// Contract:
//
//   - Run lists the prefix once (one Range, its revision R), then watches
//     it from R+1 (clientv3.WithRequireLeader, with progress notifications)
//     and applies every PUT and DELETE to the copy. Nothing else reads the
//     store.
//   - A watch that breaks (the member lost its leader, a network failure
//     the client could not hide, the server cancelled it) is opened again
//     from the last revision the copy holds: no event is lost and nothing
//     is read again. Only when that revision is compacted (ErrCompacted)
//     is the prefix listed again, and the copy replaced by the list. Every
//     wait between attempts backs off exponentially with jitter, within
//     MinBackoff and MaxBackoff, and every List has a deadline (Timeout).
//   - Each value is decoded once, when it arrives (Decode); a value that
//     does not decode is kept as an Entry with Err set, so readers see it
//     rather than a silently missing key. With Equal set, an event whose
//     decoded value equals the cached one changes nothing and wakes no one
//     (a record rewritten with fields the reader ignores).
//   - Subscribe returns a channel with a buffer of one that receives a
//     signal after every change of the copy (coalesced: several changes
//     before the reader looks give one signal). Readers then take a
//     Snapshot: a consistent copy of the entries and the revision they
//     reflect.
//   - Replace sets the whole copy from a listing; Run uses it after each
//     List, and a caller without etcd (a local store, a unit test) feeds a
//     Cache with it from its own reads.
//   - A resync, as client-go's, is the reader's business: it replays its
//     decisions from the Snapshot, never from the store.
//
// Memory: one Entry (key, decoded value, revision) per key under the
// prefix, about the size of the stored value plus the key.
package watchcache

import (
	"context"
	"errors"
	"maps"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// Defaults of Config.
const (
	DefaultMinBackoff = 200 * time.Millisecond
	DefaultMaxBackoff = 30 * time.Second
	DefaultTimeout    = 20 * time.Second
)

// Entry is one cached key.
type Entry[T any] struct {
	// Key is the key without Config.Trim (the store's prefix).
	Key   string
	Value T
	// Err is Decode's error; Value is then the zero value.
	Err error
	// ModRevision is the revision of the write that set the value.
	ModRevision int64
}

// Snapshot is a consistent copy of the cache: every entry as of Revision.
// The caller owns it (the cache never changes it afterwards).
type Snapshot[T any] struct {
	Revision int64
	Entries  map[string]Entry[T]
	// Synced: the cache holds a listing (false before the first List).
	Synced bool
}

// RawKV is one key as listed (Replace's input): Key without the trimmed
// prefix.
type RawKV struct {
	Key         string
	Value       []byte
	ModRevision int64
}

// Config is what a Cache watches and how it decodes.
type Config[T any] struct {
	// Client is the etcd client Run uses (nil: only Replace feeds the
	// cache).
	Client *clientv3.Client
	// Trim is the store's key prefix: cached keys are the etcd keys
	// without it.
	Trim string
	// Prefix is the watched prefix, below Trim ("n/").
	Prefix string
	// Decode turns a stored value into the cached one (key without Trim).
	Decode func(key string, value []byte) (T, error)
	// Equal, when set, says two decoded values are the same to readers: a
	// PUT that does not change the decoded value wakes no subscriber.
	Equal func(x, y T) bool
	// MinBackoff and MaxBackoff bound the waits between attempts (0: the
	// defaults); Timeout is the deadline of each List.
	MinBackoff, MaxBackoff, Timeout time.Duration
	// Log, when set, is told of every List and broken watch.
	Log func(msg string, args ...any)
}

// Stats counts what the cache did, for tests and metrics.
type Stats struct {
	Lists    int64 // Lists (Range requests) made
	Watches  int64 // watches opened
	Events   int64 // events applied
	Compacts int64 // watches that found their revision compacted
}

// Cache is the copy of one prefix. Make it with New; feed it with Run (etcd)
// or Replace.
type Cache[T any] struct {
	cfg Config[T]

	mu      sync.RWMutex
	entries map[string]Entry[T]
	rev     int64
	synced  bool
	// gen counts the changes readers see (Generation).
	gen   uint64
	subs  []chan struct{}
	ready chan struct{} // closed at the first Replace

	lists, watches, events, compacts atomic.Int64
}

// New returns an empty cache of cfg.Prefix.
func New[T any](cfg Config[T]) *Cache[T] {
	if cfg.MinBackoff <= 0 {
		cfg.MinBackoff = DefaultMinBackoff
	}
	if cfg.MaxBackoff < cfg.MinBackoff {
		cfg.MaxBackoff = max(DefaultMaxBackoff, cfg.MinBackoff)
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = DefaultTimeout
	}
	return &Cache[T]{cfg: cfg, entries: map[string]Entry[T]{}, ready: make(chan struct{})}
}

// Prefix is the watched prefix (below the store's).
func (c *Cache[T]) Prefix() string { return c.cfg.Prefix }

// Subscribe returns a channel signalled (without blocking the cache) after
// every change of the copy, and after the first listing.
func (c *Cache[T]) Subscribe() <-chan struct{} {
	ch := make(chan struct{}, 1)
	c.mu.Lock()
	c.subs = append(c.subs, ch)
	c.mu.Unlock()
	return ch
}

// Synced is closed once the cache holds a listing.
func (c *Cache[T]) Synced() <-chan struct{} { return c.ready }

// Snapshot returns a copy of the entries and the revision they reflect.
func (c *Cache[T]) Snapshot() Snapshot[T] {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return Snapshot[T]{Revision: c.rev, Entries: maps.Clone(c.entries), Synced: c.synced}
}

// Get returns one cached entry.
func (c *Cache[T]) Get(key string) (Entry[T], bool) {
	c.mu.RLock()
	defer c.mu.RUnlock()
	e, ok := c.entries[key]
	return e, ok
}

// Len is how many keys the cache holds.
func (c *Cache[T]) Len() int {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return len(c.entries)
}

// Revision is the revision the copy reflects.
func (c *Cache[T]) Revision() int64 {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return c.rev
}

// Generation changes exactly when the copy changes for readers (an entry
// added, removed, or replaced by one that is not the same), not with a
// progress notification: a reader that derived something from a snapshot
// may keep it while the generation stays.
func (c *Cache[T]) Generation() uint64 {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return c.gen
}

// Stats returns the counters.
func (c *Cache[T]) Stats() Stats {
	return Stats{Lists: c.lists.Load(), Watches: c.watches.Load(), Events: c.events.Load(), Compacts: c.compacts.Load()}
}

func (c *Cache[T]) entry(key string, value []byte, rev int64) Entry[T] {
	e := Entry[T]{Key: key, ModRevision: rev}
	if c.cfg.Decode != nil {
		e.Value, e.Err = c.cfg.Decode(key, value)
	}
	return e
}

// same says whether a new entry changes nothing for readers.
func (c *Cache[T]) same(old, e Entry[T]) bool {
	if old.Err != nil || e.Err != nil {
		return old.ModRevision == e.ModRevision
	}
	if c.cfg.Equal != nil {
		return c.cfg.Equal(old.Value, e.Value)
	}
	return old.ModRevision == e.ModRevision
}

// Replace sets the copy to kvs as of revision rev (keys without the trimmed
// prefix; keys outside Prefix are ignored), and signals the subscribers
// when that changed anything or is the first listing. It reports whether
// anything changed.
func (c *Cache[T]) Replace(kvs []RawKV, rev int64) bool {
	next := make(map[string]Entry[T], len(kvs))
	for _, kv := range kvs {
		if !strings.HasPrefix(kv.Key, c.cfg.Prefix) {
			continue
		}
		next[kv.Key] = c.entry(kv.Key, kv.Value, kv.ModRevision)
	}
	c.mu.Lock()
	changed := !c.synced || len(next) != len(c.entries)
	for k, e := range next {
		if changed {
			break
		}
		old, ok := c.entries[k]
		changed = !ok || !c.same(old, e)
	}
	if changed {
		// Unchanged entries keep their old form: an Equal value does
		// not count as new.
		c.entries = next
		c.gen++
	}
	c.rev = max(c.rev, rev)
	first := !c.synced
	c.synced = true
	c.mu.Unlock()
	if first {
		close(c.ready)
	}
	if changed {
		c.kick()
	}
	return changed
}

// apply applies one watch response's events; it reports whether the copy
// changed for readers.
func (c *Cache[T]) apply(evs []*clientv3.Event, rev int64) bool {
	changed := false
	c.mu.Lock()
	for _, ev := range evs {
		key := strings.TrimPrefix(string(ev.Kv.Key), c.cfg.Trim)
		switch ev.Type {
		case mvccpb.PUT:
			e := c.entry(key, ev.Kv.Value, ev.Kv.ModRevision)
			old, ok := c.entries[key]
			c.entries[key] = e
			changed = changed || !ok || !c.same(old, e)
		case mvccpb.DELETE:
			if _, ok := c.entries[key]; ok {
				delete(c.entries, key)
				changed = true
			}
		}
		rev = max(rev, ev.Kv.ModRevision)
	}
	c.rev = max(c.rev, rev)
	if changed {
		c.gen++
	}
	c.mu.Unlock()
	c.events.Add(int64(len(evs)))
	if changed {
		c.kick()
	}
	return changed
}

func (c *Cache[T]) kick() {
	c.mu.RLock()
	defer c.mu.RUnlock()
	for _, ch := range c.subs {
		select {
		case ch <- struct{}{}:
		default:
		}
	}
}

func (c *Cache[T]) log(msg string, args ...any) {
	if c.cfg.Log != nil {
		c.cfg.Log(msg, append([]any{"prefix", c.cfg.Prefix}, args...)...)
	}
}

// errCompacted: the watch's start revision is compacted; list again.
var errCompacted = errors.New("watchcache: revision compacted")

// Run lists and watches until ctx ends (see the package doc); it returns
// ctx's error.
func (c *Cache[T]) Run(ctx context.Context) error {
	if c.cfg.Client == nil {
		return errors.New("watchcache: no etcd client")
	}
	backoff := c.cfg.MinBackoff
	wait := func() error {
		d := backoff/2 + rand.N(backoff/2+1)
		backoff = min(2*backoff, c.cfg.MaxBackoff)
		t := time.NewTimer(d)
		defer t.Stop()
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
			return nil
		}
	}
	list := true
	for ctx.Err() == nil {
		if list {
			if err := c.list(ctx); err != nil {
				if ctx.Err() == nil {
					c.log("watchcache: listing failed; trying again", "err", err)
				}
				if wait() != nil {
					break
				}
				continue
			}
			list = false
		}
		healthy, err := c.watch(ctx)
		if ctx.Err() != nil {
			break
		}
		if errors.Is(err, errCompacted) {
			c.compacts.Add(1)
			list = true
			c.log("watchcache: the watch's revision is compacted; listing again", "revision", c.Revision())
		} else {
			c.log("watchcache: the watch broke; watching again from the cached revision", "revision", c.Revision(), "err", err)
		}
		if healthy {
			backoff = c.cfg.MinBackoff
		}
		if wait() != nil {
			break
		}
	}
	return ctx.Err()
}

// list reads the whole prefix (one Range) and replaces the copy.
func (c *Cache[T]) list(ctx context.Context) error {
	lctx, cancel := context.WithTimeout(clientv3.WithRequireLeader(ctx), c.cfg.Timeout)
	defer cancel()
	c.lists.Add(1)
	resp, err := c.cfg.Client.Get(lctx, c.cfg.Trim+c.cfg.Prefix, clientv3.WithPrefix())
	if err != nil {
		return err
	}
	kvs := make([]RawKV, len(resp.Kvs))
	for i, kv := range resp.Kvs {
		kvs[i] = RawKV{Key: strings.TrimPrefix(string(kv.Key), c.cfg.Trim), Value: kv.Value, ModRevision: kv.ModRevision}
	}
	c.Replace(kvs, resp.Header.Revision)
	return nil
}

// watch follows the prefix from the cached revision until the watch ends;
// healthy reports whether it delivered anything (the backoff starts over).
func (c *Cache[T]) watch(ctx context.Context) (healthy bool, err error) {
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer cancel()
	c.watches.Add(1)
	from := c.Revision() + 1
	ch := c.cfg.Client.Watch(wctx, c.cfg.Trim+c.cfg.Prefix, clientv3.WithPrefix(), clientv3.WithRev(from), clientv3.WithProgressNotify())
	for resp := range ch {
		if resp.CompactRevision != 0 || errors.Is(resp.Err(), rpctypes.ErrCompacted) {
			return healthy, errCompacted
		}
		if err := resp.Err(); err != nil {
			return healthy, err
		}
		healthy = true
		if resp.IsProgressNotify() {
			c.mu.Lock()
			c.rev = max(c.rev, resp.Header.Revision)
			c.mu.Unlock()
			continue
		}
		c.apply(resp.Events, 0)
	}
	if err := ctx.Err(); err != nil {
		return healthy, err
	}
	return healthy, errors.New("watchcache: the watch channel closed")
}
