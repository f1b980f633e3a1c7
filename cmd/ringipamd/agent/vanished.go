package agent

import (
	"context"
	"fmt"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/ringipam/ringipam/pkg/cni/portmap"
	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/portalloc"
)

// Pods that vanish without a DEL (--kube-vanished-pods).
//
// A node that crashed, a runtime whose state was wiped, a pod
// force-deleted while its node was away: the runtime never sends the DEL
// of a sandbox it forgot, and the address stays held for ever. ipam-ring
// records the pod (K8S_POD_NAMESPACE, K8S_POD_NAME, K8S_POD_UID) and the
// time with each new allocation (pool.Allocation's Pod and Since); the
// owner's container ID is the pod's sandbox ID. Every agent follows the
// pods of its own node only (a metadata-only informer, namespace, name
// and UID, with the field selector spec.nodeName=<host>: its cost does
// not grow with the cluster) and,
// every vanishedEvery, reads this host's own CNI owners (its index: O(its
// pods)) and asks the runtime for its sandboxes (one CRI ListPodSandbox).
// An owner is released (vanished) only when all of these hold:
//
//   - its record names a pod and its allocation time (records written
//     before, or by a runtime that sent no K8S_POD_*, are never touched);
//   - the pod informer has synced;
//   - the allocation is older than --vanished-grace (a pod being created:
//     containerd lists a sandbox only once its network is set up);
//   - no pod of that namespace and name exists, or one with another UID
//     (a StatefulSet's pod recreated);
//   - the informer has known it gone for --vanished-grace (since it saw the
//     deletion, or since its first sync for a pod it never saw);
//   - the runtime answered and has no sandbox of the owner's container ID
//     (a sandbox the runtime still has gets its DEL from kubelet; a runtime
//     that cannot be asked releases nothing).
//
// The release is the DEL's: portmap-ingress's (its forwards and published
// ports, under the attachment's lock) then ipam-ring's (pool ReleaseWith:
// a reservation keeps its address held as after any DEL). Each is logged
// and counted in ringipam_vanished_pods_released_total.

var podsResource = schema.GroupVersionResource{Version: "v1", Resource: "pods"}

// podPresence is what the pod informer says of an owner's pod.
type podPresence int

const (
	podPresent  podPresence = iota // a pod of that namespace/name and UID
	podAbsent                      // no pod of that namespace/name
	podOtherUID                    // a pod of that namespace/name, another UID
)

// sandboxPresence is what the runtime says of an owner's sandbox.
type sandboxPresence int

const (
	sandboxUnknown sandboxPresence = iota // the runtime could not be asked
	sandboxPresent
	sandboxAbsent
)

// vanishedFacts are what the decision on one owner is made from.
type vanishedFacts struct {
	Recorded bool          // the record names a pod and its allocation time
	Synced   bool          // the pod informer has synced
	Age      time.Duration // since the allocation
	Pod      podPresence
	GoneFor  time.Duration // since the informer knew the pod gone
	Sandbox  sandboxPresence
}

// vanished decides whether an owner's pod vanished without a DEL (see
// above): release, or why not.
func vanished(f vanishedFacts, grace time.Duration) (release bool, why string) {
	switch {
	case !f.Recorded:
		return false, "no pod recorded"
	case !f.Synced:
		return false, "pods not listed yet"
	case f.Age < grace:
		return false, "allocated within the grace period (being created)"
	case f.Pod == podPresent:
		return false, "pod exists"
	case f.GoneFor < grace:
		return false, "pod not known gone for the grace period"
	case f.Sandbox == sandboxUnknown:
		return false, "runtime not asked"
	case f.Sandbox == sandboxPresent:
		return false, "sandbox exists (its DEL comes from kubelet)"
	}
	return true, "pod and sandbox gone"
}

// vanishedEvery is how often the owners are looked at: a quarter of the
// grace, within [1s, 1m].
func vanishedEvery(grace time.Duration) time.Duration {
	return min(max(grace/4, time.Second), time.Minute)
}

