//go:build integration

package docker

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/ringipam/ringipam/docker-driver/driver"
	"github.com/ringipam/ringipam/integration/netns"
	"github.com/ringipam/ringipam/internal/testenv"
	"github.com/ringipam/ringipam/pkg/pool"
)

// runContainers starts n sleeping containers named prefix-i on network,
// with extra `docker run` flags, and returns their names.
func runContainers(t *testing.T, d *dockerd, network, prefix string, n int, extra ...string) []string {
	t.Helper()
	var names []string
	for i := range n {
		name := fmt.Sprintf("%s-%d", prefix, i)
		args := append([]string{"run", "-d", "--name", name, "--network", network}, extra...)
		d.must(append(args, image)...)
		names = append(names, name)
	}
	return names
}

// addrs returns the containers' addresses on network, failing on a
// duplicate or an address outside subnet or equal to gw.
func addrs(t *testing.T, d *dockerd, network string, subnet netip.Prefix, gw netip.Addr, names []string) map[netip.Addr]string {
	t.Helper()
	out := map[netip.Addr]string{}
	for _, n := range names {
		a := d.ip(n, network)
		if !subnet.Contains(a) || a == gw {
			t.Fatalf("%s got %s: outside %s or the gateway", n, a, subnet)
		}
		if other, dup := out[a]; dup {
			t.Fatalf("%s and %s both got %s", other, n, a)
		}
		out[a] = n
	}
	return out
}

// gateway is the gateway dockerd gave container on network (remote IPAM
// networks show no gateway in their IPAM config unless --gateway was given).
func gateway(t *testing.T, d *dockerd, container, network string) netip.Addr {
	t.Helper()
	out := d.must("inspect", "-f", fmt.Sprintf(`{{(index .NetworkSettings.Networks %q).Gateway}}`, network), container)
	gw, err := netip.ParseAddr(out)
	if err != nil {
		t.Fatalf("%s on %s: gateway %q: %v", container, network, out, err)
	}
	return gw
}

// TestNetworkAndStaticIP is item 1: a network on the driver, ten containers
// with distinct addresses in the subnet, --ip, and a taken --ip refused
// with a readable error.
func TestNetworkAndStaticIP(t *testing.T) {
	requireDocker(t)
	st := storeSpec{path: filepath.Join(tempDir(t, "rist-"), "store.db")}
	metrics := freeLoopbackAddr(t)
	drv := startDriver(t, "host1", st, "--metrics-addr", metrics)
	d := startDockerd(t, "host1", false)
	subnet := netip.MustParsePrefix("198.18.101.0/24")
	d.must("network", "create", "--ipam-driver", drv.name, "--subnet", subnet.String(), "--ip-range", "198.18.101.0/25", "net1")
	names := runContainers(t, d, "net1", "c", 10)
	gw := gateway(t, d, names[0], "net1")
	if gw != netip.MustParseAddr("198.18.101.1") {
		t.Fatalf("gateway %s, want the subnet's first address", gw)
	}
	got := addrs(t, d, "net1", subnet, gw, names)
	for a := range got {
		if !netip.MustParsePrefix("198.18.101.0/25").Contains(a) {
			t.Errorf("%s is outside --ip-range", a)
		}
	}

	static := netip.MustParseAddr("198.18.101.100") // inside --ip-range: the pool hands out nothing outside it
	d.must("run", "-d", "--name", "static", "--network", "net1", "--ip", static.String(), image)
	if a := d.ip("static", "net1"); a != static {
		t.Fatalf("--ip %s gave %s", static, a)
	}
	out, err := d.docker("run", "-d", "--name", "static2", "--network", "net1", "--ip", static.String(), image)
	if err == nil {
		t.Fatalf("a second container got the taken --ip %s", static)
	}
	if !strings.Contains(out, "IpamDriver.RequestAddress") || !strings.Contains(out, static.String()+" is already in use") {
		t.Fatalf("unreadable error for a taken --ip:\n%s", out)
	}
	t.Logf("docker run with a taken --ip says: %s", out)
	m := scrape(t, metrics)
	for _, want := range []string{
		`ringipam_docker_requests_total{method="RequestAddress",result="in_use"} 1`,
		`ringipam_docker_requests_total{method="RequestPool",result="ok"} 1`,
		`ringipam_docker_addresses_allocated_total{family="ipv4"} 11`,
		`ringipam_docker_request_duration_seconds_count{method="RequestAddress"}`,
	} {
		if !strings.Contains(m, want) {
			t.Errorf("metrics lack %q", want)
		}
	}

	// The store holds exactly the running containers' addresses.
	s := st.open(t)
	want := keys(got)
	want[static] = true
	if h := keys(held(t, s, driver.PoolName(subnet), "host1")); !mapsEqual(h, want) {
		t.Fatalf("store holds %v, containers have %v", h, want)
	}
	checkPool(t, s, driver.PoolName(subnet))

	// Removing containers releases their addresses.
	d.must("rm", "-f", "static", "static2", names[0])
	delete(want, static)
	for a, n := range got {
		if n == names[0] {
			delete(want, a)
		}
	}
	if h := keys(held(t, s, driver.PoolName(subnet), "host1")); !mapsEqual(h, want) {
		t.Fatalf("after rm the store holds %v, want %v", h, want)
	}
}

