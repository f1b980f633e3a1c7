//go:build integration

package k8s

import (
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/ringipam/ringipam/internal/testenv"
)

// agentServiceAccount is the manifest's ServiceAccount, the DaemonSet's
// pods' identity.
const agentServiceAccount = "ringipam"

// agentUser is the user the apiserver sees for a token of the agent's
// service account, and agentGroups its groups.
var (
	agentUser   = "system:serviceaccount:" + installNS + ":" + agentServiceAccount
	agentGroups = []string{"system:serviceaccounts", "system:serviceaccounts:" + installNS, "system:authenticated"}
)

// agentToken is a token of the agent's service account from the
// TokenRequest API (what kubelet projects into the DaemonSet's pods).
func (c *cluster) agentToken(t *testing.T) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	secs := int64(time.Hour / time.Second)
	tr, err := c.cs.CoreV1().ServiceAccounts(installNS).CreateToken(ctx, agentServiceAccount,
		&authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: &secs}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("a token of the service account %s/%s: %v", installNS, agentServiceAccount, err)
	}
	return tr.Status.Token
}

// agentKubeconfig writes a kubeconfig with a token of the agent's
// service account (for an agent run outside the cluster, as the
// DaemonSet's pods run) and returns its path.
func (c *cluster) agentKubeconfig(t *testing.T) string {
	t.Helper()
	path := filepath.Join(c.dir, "kubeconfig-sa-"+agentServiceAccount)
	testenv.WriteKubeconfig(t, path, c.apiServer(), c.agentToken(t), "")
	return path
}

// accessCheck is one request of the agent's account and whether the
// manifest's RBAC must allow it.
type accessCheck struct {
	verb, group, resource, subresource, namespace, name string
	allowed                                             bool
	why                                                 string
}

// agentAccess is what the agent's account may and may not do. What it
// does (cmd/ringipamd/agent/kube.go, vanished.go; cmd/ringipam-uninstall):
// the leader lists and watches the metadata of Nodes; each agent lists and
// watches the pods of its node (a field selector, which RBAC cannot
// narrow: cluster-wide pods); the preStop hook gets its DaemonSet. It
// elects through etcd, not a Lease, writes no object, reads no Secret.
var agentAccess = []accessCheck{
	{"list", "", "nodes", "", "", "", true, "the leader's Node informer"},
	{"watch", "", "nodes", "", "", "", true, "the leader's Node informer"},
	{"list", "", "pods", "", "", "", true, "the informer of the node's pods"},
	{"watch", "", "pods", "", "", "", true, "the informer of the node's pods"},
	{"get", "apps", "daemonsets", "", installNS, "ringipam", true, "the preStop hook's question"},

	{"get", "", "secrets", "", installNS, secretName, false, "the etcd certificate is kubelet's to mount"},
	{"list", "", "secrets", "", "", "", false, "no Secret at all"},
	{"delete", "", "pods", "", testNS, "any", false, "nothing written"},
	{"create", "", "pods", "", testNS, "", false, "nothing written"},
	{"get", "", "pods", "", testNS, "any", false, "only lists and watches"},
	{"update", "", "nodes", "", "", nodeName, false, "nothing written"},
	{"delete", "", "nodes", "", "", nodeName, false, "nothing written"},
	{"patch", "", "nodes", "status", "", nodeName, false, "nothing written"},
	{"get", "apps", "daemonsets", "", installNS, "other", false, "its own DaemonSet only"},
	{"update", "apps", "daemonsets", "", installNS, "ringipam", false, "read only"},
	{"create", "coordination.k8s.io", "leases", "", installNS, "", false, "the election is etcd's"},
	{"list", "", "configmaps", "", "", "", false, "kubelet mounts the ConfigMap"},
}

