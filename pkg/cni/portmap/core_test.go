package portmap

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"

	"github.com/ringipam/ringipam/pkg/hostlock"
	"github.com/ringipam/ringipam/pkg/portalloc"
	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/memory"
)

// fakeDataplane keeps forwards in a map; failAdd makes Add fail after
// installing (as a half-applied setup would).
type fakeDataplane struct {
	mu      sync.Mutex
	marks   map[string][]Rule
	failAdd error
	removed []string
}

func newFake() *fakeDataplane { return &fakeDataplane{marks: map[string][]Rule{}} }

func (f *fakeDataplane) Add(_ context.Context, mark string, rules []Rule) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.marks[mark] = append(f.marks[mark], rules...)
	return f.failAdd
}

func (f *fakeDataplane) Remove(_ context.Context, mark string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.marks, mark)
	f.removed = append(f.removed, mark)
	return nil
}

func (f *fakeDataplane) Marks(context.Context) (map[string][]Rule, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return maps.Clone(f.marks), nil
}

// world is one host's plugin over a shared memory store.
type world struct {
	st  store.Store
	dp  *fakeDataplane
	out bytes.Buffer
	log bytes.Buffer
}

// testLocks keeps the attachments' locks of the tests out of the host's
// directory.
var testLocks = hostlock.Dir(filepath.Join(os.TempDir(), "ringipam-portmap-test-locks"))

func newWorld(st store.Store) *world { return &world{st: st, dp: newFake()} }

func (w *world) edge() Edge {
	return Edge{Stdout: &w.out, Stderr: &w.log, Locks: testLocks, Open: func(_ context.Context, c *Config) (Opened, error) {
		a, err := portalloc.New(w.st, c.Host, portalloc.WithDynamicRange(c.Lo, c.Hi))
		if err != nil {
			return Opened{}, err
		}
		return Opened{Ports: a, Dataplane: w.dp, Ping: func(ctx context.Context) error { return store.Ping(ctx, w.st) }, Close: func() error { return nil }}, nil
	}}
}

const prevResult = `{"cniVersion":"1.1.0","interfaces":[{"name":"cni0"},{"name":"veth1"},{"name":"eth0","sandbox":"/var/run/netns/x"}],
 "ips":[{"address":"198.18.131.5/24","interface":2},{"address":"fd00::5/64","interface":2}]}`

// conf is a network configuration with mappings (JSON) for host.
func conf(host, mappings string, extra string) []byte {
	return []byte(fmt.Sprintf(`{"cniVersion":"1.1.0","name":"web","type":"portmap-ingress","host":%q,"dynamicRange":"30000-30009"%s,
	 "runtimeConfig":{"portMappings":[%s]},"prevResult":%s}`, host, extra, mappings, prevResult))
}

func args(id string, stdin []byte) *skel.CmdArgs {
	return &skel.CmdArgs{ContainerID: id, IfName: "eth0", Netns: "/var/run/netns/x", StdinData: stdin}
}

func code(err error) uint {
	var te *types.Error
	if errors.As(err, &te) {
		return te.Code
	}
	return 0
}

