package kubernetes

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/ringipam/ringipam/cmd/ringipamd/agent"
	"github.com/ringipam/ringipam/pkg/cni/ipam"
	"github.com/ringipam/ringipam/pkg/cni/portmap"
	"github.com/ringipam/ringipam/pkg/storeconfig"
)

const manifestFile = "ringipam.yaml"

// The names the manifest's parts refer to one another by.
const (
	listKey      = "10-ringipam.conflist"
	installerKey = "install-cni.sh"
	nodeToken    = "@NODE_NAME@"
)

// manifest is ringipam.yaml decoded, one object of each kind.
type manifest struct {
	ns   *corev1.Namespace
	sa   *corev1.ServiceAccount
	role *rbacv1.Role
	rb   *rbacv1.RoleBinding
	cr   *rbacv1.ClusterRole
	crb  *rbacv1.ClusterRoleBinding
	cm   *corev1.ConfigMap
	ds   *appsv1.DaemonSet
	all  []metav1.Object
}

// splitDocs cuts a YAML stream at its "---" lines, dropping documents with
// nothing but comments.
func splitDocs(b []byte) [][]byte {
	var docs [][]byte
	var cur []string
	flush := func() {
		content := false
		for _, l := range cur {
			if t := strings.TrimSpace(l); t != "" && !strings.HasPrefix(t, "#") {
				content = true
			}
		}
		if content {
			docs = append(docs, []byte(strings.Join(cur, "\n")+"\n"))
		}
		cur = nil
	}
	for _, l := range strings.Split(string(b), "\n") {
		if strings.TrimRight(l, " ") == "---" {
			flush()
			continue
		}
		cur = append(cur, l)
	}
	flush()
	return docs
}

// decodeStrict decodes one document into the API type of its kind; an
// unknown or duplicated field is an error (sigs.k8s.io/yaml.UnmarshalStrict,
// the decoding kubectl's --validate=strict applies on the server).
func decodeStrict(doc []byte) (any, error) {
	var tm metav1.TypeMeta
	if err := yaml.Unmarshal(doc, &tm); err != nil {
		return nil, err
	}
	var obj any
	switch tm.APIVersion + " " + tm.Kind {
	case "v1 Namespace":
		obj = &corev1.Namespace{}
	case "v1 ServiceAccount":
		obj = &corev1.ServiceAccount{}
	case "v1 ConfigMap":
		obj = &corev1.ConfigMap{}
	case "rbac.authorization.k8s.io/v1 Role":
		obj = &rbacv1.Role{}
	case "rbac.authorization.k8s.io/v1 RoleBinding":
		obj = &rbacv1.RoleBinding{}
	case "rbac.authorization.k8s.io/v1 ClusterRole":
		obj = &rbacv1.ClusterRole{}
	case "rbac.authorization.k8s.io/v1 ClusterRoleBinding":
		obj = &rbacv1.ClusterRoleBinding{}
	case "apps/v1 DaemonSet":
		obj = &appsv1.DaemonSet{}
	default:
		return nil, fmt.Errorf("unexpected kind %q of apiVersion %q", tm.Kind, tm.APIVersion)
	}
	if err := yaml.UnmarshalStrict(doc, obj); err != nil {
		return nil, fmt.Errorf("%s: %w", tm.Kind, err)
	}
	return obj, nil
}

