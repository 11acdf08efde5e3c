package executor

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/kubectl/pkg/util/podutils"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/siderolabs/talos/pkg/machinery/config/types/v1alpha1"

	"maesh.dev/ichor/api/compat"
	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/cilium"
	"maesh.dev/ichor/controller/inventory"
	"maesh.dev/ichor/controller/machine"
	"maesh.dev/ichor/controller/machineconfig"
)

// Steps of the cni kind.
const (
	StepCiliumJob        = "cilium-job"
	StepCilium           = "wait-cilium"
	StepDisableKubeProxy = "disable-kube-proxy"
	StepRemoveKubeProxy  = "remove-kube-proxy"
	StepKubeProxyGone    = "kube-proxy-gone"
	StepEnableKubeProxy  = "enable-kube-proxy"
	StepKubeProxyReady   = "kube-proxy-ready"
	StepAgentReady       = "agent-ready"
)

// CiliumServiceAccount is the ServiceAccount in kube-system the Cilium Job
// runs as (manifests/cilium): Helm changes what Cilium's chart holds.
const CiliumServiceAccount = "ichor-cilium"

// CNIChange moves Cilium to the chart this Ichor ships, or switches the
// kube-proxy mode. The cluster-wide steps run as the steps of the first
// machine (control planes go first and one at a time, so they are done
// before any other machine starts): the Cilium Job, which the operation
// lends the cluster lock, and for a switch the kube-proxy steps in the safe
// order. Every machine then follows: a rolling reboot after a switch to
// kube-proxy replacement (it flushes kube-proxy's rules), a check of its
// agent otherwise.
//
// To kube-proxy replacement: Cilium with replacement on (through KubePrism,
// agents restarted) while kube-proxy still runs, then cluster.proxy.disabled
// on every machine, then kube-proxy's objects and their inventory keys
// removed, then the reboots. Back: cluster.proxy.disabled false everywhere,
// Talos re-creates kube-proxy, and once it is ready everywhere Cilium with
// replacement off.
type CNIChange struct{}

// Target implements Executor.
func (CNIChange) Target(op *ichorv1.TalosOperation) (string, string) {
	s := "cilium " + chartVersion(op)
	if kpr := cniSpec(op).KubeProxyReplacement; kpr != nil && *kpr {
		s += ", replacing kube-proxy"
	} else if kpr != nil {
		s += ", back to kube-proxy"
	}
	return s, ""
}

// cniSpec is the operation's cni block; an absent one asks for the chart
// this release ships, keeping the mode.
func cniSpec(op *ichorv1.TalosOperation) ichorv1.CNIChange {
	if op.Spec.CNI == nil {
		return ichorv1.CNIChange{}
	}
	return *op.Spec.CNI
}

// chartVersion is the chart the operation moves to: the one it names, else
// the one this release ships.
func chartVersion(op *ichorv1.TalosOperation) string {
	if v := cniSpec(op).ChartVersion; v != "" {
		return strings.TrimPrefix(v, "v")
	}
	if t, err := compat.Default(); err == nil {
		return t.CiliumChart.Version
	}
	return "?"
}

// Scope implements Executor: the whole cluster.
func (CNIChange) Scope(op *ichorv1.TalosOperation, nodes []*corev1.Node) ([]*corev1.Node, error) {
	if op.Spec.Machines != nil {
		return nil, errors.New("spec.machines: a cni operation changes the whole cluster's network; remove spec.machines")
	}
	return nodes, nil
}

// HonourHold implements Executor: a held machine is not rebooted.
func (CNIChange) HonourHold() bool { return true }

// lead is the machine whose steps are the cluster-wide ones: the first that
// is not skipped.
func lead(op *ichorv1.TalosOperation) string {
	for _, m := range op.Status.Machines {
		if m.Phase != ichorv1.MachineSkipped {
			return m.Name
		}
	}
	return ""
}

// Check implements Executor: the cluster-wide refusals, once (for the lead).
func (CNIChange) Check(ctx context.Context, e *Env) []string {
	if e.Machine.Name != lead(e.Op) {
		return nil
	}
	agents, err := cilium.ReadAgents(ctx, e.Live)
	if err != nil {
		return []string{err.Error()}
	}
	if agents == nil {
		return []string{fmt.Sprintf("no Cilium runs (no DaemonSet %s/%s): Ichor upgrades the Cilium a cluster runs and installs no CNI", cilium.Namespace, cilium.DaemonSet)}
	}
	var out []string
	out = append(out, ciliumFromTalos(ctx, e, agents)...)
	kpr := cniSpec(e.Op).KubeProxyReplacement
	if kpr == nil {
		return out
	}
	proxy, err := kubeProxyRuns(ctx, e)
	if err != nil {
		return append(out, err.Error())
	}
	if agents.KubeProxyReplacement == *kpr && proxy != *kpr {
		return append(out, fmt.Sprintf("the cluster already runs %s: leave spec.cni.kubeProxyReplacement unset to move Cilium to the chart only", modeName(*kpr)))
	}
	if *kpr {
		out = append(out, kubePrismEverywhere(ctx, e)...)
	}
	return out
}