// testRBAC: the apiserver enforces the manifest's RBAC on the agent's
// account (authorization Node,RBAC, not AlwaysAllow): a
// SubjectAccessReview as its account allows exactly what the agent does
// and denies the rest (agentAccess), requests made with a token of its
// account get the same answers (a refused delete of a pod that does not
// exist is 403, not 404), and the agent runs with what its ClusterRole
// and Role grant (its informers synced: their log lines, no refusal in
// its log).
func testRBAC(t *testing.T, c *cluster) {
	ctx := context.Background()
	for _, a := range agentAccess {
		attrs := &authorizationv1.ResourceAttributes{Verb: a.verb, Group: a.group, Resource: a.resource, Subresource: a.subresource, Namespace: a.namespace, Name: a.name}
		sar := &authorizationv1.SubjectAccessReview{Spec: authorizationv1.SubjectAccessReviewSpec{
			User: agentUser, Groups: agentGroups, ResourceAttributes: attrs}}
		got, err := c.cs.AuthorizationV1().SubjectAccessReviews().Create(ctx, sar, metav1.CreateOptions{})
		if err != nil {
			t.Fatalf("SubjectAccessReview %s: %v", a, err)
		}
		if got.Status.Allowed != a.allowed {
			t.Errorf("%s as %s: allowed %v, want %v (%s); reason %q", a, agentUser, got.Status.Allowed, a.allowed, a.why, got.Status.Reason)
		}
	}

	// The same through requests with a token of the account.
	cfg := c.restConfig()
	cfg.BearerToken = c.agentToken(t)
	as, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := as.CoreV1().Nodes().List(ctx, metav1.ListOptions{Limit: 1}); err != nil {
		t.Errorf("listing Nodes as %s: %v", agentUser, err)
	}
	if _, err := as.CoreV1().Pods("").List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + nodeName}); err != nil {
		t.Errorf("listing the pods of %s as %s: %v", nodeName, agentUser, err)
	}
	if _, err := as.AppsV1().DaemonSets(installNS).Get(ctx, "ringipam", metav1.GetOptions{}); err != nil {
		t.Errorf("getting the DaemonSet as %s: %v", agentUser, err)
	}
	for what, err := range map[string]error{
		"getting the etcd client Secret": func() error {
			_, err := as.CoreV1().Secrets(installNS).Get(ctx, secretName, metav1.GetOptions{})
			return err
		}(),
		"deleting a pod": as.CoreV1().Pods(testNS).Delete(ctx, "no-such-pod", metav1.DeleteOptions{}),
	} {
		if !apierrors.IsForbidden(err) {
			t.Errorf("%s as %s: %v, want forbidden", what, agentUser, err)
		}
	}

	// The agent itself: its informers synced under its account (each
	// line is logged once its informer has listed and watched).
	for _, line := range []string{"kubernetes: following Node objects", "kubernetes: following this node's pods"} {
		if err := c.poll(reclaimTimeout, func(context.Context) (bool, error) {
			return strings.Contains(c.agentLog(), line), nil
		}); err != nil {
			t.Fatalf("the agent did not log %q (its informer not synced under the manifest's RBAC?): %v\n%s", line, err, lastLines(c.agentLog(), 30))
		}
	}
	if log := c.agentLog(); strings.Contains(log, "forbidden") {
		t.Errorf("the apiserver refused the agent something:\n%s", grepLines(log, "forbidden", 10))
	}
	t.Logf("the agent's account %s: %d checks of the manifest's RBAC as the apiserver enforces it", agentUser, len(agentAccess))
}

func (a accessCheck) String() string {
	s := a.verb + " " + a.resource
	if a.subresource != "" {
		s += "/" + a.subresource
	}
	if a.group != "" {
		s += "." + a.group
	}
	if a.name != "" {
		s += "/" + a.name
	}
	if a.namespace != "" {
		s += " in " + a.namespace
	}
	return s
}

// grepLines returns at most n lines of s that contain sub.
func grepLines(s, sub string, n int) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) && len(out) < n {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
