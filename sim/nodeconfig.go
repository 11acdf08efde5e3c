package sim

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"reflect"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/siderolabs/talos/pkg/machinery/config"
	"github.com/siderolabs/talos/pkg/machinery/constants"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// nodeKV is what Talos puts on a machine's Node from its active
// configuration (Talos's NodeLabelSpec, NodeAnnotationSpec and NodeTaintSpec
// controllers): machine.nodeLabels and the control-plane role label,
// machine.nodeAnnotations, machine.nodeTaints ("value:Effect" or "Effect")
// and, on a control plane that does not allow scheduling, its NoSchedule
// taint.
type nodeKV struct {
	labels, annotations map[string]string
	taints              []corev1.Taint
}

func nodeKVOf(cfg config.Provider, role Role) nodeKV {
	kv := nodeKV{labels: map[string]string{}, annotations: map[string]string{}}
	mc := cfg.Machine()
	if mc == nil {
		return kv
	}
	maps.Copy(kv.labels, mc.NodeLabels())
	maps.Copy(kv.annotations, mc.NodeAnnotations())
	if role == ControlPlane {
		kv.labels[constants.LabelNodeRoleControlPlane] = ""
		if cfg.Cluster() != nil && !cfg.Cluster().ScheduleOnControlPlanes() {
			kv.taints = append(kv.taints, corev1.Taint{Key: constants.LabelNodeRoleControlPlane, Effect: corev1.TaintEffectNoSchedule})
		}
	}
	for _, key := range slices.Sorted(maps.Keys(mc.NodeTaints())) {
		value, effect, found := strings.Cut(mc.NodeTaints()[key], ":")
		if !found {
			value, effect = "", value
		}
		kv.taints = append(kv.taints, corev1.Taint{Key: key, Value: value, Effect: corev1.TaintEffect(effect)})
	}
	return kv
}

// nodeSync serialises a machine's Node updates and remembers what was last
// put on the Node, so that a boot that changes nothing writes nothing.
type nodeSync struct {
	mu      sync.Mutex
	applied *nodeKV
}

// syncNodeConfig puts the active configuration's labels, annotations and
// taints on the machine's Node, as Talos's NodeApplyController does after a
// configuration change and at boot. Nothing is written when they are what
// was last put there. A nil kube does nothing.
func (k *kube) syncNodeConfig(m *Machine) {
	if k == nil {
		return
	}
	m.node.mu.Lock()
	defer m.node.mu.Unlock()
	kv := nodeKVOf(m.Config(), m.spec.Role)
	if m.node.applied != nil && reflect.DeepEqual(*m.node.applied, kv) {
		return
	}
	ctx, cancel := k.ctx()
	defer cancel()
	// Conflicts are retried, as Talos retries them.
	for {
		err := k.applyNodeKV(ctx, m.Name(), kv)
		if err == nil {
			m.node.applied = &kv
			return
		}
		if !apierrors.IsConflict(err) || sleep(ctx, 10*time.Millisecond) != nil {
			k.f.logf("%s: node labels, annotations and taints: %v", m.Name(), err)
			return
		}
	}
}

// syncNodeConfigLater is syncNodeConfig in the background: Talos's
// controllers update the Node after ApplyConfiguration has answered.
func (k *kube) syncNodeConfigLater(m *Machine) {
	if k == nil || k.f.ctx.Err() != nil {
		return
	}
	k.f.wg.Go(func() { k.syncNodeConfig(m) })
}

func (k *kube) applyNodeKV(ctx context.Context, name string, kv nodeKV) error {
	node, err := k.cs.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return err
	}
	before := node.DeepCopy()
	if err := kv.applyTo(node); err != nil {
		return err
	}
	if reflect.DeepEqual(before.Labels, node.Labels) && reflect.DeepEqual(before.Annotations, node.Annotations) &&
		reflect.DeepEqual(before.Spec.Taints, node.Spec.Taints) {
		return nil
	}
	_, err = k.cs.CoreV1().Nodes().Update(ctx, node, metav1.UpdateOptions{})
	return err
}