func modeName(kpr bool) string {
	if kpr {
		return "Cilium's kube-proxy replacement without kube-proxy"
	}
	return "kube-proxy"
}

// ciliumFromTalos refuses a Cilium installed from a Talos inline manifest or
// tracked in Talos's bootstrap inventory: the next `talosctl upgrade-k8s`
// would apply the old manifest again over Ichor's upgrade, or prune Cilium.
func ciliumFromTalos(ctx context.Context, e *Env, agents *cilium.Agents) []string {
	var out []string
	var inline []string
	for _, addr := range e.ControlPlanes {
		cfg, err := machineconfig.Machine{Talos: e.Talos, Node: addr}.Active(ctx)
		if err != nil {
			return []string{fmt.Sprintf("cannot read the machine configuration of control plane %s: %v", addr, err)}
		}
		if cfg.Cluster() == nil {
			continue
		}
		for _, m := range cfg.Cluster().InlineManifests() {
			if isCiliumManifest(m.Name(), m.Contents()) {
				inline = append(inline, fmt.Sprintf("%s on %s", m.Name(), addr))
				break
			}
		}
	}
	if len(inline) > 0 {
		out = append(out, fmt.Sprintf("Cilium is installed from a Talos inline manifest (%s): the next `talosctl upgrade-k8s` would apply it again over Ichor's upgrade. "+
			"First remove that entry from cluster.inlineManifests on every control plane (a config operation with the patch "+
			"`cluster: {inlineManifests: [{name: %s, $patch: delete}]}`), then remove Cilium's keys from ConfigMap %s/%s "+
			"and the annotation %s from Cilium's objects, then create this operation again: Ichor installs its chart over them",
			strings.Join(inline, ", "), strings.SplitN(inline[0], " ", 2)[0], inventory.Namespace, inventory.Name, inventory.OwningAnnotation))
		return out
	}
	ds := inventory.Ref("apps", "DaemonSet", cilium.Namespace, cilium.DaemonSet)
	tracked, err := inventory.Tracked(ctx, e.Live, ds)
	if err != nil {
		return []string{err.Error()}
	}
	if len(tracked) > 0 || agents.DaemonSet.Annotations[inventory.OwningAnnotation] != "" {
		out = append(out, fmt.Sprintf("Cilium is tracked in Talos's bootstrap inventory (ConfigMap %s/%s, key %s): the next `talosctl upgrade-k8s` would prune it. "+
			"Remove Cilium's keys from that ConfigMap and the annotation %s from Cilium's objects, then create this operation again",
			inventory.Namespace, inventory.Name, inventory.Key(ds), inventory.OwningAnnotation))
	}
	return out
}

func isCiliumManifest(name, contents string) bool {
	if strings.Contains(strings.ToLower(name), "cilium") {
		return true
	}
	return strings.Contains(contents, "kind: DaemonSet") && strings.Contains(contents, "name: cilium\n")
}

// kubePrismEverywhere refuses a switch to kube-proxy replacement while a
// machine has KubePrism off or on another port: without kube-proxy, Cilium
// reaches the API server only through it.
func kubePrismEverywhere(ctx context.Context, e *Env) []string {
	var off []string
	for _, m := range e.Op.Status.Machines {
		addr := nodeAddress(e, m.Name)
		cfg, err := machineconfig.Machine{Talos: e.Talos, Node: addr}.Active(ctx)
		if err != nil {
			return []string{fmt.Sprintf("cannot read the machine configuration of %s: %v", m.Name, err)}
		}
		kp := cfg.Machine().Features().KubePrism()
		if !kp.Enabled() || kp.Port() != cilium.KubePrismPort {
			off = append(off, m.Name)
		}
	}
	if len(off) == 0 {
		return nil
	}
	return []string{fmt.Sprintf("KubePrism is off or not on port %d on %s: without kube-proxy Cilium reaches the API server only through it; "+
		"set machine.features.kubePrism {enabled: true, port: %d} there first (a config operation)", cilium.KubePrismPort, andList(off), cilium.KubePrismPort)}
}