func loadManifest(t *testing.T, b []byte) *manifest {
	t.Helper()
	m := &manifest{}
	for i, doc := range splitDocs(b) {
		obj, err := decodeStrict(doc)
		if err != nil {
			t.Fatalf("document %d: %v", i+1, err)
		}
		twice := false
		switch o := obj.(type) {
		case *corev1.Namespace:
			twice, m.ns = m.ns != nil, o
		case *corev1.ServiceAccount:
			twice, m.sa = m.sa != nil, o
		case *corev1.ConfigMap:
			twice, m.cm = m.cm != nil, o
		case *rbacv1.Role:
			twice, m.role = m.role != nil, o
		case *rbacv1.RoleBinding:
			twice, m.rb = m.rb != nil, o
		case *rbacv1.ClusterRole:
			twice, m.cr = m.cr != nil, o
		case *rbacv1.ClusterRoleBinding:
			twice, m.crb = m.crb != nil, o
		case *appsv1.DaemonSet:
			twice, m.ds = m.ds != nil, o
		}
		if twice {
			t.Fatalf("document %d: a second %T", i+1, obj)
		}
		m.all = append(m.all, obj.(metav1.Object))
	}
	if m.ns == nil || m.sa == nil || m.role == nil || m.rb == nil || m.cr == nil || m.crb == nil || m.cm == nil || m.ds == nil {
		t.Fatalf("want a Namespace, a ServiceAccount, a Role, a RoleBinding, a ClusterRole, a ClusterRoleBinding, a ConfigMap and a DaemonSet; got %d documents", len(m.all))
	}
	return m
}

