package agent

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/metadata"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/ringipam/ringipam/pkg/pool"
)

// Kubernetes: nodes that go (this file) and pods that vanish (vanished.go).
//
// With --kube-reclaim-nodes the host is the Kubernetes node of its name
// (the manifest passes --host=$(NODE_NAME)): its agent marks its host
// record so once (pool.Allocator.MarkKubeNode), and the elected leader
// (leader.go; no second election) follows the cluster's Node objects with
// a metadata-only informer (names, no status: what a Node costs the leader
// does not grow with its images or conditions). When a Node is deleted,
// the leader reclaims its host at once through the sweep's fenced reclaim
// (pool.Allocator.Reclaim: ranges tombstoned, owners released, the host
// marked orphaned; then portalloc's ReleaseHost under the same guard): no
// orphanAfter wait. Every commit of it requires the host's liveness key
// absent, so a host whose agent still holds its lease is never touched:
// the leader watches that one key until it goes (each watch bounded by
// SweepInterval, the key read again after each), and gives up when the
// Node comes back or it stops leading. A Node that is only NotReady keeps
// everything until orphanAfter, as any down host.
//
// When the informer has synced (a leader that started after a deletion),
// the hosts the store knows that are marked Kubernetes nodes and have no
// Node are candidates too. Only marked hosts: a store shared with hosts
// outside Kubernetes (Docker hosts, VMs running the CNI plugins) never
// loses a host for having no Node. Hosts already reclaimed with nothing
// left are not reclaimed again. A host that comes back under the same name
// finds its orphaned mark (ringctl status shows the host orphaned*, its
// agent logs it until `ringctl host ack`) and claims fresh space.

// kubeClients are the agent's clients of the apiserver.
type kubeClients struct {
	meta metadata.Interface
}

// withKube replaces the apiserver's clients (tests: fakes).
func withKube(k *kubeClients) Option { return func(o *options) { o.kube = k } }

// newKubeClients builds the clients from the kubeconfig file, or the
// pod's in-cluster configuration when none is named.
func newKubeClients(kubeconfig string) (*kubeClients, error) {
	var cfg *rest.Config
	var err error
	if kubeconfig != "" {
		cfg, err = clientcmd.BuildConfigFromFlags("", kubeconfig)
	} else {
		cfg, err = rest.InClusterConfig()
	}
	if err != nil {
		return nil, fmt.Errorf("kubernetes client configuration (--kubeconfig, or in a pod its service account): %w", err)
	}
	cfg.UserAgent = "ringipamd"
	cfg.Timeout = 30 * time.Second
	meta, err := metadata.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("kubernetes metadata client: %w", err)
	}
	return &kubeClients{meta: meta}, nil
}

var nodesResource = schema.GroupVersionResource{Version: "v1", Resource: "nodes"}

// metadataInformer is an informer of the metadata (PartialObjectMetadata)
// of resource, its lists and watches shaped by tweak (nil: all): client-go's
// metadatainformer without its package, which links every API group's
// types through the informers' interfaces (the agent's binary would double).
func metadataInformer(c metadata.Interface, resource schema.GroupVersionResource, resync time.Duration, tweak func(*metav1.ListOptions)) cache.SharedIndexInformer {
	if tweak == nil {
		tweak = func(*metav1.ListOptions) {}
	}
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			tweak(&o)
			return c.Resource(resource).List(ctx, o)
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			tweak(&o)
			return c.Resource(resource).Watch(ctx, o)
		},
	}
	// As metadatainformer does: a client that cannot stream the initial
	// list (a fake) is listed, then watched.
	return cache.NewSharedIndexInformer(cache.ToListWatcherWithWatchListSemantics(lw, c), &metav1.PartialObjectMetadata{}, resync, cache.Indexers{})
}

// nodeCandidates are the hosts the leader reclaims when its Node informer
// has synced: hosts marked Kubernetes nodes (never others: see above),
// not this one, without a Node of their name, and not already reclaimed
// with nothing left.
func nodeCandidates(hosts []pool.HostInfo, self string, hasNode func(string) bool) []string {
	var out []string
	for _, h := range hosts {
		switch {
		case !h.KubeNode, h.Name == self, hasNode(h.Name):
		case !h.OrphanedAt.IsZero() && h.Ranges == 0 && h.Used == 0:
		default:
			out = append(out, h.Name)
		}
	}
	sort.Strings(out)
	return out
}

// nodeReclaimer is the leader's follower of Node objects.
type nodeReclaimer struct {
	a       *Agent
	nodes   cache.SharedIndexInformer
	mu      sync.Mutex
	pending map[string]context.CancelFunc // hosts waiting to be reclaimed
	wg      sync.WaitGroup
}

