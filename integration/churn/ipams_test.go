//go:build integration

package churn

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/yaml"

	"github.com/ringipam/ringipam/cmd/ringctl/cli"
	"github.com/ringipam/ringipam/integration/cnitest"
	"github.com/ringipam/ringipam/internal/testenv"
	"github.com/ringipam/ringipam/pkg/pool"
)

// The pods' address space: one pool across the hosts for ringipam and
// whereabouts; a /24 of it per host for host-local.
const podSubnet = "198.19.0.0/16"

// ringipam starts a ringipamd agent on every host (in its namespace, on
// the LAN's etcd) and returns ipam-ring on them and a stop for the agents.
func (w *world) ringipam(t *testing.T) (ipam, func()) {
	t.Helper()
	prefix := "/" + mark + "/"
	endpoints := []string{"http://" + ringEtcdIP.String() + ":2379"}
	agents := make([]*cnitest.Agent, len(w.hosts))
	for i, h := range w.hosts {
		agents[i] = cnitest.StartAgent(t, cnitest.AgentOptions{Endpoints: endpoints, Prefix: prefix, Host: h.name, NS: h.ns})
	}
	// The checks' own client, from the test's namespace.
	st := cnitest.OpenStore(t, map[string]any{"type": "etcd", "endpoints": []string{"http://" + w.cp.Forward(t, ringEtcdIP.String()+":2379")},
		"prefix": prefix, "requestTimeout": "30s"})
	p, err := pool.New(st, "churn-check", pool.WithTimeout(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	ip := ipam{name: "ringipam", plugin: "ipam-ring", real: cnitest.IPAMBin,
		conf: func(i int) map[string]any {
			return map[string]any{"type": "ipam-ring", "ranges": [][]map[string]string{{{"subnet": podSubnet}}},
				"pools": []string{"churn"}, "host": w.hosts[i].name,
				"store": agents[i].Store(map[string]any{"type": "etcd", "endpoints": endpoints, "prefix": prefix})}
		},
		check: func(ctx context.Context, network string, live map[string]netip.Addr) ([]string, error) {
			allocs, err := p.List(ctx, pool.Filter{Kind: pool.KindCNI, Network: network})
			if err != nil {
				return nil, err
			}
			held := map[string]netip.Addr{}
			for _, a := range allocs {
				if len(a.Addrs) != 1 {
					held[a.Owner.ContainerID] = netip.Addr{}
					continue
				}
				held[a.Owner.ContainerID] = a.Addrs[0].Addr
			}
			diff := compare(held, live)
			if len(live) == 0 {
				v, err := (&cli.Ctl{Pool: p, Store: st, OrphanAfter: 48 * time.Hour}).Check(ctx)
				if err != nil {
					return diff, fmt.Errorf("ringctl check: %w", err)
				}
				for _, x := range v {
					diff = append(diff, fmt.Sprintf("ringctl check: %s: %s: %s", x.Invariant, x.Pool, x.Detail))
				}
			}
			return diff, nil
		}}
	stop := func() {
		for _, a := range agents {
			a.Stop(t)
		}
	}
	return ip, stop
}

// compare returns what differs between held (the store: container ID ->
// address) and live (the ledger).
func compare(held, live map[string]netip.Addr) []string {
	var out []string
	for id, a := range held {
		want, ok := live[id]
		switch {
		case !ok:
			out = append(out, fmt.Sprintf("leak: %s holds %v but was deleted", id, a))
		case a != want:
			out = append(out, fmt.Sprintf("mismatch: %s holds %v, its ADD answered %v", id, a, want))
		}
	}
	for id, a := range live {
		if _, ok := held[id]; !ok {
			out = append(out, fmt.Sprintf("lost: %s was answered %v but holds nothing", id, a))
		}
	}
	sort.Strings(out)
	return out
}

// hostLocal is the reference host-local plugin with a /24 of its own on
// each host (the uncoordinated floor: nothing is shared between hosts)
// and its files under the world's directory.
func (w *world) hostLocal(t *testing.T) ipam {
	t.Helper()
	dataDir := func(i int) string { return filepath.Join(w.dir, "host-local", w.hosts[i].name) }
	return ipam{name: "host-local", plugin: "host-local", real: cnitest.RefBin(t, "host-local"),
		conf: func(i int) map[string]any {
			return map[string]any{"type": "host-local", "ranges": [][]map[string]string{{{"subnet": fmt.Sprintf("198.19.%d.0/24", i)}}},
				"dataDir": dataDir(i)}
		},
		check: func(ctx context.Context, network string, live map[string]netip.Addr) ([]string, error) {
			// host-local keeps one file per address, named by it, holding
			// the container ID and the interface; and a lock and a
			// last_reserved_ip.<range set> file, which stay.
			held := map[string]netip.Addr{}
			for i := range w.hosts {
				dir := filepath.Join(dataDir(i), network)
				ents, err := os.ReadDir(dir)
				if err != nil && !os.IsNotExist(err) {
					return nil, err
				}
				for _, e := range ents {
					a, err := netip.ParseAddr(e.Name())
					if err != nil {
						continue
					}
					b, err := os.ReadFile(filepath.Join(dir, e.Name()))
					if err != nil {
						return nil, err
					}
					id, _, _ := strings.Cut(string(b), "\n")
					held[strings.TrimSpace(id)] = a
				}
			}
			return compare(held, live), nil
		}}
}

// The whereabouts resources the checks read.
var (
	crdGVR      = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}
	ippoolGVR   = schema.GroupVersionResource{Group: "whereabouts.cni.cncf.io", Version: "v1alpha1", Resource: "ippools"}
	overlapGVR  = schema.GroupVersionResource{Group: "whereabouts.cni.cncf.io", Version: "v1alpha1", Resource: "overlappingrangeipreservations"}
	apiserverTO = 3 * time.Minute // kube-apiserver's first /readyz on a loaded machine
)

// whereaboutsBin and whereaboutsCRDs are what scripts/build-whereabouts.sh
// makes (make scale-churn runs it).
var (
	whereaboutsBin  = filepath.Join(cnitest.RepoRoot, ".cache", "bin", "whereabouts")
	whereaboutsCRDs = filepath.Join(cnitest.RepoRoot, ".cache", "whereabouts", "crds")
	kubeAPIServer   = filepath.Join(cnitest.RepoRoot, ".cache", "bin", "k8s", "kube-apiserver")
)

// whereaboutsMissing says what whereabouts needs that is not there ("" when
// nothing is missing).
func whereaboutsMissing() string {
	var missing []string
	for _, f := range []string{whereaboutsBin, filepath.Join(whereaboutsCRDs, "whereabouts.cni.cncf.io_ippools.yaml"), kubeAPIServer} {
		if _, err := os.Stat(f); err != nil {
			missing = append(missing, f)
		}
	}
	if len(missing) == 0 {
		return ""
	}
	return strings.Join(missing, ", ") + " (scripts/build-whereabouts.sh, scripts/build-k8s.sh: make scale-churn runs both)"
}

// whereabouts starts a Kubernetes control plane without nodes (its own
// etcd and kube-apiserver in the control-plane namespace, on the LAN),
// installs whereabouts' CRDs from its module, and returns whereabouts on
// every host, each with a kubeconfig for the apiserver (an admin token,
// the namespace kube-system, where whereabouts keeps its IPPools and its
// leader-election Lease).
func (w *world) whereabouts(t *testing.T) ipam {
	t.Helper()
	kubeEtcd := testenv.StartEtcdCluster(t, testenv.ClusterOptions{Size: 1, Netns: w.cp.Name,
		Addrs: []netip.Addr{kubeEtcdIP}, Dial: w.cp.DialContext}).Endpoints()[0]
	d := filepath.Join(w.dir, "kube")
	if err := os.MkdirAll(d, 0o700); err != nil {
		t.Fatal(err)
	}
	server := "https://" + net.JoinHostPort(apiserverIP.String(), "6443")
	token := testenv.WriteKubeCredentials(t, d, server, "kube-system")
	api := w.startIn(w.cp, "kube-apiserver", kubeAPIServer,
		"--etcd-servers="+kubeEtcd,
		"--bind-address="+apiserverIP.String(), "--secure-port=6443", "--advertise-address="+apiserverIP.String(),
		"--cert-dir="+filepath.Join(d, "apiserver"),
		"--token-auth-file="+filepath.Join(d, "tokens.csv"),
		"--authorization-mode=AlwaysAllow",
		"--service-account-issuer=https://kubernetes.default.svc",
		"--service-account-key-file="+filepath.Join(d, "sa.pub"),
		"--service-account-signing-key-file="+filepath.Join(d, "sa.key"),
		"--service-cluster-ip-range=198.18.251.0/24",
	)
	cfg := &rest.Config{Host: server, BearerToken: token, TLSClientConfig: rest.TLSClientConfig{Insecure: true},
		Dial: w.cp.DialContext, QPS: 50, Burst: 100, Timeout: 30 * time.Second}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	rc := cs.Discovery().RESTClient()
	if err := poll(apiserverTO, func(ctx context.Context) (bool, error) {
		if err := api.ExitErr(); err != nil {
			return false, err
		}
		if _, err := rc.Get().AbsPath("/readyz").DoRaw(ctx); err != nil {
			return false, nil
		}
		_, err := rc.Get().AbsPath("/api/v1/namespaces/kube-system").DoRaw(ctx)
		return err == nil, nil
	}); err != nil {
		t.Fatalf("kube-apiserver not ready: %v\n%s", err, api.Tail(30))
	}
	files, _ := filepath.Glob(filepath.Join(whereaboutsCRDs, "*.yaml"))
	if len(files) == 0 {
		t.Fatalf("no CRDs in %s", whereaboutsCRDs)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		j, err := yaml.YAMLToJSON(b)
		if err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		u := &unstructured.Unstructured{}
		if err := u.UnmarshalJSON(j); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		if _, err := dyn.Resource(crdGVR).Create(ctx, u, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			t.Fatalf("creating the CRD of %s: %v", f, err)
		}
	}
	if err := poll(time.Minute, func(ctx context.Context) (bool, error) {
		_, err := dyn.Resource(ippoolGVR).Namespace("kube-system").List(ctx, metav1.ListOptions{})
		return err == nil, nil
	}); err != nil {
		t.Fatalf("whereabouts' IPPool resource never served: %v", err)
	}
	kubeconfig := filepath.Join(d, "kubeconfig")
	// The flat file a whereabouts install writes on every node
	// (whereabouts.d/whereabouts.conf): the plugin refuses to run without
	// one. Its configuration_path points there.
	conf := fmt.Sprintf(`{"datastore": "kubernetes", "kubernetes": {"kubeconfig": %q}, "log_level": "error"}`, kubeconfig)
	if err := os.WriteFile(filepath.Join(d, "whereabouts.conf"), []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	return ipam{name: "whereabouts", plugin: "whereabouts", real: whereaboutsBin,
		conf: func(int) map[string]any {
			return map[string]any{"type": "whereabouts", "range": podSubnet, "range_start": "198.19.0.2", "gateway": "198.19.0.1",
				"kubernetes": map[string]any{"kubeconfig": kubeconfig}, "log_level": "error",
				"log_file": filepath.Join(d, "whereabouts.log"), "configuration_path": filepath.Join(d, "whereabouts.conf")}
		},
		check: func(ctx context.Context, network string, live map[string]netip.Addr) ([]string, error) {
			pools, err := dyn.Resource(ippoolGVR).Namespace("kube-system").List(ctx, metav1.ListOptions{})
			if err != nil {
				return nil, fmt.Errorf("listing IPPools: %w", err)
			}
			held := map[string]netip.Addr{}
			for _, p := range pools.Items {
				rng, _, _ := unstructured.NestedString(p.Object, "spec", "range")
				prefix, err := netip.ParsePrefix(rng)
				if err != nil {
					return nil, fmt.Errorf("IPPool %s: range %q: %w", p.GetName(), rng, err)
				}
				allocs, _, _ := unstructured.NestedMap(p.Object, "spec", "allocations")
				for off, v := range allocs {
					m, _ := v.(map[string]any)
					id, _ := m["id"].(string)
					var n int
					fmt.Sscan(off, &n)
					held[id] = addrAdd(prefix.Masked().Addr(), n)
				}
			}
			diff := compare(held, live)
			if len(live) == 0 {
				ov, err := dyn.Resource(overlapGVR).Namespace("kube-system").List(ctx, metav1.ListOptions{})
				if err != nil {
					return diff, fmt.Errorf("listing OverlappingRangeIPReservations: %w", err)
				}
				for _, o := range ov.Items {
					diff = append(diff, "leak: OverlappingRangeIPReservation "+o.GetName()+" left")
				}
			}
			return diff, nil
		}}
}