func TestAddDelThroughTheEdge(t *testing.T) {
	w := newWorld(memory.New())
	e := w.edge()
	stdin := conf("h1", `{"hostPort":8080,"containerPort":80},{"hostPort":0,"containerPort":53,"protocol":"udp","mode":"ingress"}`, "")
	if err := e.Add(args("c1", stdin)); err != nil {
		t.Fatal(err)
	}
	// prevResult passed on, with the chosen ports beside it; the dynamic
	// one is the port the log names.
	var res struct {
		IPs          []any           `json:"ips"`
		Interfaces   []any           `json:"interfaces"`
		PortMappings []ResultMapping `json:"portMappings"`
	}
	if err := json.Unmarshal(w.out.Bytes(), &res); err != nil || len(res.IPs) != 2 || len(res.Interfaces) != 3 {
		t.Fatalf("result %s: %v", w.out.String(), err)
	}
	if len(res.PortMappings) != 2 ||
		res.PortMappings[0] != (ResultMapping{HostPort: 8080, ContainerPort: 80, Protocol: "tcp", Mode: "host"}) ||
		res.PortMappings[1].ContainerPort != 53 || res.PortMappings[1].Protocol != "udp" || res.PortMappings[1].Mode != "ingress" ||
		res.PortMappings[1].HostPort < 30000 || res.PortMappings[1].HostPort > 30009 ||
		!strings.Contains(w.log.String(), fmt.Sprintf("ingress udp %d->53", res.PortMappings[1].HostPort)) {
		t.Fatalf("portMappings in the result: %+v (log %s)", res.PortMappings, w.log.String())
	}
	// A runtime decoding the result into the CNI types still can.
	if _, err := current.NewResult(w.out.Bytes()); err != nil {
		t.Fatalf("the result is no CNI result: %v", err)
	}
	if !strings.Contains(w.log.String(), "published host tcp 8080->80, ingress udp 3000") {
		t.Fatalf("log: %s", w.log.String())
	}
	mark := Mark(portalloc.EndpointID{Network: "web", ContainerID: "c1", IfName: "eth0"})
	rules := w.dp.marks[mark]
	if len(rules) != 4 { // two ports x two container addresses
		t.Fatalf("rules %v", rules)
	}
	if err := e.Check(args("c1", stdin)); err != nil {
		t.Fatalf("CHECK: %v", err)
	}
	// A second attachment asking for the taken host port: 100, naming it.
	err := e.Add(args("c2", conf("h1", `{"hostPort":8080,"containerPort":80}`, "")))
	if code(err) != CodeInUse || !strings.Contains(err.Error(), "port/web/c1/eth0") || !strings.Contains(err.Error(), "host h1") {
		t.Fatalf("taken port: %v", err)
	}
	// DEL without mappings nor prevResult releases everything.
	if err := e.Del(args("c1", []byte(`{"cniVersion":"1.1.0","name":"web","type":"portmap-ingress","host":"h1"}`))); err != nil {
		t.Fatal(err)
	}
	if len(w.dp.marks) != 0 {
		t.Fatalf("forwards left after DEL: %v", w.dp.marks)
	}
	if err := e.Add(args("c2", conf("h1", `{"hostPort":8080,"containerPort":80}`, ""))); err != nil {
		t.Fatalf("8080 after DEL: %v", err)
	}
	// DEL again, and DEL of an attachment that never published: success.
	for _, id := range []string{"c1", "c9"} {
		if err := e.Del(args(id, conf("h1", "", ""))); err != nil {
			t.Fatalf("DEL %s: %v", id, err)
		}
	}
}