func readManifest(t *testing.T) []byte {
	t.Helper()
	b, err := os.ReadFile(manifestFile)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestManifestStrict: every document decodes strictly, and a field the API
// does not know is refused (the check can fail).
func TestManifestStrict(t *testing.T) {
	b := readManifest(t)
	loadManifest(t, b)
	for _, c := range []struct{ name, from, to string }{
		{"unknown field", "      hostNetwork: true\n", "      hostNetwork: true\n      hostNetwrk: true\n"},
		{"duplicate field", "      hostNetwork: true\n", "      hostNetwork: true\n      hostNetwork: false\n"},
	} {
		bad := strings.Replace(string(b), c.from, c.to, 1)
		if bad == string(b) {
			t.Fatalf("%s: %q not in the manifest", c.name, c.from)
		}
		var err error
		for _, doc := range splitDocs([]byte(bad)) {
			if _, e := decodeStrict(doc); e != nil {
				err = e
			}
		}
		if err == nil {
			t.Errorf("%s: decoded without an error", c.name)
		} else {
			t.Logf("%s refused: %v", c.name, err)
		}
	}
}

func container(t *testing.T, cs []corev1.Container, name string) *corev1.Container {
	t.Helper()
	for i := range cs {
		if cs[i].Name == name {
			return &cs[i]
		}
	}
	t.Fatalf("no container %q", name)
	return nil
}

// fieldEnv is the downward API field an env variable of c takes.
func fieldEnv(c *corev1.Container, name string) string {
	for _, e := range c.Env {
		if e.Name == name && e.ValueFrom != nil && e.ValueFrom.FieldRef != nil {
			return e.ValueFrom.FieldRef.FieldPath
		}
	}
	return ""
}

// volumeAt is the volume c mounts at dir.
func volumeAt(t *testing.T, spec *corev1.PodSpec, c *corev1.Container, dir string) *corev1.Volume {
	t.Helper()
	for _, vm := range c.VolumeMounts {
		if vm.MountPath != dir {
			continue
		}
		for i := range spec.Volumes {
			if spec.Volumes[i].Name == vm.Name {
				return &spec.Volumes[i]
			}
		}
		t.Fatalf("%s: mount %s names no volume %q", c.Name, dir, vm.Name)
	}
	t.Fatalf("%s: nothing mounted at %s", c.Name, dir)
	return nil
}

func hostPathAt(t *testing.T, spec *corev1.PodSpec, c *corev1.Container, dir string) string {
	t.Helper()
	v := volumeAt(t, spec, c, dir)
	if v.HostPath == nil {
		t.Fatalf("%s: %s is not a hostPath volume", c.Name, dir)
	}
	return v.HostPath.Path
}

// TestDaemonSet checks the DaemonSet's invariants (issue 36, item 2).
func TestDaemonSet(t *testing.T) {
	m := loadManifest(t, readManifest(t))
	for _, o := range m.all[1:] {
		if o == metav1.Object(m.cr) || o == metav1.Object(m.crb) {
			continue // cluster-scoped
		}
		if o.GetNamespace() != m.ns.Name {
			t.Errorf("%s is in namespace %q, not %q", o.GetName(), o.GetNamespace(), m.ns.Name)
		}
	}
	ds := m.ds
	spec := &ds.Spec.Template.Spec
	if sel := ds.Spec.Selector; sel == nil || len(sel.MatchLabels) == 0 {
		t.Error("no selector")
	} else {
		for k, v := range sel.MatchLabels {
			if ds.Spec.Template.Labels[k] != v {
				t.Errorf("selector %s=%s does not match the template's labels", k, v)
			}
		}
	}
	if len(spec.Tolerations) != 1 || spec.Tolerations[0] != (corev1.Toleration{Operator: corev1.TolerationOpExists}) {
		t.Errorf("tolerations %+v: want exactly one, operator Exists with no key and no effect (every taint)", spec.Tolerations)
	}
	if spec.PriorityClassName != "system-node-critical" {
		t.Errorf("priorityClassName %q", spec.PriorityClassName)
	}
	if !spec.HostNetwork || spec.HostPID || spec.HostIPC {
		t.Errorf("hostNetwork %v hostPID %v hostIPC %v: want the host's network only", spec.HostNetwork, spec.HostPID, spec.HostIPC)
	}
	if spec.ServiceAccountName != m.sa.Name {
		t.Errorf("serviceAccountName %q, the manifest's is %q", spec.ServiceAccountName, m.sa.Name)
	}
	u := ds.Spec.UpdateStrategy
	if u.Type != appsv1.RollingUpdateDaemonSetStrategyType || u.RollingUpdate == nil || u.RollingUpdate.MaxUnavailable == nil ||
		u.RollingUpdate.MaxUnavailable.String() != "1" {
		t.Errorf("updateStrategy %+v: want RollingUpdate, maxUnavailable 1", u)
	}
	if len(spec.InitContainers) != 1 || len(spec.Containers) != 1 {
		t.Fatalf("%d init containers and %d containers: want one of each", len(spec.InitContainers), len(spec.Containers))
	}

	// The installer: node name from the downward API, the script from the
	// ConfigMap, the host's CNI directories, no privilege.
	in := container(t, spec.InitContainers, "install-cni")
	if a := spec.Containers[0]; in.Image != a.Image || !strings.HasPrefix(a.Image, "ringipam/ringipam:") {
		t.Errorf("images %q and %q: want one ringipam/ringipam image (make image) for both", in.Image, a.Image)
	}
	if f := fieldEnv(in, "NODE_NAME"); f != "spec.nodeName" {
		t.Errorf("install-cni: NODE_NAME from %q, want spec.nodeName", f)
	}
	if len(in.Command) != 2 || in.Command[0] != "/bin/sh" {
		t.Fatalf("install-cni: command %q, want /bin/sh <script>", in.Command)
	}
	v := volumeAt(t, spec, in, path.Dir(in.Command[1]))
	if v.ConfigMap == nil || v.ConfigMap.Name != m.cm.Name {
		t.Errorf("install-cni: %s is not from ConfigMap %s", path.Dir(in.Command[1]), m.cm.Name)
	} else {
		keys := map[string]string{}
		for _, it := range v.ConfigMap.Items {
			keys[it.Path] = it.Key
		}
		if keys[path.Base(in.Command[1])] != installerKey || keys[listKey] != listKey {
			t.Errorf("install-cni: items %+v: want %s and %s", v.ConfigMap.Items, installerKey, listKey)
		}
	}
	for dir, host := range map[string]string{"/host/opt/cni/bin": "/opt/cni/bin", "/host/etc/cni/net.d": "/etc/cni/net.d"} {
		if p := hostPathAt(t, spec, in, dir); p != host {
			t.Errorf("install-cni: %s is the host's %s, want %s", dir, p, host)
		}
	}
	if sc := in.SecurityContext; sc == nil || (sc.Privileged != nil && *sc.Privileged) || sc.Capabilities == nil ||
		!reflect.DeepEqual(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) || len(sc.Capabilities.Add) != 0 {
		t.Errorf("install-cni: securityContext %+v: want every capability dropped, none added", sc)
	}

	// The agent: the store flags name the list's store, host and address
	// from the downward API, liveness on /livez and readiness on /readyz
	// where it listens.
	a := container(t, spec.Containers, "ringipamd")
	if f := fieldEnv(a, "NODE_NAME"); f != "spec.nodeName" {
		t.Errorf("ringipamd: NODE_NAME from %q, want spec.nodeName", f)
	}
	if f := fieldEnv(a, "NODE_IP"); f != "status.hostIPs" {
		t.Errorf("ringipamd: NODE_IP from %q, want status.hostIPs (both families on a dual-stack node)", f)
	}
	if len(a.Command) != 1 || path.Base(a.Command[0]) != "ringipamd" {
		t.Errorf("ringipamd: command %q", a.Command)
	}
	// kubelet expands $(VAR) from the container's env.
	expand := strings.NewReplacer("$(NODE_NAME)", "node-a", "$(NODE_IP)", "192.0.2.10,2001:db8::10")
	var args []string
	for _, s := range a.Args {
		args = append(args, expand.Replace(s))
	}
	cfg, err := agent.LoadConfig(args, func(string) string { return "" }, io.Discard)
	if err != nil {
		t.Fatalf("ringipamd's args %q: %v", a.Args, err)
	}
	if cfg.Host != "node-a" || cfg.Addr != "192.0.2.10,2001:db8::10" {
		t.Errorf("ringipamd: host %q addr %q: want $(NODE_NAME) and $(NODE_IP)", cfg.Host, cfg.Addr)
	}
	pm := loadList(t, m.cm, "node-a").portmap
	if !reflect.DeepEqual(cfg.Store, pm.Store) {
		t.Errorf("ringipamd's store flags and the list's store differ:\nagent %+v\nlist  %+v", cfg.Store, pm.Store)
	}
	for _, p := range []struct {
		name, path string
		probe      *corev1.Probe
	}{{"liveness", "/livez", a.LivenessProbe}, {"readiness", "/readyz", a.ReadinessProbe}} {
		if p.probe == nil || p.probe.HTTPGet == nil {
			t.Errorf("ringipamd: no %s probe over HTTP", p.name)
			continue
		}
		g := p.probe.HTTPGet
		if got := fmt.Sprintf("%s:%s", g.Host, g.Port.String()); g.Path != p.path || got != cfg.Listen {
			t.Errorf("ringipamd: %s probe on %s%s, the agent serves %s on %s", p.name, got, g.Path, p.path, cfg.Listen)
		}
	}
	// Uninstall: the preStop hook, which reads this DaemonSet with the
	// pod's account (the Role, bound to the pod's ServiceAccount), and sees
	// the installer's record and the host's CNI directories where the
	// installer wrote them.
	if h := a.Lifecycle; h == nil || h.PreStop == nil || h.PreStop.Exec == nil ||
		!reflect.DeepEqual(h.PreStop.Exec.Command, []string{"/usr/local/bin/ringipam-uninstall", "--daemonset=" + ds.Name}) {
		t.Errorf("ringipamd: lifecycle %+v: want the preStop hook ringipam-uninstall --daemonset=%s", a.Lifecycle, ds.Name)
	}
	if spec.AutomountServiceAccountToken != nil && !*spec.AutomountServiceAccountToken ||
		m.sa.AutomountServiceAccountToken != nil && !*m.sa.AutomountServiceAccountToken {
		t.Error("the service-account token is not mounted: the preStop hook cannot ask for the DaemonSet")
	}
	if r := m.role.Rules; len(r) != 1 || !reflect.DeepEqual(r[0], rbacv1.PolicyRule{APIGroups: []string{"apps"}, Resources: []string{"daemonsets"},
		ResourceNames: []string{ds.Name}, Verbs: []string{"get"}}) {
		t.Errorf("Role rules %+v: want get on daemonsets/%s only", r, ds.Name)
	}
	if rb := m.rb; rb.RoleRef != (rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: m.role.Name}) || len(rb.Subjects) != 1 ||
		rb.Subjects[0] != (rbacv1.Subject{Kind: "ServiceAccount", Name: m.sa.Name, Namespace: m.ns.Name}) {
		t.Errorf("RoleBinding %+v: want Role %s bound to ServiceAccount %s", rb, m.role.Name, m.sa.Name)
	}
	// Kubernetes: the leader reclaims deleted Nodes' hosts, every agent
	// collects its node's vanished pods, asking the runtime's socket; the
	// ClusterRole lets the agent list and watch Nodes and pods, nothing
	// else.
	if !cfg.KubeReclaimNodes || !cfg.KubeVanishedPods || cfg.Kubeconfig != "" {
		t.Errorf("ringipamd: kube-reclaim-nodes %v, kube-vanished-pods %v, kubeconfig %q: want both on, in-cluster", cfg.KubeReclaimNodes, cfg.KubeVanishedPods, cfg.Kubeconfig)
	}
	if p := hostPathAt(t, spec, a, path.Dir(cfg.CRISocket)); p != "/run/containerd" || path.Base(cfg.CRISocket) != "containerd.sock" {
		t.Errorf("ringipamd: the CRI socket %s is in the host's %s, want containerd's /run/containerd/containerd.sock", cfg.CRISocket, p)
	}
	if r := m.cr.Rules; len(r) != 1 || !reflect.DeepEqual(r[0], rbacv1.PolicyRule{APIGroups: []string{""}, Resources: []string{"nodes", "pods"},
		Verbs: []string{"list", "watch"}}) {
		t.Errorf("ClusterRole rules %+v: want list and watch of nodes and pods only", r)
	}
	if b := m.crb; b.RoleRef != (rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: m.cr.Name}) || len(b.Subjects) != 1 ||
		b.Subjects[0] != (rbacv1.Subject{Kind: "ServiceAccount", Name: m.sa.Name, Namespace: m.ns.Name}) {
		t.Errorf("ClusterRoleBinding %+v: want ClusterRole %s bound to ServiceAccount %s", b, m.cr.Name, m.sa.Name)
	}
	for _, c := range []*corev1.Container{in, a} {
		for dir, host := range map[string]string{"/host/opt/cni/bin": "/opt/cni/bin", "/host/etc/cni/net.d": "/etc/cni/net.d", "/var/lib/ringipam": "/var/lib/ringipam"} {
			if p := hostPathAt(t, spec, c, dir); p != host {
				t.Errorf("%s: %s is the host's %s, want %s", c.Name, dir, p, host)
			}
		}
	}
	// The directories the plugins on the host and the agent share.
	st := cfg.Store
	if p := hostPathAt(t, spec, a, path.Dir(st.AgentSocket)); p != path.Dir(st.AgentSocket) {
		t.Errorf("ringipamd: the agent socket's directory is the host's %s", p)
	}
	if !strings.HasPrefix(st.DelQueue, "/var/lib/ringipam/") || hostPathAt(t, spec, a, "/var/lib/ringipam") != "/var/lib/ringipam" {
		t.Errorf("ringipamd: del queue %s is not on the host's /var/lib/ringipam", st.DelQueue)
	}
	for _, f := range []string{st.TLS.CA, st.TLS.Cert, st.TLS.Key} {
		v := volumeAt(t, spec, a, path.Dir(f))
		if v.Secret == nil || v.Secret.SecretName == "" {
			t.Errorf("ringipamd: %s is not from a Secret", f)
		}
	}
	// Privileged for the /proc/sys/net writes (see the manifest); the only
	// container that is, and nothing else of the host's is shared.
	if sc := a.SecurityContext; sc == nil || sc.Privileged == nil || !*sc.Privileged {
		t.Errorf("ringipamd: securityContext %+v: the agent writes /proc/sys/net, read-only unless privileged", sc)
	}
}

