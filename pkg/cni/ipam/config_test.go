package ipam

import (
	"errors"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/ringipam/ringipam/pkg/pool"
)

func conf(ipam string) []byte {
	return []byte(`{"cniVersion":"1.1.0","name":"net1","type":"bridge","ipam":` + ipam + `}`)
}

func TestLoadDefaults(t *testing.T) {
	c, err := Load(conf(`{"type":"ipam-ring","host":"h1","ranges":[[{"subnet":"198.18.0.0/24"}],[{"subnet":"2001:db8::/64","rangeStart":"2001:db8::10","rangeEnd":"2001:db8::ff"}]]}`), "")
	if err != nil {
		t.Fatal(err)
	}
	want := []RangeSet{
		{Def: pool.Def{Name: "net1-0", Ranges: []pool.Range{{
			Subnet:  netip.MustParsePrefix("198.18.0.0/24"),
			Start:   netip.MustParseAddr("198.18.0.1"),
			End:     netip.MustParseAddr("198.18.0.254"),
			Gateway: netip.MustParseAddr("198.18.0.1"),
		}}}},
		{Def: pool.Def{Name: "net1-1", Ranges: []pool.Range{{
			Subnet:  netip.MustParsePrefix("2001:db8::/64"),
			Start:   netip.MustParseAddr("2001:db8::10"),
			End:     netip.MustParseAddr("2001:db8::ff"),
			Gateway: netip.MustParseAddr("2001:db8::1"),
		}}}},
	}
	if diff := cmp.Diff(want, c.RangeSets, cmp.Comparer(func(a, b netip.Addr) bool { return a == b }), cmp.Comparer(func(a, b netip.Prefix) bool { return a == b })); diff != "" {
		t.Errorf("range sets (-want +got):\n%s", diff)
	}
	if c.Host != "h1" || c.GatewayMode != GatewayShared || c.Timeout != DefaultTimeout || c.Network != "net1" || c.HasValid || c.Reservation != "" {
		t.Errorf("defaults: %+v", c)
	}
}