// TestDefaultPool: networks without --subnet get distinct default subnets.
func TestDefaultPool(t *testing.T) {
	requireDocker(t)
	st := storeSpec{path: filepath.Join(tempDir(t, "rist-"), "store.db")}
	drv := startDriver(t, "host1", st)
	d := startDockerd(t, "host1", false)
	seen := map[string]string{}
	for i := range 3 {
		name := fmt.Sprintf("auto%d", i)
		d.must("network", "create", "--ipam-driver", drv.name, name)
		sub := d.must("network", "inspect", "-f", "{{range .IPAM.Config}}{{.Subnet}}{{end}}", name)
		if !netip.MustParsePrefix("198.18.200.0/22").Contains(netip.MustParsePrefix(sub).Addr()) {
			t.Fatalf("%s got subnet %s outside the default pool", name, sub)
		}
		if other, dup := seen[sub]; dup {
			t.Fatalf("%s and %s both got %s", other, name, sub)
		}
		seen[sub] = name
	}
	d.must("network", "rm", "auto1")
	d.must("network", "create", "--ipam-driver", drv.name, "auto3")
	if sub := d.must("network", "inspect", "-f", "{{range .IPAM.Config}}{{.Subnet}}{{end}}", "auto3"); seen[sub] != "auto1" {
		t.Fatalf("auto3 got %s, want auto1's released subnet", sub)
	}
}

