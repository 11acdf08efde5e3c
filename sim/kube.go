package sim

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"time"

	"github.com/siderolabs/talos/pkg/machinery/constants"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
)

// FleetLabel on a Node names the fleet that owns it.
const FleetLabel = "sim.ichor.maesh.dev/fleet"

// kube is the fleet's Kubernetes side: each machine's Node, and each
// machine's kubelet part for the pods bound to it. Everything is driven by
// two informers (the fleet's Nodes, and pods bound to a node).
type kube struct {
	f      *Fleet
	cs     kubernetes.Interface
	stopCh chan struct{}
	nodes  cache.SharedIndexInformer
	pods   cache.SharedIndexInformer

	// kubelet runs the pods bound to the fleet's Nodes; leases renews
	// their Node Leases (nil without Kubelet.NodeLease).
	kubelet *kubelet
	leases  *leases

	mu       sync.Mutex
	ready    map[string]bool   // last Ready written per Node
	faultAnn map[string]string // last fault annotation seen per Node
	podsGone chan struct{}     // closed and replaced when a pod goes away
	// unposted are the machines whose boot's Node Ready went unwritten
	// (the API was down: Spec.Hosted); apiBack writes it.
	unposted map[*Machine]bool
}

const podNodeIndex = "node"

func startKube(ctx context.Context, f *Fleet, cs kubernetes.Interface) (*kube, error) {
	k := &kube{
		f:        f,
		cs:       cs,
		stopCh:   make(chan struct{}),
		ready:    map[string]bool{},
		faultAnn: map[string]string{},
		podsGone: make(chan struct{}),
	}
	k.kubelet = newKubelet(k)
	nodeFactory := informers.NewSharedInformerFactoryWithOptions(cs, 0, informers.WithTweakListOptions(func(o *metav1.ListOptions) {
		o.LabelSelector = FleetLabel + "=" + f.spec.Name
	}))
	k.nodes = nodeFactory.Core().V1().Nodes().Informer()
	podFactory := informers.NewSharedInformerFactoryWithOptions(cs, 0, informers.WithTweakListOptions(func(o *metav1.ListOptions) {
		o.FieldSelector = "spec.nodeName!="
	}))
	k.pods = podFactory.Core().V1().Pods().Informer()
	if err := k.pods.AddIndexers(cache.Indexers{podNodeIndex: func(obj any) ([]string, error) {
		return []string{obj.(*corev1.Pod).Spec.NodeName}, nil
	}}); err != nil {
		return nil, err
	}
	if _, err := k.nodes.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) {
			k.nodeAdded(obj)
			k.nodeChanged(obj)
		},
		UpdateFunc: func(_, obj any) { k.nodeChanged(obj) },
	}); err != nil {
		return nil, err
	}
	if _, err := k.pods.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    k.podChanged,
		UpdateFunc: func(_, obj any) { k.podChanged(obj) },
		DeleteFunc: k.podDeleted,
	}); err != nil {
		return nil, err
	}
	nodeFactory.Start(k.stopCh)
	podFactory.Start(k.stopCh)
	if !cache.WaitForCacheSync(ctx.Done(), k.nodes.HasSynced, k.pods.HasSynced) {
		close(k.stopCh)
		return nil, fmt.Errorf("sync Node and Pod informers: %w", ctx.Err())
	}
	if f.spec.Kubelet.NodeLease > 0 {
		l, err := startLeases(ctx, k)
		if err != nil {
			close(k.stopCh)
			return nil, err
		}
		k.leases = l
	}
	return k, nil
}

func (k *kube) stop() {
	close(k.stopCh)
	k.kubelet.stopAll()
}

func (k *kube) ctx() (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithTimeout(k.f.ctx, 30*time.Second)
	if !k.f.apiStores() {
		// The write could only wait for its timeout.
		cancel()
	}
	return ctx, cancel
}

// registerAll creates (or adopts) every machine's Node, a few at a time.
func (k *kube) registerAll(ctx context.Context) error {
	work := make(chan *Machine)
	errs := make(chan error, len(k.f.machines))
	var wg sync.WaitGroup
	for range 16 {
		wg.Go(func() {
			for m := range work {
				if err := k.register(ctx, m, true); err != nil {
					errs <- fmt.Errorf("register Node %s: %w", m.Name(), err)
				}
			}
		})
	}
	for _, m := range k.f.machines {
		if !m.Pending() {
			work <- m
		}
	}
	close(work)
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return err
	}
	for _, m := range k.f.machines {
		if !m.Pending() { // a machine waiting to join runs no kubelet yet
			k.kubeletStarted(m)
		}
	}
	return nil
}

