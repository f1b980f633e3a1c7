package watchcache

import (
	"errors"
	"strconv"
	"testing"
)

func intCache() *Cache[int] {
	return New(Config[int]{Prefix: "n/", Decode: func(_ string, v []byte) (int, error) {
		n, err := strconv.Atoi(string(v))
		return n / 10, err // tens only: 11 and 12 are the same to readers
	}, Equal: func(x, y int) bool { return x == y }})
}

func signalled(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// Replace sets the copy, keeps keys of its prefix only, signals every
// subscriber once per change (coalesced), and nothing when nothing changed
// for readers (Equal); a value that does not decode is kept with its error.
func TestReplace(t *testing.T) {
	c := intCache()
	s1, s2 := c.Subscribe(), c.Subscribe()
	select {
	case <-c.Synced():
		t.Fatal("synced before any listing")
	default:
	}
	if !c.Replace([]RawKV{{Key: "n/a", Value: []byte("11"), ModRevision: 3}, {Key: "x/other", Value: []byte("1")}}, 7) {
		t.Fatal("first listing: no change")
	}
	<-c.Synced()
	if !signalled(s1) || !signalled(s2) || signalled(s1) {
		t.Fatal("each subscriber is signalled once")
	}
	snap := c.Snapshot()
	if snap.Revision != 7 || len(snap.Entries) != 1 || snap.Entries["n/a"].Value != 1 || !snap.Synced {
		t.Fatalf("snapshot %+v", snap)
	}
	// 12 is 1 to readers: no change, no signal.
	if c.Replace([]RawKV{{Key: "n/a", Value: []byte("12"), ModRevision: 9}}, 9) || signalled(s1) {
		t.Fatal("an equal value counted as a change")
	}
	if c.Revision() != 9 {
		t.Fatalf("revision %d, want 9", c.Revision())
	}
	if !c.Replace([]RawKV{{Key: "n/a", Value: []byte("12")}, {Key: "n/b", Value: []byte("x"), ModRevision: 10}}, 10) || !signalled(s1) {
		t.Fatal("a new key is a change")
	}
	e, ok := c.Get("n/b")
	if !ok || e.Err == nil || !errors.Is(e.Err, strconv.ErrSyntax) {
		t.Fatalf("undecodable value: %+v", e)
	}
	// The caller owns its snapshot.
	snap.Entries["n/z"] = Entry[int]{}
	if c.Len() != 2 {
		t.Fatalf("a snapshot's change reached the cache: %d keys", c.Len())
	}
	if !c.Replace(nil, 11) || c.Len() != 0 {
		t.Fatal("an empty listing empties the cache")
	}
}

// Run needs a client.
func TestRunWithoutClient(t *testing.T) {
	if err := intCache().Run(t.Context()); err == nil {
		t.Fatal("Run without a client")
	}
}

// Generation moves with every change readers see, and only then: not
// with a revision that moved (a progress notification, an equal value).
func TestGeneration(t *testing.T) {
	c := intCache()
	g0 := c.Generation()
	c.Replace([]RawKV{{Key: "n/a", Value: []byte("11"), ModRevision: 3}}, 3)
	g1 := c.Generation()
	if g1 == g0 {
		t.Fatal("the first listing did not move the generation")
	}
	c.Replace([]RawKV{{Key: "n/a", Value: []byte("12"), ModRevision: 5}}, 8) // 12 is 1 to readers
	if c.Generation() != g1 || c.Revision() != 8 {
		t.Fatalf("an equal value moved the generation (%d, was %d) or not the revision (%d)", c.Generation(), g1, c.Revision())
	}
	c.Replace([]RawKV{{Key: "n/a", Value: []byte("12")}, {Key: "n/b", Value: []byte("20"), ModRevision: 9}}, 9)
	g2 := c.Generation()
	if g2 == g1 {
		t.Fatal("a new key did not move the generation")
	}
	c.Replace([]RawKV{{Key: "n/b", Value: []byte("20"), ModRevision: 9}}, 10)
	if c.Generation() == g2 {
		t.Fatal("a removed key did not move the generation")
	}
}