// TestRestarts is item 2: restarting the driver and dockerd (with and
// without live-restore) keeps addresses, replays idempotently, and neither
// duplicates nor leaks an address.
func TestRestarts(t *testing.T) {
	requireDocker(t)
	st := storeSpec{path: filepath.Join(tempDir(t, "rist-"), "store.db")}
	drv := startDriver(t, "host1", st)
	d := startDockerd(t, "host1", true)
	subnet := netip.MustParsePrefix("198.18.102.0/24")
	poolName := driver.PoolName(subnet)
	d.must("network", "create", "--ipam-driver", drv.name, "--subnet", subnet.String(), "net2")
	names := runContainers(t, d, "net2", "a", 5, "--restart", "always")
	gw := gateway(t, d, names[0], "net2")
	before := addrs(t, d, "net2", subnet, gw, names)
	s := st.open(t)
	storeMatches := func(stage string, want map[netip.Addr]string) {
		t.Helper()
		if h := keys(held(t, s, poolName, "host1")); !mapsEqual(h, keys(want)) {
			t.Fatalf("%s: store holds %v, running containers have %v", stage, h, want)
		}
		checkPool(t, s, poolName)
	}
	storeMatches("start", before)

	// 1. Driver restart: running containers keep their addresses; new
	// containers never collide with them.
	drv.restart()
	if now := addrs(t, d, "net2", subnet, gw, names); !mapsEqual(keys(now), keys(before)) {
		t.Fatalf("addresses changed over a driver restart: %v -> %v", before, now)
	}
	names = append(names, runContainers(t, d, "net2", "b", 5, "--restart", "always")...)
	after := addrs(t, d, "net2", subnet, gw, names)
	storeMatches("driver restart", after)

	// 2. dockerd restart with live-restore: containers keep running, dockerd
	// replays pool, gateway and endpoint requests (RequiresRequestReplay);
	// the replay is idempotent.
	pools := drv.served("RequestPool")
	d.restart(true)
	d.waitRunning(names)
	if drv.served("RequestPool") == pools {
		t.Fatal("dockerd did not replay RequestPool on start: RequiresRequestReplay not honoured")
	}
	if gw2 := gateway(t, d, names[0], "net2"); gw2 != gw {
		t.Fatalf("gateway %s became %s", gw, gw2)
	}
	if now := addrs(t, d, "net2", subnet, gw, names); !mapsEqual(keys(now), keys(after)) {
		t.Fatalf("addresses changed over a live-restore dockerd restart: %v -> %v", after, now)
	}
	storeMatches("live-restore dockerd restart", after)

	// 3. dockerd restart without live-restore: containers stop (addresses
	// released) and come back by their restart policy with new endpoints.
	d.restart(false)
	d.waitRunning(names)
	final := addrs(t, d, "net2", subnet, gw, names)
	storeMatches("dockerd restart", final)
	names = append(names, runContainers(t, d, "net2", "c", 3)...)
	storeMatches("new containers", addrs(t, d, "net2", subnet, gw, names))

	// 4. Everything removed: nothing leaked.
	d.must(append([]string{"rm", "-f"}, names...)...)
	d.must("network", "rm", "net2")
	if h := held(t, s, poolName, "host1"); len(h) != 0 {
		t.Fatalf("leaked after removing every container: %v", h)
	}
}