// podWatch is this node's pods as the informer shows them.
type podWatch struct {
	inf cache.SharedIndexInformer
	mu  sync.Mutex
	// synced is when the informer first synced; gone when it saw each
	// pod UID deleted (forgotten after twice the grace).
	synced time.Time
	gone   map[types.UID]time.Time
}

func (w *podWatch) deleted(uid types.UID, now time.Time) {
	w.mu.Lock()
	w.gone[uid] = now
	w.mu.Unlock()
}

// facts fills the informer's part of the facts of rec at now.
func (w *podWatch) facts(rec pool.Allocation, now time.Time, f *vanishedFacts) {
	w.mu.Lock()
	synced := w.synced
	goneAt, seenGone := w.gone[types.UID(rec.Pod.UID)]
	w.mu.Unlock()
	f.Synced = !synced.IsZero()
	f.Pod = podAbsent
	if obj, ok, err := w.inf.GetStore().GetByKey(rec.Pod.Namespace + "/" + rec.Pod.Name); err == nil && ok {
		if p, ok := obj.(metav1.Object); ok {
			f.Pod = podPresent
			if rec.Pod.UID != "" && string(p.GetUID()) != rec.Pod.UID {
				f.Pod = podOtherUID
			}
		}
	}
	since := synced
	if seenGone && goneAt.After(since) {
		since = goneAt
	}
	if f.Synced {
		f.GoneFor = now.Sub(since)
	}
}

func (w *podWatch) prune(now time.Time, keep time.Duration) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for uid, t := range w.gone {
		if now.Sub(t) > keep {
			delete(w.gone, uid)
		}
	}
}

// collectVanishedPods runs until ctx ends (every agent with
// --kube-vanished-pods).
func (a *Agent) collectVanishedPods(ctx context.Context) {
	grace := time.Duration(a.cfg.VanishedGrace)
	sel := fields.OneTermEqualSelector("spec.nodeName", a.cfg.Host).String()
	w := &podWatch{gone: map[types.UID]time.Time{}}
	w.inf = metadataInformer(a.kube.meta, podsResource, a.resyncPeriod(), func(o *metav1.ListOptions) { o.FieldSelector = sel })
	_, err := w.inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		DeleteFunc: func(obj any) {
			if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = d.Obj
			}
			if p, ok := obj.(metav1.Object); ok {
				w.deleted(p.GetUID(), a.now())
			}
		},
	})
	if err != nil {
		a.log.Error("kubernetes: pod informer", "err", err)
		return
	}
	go w.inf.Run(ctx.Done())
	if !cache.WaitForCacheSync(ctx.Done(), w.inf.HasSynced) {
		return
	}
	w.mu.Lock()
	w.synced = a.now()
	w.mu.Unlock()
	a.log.Info("kubernetes: following this node's pods (addresses of pods gone without a DEL are released)", "node", a.cfg.Host, "grace", grace, "criSocket", a.cfg.CRISocket)
	conn, err := grpc.NewClient("unix://"+a.cfg.CRISocket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		a.log.Error("kubernetes: CRI client: no address of a vanished pod is released", "criSocket", a.cfg.CRISocket, "err", err)
		return
	}
	defer conn.Close()
	rt := runtimeapi.NewRuntimeServiceClient(conn)
	t := time.NewTicker(vanishedEvery(grace))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		a.vanishedPass(ctx, w, rt, grace)
		w.prune(a.now(), 2*grace)
	}
}