// applyTo is Talos's NodeApplyController on one Node: what Talos owns is
// recorded in the talos.dev/owned-labels, -annotations and -taints
// annotations; a key that is not on the Node is taken over, one that holds
// the wanted value becomes owned, one set by someone else to another value
// is left alone, and an owned key the configuration no longer has is
// removed.
func (kv nodeKV) applyTo(node *corev1.Node) error {
	if node.Labels == nil {
		node.Labels = map[string]string{}
	}
	if node.Annotations == nil {
		node.Annotations = map[string]string{}
	}
	owned := map[string]map[string]bool{}
	for _, a := range []string{constants.AnnotationOwnedLabels, constants.AnnotationOwnedAnnotations, constants.AnnotationOwnedTaints} {
		var keys []string
		if v := node.Annotations[a]; v != "" {
			if err := json.Unmarshal([]byte(v), &keys); err != nil {
				return fmt.Errorf("annotation %s: %w", a, err)
			}
		}
		owned[a] = map[string]bool{}
		for _, key := range keys {
			owned[a][key] = true
		}
	}
	applyMap(node.Labels, owned[constants.AnnotationOwnedLabels], kv.labels)
	applyMap(node.Annotations, owned[constants.AnnotationOwnedAnnotations], kv.annotations)
	node.Spec.Taints = applyTaints(node.Spec.Taints, owned[constants.AnnotationOwnedTaints], kv.taints)
	for a, set := range owned {
		if len(set) == 0 {
			delete(node.Annotations, a)
			continue
		}
		b, err := json.Marshal(slices.Sorted(maps.Keys(set)))
		if err != nil {
			return err
		}
		node.Annotations[a] = string(b)
	}
	return nil
}

func applyMap(on map[string]string, owned map[string]bool, want map[string]string) {
	for key, value := range want {
		cur, exists := on[key]
		switch {
		case !exists:
			on[key], owned[key] = value, true
		case cur == value:
			owned[key] = true
		case owned[key]:
			on[key] = value
		}
	}
	for key := range owned {
		if _, ok := want[key]; !ok {
			delete(on, key)
			delete(owned, key)
		}
	}
}

func applyTaints(on []corev1.Taint, owned map[string]bool, want []corev1.Taint) []corev1.Taint {
	for _, w := range want {
		i := slices.IndexFunc(on, func(t corev1.Taint) bool { return t.Key == w.Key })
		switch {
		case i < 0:
			on, owned[w.Key] = append(on, w), true
		case owned[w.Key]:
			on[i].Value, on[i].Effect = w.Value, w.Effect
		case on[i].Value == w.Value && on[i].Effect == w.Effect:
			owned[w.Key] = true
		}
	}
	return slices.DeleteFunc(on, func(t corev1.Taint) bool {
		if !owned[t.Key] || slices.ContainsFunc(want, func(w corev1.Taint) bool { return w.Key == t.Key }) {
			return false
		}
		delete(owned, t.Key)
		return true
	})
}

// kubeletInputs is what Talos's KubeletConfig controller takes from the
// configuration: when it changes, the kubelet restarts.
type kubeletInputs struct {
	kubelet       any
	dnsDomain     string
	dnsServiceIPs string
	cloudProvider bool
	diskQuota     bool
	scheduleOnCP  bool
	// kubernetesCAs is the secrets.Kubelet resource's AcceptedCAs (Talos
	// 1.13: cluster.ca's certificate, then cluster.acceptedCAs): the
	// KubeletServiceController restarts the kubelet when it changes, so
	// each stage of a Kubernetes CA rotation restarts it.
	kubernetesCAs string
}

func kubeletInputsOf(cfg config.Provider) kubeletInputs {
	raw := cfg.RawV1Alpha1()
	in := kubeletInputs{}
	if raw != nil && raw.MachineConfig != nil {
		in.kubelet = raw.MachineConfig.MachineKubelet
	}
	if cfg.Machine() != nil {
		in.diskQuota = cfg.Machine().Features().DiskQuotaSupportEnabled()
	}
	if c := cfg.Cluster(); c != nil {
		in.dnsDomain = c.Network().DNSDomain()
		ips, _ := c.Network().DNSServiceIPs()
		in.dnsServiceIPs = fmt.Sprint(ips)
		in.cloudProvider = c.ExternalCloudProvider().Enabled()
		in.scheduleOnCP = c.ScheduleOnControlPlanes()
		if ca := c.IssuingCA(); ca != nil {
			in.kubernetesCAs = string(ca.Crt)
		}
		for _, a := range c.AcceptedCAs() {
			in.kubernetesCAs += string(a.Crt)
		}
	}
	return in
}