func TestLoadCases(t *testing.T) {
	const r4 = `"ranges":[[{"subnet":"198.18.0.0/24"}]]`
	const r46 = `"ranges":[[{"subnet":"198.18.0.0/24"}],[{"subnet":"2001:db8::/64"}]]`
	tests := []struct {
		name    string
		ipam    string
		args    string
		extra   string // top-level keys
		check   func(t *testing.T, c *Config)
		wantErr string
	}{
		{name: "no ranges", ipam: `{"host":"h"}`, wantErr: "no IP ranges"},
		{name: "bad subnet", ipam: `{"host":"h","ranges":[[{"subnet":"198.18.0.0/33"}]]}`, wantErr: "ranges[0]"},
		{name: "unknown ipam key", ipam: `{"host":"h","rnages":[]}`, wantErr: "unknown field"},
		{name: "unknown key in a range", ipam: `{"host":"h","ranges":[[{"subnet":"198.18.0.0/24","gatway":"198.18.0.1"}]]}`, wantErr: "unknown field"},
		{name: "other plugins' top-level keys accepted", ipam: `{"host":"h",` + r4 + `}`, extra: `"bridge":"cni0","isGateway":true,"capabilities":{"ips":true},"dns":{"nameservers":["x"]},`},
		{name: "unknown runtimeConfig keys accepted", ipam: `{"host":"h",` + r4 + `}`, extra: `"runtimeConfig":{"portMappings":[{"hostPort":80}],"ips":["198.18.0.9"]},`, check: func(t *testing.T, c *Config) {
			if c.RangeSets[0].Static != netip.MustParseAddr("198.18.0.9") {
				t.Errorf("static %v", c.RangeSets[0].Static)
			}
		}},
		{name: "configuration larger than MaxConfig", ipam: `{"host":"h",` + r4 + `}`, extra: `"pad":"` + strings.Repeat("a", MaxConfig) + `",`, wantErr: "larger than"},
		{name: "host-local dataDir accepted", ipam: `{"host":"h","dataDir":"/x",` + r4 + `}`},
		{name: "start after end", ipam: `{"host":"h","ranges":[[{"subnet":"198.18.0.0/24","rangeStart":"198.18.0.9","rangeEnd":"198.18.0.2"}]]}`, wantErr: "after"},
		{name: "overlapping sets", ipam: `{"host":"h","ranges":[[{"subnet":"198.18.0.0/24"}],[{"subnet":"198.18.0.0/25"}]]}`, wantErr: "overlap"},
		{name: "legacy single range", ipam: `{"host":"h","subnet":"198.18.1.0/24","gateway":"198.18.1.254"}`, check: func(t *testing.T, c *Config) {
			if g := c.RangeSets[0].Def.Ranges[0].Gateway; g != netip.MustParseAddr("198.18.1.254") {
				t.Errorf("gateway %v", g)
			}
		}},
		{name: "pools override", ipam: `{"host":"h","pools":["a","b"],` + r46 + `}`, check: func(t *testing.T, c *Config) {
			if c.RangeSets[0].Def.Name != "a" || c.RangeSets[1].Def.Name != "b" {
				t.Errorf("names %v", c.Defs())
			}
		}},
		{name: "pools count mismatch", ipam: `{"host":"h","pools":["a"],` + r46 + `}`, wantErr: "names 1 pools"},
		{name: "bad pool name", ipam: `{"host":"h","pools":["a/b"],` + r4 + `}`, wantErr: "pool name"},
		{name: "exclude per family", ipam: `{"host":"h","exclude":["198.18.0.7","198.18.0.64/26","2001:db8::5"],` + r46 + `}`, check: func(t *testing.T, c *Config) {
			if len(c.RangeSets[0].Def.Exclude) != 2 || len(c.RangeSets[1].Def.Exclude) != 1 {
				t.Errorf("excludes %v", c.Defs())
			}
		}},
		{name: "bad exclude", ipam: `{"host":"h","exclude":["nope"],` + r4 + `}`, wantErr: "exclude"},
		{name: "static from CNI_ARGS comma list", ipam: `{"host":"h",` + r46 + `}`, args: "IP=198.18.0.9,2001:db8::9", check: func(t *testing.T, c *Config) {
			if c.RangeSets[0].Static != netip.MustParseAddr("198.18.0.9") || c.RangeSets[1].Static != netip.MustParseAddr("2001:db8::9") {
				t.Errorf("statics %+v", c.RangeSets)
			}
		}},
		{name: "static from ips capability with prefix", ipam: `{"host":"h",` + r4 + `}`, extra: `"runtimeConfig":{"ips":["198.18.0.10/24"]},`, check: func(t *testing.T, c *Config) {
			if c.RangeSets[0].Static != netip.MustParseAddr("198.18.0.10") {
				t.Errorf("static %v", c.RangeSets[0].Static)
			}
		}},
		// What containerd 1.6 sends (LAB.md, "containerd over CRI"): the
		// K8S_* keys with IgnoreUnknown, the runtimeConfig of the main
		// plugin's capabilities in Go field case, never "ips".
		{name: "containerd pod with ip annotation", ipam: `{"host":"h","reservationFromPod":true,` + r46 + `}`,
			args:  "IgnoreUnknown=1;K8S_POD_NAMESPACE=db;K8S_POD_NAME=db-0;K8S_POD_INFRA_CONTAINER_ID=4f1e;K8S_POD_UID=1b2c",
			extra: `"runtimeConfig":{"portMappings":[{"HostPort":38080,"ContainerPort":80,"Protocol":"tcp","HostIP":""}],"dns":{"Servers":["198.18.0.53"]},"io.kubernetes.cri.pod-annotations":{"ringipam.io/ip":" 198.18.0.10 , 2001:db8::10","other":"x"}},`,
			check: func(t *testing.T, c *Config) {
				if c.RangeSets[0].Static != netip.MustParseAddr("198.18.0.10") || c.RangeSets[1].Static != netip.MustParseAddr("2001:db8::10") {
					t.Errorf("statics %+v", c.RangeSets)
				}
				if c.Reservation != "db/db-0" {
					t.Errorf("reservation %q", c.Reservation)
				}
				// The pod, recorded with the allocation (the agent's
				// collection of vanished pods).
				if c.Pod == nil || *c.Pod != (pool.PodRef{Namespace: "db", Name: "db-0", UID: "1b2c"}) {
					t.Errorf("pod %+v", c.Pod)
				}
			}},
		{name: "containerd pod without ip annotation", ipam: `{"host":"h",` + r4 + `}`, args: "IgnoreUnknown=1;K8S_POD_NAMESPACE=db;K8S_POD_NAME=db-0",
			extra: `"runtimeConfig":{"io.kubernetes.cri.pod-annotations":{"other":"198.18.0.10"}},`,
			check: func(t *testing.T, c *Config) {
				if c.RangeSets[0].Static.IsValid() || c.Reservation != "" {
					t.Errorf("static %v reservation %q", c.RangeSets[0].Static, c.Reservation)
				}
			}},
		{name: "ip annotation not an address", ipam: `{"host":"h",` + r4 + `}`, extra: `"runtimeConfig":{"io.kubernetes.cri.pod-annotations":{"ringipam.io/ip":"db-0"}},`, wantErr: "pod annotation ringipam.io/ip"},
		{name: "ip annotation outside ranges", ipam: `{"host":"h",` + r4 + `}`, extra: `"runtimeConfig":{"io.kubernetes.cri.pod-annotations":{"ringipam.io/ip":"198.19.0.1"}},`, wantErr: "not in any configured range"},
		{name: "ip annotation and CNI_ARGS IP disagree", ipam: `{"host":"h",` + r4 + `}`, args: "IP=198.18.0.11", extra: `"runtimeConfig":{"io.kubernetes.cri.pod-annotations":{"ringipam.io/ip":"198.18.0.10"}},`, wantErr: "two IPs"},
		{name: "static outside ranges", ipam: `{"host":"h",` + r4 + `}`, args: "IP=198.19.0.1", wantErr: "not in any configured range"},
		{name: "two statics one set", ipam: `{"host":"h",` + r4 + `}`, args: "IP=198.18.0.1,198.18.0.2", wantErr: "two IPs"},
		{name: "unknown CNI_ARGS", ipam: `{"host":"h",` + r4 + `}`, args: "FOO=1", wantErr: "unknown keys"},
		{name: "unknown CNI_ARGS ignored", ipam: `{"host":"h",` + r4 + `}`, args: "IgnoreUnknown=1;FOO=1"},
		{name: "reservation explicit", ipam: `{"host":"h","reservationFromPod":true,` + r4 + `}`, args: "RESERVATION=db-0;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p", check: func(t *testing.T, c *Config) {
			if c.Reservation != "db-0" {
				t.Errorf("reservation %q", c.Reservation)
			}
		}},
		{name: "reservation from pod", ipam: `{"host":"h","reservationFromPod":true,` + r4 + `}`, args: "IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p", check: func(t *testing.T, c *Config) {
			if c.Reservation != "ns/p" {
				t.Errorf("reservation %q", c.Reservation)
			}
		}},
		{name: "reservation annotated: annotated pod", ipam: `{"host":"h","reservationFromPod":"annotated",` + r4 + `}`, args: "IgnoreUnknown=1;K8S_POD_NAMESPACE=db;K8S_POD_NAME=db-0",
			extra: `"runtimeConfig":{"io.kubernetes.cri.pod-annotations":{"ringipam.io/reservation":"true"}},`,
			check: func(t *testing.T, c *Config) {
				if c.Reservation != "db/db-0" {
					t.Errorf("reservation %q, want db/db-0", c.Reservation)
				}
			}},
		{name: "reservation annotated: pod without the annotation", ipam: `{"host":"h","reservationFromPod":"annotated",` + r4 + `}`, args: "IgnoreUnknown=1;K8S_POD_NAMESPACE=web;K8S_POD_NAME=web-5d8f-x2k9q",
			extra: `"runtimeConfig":{"io.kubernetes.cri.pod-annotations":{"ringipam.io/reservation":"false","other":"true"}},`,
			check: func(t *testing.T, c *Config) {
				if c.Reservation != "" {
					t.Errorf("reservation %q, want none", c.Reservation)
				}
			}},
		{name: "reservation annotated: no annotations sent", ipam: `{"host":"h","reservationFromPod":"annotated",` + r4 + `}`, args: "IgnoreUnknown=1;K8S_POD_NAMESPACE=db;K8S_POD_NAME=db-0", check: func(t *testing.T, c *Config) {
			if c.Reservation != "" {
				t.Errorf("reservation %q, want none", c.Reservation)
			}
		}},
		{name: "reservationFromPod false", ipam: `{"host":"h","reservationFromPod":false,` + r4 + `}`, args: "IgnoreUnknown=1;K8S_POD_NAMESPACE=db;K8S_POD_NAME=db-0", check: func(t *testing.T, c *Config) {
			if c.Reservation != "" {
				t.Errorf("reservation %q, want none", c.Reservation)
			}
		}},
		{name: "reservationFromPod of another mode", ipam: `{"host":"h","reservationFromPod":"yes",` + r4 + `}`, wantErr: `want true, false or "annotated"`},
		{name: "pod args without reservationFromPod", ipam: `{"host":"h",` + r4 + `}`, args: "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p", check: func(t *testing.T, c *Config) {
			if c.Reservation != "" {
				t.Errorf("reservation %q", c.Reservation)
			}
		}},
		{name: "ipRanges prepended with content name", ipam: `{"host":"h",` + r4 + `}`, extra: `"runtimeConfig":{"ipRanges":[[{"subnet":"198.19.4.0/24"}]]},`, check: func(t *testing.T, c *Config) {
			if len(c.RangeSets) != 2 || !c.RangeSets[0].FromRuntime || !strings.HasPrefix(c.RangeSets[0].Def.Name, "net1-rt-") || c.RangeSets[1].Def.Name != "net1-0" {
				t.Errorf("sets %+v", c.Defs())
			}
		}},
		{name: "gatewayMode per-container", ipam: `{"host":"h","gatewayMode":"per-container",` + r4 + `}`, check: func(t *testing.T, c *Config) {
			if c.GatewayMode != GatewayPerContainer || c.PerContainerPrefix != PrefixRange {
				t.Errorf("mode %q prefix %q", c.GatewayMode, c.PerContainerPrefix)
			}
		}},
		{name: "gatewayMode subnet is not a mode", ipam: `{"host":"h","gatewayMode":"subnet",` + r4 + `}`, wantErr: "SUBNET="},
		{name: "perContainerPrefix host", ipam: `{"host":"h","gatewayMode":"per-container","perContainerPrefix":"host",` + r4 + `}`, check: func(t *testing.T, c *Config) {
			if c.PerContainerPrefix != PrefixHost {
				t.Errorf("prefix %q", c.PerContainerPrefix)
			}
		}},
		{name: "perContainerPrefix host needs per-container", ipam: `{"host":"h","perContainerPrefix":"host",` + r4 + `}`, wantErr: "needs gatewayMode"},
		{name: "perContainerPrefix bogus", ipam: `{"host":"h","gatewayMode":"per-container","perContainerPrefix":"x",` + r4 + `}`, wantErr: "unknown"},
		{name: "special subnet", ipam: `{"host":"h","gatewayMode":"per-container",` + r46 + `}`, args: "SUBNET=198.19.7.9/24;IP=198.19.7.3,2001:db8::7", check: func(t *testing.T, c *Config) {
			want := []RangeSet{
				{Subnet: netip.MustParsePrefix("198.19.7.0/24"), Static: netip.MustParseAddr("198.19.7.3")},
				{Static: netip.MustParseAddr("2001:db8::7")},
			}
			for i, w := range want {
				if got := c.RangeSets[i]; got.Subnet != w.Subnet || got.Static != w.Static {
					t.Errorf("range set %d: subnet %v static %v, want %v %v", i, got.Subnet, got.Static, w.Subnet, w.Static)
				}
			}
		}},
		{name: "special subnet from ips capability", ipam: `{"host":"h","gatewayMode":"per-container",` + r4 + `}`, args: "SUBNET=198.19.7.0/24", extra: `"runtimeConfig":{"ips":["198.19.7.3/24"]},`, check: func(t *testing.T, c *Config) {
			if rs := c.RangeSets[0]; rs.Subnet.String() != "198.19.7.0/24" || rs.Static.String() != "198.19.7.3" {
				t.Errorf("subnet %v static %v", rs.Subnet, rs.Static)
			}
		}},
		{name: "special subnet needs per-container", ipam: `{"host":"h",` + r4 + `}`, args: "SUBNET=198.19.7.0/24;IP=198.19.7.3", wantErr: "needs gatewayMode"},
		{name: "special subnet needs an ip", ipam: `{"host":"h","gatewayMode":"per-container",` + r4 + `}`, args: "SUBNET=198.19.7.0/24", wantErr: "needs the container's ip"},
		{name: "special subnet ip outside it", ipam: `{"host":"h","gatewayMode":"per-container",` + r4 + `}`, args: "SUBNET=198.19.7.0/24;IP=198.19.8.3", wantErr: "not in any configured range or requested SUBNET"},
		{name: "special subnet overlapping the pool", ipam: `{"host":"h","gatewayMode":"per-container",` + r4 + `}`, args: "SUBNET=198.18.0.0/25;IP=198.18.0.3", wantErr: "outside the pool"},
		{name: "special subnet without a range set of its family", ipam: `{"host":"h","gatewayMode":"per-container",` + r4 + `}`, args: "SUBNET=fd00:7::/64;IP=fd00:7::3", wantErr: "no range set of its address family"},
		{name: "special subnet ambiguous family", ipam: `{"host":"h","gatewayMode":"per-container","ranges":[[{"subnet":"198.18.0.0/24"}],[{"subnet":"198.18.1.0/24"}]]}`, args: "SUBNET=198.19.7.0/24;IP=198.19.7.3", wantErr: "ambiguous"},
		{name: "two special subnets of a family", ipam: `{"host":"h","gatewayMode":"per-container",` + r4 + `}`, args: "SUBNET=198.19.7.0/24,198.19.8.0/24;IP=198.19.7.3", wantErr: "two SUBNETs"},
		{name: "bad special subnet", ipam: `{"host":"h","gatewayMode":"per-container",` + r4 + `}`, args: "SUBNET=198.19.7.0;IP=198.19.7.3", wantErr: "CNI_ARGS SUBNET"},
		{name: "gatewayMode bogus", ipam: `{"host":"h","gatewayMode":"x",` + r4 + `}`, wantErr: "unknown"},
		{name: "timeout", ipam: `{"host":"h","timeout":"2s",` + r4 + `}`, check: func(t *testing.T, c *Config) {
			if c.Timeout != 2*time.Second {
				t.Errorf("timeout %v", c.Timeout)
			}
		}},
		{name: "bad timeout", ipam: `{"host":"h","timeout":"-1s",` + r4 + `}`, wantErr: "timeout"},
		{name: "valid attachments", ipam: `{"host":"h",` + r4 + `}`, extra: `"cni.dev/valid-attachments":[{"containerID":"c1","ifname":"eth0"}],`, check: func(t *testing.T, c *Config) {
			if !c.HasValid || len(c.Valid) != 1 || c.Valid[0].ContainerID != "c1" {
				t.Errorf("valid %+v", c.Valid)
			}
		}},
		{name: "old attachments key", ipam: `{"host":"h",` + r4 + `}`, extra: `"cni.dev/attachments":[],`, check: func(t *testing.T, c *Config) {
			if !c.HasValid || len(c.Valid) != 0 {
				t.Errorf("valid %v %+v", c.HasValid, c.Valid)
			}
		}},
		{name: "null list is no list", ipam: `{"host":"h",` + r4 + `}`, extra: `"cni.dev/valid-attachments":null,`, check: func(t *testing.T, c *Config) {
			if c.HasValid {
				t.Error("null list taken as a list")
			}
		}},
		{name: "store bad type", ipam: `{"host":"h","store":{"type":"zk"},` + r4 + `}`, wantErr: "store"},
		{name: "store relative path", ipam: `{"host":"h","store":{"type":"local","path":"x.db"},` + r4 + `}`, wantErr: "absolute"},
		{name: "store etcd without endpoints", ipam: `{"host":"h","store":{"type":"etcd"},` + r4 + `}`, wantErr: "endpoint"},
		{name: "store etcd", ipam: `{"host":"h","store":{"type":"etcd","endpoints":["http://127.0.0.1:2379"],"dialTimeout":"1s"},` + r4 + `}`, check: func(t *testing.T, c *Config) {
			if c.Store.Type != "etcd" || len(c.Store.Endpoints) != 1 {
				t.Errorf("store %+v", c.Store)
			}
		}},
		{name: "route without dst", ipam: `{"host":"h","routes":[{}],` + r4 + `}`, wantErr: "dst"},
		{name: "prevResult parsed", ipam: `{"host":"h",` + r4 + `}`, extra: `"prevResult":{"cniVersion":"1.1.0","ips":[{"address":"198.18.0.2/24"}]},`, check: func(t *testing.T, c *Config) {
			if c.PrevResult == nil || len(c.PrevResult.IPs) != 1 {
				t.Errorf("prev %+v", c.PrevResult)
			}
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			in := []byte(`{"cniVersion":"1.1.0","name":"net1","type":"bridge",` + tt.extra + `"ipam":` + tt.ipam + `}`)
			c, err := Load(in, tt.args)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err = %v, want containing %q", err, tt.wantErr)
				}
				if !errors.Is(err, ErrBadConfig) || CNIError(err).Code != 7 {
					t.Fatalf("err %v is not a code-7 config error", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if tt.check != nil {
				tt.check(t, c)
			}
		})
	}
}

func FuzzLoad(f *testing.F) {
	f.Add([]byte(`{"name":"n","ipam":{"host":"h","ranges":[[{"subnet":"198.18.0.0/24"}]]}}`), "IP=198.18.0.4")
	f.Add([]byte(`{"name":"n","ipam":{"host":"h","exclude":["2001:db8::/120"],"ranges":[[{"subnet":"2001:db8::/64"}]]}}`), "")
	f.Fuzz(func(t *testing.T, in []byte, args string) {
		c, err := Load(in, args)
		if err != nil {
			if !errors.Is(err, ErrBadConfig) {
				t.Fatalf("error not wrapping ErrBadConfig: %v", err)
			}
			return
		}
		if len(c.RangeSets) == 0 || c.Host == "" || c.Timeout <= 0 {
			t.Fatalf("accepted an incomplete config: %+v", c)
		}
	})
}
