package executor

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/cosi-project/runtime/pkg/resource"
	"github.com/cosi-project/runtime/pkg/safe"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/kubectl/pkg/util/podutils"

	talosclient "github.com/siderolabs/talos/pkg/machinery/client"
	"github.com/siderolabs/talos/pkg/machinery/config"
	"github.com/siderolabs/talos/pkg/machinery/config/types/v1alpha1"
	"github.com/siderolabs/talos/pkg/machinery/constants"
	"github.com/siderolabs/talos/pkg/machinery/resources/k8s"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/bootstrap"
	"maesh.dev/ichor/controller/machine"
	"maesh.dev/ichor/controller/machineconfig"
	"maesh.dev/ichor/controller/plan"
	"maesh.dev/ichor/controller/talos"
)

// Stages of the kubernetes kind, in the order they run after the pre-pull
// (StagePrePull): each control-plane
// component on every control plane before the next component (a
// controller-manager or scheduler is never newer than an API server), then
// kube-proxy (its image in every control plane's configuration, then, once,
// the sync of the bootstrap manifests Talos renders from it, which rolls
// its DaemonSet), then the kubelets.
const (
	StageAPIServer         = k8s.APIServerID
	StageControllerManager = k8s.ControllerManagerID
	StageScheduler         = k8s.SchedulerID
	StageKubeProxy         = "kube-proxy"
	StageManifests         = "bootstrap-manifests"
	StageKubelet           = "kubelet"
)

// Steps of the kubernetes kind: in each machine stage, the patch of the
// image in the machine's configuration, then the wait for what runs it; in
// the bootstrap-manifests stage, the wait for Talos to render the new
// kube-proxy image, the sync, and the wait for what it applied to
// reconcile (kube-proxy's DaemonSet rolled out).
const (
	StepPatchImage        = "patch-image"
	StepPodReady          = "pod-ready"
	StepKubelet           = "kubelet-ready"
	StepManifestsRendered = "manifests-rendered"
	StepSyncManifests     = "sync-manifests"
	StepManifestsReady    = "manifests-ready"
)

// KubernetesUpgrade moves a cluster's Kubernetes to spec.kubernetes.version
// as `talosctl upgrade-k8s` does, in stages: the new images pulled on
// every machine (unless spec.kubernetes.prePullImages is false), then kube-apiserver, then
// kube-controller-manager, then kube-scheduler, each a control plane at a
// time (the image in the machine configuration patched with NO_REBOOT, then
// the wait for the mirror pod to carry the configuration version Talos
// rendered for it and be Ready), then the kubelets, control planes one at
// a time and workers within maxUnavailable (machine.kubelet.image patched,
// keeping the image's suffix, then the wait for the Node to report the new
// kubeletVersion and be Ready). Each step reads the machine's real state
// first: an image already set is not applied again, so a restart at any
// point neither repeats nor skips a component.
type KubernetesUpgrade struct{}

// Target implements Executor. The machines' versions are the steps' to
// record (from the images they patch), not Talos's.
func (KubernetesUpgrade) Target(op *ichorv1.TalosOperation) (string, string) {
	return "kubernetes " + kubernetesVersion(op), ""
}

func kubernetesVersion(op *ichorv1.TalosOperation) string {
	if op.Spec.Kubernetes == nil {
		return ""
	}
	return op.Spec.Kubernetes.Version
}

// Scope implements Executor: the whole cluster.
func (KubernetesUpgrade) Scope(op *ichorv1.TalosOperation, nodes []*corev1.Node) ([]*corev1.Node, error) {
	if op.Spec.Machines != nil {
		return nil, errors.New("spec.machines: a kubernetes upgrade moves the whole cluster; remove spec.machines")
	}
	return nodes, nil
}

// HonourHold implements Executor.
func (KubernetesUpgrade) HonourHold() bool { return true }

// MachineBound implements MachineBound: a step reads its own machine only.
func (KubernetesUpgrade) MachineBound() bool { return true }