func TestErrorsMapToCodes(t *testing.T) {
	w := newWorld(memory.New())
	e := w.edge()
	for _, tc := range []struct {
		name     string
		mappings string
		extra    string
		code     uint
	}{
		{"duplicate", `{"hostPort":8080,"containerPort":80},{"hostPort":8080,"containerPort":81}`, "", CodeDuplicate},
		{"exhausted", strings.Repeat(`{"hostPort":0,"containerPort":80,"protocol":"sctp"},`, 10) + `{"hostPort":0,"containerPort":80,"protocol":"sctp"}`, "", CodeExhausted},
		{"bad mapping", `{"hostPort":8080}`, "", types.ErrInvalidNetworkConfig},
		{"ingress with a host IP", `{"hostPort":8080,"containerPort":80,"hostIP":"198.18.0.1","mode":"ingress"}`, "", types.ErrInvalidNetworkConfig},
		{"host IP of a family the container lacks", `{"hostPort":8080,"containerPort":80,"hostIP":"2001:db8::1"}`, `,"prevResult":{"cniVersion":"1.1.0","ips":[{"address":"198.18.131.5/24"}]}`, types.ErrInvalidNetworkConfig},
	} {
		t.Run(tc.name, func(t *testing.T) {
			stdin := conf("h1", tc.mappings, "")
			if tc.extra != "" {
				stdin = []byte(fmt.Sprintf(`{"cniVersion":"1.1.0","name":"web","type":"portmap-ingress","host":"h1","runtimeConfig":{"portMappings":[%s]}%s}`, tc.mappings, tc.extra))
			}
			err := e.Add(args("c-"+tc.name[:3], stdin))
			if code(err) != tc.code {
				t.Fatalf("%v (code %d), want code %d", err, code(err), tc.code)
			}
			if len(w.dp.marks) != 0 {
				t.Fatalf("a failed ADD left forwards: %v", w.dp.marks)
			}
		})
	}
	// No prevResult: chained plugins need one.
	if err := e.Add(args("x", []byte(`{"cniVersion":"1.1.0","name":"web"}`))); code(err) != types.ErrInvalidNetworkConfig {
		t.Fatalf("no prevResult: %v", err)
	}
	// The store unreachable: try again later.
	e.Open = func(context.Context, *Config) (Opened, error) {
		return Opened{}, fmt.Errorf("opening store: %w", store.ErrUnavailable)
	}
	if err := e.Add(args("y", conf("h1", `{"hostPort":8080,"containerPort":80}`, ""))); code(err) != types.ErrTryAgainLater {
		t.Fatalf("store down: %v", err)
	}
	if err := e.Status(args("y", conf("h1", "", ""))); code(err) != CodePluginNotAvailable {
		t.Fatalf("STATUS with the store down: %v", err)
	}
}

// ADD without mappings passes prevResult on and touches nothing.
func TestAddWithoutMappings(t *testing.T) {
	w := newWorld(memory.New())
	e := w.edge()
	opened := false
	e.Open = func(context.Context, *Config) (Opened, error) {
		opened = true
		return Opened{}, errors.New("not expected")
	}
	if err := e.Add(args("c1", conf("h1", "", ""))); err != nil || opened || !strings.Contains(w.out.String(), "198.18.131.5/24") {
		t.Fatalf("%v opened=%v out=%s", err, opened, w.out.String())
	}
}

// A data path that fails leaves no port held and no forward.
func TestFailedForwardsReleaseThePorts(t *testing.T) {
	w := newWorld(memory.New())
	w.dp.failAdd = errors.New("nft: boom")
	e := w.edge()
	if err := e.Add(args("c1", conf("h1", `{"hostPort":8080,"containerPort":80}`, ""))); err == nil || !strings.Contains(err.Error(), "boom") {
		t.Fatalf("ADD: %v", err)
	}
	if len(w.dp.marks) != 0 {
		t.Fatalf("forwards left: %v", w.dp.marks)
	}
	w.dp.failAdd = nil
	if err := e.Add(args("c2", conf("h1", `{"hostPort":8080,"containerPort":80}`, ""))); err != nil {
		t.Fatalf("8080 after the failed ADD: %v", err)
	}
}

// ADD again for one attachment with other mappings replaces its forwards.
func TestReAddReplacesForwards(t *testing.T) {
	w := newWorld(memory.New())
	e := w.edge()
	if err := e.Add(args("c1", conf("h1", `{"hostPort":8080,"containerPort":80}`, ""))); err != nil {
		t.Fatal(err)
	}
	if err := e.Add(args("c1", conf("h1", `{"hostPort":9090,"containerPort":80}`, ""))); err != nil {
		t.Fatal(err)
	}
	mark := Mark(portalloc.EndpointID{Network: "web", ContainerID: "c1", IfName: "eth0"})
	for _, r := range w.dp.marks[mark] {
		if r.HostPort != 9090 {
			t.Fatalf("stale forward %v", r)
		}
	}
	if len(w.dp.marks[mark]) != 2 {
		t.Fatalf("forwards %v", w.dp.marks[mark])
	}
}