// register creates the machine's Node as its kubelet registers it: Ready,
// or (a joining machine) NotReady until its network is up.
func (k *kube) register(ctx context.Context, m *Machine, ready bool) error {
	labels := map[string]string{
		corev1.LabelHostname:   m.Name(),
		corev1.LabelOSStable:   "linux",
		corev1.LabelArchStable: "amd64",
		FleetLabel:             k.f.spec.Name,
	}
	// Registered with its status in one call, as a kubelet registers.
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: m.Name(), Labels: labels}, Status: runningStatus(m)}
	now := metav1.Now()
	node.Status.Conditions = []corev1.NodeCondition{{
		Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "KubeletReady", Message: "kubelet is posting ready status",
		LastHeartbeatTime: now, LastTransitionTime: now,
	}}
	if !ready {
		c := &node.Status.Conditions[0]
		c.Status, c.Reason = corev1.ConditionFalse, "KubeletNotReady"
		c.Message = "container runtime network not ready: NetworkReady=false reason:NetworkPluginNotReady message:Network plugin returns error: cni plugin not initialized"
	}
	kv := nodeKVOf(m.Config(), m.spec.Role)
	if err := kv.applyTo(node); err != nil {
		return err
	}
	k.mu.Lock()
	k.ready[m.Name()] = ready
	k.mu.Unlock()
	_, err := k.cs.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{})
	if err == nil {
		m.node.mu.Lock()
		m.node.applied = &kv
		m.node.mu.Unlock()
	}
	if !apierrors.IsAlreadyExists(err) {
		return err
	}
	// Adopt it: our labels and status, its spec (cordon state) untouched.
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"labels": labels}})
	if _, err := k.cs.CoreV1().Nodes().Patch(ctx, m.Name(), types.StrategicMergePatchType, patch, metav1.PatchOptions{}); err != nil {
		return err
	}
	k.syncNodeConfig(m)
	return k.writeStatus(ctx, m, ready, true)
}

// runningStatus is what the kubelet of a running machine reports, but the
// conditions.
func runningStatus(m *Machine) corev1.NodeStatus {
	res := corev1.ResourceList{
		corev1.ResourceCPU:    resource.MustParse("4"),
		corev1.ResourceMemory: resource.MustParse("8Gi"),
		corev1.ResourcePods:   resource.MustParse("110"),
	}
	return corev1.NodeStatus{
		Capacity:    res,
		Allocatable: res,
		Addresses:   []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: m.addr}, {Type: corev1.NodeHostName, Address: m.Name()}},
		NodeInfo: corev1.NodeSystemInfo{
			MachineID:               fmt.Sprintf("%032x", m.addr),
			SystemUUID:              "sim-" + m.Name(),
			BootID:                  m.BootID(),
			KernelVersion:           "6.12.18-talos",
			OSImage:                 m.osImage(),
			ContainerRuntimeVersion: "containerd://2.1.5",
			KubeletVersion:          "v" + m.KubeletVersion(),
			OperatingSystem:         "linux",
			Architecture:            "amd64",
		},
	}
}

// writeStatus writes the Node's status as the kubelet posts it: Ready (or
// not, as the machine goes down), addresses and nodeInfo.
func (k *kube) writeStatus(ctx context.Context, m *Machine, ready, force bool) error {
	k.mu.Lock()
	was, known := k.ready[m.Name()]
	k.ready[m.Name()] = ready
	k.mu.Unlock()
	now := metav1.Now()
	cond := map[string]any{
		"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet is posting ready status",
		"lastHeartbeatTime": now,
	}
	if !ready {
		// What the kubelet's graceful node shutdown (Talos configures it)
		// posts as the machine goes down. Once its Lease has expired, the
		// node-lifecycle controller marks the Node Unknown.
		cond["status"], cond["reason"], cond["message"] = "False", "KubeletNotReady", "node is shutting down"
	}
	if force || !known || was != ready {
		cond["lastTransitionTime"] = now
	}
	status := map[string]any{"conditions": []any{cond}}
	if ready {
		st := runningStatus(m)
		status["addresses"], status["nodeInfo"] = st.Addresses, st.NodeInfo
		status["capacity"], status["allocatable"] = st.Capacity, st.Allocatable
	}
	patch, err := json.Marshal(map[string]any{"status": status})
	if err != nil {
		return err
	}
	_, err = k.cs.CoreV1().Nodes().Patch(ctx, m.Name(), types.StrategicMergePatchType, patch, metav1.PatchOptions{}, "status")
	return err
}

