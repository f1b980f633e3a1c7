//go:build integration

package ringctl

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	rc "github.com/ringipam/ringipam/cmd/ringctl/cli"
	"github.com/ringipam/ringipam/integration/cnitest"
	"github.com/ringipam/ringipam/integration/netns"
	"github.com/ringipam/ringipam/internal/testenv"
	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/portalloc"
	"github.com/ringipam/ringipam/pkg/store"
)

var hosts = []string{"node-a", "node-b", "node-c"}

// threeHosts allocates 3 containers on each host through the real plugin;
// the first of each carries a reservation. It returns each container's
// addresses and host.
func (c *cluster) threeHosts(t *testing.T) (map[string][]string, map[string]string) {
	t.Helper()
	addrs, hostOf := map[string][]string{}, map[string]string{}
	for _, h := range hosts {
		for i := range 3 {
			ctr := fmt.Sprintf("%s-%d", h, i)
			args := ""
			if i == 0 {
				args = "RESERVATION=ns/" + ctr
			}
			addrs[ctr], hostOf[ctr] = c.add(t, h, ctr, args, nil), h
			if len(addrs[ctr]) != 2 {
				t.Fatalf("%s got %v, want an IPv4 and an IPv6 address", ctr, addrs[ctr])
			}
		}
	}
	return addrs, hostOf
}

