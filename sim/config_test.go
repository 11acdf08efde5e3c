package sim_test

import (
	"context"
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cosi-project/runtime/pkg/resource"
	"github.com/cosi-project/runtime/pkg/safe"
	"github.com/cosi-project/runtime/pkg/state"
	"github.com/siderolabs/talos/pkg/machinery/api/machine"
	"github.com/siderolabs/talos/pkg/machinery/client"
	"github.com/siderolabs/talos/pkg/machinery/config/types/v1alpha1"
	configres "github.com/siderolabs/talos/pkg/machinery/resources/config"
	v1alpha1res "github.com/siderolabs/talos/pkg/machinery/resources/v1alpha1"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/types/known/durationpb"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

// configApply is a machine's active configuration changed by fn, applied in
// mode through the real client.
type configApply struct {
	t   *testing.T
	c   *client.Client
	ctx context.Context
}

func newConfigApply(t *testing.T, f *sim.Fleet, m *sim.Machine) configApply {
	ctx, cancel := context.WithTimeout(client.WithNode(context.Background(), m.Address()), time.Minute)
	t.Cleanup(cancel)
	return configApply{t: t, c: talos(t, f), ctx: ctx}
}

func (a configApply) patched(id resource.ID, fn func(*v1alpha1.Config)) []byte {
	a.t.Helper()
	mc, err := safe.StateGetByID[*configres.MachineConfig](a.ctx, a.c.COSI, id)
	if err != nil {
		a.t.Fatal(err)
	}
	p, err := mc.Provider().PatchV1Alpha1(func(cfg *v1alpha1.Config) error { fn(cfg); return nil })
	if err != nil {
		a.t.Fatal(err)
	}
	b, err := p.EncodeBytes()
	if err != nil {
		a.t.Fatal(err)
	}
	return b
}

func (a configApply) apply(mode machine.ApplyConfigurationRequest_Mode, dryRun bool, fn func(*v1alpha1.Config)) (*machine.ApplyConfiguration, error) {
	a.t.Helper()
	req := &machine.ApplyConfigurationRequest{Data: a.patched(configres.ActiveID, fn), Mode: mode, DryRun: dryRun}
	if mode == machine.ApplyConfigurationRequest_TRY {
		req.TryModeTimeout = durationpb.New(100 * time.Millisecond)
	}
	resp, err := a.c.ApplyConfiguration(a.ctx, req)
	if err != nil {
		return nil, err
	}
	return resp.Messages[0], nil
}

func owned(n *corev1.Node, annotation string) []string {
	var keys []string
	_ = json.Unmarshal([]byte(n.Annotations[annotation]), &keys)
	return keys
}

func hasTaint(n *corev1.Node, key, value string, effect corev1.TaintEffect) bool {
	return slices.ContainsFunc(n.Spec.Taints, func(t corev1.Taint) bool {
		return t.Key == key && t.Value == value && t.Effect == effect
	})
}

// TestNodeConfigLive: labels, annotations and taints of the configuration
// appear on the Node when applied live, as Talos's NodeApplyController puts
// them there, owned (talos.dev/owned-*) so that removing them from the
// configuration removes them from the Node, and never overwriting what
// someone else set. No reboot.
func TestNodeConfigLive(t *testing.T) {
	f := start(t, fleetSpec(t, 1, 1))
	cp, w := f.Machines()[0], f.Machines()[1]
	// Generated control-plane configurations carry a node label of their own.
	if n := node(t, cp); !slices.Equal(owned(n, "talos.dev/owned-labels"), []string{"node-role.kubernetes.io/control-plane", "node.kubernetes.io/exclude-from-external-load-balancers"}) ||
		!hasTaint(n, "node-role.kubernetes.io/control-plane", "", corev1.TaintEffectNoSchedule) ||
		!slices.Equal(owned(n, "talos.dev/owned-taints"), []string{"node-role.kubernetes.io/control-plane"}) {
		t.Fatalf("a control plane's Node: labels %v, annotations %v, taints %v", n.Labels, n.Annotations, n.Spec.Taints)
	}
	// An operator's label that the configuration will want otherwise.
	patch := []byte(`{"metadata":{"labels":{"team":"ops"}}}`)
	if _, err := env.Kube.CoreV1().Nodes().Patch(context.Background(), w.Name(), types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	a := newConfigApply(t, f, w)
	boot := w.BootID()
	res, err := a.apply(machine.ApplyConfigurationRequest_AUTO, false, func(cfg *v1alpha1.Config) {
		cfg.MachineConfig.MachineNodeLabels = map[string]string{"zone": "a", "team": "dev"}
		cfg.MachineConfig.MachineNodeAnnotations = map[string]string{"example.com/owner": "platform"}
		cfg.MachineConfig.MachineNodeTaints = map[string]string{"dedicated": "gpu:NoSchedule", "maintenance": "NoExecute"}
	})
	if err != nil || res.Mode != machine.ApplyConfigurationRequest_NO_REBOOT {
		t.Fatalf("auto apply: %v, %v", res, err)
	}
	testenv.Eventually(t, 30*time.Second, "the configuration's labels, annotations and taints on the Node", func(context.Context) (bool, error) {
		n := node(t, w)
		return n.Labels["zone"] == "a" && n.Annotations["example.com/owner"] == "platform" &&
			hasTaint(n, "dedicated", "gpu", corev1.TaintEffectNoSchedule) && hasTaint(n, "maintenance", "", corev1.TaintEffectNoExecute), nil
	})
	n := node(t, w)
	if n.Labels["team"] != "ops" || !slices.Equal(owned(n, "talos.dev/owned-labels"), []string{"zone"}) ||
		!slices.Equal(owned(n, "talos.dev/owned-annotations"), []string{"example.com/owner"}) ||
		!slices.Equal(owned(n, "talos.dev/owned-taints"), []string{"dedicated", "maintenance"}) {
		t.Fatalf("ownership: labels %v, annotations %v", n.Labels, n.Annotations)
	}

	if _, err := a.apply(machine.ApplyConfigurationRequest_NO_REBOOT, false, func(cfg *v1alpha1.Config) {
		cfg.MachineConfig.MachineNodeLabels = map[string]string{"team": "dev"}
		cfg.MachineConfig.MachineNodeAnnotations = nil
		cfg.MachineConfig.MachineNodeTaints = map[string]string{"dedicated": "cpu:NoSchedule"}
	}); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 30*time.Second, "what the configuration dropped gone from the Node", func(context.Context) (bool, error) {
		n := node(t, w)
		_, zone := n.Labels["zone"]
		_, owner := n.Annotations["example.com/owner"]
		return !zone && !owner && hasTaint(n, "dedicated", "cpu", corev1.TaintEffectNoSchedule) && !hasTaint(n, "maintenance", "", corev1.TaintEffectNoExecute), nil
	})
	n = node(t, w)
	if _, ok := n.Annotations["talos.dev/owned-labels"]; ok || n.Labels["team"] != "ops" {
		t.Fatalf("after the removal: labels %v, annotations %v", n.Labels, n.Annotations)
	}
	if w.BootID() != boot {
		t.Fatal("a live change rebooted the machine")
	}
}

// TestNodeConfigAtBoot: labels applied in reboot mode reach the Node once
// the machine is back on the new configuration.
func TestNodeConfigAtBoot(t *testing.T) {
	f := start(t, fleetSpec(t, 1, 1))
	w := f.Machines()[1]
	a := newConfigApply(t, f, w)
	boot := w.BootID()
	if _, err := a.apply(machine.ApplyConfigurationRequest_REBOOT, false, func(cfg *v1alpha1.Config) {
		cfg.MachineConfig.MachineNodeLabels = map[string]string{"zone": "b"}
	}); err != nil {
		t.Fatal(err)
	}
	waitRebooted(t, w, boot)
	testenv.Eventually(t, 30*time.Second, "the label on the Node", func(context.Context) (bool, error) {
		return node(t, w).Labels["zone"] == "b", nil
	})
}

// TestKubeletRestartsOnChange: a change to what the kubelet is built from
// (machine.kubelet, here its extra arguments) restarts the kubelet, its
// Service going down and coming back; other live changes leave it alone.
func TestKubeletRestartsOnChange(t *testing.T) {
	spec := fleetSpec(t, 1, 1)
	spec.Durations.KubeletRestart = 100 * time.Millisecond
	f := start(t, spec)
	w := f.Machines()[1]
	a := newConfigApply(t, f, w)
	events := make(chan safe.WrappedStateEvent[*v1alpha1res.Service], 64)
	ptr := resource.NewMetadata(v1alpha1res.NamespaceName, v1alpha1res.ServiceType, "kubelet", resource.VersionUndefined)
	if err := safe.StateWatch(a.ctx, a.c.COSI, ptr, events); err != nil {
		t.Fatal(err)
	}
	next := func() safe.WrappedStateEvent[*v1alpha1res.Service] {
		t.Helper()
		select {
		case ev := <-events:
			return ev
		case <-a.ctx.Done():
			t.Fatal("no kubelet Service event")
		}
		panic("unreachable")
	}
	if ev := next(); ev.Type() != state.Created {
		t.Fatalf("first event %s", ev.Type())
	}
	// A label change does not restart the kubelet; the extra argument after it does.
	if _, err := a.apply(machine.ApplyConfigurationRequest_NO_REBOOT, false, func(cfg *v1alpha1.Config) {
		cfg.MachineConfig.MachineNodeLabels = map[string]string{"zone": "a"}
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := a.apply(machine.ApplyConfigurationRequest_NO_REBOOT, false, func(cfg *v1alpha1.Config) {
		cfg.MachineConfig.MachineKubelet.KubeletExtraArgs = v1alpha1.Args{"max-pods": v1alpha1.NewArgValue("150", nil)}
	}); err != nil {
		t.Fatal(err)
	}
	if ev := next(); ev.Type() != state.Destroyed {
		t.Fatalf("after the kubelet change: %s, want the Service to go away", ev.Type())
	}
	ev := next()
	if svc, err := ev.Resource(); err != nil || !svc.TypedSpec().Running || !svc.TypedSpec().Healthy {
		t.Fatalf("after the restart: %s %v", ev.Type(), err)
	}
	select {
	case ev := <-events:
		t.Fatalf("one more kubelet event: %s", ev.Type())
	default:
	}
}

// TestRebootNeeded: a change Talos cannot apply live is refused in NO_REBOOT
// and TRY with the diff, changes nothing, and AUTO picks REBOOT for it; a
// dry run shows the diff, or that there is none.
func TestRebootNeeded(t *testing.T) {
	f := start(t, fleetSpec(t, 1, 1))
	w := f.Machines()[1]
	a := newConfigApply(t, f, w)
	env := func(cfg *v1alpha1.Config) {
		cfg.MachineConfig.MachineEnv = map[string]string{"HTTP_PROXY": "http://proxy:3128"}
	}
	for _, mode := range []machine.ApplyConfigurationRequest_Mode{machine.ApplyConfigurationRequest_NO_REBOOT, machine.ApplyConfigurationRequest_TRY} {
		_, err := a.apply(mode, false, env)
		wantCode(t, err, codes.InvalidArgument, "this config change can't be applied in immediate mode")
		if !strings.Contains(err.Error(), "HTTP_PROXY") {
			t.Fatalf("%s: the refusal has no diff: %v", mode, err)
		}
	}
	if w.Config().Machine().Env()["HTTP_PROXY"] != "" {
		t.Fatal("a refused apply changed the configuration")
	}
	res, err := a.apply(machine.ApplyConfigurationRequest_AUTO, true, env)
	if err != nil || res.Mode != machine.ApplyConfigurationRequest_REBOOT ||
		!strings.Contains(res.ModeDetails, "Config diff:") || !strings.Contains(res.ModeDetails, "+        HTTP_PROXY: http://proxy:3128") {
		t.Fatalf("auto dry run: %v, %v", res, err)
	}
	res, err = a.apply(machine.ApplyConfigurationRequest_AUTO, true, func(*v1alpha1.Config) {})
	if err != nil || res.Mode != machine.ApplyConfigurationRequest_NO_REBOOT || !strings.HasSuffix(res.ModeDetails, "Config diff:\n\nNo changes.") {
		t.Fatalf("a dry run of the same configuration: %v, %v", res, err)
	}
	boot := w.BootID()
	if res, err := a.apply(machine.ApplyConfigurationRequest_AUTO, false, env); err != nil || res.Mode != machine.ApplyConfigurationRequest_REBOOT {
		t.Fatalf("auto: %v, %v", res, err)
	}
	waitRebooted(t, w, boot)
	if w.Config().Machine().Env()["HTTP_PROXY"] == "" {
		t.Fatal("the configuration is not active after the reboot")
	}
}

// TestTryRevertsToActive: a TRY apply reverts to the configuration that was
// active when it came, not to the persisted one (here a staged one).
func TestTryRevertsToActive(t *testing.T) {
	f := start(t, fleetSpec(t, 1, 1))
	w := f.Machines()[1]
	a := newConfigApply(t, f, w)
	if _, err := a.apply(machine.ApplyConfigurationRequest_STAGED, false, func(cfg *v1alpha1.Config) {
		cfg.MachineConfig.MachineEnv = map[string]string{"STAGED": "1"}
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := a.apply(machine.ApplyConfigurationRequest_TRY, false, func(cfg *v1alpha1.Config) {
		cfg.MachineConfig.MachineNodeLabels = map[string]string{"try": "1"}
	}); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 30*time.Second, "the try reverted", func(context.Context) (bool, error) {
		return w.Config().Machine().NodeLabels()["try"] == "", nil
	})
	if w.Config().Machine().Env()["STAGED"] != "" {
		t.Fatal("the try reverted to the staged configuration")
	}
	persisted, err := safe.StateGetByID[*configres.MachineConfig](a.ctx, a.c.COSI, configres.PersistentID)
	if err != nil || persisted.Config().Machine().Env()["STAGED"] != "1" {
		t.Fatalf("the staged configuration is gone: %v", err)
	}
}