func TestCheckFindsDifferences(t *testing.T) {
	st := memory.New()
	w := newWorld(st)
	e := w.edge()
	stdin := conf("h1", `{"hostPort":8080,"containerPort":80}`, "")
	if err := e.Add(args("c1", stdin)); err != nil {
		t.Fatal(err)
	}
	mark := Mark(portalloc.EndpointID{Network: "web", ContainerID: "c1", IfName: "eth0"})
	// A different request.
	if err := e.Check(args("c1", conf("h1", `{"hostPort":8081,"containerPort":80}`, ""))); code(err) != CodeCheckFailed {
		t.Fatalf("other port: %v", err)
	}
	// A forward gone.
	saved := w.dp.marks[mark]
	w.dp.marks[mark] = saved[:1]
	if err := e.Check(args("c1", stdin)); code(err) != CodeCheckFailed || !strings.Contains(err.Error(), "missing") {
		t.Fatalf("forward gone: %v", err)
	}
	w.dp.marks[mark] = saved
	// The store's address no longer lists the attachment (a host port: its
	// host's binding under p/h/, and the marker in p/a/).
	if err := st.Commit(context.Background(), nil, []store.Op{store.Delete("p/a/tcp/08080"), store.Delete("p/h/tcp/08080/h1")}); err != nil {
		t.Fatal(err)
	}
	if err := e.Check(args("c1", stdin)); code(err) != CodeCheckFailed || !strings.Contains(err.Error(), "does not list") {
		t.Fatalf("reservation gone: %v", err)
	}
	// Nothing published and nothing asked: fine.
	if err := e.Check(args("c9", conf("h1", "", ""))); err != nil {
		t.Fatal(err)
	}
	if err := e.Check(args("c9", stdin)); code(err) != CodeCheckFailed {
		t.Fatalf("nothing published: %v", err)
	}
}

// GC cleans this network's stale attachments on this host only.
func TestGCThisHostThisNetwork(t *testing.T) {
	st := memory.New()
	h1, h2 := newWorld(st), newWorld(st)
	for _, x := range []struct {
		w    *world
		host string
		id   string
		port int
		net  string
	}{
		{h1, "h1", "keep", 8001, "web"}, {h1, "h1", "gone", 8002, "web"}, {h1, "h1", "othernet", 8003, "db"},
		{h2, "h2", "remote", 8004, "web"},
	} {
		stdin := conf(x.host, fmt.Sprintf(`{"hostPort":%d,"containerPort":80}`, x.port), "")
		stdin = bytes.Replace(stdin, []byte(`"name":"web"`), []byte(`"name":"`+x.net+`"`), 1)
		if err := x.w.edge().Add(args(x.id, stdin)); err != nil {
			t.Fatal(err)
		}
	}
	// A stray forward of this network with no store record, and one with
	// a long name (hashed mark).
	long := portalloc.EndpointID{Network: "web", ContainerID: strings.Repeat("a", 150), IfName: "eth0"}
	h1.dp.marks[Mark(portalloc.EndpointID{Network: "web", ContainerID: "stray", IfName: "eth0"})] = nil
	h1.dp.marks[Mark(long)] = nil
	gc := []byte(`{"cniVersion":"1.1.0","name":"web","type":"portmap-ingress","host":"h1",
	 "cni.dev/valid-attachments":[{"containerID":"keep","ifname":"eth0"},{"containerID":"remote","ifname":"eth0"}]}`)
	if err := h1.edge().GC(args("", gc)); err != nil {
		t.Fatal(err)
	}
	var left []string
	for m := range h1.dp.marks {
		left = append(left, m)
	}
	slices.Sort(left)
	if want := []string{"port/db/othernet/eth0", "port/web/keep/eth0"}; !slices.Equal(left, want) {
		t.Fatalf("forwards after GC: %v, want %v", left, want)
	}
	a, _ := portalloc.New(st, "h1")
	for id, want := range map[string]bool{"keep": true, "gone": false, "remote": true} {
		if _, ok, _ := a.Lookup(context.Background(), portalloc.EndpointID{Network: "web", ContainerID: id, IfName: "eth0"}); ok != want {
			t.Errorf("%s held after GC: %v, want %v", id, ok, want)
		}
	}
	// h2's attachment is not in h1's list at all: h1's GC leaves it alone.
	gc2 := bytes.Replace(gc, []byte(`,{"containerID":"remote","ifname":"eth0"}`), nil, 1)
	if err := h1.edge().GC(args("", gc2)); err != nil {
		t.Fatal(err)
	}
	if _, ok, _ := a.Lookup(context.Background(), portalloc.EndpointID{Network: "web", ContainerID: "remote", IfName: "eth0"}); !ok {
		t.Fatal("h1's GC released h2's attachment")
	}
	// Without a list, GC does nothing.
	if err := h1.edge().GC(args("", []byte(`{"cniVersion":"1.1.0","name":"web","host":"h1"}`))); err != nil || len(h1.dp.marks) != 2 {
		t.Fatalf("GC without a list: %v %v", err, h1.dp.marks)
	}
}

