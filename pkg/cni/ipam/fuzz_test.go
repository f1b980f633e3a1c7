package ipam

import (
	"errors"
	"strings"
	"testing"

	"github.com/ringipam/ringipam/pkg/pool"
)

// FuzzConfigAndArgs feeds arbitrary network configurations, CNI_ARGS and
// runtimeConfig to the loader: it never panics, every refusal wraps
// ErrBadConfig (CNI code 7), and every accepted configuration is one the
// core can use: normalized pools, a host name, positive timeouts, owners
// that pass the pool's rules.
func FuzzConfigAndArgs(f *testing.F) {
	f.Add([]byte(`{"cniVersion":"1.0.0","name":"n","type":"bridge","ipam":{"type":"ipam-ring","host":"h","ranges":[[{"subnet":"198.18.0.0/24"}]]}}`), "")
	f.Add([]byte(`{"cniVersion":"1.1.0","name":"n","ipam":{"type":"ipam-ring","host":"h","reservationFromPod":true,"ranges":[[{"subnet":"198.18.0.0/24","rangeStart":"198.18.0.10","rangeEnd":"198.18.0.20","gateway":"198.18.0.1"}],[{"subnet":"2001:db8::/64"}]],"exclude":["198.18.0.15"]}}`),
		"IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=web-0;K8S_POD_INFRA_CONTAINER_ID=abc")
	f.Add([]byte(`{"cniVersion":"1.0.0","name":"n","ipam":{"type":"ipam-ring","host":"h","ranges":[[{"subnet":"198.18.0.0/24"}]]},"runtimeConfig":{"ips":["198.18.0.7/24"],"ipRanges":[[{"subnet":"198.18.9.0/24"}]]}}`), "IP=198.18.0.8")
	f.Add([]byte(`{"cniVersion":"1.0.0","name":"n","ipam":{"type":"ipam-ring","host":"h","gatewayMode":"per-container","ranges":[[{"subnet":"198.18.0.0/24"}]]}}`), "SUBNET=198.19.1.0/24;IP=198.19.1.5")
	f.Add([]byte(`{"cniVersion":"1.0.0","name":"n","ipam":{"type":"ipam-ring","host":"h","subnet":"198.18.0.0/24","store":{"type":"etcd","endpoints":["https://127.0.0.1:2379"],"tls":{"ca":"/x"}},"timeout":"5s","reservationHold":"1m"}}`), "RESERVATION=r1")
	f.Add([]byte(`{"cniVersion":"1.1.0","name":"n","ipam":{"type":"ipam-ring","host":"h","ranges":[[{"subnet":"198.18.0.0/24"}]]},"cni.dev/valid-attachments":[{"containerID":"c","ifname":"eth0"}]}`), "")
	f.Fuzz(func(t *testing.T, stdin []byte, args string) {
		c, err := Load(stdin, args)
		if err != nil {
			if !errors.Is(err, ErrBadConfig) {
				t.Fatalf("refusal %v does not wrap ErrBadConfig (code 7)", err)
			}
			if code := CNIError(err).Code; code != 7 {
				t.Fatalf("refusal %v maps to code %d", err, code)
			}
			return
		}
		if c.Host == "" || c.Network == "" || c.Timeout <= 0 || c.ReservationHold < 0 || len(c.RangeSets) == 0 {
			t.Fatalf("accepted an unusable configuration: %+v", c)
		}
		for _, rs := range c.RangeSets {
			n, err := rs.Def.Normalize()
			if err != nil {
				t.Fatalf("accepted pool %+v that does not normalize: %v", rs.Def, err)
			}
			if n.Name != rs.Def.Name || len(n.Ranges) != len(rs.Def.Ranges) {
				t.Fatalf("pool %+v is not in canonical form (%+v)", rs.Def, n)
			}
		}
		o := c.Owner(Attachment{ContainerID: "ctr", IfName: "eth0"})
		if err := o.Validate(); err != nil && !strings.ContainsRune(c.Network, '/') {
			t.Fatalf("network %q gives an invalid owner: %v", c.Network, err)
		}
		if _, err := pool.New(nil, c.Host); err != nil {
			t.Fatalf("host %q accepted but refused by the pool: %v", c.Host, err)
		}
	})
}
