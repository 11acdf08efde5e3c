package operation

import (
	"context"
	"fmt"
	"sort"
	"sync"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/selection"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"maesh.dev/ichor/api/compat"
	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/cilium"
	"maesh.dev/ichor/controller/machine"
	"maesh.dev/ichor/controller/machineconfig"
	"maesh.dev/ichor/controller/preflight"
	"maesh.dev/ichor/controller/watchlist"
)

// facts gathers what preflight reads: the versions of the machines in scope
// and of the others, the control plane's Kubernetes version, and Cilium's.
func (t *turn) facts(ctx context.Context) (preflight.Cluster, error) {
	var c preflight.Cluster
	inScope := map[string]bool{}
	for _, m := range t.op.Status.Machines {
		inScope[m.Name] = true
	}
	for _, n := range t.nodes {
		pm := preflight.Machine{Name: n.Name, Role: machine.Role(n), Talos: machine.TalosVersion(n), Kubelet: machine.KubeletVersion(n)}
		if inScope[n.Name] {
			c.Machines = append(c.Machines, pm)
		} else {
			c.Others = append(c.Others, pm)
		}
	}
	cp, err := t.controlPlaneVersion(ctx)
	if err != nil {
		return c, err
	}
	c.ControlPlane = cp
	switch t.op.Spec.Kind {
	case ichorv1.KindCNI:
		agents, err := cilium.ReadAgents(ctx, t.r.live())
		if err != nil {
			return c, err
		}
		if agents != nil {
			c.Cilium = agents.Version.String()
		}
		c.CiliumChart = t.r.Controller.Chart.Version
	case ichorv1.KindIchor:
		c.Ichor = t.r.Controller.Version
	case ichorv1.KindKubernetes:
		if err := t.removedFacts(ctx, &c); err != nil {
			return c, err
		}
	}
	return c, nil
}

// removedFacts gathers what the removed-items checks of the upgrade's path
// read (preflight.RemovedBetween): what the configurations of the machines
// in scope and of every control plane give the components, read a few
// machines at a time through the Talos API, and how many objects each
// removed API resource still stores. A machine whose configuration cannot
// be read is named in c.Unreadable.
func (t *turn) removedFacts(ctx context.Context, c *preflight.Cluster) error {
	if t.op.Spec.Kubernetes == nil {
		return nil
	}
	from, err1 := compat.ParseVersion(c.ControlPlane)
	to, err2 := compat.ParseVersion(t.op.Spec.Kubernetes.Version)
	if err1 != nil || err2 != nil {
		return nil // preflight refuses the versions themselves
	}
	rm := preflight.RemovedBetween(from.MajorMinor(), to.MajorMinor())
	if len(rm.FeatureGates) > 0 || len(rm.Flags) > 0 {
		t.configuredFacts(ctx, c)
	}
	for _, api := range rm.APIs {
		n, err := t.storedObjects(ctx, api)
		if err != nil {
			return err
		}
		if n > 0 {
			if c.InUse == nil {
				c.InUse = map[string]int{}
			}
			c.InUse[api] = n
		}
	}
	return nil
}

// configuredFacts reads the configuration of the machines in scope and of
// every control plane, kindCheckers at a time.
func (t *turn) configuredFacts(ctx context.Context, c *preflight.Cluster) {
	if t.talos == nil {
		c.Unreadable = append(c.Unreadable, "the machines' configurations (no Talos client)")
		return
	}
	inScope := map[string]bool{}
	for _, m := range t.op.Status.Machines {
		inScope[m.Name] = true
	}
	var mu sync.Mutex
	var wg sync.WaitGroup
	slots := make(chan struct{}, kindCheckers)
	for _, n := range t.nodes {
		if !inScope[n.Name] && machine.Role(n) != ichorv1.RoleControlPlane {
			continue
		}
		slots <- struct{}{}
		wg.Go(func() {
			defer func() { <-slots }()
			rctx, cancel := context.WithTimeout(ctx, configReadTimeout)
			defer cancel()
			cfg, err := machineconfig.Machine{Talos: t.talos.Client, Node: machine.Address(n)}.Active(rctx)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				c.Unreadable = append(c.Unreadable, fmt.Sprintf("the configuration of %s (%v)", n.Name, err))
				return
			}
			c.Configured = append(c.Configured, preflight.ConfiguredIn(n.Name, cfg)...)
		})
	}
	wg.Wait()
	// The machines in a stable order, so the messages are too.
	sort.SliceStable(c.Configured, func(i, j int) bool { return c.Configured[i].Machine < c.Configured[j].Machine })
	sort.Strings(c.Unreadable)
}