func TestMarks(t *testing.T) {
	id := portalloc.EndpointID{Network: "web", ContainerID: "c1", IfName: "eth0"}
	if m := Mark(id); m != "port/web/c1/eth0" || !markOfNetwork(m, "web") || markOfNetwork(m, "we") {
		t.Fatalf("plain mark %q", m)
	}
	long := portalloc.EndpointID{Network: "web", ContainerID: strings.Repeat("f", 200), IfName: "eth0"}
	m := Mark(long)
	if len(m) > maxMark || !plainMark(strings.Replace(m, "#", "", 1)) || !markOfNetwork(m, "web") || markOfNetwork(m, "db") || m == Mark(id) {
		t.Fatalf("hashed mark %q", m)
	}
	odd := portalloc.EndpointID{Network: "web", ContainerID: `a"b c`, IfName: "eth0"}
	if m := Mark(odd); !strings.HasPrefix(m, "port/#") || !markOfNetwork(m, "web") {
		t.Fatalf("mark of an odd name %q", m)
	}
	// The lock named from a mark (the agent's) is the attachment's own
	// (ADD's and DEL's), plain or hashed.
	for _, x := range []portalloc.EndpointID{id, long, odd} {
		if got, want := MarkLock(Mark(x)), attachmentLockPrefix+shortHash(x.String(), 32); got != want {
			t.Errorf("MarkLock of %s's mark %q is %q, ADD and DEL lock %q", x, Mark(x), got, want)
		}
	}
}

// slowDataplane's Add outlives the invocation's deadline and then fails the
// way a killed nft child does: without naming the deadline.
type slowDataplane struct{ *fakeDataplane }

func (s slowDataplane) Add(ctx context.Context, _ string, _ []Rule) error {
	<-ctx.Done()
	return errors.New("nftables: signal: killed")
}

func TestDeadlineInTheDataPathIsTryAgainLater(t *testing.T) {
	w := newWorld(memory.New())
	e := w.edge()
	open := e.Open
	e.Open = func(ctx context.Context, c *Config) (Opened, error) {
		o, err := open(ctx, c)
		o.Dataplane = slowDataplane{w.dp}
		return o, err
	}
	err := e.Add(args("c1", conf("h1", `{"hostPort":8080,"containerPort":80}`, `,"timeout":"50ms"`)))
	if code(err) != 11 || !strings.Contains(err.Error(), "signal: killed") {
		t.Fatalf("ADD cut short by its deadline: %v (code %d), want code 11 with the cause", err, code(err))
	}
	// Nothing stays published: the ports were released again.
	if err := w.edge().Add(args("c2", conf("h1", `{"hostPort":8080,"containerPort":80}`, ""))); err != nil {
		t.Fatalf("8080 after the failed ADD: %v", err)
	}
}

