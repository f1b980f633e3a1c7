//go:build integration

package k8s

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes/scheme"

	"github.com/ringipam/ringipam/integration/cnitest"
)

// The operator's values the suite sets in the manifest (README,
// "Kubernetes"): the etcd endpoints (the suite's etcd through the node's
// relay), the certificate Secret (the suite's etcd client certificate),
// the pod CIDR pool (a /27 of the test range).
const (
	shippedEndpoint = "https://etcd.example:2379"
	shippedPool     = "10.244.0.0/16"
	podCIDR         = "198.18.0.0/27"
	shippedImage    = "ringipam/ringipam:" // the release the manifest pins follows
	poolName        = "k8s-pods-v4"
	installNS       = "ringipam-system"
	secretName      = "ringipam-etcd-client"
	// shippedCRIDir is the host's directory of the CRI socket the
	// manifest mounts (the socket: containerd.sock, as the suite's).
	shippedCRIDir = "/run/containerd"
)

// installTimeout bounds the DaemonSet's rollout and the node's readiness.
const installTimeout = 3 * time.Minute

// manifest is deploy/kubernetes/ringipam.yaml decoded into the API's
// types, in file order, with the operator's values set.
type manifest struct {
	objs []runtime.Object
}

// loadManifest decodes the manifest strictly (an unknown field fails, as
// it would in `kubectl apply --validate=strict`) and sets the operator's
// values; each value must be found where the README says it is.
func (c *cluster) loadManifest(t *testing.T) *manifest {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(cnitest.RepoRoot, "deploy", "kubernetes", "ringipam.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	dec := serializer.NewCodecFactory(scheme.Scheme, serializer.EnableStrict).UniversalDeserializer()
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(b)))
	m := &manifest{}
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if onlyComments(doc) {
			continue
		}
		obj, _, err := dec.Decode(doc, nil, nil)
		if err != nil {
			t.Fatalf("decoding the manifest: %v", err)
		}
		m.objs = append(m.objs, obj)
	}
	replace := func(what, s, old, new string) string {
		if !strings.Contains(s, old) {
			t.Fatalf("%s: %q not found: the suite's substitution no longer matches the manifest", what, old)
		}
		return strings.ReplaceAll(s, old, new)
	}
	for _, obj := range m.objs {
		switch o := obj.(type) {
		case *corev1.ConfigMap:
			for k, v := range o.Data {
				if strings.HasSuffix(k, ".conflist") {
					v = replace("ConfigMap "+k, v, shippedEndpoint, c.etcdInNode)
					o.Data[k] = replace("ConfigMap "+k, v, shippedPool, podCIDR)
				}
			}
		case *appsv1.DaemonSet:
			spec := &o.Spec.Template.Spec
			// The cluster has no kube-proxy: in-cluster clients (the
			// preStop hook) reach the apiserver at its own address, as
			// on any cluster without a service proxy.
			// The node's containerd's socket directory is at the shipped
			// path in every node's mount namespace (nodeMounts).
			found := false
			for i := range spec.Volumes {
				if hp := spec.Volumes[i].HostPath; hp != nil && hp.Path == shippedCRIDir {
					found = true
				}
			}
			if !found {
				t.Fatalf("DaemonSet: no hostPath volume of %s: the suite's substitution no longer matches the manifest", shippedCRIDir)
			}
			for i := range spec.Containers {
				spec.Containers[i].Env = append(spec.Containers[i].Env,
					corev1.EnvVar{Name: "KUBERNETES_SERVICE_HOST", Value: nodeIP}, corev1.EnvVar{Name: "KUBERNETES_SERVICE_PORT", Value: apiPort})
			}
			for _, cs := range [][]corev1.Container{spec.InitContainers, spec.Containers} {
				for i := range cs {
					// The manifest pins a release (deploy/kubernetes checks
					// which); the suite runs the image it built of this tree.
					if !strings.HasPrefix(cs[i].Image, shippedImage) {
						t.Fatalf("DaemonSet image %q: want %s<release>", cs[i].Image, shippedImage)
					}
					cs[i].Image = "docker.io/ringipam/ringipam:" + imageTag
					for j, a := range cs[i].Args {
						if strings.HasPrefix(a, "--etcd-endpoints=") {
							cs[i].Args[j] = replace("DaemonSet args", a, shippedEndpoint, c.etcdInNode)
						}
						// The vanished pods' grace, shortened (VanishedPods).
						if strings.HasPrefix(a, "--vanished-grace=") {
							cs[i].Args[j] = "--vanished-grace=" + vanishedGrace.String()
						}
					}
				}
			}
		}
	}
	return m
}

