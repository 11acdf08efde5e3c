package executor

import (
	"context"
	"fmt"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	kruntime "k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	talosclient "github.com/siderolabs/talos/pkg/machinery/client"

	"maesh.dev/ichor/controller/bootstrap"
	"maesh.dev/ichor/controller/talos"
)

// rendered is what the bootstrap-manifests stage reads from the control
// plane that runs it: its bootstrap manifests, once they render the
// kube-proxy image of its configuration at the target version.
type rendered struct {
	objs []*unstructured.Unstructured
	// off says why there is nothing to sync (kube-proxy disabled).
	off string
	// waiting says what Talos has not rendered yet.
	waiting string
}

// readRendered reads the control plane's configuration and bootstrap
// manifests. The kube-proxy stage patched cluster.proxy.image on every
// control plane before; Talos renders the manifests anew from it a moment
// after the configuration applies.
func readRendered(ctx context.Context, e *Env) (rendered, error) {
	if err := e.requireAddress(); err != nil {
		return rendered{}, err
	}
	active, err := configMachine(e).Active(ctx)
	if err != nil {
		return rendered{}, configFail(err)
	}
	if why := proxyDisabled(active); why != "" {
		return rendered{off: why}, nil
	}
	want, version := active.Cluster().Proxy().Image(), kubernetesVersion(e.Op)
	if imageTag(want) != version {
		return rendered{}, Fail("KubeProxyNotPatched", "cluster.proxy.image on %s is %s, not at %s: retry to patch it again", e.Machine.Name, want, version)
	}
	objs, err := bootstrap.Read(talosclient.WithNode(ctx, e.Address), e.Talos.COSI)
	if talos.Unreachable(err) {
		return rendered{}, err
	}
	if err != nil {
		return rendered{}, Fail("ManifestsNotRead", "%s: %w; once it answers, retry", e.Machine.Name, err)
	}
	got := "no kube-proxy DaemonSet"
	for _, o := range objs {
		if o.GetKind() != "DaemonSet" || o.GetNamespace() != "kube-system" || o.GetName() != "kube-proxy" {
			continue
		}
		got = proxyImageOf(o)
		if got == want {
			return rendered{objs: objs}, nil
		}
	}
	return rendered{waiting: fmt.Sprintf("waiting for Talos on %s to render kube-proxy %s (it renders %s)", e.Machine.Name, version, got)}, nil
}

// proxyImageOf is the image of the kube-proxy container of a DaemonSet.
func proxyImageOf(o *unstructured.Unstructured) string {
	ds := &appsv1.DaemonSet{}
	if err := kruntime.DefaultUnstructuredConverter.FromUnstructured(o.Object, ds); err != nil {
		return "a DaemonSet that does not decode: " + err.Error()
	}
	return podImage(&ds.Spec.Template.Spec, "kube-proxy")
}

// manifestsRenderedStep waits until the control plane renders the bootstrap
// manifests from its new cluster.proxy.image. With kube-proxy disabled the
// stage is done: there is no kube-proxy to move, and a sync would prune
// the objects Talos applied for it.
func manifestsRenderedStep() Step {
	return Step{Name: StepManifestsRendered, Timeout: 2 * time.Minute, Wait: func(ctx context.Context, e *Env) (bool, Outcome, error) {
		r, err := readRendered(ctx, e)
		if talos.Unreachable(err) {
			return false, Outcome{Message: "waiting for the Talos API to answer", Recheck: time.Second}, nil
		}
		switch {
		case err != nil:
			return false, Outcome{}, err
		case r.off != "":
			return true, Outcome{Done: true, Message: r.off}, nil
		case r.waiting != "":
			return false, Outcome{Message: r.waiting, Recheck: time.Second}, nil
		}
		return true, Outcome{}, nil
	}}
}

// syncManifestsStep applies the bootstrap manifests as talosctl does
// (bootstrap.Sync). It reads them again: they are what it applies, and a
// sync run again (a controller killed before it recorded the sync) applies
// the same objects, which changes nothing.
func syncManifestsStep() Step {
	return Step{Name: StepSyncManifests, Timeout: 10 * time.Minute, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		r, err := readRendered(ctx, e)
		switch {
		case err != nil:
			return Outcome{}, err
		case r.off != "":
			return Outcome{Done: true, Message: r.off}, nil
		case r.waiting != "":
			return Outcome{}, &StepError{Reason: "ManifestsNotRendered", RetryFrom: StepManifestsRendered, Err: fmt.Errorf("%s; a retry waits again", r.waiting)}
		}
		res, err := bootstrap.Sync(ctx, e.Live, r.objs)
		if err != nil {
			return Outcome{}, Fail("ManifestSyncFailed", "sync the bootstrap manifests of %s (%s so far): %w; once fixed, retry", e.Machine.Name, res, err)
		}
		return Outcome{Message: fmt.Sprintf("bootstrap manifests of %s synced: %s", e.Machine.Name, res)}, nil
	}}
}

// manifestsReadyStep waits until what the sync applied has reconciled:
// kube-proxy's DaemonSet, on its new image, rolled out by the DaemonSet
// controller to every node.
func manifestsReadyStep() Step {
	return Step{Name: StepManifestsReady, Timeout: 10 * time.Minute, Wait: func(ctx context.Context, e *Env) (bool, Outcome, error) {
		version := kubernetesVersion(e.Op)
		ds := kubeProxyObjects()[0].(*appsv1.DaemonSet)
		err := e.Live.Get(ctx, client.ObjectKeyFromObject(ds), ds)
		if err != nil && !apierrors.IsNotFound(err) {
			return false, Outcome{}, err
		}
		if img := podImage(&ds.Spec.Template.Spec, "kube-proxy"); err != nil || imageTag(img) != version {
			return false, Outcome{}, &StepError{Reason: "KubeProxyNotSynced", RetryFrom: StepManifestsRendered,
				Err: fmt.Errorf("after the sync, DaemonSet kube-system/kube-proxy runs %q, not %s: a retry syncs again", img, version)}
		}
		// While the DaemonSet rolls out (each change of it wakes the step),
		// it is what the wait is for: the rest of the inventory is read
		// once it has, not at every change.
		if ok, why, err := bootstrap.RolledOut(ds, appsv1.SchemeGroupVersion.WithKind("DaemonSet")); err != nil || !ok {
			return false, Outcome{Message: why, Recheck: 10 * time.Second}, err
		}
		ok, why, err := bootstrap.Reconciled(ctx, e.Live)
		if err != nil || !ok {
			// A change of kube-proxy's DaemonSet or CoreDNS's Deployment
			// wakes the step (the controller watches them); the recheck is
			// for a read that failed and the tracked objects nobody watches.
			return false, Outcome{Message: why, Recheck: 10 * time.Second}, err
		}
		return true, Outcome{Message: fmt.Sprintf("kube-proxy %s rolled out; %s", version, why)}, nil
	}}
}