func andList(items []string) string {
	if len(items) > 5 {
		return strings.Join(items[:5], ", ") + fmt.Sprintf(" and %d more", len(items)-5)
	}
	return strings.Join(items, ", ")
}

func nodeAddress(e *Env, name string) string {
	for _, n := range e.Nodes {
		if n.Name == name {
			return machine.Address(n)
		}
	}
	return ""
}

// Steps implements Executor.
func (CNIChange) Steps(op *ichorv1.TalosOperation, m *ichorv1.MachineStatus) []Step {
	kpr := cniSpec(op).KubeProxyReplacement
	if m.Name != lead(op) {
		if kpr != nil && *kpr {
			return rebootSteps(op, m)
		}
		return []Step{agentReadyStep()}
	}
	switch {
	case kpr != nil && *kpr:
		steps := []Step{ciliumJobStep(kpr), ciliumStep(kpr),
			proxyStep(StepDisableKubeProxy, true), removeKubeProxyStep(), kubeProxyGoneStep()}
		return append(steps, rebootSteps(op, m)...)
	case kpr != nil:
		return []Step{proxyStep(StepEnableKubeProxy, false), kubeProxyReadyStep(), ciliumJobStep(kpr), ciliumStep(kpr)}
	}
	return []Step{ciliumJobStep(nil), ciliumStep(nil)}
}

// ciliumJob is the operation's Cilium Job at the machine's attempt.
func ciliumJob(e *Env, kpr bool) job {
	c := e.Controller
	return job{namespace: cilium.Namespace, name: jobName(e, "cni"), image: c.Image, serviceAccount: CiliumServiceAccount,
		args: []string{"cilium", "upgrade", "--kube-proxy-replacement=" + strconv.FormatBool(kpr),
			"--chart-dir", c.ChartDir, "--chart-version", c.Chart.Version, "--chart-digest", c.Chart.Digest, "--timeout", "10m"}}
}

// ciliumJobStep starts the Cilium Job and lends it the cluster lock. With
// kpr nil the mode is kept: the one cilium-config says now.
func ciliumJobStep(kpr *bool) Step {
	return Step{Name: StepCiliumJob, Timeout: 2 * time.Minute, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		mode := false
		if kpr != nil {
			mode = *kpr
		} else {
			agents, err := cilium.ReadAgents(ctx, e.Live)
			if err != nil || agents == nil {
				return Outcome{}, Fail("CiliumNotFound", "read the running Cilium: %v", err)
			}
			mode = agents.KubeProxyReplacement
		}
		if e.Controller.Image == "" {
			return Outcome{}, Fail("NoControllerImage", "this controller does not know its own image, which the Cilium Job runs: run it in its Deployment, or with --image")
		}
		j := ciliumJob(e, mode)
		if err := j.start(ctx, e); err != nil {
			return Outcome{}, err
		}
		return Outcome{Message: fmt.Sprintf("Job %s/%s started; it holds the cluster lock for this operation", j.namespace, j.name)}, nil
	}}
}

// ciliumStep waits for the Cilium Job, checks that every agent runs the
// chart's version (and the mode asked for) and is available, and takes the
// cluster lock back from the Job.
func ciliumStep(kpr *bool) Step {
	return Step{Name: StepCilium, Timeout: 30 * time.Minute, Wait: func(ctx context.Context, e *Env) (bool, Outcome, error) {
		j := ciliumJob(e, false)
		st, err := j.state(ctx, e)
		if err != nil {
			return false, Outcome{}, err
		}
		if st.failed {
			return false, Outcome{}, &StepError{Reason: "CiliumUpgradeFailed", RetryFrom: StepCiliumJob, Err: errors.New(st.message + "; a retry starts a new Job")}
		}
		if !st.done {
			return false, Outcome{Message: st.message}, nil
		}
		agents, err := cilium.ReadAgents(ctx, e.Live)
		if err != nil || agents == nil {
			return false, Outcome{}, Fail("CiliumNotFound", "read the running Cilium after the upgrade: %v", err)
		}
		want, _ := compat.ParseVersion(e.Controller.Chart.Version)
		if agents.Version.Core() != want.Core() {
			return false, Outcome{}, &StepError{Reason: "CiliumNotUpgraded", RetryFrom: StepCiliumJob,
				Err: fmt.Errorf("the Job finished, but the agents run %s, not %s", agents.Version, want)}
		}
		if kpr != nil && agents.KubeProxyReplacement != *kpr {
			return false, Outcome{}, &StepError{Reason: "CiliumNotUpgraded", RetryFrom: StepCiliumJob,
				Err: fmt.Errorf("the Job finished, but cilium-config says kube-proxy-replacement %v", agents.KubeProxyReplacement)}
		}
		if ok, why := cilium.RolledOut(agents.DaemonSet); !ok {
			return false, Outcome{Message: "waiting for the agents: " + why, Recheck: time.Second}, nil
		}
		if ok, err := e.Lock.Reclaim(ctx, e.Holder); err != nil || !ok {
			return false, Outcome{}, fmt.Errorf("take the cluster lock back from Job %s/%s: held %v, %v", j.namespace, j.name, ok, err)
		}
		return true, Outcome{Message: fmt.Sprintf("cilium %s on every agent", agents.Version)}, nil
	}}
}