// 1. status, ls and ports on a real etcd with three hosts' allocations made
// by the real plugins, checked field by field against what the plugins
// returned; the human form of status once.
func TestStatusLsPorts(t *testing.T) {
	c := newCluster(t)
	addrs, hostOf := c.threeHosts(t)
	// node-a's reserved container goes: its addresses are held for the name.
	c.del(t, "node-a", "node-a-0", nil)
	held := addrs["node-a-0"]
	delete(addrs, "node-a-0")
	// Ports: node-a ingress tcp/8080, node-b host udp/5353 on one host IP,
	// node-c a dynamic ingress port, all by the real portmap-ingress.
	lab := netns.New(t, "rclab")
	lab.MustRun(t, "ip", "link", "set", "lo", "up")
	c.publish(t, lab, "node-a", "node-a-1", addrs["node-a-1"][0], map[string]any{"hostPort": 8080, "containerPort": 80, "protocol": "tcp", "mode": "ingress"})
	c.publish(t, lab, "node-b", "node-b-1", addrs["node-b-1"][0], map[string]any{"hostPort": 5353, "containerPort": 53, "protocol": "udp", "hostIP": "198.18.99.2"})
	c.publish(t, lab, "node-c", "node-c-1", addrs["node-c-1"][0], map[string]any{"hostPort": 0, "containerPort": 80, "protocol": "tcp", "mode": "ingress"})

	var st rc.Status
	c.jsonOf(t, &st, "status")
	if len(st.Pools) != 2 || len(st.Hosts) != 3 {
		t.Fatalf("status: %d pools, %d hosts\n%+v", len(st.Pools), len(st.Hosts), st)
	}
	wantPools := []struct {
		name, family, size, free string
	}{
		{network + "-0", "IPv4", "253", "244"},                                   // .1 is the gateway; 8 used, 1 held
		{network + "-1", "IPv6", "18446744073709551614", "18446744073709551605"}, // ::1 is the gateway
	}
	for i, w := range wantPools {
		p := st.Pools[i]
		if p.Name != w.name || p.Family != w.family || p.Size != w.size || p.Used != 8 || p.Held != 1 || p.Free != w.free || p.EndedHolds != 0 {
			t.Errorf("pool %d: %+v, want %+v with 8 used and 1 held", i, p, w)
		}
		owners := map[string]bool{}
		var used uint64
		for _, r := range p.Ranges {
			owners[r.Host] = true
			used += r.Used
			if r.Tombstone {
				t.Errorf("pool %s: tombstoned range %+v", p.Name, r)
			}
		}
		if used != 8 || !owners["node-a"] || !owners["node-b"] || !owners["node-c"] {
			t.Errorf("pool %s ranges: %+v", p.Name, p.Ranges)
		}
	}
	for i, h := range st.Hosts {
		wantUsed := uint64(6)
		if h.Name == "node-a" {
			wantUsed = 4
		}
		// Each host's agent runs (its plugins went through it): up.
		if h.Name != hosts[i] || h.State != "up" || !h.Agent || h.Used != wantUsed || h.Ranges != 2 ||
			time.Since(h.LastSeen) > 5*time.Minute || !slices.Equal(h.Pools, []string{network + "-0", network + "-1"}) {
			t.Errorf("host %d: %+v", i, h)
		}
	}
	human := c.ok(t, "status")
	checkWidth(t, human)
	var fields []string
	for _, l := range strings.Split(human, "\n") {
		fields = append(fields, strings.Join(strings.Fields(l), " "))
	}
	// Layout 4: each host claims a block of 64, so unowned space lies
	// between them and the number of ranges (unowned ones included)
	// depends on where the blocks fall; layout 3 had exactly 3.
	for _, want := range []string{
		"POOL FAMILY SIZE USED HELD FREE RANGES",
		"rcnet-0 IPv4 253 8 1 244 ",
		"rcnet-1 IPv6 18446744073709551614 8 1 18446744073709551605 ",
		"A node-a up", "B node-b up", "C node-c up",
		"ring rcnet-0: 198.18.20.2 - 198.18.20.254, ",
	} {
		if !slices.ContainsFunc(fields, func(l string) bool { return strings.HasPrefix(l, want) }) {
			t.Errorf("status lacks a line %q:\n%s", want, human)
		}
	}
	bars := 0
	for _, l := range strings.Split(human, "\n") {
		if strings.HasPrefix(l, "[") {
			bars++
			if len(l) != 100 || strings.Trim(l[1:99], "ABC.") != "" || !strings.Contains(l, "A") || !strings.Contains(l, "B") || !strings.Contains(l, "C") {
				t.Errorf("ring bar %q", l)
			}
		}
	}
	if bars != 2 {
		t.Errorf("%d ring bars, want 2:\n%s", bars, human)
	}
	t.Logf("ringctl status:\n%s", human)

	// ls: every address the plugin handed out, with its owner and host; the
	// hold of node-a-0's reservation.
	var rows []rc.AddrRow
	c.jsonOf(t, &rows, "ls")
	type key struct{ addr, who, host, resv string }
	var got, want []key
	for _, r := range rows {
		who := "hold"
		if r.Owner != nil {
			who = r.Owner.String()
			if r.Since.IsZero() || time.Since(r.Since) > 5*time.Minute || r.Role != pool.RoleIP || r.Kind != pool.KindCNI || r.Network != network {
				t.Errorf("ls row %+v", r)
			}
		} else if r.HeldUntil.Before(time.Now()) {
			t.Errorf("hold row %+v has ended", r)
		}
		got = append(got, key{r.Addr.String(), who, r.Host, r.Reservation})
	}
	for ctr, as := range addrs {
		resv := ""
		if strings.HasSuffix(ctr, "-0") {
			resv = "ns/" + ctr
		}
		for _, a := range as {
			want = append(want, key{a, "cni/" + network + "/" + ctr + "/eth0", hostOf[ctr], resv})
		}
	}
	for _, a := range held {
		want = append(want, key{a, "hold", "node-a", "ns/node-a-0"})
	}
	less := func(a, b key) int { return strings.Compare(a.addr, b.addr) }
	slices.SortFunc(got, less)
	slices.SortFunc(want, less)
	if diff := cmp.Diff(want, got, cmp.AllowUnexported(key{})); diff != "" {
		t.Errorf("ls (-want +got):\n%s", diff)
	}
	var onlyB []rc.AddrRow
	c.jsonOf(t, &onlyB, "ls", "--host", "node-b", "--pool", network+"-0")
	if len(onlyB) != 3 {
		t.Errorf("ls --host node-b --pool %s-0: %d rows, want 3", network, len(onlyB))
	}
	lsText := c.ok(t, "ls", "--owner", "cni/"+network+"/node-c-2")
	checkWidth(t, lsText)
	if !strings.Contains(lsText, addrs["node-c-2"][0]) || !strings.Contains(lsText, "2 addresses") {
		t.Errorf("ls --owner:\n%s", lsText)
	}

	// ports.
	var ports []rc.PortRow
	c.jsonOf(t, &ports, "ports")
	if len(ports) != 3 {
		t.Fatalf("ports: %+v", ports)
	}
	dyn := ports[0] // tcp sorts before udp; the dynamic port (>= 30000) after 8080
	if ports[0].Port == 8080 {
		dyn = ports[1]
	}
	wantPorts := []rc.PortRow{
		{Mode: "ingress", Protocol: "tcp", Port: 8080, Host: "node-a", Owner: "port/" + network + "/node-a-1/eth0"},
		{Mode: "ingress", Protocol: "tcp", Port: dyn.Port, Host: "node-c", Owner: "port/" + network + "/node-c-1/eth0"},
		{Mode: "host", Protocol: "udp", Port: 5353, Host: "node-b", HostIP: netip.MustParseAddr("198.18.99.2"), Owner: "port/" + network + "/node-b-1/eth0"},
	}
	if diff := cmp.Diff(wantPorts, ports, cmp.Comparer(func(a, b netip.Addr) bool { return a == b })); diff != "" || dyn.Port < 30000 || dyn.Port > 32767 {
		t.Errorf("ports (-want +got):\n%s", diff)
	}
	var ingressOnC []rc.PortRow
	c.jsonOf(t, &ingressOnC, "ports", "--mode", "ingress", "--host", "node-c")
	if len(ingressOnC) != 1 || ingressOnC[0].Port != dyn.Port {
		t.Errorf("ports --mode ingress --host node-c: %+v", ingressOnC)
	}
	checkWidth(t, c.ok(t, "ports"))

	// explain: the plugin's own configuration, a static address in use.
	conf := t.TempDir() + "/net.conf"
	writeFile(t, conf, netConf(c.ipam(t, "node-b", nil)))
	r := ringctlRun(t, nil, "--config", conf, "explain", "--ip", addrs["node-c-2"][0], "--container", "new")
	if r.code != 1 || !strings.Contains(r.stdout, "fail static rcnet-0 (CNI code 100)") || !strings.Contains(r.stdout, "an ADD on host node-b would fail now") {
		t.Errorf("explain of a taken address: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	checkWidth(t, r.stdout)
	var ex rc.Explanation
	r = ringctlRun(t, nil, "--config", conf, "explain", "--ip", addrs["node-c-2"][0], "--container", "new", "--json")
	if err := json.Unmarshal([]byte(r.stdout), &ex); err != nil || ex.WouldSucceed ||
		!slices.ContainsFunc(ex.Findings, func(f rc.Finding) bool {
			return f.Check == "static" && f.CNICode == 100 && strings.Contains(f.Detail, "already in use by cni/"+network+"/node-c-2/eth0 on host node-c")
		}) {
		t.Errorf("explain --json of a taken address: %v\n%s", err, r.stdout)
	}
	if r := ringctlRun(t, nil, "--config", conf, "explain"); r.code != 0 || !strings.Contains(r.stdout, "would succeed") {
		t.Errorf("explain of a healthy network: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	// The store down: a clear error and exit 3.
	c.etcd.Stop()
	r = c.ringctl(t, "status", "--timeout", "5s")
	if r.code != rc.ExitUnavailable || !strings.Contains(r.stderr, "unavailable") {
		t.Errorf("status with etcd down: exit %d\n%s", r.code, r.stderr)
	}
	r = ringctlRun(t, nil, "--config", conf, "explain", "--timeout", "5s")
	if r.code != 1 || !strings.Contains(r.stdout, "fail store (CNI code 11)") {
		t.Errorf("explain with etcd down: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
}

// 4. release --dry-run and gc --dry-run print what the real run then does,
// and nothing else.
func TestDryRunsAreTheRuns(t *testing.T) {
	c := newCluster(t)
	hold := map[string]any{"reservationHold": "2s"}
	for _, h := range hosts {
		for i := range 2 {
			args := ""
			if i == 0 {
				args = fmt.Sprintf("RESERVATION=ns/%s-%d", h, i)
			}
			c.add(t, h, fmt.Sprintf("%s-%d", h, i), args, hold)
		}
	}
	// release --owner: text and JSON of the dry run are the real run's.
	// ringctl keeps a released reservation held as the plugin would.
	sel := []string{"release", "--owner", "cni/" + network + "/node-b", "--reservation-hold", "2s"}
	dryText := c.ok(t, append(sel, "--dry-run")...)
	var dry rc.Actions
	c.jsonOf(t, &dry, append(sel, "--dry-run")...)
	if len(dry.Actions) != 2 || !dry.DryRun {
		t.Fatalf("release dry run: %+v", dry)
	}
	var real rc.Actions
	c.jsonOf(t, &real, sel...)
	if diff := cmp.Diff(dry.Actions, real.Actions, addrCmp); diff != "" {
		t.Fatalf("release did other than its dry run:\n%s", diff)
	}
	if !strings.HasSuffix(dryText, "# dry run: nothing was changed\n") {
		t.Errorf("dry run text %q", dryText)
	}
	var left []rc.AddrRow
	c.jsonOf(t, &left, "ls", "--owner", "cni/"+network+"/node-b", "--no-holds")
	if len(left) != 0 {
		t.Fatalf("node-b still holds %+v", left)
	}
	// The release by address, text against text.
	victim := c.add(t, "node-b", "node-b-5", "", hold)[0]
	dryText = c.ok(t, "release", victim, "--dry-run")
	realText := c.ok(t, "release", victim)
	if dryText != realText+"# dry run: nothing was changed\n" || !strings.Contains(realText, "release cni/"+network+"/node-b-5/eth0 (host node-b): "+victim) {
		t.Fatalf("release %s:\ndry run:\n%s\nreal run:\n%s", victim, dryText, realText)
	}

	// gc: node-c is not seen for longer than orphan-after (its agent
	// stopped: the host is down); node-a and node-b are seen again (an
	// ADD); ns/node-b-0's hold has ended.
	c.agent(t, "node-c").Stop(t)
	time.Sleep(5 * time.Second)
	c.add(t, "node-a", "node-a-9", "", hold)
	c.add(t, "node-b", "node-b-9", "", hold)
	gcArgs := []string{"gc", "--orphan-after", "4s"}
	dryText = c.ok(t, append(gcArgs, "--dry-run")...)
	c.jsonOf(t, &dry, append(gcArgs, "--dry-run")...)
	var whats []string
	for _, a := range dry.Actions {
		whats = append(whats, a.Do+" "+a.Target)
	}
	wantWhats := []string{
		"reclaim node-c", "release cni/" + network + "/node-c-0/eth0", "release cni/" + network + "/node-c-1/eth0",
		"drop-ended-hold reservation ns/node-b-0 (cni network " + network + ")",
		"drop-ended-hold reservation ns/node-b-0 (cni network " + network + ")",
	}
	if diff := cmp.Diff(wantWhats, whats); diff != "" {
		t.Fatalf("gc dry run (-want +got):\n%s\n%s", diff, dryText)
	}
	realText = c.ok(t, gcArgs...)
	if dryText != realText+"# dry run: nothing was changed\n" {
		t.Fatalf("gc did other than its dry run:\ndry run:\n%s\nreal run:\n%s", dryText, realText)
	}
	c.jsonOf(t, &dry, append(gcArgs, "--dry-run")...)
	if len(dry.Actions) != 0 {
		t.Fatalf("gc dry run after gc: %+v", dry)
	}
	var st rc.Status
	c.jsonOf(t, &st, "status", "--orphan-after", "4s")
	for _, h := range st.Hosts {
		if h.Name == "node-c" && (h.OrphanedAt.IsZero() || h.Ranges != 0 || h.Used != 0) {
			t.Errorf("node-c after gc: %+v", h)
		}
	}
	if out := c.ok(t, "check"); !strings.HasPrefix(out, "ok:") {
		t.Fatalf("check after the repairs:\n%s", out)
	}
	// node-c comes back (its agent first): its STATUS tells it to
	// acknowledge; host ack clears it.
	c.agent(t, "node-c").Start(t)
	_, err := ipamExecErr("STATUS", netConf(c.ipam(t, "node-c", hold)), "", "")
	if err == nil || !strings.Contains(err.Error(), "ringctl host ack node-c") {
		t.Fatalf("STATUS of the orphaned host: %v", err)
	}
	if out := c.ok(t, "host", "ack", "node-c"); !strings.Contains(out, "ack node-c") {
		t.Fatalf("host ack: %s", out)
	}
	if _, err := ipamExecErr("STATUS", netConf(c.ipam(t, "node-c", hold)), "", ""); err != nil {
		t.Fatalf("STATUS after host ack: %v", err)
	}
}

// 5. history shows the holders of an address that was allocated, released
// and reallocated.
func TestHistory(t *testing.T) {
	c := newCluster(t)
	const ip = "198.18.20.50"
	c.add(t, "node-a", "first", "IP="+ip, nil)
	c.del(t, "node-a", "first", nil)
	c.add(t, "node-b", "second", "IP="+ip, nil)
	var rows []rc.HistoryRow
	c.jsonOf(t, &rows, "history", ip)
	var got []string
	for _, r := range rows {
		got = append(got, r.What+" "+r.Owner+" "+r.Host)
		if r.Pool != network+"-0" || r.Addr.String() != ip || time.Since(r.Time) > 5*time.Minute {
			t.Errorf("history row %+v", r)
		}
	}
	want := []string{
		"alloc cni/" + network + "/first/eth0 node-a",
		"release cni/" + network + "/first/eth0 node-a",
		"alloc cni/" + network + "/second/eth0 node-b",
	}
	// Every event has its own key (named by its time): none is lost,
	// however quickly the address changes hands.
	if diff := cmp.Diff(want, got); diff != "" {
		t.Fatalf("history (-want +got):\n%s", diff)
	}
	text := c.ok(t, "history", ip)
	checkWidth(t, text)
	if lines := strings.Split(strings.TrimSpace(text), "\n"); len(lines) != len(got)+1 || strings.Join(strings.Fields(lines[len(lines)-1])[1:], " ") != "alloc cni/"+network+"/second/eth0 node-b" {
		t.Fatalf("history text:\n%s", text)
	}
	if r := c.ringctl(t, "history", "198.51.100.1"); r.code != rc.ExitFailed || !strings.Contains(r.stderr, "no recorded pool hands out 198.51.100.1") {
		t.Fatalf("history of an address outside every pool: %+v", r)
	}
}

var addrCmp = cmp.Comparer(func(a, b netip.Addr) bool { return a == b })

func writeFile(t *testing.T, path string, b []byte) {
	t.Helper()
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// 2. check passes on a healthy store (addresses, published ports and
// container networks, all made by the real plugins) and reports each
// violation on a store corrupted on purpose, one subtest per invariant,
// each through the binary.
// The corruptions write the documented store layout (docs/DESIGN-NOTES.md)
// directly, as a bug or a hand edit would.
func TestCheck(t *testing.T) {
	netns.RequireRoot(t)
	etcd := testenv.StartEtcd(t)
	hexOf := func(a string) string {
		b := netip.MustParseAddr(a).AsSlice()
		return hex.EncodeToString(b)
	}
	cases := []struct {
		invariant string
		corrupt   func(t *testing.T, c *cluster, st store.Store, addrs map[string][]string)
	}{
		{pool.InvTwoOwners, func(t *testing.T, c *cluster, st store.Store, addrs map[string][]string) {
			editJSON(t, st, "o/cni/rcnet/node-b-0/eth0", func(rec map[string]any) {
				rec["addrs"].([]any)[0].(map[string]any)["addr"] = addrs["node-a-0"][0]
			})
		}},
		{pool.InvRingCover, func(t *testing.T, c *cluster, st store.Store, addrs map[string][]string) {
			// A range of node-b inside another host's (layout 4: one key
			// per range, named by its last address).
			put(t, st, "g/rcnet-0/"+hexOf("198.18.20.2"), `{"s":"198.18.20.2","h":"node-b"}`)
		}},
		{pool.InvNotInPool, func(t *testing.T, c *cluster, st store.Store, addrs map[string][]string) {
			put(t, st, "a/rcnet-0/"+hexOf("198.18.20.255"), "node-b cni/rcnet/node-b-1/eth0")
		}},
		{pool.InvOutsideRange, func(t *testing.T, c *cluster, st store.Store, addrs map[string][]string) {
			put(t, st, "a/rcnet-0/"+hexOf(addrs["node-a-1"][0]), "node-b cni/rcnet/node-a-1/eth0")
		}},
		{pool.InvTombstoned, func(t *testing.T, c *cluster, st store.Store, addrs map[string][]string) {
			// node-c is removed with its ranges tombstoned; its owner comes
			// back as a stray record that the reclaim never saw.
			rec := get(t, st, "o/cni/rcnet/node-c-0/eth0")
			key := "a/rcnet-0/" + hexOf(addrs["node-c-0"][0])
			holder := get(t, st, key)
			c.ok(t, "rmpeer", "node-c", "--tombstone")
			put(t, st, "o/cni/rcnet/node-c-0/eth0", string(rec))
			put(t, st, key, string(holder))
			put(t, st, "a/rcnet-1/"+hexOf(addrs["node-c-0"][1]), string(holder))
		}},
		{pool.InvRecords, func(t *testing.T, c *cluster, st store.Store, addrs map[string][]string) {
			if err := st.Commit(context.Background(), nil, []store.Op{store.Delete("o/cni/rcnet/node-b-1/eth0")}); err != nil {
				t.Fatal(err)
			}
		}},
		{pool.InvOverlap, func(t *testing.T, c *cluster, st store.Store, addrs map[string][]string) {
			put(t, st, "d/other", `{"name":"other","ranges":[{"subnet":"198.18.20.128/25","rangeStart":"198.18.20.129","rangeEnd":"198.18.20.254"}]}`)
		}},
		{pool.InvHostCount, func(t *testing.T, c *cluster, st store.Store, addrs map[string][]string) {
			editJSON(t, st, "h/rcnet-0/node-b", func(hs map[string]any) { hs["u"] = 7 })
		}},
		{pool.InvCorrupt, func(t *testing.T, c *cluster, st store.Store, addrs map[string][]string) {
			put(t, st, "o/cni/rcnet/broken/eth0", "{not json")
		}},
		// Published ports (the real portmap-ingress published them in the
		// healthy store: see below).
		{portalloc.InvRecords, func(t *testing.T, c *cluster, st store.Store, addrs map[string][]string) {
			// node-a-0's ingress port loses its address record.
			if err := st.Commit(context.Background(), nil, []store.Op{store.Delete("p/a/tcp/08080")}); err != nil {
				t.Fatal(err)
			}
		}},
		{portalloc.InvClash, func(t *testing.T, c *cluster, st store.Store, addrs map[string][]string) {
			// An endpoint record alone claims, in ingress mode, the address
			// node-b-0 publishes in host mode.
			put(t, st, "p/e/rcnet/node-c-1/eth0", `{"kind":"port","host":"node-c","spec":[{"mode":"ingress","protocol":"udp","published":5353}],"ports":[{"mode":"ingress","protocol":"udp","published":5353}]}`)
		}},
		{portalloc.InvHolder, func(t *testing.T, c *cluster, st store.Store, addrs map[string][]string) {
			// Record and address agree on a host the store does not know,
			// not the host of the attachment's addresses.
			editJSON(t, st, "p/e/rcnet/node-a-0/eth0", func(m map[string]any) { m["host"] = "node-z" })
			editJSON(t, st, "p/a/tcp/08080", func(m map[string]any) { m["ih"] = "node-z" })
		}},
		// Container networks (the real ipam-ring made them, per-container
		// gateways, one from the pool and two in a special subnet).
		{rc.InvCNetValid, func(t *testing.T, c *cluster, st store.Store, addrs map[string][]string) {
			// cn-0's gateway is its own ip.
			editJSON(t, st, "o/cni/"+cnNetwork+"/cn-0/eth0", func(rec map[string]any) {
				setAddrOfRole(rec, "gw", addrs["cn-0"][0])
			})
		}},
		{rc.InvCNetPair, func(t *testing.T, c *cluster, st store.Store, addrs map[string][]string) {
			// cn-2's gateway record names cn-1's gateway.
			editJSON(t, st, "o/cni/"+cnNetwork+"/cn-2/eth0", func(rec map[string]any) {
				setAddrOfRole(rec, "gw", addrs["cn-1"][1])
			})
		}},
	}
	lab := netns.New(t, "rckl")
	lab.MustRun(t, "ip", "link", "set", "lo", "up")
	for _, tc := range cases {
		t.Run(tc.invariant, func(t *testing.T) {
			c := &cluster{etcd: etcd, prefix: "/" + netns.Unique("rck-") + "/"}
			addrs := map[string][]string{}
			for _, h := range hosts {
				for i := range 2 {
					ctr := fmt.Sprintf("%s-%d", h, i)
					addrs[ctr] = c.add(t, h, ctr, "", nil)
				}
			}
			// Published ports, by the real portmap-ingress: an ingress, a
			// host-mode and a dynamic ingress port.
			c.publish(t, lab, "node-a", "node-a-0", addrs["node-a-0"][0], map[string]any{"hostPort": 8080, "containerPort": 80, "protocol": "tcp", "mode": "ingress"})
			c.publish(t, lab, "node-b", "node-b-0", addrs["node-b-0"][0], map[string]any{"hostPort": 5353, "containerPort": 53, "protocol": "udp"})
			c.publish(t, lab, "node-c", "node-c-0", addrs["node-c-0"][0], map[string]any{"hostPort": 0, "containerPort": 80, "protocol": "tcp", "mode": "ingress"})
			// Container networks with their own gateways, by the real
			// ipam-ring: ip and gateway of each.
			for i, args := range []string{"", "SUBNET=10.99.0.0/24;IP=10.99.0.5", "SUBNET=10.99.0.0/24;IP=10.99.0.6"} {
				ctr := fmt.Sprintf("cn-%d", i)
				addrs[ctr] = c.addCNet(t, "node-c", ctr, args)
			}
			if out := c.ok(t, "check"); out != "ok: every invariant holds\n" {
				t.Fatalf("check of a healthy store:\n%s", out)
			}
			// The hosts' agents stop first: an agent that finds its host's
			// state changed would repair some of it (Readopt) before the
			// check reads what was written.
			c.stopAgents(t)
			st := cnitest.OpenStore(t, c.store())
			tc.corrupt(t, c, st, addrs)
			r := c.ringctl(t, "check")
			var v struct{ Violations []pool.Violation }
			rj := c.jsonOf(t, &v, "check")
			if r.code != rc.ExitFindings || rj.code != rc.ExitFindings {
				t.Fatalf("check exit %d (json %d), want %d\n%s%s", r.code, rj.code, rc.ExitFindings, r.stdout, r.stderr)
			}
			// One entry per violation; a long one continues on indented lines.
			var lines []string
			for _, l := range strings.Split(strings.TrimSuffix(r.stdout, "\n"), "\n") {
				if strings.HasPrefix(l, "    ") && len(lines) > 0 {
					lines[len(lines)-1] += " " + strings.TrimSpace(l)
					continue
				}
				lines = append(lines, l)
			}
			if len(lines) != len(v.Violations) {
				t.Errorf("%d lines for %d violations:\n%s", len(lines), len(v.Violations), r.stdout)
			}
			found := false
			for i, l := range lines {
				if i < len(v.Violations) && l != v.Violations[i].String() {
					t.Errorf("entry %q is not violation %q", l, v.Violations[i])
				}
				found = found || strings.HasPrefix(l, tc.invariant+": ")
			}
			checkWidth(t, r.stdout)
			if !found {
				t.Fatalf("check did not report %s:\n%s", tc.invariant, r.stdout)
			}
			t.Logf("ringctl check:\n%s", r.stdout)
		})
	}
}

// cnNetwork is the network of TestCheck's container networks: gateway
// mode per-container, one IPv4 range set.
const cnNetwork = "rccn"

// addCNet runs the real ipam-ring's ADD for ctr on cnNetwork and returns
// the container's ip and its gateway.
func (c *cluster) addCNet(t *testing.T, host, ctr, cniArgs string) []string {
	t.Helper()
	ipam := c.ipam(t, host, map[string]any{"gatewayMode": "per-container", "ranges": [][]map[string]string{{{"subnet": "198.18.21.0/24"}}}})
	conf, _ := json.Marshal(map[string]any{"cniVersion": "1.1.0", "name": cnNetwork, "type": "ptp", "ipam": ipam})
	var r struct {
		IPs []struct {
			Address string `json:"address"`
			Gateway string `json:"gateway"`
		} `json:"ips"`
	}
	if err := json.Unmarshal(ipamExec(t, "ADD", conf, ctr, cniArgs), &r); err != nil || len(r.IPs) != 1 || r.IPs[0].Gateway == "" {
		t.Fatalf("per-container ADD of %s: %+v %v", ctr, r, err)
	}
	return []string{strings.Split(r.IPs[0].Address, "/")[0], r.IPs[0].Gateway}
}

// setAddrOfRole sets the address of the owner record's entry of role.
func setAddrOfRole(rec map[string]any, role, addr string) {
	for _, x := range rec["addrs"].([]any) {
		if x := x.(map[string]any); x["role"] == role {
			x["addr"] = addr
		}
	}
}

func get(t *testing.T, st store.Store, key string) []byte {
	t.Helper()
	kvs, err := st.Get(context.Background(), key)
	if err != nil || !kvs[0].Exists() {
		t.Fatalf("get %s: %v (exists %v)", key, err, err == nil && kvs[0].Exists())
	}
	return kvs[0].Value
}

func put(t *testing.T, st store.Store, key, value string) {
	t.Helper()
	if err := st.Commit(context.Background(), nil, []store.Op{store.Put(key, []byte(value))}); err != nil {
		t.Fatal(err)
	}
}

func editJSON(t *testing.T, st store.Store, key string, edit func(map[string]any)) {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal(get(t, st, key), &m); err != nil {
		t.Fatal(err)
	}
	edit(m)
	b, _ := json.Marshal(m)
	put(t, st, key, string(b))
}

// 3. import host-local on a data dir written by the real host-local plugin
// (cnitool, bridge, real namespaces): after switching the conflist to
// ipam-ring, CHECK passes for the same containers with the same addresses,
// new ADDs never reuse them, DEL releases them. An address another owner
// holds is refused; a second import changes nothing.
func TestImportHostLocal(t *testing.T) {
	netns.RequireRoot(t)
	host := netns.New(t, "rcih")
	name := netns.Unique("rci-")
	t.Cleanup(func() {
		// cnitool keeps its results in libcni's default cache.
		matches, _ := filepath.Glob(filepath.Join("/var/lib/cni/results", name+"-*"))
		for _, m := range matches {
			os.Remove(m)
		}
	})
	dir := t.TempDir()
	dataDir := filepath.Join(dir, "host-local")
	ranges := [][]map[string]string{{{"subnet": "198.18.30.0/24"}}}
	bridge := func(ipam map[string]any) map[string]any {
		return map[string]any{"type": "bridge", "bridge": "rcbr0", "isGateway": true, "ipMasq": false, "ipam": ipam}
	}
	writeConfList := func(sub string, ipam map[string]any) string {
		d := filepath.Join(dir, sub)
		os.MkdirAll(d, 0o755)
		b, _ := json.Marshal(map[string]any{"cniVersion": "1.1.0", "name": name, "plugins": []any{bridge(ipam)}})
		writeFile(t, filepath.Join(d, name+".conflist"), b)
		return d
	}
	hlConf := writeConfList("host-local", map[string]any{"type": "host-local", "dataDir": dataDir, "ranges": ranges})
	st := map[string]any{"type": "local", "path": filepath.Join(dir, "store.db")}
	ringConf := writeConfList("ipam-ring", map[string]any{"type": "ipam-ring", "host": "node-h", "store": st, "ranges": ranges, "timeout": "30s"})
	cniPath := cnitest.PluginDir(t, cnitest.IPAMBin, "bridge", "host-local", "loopback")
	cnitool := func(conf string, args ...string) (string, error) {
		ctx, cancel := context.WithTimeout(context.Background(), cnitest.OpTimeout)
		defer cancel()
		cmd := exec.CommandContext(ctx, "ip", append([]string{"netns", "exec", host.Name, cnitest.RefBin(t, "cnitool")}, args...)...)
		cmd.Env = append(os.Environ(), "NETCONFPATH="+conf, "CNI_PATH="+cniPath)
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	add := func(conf string, ctr *netns.NS) string {
		t.Helper()
		out, err := cnitool(conf, "add", name, ctr.Path)
		if err != nil {
			t.Fatalf("cnitool add: %v\n%s", err, out)
		}
		var r addResult
		if err := json.Unmarshal([]byte(out), &r); err != nil || len(r.IPs) != 1 {
			t.Fatalf("cnitool add printed %q: %v", out, err)
		}
		return strings.Split(r.IPs[0].Address, "/")[0]
	}
	ctrs := []*netns.NS{netns.New(t, "rcic"), netns.New(t, "rcic"), netns.New(t, "rcic")}
	var ips []string
	for _, c := range ctrs {
		ips = append(ips, add(hlConf, c))
	}
	netDir := filepath.Join(dataDir, name)
	if files, _ := os.ReadDir(netDir); len(files) < 3 {
		t.Fatalf("host-local's data dir holds %v", files)
	}
	ringctl := func(args ...string) run {
		return ringctlRun(t, nil, append([]string{"--config", filepath.Join(ringConf, name+".conflist")}, args...)...)
	}
	// Another owner took the third container's address in the store first.
	squatter := netConf(map[string]any{"type": "ipam-ring", "host": "node-x", "store": st, "ranges": ranges})
	squatter = []byte(strings.Replace(string(squatter), `"name":"`+network+`"`, `"name":"`+name+`"`, 1))
	if _, err := ipamExecErr("ADD", squatter, "squatter", "IP="+ips[2]); err != nil {
		t.Fatal(err)
	}

	dry := ringctl("import", "host-local", netDir, "--dry-run")
	real := ringctl("import", "host-local", netDir)
	var rep rc.ImportReport
	if err := json.Unmarshal([]byte(ringctl("import", "host-local", netDir, "--dry-run", "--json").stdout), &rep); err != nil {
		t.Fatal(err)
	}
	if real.code != rc.ExitFindings || dry.code != rc.ExitFindings || dry.stdout != real.stdout+"# dry run: nothing was changed\n" {
		t.Fatalf("import: exit %d (dry run %d)\ndry run:\n%s\nreal:\n%s%s", real.code, dry.code, dry.stdout, real.stdout, real.stderr)
	}
	checkWidth(t, real.stdout)
	results := map[string]string{}
	for _, o := range rep.Owners {
		results[o.Addrs[0].String()] = o.Result
		if o.Owner.Kind != pool.KindCNI || o.Owner.Network != name || o.Owner.IfName != "eth0" || !strings.HasPrefix(o.Owner.ContainerID, "cnitool-") {
			t.Errorf("imported owner %+v", o.Owner)
		}
	}
	// (the json dry run ran after the import: the first two are unchanged now)
	if results[ips[0]] != rc.ImportUnchanged || results[ips[1]] != rc.ImportUnchanged || results[ips[2]] != rc.ImportRefused ||
		!strings.Contains(strings.Join(strings.Fields(real.stdout), " "), "already in use by cni/"+name+"/squatter/eth0 on host node-x") {
		t.Fatalf("import results %v\n%s", results, real.stdout)
	}
	// The squatter goes; the import finishes the job and then changes nothing.
	if _, err := ipamExecErr("DEL", squatter, "squatter", ""); err != nil {
		t.Fatal(err)
	}
	if r := ringctl("import", "host-local", netDir); r.code != 0 || strings.Count(r.stdout, "adopted ") != 1 || strings.Count(r.stdout, "unchanged ") != 2 {
		t.Fatalf("second import: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	if r := ringctl("import", "host-local", netDir); r.code != 0 || strings.Count(r.stdout, "unchanged ") != 3 {
		t.Fatalf("third import: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}

	// The conflist now names ipam-ring: CHECK passes for the same
	// containers with the same addresses (prevResult is host-local's).
	for i, c := range ctrs {
		if out, err := cnitool(ringConf, "check", name, c.Path); err != nil {
			t.Fatalf("cnitool check of container %d (%s) on ipam-ring: %v\n%s", i, ips[i], err, out)
		}
	}
	// New ADDs never reuse them.
	for range 3 {
		if ip := add(ringConf, netns.New(t, "rcin")); slices.Contains(ips, ip) {
			t.Fatalf("a new container got %s, an imported address (%v)", ip, ips)
		}
	}
	// DEL releases them.
	if out, err := cnitool(ringConf, "del", name, ctrs[0].Path); err != nil {
		t.Fatalf("cnitool del: %v\n%s", err, out)
	}
	var rows []rc.AddrRow
	json.Unmarshal([]byte(ringctl("ls", "--json").stdout), &rows)
	held := map[string]bool{}
	for _, r := range rows {
		held[r.Addr.String()] = true
	}
	if held[ips[0]] || !held[ips[1]] || !held[ips[2]] || len(rows) != 5 {
		t.Fatalf("after DEL of the first container the store holds %v, imported %v", held, ips)
	}
	if r := ringctl("check"); r.code != 0 {
		t.Fatalf("check after the migration: %s%s", r.stdout, r.stderr)
	}
}
