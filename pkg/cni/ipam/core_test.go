package ipam

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"

	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/memory"
)

func newAlloc(t *testing.T, st store.Store, host string) *pool.Allocator {
	t.Helper()
	a, err := pool.New(st, host)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

func mustLoad(t *testing.T, ipam, args string) *Config {
	t.Helper()
	c, err := Load(conf(ipam), args)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

const dual = `{"host":"h1","ranges":[[{"subnet":"198.18.0.0/24"}],[{"subnet":"2001:db8::/64"}]],"routes":[{"dst":"0.0.0.0/0"}],"dns":{"nameservers":["198.18.0.1"]}}`

func codeOf(err error) uint {
	if err == nil {
		return 0
	}
	return CNIError(err).Code
}

func TestAddDualStackIdempotent(t *testing.T) {
	ctx := context.Background()
	a := newAlloc(t, memory.New(), "h1")
	c := mustLoad(t, dual, "")
	at := Attachment{ContainerID: "c1", IfName: "eth0"}
	r1, err := Add(ctx, a, c, at)
	if err != nil {
		t.Fatal(err)
	}
	if len(r1.IPs) != 2 || r1.IPs[0].Address.IP.To4() == nil || r1.IPs[1].Address.IP.To4() != nil {
		t.Fatalf("want one IPv4 and one IPv6 address, got %v", r1.IPs)
	}
	if r1.IPs[0].Gateway.String() != "198.18.0.1" || r1.IPs[1].Gateway.String() != "2001:db8::1" {
		t.Errorf("gateways %v %v", r1.IPs[0].Gateway, r1.IPs[1].Gateway)
	}
	if ones, _ := r1.IPs[0].Address.Mask.Size(); ones != 24 {
		t.Errorf("v4 prefix %d", ones)
	}
	if len(r1.Routes) != 1 || len(r1.DNS.Nameservers) != 1 {
		t.Errorf("routes/dns not passed through: %+v", r1)
	}
	r2, err := Add(ctx, a, c, at)
	if err != nil {
		t.Fatal(err)
	}
	if r1.IPs[0].Address.String() != r2.IPs[0].Address.String() || r1.IPs[1].Address.String() != r2.IPs[1].Address.String() {
		t.Errorf("re-ADD gave %v, first ADD %v", r2.IPs, r1.IPs)
	}
	r3, err := Add(ctx, a, c, Attachment{ContainerID: "c2", IfName: "eth0"})
	if err != nil {
		t.Fatal(err)
	}
	if r3.IPs[0].Address.String() == r1.IPs[0].Address.String() {
		t.Errorf("two owners got %v", r3.IPs[0].Address)
	}
}

func TestAddErrorsMapToCodes(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	a := newAlloc(t, st, "h1")
	c := mustLoad(t, `{"host":"h1","ranges":[[{"subnet":"198.18.0.0/29"}]]}`, "")
	held, err := Add(ctx, a, c, Attachment{ContainerID: "holder", IfName: "eth0"})
	if err != nil {
		t.Fatal(err)
	}
	heldIP := held.IPs[0].Address.IP.String()

	t.Run("in use names holder", func(t *testing.T) {
		cs := mustLoad(t, `{"host":"h1","ranges":[[{"subnet":"198.18.0.0/29"}]]}`, "IP="+heldIP)
		_, err := Add(ctx, a, cs, Attachment{ContainerID: "other", IfName: "eth0"})
		if codeOf(err) != CodeAlreadyInUse || !strings.Contains(err.Error(), "holder") {
			t.Fatalf("err = %v (code %d), want code %d naming the holder", err, codeOf(err), CodeAlreadyInUse)
		}
	})
	t.Run("exists", func(t *testing.T) {
		other := "198.18.0.6"
		if heldIP == other {
			other = "198.18.0.5"
		}
		cs := mustLoad(t, `{"host":"h1","ranges":[[{"subnet":"198.18.0.0/29"}]]}`, "IP="+other)
		_, err := Add(ctx, a, cs, Attachment{ContainerID: "holder", IfName: "eth0"})
		if codeOf(err) != CodeAlreadyExists {
			t.Fatalf("err = %v (code %d), want %d", err, codeOf(err), CodeAlreadyExists)
		}
	})
	t.Run("capacity says how full", func(t *testing.T) {
		var err error
		for i := 0; i < 10 && err == nil; i++ {
			_, err = Add(ctx, a, c, Attachment{ContainerID: fmt.Sprintf("fill%d", i), IfName: "eth0"})
		}
		if codeOf(err) != CodeNoCapacity || !strings.Contains(err.Error(), "in use") {
			t.Fatalf("err = %v (code %d), want %d", err, codeOf(err), CodeNoCapacity)
		}
		serr := Status(ctx, a, c)
		if statusError(serr) == nil || statusError(serr).Code != CodePluginNotAvailable {
			t.Fatalf("STATUS on a full pool = %v, want code 50", serr)
		}
	})
	t.Run("definition mismatch", func(t *testing.T) {
		cm := mustLoad(t, `{"host":"h2","ranges":[[{"subnet":"198.18.0.0/28"}]]}`, "")
		_, err := Add(ctx, newAlloc(t, st, "h2"), cm, Attachment{ContainerID: "x", IfName: "eth0"})
		if codeOf(err) != CodeDefinitionMismatch {
			t.Fatalf("err = %v (code %d), want %d", err, codeOf(err), CodeDefinitionMismatch)
		}
		if serr := Status(ctx, a, cm); statusError(serr) == nil {
			t.Fatal("STATUS passed with a mismatching definition")
		}
	})
}

func TestDelCheckGC(t *testing.T) {
	ctx := context.Background()
	a := newAlloc(t, memory.New(), "h1")
	c := mustLoad(t, dual, "")
	at := Attachment{ContainerID: "c1", IfName: "eth0"}
	res, err := Add(ctx, a, c, at)
	if err != nil {
		t.Fatal(err)
	}
	// CHECK with a matching prevResult.
	cc := *c
	cc.PrevResult = res
	if err := Check(ctx, a, &cc, at); err != nil {
		t.Fatalf("CHECK of a fresh allocation: %v", err)
	}
	// CHECK with a differing prevResult.
	bad := *res
	bad.IPs = res.IPs[:1]
	cc.PrevResult = &bad
	if err := Check(ctx, a, &cc, at); codeOf(err) != CodeCheckFailed {
		t.Fatalf("CHECK with a differing prevResult = %v", err)
	}
	if err := Del(ctx, a, c, at); err != nil {
		t.Fatal(err)
	}
	if err := Del(ctx, a, c, at); err != nil {
		t.Fatalf("second DEL: %v", err)
	}
	cc.PrevResult = res
	if err := Check(ctx, a, &cc, at); codeOf(err) != CodeCheckFailed {
		t.Fatalf("CHECK after DEL = %v, want code %d", err, CodeCheckFailed)
	}

	// GC: keep k1, release s1 and s2; without a list, release nothing.
	for _, id := range []string{"k1", "s1", "s2"} {
		if _, err := Add(ctx, a, c, Attachment{ContainerID: id, IfName: "eth0"}); err != nil {
			t.Fatal(err)
		}
	}
	if rel, err := GC(ctx, a, c); err != nil || len(rel) != 0 {
		t.Fatalf("GC without a list released %v, %v", rel, err)
	}
	gc := *c
	gc.HasValid = true
	gc.Valid = []types.GCAttachment{{ContainerID: "k1", IfName: "eth0"}}
	rel, err := GC(ctx, a, &gc)
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, r := range rel {
		ids = append(ids, r.Owner.ContainerID)
	}
	if len(ids) != 2 || strings.Contains(strings.Join(ids, ","), "k1") {
		t.Fatalf("GC released %v, want s1 and s2", ids)
	}
	if _, ok, _ := a.Lookup(ctx, c.Owner(Attachment{ContainerID: "k1", IfName: "eth0"})); !ok {
		t.Fatal("GC released a valid attachment")
	}
}

// downStore is a store that cannot be reached.
type downStore struct{}

func (downStore) Get(context.Context, ...string) ([]store.KV, error) {
	return nil, fmt.Errorf("dial: %w", store.ErrUnavailable)
}
func (downStore) Scan(context.Context, string, string, int) ([]store.KV, error) {
	return nil, fmt.Errorf("dial: %w", store.ErrUnavailable)
}
func (downStore) Commit(context.Context, []store.Cond, []store.Op) error {
	return fmt.Errorf("dial: %w", store.ErrUnavailable)
}
func (downStore) Close() error { return nil }

func TestEdgeStoreDown(t *testing.T) {
	e := Edge{
		Open: func(ctx context.Context, c *Config) (Allocator, func() error, error) {
			a, err := pool.New(downStore{}, c.Host)
			return a, func() error { return nil }, err
		},
		Stdout: &bytes.Buffer{},
	}
	args := &skel.CmdArgs{ContainerID: "c1", IfName: "eth0", Netns: "/x", StdinData: conf(dual)}
	if err := e.Add(args); codeOf(err) != types.ErrTryAgainLater {
		t.Errorf("ADD with store down = %v, want code 11", err)
	}
	if err := e.Del(args); codeOf(err) != types.ErrTryAgainLater {
		t.Errorf("DEL with store down = %v, want code 11", err)
	}
	if err := e.Status(args); codeOf(err) != CodePluginNotAvailable {
		t.Errorf("STATUS with store down = %v, want code 50", err)
	}
	bad := &skel.CmdArgs{ContainerID: "c1", IfName: "eth0", StdinData: conf(`{"ranges":[]}`)}
	for name, f := range map[string]func(*skel.CmdArgs) error{"ADD": e.Add, "DEL": e.Del, "CHECK": e.Check, "GC": e.GC, "STATUS": e.Status} {
		if err := f(bad); codeOf(err) != types.ErrInvalidNetworkConfig {
			t.Errorf("%s with bad config = %v, want code 7", name, err)
		}
	}
}

func TestEdgeAddPrintsRequestedVersion(t *testing.T) {
	st := memory.New()
	for _, ver := range []string{"0.3.1", "0.4.0", "1.0.0", "1.1.0"} {
		t.Run(ver, func(t *testing.T) {
			out := &bytes.Buffer{}
			e := Edge{
				Open: func(ctx context.Context, c *Config) (Allocator, func() error, error) {
					a, err := pool.New(st, c.Host)
					return a, func() error { return nil }, err
				},
				Stdout: out,
			}
			in := []byte(`{"cniVersion":"` + ver + `","name":"net1","type":"bridge","ipam":` + dual + `}`)
			if err := e.Add(&skel.CmdArgs{ContainerID: "c-" + ver, IfName: "eth0", StdinData: in}); err != nil {
				t.Fatal(err)
			}
			var got struct {
				CNIVersion string `json:"cniVersion"`
				IPs        []json.RawMessage
			}
			if err := json.Unmarshal(out.Bytes(), &got); err != nil || got.CNIVersion != ver || len(got.IPs) != 2 {
				t.Fatalf("printed %s (%v)", out, err)
			}
		})
	}
}

func TestEdgeChainedPassesThrough(t *testing.T) {
	out := &bytes.Buffer{}
	e := Edge{Stdout: out, Open: func(context.Context, *Config) (Allocator, func() error, error) {
		return nil, nil, errors.New("chained ADD must not open the store")
	}}
	in := []byte(`{"cniVersion":"1.1.0","name":"net1","type":"ipam-ring","chained":true,"prevResult":{"cniVersion":"1.1.0","ips":[{"address":"198.18.0.2/24"}]},"ipam":` + dual + `}`)
	if err := e.Add(&skel.CmdArgs{ContainerID: "c", IfName: "eth0", StdinData: in}); err != nil {
		t.Fatal(err)
	}
	r, err := current.NewResult(out.Bytes())
	if err != nil {
		t.Fatal(err)
	}
	if res := r.(*current.Result); len(res.IPs) != 1 || res.IPs[0].Address.String() != "198.18.0.2/24" {
		t.Fatalf("chained ADD printed %s", out)
	}
	if err := e.Del(&skel.CmdArgs{ContainerID: "c", IfName: "eth0", StdinData: in}); err != nil {
		t.Fatal(err)
	}
}

func TestReservationSurvivesRecreate(t *testing.T) {
	ctx := context.Background()
	a := newAlloc(t, memory.New(), "h1")
	c := mustLoad(t, `{"host":"h1","reservationFromPod":true,"ranges":[[{"subnet":"198.18.0.0/24"}]]}`, "IgnoreUnknown=1;K8S_POD_NAMESPACE=db;K8S_POD_NAME=db-0")
	first, err := Add(ctx, a, c, Attachment{ContainerID: "old", IfName: "eth0"})
	if err != nil {
		t.Fatal(err)
	}
	// Something else takes the next address meanwhile.
	if _, err := Add(ctx, a, mustLoad(t, `{"host":"h1","ranges":[[{"subnet":"198.18.0.0/24"}]]}`, ""), Attachment{ContainerID: "other", IfName: "eth0"}); err != nil {
		t.Fatal(err)
	}
	if err := Del(ctx, a, c, Attachment{ContainerID: "old", IfName: "eth0"}); err != nil {
		t.Fatal(err)
	}
	again, err := Add(ctx, a, c, Attachment{ContainerID: "new", IfName: "eth0"})
	if err != nil {
		t.Fatal(err)
	}
	if again.IPs[0].Address.String() != first.IPs[0].Address.String() {
		t.Fatalf("recreated pod got %s, had %s", again.IPs[0].Address.String(), first.IPs[0].Address.String())
	}
}

// TestContainerdSequence replays, through the skel edge, the calls
// containerd 1.6's CRI plugin makes for pods (LAB.md "containerd over
// CRI"): CNI_ARGS with K8S_* and IgnoreUnknown, the main plugin's stdin
// with runtimeConfig in Go field case and no "ips", DEL at stop with the
// netns and again at remove without it, and a DEL right after every failed
// ADD.
func TestContainerdSequence(t *testing.T) {
	st := memory.New()
	out := &bytes.Buffer{}
	e := Edge{Stdout: out, Open: func(ctx context.Context, c *Config) (Allocator, func() error, error) {
		a, err := pool.New(st, c.Host)
		return a, func() error { return nil }, err
	}}
	const ipam = `{"type":"ipam-ring","host":"node-a","reservationFromPod":true,"ranges":[[{"subnet":"198.18.0.0/28"}]]}`
	stdin := func(annotations string) []byte {
		return []byte(`{"cniVersion":"1.0.0","name":"k8s","type":"bridge","bridge":"cni0","isGateway":true,` +
			`"runtimeConfig":{"portMappings":[{"HostPort":38080,"ContainerPort":80,"Protocol":"tcp","HostIP":""}],` +
			`"io.kubernetes.cri.pod-annotations":{` + annotations + `}},"ipam":` + ipam + `}`)
	}
	args := func(ns, name, sandbox, netns string, annotations string) *skel.CmdArgs {
		return &skel.CmdArgs{ContainerID: sandbox, Netns: netns, IfName: "eth0", StdinData: stdin(annotations),
			Args: "K8S_POD_NAMESPACE=" + ns + ";K8S_POD_NAME=" + name + ";K8S_POD_INFRA_CONTAINER_ID=" + sandbox + ";K8S_POD_UID=uid-" + sandbox + ";IgnoreUnknown=1"}
	}
	add := func(a *skel.CmdArgs) (string, error) {
		out.Reset()
		if err := e.Add(a); err != nil {
			return "", err
		}
		r, err := current.NewResult(out.Bytes())
		if err != nil {
			t.Fatal(err)
		}
		return r.(*current.Result).IPs[0].Address.IP.String(), nil
	}
	// run is RunPodSandbox: ADD, and on failure DEL at once.
	run := func(a *skel.CmdArgs) (string, error) {
		ip, err := add(a)
		if err != nil {
			if derr := e.Del(a); derr != nil {
				t.Fatalf("DEL after failed ADD of %s: %v", a.ContainerID, derr)
			}
		}
		return ip, err
	}
	// remove is StopPodSandbox then RemovePodSandbox.
	remove := func(a *skel.CmdArgs) {
		t.Helper()
		if err := e.Del(a); err != nil {
			t.Fatalf("DEL at stop of %s: %v", a.ContainerID, err)
		}
		noNS := *a
		noNS.Netns = ""
		if err := e.Del(&noNS); err != nil {
			t.Fatalf("DEL at remove of %s: %v", a.ContainerID, err)
		}
	}
	a := newAlloc(t, st, "node-a")
	holders := func() map[string]string {
		allocs, err := a.List(context.Background(), pool.Filter{Kind: pool.KindCNI, Network: "k8s"})
		if err != nil {
			t.Fatal(err)
		}
		m := map[string]string{}
		for _, al := range allocs {
			m[al.Owner.ContainerID] = al.Addrs[0].Addr.String()
		}
		return m
	}

	db0 := args("db", "db-0", "sb1", "/var/run/netns/cni-1", "")
	first, err := run(db0)
	if err != nil {
		t.Fatal(err)
	}
	// A second sandbox of the same pod while the first lives: refused
	// (the reservation has a live owner), and its DEL leaves the first's
	// address alone.
	if _, err := run(args("db", "db-0", "sb2", "/var/run/netns/cni-2", "")); codeOf(err) != 100 || !strings.Contains(err.Error(), "db/db-0") {
		t.Fatalf("second sandbox of db/db-0: %v (code %d), want 100 naming the reservation", err, codeOf(err))
	}
	if h := holders(); h["sb1"] != first || len(h) != 1 {
		t.Fatalf("after the refused sandbox the store holds %v, want sb1 on %s only", h, first)
	}
	remove(db0)
	if h := holders(); len(h) != 0 {
		t.Fatalf("after stop and remove the store holds %v", h)
	}
	// Another pod asking for the held address is refused, naming the
	// reservation; a pod asking for a free one gets it.
	web := args("default", "web", "sb3", "/var/run/netns/cni-3", `"ringipam.io/ip":"`+first+`"`)
	if _, err := run(web); codeOf(err) != 100 || !strings.Contains(err.Error(), "db/db-0") {
		t.Fatalf("web asking for %s held for db/db-0: %v (code %d)", first, err, codeOf(err))
	}
	web2 := args("default", "web", "sb4", "/var/run/netns/cni-4", `"ringipam.io/ip":"198.18.0.9"`)
	if ip, err := run(web2); err != nil || ip != "198.18.0.9" {
		t.Fatalf("web asking for the free 198.18.0.9: %s, %v", ip, err)
	}
	// The recreated pod gets its address back.
	db0b := args("db", "db-0", "sb5", "/var/run/netns/cni-5", "")
	if ip, err := run(db0b); err != nil || ip != first {
		t.Fatalf("recreated db/db-0 got %s (%v), had %s", ip, err, first)
	}
	remove(web2)
	remove(db0b)
	if h := holders(); len(h) != 0 {
		t.Fatalf("at the end the store holds %v", h)
	}
}

// TestIPv6ViaGateway: with "ipv6ViaGateway" the result carries, for the
// IPv6 address only, a route for its subnet through the gateway with a
// metric below the kernel's 256 of the on-link prefix route, after the
// configured routes, and printed with its priority whatever the CNI
// version asked for; without the key the routes are the configured ones. It
// is refused for ptp and per-container gateways, where it would do harm.
func TestIPv6ViaGateway(t *testing.T) {
	ctx := context.Background()
	a := newAlloc(t, memory.New(), "h1")
	via := strings.Replace(dual, `"host":"h1",`, `"host":"h1","ipv6ViaGateway":true,`, 1)
	c := mustLoad(t, via, "")
	r, err := Add(ctx, a, c, Attachment{ContainerID: "c1", IfName: "eth0"})
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Routes) != 2 || r.Routes[0].Dst.String() != "0.0.0.0/0" {
		t.Fatalf("routes %v: want the configured default route and one subnet route", r.Routes)
	}
	if got := r.Routes[1]; got.Dst.String() != "2001:db8::/64" || got.GW.String() != "2001:db8::1" || got.Priority != SubnetViaGatewayMetric || SubnetViaGatewayMetric >= 256 {
		t.Fatalf("subnet route %v", got)
	}
	if len(c.Routes) != 1 {
		t.Fatalf("the configuration's routes were changed: %v", c.Routes)
	}
	// Without the key: only the configured route.
	if r, err := Add(ctx, a, mustLoad(t, dual, ""), Attachment{ContainerID: "c2", IfName: "eth0"}); err != nil || len(r.Routes) != 1 {
		t.Fatalf("without ipv6ViaGateway: %v %v", r, err)
	}
	// An IPv4-only network gets nothing from it.
	v4 := `{"host":"h1","ipv6ViaGateway":true,"ranges":[[{"subnet":"198.18.1.0/24"}]]}`
	if r, err := Add(ctx, newAlloc(t, memory.New(), "h1"), mustLoad(t, v4, ""), Attachment{ContainerID: "c3", IfName: "eth0"}); err != nil || len(r.Routes) != 0 {
		t.Fatalf("IPv4 only: %v %v", r, err)
	}
	// Printed with its priority for every version a runtime asks for.
	for _, ver := range []string{"0.4.0", "1.0.0"} {
		out := &bytes.Buffer{}
		e := Edge{Open: func(ctx context.Context, c *Config) (Allocator, func() error, error) {
			return a, func() error { return nil }, nil
		}, Stdout: out}
		in := []byte(`{"cniVersion":"` + ver + `","name":"net1","type":"bridge","ipam":` + via + `}`)
		if err := e.Add(&skel.CmdArgs{ContainerID: "c-" + ver, IfName: "eth0", StdinData: in}); err != nil {
			t.Fatal(err)
		}
		var got struct{ Routes []map[string]any }
		if err := json.Unmarshal(out.Bytes(), &got); err != nil || len(got.Routes) != 2 ||
			fmt.Sprint(got.Routes[1]) != "map[dst:2001:db8::/64 gw:2001:db8::1 priority:100]" {
			t.Errorf("%s: printed %s (%v)", ver, out, err)
		}
	}
	for _, bad := range []string{
		`{"cniVersion":"1.0.0","name":"net1","type":"ptp","ipam":` + via + `}`,
		`{"cniVersion":"1.0.0","name":"net1","type":"bridge","ipam":` + strings.Replace(via, `"host":"h1",`, `"host":"h1","gatewayMode":"per-container",`, 1) + `}`,
	} {
		if _, err := Load([]byte(bad), ""); !errors.Is(err, ErrBadConfig) || !strings.Contains(err.Error(), "ipv6ViaGateway") {
			t.Errorf("%s: %v", bad, err)
		}
	}
}
