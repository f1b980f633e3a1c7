package portmap

import (
	"errors"
	"strings"
	"testing"

	"github.com/ringipam/ringipam/pkg/portalloc"
)

func TestLoadMappings(t *testing.T) {
	conf := `{"cniVersion":"1.0.0","name":"web","type":"portmap-ingress","host":"h1","mode":"ingress",
	 "runtimeConfig":{"portMappings":[
	   {"hostPort":8080,"containerPort":80,"protocol":"TCP"},
	   {"HostPort":0,"ContainerPort":53,"Protocol":"udp","HostIP":"198.18.0.9"},
	   {"hostPort":2222,"containerPort":22,"mode":"host"}],
	  "io.kubernetes.cri.pod-annotations":{"ringipam.io/publish":"443/tcp, 9000/udp:19000=host"}}}`
	c, err := Load([]byte(conf), "IgnoreUnknown=1;PUBLISH=7000/tcp")
	if err != nil {
		t.Fatal(err)
	}
	want := []Mapping{
		{HostPort: 8080, ContainerPort: 80, Protocol: "tcp", Mode: portalloc.Ingress},
		{HostPort: 0, ContainerPort: 53, Protocol: "udp", Mode: portalloc.Ingress},
		{HostPort: 2222, ContainerPort: 22, Protocol: "tcp", Mode: portalloc.Host},
		{HostPort: 0, ContainerPort: 443, Protocol: "tcp", Mode: portalloc.Ingress},
		{HostPort: 19000, ContainerPort: 9000, Protocol: "udp", Mode: portalloc.Host},
		{HostPort: 0, ContainerPort: 7000, Protocol: "tcp", Mode: portalloc.Ingress},
	}
	if len(c.Mappings) != len(want) {
		t.Fatalf("mappings %+v", c.Mappings)
	}
	for i := range want {
		m := c.Mappings[i]
		m.HostIP = want[i].HostIP
		if m != want[i] {
			t.Errorf("mapping %d = %+v, want %+v", i, c.Mappings[i], want[i])
		}
	}
	if c.Mappings[1].HostIP.String() != "198.18.0.9" {
		t.Errorf("host IP %v", c.Mappings[1].HostIP)
	}
	// An ingress mapping with a host IP is refused by the allocator's spec
	// check, with code 7, for ADD and CHECK (DEL needs no mappings).
	if err := c.MappingsErr; !errors.Is(err, ErrBadConfig) || CNIError(err).Code != 7 {
		t.Errorf("ingress with hostIP: %v", err)
	}
	for _, bad := range []string{
		`{"name":"n","mode":"cluster"}`,
		`{"name":"n","dataplane":"ebpf"}`,
		`{"name":"n","table":"a b"}`,
		`{"name":"n","timeout":"-1s"}`,
		`{"name":"n","store":{"type":"etcd"}}`,
		`{"name":"n","dynamicRange":"5-1"}`,
		`{"name":"a/b"}`,
		`{"name":"n","pad":"` + strings.Repeat("a", MaxConfig) + `"}`, // larger than MaxConfig
	} {
		if _, err := Load([]byte(bad), ""); !errors.Is(err, ErrBadConfig) || CNIError(err).Code != 7 {
			t.Errorf("%s: %v", bad, err)
		}
	}
	// Other plugins' and the runtime's keys are accepted (lenient decode).
	if _, err := Load([]byte(`{"name":"n","type":"portmap-ingress","capabilities":{"portMappings":true},"snat":true,"runtimeConfig":{"bandwidth":{}}}`), ""); err != nil {
		t.Errorf("unknown keys refused: %v", err)
	}
	// Bad mappings fail ADD and CHECK (code 7) but not the load: DEL and
	// GC need no mappings.
	for _, bad := range []string{
		`{"name":"n","runtimeConfig":{"portMappings":[{"hostPort":70000,"containerPort":80}]}}`,
		`{"name":"n","runtimeConfig":{"portMappings":[{"hostPort":80}]}}`,
		`{"name":"n","runtimeConfig":{"portMappings":[{"hostPort":80,"containerPort":80,"protocol":"icmp"}]}}`,
		`{"name":"n","runtimeConfig":{"portMappings":[{"hostPort":80,"containerPort":80,"hostIP":"not-an-ip"}]}}`,
		`{"name":"n","prevResult":{"ips":"nonsense"}}`,
	} {
		c, err := Load([]byte(bad), "PUBLISH=80/tcp")
		if err != nil || !errors.Is(c.MappingsErr, ErrBadConfig) || CNIError(c.MappingsErr).Code != 7 {
			t.Errorf("%s: %v, mappings %v", bad, err, c.MappingsErr)
		}
	}
}
