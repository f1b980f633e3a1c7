package testenv

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// ClusterOptions shapes an EtcdCluster. The zero value is three members on
// free loopback ports of the test's own network namespace.
type ClusterOptions struct {
	// Size is the number of members; 3 if zero.
	Size int
	// Netns is the name (as in `ip netns list`) of a network namespace the
	// test made, in which every member runs. It needs Addrs.
	Netns string
	// Addrs are the members' addresses, one per member, each serving
	// clients on port 2379 and peers on 2380. Required with Netns (the
	// addresses must be configured in it); without Netns they must be
	// loopback addresses of the test's namespace. Empty: 127.0.0.1 with
	// free ports.
	Addrs []netip.Addr
	// Dial reaches a member's client port from the test process, for the
	// health probes and Leader (a member in Netns is not reachable with a
	// plain dialer). Nil: a plain dialer.
	Dial func(ctx context.Context, network, addr string) (net.Conn, error)
}

// EtcdCluster is a multi-member etcd cluster of a test: one *Etcd per
// member, each its own process and data directory, stopped and started on
// its own.
type EtcdCluster struct {
	members []*Etcd
}

// StartEtcdCluster starts every member of a new cluster at once (a member
// cannot serve before a quorum is up), waits until each reports healthy
// (bounded by the start timeout), and registers a cleanup that kills them.
// It fails tb (never skips) if /usr/bin/etcd is missing or a member does
// not come up.
func StartEtcdCluster(tb testing.TB, opt ClusterOptions) *EtcdCluster {
	tb.Helper()
	if _, err := os.Stat(EtcdBinary); err != nil {
		tb.Fatalf("testenv: %s not found (%v): run scripts/install-deps.sh as root", EtcdBinary, err)
	}
	n := opt.Size
	if n == 0 {
		n = 3
	}
	if n < 1 || (len(opt.Addrs) != 0 && len(opt.Addrs) != n) {
		tb.Fatalf("testenv: cluster of %d members with %d addresses", n, len(opt.Addrs))
	}
	if opt.Netns != "" && len(opt.Addrs) == 0 {
		tb.Fatalf("testenv: a cluster in netns %s needs its members' addresses", opt.Netns)
	}
	c := &EtcdCluster{}
	var peers []string
	for i := range n {
		e := &Etcd{
			tb:      tb,
			dataDir: filepath.Join(memDir(tb), "data"),
			logPath: filepath.Join(tb.TempDir(), "etcd.log"),
			name:    "m" + strconv.Itoa(i),
			netns:   opt.Netns,
			dial:    opt.Dial,
		}
		if len(opt.Addrs) != 0 {
			host := opt.Addrs[i].String()
			if opt.Addrs[i].Is6() {
				host = "[" + host + "]"
			}
			e.client, e.peer = "http://"+host+":2379", "http://"+host+":2380"
		} else {
			// Ports taken between probing and binding make that member
			// fail to start; the whole start then fails (no retry: the
			// other members already know this member's peer URL).
			cp, pp, err := freePorts()
			if err != nil {
				tb.Fatalf("testenv: %v", err)
			}
			e.client = "http://127.0.0.1:" + strconv.Itoa(cp)
			e.peer = "http://127.0.0.1:" + strconv.Itoa(pp)
		}
		tb.Cleanup(e.Close)
		peers = append(peers, e.name+"="+e.peer)
		c.members = append(c.members, e)
	}
	for _, e := range c.members {
		e.cluster = strings.Join(peers, ",")
	}
	exits := make([]<-chan struct{}, n)
	for i, e := range c.members {
		var err error
		if exits[i], err = e.spawn(); err != nil {
			tb.Fatalf("testenv: etcd member %s: %v", e.name, err)
		}
	}
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i, e := range c.members {
		wg.Go(func() { errs[i] = e.waitStarted(exits[i]) })
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			tb.Fatalf("testenv: etcd member %s did not start: %v", c.members[i].name, err)
		}
	}
	return c
}

// Members returns the members, in the order of ClusterOptions.Addrs.
func (c *EtcdCluster) Members() []*Etcd { return c.members }

// Endpoints returns every member's client URL, for clientv3.Config.Endpoints
// (or a CNI store configuration).
func (c *EtcdCluster) Endpoints() []string {
	var out []string
	for _, e := range c.members {
		out = append(out, e.client)
	}
	return out
}

// MemberStatus is what one member's status API says.
type MemberStatus struct {
	ID     uint64 // the member's own ID
	Leader uint64 // the leader it knows; 0 when it knows none
	Term   uint64 // raft term
}

// Status asks the member's status API (the gRPC gateway's
// /v3/maintenance/status) within ctx.
func (e *Etcd) Status(ctx context.Context) (MemberStatus, error) {
	hc := e.httpClient(2 * time.Second)
	defer hc.CloseIdleConnections()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, e.client+"/v3/maintenance/status", strings.NewReader("{}"))
	if err != nil {
		return MemberStatus{}, err
	}
	resp, err := hc.Do(req)
	if err != nil {
		return MemberStatus{}, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	if err != nil {
		return MemberStatus{}, err
	}
	if resp.StatusCode != http.StatusOK {
		return MemberStatus{}, fmt.Errorf("status of %s: %s %s", e.name, resp.Status, body)
	}
	// The gateway renders 64-bit integers as JSON strings.
	var st struct {
		Header struct {
			MemberID string `json:"member_id"`
		} `json:"header"`
		Leader    string `json:"leader"`
		RaftTerm  string `json:"raftTerm"`
		RaftTerm2 string `json:"raft_term"`
	}
	if err := json.Unmarshal(body, &st); err != nil {
		return MemberStatus{}, fmt.Errorf("status of %s: %w: %s", e.name, err, body)
	}
	var out MemberStatus
	if out.ID, err = strconv.ParseUint(st.Header.MemberID, 10, 64); err != nil {
		return MemberStatus{}, fmt.Errorf("status of %s: member id %q: %w", e.name, st.Header.MemberID, err)
	}
	if st.Leader != "" {
		if out.Leader, err = strconv.ParseUint(st.Leader, 10, 64); err != nil {
			return MemberStatus{}, fmt.Errorf("status of %s: leader %q: %w", e.name, st.Leader, err)
		}
	}
	term := st.RaftTerm
	if term == "" {
		term = st.RaftTerm2
	}
	if term != "" {
		out.Term, _ = strconv.ParseUint(term, 10, 64)
	}
	return out, nil
}

// Leader asks the running members' status API which member leads and
// returns its index in Members, with the leader's ID. It fails when no
// running member answers, when they name no leader, or when the leader
// they name is not among the members that answered.
func (c *EtcdCluster) Leader(ctx context.Context) (int, uint64, error) {
	ids := map[uint64]int{}
	var leader uint64
	var errs []string
	for i, e := range c.members {
		if !e.Running() {
			continue
		}
		st, err := e.Status(ctx)
		if err != nil {
			errs = append(errs, err.Error())
			continue
		}
		ids[st.ID] = i
		if st.Leader != 0 {
			leader = st.Leader
		}
	}
	if leader == 0 {
		return -1, 0, fmt.Errorf("no member names a leader (%s)", strings.Join(errs, "; "))
	}
	i, ok := ids[leader]
	if !ok {
		return -1, leader, fmt.Errorf("leader %x is not among the members that answered (%s)", leader, strings.Join(errs, "; "))
	}
	return i, leader, nil
}