// vanishedPass looks at this host's CNI owners once.
func (a *Agent) vanishedPass(ctx context.Context, w *podWatch, rt runtimeapi.RuntimeServiceClient, grace time.Duration) {
	octx, cancel := a.op(ctx)
	recs, err := a.alloc.List(octx, pool.Filter{Kind: pool.KindCNI, Host: a.cfg.Host})
	cancel()
	if err != nil {
		a.storeError("vanished-pods", err)
		return
	}
	now := a.now()
	type cand struct {
		rec pool.Allocation
		f   vanishedFacts
	}
	var cands []cand
	for _, rec := range recs {
		f := vanishedFacts{Recorded: rec.Pod != nil && rec.Since != 0}
		if f.Recorded {
			f.Age = now.Sub(time.Unix(rec.Since, 0))
			w.facts(rec, now, &f)
		}
		// The runtime is asked only when nothing else keeps the owner.
		f.Sandbox = sandboxAbsent
		if ok, _ := vanished(f, grace); ok {
			cands = append(cands, cand{rec, f})
		}
	}
	if len(cands) == 0 {
		return
	}
	sandboxes, err := listSandboxes(ctx, rt, time.Duration(a.cfg.Timeout))
	if err != nil {
		a.metrics.criErrs.Inc()
		a.log.Warn("kubernetes: the runtime cannot be asked for its sandboxes: no address of a vanished pod is released", "criSocket", a.cfg.CRISocket, "err", err)
		return
	}
	for _, c := range cands {
		c.f.Sandbox = sandboxAbsent
		if sandboxes[c.rec.Owner.ContainerID] {
			c.f.Sandbox = sandboxPresent
		}
		ok, why := vanished(c.f, grace)
		if !ok {
			a.log.Debug("kubernetes: keeping the address of a pod gone from the apiserver", "owner", c.rec.Owner.String(), "why", why)
			continue
		}
		if err := a.releaseVanished(ctx, c.rec); err != nil {
			a.storeError("vanished-pods", err)
			continue
		}
		a.metrics.vanished.Inc()
		a.log.Warn("kubernetes: released the address of a pod that vanished without a DEL (pod gone from the apiserver, sandbox gone from the runtime)",
			"pod", c.rec.Pod.Namespace+"/"+c.rec.Pod.Name, "uid", c.rec.Pod.UID, "owner", c.rec.Owner.String(),
			"addrs", addrsText(c.rec.Addrs), "allocatedAt", time.Unix(c.rec.Since, 0).UTC(), "goneFor", c.f.GoneFor.Round(time.Second))
	}
}

func addrsText(as []pool.Assigned) []string {
	out := make([]string, len(as))
	for i, x := range as {
		out[i] = x.Addr.String()
	}
	return out
}

// listSandboxes returns the IDs of every sandbox the runtime has, in any
// state.
func listSandboxes(ctx context.Context, rt runtimeapi.RuntimeServiceClient, timeout time.Duration) (map[string]bool, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	resp, err := rt.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{})
	if err != nil {
		return nil, fmt.Errorf("ListPodSandbox: %w", err)
	}
	out := make(map[string]bool, len(resp.Items))
	for _, s := range resp.Items {
		out[s.Id] = true
	}
	return out, nil
}

// releaseVanished releases rec as the runtime's DEL of its attachment
// would: portmap-ingress's part under the attachment's lock, then the
// addresses (a reservation keeps them held, as after a DEL).
func (a *Agent) releaseVanished(ctx context.Context, rec pool.Allocation) error {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Duration(a.cfg.Timeout))
	defer cancel()
	id := portalloc.EndpointID{Network: rec.Owner.Network, ContainerID: rec.Owner.ContainerID, IfName: rec.Owner.IfName}
	lock := portmap.MarkLock(portmap.Mark(id))
	unlock, err := a.locks.Lock(ctx, lock)
	if err != nil {
		return fmt.Errorf("the lock of %s: %w", rec.Owner, err)
	}
	var dp portmap.Dataplane
	if a.pm != nil {
		dp = a.pm
	}
	err = portmap.Del(ctx, a.ports, dp, id)
	unlock()
	if err != nil {
		return fmt.Errorf("releasing the published ports of %s: %w", rec.Owner, err)
	}
	_ = a.locks.Discard(lock)
	hint := pool.ReleaseHint{Reservation: rec.Reservation}
	for _, x := range rec.Addrs {
		hint.Pools = append(hint.Pools, x.Pool)
	}
	if _, _, err := a.alloc.ReleaseWith(ctx, rec.Owner, hint); err != nil {
		return fmt.Errorf("releasing %s: %w", rec.Owner, err)
	}
	return nil
}