// reclaimDeletedNodes runs while this agent leads (etcd only): see above.
func (a *Agent) reclaimDeletedNodes(ctx context.Context) {
	inf := metadataInformer(a.kube.meta, nodesResource, a.resyncPeriod(), nil)
	r := &nodeReclaimer{a: a, nodes: inf, pending: map[string]context.CancelFunc{}}
	_, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) {
			if name := objName(obj); name != "" {
				r.cancel(name, "its Node is back")
			}
		},
		DeleteFunc: func(obj any) {
			if name := objName(obj); name != "" && name != a.cfg.Host {
				a.log.Warn("kubernetes: a Node was deleted: reclaiming its host", "node", name)
				r.start(ctx, name)
			}
		},
	})
	if err != nil {
		a.log.Error("kubernetes: node informer", "err", err)
		return
	}
	go inf.Run(ctx.Done())
	defer r.wg.Wait()
	if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) {
		return
	}
	a.log.Info("kubernetes: following Node objects (the leader reclaims the hosts of deleted nodes)")
	// The deletions this leader did not see: the marked hosts without a
	// Node, once the informer lists every Node.
	var hosts []pool.HostInfo
	for ctx.Err() == nil {
		octx, cancel := context.WithTimeout(ctx, 3*time.Duration(a.cfg.Timeout))
		hosts, err = a.alloc.Hosts(octx, time.Duration(a.cfg.OrphanAfter))
		cancel()
		if err == nil {
			break
		}
		a.storeError("hosts", err)
		if sleep(ctx, time.Duration(a.cfg.SweepInterval)) != nil {
			return
		}
	}
	for _, name := range nodeCandidates(hosts, a.cfg.Host, r.hasNode) {
		a.log.Warn("kubernetes: a host marked a Kubernetes node has no Node: reclaiming it", "node", name)
		r.start(ctx, name)
	}
	<-ctx.Done()
}

func objName(obj any) string {
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = d.Obj
	}
	if m, ok := obj.(metav1.Object); ok {
		return m.GetName()
	}
	return ""
}

func (r *nodeReclaimer) hasNode(name string) bool {
	_, ok, err := r.nodes.GetStore().GetByKey(name)
	return err == nil && ok
}

// start reclaims host once its liveness key is gone, unless one is under
// way already.
func (r *nodeReclaimer) start(ctx context.Context, host string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.pending[host]; ok {
		return
	}
	hctx, cancel := context.WithCancel(ctx)
	r.pending[host] = cancel
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		r.a.reclaimNodeHost(hctx, host, r.hasNode)
		r.mu.Lock()
		delete(r.pending, host)
		r.mu.Unlock()
		cancel()
	}()
}

func (r *nodeReclaimer) cancel(host, why string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if cancel, ok := r.pending[host]; ok {
		r.a.log.Info("kubernetes: not reclaiming the host of a deleted Node: "+why, "node", host)
		cancel()
		delete(r.pending, host)
	}
}

// reclaimNodeHost reclaims host when its liveness key is absent, waiting
// for the key to go while it exists (a watch of that one key, bounded by
// SweepInterval, then read again), until ctx ends or hasNode says its Node
// is back.
func (a *Agent) reclaimNodeHost(ctx context.Context, host string, hasNode func(string) bool) {
	key := a.prefix + pool.LivenessKey(host)
	said := false
	for ctx.Err() == nil {
		if hasNode(host) {
			a.log.Info("kubernetes: not reclaiming the host of a deleted Node: its Node is back", "node", host)
			return
		}
		octx, cancel := a.op(ctx)
		got, err := a.cli.Get(octx, key)
		cancel()
		if err != nil {
			a.storeError("kube-node-liveness", err)
			if sleep(ctx, time.Duration(a.cfg.SweepInterval)) != nil {
				return
			}
			continue
		}
		if len(got.Kvs) == 0 {
			err := a.reclaimHost(ctx, host)
			if err == nil {
				return
			}
			if !errors.Is(err, pool.ErrHostLive) {
				a.storeError("kube-node-reclaim", err)
				if sleep(ctx, time.Duration(a.cfg.SweepInterval)) != nil {
					return
				}
			}
			continue
		}
		if !said {
			a.log.Warn("kubernetes: the host of a deleted Node is still up (its agent holds its liveness key): waiting for the key to go before reclaiming it", "node", host)
			said = true
		}
		wctx, cancel := context.WithTimeout(ctx, time.Duration(a.cfg.SweepInterval))
		for resp := range a.cli.Watch(wctx, key, clientv3.WithRev(got.Header.Revision+1), clientv3.WithFilterPut()) {
			if resp.Err() != nil || len(resp.Events) > 0 {
				break
			}
		}
		cancel()
	}
}

// reclaimHost is the sweep's reclaim of one host (pool.Sweeper's steps 1
// and 2): its space, then its published ports under the reclaim guard.
func (a *Agent) reclaimHost(ctx context.Context, host string) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Duration(a.cfg.Timeout))
	defer cancel()
	rep, err := a.alloc.Reclaim(ctx, host, pool.ReclaimOptions{})
	if err != nil {
		return fmt.Errorf("reclaiming %s: %w", host, err)
	}
	guard, err := a.alloc.ReclaimGuard(ctx, host, false)
	if err != nil {
		return fmt.Errorf("releasing the published ports of %s: %w", host, err)
	}
	rel, err := a.ports.ReleaseHost(ctx, host, guard)
	if err != nil {
		return fmt.Errorf("releasing the published ports of %s: %w", host, err)
	}
	a.metrics.nodeReclaims.Inc()
	a.metrics.reclaims.Inc()
	a.metrics.released.Add(float64(rep.Released))
	a.metrics.ports.Add(float64(len(rel)))
	a.log.Warn("kubernetes: reclaimed the host of a deleted Node", "node", host, "pools", rep.TombstonedPools,
		"ownersReleased", rep.Released, "endpointsWithPortsReleased", len(rel), "alreadyReclaimed", rep.AlreadyWas)
	return nil
}