// list is the ConfigMap's CNI list as the plugins see it on node host.
type list struct {
	raw     map[string]any
	ipam    []*ipam.Config
	portmap *portmap.Config
}

// loadList substitutes the node's name as the installer does and runs each
// plugin of the list through its configuration loader, with the network's
// name and cniVersion put in as libcni does.
func loadList(t *testing.T, cm *corev1.ConfigMap, host string) list {
	t.Helper()
	text, ok := cm.Data[listKey]
	if !ok {
		t.Fatalf("ConfigMap has no %s", listKey)
	}
	if !strings.Contains(text, nodeToken) {
		t.Fatalf("the list has no %s for the installer to replace", nodeToken)
	}
	text = strings.ReplaceAll(text, nodeToken, host)
	var conf struct {
		CNIVersion string            `json:"cniVersion"`
		Name       string            `json:"name"`
		Plugins    []json.RawMessage `json:"plugins"`
	}
	dec := json.NewDecoder(strings.NewReader(text))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&conf); err != nil {
		t.Fatalf("the list: %v", err)
	}
	if conf.CNIVersion != "1.0.0" {
		t.Errorf("cniVersion %q: containerd 1.6 reads 1.0.0 results only", conf.CNIVersion)
	}
	var l list
	var types []string
	for i, p := range conf.Plugins {
		var m map[string]any
		if err := json.Unmarshal(p, &m); err != nil {
			t.Fatalf("plugin %d: %v", i, err)
		}
		m["name"], m["cniVersion"] = conf.Name, conf.CNIVersion
		stdin, err := json.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		typ, _ := m["type"].(string)
		types = append(types, typ)
		switch typ {
		case "bridge", "ipam-ring":
			c, err := ipam.Load(stdin, "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=p")
			if err != nil {
				t.Fatalf("plugin %d (%s): ipam-ring refuses its ipam: %v", i, typ, err)
			}
			if c.Host != host {
				t.Errorf("plugin %d (%s): host %q, want %q", i, typ, c.Host, host)
			}
			if c.Chained != (typ == "ipam-ring") {
				t.Errorf("plugin %d (%s): chained %v", i, typ, c.Chained)
			}
			l.ipam = append(l.ipam, c)
		case "portmap-ingress":
			c, err := portmap.Load(stdin, "IgnoreUnknown=1")
			if err != nil {
				t.Fatalf("plugin %d: portmap-ingress refuses its configuration: %v", i, err)
			}
			if c.Host != host {
				t.Errorf("portmap-ingress: host %q, want %q", c.Host, host)
			}
			if c.Store.Type != storeconfig.TypeEtcd {
				t.Errorf("portmap-ingress: store type %q", c.Store.Type)
			}
			l.portmap = c
		}
		if i == 0 {
			l.raw = m
		}
	}
	if want := []string{"bridge", "portmap-ingress", "ipam-ring"}; !reflect.DeepEqual(types, want) {
		t.Fatalf("plugins %q, want %q (main plugin with ipam-ring, ports, ipam-ring chained for GC)", types, want)
	}
	return l
}