func onlyComments(doc []byte) bool {
	for _, line := range strings.Split(string(doc), "\n") {
		if l := strings.TrimSpace(line); l != "" && !strings.HasPrefix(l, "#") && l != "---" {
			return false
		}
	}
	return true
}

// create creates obj through the apiserver.
func (c *cluster) create(ctx context.Context, obj runtime.Object) error {
	var err error
	cs := c.cs
	switch o := obj.(type) {
	case *corev1.Namespace:
		_, err = cs.CoreV1().Namespaces().Create(ctx, o, metav1.CreateOptions{})
	case *corev1.ServiceAccount:
		_, err = cs.CoreV1().ServiceAccounts(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
	case *corev1.ConfigMap:
		_, err = cs.CoreV1().ConfigMaps(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
	case *corev1.Secret:
		_, err = cs.CoreV1().Secrets(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
	case *rbacv1.Role:
		_, err = cs.RbacV1().Roles(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
	case *rbacv1.RoleBinding:
		_, err = cs.RbacV1().RoleBindings(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
	case *rbacv1.ClusterRole:
		_, err = cs.RbacV1().ClusterRoles().Create(ctx, o, metav1.CreateOptions{})
	case *rbacv1.ClusterRoleBinding:
		_, err = cs.RbacV1().ClusterRoleBindings().Create(ctx, o, metav1.CreateOptions{})
	case *appsv1.DaemonSet:
		_, err = cs.AppsV1().DaemonSets(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
	default:
		err = fmt.Errorf("the suite does not know how to create a %T", obj)
	}
	return err
}

// remove deletes obj as `kubectl delete` does (background propagation);
// exists reports whether it is still there.
func (c *cluster) remove(ctx context.Context, obj runtime.Object) error {
	bg := metav1.DeletePropagationBackground
	opts := metav1.DeleteOptions{PropagationPolicy: &bg}
	cs := c.cs
	acc := obj.(metav1.Object)
	var err error
	switch obj.(type) {
	case *corev1.Namespace:
		err = cs.CoreV1().Namespaces().Delete(ctx, acc.GetName(), opts)
	case *corev1.ServiceAccount:
		err = cs.CoreV1().ServiceAccounts(acc.GetNamespace()).Delete(ctx, acc.GetName(), opts)
	case *corev1.ConfigMap:
		err = cs.CoreV1().ConfigMaps(acc.GetNamespace()).Delete(ctx, acc.GetName(), opts)
	case *corev1.Secret:
		err = cs.CoreV1().Secrets(acc.GetNamespace()).Delete(ctx, acc.GetName(), opts)
	case *rbacv1.Role:
		err = cs.RbacV1().Roles(acc.GetNamespace()).Delete(ctx, acc.GetName(), opts)
	case *rbacv1.RoleBinding:
		err = cs.RbacV1().RoleBindings(acc.GetNamespace()).Delete(ctx, acc.GetName(), opts)
	case *rbacv1.ClusterRole:
		err = cs.RbacV1().ClusterRoles().Delete(ctx, acc.GetName(), opts)
	case *rbacv1.ClusterRoleBinding:
		err = cs.RbacV1().ClusterRoleBindings().Delete(ctx, acc.GetName(), opts)
	case *appsv1.DaemonSet:
		err = cs.AppsV1().DaemonSets(acc.GetNamespace()).Delete(ctx, acc.GetName(), opts)
	default:
		err = fmt.Errorf("the suite does not know how to delete a %T", obj)
	}
	if apierrors.IsNotFound(err) {
		return nil
	}
	return err
}

func (c *cluster) exists(ctx context.Context, obj runtime.Object) (bool, error) {
	acc := obj.(metav1.Object)
	cs := c.cs
	var err error
	switch obj.(type) {
	case *corev1.Namespace:
		_, err = cs.CoreV1().Namespaces().Get(ctx, acc.GetName(), metav1.GetOptions{})
	case *corev1.ServiceAccount:
		_, err = cs.CoreV1().ServiceAccounts(acc.GetNamespace()).Get(ctx, acc.GetName(), metav1.GetOptions{})
	case *corev1.ConfigMap:
		_, err = cs.CoreV1().ConfigMaps(acc.GetNamespace()).Get(ctx, acc.GetName(), metav1.GetOptions{})
	case *corev1.Secret:
		_, err = cs.CoreV1().Secrets(acc.GetNamespace()).Get(ctx, acc.GetName(), metav1.GetOptions{})
	case *rbacv1.Role:
		_, err = cs.RbacV1().Roles(acc.GetNamespace()).Get(ctx, acc.GetName(), metav1.GetOptions{})
	case *rbacv1.RoleBinding:
		_, err = cs.RbacV1().RoleBindings(acc.GetNamespace()).Get(ctx, acc.GetName(), metav1.GetOptions{})
	case *rbacv1.ClusterRole:
		_, err = cs.RbacV1().ClusterRoles().Get(ctx, acc.GetName(), metav1.GetOptions{})
	case *rbacv1.ClusterRoleBinding:
		_, err = cs.RbacV1().ClusterRoleBindings().Get(ctx, acc.GetName(), metav1.GetOptions{})
	case *appsv1.DaemonSet:
		_, err = cs.AppsV1().DaemonSets(acc.GetNamespace()).Get(ctx, acc.GetName(), metav1.GetOptions{})
	default:
		return false, fmt.Errorf("the suite does not know how to get a %T", obj)
	}
	if apierrors.IsNotFound(err) {
		return false, nil
	}
	return err == nil, err
}

// install applies the manifest as an operator would: the Secret with the
// etcd client certificate first (in the manifest's namespace), then every
// object of the file. It waits until the DaemonSet's pod is ready and the
// node is Ready (the installer wrote the CNI list), and checks what the
// installer wrote on the node.
func (c *cluster) install(t *testing.T) *manifest {
	t.Helper()
	m := c.loadManifest(t)
	ctx, cancel := context.WithTimeout(context.Background(), installTimeout)
	defer cancel()
	for _, obj := range m.objs {
		if err := c.create(ctx, obj); err != nil {
			t.Fatalf("creating %T %s: %v", obj, obj.(metav1.Object).GetName(), err)
		}
		if ns, ok := obj.(*corev1.Namespace); ok && ns.Name == installNS {
			c.createEtcdSecret(ctx, t)
		}
	}
	var ds *appsv1.DaemonSet
	err := c.poll(installTimeout, func(ctx context.Context) (bool, error) {
		var err error
		ds, err = c.cs.AppsV1().DaemonSets(installNS).Get(ctx, "ringipam", metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		st := ds.Status
		return st.ObservedGeneration >= ds.Generation && st.DesiredNumberScheduled == 1 && st.NumberReady == 1 && st.UpdatedNumberScheduled == 1, nil
	})
	if err != nil {
		t.Fatalf("DaemonSet ringipam not ready: %v; status %+v; pod: %s", err, ds.Status, c.agentPodState())
	}
	// The node lifecycle controller lifts the not-ready taint after.
	c.waitNodeReady(t, nodeName)

	list, err := os.ReadFile(c.hostDir("/etc/cni/net.d/10-ringipam.conflist"))
	if err != nil {
		t.Fatalf("the installer's list: %v", err)
	}
	if !strings.Contains(string(list), `"host": "`+nodeName+`"`) || strings.Contains(string(list), "@NODE_NAME@") {
		t.Errorf("the installed list does not name the node %s as host:\n%s", nodeName, list)
	}
	for _, p := range installedBinaries {
		if fi, err := os.Stat(c.hostDir(p)); err != nil || fi.Mode()&0o111 == 0 {
			t.Errorf("%s not installed (executable) on the node: %v", p, err)
		}
	}
	return m
}

// installedBinaries are what the installer puts into the node's (empty)
// /opt/cni/bin.
var installedBinaries = []string{"/opt/cni/bin/ipam-ring", "/opt/cni/bin/portmap-ingress", "/opt/cni/bin/bridge", "/opt/cni/bin/loopback"}

func (c *cluster) createEtcdSecret(ctx context.Context, t *testing.T) {
	t.Helper()
	data := map[string][]byte{}
	for key, file := range map[string]string{"ca.crt": c.etcdTLS.CA, "tls.crt": c.etcdTLS.Cert, "tls.key": c.etcdTLS.Key} {
		b, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		data[key] = b
	}
	s := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: secretName, Namespace: installNS}, Data: data}
	if _, err := c.cs.CoreV1().Secrets(installNS).Create(ctx, s, metav1.CreateOptions{}); err != nil {
		t.Fatalf("creating the etcd client Secret: %v", err)
	}
}

// agentPod returns the DaemonSet's pod (nil if there is none).
func (c *cluster) agentPod(ctx context.Context) (*corev1.Pod, error) {
	pods, err := c.cs.CoreV1().Pods(installNS).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=ringipam"})
	if err != nil {
		return nil, err
	}
	for i := range pods.Items {
		if pods.Items[i].DeletionTimestamp == nil {
			return &pods.Items[i], nil
		}
	}
	return nil, nil
}

func (c *cluster) agentPodState() string {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	p, err := c.agentPod(ctx)
	if err != nil {
		return err.Error()
	}
	if p == nil {
		return "none"
	}
	return p.Name + ": " + describePod(p) + "; events: " + strings.Join(c.events(installNS, p.Name), " | ")
}