// proxyStep sets cluster.proxy.disabled on every machine of the operation,
// live (NO_REBOOT, as Talos applies .cluster changes), and verifies it
// through COSI. Machines already set are left alone, so a rerun applies
// nothing twice.
func proxyStep(name string, disabled bool) Step {
	return Step{Name: name, Timeout: 5 * time.Minute, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		patch := machineconfig.Typed("cluster.proxy.disabled", func(cfg *v1alpha1.Config) error {
			if cfg.ClusterConfig == nil {
				cfg.ClusterConfig = &v1alpha1.ClusterConfig{}
			}
			if cfg.ClusterConfig.ProxyConfig == nil {
				cfg.ClusterConfig.ProxyConfig = &v1alpha1.ProxyConfig{}
			}
			cfg.ClusterConfig.ProxyConfig.Disabled = ptr.To(disabled)
			return nil
		})
		changed := 0
		for _, m := range e.Op.Status.Machines {
			mc := machineconfig.Machine{Talos: e.Talos, Node: nodeAddress(e, m.Name)}
			if mc.Node == "" {
				return Outcome{}, Fail("ConfigNotApplied", "%s has no Node address", m.Name)
			}
			ch, err := mc.Plan(ctx, []machineconfig.Patch{patch})
			if err != nil {
				return Outcome{}, fmt.Errorf("%s: %w", m.Name, err)
			}
			if ch.Applied() {
				continue
			}
			if _, err := mc.Apply(ctx, ch.Config, machineconfig.NoReboot); err != nil {
				return Outcome{}, Fail("ConfigNotApplied", "cluster.proxy.disabled: %v on %s: %w", disabled, m.Name, err)
			}
			if err := mc.Verify(ctx, ch.To); err != nil {
				return Outcome{}, Fail("ConfigNotApplied", "%s: %w", m.Name, err)
			}
			changed++
		}
		return Outcome{Message: fmt.Sprintf("cluster.proxy.disabled: %v on every machine (%d changed)", disabled, changed)}, nil
	}}
}

// removeKubeProxyStep deletes kube-proxy's objects and takes them out of
// Talos's inventory, so that the next `talosctl upgrade-k8s` neither prunes
// nor re-creates them (Talos stopped rendering them with the proxy disabled).
func removeKubeProxyStep() Step {
	return Step{Name: StepRemoveKubeProxy, Timeout: 2 * time.Minute, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		if err := inventory.Remove(ctx, e.Live, inventory.KubeProxy...); err != nil {
			return Outcome{}, err
		}
		bg := client.PropagationPolicy(metav1.DeletePropagationBackground)
		for _, o := range kubeProxyObjects() {
			if err := e.Live.Delete(ctx, o, bg); err != nil && !apierrors.IsNotFound(err) {
				return Outcome{}, Fail("KubeProxyNotRemoved", "delete %T %s: %w", o, client.ObjectKeyFromObject(o), err)
			}
		}
		return Outcome{Message: "kube-proxy's DaemonSet, ServiceAccount and ClusterRoleBinding deleted and out of Talos's inventory"}, nil
	}}
}

