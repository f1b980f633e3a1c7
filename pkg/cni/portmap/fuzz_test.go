package portmap

import (
	"errors"
	"slices"
	"testing"

	"github.com/ringipam/ringipam/pkg/portalloc"
)

// FuzzLoadMappings feeds Load arbitrary network configurations and CNI_ARGS
// (runtimeConfig portMappings in both spellings, the publish annotation,
// PUBLISH=): it never panics, every refusal is a bad configuration (CNI code
// 7), and whatever it accepts is a spec the allocator takes as it is.
func FuzzLoadMappings(f *testing.F) {
	f.Add(`{"cniVersion":"1.0.0","name":"web","host":"h1","mode":"ingress","runtimeConfig":{"portMappings":[{"hostPort":8080,"containerPort":80,"protocol":"TCP"},{"HostPort":0,"ContainerPort":53,"Protocol":"udp","HostIP":"198.18.0.9"}]}}`, "IgnoreUnknown=1;PUBLISH=7000/tcp")
	f.Add(`{"name":"web","host":"h1","runtimeConfig":{"io.kubernetes.cri.pod-annotations":{"ringipam.io/publish":"443/tcp, 9000/udp:19000=host"}}}`, "")
	f.Add(`{"name":"n","dynamicRange":"100-90","timeout":"1s","table":"t","dataplane":"iptables"}`, "PUBLISH=80/sctp:0=ingress")
	f.Add(`{"name":"n","host":"h","prevResult":{"cniVersion":"1.0.0","ips":[{"address":"198.18.0.5/24"}]},"runtimeConfig":{"portMappings":[{"hostPort":-1,"containerPort":70000}]}}`, "PUBLISH=,,80")
	f.Add(`{"name":"n","host":"h","cni.dev/valid-attachments":[{"containerID":"a","ifname":"eth0"}]}`, "PUBLISH=80/tcp:x")
	f.Fuzz(func(t *testing.T, stdin, cniArgs string) {
		c, err := Load([]byte(stdin), cniArgs)
		if err != nil {
			if !errors.Is(err, ErrBadConfig) || CNIError(err).Code != 7 {
				t.Fatalf("refusal %v is not a bad configuration (code %d)", err, CNIError(err).Code)
			}
			return
		}
		if c.Network == "" || c.Host == "" || c.Lo == 0 || c.Lo > c.Hi || c.Timeout <= 0 || c.Table == "" {
			t.Fatalf("accepted an incomplete configuration: %+v", c)
		}
		if c.MappingsErr != nil {
			if !errors.Is(c.MappingsErr, ErrBadConfig) || CNIError(c.MappingsErr).Code != 7 {
				t.Fatalf("mappings refused with %v", c.MappingsErr)
			}
			return
		}
		for i, m := range c.Mappings {
			if m.ContainerPort == 0 || !slices.Contains(portalloc.Protocols, m.Protocol) ||
				(m.Mode != portalloc.Host && m.Mode != portalloc.Ingress) ||
				(m.Mode == portalloc.Ingress && m.HostIP.IsValid()) {
				t.Fatalf("mapping %d accepted: %+v", i, m)
			}
		}
		if err := portalloc.ValidateSpec(c.spec()); err != nil {
			t.Fatalf("accepted mappings the allocator refuses: %v", err)
		}
	})
}