// TestCNIList: the list passes both plugins' loaders (strict on ipam-ring's
// ipam object and on every store object), both ipam objects are the same
// (the chained entry serves GC of the main plugin's pool), and the store
// object is the same in all three.
func TestCNIList(t *testing.T) {
	m := loadManifest(t, readManifest(t))
	text := m.cm.Data[listKey]
	var conf struct {
		Plugins []struct {
			IPAM  json.RawMessage `json:"ipam"`
			Store json.RawMessage `json:"store"`
		} `json:"plugins"`
	}
	if err := json.Unmarshal([]byte(text), &conf); err != nil {
		t.Fatal(err)
	}
	loadList(t, m.cm, "node-a")
	canon := func(b []byte) string {
		var v any
		if err := json.Unmarshal(b, &v); err != nil {
			t.Fatal(err)
		}
		out, _ := json.Marshal(v)
		return string(out)
	}
	if a, b := canon(conf.Plugins[0].IPAM), canon(conf.Plugins[2].IPAM); a != b {
		t.Errorf("the main plugin's ipam and the chained entry's differ:\n%s\n%s", a, b)
	}
	var im struct {
		Store json.RawMessage `json:"store"`
	}
	if err := json.Unmarshal(conf.Plugins[0].IPAM, &im); err != nil {
		t.Fatal(err)
	}
	if a, b := canon(im.Store), canon(conf.Plugins[1].Store); a != b {
		t.Errorf("ipam-ring's store and portmap-ingress's differ:\n%s\n%s", a, b)
	}
	// A typo in the ipam object is refused: the loader is strict there.
	bad := strings.Replace(text, `"reservationFromPod"`, `"reservationFromPd"`, 1)
	cm := m.cm.DeepCopy()
	cm.Data[listKey] = bad
	var c struct {
		Plugins []json.RawMessage `json:"plugins"`
	}
	if err := json.Unmarshal([]byte(strings.ReplaceAll(bad, nodeToken, "node-a")), &c); err != nil {
		t.Fatal(err)
	}
	var p map[string]any
	if err := json.Unmarshal(c.Plugins[0], &p); err != nil {
		t.Fatal(err)
	}
	p["name"], p["cniVersion"] = "n", "1.0.0"
	stdin, _ := json.Marshal(p)
	if _, err := ipam.Load(stdin, ""); err == nil {
		t.Error("ipam-ring accepted an unknown ipam key")
	}
}