// kubeProxyGoneStep waits until kube-proxy's objects and pods are gone and
// the inventory no longer tracks them.
func kubeProxyGoneStep() Step {
	return Step{Name: StepKubeProxyGone, Timeout: 5 * time.Minute, Wait: func(ctx context.Context, e *Env) (bool, Outcome, error) {
		for _, o := range kubeProxyObjects() {
			err := e.Live.Get(ctx, client.ObjectKeyFromObject(o), o)
			if err == nil {
				return false, Outcome{Message: "waiting for " + client.ObjectKeyFromObject(o).String() + " to go", Recheck: time.Second}, nil
			}
			if !apierrors.IsNotFound(err) {
				return false, Outcome{}, err
			}
		}
		tracked, err := inventory.Tracked(ctx, e.Live, inventory.KubeProxy...)
		if err != nil {
			return false, Outcome{}, err
		}
		if len(tracked) > 0 {
			return false, Outcome{}, Fail("KubeProxyNotRemoved", "Talos's inventory still tracks %v", tracked)
		}
		var pods corev1.PodList
		if err := e.Live.List(ctx, &pods, client.InNamespace("kube-system"), client.MatchingLabels{"k8s-app": "kube-proxy"}); err != nil {
			return false, Outcome{}, err
		}
		if len(pods.Items) > 0 {
			return false, Outcome{Message: fmt.Sprintf("waiting for %d kube-proxy pod(s) to go", len(pods.Items)), Recheck: time.Second}, nil
		}
		return true, Outcome{Message: "kube-proxy is gone"}, nil
	}}
}

// kubeProxyReadyStep waits until Talos has re-created kube-proxy and its
// DaemonSet has an available pod on every machine it schedules to.
func kubeProxyReadyStep() Step {
	return Step{Name: StepKubeProxyReady, Timeout: 10 * time.Minute, Wait: func(ctx context.Context, e *Env) (bool, Outcome, error) {
		ok, why, err := kubeProxyReady(ctx, e)
		if err != nil || !ok {
			return false, Outcome{Message: why, Recheck: time.Second}, err
		}
		return true, Outcome{Message: "kube-proxy runs on every machine: " + why}, nil
	}}
}

func kubeProxyReady(ctx context.Context, e *Env) (bool, string, error) {
	ds := kubeProxyObjects()[0].(*appsv1.DaemonSet)
	err := e.Live.Get(ctx, client.ObjectKeyFromObject(ds), ds)
	if apierrors.IsNotFound(err) {
		return false, "waiting for Talos to create kube-proxy's DaemonSet", nil
	}
	if err != nil {
		return false, "", err
	}
	if ds.Status.DesiredNumberScheduled == 0 {
		return false, "waiting for kube-proxy's DaemonSet to schedule", nil
	}
	ok, why := cilium.RolledOut(ds)
	return ok, why, nil
}

// kubeProxyRuns reports whether kube-proxy's DaemonSet exists.
func kubeProxyRuns(ctx context.Context, e *Env) (bool, error) {
	ds := kubeProxyObjects()[0]
	err := e.Live.Get(ctx, client.ObjectKeyFromObject(ds), ds)
	if apierrors.IsNotFound(err) {
		return false, nil
	}
	return err == nil, err
}

// agentReadyStep waits until the machine's Cilium agent runs the
// DaemonSet's template and is Ready.
func agentReadyStep() Step {
	return Step{Name: StepAgentReady, Timeout: 10 * time.Minute, Wait: func(ctx context.Context, e *Env) (bool, Outcome, error) {
		agents, err := cilium.ReadAgents(ctx, e.Live)
		if err != nil || agents == nil {
			return false, Outcome{}, Fail("CiliumNotFound", "read the running Cilium: %v", err)
		}
		var pods corev1.PodList
		if err := e.Live.List(ctx, &pods, client.InNamespace(cilium.Namespace), client.MatchingLabels{"k8s-app": "cilium"}); err != nil {
			return false, Outcome{}, err
		}
		for _, p := range pods.Items {
			if p.Spec.NodeName != e.Machine.Name || !p.DeletionTimestamp.IsZero() {
				continue
			}
			if podImage(&p.Spec, cilium.AgentContainer) == agents.Image && podutils.IsPodReady(&p) {
				return true, Outcome{Message: "cilium " + agents.Version.String() + " ready"}, nil
			}
		}
		return false, Outcome{Message: "waiting for the Cilium agent " + agents.Version.String() + " to be ready here", Recheck: time.Second}, nil
	}}
}

func podImage(p *corev1.PodSpec, container string) string {
	for _, c := range p.Containers {
		if c.Name == container {
			return c.Image
		}
	}
	return ""
}

// kubeProxyObjects are the objects of Talos's kube-proxy manifest
// (inventory.KubeProxy), fresh for each use.
func kubeProxyObjects() []client.Object {
	meta := func(ns string) metav1.ObjectMeta { return metav1.ObjectMeta{Namespace: ns, Name: "kube-proxy"} }
	return []client.Object{
		&appsv1.DaemonSet{ObjectMeta: meta("kube-system")},
		&corev1.ServiceAccount{ObjectMeta: meta("kube-system")},
		&rbacv1.ClusterRoleBinding{ObjectMeta: meta("")},
	}
}