// Check implements Executor. The version checks are preflight's; the
// kind's own is that the controller may apply every object of the
// bootstrap manifests its sync will apply (a manifest added to
// cluster.inlineManifests, say, that the shipped RBAC does not name): a
// missing grant then refuses the upgrade before any component moves,
// instead of stopping it in the bootstrap-manifests stage once the control
// planes run the new version. It asks once, on the control plane that
// will run the sync, about what that machine renders now: the upgrade
// changes those objects' images, not which objects they are.
func (KubernetesUpgrade) Check(ctx context.Context, e *Env) []string {
	stage := manifestsStage()
	if syncer, _ := plan.InStage(e.Op.Status.Machines, &stage); len(syncer) == 0 || syncer[0].Name != e.Machine.Name {
		return nil
	}
	if err := e.requireAddress(); err != nil {
		return []string{err.Error()}
	}
	active, err := configMachine(e).Active(ctx)
	if err != nil {
		return []string{fmt.Sprintf("read the configuration of %s: %v", e.Machine.Name, err)}
	}
	if proxyDisabled(active) != "" {
		return nil // no sync: the stage is done at once
	}
	objs, err := bootstrap.Read(talosclient.WithNode(ctx, e.Address), e.Talos.COSI)
	if err != nil {
		return []string{fmt.Sprintf("%s: %v; once it answers, create the operation again", e.Machine.Name, err)}
	}
	denied, err := bootstrap.Denied(ctx, e.Live.RESTMapper(), e.Clientset.AuthorizationV1().SelfSubjectAccessReviews(), objs)
	if err != nil {
		return []string{err.Error()}
	}
	if len(denied) == 0 {
		return nil
	}
	return []string{fmt.Sprintf("the sync of the bootstrap manifests %s renders would be refused on %s: "+
		"grant the controller's ServiceAccount those verbs on them by name (a Role or ClusterRole bound to it, "+
		"as the shipped ichor-controller-kubernetes roles do for Talos's own), or remove them from the control planes' "+
		"configuration (cluster.inlineManifests, cluster.extraManifests); then create the operation again",
		e.Machine.Name, strings.Join(denied, ", "))}
}

// Stages implements Stager.
func (KubernetesUpgrade) Stages(op *ichorv1.TalosOperation) []ichorv1.StageStatus {
	cp := []ichorv1.MachineRole{ichorv1.RoleControlPlane}
	var stages []ichorv1.StageStatus
	if prePull(op) {
		stages = append(stages, prePullStage)
	}
	return append(stages, []ichorv1.StageStatus{
		{Name: StageAPIServer, Roles: cp, Order: ichorv1.StageOneAtATime},
		{Name: StageControllerManager, Roles: cp, Order: ichorv1.StageOneAtATime},
		{Name: StageScheduler, Roles: cp, Order: ichorv1.StageOneAtATime},
		{Name: StageKubeProxy, Roles: cp, Order: ichorv1.StageOneAtATime},
		manifestsStage(),
		{Name: StageKubelet, Order: ichorv1.StageRolling},
	}...)
}

// manifestsStage syncs the bootstrap manifests, once, on the first control
// plane.
func manifestsStage() ichorv1.StageStatus {
	return ichorv1.StageStatus{Name: StageManifests, Roles: []ichorv1.MachineRole{ichorv1.RoleControlPlane}, Order: ichorv1.StageOnce}
}

// Steps implements Executor.
func (KubernetesUpgrade) Steps(op *ichorv1.TalosOperation, _ *ichorv1.MachineStatus) []Step {
	if op.Status.Stage == StagePrePull {
		return []Step{pullImagesStep()}
	}
	if c, ok := staticPodComponents[op.Status.Stage]; ok {
		return []Step{imagePatchStep(c.image), podReadyStep(op.Status.Stage, c)}
	}
	switch op.Status.Stage {
	case StageKubeProxy:
		return []Step{imagePatchStep(proxyImage)}
	case StageManifests:
		return []Step{manifestsRenderedStep(), syncManifestsStep(), manifestsReadyStep()}
	case StageKubelet:
		return []Step{imagePatchStep(kubeletImage), kubeletReadyStep()}
	}
	return nil
}

// image is one image in the machine configuration: how to read it and set it.
type image struct {
	field string
	get   func(config.Provider) string
	set   func(cfg *v1alpha1.Config, ref string)
	// keepSuffix keeps what follows the version in the tag (the kubelet's
	// -fat or -slim flavours).
	keepSuffix bool
	// off, when set, says why the configuration runs no such image (the
	// machine is then done with it), or "".
	off func(config.Provider) string
}

// staticPodComponent is a control-plane component: its image, and the COSI
// resource Talos renders its static pod from.
type staticPodComponent struct {
	image    image
	resource resource.Metadata
}