// nodeDown marks the Node NotReady. A nil kube (no API server) does nothing.
func (k *kube) nodeDown(m *Machine) {
	if k == nil {
		return
	}
	k.leases.down(m)
	k.kubelet.down(m)
	k.staticPods(m, false)
	ctx, cancel := k.ctx()
	defer cancel()
	if err := k.writeStatus(ctx, m, false, false); err != nil {
		k.f.logf("%s: Node NotReady: %v", m.Name(), err)
	}
}

// nodeUp marks the Node Ready with the running versions and uncordons it
// if Talos cordoned it.
func (k *kube) nodeUp(m *Machine) {
	if k == nil {
		return
	}
	ctx, cancel := k.ctx()
	defer cancel()
	err := k.writeStatus(ctx, m, true, false)
	if err != nil {
		k.f.logf("%s: Node Ready: %v", m.Name(), err)
	}
	if uerr := k.uncordon(ctx, m); uerr != nil {
		k.f.logf("%s: uncordon: %v", m.Name(), uerr)
		err = uerr
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.unposted == nil {
		k.unposted = map[*Machine]bool{}
	}
	k.unposted[m] = err != nil
}

// apiBack is the kubelets' next status update once an API server is
// ready again: a machine that booted while the API did not answer is
// marked Ready (and uncordoned) now.
func (k *kube) apiBack() {
	k.mu.Lock()
	var retry []*Machine
	for m, lost := range k.unposted {
		if lost {
			retry = append(retry, m)
		}
	}
	k.mu.Unlock()
	for _, m := range retry {
		if !m.Down() {
			k.nodeUp(m)
		}
	}
}

// cordon marks the Node unschedulable as Talos does when a machine starts
// upgrading, shutting down or resetting: only if it is schedulable, and
// with the talos.dev/cordoned annotation so that Talos knows it is its own.
func (k *kube) cordon(ctx context.Context, m *Machine) error {
	node, err := k.cs.CoreV1().Nodes().Get(ctx, m.Name(), metav1.GetOptions{})
	if err != nil || node.Spec.Unschedulable {
		return err
	}
	return k.patchNode(ctx, node, map[string]any{constants.AnnotationCordonedKey: constants.AnnotationCordonedValue}, true)
}

// uncordon undoes a cordon Talos made, and only that: a Node an operator
// cordoned stays cordoned.
func (k *kube) uncordon(ctx context.Context, m *Machine) error {
	node, err := k.cs.CoreV1().Nodes().Get(ctx, m.Name(), metav1.GetOptions{})
	if err != nil {
		return err
	}
	if _, ours := node.Annotations[constants.AnnotationCordonedKey]; !ours || !node.Spec.Unschedulable {
		return nil
	}
	return k.patchNode(ctx, node, map[string]any{constants.AnnotationCordonedKey: nil}, false)
}

func (k *kube) patchNode(ctx context.Context, node *corev1.Node, annotations map[string]any, unschedulable bool) error {
	patch, err := json.Marshal(map[string]any{
		"metadata": map[string]any{"resourceVersion": node.ResourceVersion, "annotations": annotations},
		"spec":     map[string]any{"unschedulable": unschedulable},
	})
	if err != nil {
		return err
	}
	_, err = k.cs.CoreV1().Nodes().Patch(ctx, node.Name, types.MergePatchType, patch, metav1.PatchOptions{})
	return err
}

// talosDrain is the drain Talos runs in its upgrade, shutdown and graceful
// reset sequences: cordon, evict every pod but mirror, unmanaged and
// DaemonSet ones, and wait for them to go, within Durations.DrainTimeout.
// Failures are logged, not fatal, as in Talos.
func (k *kube) talosDrain(ctx context.Context, m *Machine) {
	if k == nil {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, k.f.spec.Durations.DrainTimeout)
	defer cancel()
	if err := k.cordon(ctx, m); err != nil {
		k.f.logf("%s: cordon: %v", m.Name(), err)
	}
	var evicted []*corev1.Pod
	for _, pod := range k.podsOn(m) {
		if _, mirror := pod.Annotations[corev1.MirrorPodAnnotationKey]; mirror {
			continue
		}
		ref := metav1.GetControllerOf(pod)
		if ref == nil || ref.Kind == "DaemonSet" {
			continue
		}
		if err := k.evict(ctx, pod); err != nil {
			k.f.logf("%s: evict %s/%s: %v", m.Name(), pod.Namespace, pod.Name, err)
			continue
		}
		evicted = append(evicted, pod)
	}
	for {
		k.mu.Lock()
		gone := k.podsGone
		k.mu.Unlock()
		left := 0
		for _, pod := range evicted {
			if cur, ok, _ := k.pods.GetIndexer().GetByKey(pod.Namespace + "/" + pod.Name); ok && cur.(*corev1.Pod).UID == pod.UID {
				left++
			}
		}
		if left == 0 {
			return
		}
		select {
		case <-ctx.Done():
			k.f.logf("%s: drain: %d pods still there: %v", m.Name(), left, ctx.Err())
			return
		case <-gone:
		}
	}
}

func (k *kube) evict(ctx context.Context, pod *corev1.Pod) error {
	grace := int64(60)
	for {
		err := k.cs.CoreV1().Pods(pod.Namespace).EvictV1(ctx, &policyv1.Eviction{
			ObjectMeta:    metav1.ObjectMeta{Namespace: pod.Namespace, Name: pod.Name},
			DeleteOptions: &metav1.DeleteOptions{GracePeriodSeconds: &grace},
		})
		if !apierrors.IsTooManyRequests(err) {
			if apierrors.IsNotFound(err) {
				return nil
			}
			return err
		}
		// A disruption budget says not now; Talos retries too.
		if err := sleep(ctx, 100*time.Millisecond); err != nil {
			return err
		}
	}
}

func (k *kube) podsOn(m *Machine) []*corev1.Pod {
	objs, err := k.pods.GetIndexer().ByIndex(podNodeIndex, m.Name())
	if err != nil {
		return nil
	}
	pods := make([]*corev1.Pod, 0, len(objs))
	for _, o := range objs {
		pods = append(pods, o.(*corev1.Pod))
	}
	return pods
}

// nodeAdded makes the mirror pods of a running control plane whose Node
// the informer has just seen: they are owned by the Node, so they wait for
// its UID (staticPods).
func (k *kube) nodeAdded(obj any) {
	node, ok := obj.(*corev1.Node)
	if !ok {
		return
	}
	m := k.f.byName[node.Name]
	if m == nil || m.spec.Role != ControlPlane || m.Down() || m.Pending() || k.f.ctx.Err() != nil {
		return
	}
	k.f.wg.Go(func() { k.staticPods(m, true) })
}

// nodeChanged applies the fault annotation of one of the fleet's Nodes. An
// annotation that does not parse changes nothing and is reported in a
// Warning Event on the Node.
func (k *kube) nodeChanged(obj any) {
	node, ok := obj.(*corev1.Node)
	if !ok {
		return
	}
	m := k.f.byName[node.Name]
	if m == nil {
		return
	}
	val := node.Annotations[FaultAnnotation]
	k.mu.Lock()
	last, seen := k.faultAnn[node.Name]
	k.faultAnn[node.Name] = val
	k.mu.Unlock()
	if seen && last == val {
		return
	}
	faults, err := ParseFaults(val)
	if err != nil {
		k.f.logf("%s: annotation %s: %v", node.Name, FaultAnnotation, err)
		k.event(m, corev1.EventTypeWarning, "InvalidFault", fmt.Sprintf("annotation %s ignored: %v", FaultAnnotation, err))
		return
	}
	m.setAnnotationFaults(faults)
}

// event records a Kubernetes Event on the machine's Node, in the background.
func (k *kube) event(m *Machine, typ, reason, message string) {
	if k == nil || k.f.ctx.Err() != nil {
		return
	}
	k.f.wg.Add(1)
	go func() {
		defer k.f.wg.Done()
		ctx, cancel := k.ctx()
		defer cancel()
		now := metav1.Now()
		ev := &corev1.Event{
			ObjectMeta:     metav1.ObjectMeta{GenerateName: m.Name() + ".", Namespace: metav1.NamespaceDefault},
			InvolvedObject: corev1.ObjectReference{Kind: "Node", Name: m.Name(), UID: k.nodeUID(m), APIVersion: "v1"},
			Reason:         reason,
			Message:        message,
			Type:           typ,
			Source:         corev1.EventSource{Component: "ichor-sim", Host: m.Name()},
			FirstTimestamp: now,
			LastTimestamp:  now,
			Count:          1,
		}
		if _, err := k.cs.CoreV1().Events(metav1.NamespaceDefault).Create(ctx, ev, metav1.CreateOptions{}); err != nil && k.f.ctx.Err() == nil {
			k.f.logf("%s: event %s: %v", m.Name(), reason, err)
		}
	}()
}

func (k *kube) nodeUID(m *Machine) types.UID {
	if obj, ok, _ := k.nodes.GetIndexer().GetByKey(m.Name()); ok {
		return obj.(*corev1.Node).UID
	}
	return ""
}
