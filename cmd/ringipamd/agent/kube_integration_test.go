//go:build integration

package agent

import (
	"context"
	"net/netip"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	metadatafake "k8s.io/client-go/metadata/fake"

	"github.com/ringipam/ringipam/pkg/pool"
)

// fakeNodes is a metadata client holding Node objects of names.
func fakeNodes(t *testing.T, names ...string) *metadatafake.FakeMetadataClient {
	t.Helper()
	sch := metadatafake.NewTestScheme()
	if err := metav1.AddMetaToScheme(sch); err != nil {
		t.Fatal(err)
	}
	var objs []runtime.Object
	for _, n := range names {
		objs = append(objs, node(n))
	}
	return metadatafake.NewSimpleMetadataClient(sch, objs...)
}

func node(name string) *metav1.PartialObjectMetadata {
	return &metav1.PartialObjectMetadata{TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "Node"}, ObjectMeta: metav1.ObjectMeta{Name: name}}
}

func (e *etcdEnv) kubeConfig(t *testing.T, host string, lead bool) Config {
	cfg := e.config(t, host)
	cfg.KubeReclaimNodes, cfg.Sweep = true, lead
	return cfg
}

func hostInfo(t *testing.T, a *pool.Allocator, name string) pool.HostInfo {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	hosts, err := a.Hosts(ctx, 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, h := range hosts {
		if h.Name == name {
			return h
		}
	}
	return pool.HostInfo{}
}

// TestDeletedNodeReclaimed: the leader reclaims the host of a deleted
// Node once its agent is gone, not before; a host that never ran as a
// Kubernetes node is not reclaimed for having no Node, a marked one
// without a Node is reclaimed by a leader that starts after the deletion.
func TestDeletedNodeReclaimed(t *testing.T) {
	e := newEtcdEnv(t)
	ctx := context.Background()
	nodes := fakeNodes(t, "lead", "gone", "later")
	kube := &kubeClients{meta: nodes}
	lead := e.start(t, e.kubeConfig(t, "lead", true), withKube(kube))
	waitCond(t, "lead leads", lead.Leading)
	// gone and later run as Kubernetes nodes, docker never does.
	gone := e.start(t, e.kubeConfig(t, "gone", false), withKube(kube))
	later := e.start(t, e.kubeConfig(t, "later", false), withKube(kube))
	docker := e.start(t, e.config(t, "docker"))
	def := pool.Def{Name: "p", Ranges: []pool.Range{{Subnet: netip.MustParsePrefix("198.18.0.0/24")}}}
	owner := func(id string) pool.Owner {
		return pool.Owner{Kind: pool.KindCNI, Network: "n", ContainerID: id, IfName: "eth0"}
	}
	check := e.allocator(t, "check", nil)
	for _, h := range []string{"gone", "later", "docker"} {
		a := e.allocator(t, h, nil)
		if _, err := a.Allocate(ctx, pool.Request{Owner: owner(h), Wants: []pool.Want{{Pool: "p", Role: pool.RoleIP}}, Defs: []pool.Def{def}}); err != nil {
			t.Fatal(err)
		}
	}
	waitCond(t, "gone and later marked Kubernetes nodes", func() bool {
		return hostInfo(t, check, "gone").KubeNode && hostInfo(t, check, "later").KubeNode && !hostInfo(t, check, "docker").KubeNode
	})
	held := func(h string) bool {
		_, ok, err := check.Lookup(ctx, owner(h))
		if err != nil {
			t.Fatal(err)
		}
		return ok
	}

	// The Node goes while its agent runs: nothing of gone is touched
	// (observed over several sweep intervals of the leader).
	if err := nodes.Resource(nodesResource).Delete(ctx, "gone", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	for range 20 {
		time.Sleep(50 * time.Millisecond)
		if !held("gone") {
			t.Fatal("gone's owner released while its agent held its liveness key")
		}
	}
	gone.stop()
	waitCond(t, "gone reclaimed once its agent stopped", func() bool {
		h := hostInfo(t, check, "gone")
		return !held("gone") && h.Ranges == 0 && !h.OrphanedAt.IsZero()
	})
	if n := counter(t, lead.Agent, "ringipam_node_reclaims_total"); n != 1 {
		t.Errorf("ringipam_node_reclaims_total = %v, want 1", n)
	}

	// later's Node goes while no agent leads... then a leader starts:
	// later (marked) is reclaimed, docker (never a Kubernetes node) is not.
	lead.stop()
	later.stop()
	if err := nodes.Resource(nodesResource).Delete(ctx, "later", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	docker.stop()
	lead2 := e.start(t, e.kubeConfig(t, "lead", true), withKube(kube))
	waitCond(t, "a new leader reclaims later", func() bool { return lead2.Leading() && !held("later") })
	for range 20 {
		time.Sleep(50 * time.Millisecond)
		if !held("docker") {
			t.Fatal("docker's owner released: it was never a Kubernetes node")
		}
	}
	if n := counter(t, lead2.Agent, "ringipam_node_reclaims_total"); n != 1 {
		t.Errorf("the new leader's ringipam_node_reclaims_total = %v, want 1 (later only; gone has nothing left)", n)
	}
}