// TestTwoHosts is item 3: two drivers with different host names on one
// etcd, each serving its own dockerd, create the same subnet; containers
// started on both at once never share an address.
func TestTwoHosts(t *testing.T) {
	requireDocker(t)
	e := testenv.StartEtcd(t)
	st := storeSpec{endpoints: e.Endpoints(), prefix: "/" + netns.Unique("rit") + "/"}
	hosts := []struct {
		drv *drv
		d   *dockerd
	}{
		{startDriver(t, "hostA", st), startDockerd(t, "hostA", false)},
		{startDriver(t, "hostB", st), startDockerd(t, "hostB", false)},
	}
	subnet := netip.MustParsePrefix("198.18.103.0/24")
	for _, h := range hosts {
		h.d.must("network", "create", "-d", "bridge", "--ipam-driver", h.drv.name, "--subnet", subnet.String(), "--gateway", "198.18.103.254", "lan")
	}
	const perHost = 8
	names := make([][]string, len(hosts))
	errs := make([]error, len(hosts))
	var wg sync.WaitGroup
	for i, h := range hosts {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range perHost {
				name := fmt.Sprintf("%s-%d", h.drv.host, j)
				if out, err := h.d.docker("run", "-d", "--name", name, "--network", "lan", image); err != nil {
					errs[i] = fmt.Errorf("docker run %s: %v: %s", name, err, out)
					return
				}
				names[i] = append(names[i], name)
			}
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	var gws []netip.Addr
	for i, h := range hosts {
		gws = append(gws, gateway(t, h.d, names[i][0], "lan"))
	}
	if gws[0] != gws[1] || gws[0] != netip.MustParseAddr("198.18.103.254") {
		t.Fatalf("gateways %v, want 198.18.103.254 on both hosts", gws)
	}
	all := map[netip.Addr]string{}
	s := st.open(t)
	for i, h := range hosts {
		got := addrs(t, h.d, "lan", subnet, gws[0], names[i])
		for a, n := range got {
			if other, dup := all[a]; dup {
				t.Fatalf("%s on %s and %s both got %s", n, h.drv.host, other, a)
			}
			all[a] = h.drv.host + "/" + n
		}
		if hs := keys(held(t, s, driver.PoolName(subnet), h.drv.host)); !mapsEqual(hs, keys(got)) {
			t.Fatalf("store holds %v for %s, its containers have %v", hs, h.drv.host, got)
		}
	}
	checkPool(t, s, driver.PoolName(subnet))
	// A static address held on one host is refused on the other.
	var onA netip.Addr
	for a, n := range all {
		if strings.HasPrefix(n, "hostA/") {
			onA = a
			break
		}
	}
	out, err := hosts[1].d.docker("run", "-d", "--name", "steal", "--network", "lan", "--ip", onA.String(), image)
	if err == nil || !strings.Contains(out, "already in use") || !strings.Contains(out, "hostA") {
		t.Fatalf("--ip %s held on hostA, on hostB: err=%v\n%s", onA, err, out)
	}
}

// TestSharedWithCNI is item 4: one pool served at once to Docker (through
// the driver) and to the ipam-ring CNI plugin (the binary, invoked as a
// runtime's main plugin would) on one etcd; no address is handed out twice.
func TestSharedWithCNI(t *testing.T) {
	requireDocker(t)
	e := testenv.StartEtcd(t)
	st := storeSpec{endpoints: e.Endpoints(), prefix: "/" + netns.Unique("rit") + "/"}
	drv := startDriver(t, "dockerhost", st)
	d := startDockerd(t, "dockerhost", false)
	s := st.open(t)
	poolName := netns.Unique("shared-")
	subnet := netip.MustParsePrefix("198.18.104.0/26") // 61 addresses besides the gateway
	d.must("network", "create", "--ipam-driver", drv.name, "--subnet", subnet.String(), "--ipam-opt", "pool="+poolName, "mixed")

	conf, err := json.Marshal(map[string]any{
		"cniVersion": "1.0.0", "name": "cninet", "type": "bridge",
		"ipam": map[string]any{
			"type": "ipam-ring", "host": "cnihost", "pools": []string{poolName},
			"ranges": [][]map[string]string{{{"subnet": subnet.String()}}},
			"store":  hostAgent(t, st, "cnihost").Store(map[string]any{"type": "etcd", "endpoints": st.endpoints, "prefix": st.prefix}),
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	const dockerN, cniN = 10, 40
	var (
		wg       sync.WaitGroup
		cniAddrs = map[netip.Addr]string{}
		cniGWs   = map[netip.Addr]bool{}
		cniErr   error
		dockErr  error
		dnames   []string
	)
	wg.Add(2)
	go func() {
		defer wg.Done()
		for i := range cniN {
			id := fmt.Sprintf("cni-%d", i)
			a, gw, err := cniAdd(conf, id)
			if err != nil {
				cniErr = err
				return
			}
			if other, dup := cniAddrs[a]; dup {
				cniErr = fmt.Errorf("CNI gave %s to %s and %s", a, other, id)
				return
			}
			cniAddrs[a] = id
			cniGWs[gw] = true
		}
	}()
	go func() {
		defer wg.Done()
		for i := range dockerN {
			name := fmt.Sprintf("d-%d", i)
			if out, err := d.docker("run", "-d", "--name", name, "--network", "mixed", image); err != nil {
				dockErr = fmt.Errorf("docker run %s: %v: %s", name, err, out)
				return
			}
			dnames = append(dnames, name)
		}
	}()
	wg.Wait()
	if cniErr != nil || dockErr != nil {
		t.Fatalf("cni: %v; docker: %v", cniErr, dockErr)
	}
	gw := gateway(t, d, dnames[0], "mixed")
	if len(cniGWs) != 1 || !cniGWs[gw] {
		t.Fatalf("CNI results carry gateways %v, Docker uses %s", cniGWs, gw)
	}
	dock := addrs(t, d, "mixed", subnet, gw, dnames)
	for a, n := range dock {
		if id, dup := cniAddrs[a]; dup {
			t.Fatalf("%s handed to docker container %s and CNI container %s", a, n, id)
		}
	}
	for a := range cniAddrs {
		if !subnet.Contains(a) || a == gw {
			t.Fatalf("CNI got %s: outside %s or the gateway", a, subnet)
		}
	}
	if h := keys(held(t, s, poolName, "dockerhost")); !mapsEqual(h, keys(dock)) {
		t.Fatalf("store holds %v for docker, containers have %v", h, dock)
	}
	if h := keys(held(t, s, poolName, "cnihost")); !mapsEqual(h, keys(cniAddrs)) {
		t.Fatalf("store holds %v for CNI, the plugin returned %v", h, cniAddrs)
	}
	checkPool(t, s, poolName)
	// 50 of 61 addresses are taken: Docker gets the other 11, then both
	// sides hear that the pool is full.
	if more := runContainersUntilFull(t, d, "mixed"); more != 11 {
		t.Fatalf("docker got %d more addresses, want 11", more)
	}
	if _, _, err := cniAdd(conf, "late"); err == nil || !strings.Contains(err.Error(), "no free address") {
		t.Fatalf("CNI ADD on a full pool: %v", err)
	}
}

// runContainersUntilFull starts containers until docker run fails with the
// driver's capacity error, and returns how many started.
func runContainersUntilFull(t *testing.T, d *dockerd, network string) int {
	t.Helper()
	for i := 0; i < 100; i++ {
		out, err := d.docker("run", "-d", "--name", fmt.Sprintf("fill-%d", i), "--network", network, image)
		if err != nil {
			if !strings.Contains(out, "no free address") && !strings.Contains(out, "capacity") {
				t.Fatalf("docker run failed, but not for capacity:\n%s", out)
			}
			return i
		}
	}
	t.Fatal("the pool never filled up")
	return 0
}

func mapsEqual[K comparable](a, b map[K]bool) bool {
	if len(a) != len(b) {
		return false
	}
	for k := range a {
		if !b[k] {
			return false
		}
	}
	return true
}

// TestDualStackAndAux: an IPv6 subnet next to the IPv4 one (one pool per
// family), and an --aux-address inside the range that no container gets.
func TestDualStackAndAux(t *testing.T) {
	requireDocker(t)
	st := storeSpec{path: filepath.Join(tempDir(t, "rist-"), "store.db")}
	drv := startDriver(t, "host1", st)
	d := startDockerd(t, "host1", false)
	v4, v6 := netip.MustParsePrefix("198.18.105.0/29"), netip.MustParsePrefix("2001:db8:105::/64")
	aux := netip.MustParseAddr("198.18.105.3")
	d.must("network", "create", "--ipv6", "--ipam-driver", drv.name, "--subnet", v4.String(), "--subnet", v6.String(),
		"--aux-address", "router2="+aux.String(), "dual")
	// 198.18.105.0/29: .1 gateway, .3 aux, so .2 .4 .5 .6 are left.
	names := runContainers(t, d, "dual", "x", 4)
	got := addrs(t, d, "dual", v4, gateway(t, d, names[0], "dual"), names)
	if _, taken := got[aux]; taken {
		t.Fatalf("the aux address %s went to a container", aux)
	}
	for _, n := range names {
		out := d.must("inspect", "-f", `{{(index .NetworkSettings.Networks "dual").GlobalIPv6Address}}`, n)
		a, err := netip.ParseAddr(out)
		if err != nil || !v6.Contains(a) {
			t.Fatalf("%s has IPv6 address %q, want one in %s", n, out, v6)
		}
	}
	if out, err := d.docker("run", "-d", "--name", "x-full", "--network", "dual", image); err == nil || !strings.Contains(out, "no free address") {
		t.Fatalf("a fifth container on a full /29: err=%v\n%s", err, out)
	}
	d.must("rm", "-f", "x-full")
	d.must(append([]string{"rm", "-f"}, names...)...)
	d.must("network", "rm", "dual")
	s := st.open(t)
	for _, p := range []netip.Prefix{v4, v6} {
		if h := held(t, s, driver.PoolName(p), "host1"); len(h) != 0 {
			t.Fatalf("pool %s still holds %v after the network is gone", p, h)
		}
	}
	a, err := pool.New(s, "inspector")
	if err != nil {
		t.Fatal(err)
	}
	if u, err := a.Usage(context.Background(), driver.PoolName(v4)); err != nil || u.Used != 0 {
		t.Fatalf("aux reservation left behind: %+v, %v", u, err)
	}
}
