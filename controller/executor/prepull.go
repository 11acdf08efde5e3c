package executor

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/siderolabs/talos/pkg/machinery/api/common"
	"github.com/siderolabs/talos/pkg/machinery/config"
	"github.com/siderolabs/talos/pkg/machinery/constants"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/talos"
)

// StagePrePull is the kubernetes kind's first stage (unless
// spec.kubernetes.prePullImages is false): the new images pulled on every
// machine before any component moves, so that no component waits on a
// registry while its old version is already stopped.
const StagePrePull = "pre-pull"

// StepPullImages pulls the new images on one machine.
const StepPullImages = "pull-images"

// prePullStage is the pre-pull stage: every machine, in the rolling order
// (nothing is disrupted, so workers pull in batches of maxUnavailable).
var prePullStage = ichorv1.StageStatus{Name: StagePrePull, Order: ichorv1.StageRolling}

// prePull says whether the operation pre-pulls the new images: true unless
// spec.kubernetes.prePullImages is false (the API's default is true).
func prePull(op *ichorv1.TalosOperation) bool {
	k := op.Spec.Kubernetes
	return k == nil || k.PrePullImages == nil || *k.PrePullImages
}

// pull is one image to pull, and the containerd namespace it goes to.
type pull struct {
	ns  common.ContainerdNamespace
	ref string
}

// prePulls are the images a machine of role pulls before the upgrade, as
// talosctl upgrade-k8s pulls them: on a control plane kube-apiserver,
// kube-controller-manager and kube-scheduler into the CRI namespace (the
// kubelet runs their static pods), and on every machine the kubelet into
// the system namespace (Talos runs it). Each is the image of the machine's
// active configuration moved to version exactly as the stage that later
// patches it moves it (the kubelet's -fat or -slim suffix kept), so the
// image pulled is the image patched.
func prePulls(active config.Provider, role ichorv1.MachineRole, version string) ([]pull, error) {
	var imgs []image
	if role == ichorv1.RoleControlPlane {
		for _, stage := range []string{StageAPIServer, StageControllerManager, StageScheduler} {
			imgs = append(imgs, staticPodComponents[stage].image)
		}
	}
	imgs = append(imgs, kubeletImage)
	out := make([]pull, 0, len(imgs))
	for _, img := range imgs {
		_, want, err := img.moved(active, version)
		if err != nil {
			return nil, err
		}
		ns := common.ContainerdNamespace_NS_CRI
		if img.field == kubeletImage.field {
			ns = common.ContainerdNamespace_NS_SYSTEM
		}
		out = append(out, pull{ns, want})
	}
	return out, nil
}

// containerdNamespace is the name Talos gives a containerd namespace.
func containerdNamespace(ns common.ContainerdNamespace) string {
	if ns == common.ContainerdNamespace_NS_CRI {
		return constants.K8sContainerdNamespace
	}
	return constants.SystemContainerdNamespace
}

// pullImagesStep pulls the machine's prePulls with the deprecated
// MachineService.ImagePull, the call talosctl upgrade-k8s pre-pulls with.
// An image Talos answers Unimplemented for (a Talos without the call) is
// skipped, as talosctl skips it; any other error fails the step, before
// anything has moved. Talos skips an image it already has, so a rerun
// costs nothing; nothing but the machine's image store changes.
func pullImagesStep() Step {
	return Step{Name: StepPullImages, Timeout: 10 * time.Minute, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		if err := e.requireAddress(); err != nil {
			return Outcome{}, err
		}
		active, err := configMachine(e).Active(ctx)
		if err != nil {
			return Outcome{}, configFail(err)
		}
		pulls, err := prePulls(active, e.Machine.Role, kubernetesVersion(e.Op))
		if err != nil {
			return Outcome{}, Fail("PullFailed", "%w", err)
		}
		var pulled, skipped []string
		for _, p := range pulls {
			e.report("pulling " + p.ref)
			err := talos.PullLegacy(ctx, e.Talos, e.Address, p.ns, p.ref)
			switch {
			case status.Code(err) == codes.Unimplemented:
				skipped = append(skipped, p.ref)
			case err != nil:
				return Outcome{}, Fail("PullFailed", "nothing has moved yet: make %s available to the machine (its registry, or a mirror "+
					"in machine.registries), then retry; Talos did not pull it into containerd namespace %s: %s",
					p.ref, containerdNamespace(p.ns), talosSays(err))
			default:
				pulled = append(pulled, p.ref)
			}
		}
		msg := fmt.Sprintf("pulled %d image(s)", len(pulled))
		if len(skipped) > 0 {
			msg += fmt.Sprintf("; skipped %s: this Talos answers ImagePull Unimplemented", strings.Join(skipped, ", "))
		}
		return Outcome{Message: msg}, nil
	}}
}

// talosSays is what Talos answered a call: its code and message, without
// what wraps them.
func talosSays(err error) string {
	var gs interface{ GRPCStatus() *status.Status }
	if errors.As(err, &gs) && gs.GRPCStatus() != nil {
		return gs.GRPCStatus().Code().String() + ": " + gs.GRPCStatus().Message()
	}
	return err.Error()
}