// ADD and DEL of one attachment hold its lock (Edge.lockAttachment): while
// it is held elsewhere (a killed ADD's nft still running) a DEL waits, and
// fails with code 11 at its deadline, its ports still published; once the
// lock is free the DEL goes through.
func TestAddAndDelWaitForTheAttachmentLock(t *testing.T) {
	w := newWorld(memory.New())
	e := w.edge()
	e.Locks = hostlock.Dir(t.TempDir())
	stdin := conf("h1", `{"hostPort":8080,"containerPort":80}`, `,"timeout":"300ms"`)
	if err := e.Add(args("c1", stdin)); err != nil {
		t.Fatal(err)
	}
	id := portalloc.EndpointID{Network: "web", ContainerID: "c1", IfName: "eth0"}
	release, err := e.lockAttachment(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	if err := e.Del(args("c1", stdin)); code(err) != 11 {
		release()
		t.Fatalf("DEL while the attachment is locked: %v (code %d), want code 11", err, code(err))
	}
	if err := e.Add(args("c2", stdin)); code(err) != CodeInUse {
		release()
		t.Fatalf("8080 after the DEL that waited: %v (code %d), want %d: still c1's", err, code(err), CodeInUse)
	}
	if err := e.Add(args("c1", stdin)); code(err) != 11 {
		release()
		t.Fatalf("ADD while the attachment is locked: %v (code %d), want code 11", err, code(err))
	}
	release()
	if err := e.Del(args("c1", stdin)); err != nil {
		t.Fatalf("DEL once the lock is free: %v", err)
	}
	if err := e.Add(args("c2", stdin)); err != nil {
		t.Fatalf("8080 after c1's DEL: %v", err)
	}
}

// A host does not keep a lock file for every attachment it ever had: DEL
// removes its attachment's, GC the ones no call holds; a live attachment
// keeps its ports all along.
func TestAttachmentLockFilesDoNotPileUp(t *testing.T) {
	w := newWorld(memory.New())
	e := w.edge()
	e.Locks = hostlock.Dir(t.TempDir())
	lockFiles := func() int {
		m, err := filepath.Glob(filepath.Join(string(e.Locks), attachmentLockPrefix+"*.lock"))
		if err != nil {
			t.Fatal(err)
		}
		return len(m)
	}
	for i, id := range []string{"c1", "c2"} {
		stdin := conf("h1", fmt.Sprintf(`{"hostPort":%d,"containerPort":80}`, 8080+i), "")
		if err := e.Add(args(id, stdin)); err != nil {
			t.Fatal(err)
		}
	}
	if n := lockFiles(); n != 2 {
		t.Fatalf("%d lock files after two ADDs, want 2", n)
	}
	if err := e.Del(args("c1", conf("h1", `{"hostPort":8080,"containerPort":80}`, ""))); err != nil {
		t.Fatal(err)
	}
	if n := lockFiles(); n != 1 {
		t.Fatalf("%d lock files after c1's DEL, want 1 (c2's)", n)
	}
	gc := []byte(`{"cniVersion":"1.1.0","name":"web","type":"portmap-ingress","host":"h1",
	 "cni.dev/valid-attachments":[{"containerID":"c2","ifname":"eth0"}]}`)
	if err := e.GC(args("", gc)); err != nil {
		t.Fatal(err)
	}
	if n := lockFiles(); n != 0 {
		t.Fatalf("%d lock files after GC, want 0", n)
	}
	if err := e.Add(args("c3", conf("h1", `{"hostPort":8081,"containerPort":80}`, ""))); code(err) != CodeInUse {
		t.Fatalf("8081 after GC: %v (code %d), want %d: still c2's", err, code(err), CodeInUse)
	}
	// The failed ADD made c3's lock; the DEL a runtime sends after a
	// failed ADD removes it.
	if err := e.Del(args("c3", conf("h1", `{"hostPort":8081,"containerPort":80}`, ""))); err != nil {
		t.Fatal(err)
	}
	// c2's next call makes its lock again, and its DEL removes it.
	if err := e.Del(args("c2", conf("h1", `{"hostPort":8081,"containerPort":80}`, ""))); err != nil {
		t.Fatal(err)
	}
	if n := lockFiles(); n != 0 {
		t.Fatalf("%d lock files after c2's DEL, want 0", n)
	}
}