// configReadTimeout bounds one machine's configuration read in preflight: a
// machine that does not answer is reported, not waited for.
const configReadTimeout = 15 * time.Second

// storedObjects counts the objects of an API resource ("resource.version.group"),
// as go-kubernetes' removed-API check lists them; none when the API server
// does not serve it.
func (t *turn) storedObjects(ctx context.Context, api string) (int, error) {
	gvr, _ := schema.ParseResourceArg(api)
	if gvr == nil {
		return 0, fmt.Errorf("removed API %q is not resource.version.group", api)
	}
	live := t.r.live()
	gvk, err := live.RESTMapper().KindFor(*gvr)
	if meta.IsNoMatchError(err) || apierrors.IsNotFound(err) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("look up %s: %w", api, err)
	}
	list := &metav1.PartialObjectMetadataList{}
	list.SetGroupVersionKind(gvk.GroupVersion().WithKind(gvk.Kind + "List"))
	if err := live.List(ctx, list, client.Limit(1)); err != nil {
		if apierrors.IsNotFound(err) || meta.IsNoMatchError(err) {
			return 0, nil
		}
		return 0, fmt.Errorf("list %s: %w", api, err)
	}
	n := len(list.Items)
	if rest := list.GetRemainingItemCount(); rest != nil {
		n += int(*rest)
	} else if list.GetContinue() != "" {
		n++ // more than one; the API server did not say how many
	}
	return n, nil
}

// controlPlaneVersion is the Kubernetes version the cluster runs, as
// `talosctl upgrade-k8s` detects it (preflight.RunningKubernetes): the
// lowest image tag of the control-plane mirror pods (cached) and of
// kube-proxy's DaemonSet (read live); while that DaemonSet rolls out, of its
// pods too (read then only, as a watch-list: 5,000 of them are not worth
// caching). The
// control-plane kubelets stand in when neither runs.
func (t *turn) controlPlaneVersion(ctx context.Context) (string, error) {
	var pods corev1.PodList
	apps, err := labels.NewRequirement("k8s-app", selection.In, preflight.KubernetesApps)
	if err != nil {
		return "", err
	}
	if err := t.r.Client.List(ctx, &pods, client.InNamespace("kube-system"), client.MatchingLabelsSelector{Selector: labels.NewSelector().Add(*apps)}); err != nil {
		return "", fmt.Errorf("list the control-plane pods: %w", err)
	}
	proxy := &appsv1.DaemonSet{}
	switch err := t.r.live().Get(ctx, client.ObjectKey{Namespace: "kube-system", Name: "kube-proxy"}, proxy); {
	case apierrors.IsNotFound(err):
		proxy = nil
	case err != nil:
		return "", fmt.Errorf("read kube-proxy's DaemonSet: %w", err)
	case rollingOut(proxy):
		proxyPods, err := watchlist.Pods(ctx, t.r.Clientset.CoreV1().Pods("kube-system"), metav1.ListOptions{LabelSelector: "k8s-app=kube-proxy"})
		if err != nil {
			return "", fmt.Errorf("list kube-proxy's pods: %w", err)
		}
		pods.Items = append(pods.Items, proxyPods.Items...)
	}
	if v := preflight.RunningKubernetes(pods.Items, proxy); v != "" {
		return v, nil
	}
	var versions []string
	for _, n := range t.nodes {
		if machine.Role(n) == ichorv1.RoleControlPlane {
			versions = append(versions, machine.KubeletVersion(n))
		}
	}
	return preflight.LowestVersion(versions), nil
}

// rollingOut reports whether some of a DaemonSet's pods may still run an
// older template.
func rollingOut(ds *appsv1.DaemonSet) bool {
	st := ds.Status
	return st.ObservedGeneration < ds.Generation || st.UpdatedNumberScheduled < st.DesiredNumberScheduled ||
		st.NumberAvailable < st.DesiredNumberScheduled
}