var staticPodComponents = map[string]staticPodComponent{
	StageAPIServer: {image{"cluster.apiServer.image",
		func(c config.Provider) string { return c.Cluster().APIServer().Image() },
		func(cfg *v1alpha1.Config, ref string) {
			cluster(cfg).APIServerConfig = orNew(cluster(cfg).APIServerConfig)
			cluster(cfg).APIServerConfig.ContainerImage = ref
		}, false, nil}, *k8s.NewAPIServerConfig().Metadata()},
	StageControllerManager: {image{"cluster.controllerManager.image",
		func(c config.Provider) string { return c.Cluster().ControllerManager().Image() },
		func(cfg *v1alpha1.Config, ref string) {
			cluster(cfg).ControllerManagerConfig = orNew(cluster(cfg).ControllerManagerConfig)
			cluster(cfg).ControllerManagerConfig.ContainerImage = ref
		}, false, nil}, *k8s.NewControllerManagerConfig().Metadata()},
	StageScheduler: {image{"cluster.scheduler.image",
		func(c config.Provider) string { return c.Cluster().Scheduler().Image() },
		func(cfg *v1alpha1.Config, ref string) {
			cluster(cfg).SchedulerConfig = orNew(cluster(cfg).SchedulerConfig)
			cluster(cfg).SchedulerConfig.ContainerImage = ref
		}, false, nil}, *k8s.NewSchedulerConfig().Metadata()},
}

var proxyImage = image{field: "cluster.proxy.image",
	get: func(c config.Provider) string { return c.Cluster().Proxy().Image() },
	set: func(cfg *v1alpha1.Config, ref string) {
		cluster(cfg).ProxyConfig = orNew(cluster(cfg).ProxyConfig)
		cluster(cfg).ProxyConfig.ContainerImage = ref
	},
	off: proxyDisabled}

// proxyDisabled says so when the configuration disables kube-proxy: Talos
// then renders no kube-proxy manifest, and there is nothing to move.
func proxyDisabled(c config.Provider) string {
	if c.Cluster() != nil && !c.Cluster().Proxy().Enabled() {
		return "kube-proxy is disabled (cluster.proxy.disabled): nothing to upgrade"
	}
	return ""
}

var kubeletImage = image{"machine.kubelet.image",
	func(c config.Provider) string { return c.Machine().Kubelet().Image() },
	func(cfg *v1alpha1.Config, ref string) {
		if cfg.MachineConfig == nil {
			cfg.MachineConfig = &v1alpha1.MachineConfig{}
		}
		cfg.MachineConfig.MachineKubelet = orNew(cfg.MachineConfig.MachineKubelet)
		cfg.MachineConfig.MachineKubelet.KubeletImage = ref
	}, true, nil}

// moved is the image in the machine's active configuration, and the
// reference it moves to at version.
func (img image) moved(active config.Provider, version string) (cur, want string, err error) {
	cur = img.get(active)
	want, err = retag(cur, version, img.keepSuffix)
	if err != nil {
		return cur, "", fmt.Errorf("%s: %w", img.field, err)
	}
	return cur, want, nil
}

func cluster(cfg *v1alpha1.Config) *v1alpha1.ClusterConfig {
	if cfg.ClusterConfig == nil {
		cfg.ClusterConfig = &v1alpha1.ClusterConfig{}
	}
	return cfg.ClusterConfig
}

func orNew[T any](p *T) *T {
	if p == nil {
		return new(T)
	}
	return p
}

// retag is ref with its tag's version replaced by version, keeping what
// follows the version when keepSuffix ("ghcr.io/siderolabs/kubelet:v1.35.0-fat"
// to v1.36.2 is "...:v1.36.2-fat").
func retag(ref, version string, keepSuffix bool) (string, error) {
	i := strings.LastIndex(ref, ":")
	if i < 0 || strings.Contains(ref[i:], "/") || strings.Contains(ref, "@") {
		return "", fmt.Errorf("image %q has no tag to move to %s", ref, version)
	}
	suffix := ""
	if keepSuffix {
		if j := strings.Index(ref[i+1:], "-"); j >= 0 {
			suffix = ref[i+1+j:]
		}
	}
	return ref[:i+1] + version + suffix, nil
}

