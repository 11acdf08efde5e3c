package executor

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/kubectl/pkg/util/podutils"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/machine"
	"maesh.dev/ichor/manifests"
)

// Steps of the ichor kind.
const (
	StepIchorInstall = "install-ichor"
	StepIchorJob     = "wait-installed"
	StepNewVersion   = "wait-new-version"
)

// InstallerServiceAccount is the ServiceAccount the installer Job runs as
// (manifests/controller/jobs.yaml).
const InstallerServiceAccount = "ichor-installer"

// ReleaseImage is where Ichor's releases publish the controller image.
const ReleaseImage = "ghcr.io/maesh-dev/ichor-controller"

// IchorUpgrade upgrades Ichor through an installer Job that runs the
// target's image and applies the target's own manifests. The Deployment's
// rollout replaces the controller's pods, and the operation is finished by
// the new version: its last step is done only for a controller of the
// target version, once every replica runs the target and the leader Lease
// says so. A controller of the old version never marks it done. The
// operation's steps are those of one machine, the first control plane: it
// changes no machine.
type IchorUpgrade struct{}

// Target implements Executor.
func (IchorUpgrade) Target(op *ichorv1.TalosOperation) (string, string) {
	if op.Spec.Ichor == nil {
		return "", ""
	}
	return "ichor " + op.Spec.Ichor.Version, ""
}

// Scope implements Executor: one entry, the first control plane, whose
// steps are the cluster-wide ones.
func (IchorUpgrade) Scope(op *ichorv1.TalosOperation, nodes []*corev1.Node) ([]*corev1.Node, error) {
	if op.Spec.Machines != nil {
		return nil, errors.New("spec.machines: an ichor operation upgrades Ichor, not machines; remove spec.machines")
	}
	if len(nodes) == 0 {
		return nil, nil
	}
	sorted := append([]*corev1.Node(nil), nodes...)
	sort.SliceStable(sorted, func(i, j int) bool {
		ci, cj := machine.Role(sorted[i]) == ichorv1.RoleControlPlane, machine.Role(sorted[j]) == ichorv1.RoleControlPlane
		if ci != cj {
			return ci
		}
		return sorted[i].Name < sorted[j].Name
	})
	return sorted[:1], nil
}

// HonourHold implements Executor: no machine is disrupted.
func (IchorUpgrade) HonourHold() bool { return false }

// MachineBound implements MachineBound: a step reads its own machine only.
func (IchorUpgrade) MachineBound() bool { return true }

// Check implements Executor; the version checks are the preflight package's.
func (IchorUpgrade) Check(context.Context, *Env) []string { return nil }

// Steps implements Executor.
func (IchorUpgrade) Steps(*ichorv1.TalosOperation, *ichorv1.MachineStatus) []Step {
	return []Step{installIchorStep(), installedStep(), newVersionStep()}
}

// targetImage is the image of the target: spec.ichor.image, else the
// controller's own repository (a mirror stays a mirror) at the target tag.
func targetImage(e *Env) string {
	if img := e.Op.Spec.Ichor.Image; img != "" {
		return img
	}
	repo := ReleaseImage
	if own := e.Controller.Image; own != "" {
		repo, _, _ = strings.Cut(own, "@")
		if i := strings.LastIndex(repo, ":"); i > strings.LastIndex(repo, "/") {
			repo = repo[:i]
		}
	}
	return repo + ":" + e.Op.Spec.Ichor.Version
}

func installerJob(e *Env) job {
	image := targetImage(e)
	return job{namespace: e.Controller.Namespace, name: jobName(e, "ichor"), image: image, serviceAccount: InstallerServiceAccount,
		args: []string{"install", "--image", image}}
}

func installIchorStep() Step {
	return Step{Name: StepIchorInstall, Timeout: 2 * time.Minute, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		j := installerJob(e)
		if err := j.start(ctx, e); err != nil {
			return Outcome{}, err
		}
		return Outcome{Message: fmt.Sprintf("installer Job %s/%s of %s started", j.namespace, j.name, j.image)}, nil
	}}
}