// TestInstaller runs the installer from the ConfigMap in a directory tree
// standing for the node and the image: the plugins and the list land in the
// host's directories with the node's name, through a temporary file renamed
// over the target, a node's own reference plugin is left alone, and the
// record (what ringipam-uninstall removes) lists exactly what it wrote.
func TestInstaller(t *testing.T) {
	if _, err := exec.LookPath("sh"); err != nil {
		t.Fatalf("the installer is a shell script: %v", err)
	}
	m := loadManifest(t, readManifest(t))
	script := m.cm.Data[installerKey]
	if !strings.Contains(script, `mv -f "$tmp" "$2"`) {
		t.Error("the installer does not rename its temporary file over the target")
	}
	root := t.TempDir()
	write := func(rel, content string, mode os.FileMode) {
		p := filepath.Join(root, rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), mode); err != nil {
			t.Fatal(err)
		}
	}
	write("etc/ringipam/install/"+listKey, m.cm.Data[listKey], 0o644)
	write("etc/ringipam/install/"+installerKey, script, 0o644)
	write("opt/ringipam/cni/ipam-ring", "new ipam-ring", 0o644)
	write("opt/ringipam/cni/portmap-ingress", "new portmap-ingress", 0o644)
	write("opt/ringipam/cni-reference/bridge", "image's bridge", 0o755)
	write("opt/ringipam/cni-reference/loopback", "image's loopback", 0o755)
	write("host/opt/cni/bin/ipam-ring", "old ipam-ring", 0o755)
	write("host/opt/cni/bin/bridge", "node's bridge", 0o755)

	run := func(node string) ([]byte, error) {
		cmd := exec.Command("sh", filepath.Join(root, "etc/ringipam/install", installerKey))
		cmd.Env = append(os.Environ(), "RINGIPAM_INSTALL_ROOT="+root, "NODE_NAME="+node)
		return cmd.CombinedOutput()
	}
	if out, err := run("node-a"); err != nil {
		t.Fatalf("installer: %v\n%s", err, out)
	}
	for rel, want := range map[string]string{
		"host/opt/cni/bin/ipam-ring":       "new ipam-ring",
		"host/opt/cni/bin/portmap-ingress": "new portmap-ingress",
		"host/opt/cni/bin/bridge":          "node's bridge",
		"host/opt/cni/bin/loopback":        "image's loopback",
	} {
		b, err := os.ReadFile(filepath.Join(root, rel))
		if err != nil || string(b) != want {
			t.Errorf("%s: %q, %v; want %q", rel, b, err, want)
		}
		if fi, err := os.Stat(filepath.Join(root, rel)); err == nil && fi.Mode().Perm() != 0o755 {
			t.Errorf("%s: mode %v", rel, fi.Mode())
		}
	}
	got, err := os.ReadFile(filepath.Join(root, "host/etc/cni/net.d", listKey))
	if err != nil {
		t.Fatal(err)
	}
	if want := strings.ReplaceAll(m.cm.Data[listKey], nodeToken, "node-a"); string(got) != want {
		t.Errorf("the installed list is not the ConfigMap's with the node's name:\n%s", got)
	}
	// The record lists what the installer wrote (not the node's own
	// bridge), as the container sees it; a second run (a new pod) replaces
	// its own loopback and keeps it in the record.
	wantRecord := []string{"/host/opt/cni/bin/ipam-ring", "/host/opt/cni/bin/portmap-ingress", "/host/opt/cni/bin/loopback", "/host/etc/cni/net.d/" + listKey}
	checkRecord := func(when string) {
		t.Helper()
		b, err := os.ReadFile(filepath.Join(root, "var/lib/ringipam/installed"))
		if err != nil {
			t.Fatalf("%s: the installer's record: %v", when, err)
		}
		var got []string
		for _, l := range strings.Fields(string(b)) {
			got = append(got, strings.TrimPrefix(l, root))
		}
		if !reflect.DeepEqual(got, wantRecord) {
			t.Errorf("%s: record %q, want %q", when, got, wantRecord)
		}
	}
	checkRecord("first run")
	write("opt/ringipam/cni-reference/loopback", "image's new loopback", 0o755)
	if out, err := run("node-a"); err != nil {
		t.Fatalf("installer, second run: %v\n%s", err, out)
	}
	checkRecord("second run")
	for rel, want := range map[string]string{"host/opt/cni/bin/loopback": "image's new loopback", "host/opt/cni/bin/bridge": "node's bridge"} {
		if b, err := os.ReadFile(filepath.Join(root, rel)); err != nil || string(b) != want {
			t.Errorf("second run: %s: %q, %v; want %q", rel, b, err, want)
		}
	}
	for _, dir := range []string{"host/opt/cni/bin", "host/etc/cni/net.d"} {
		ents, err := os.ReadDir(filepath.Join(root, dir))
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range ents {
			if strings.HasPrefix(e.Name(), ".") {
				t.Errorf("%s: temporary file %s left behind", dir, e.Name())
			}
		}
	}
	// A node name that is not a host name is refused before anything is
	// written (it would also break sed's expression).
	if err := os.Remove(filepath.Join(root, "host/etc/cni/net.d", listKey)); err != nil {
		t.Fatal(err)
	}
	if out, err := run("node/a"); err == nil || !bytes.Contains(out, []byte("node/a")) {
		t.Errorf("installer with node name node/a: %v\n%s", err, out)
	}
	if _, err := os.Stat(filepath.Join(root, "host/etc/cni/net.d", listKey)); !os.IsNotExist(err) {
		t.Errorf("a refused node name still wrote the list: %v", err)
	}
}