// imagePatchStep sets the image to the target version in the machine's
// configuration, live (NO_REBOOT: Talos restarts what runs it), and
// verifies through COSI that the machine runs it. An image already set is
// not applied again.
func imagePatchStep(img image) Step {
	return Step{Name: StepPatchImage, Timeout: 2 * time.Minute, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		if err := e.requireAddress(); err != nil {
			return Outcome{}, err
		}
		version := kubernetesVersion(e.Op)
		mc := configMachine(e)
		active, err := mc.Active(ctx)
		if err != nil {
			return Outcome{}, configFail(err)
		}
		if img.off != nil {
			if why := img.off(active); why != "" {
				return Outcome{Done: true, Message: why}, nil
			}
		}
		cur, want, err := img.moved(active, version)
		if err != nil {
			return Outcome{}, Fail("ImageNotPatched", "%w", err)
		}
		out := Outcome{From: e.Machine.From, To: version, Message: img.field + " " + want}
		if out.From == "" {
			out.From = imageTag(cur)
		}
		if cur == want {
			return out, nil
		}
		ch, err := machineconfig.PlanOn(active, []machineconfig.Patch{machineconfig.Typed(img.field, func(cfg *v1alpha1.Config) error {
			img.set(cfg, want)
			return nil
		})})
		if err != nil {
			return Outcome{}, configFail(err)
		}
		if _, err := mc.Apply(ctx, ch.Config, machineconfig.NoReboot); err != nil {
			return Outcome{}, configFail(err)
		}
		if err := mc.Verify(ctx, ch.To); err != nil {
			return Outcome{}, configFail(err)
		}
		return out, nil
	}}
}

// imageTag is the tag of an image reference, without a leading v's loss.
func imageTag(ref string) string {
	if i := strings.LastIndex(ref, ":"); i >= 0 && !strings.Contains(ref[i:], "/") {
		return ref[i+1:]
	}
	return ""
}

// podReadyStep waits until the machine's mirror pod of the component runs
// the configuration Talos rendered for the new image (its
// talos.dev/config-version is the version of the component's COSI
// resource, which carries that image) and is Ready.
func podReadyStep(component string, c staticPodComponent) Step {
	return Step{Name: StepPodReady, Timeout: 5 * time.Minute, Wait: func(ctx context.Context, e *Env) (bool, Outcome, error) {
		version := kubernetesVersion(e.Op)
		r, err := safe.StateGet[resource.Resource](talosclient.WithNode(ctx, e.Address), e.Talos.COSI, c.resource)
		if talos.Unreachable(err) {
			return false, Outcome{Message: "waiting for the Talos API to answer", Recheck: time.Second}, nil
		}
		if err != nil {
			return false, Outcome{}, fmt.Errorf("read %s %s: %w", c.resource.Type(), c.resource.ID(), err)
		}
		if tag := imageTag(renderedImage(r)); tag != version {
			return false, Outcome{Message: fmt.Sprintf("waiting for Talos to render %s %s (it renders %s)", component, version, tag), Recheck: time.Second}, nil
		}
		want := r.Metadata().Version().String()
		pods, err := mirrorPods(ctx, e.Kube, e, component)
		if err != nil {
			return false, Outcome{}, err
		}
		for i := range pods {
			p := &pods[i]
			if p.Annotations[constants.AnnotationStaticPodConfigVersion] != want {
				continue
			}
			if podutils.IsPodReady(p) {
				return true, Outcome{}, nil
			}
			return false, Outcome{Message: fmt.Sprintf("waiting for %s to be Ready", p.Name), Recheck: time.Second}, nil
		}
		return false, Outcome{Message: fmt.Sprintf("waiting for the mirror pod of %s at configuration version %s", component, want), Recheck: time.Second}, nil
	}}
}

// renderedImage is the image of a component's configuration resource.
func renderedImage(r resource.Resource) string {
	switch r := r.(type) {
	case *k8s.APIServerConfig:
		return r.TypedSpec().Image
	case *k8s.ControllerManagerConfig:
		return r.TypedSpec().Image
	case *k8s.SchedulerConfig:
		return r.TypedSpec().Image
	}
	return ""
}

// kubeletReadyStep waits until the machine's Node reports the new
// kubeletVersion and is Ready: its kubelet restarted on the new image.
func kubeletReadyStep() Step {
	return Step{Name: StepKubelet, Timeout: 5 * time.Minute, Wait: func(_ context.Context, e *Env) (bool, Outcome, error) {
		version := kubernetesVersion(e.Op)
		if e.Node == nil {
			return false, Outcome{Message: "waiting for the Node", Recheck: time.Second}, nil
		}
		if got := machine.KubeletVersion(e.Node); got != version {
			return false, Outcome{Message: fmt.Sprintf("waiting for the kubelet %s (the Node reports %s)", version, got)}, nil
		}
		if !machine.Ready(e.Node) {
			return false, Outcome{Message: "waiting for the Node to be Ready"}, nil
		}
		return true, Outcome{}, nil
	}}
}