// installedStep waits for the installer Job and takes the lock back from it.
func installedStep() Step {
	return Step{Name: StepIchorJob, Timeout: 15 * time.Minute, Wait: func(ctx context.Context, e *Env) (bool, Outcome, error) {
		j := installerJob(e)
		st, err := j.state(ctx, e)
		if err != nil {
			return false, Outcome{}, err
		}
		if st.failed {
			return false, Outcome{}, &StepError{Reason: "InstallFailed", RetryFrom: StepIchorInstall, Err: errors.New(st.message + "; a retry starts a new Job")}
		}
		if !st.done {
			return false, Outcome{Message: st.message}, nil
		}
		if ok, err := e.Lock.Reclaim(ctx, e.Holder); err != nil || !ok {
			return false, Outcome{}, fmt.Errorf("take the cluster lock back from Job %s/%s: held %v, %v", j.namespace, j.name, ok, err)
		}
		return true, Outcome{Message: "installed " + e.Op.Spec.Ichor.Version + "; waiting for the new controller"}, nil
	}}
}

// newVersionStep is done only for a controller of the target version, once
// every replica of the Deployment runs the target image and is ready, and
// the leader Lease says the target leads.
func newVersionStep() Step {
	return Step{Name: StepNewVersion, Timeout: 30 * time.Minute, Wait: func(ctx context.Context, e *Env) (bool, Outcome, error) {
		want := e.Op.Spec.Ichor.Version
		if e.Controller.Version != want {
			return false, Outcome{Message: fmt.Sprintf("waiting for ichor-controller %s to take over (this controller is %s)", want, e.Controller.Version)}, nil
		}
		ok, why, err := rolledOutTo(ctx, e, targetImage(e))
		if err != nil || !ok {
			return false, Outcome{Message: why, Recheck: time.Second}, err
		}
		lease := &coordinationv1.Lease{}
		if err := e.Live.Get(ctx, client.ObjectKey{Namespace: e.Controller.Namespace, Name: ichorv1.LeaderLeaseName}, lease); err != nil {
			return false, Outcome{}, err
		}
		if v := lease.Annotations[ichorv1.VersionAnnotation]; v != want {
			return false, Outcome{Message: fmt.Sprintf("waiting for the leader Lease to name %s (it names %q)", want, v), Recheck: time.Second}, nil
		}
		// The version is the writer's own: the test of who finished it.
		return true, Outcome{Message: fmt.Sprintf("every replica runs ichor-controller %s; finished by ichor-controller %s", want, e.Controller.Version)}, nil
	}}
}

// rolledOutTo reports whether the controller's Deployment has rolled out
// image: every replica updated, ready and on that image, no other pod left.
func rolledOutTo(ctx context.Context, e *Env, image string) (bool, string, error) {
	d := &appsv1.Deployment{}
	if err := e.Live.Get(ctx, client.ObjectKey{Namespace: e.Controller.Namespace, Name: manifests.Deployment}, d); err != nil {
		return false, "", fmt.Errorf("read Deployment %s/%s: %w", e.Controller.Namespace, manifests.Deployment, err)
	}
	replicas := int32(1)
	if d.Spec.Replicas != nil {
		replicas = *d.Spec.Replicas
	}
	st := d.Status
	if st.ObservedGeneration < d.Generation || st.UpdatedReplicas < replicas || st.ReadyReplicas < replicas || st.Replicas != replicas {
		return false, fmt.Sprintf("waiting for the rollout: %d of %d replicas updated, %d ready, %d in all", st.UpdatedReplicas, replicas, st.ReadyReplicas, st.Replicas), nil
	}
	var pods corev1.PodList
	if err := e.Live.List(ctx, &pods, client.InNamespace(e.Controller.Namespace), client.MatchingLabels(d.Spec.Selector.MatchLabels)); err != nil {
		return false, "", err
	}
	ready := 0
	for _, p := range pods.Items {
		if img := podImage(&p.Spec, manifests.Container); img != image {
			return false, fmt.Sprintf("waiting for pod %s (%s) to go", p.Name, img), nil
		}
		if podutils.IsPodReady(&p) {
			ready++
		}
	}
	if ready != int(replicas) {
		return false, fmt.Sprintf("waiting for %d ready replicas of %s (%d)", replicas, image, ready), nil
	}
	return true, "", nil
}
