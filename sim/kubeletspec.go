package sim

import (
	"maps"

	"github.com/siderolabs/talos/pkg/machinery/resources/k8s"
)

// renderKubeletSpec is Talos's KubeletSpecController: the KubeletSpec
// resource (namespace k8s, ID kubelet) holds the kubelet image of the
// active configuration, its flags (Talos's own merged with
// machine.kubelet.extraArgs, as argsbuilder renders them) and its
// KubeletConfiguration with machine.kubelet.extraConfig over it.
func (m *Machine) renderKubeletSpec() {
	cfg := m.Config()
	if cfg == nil || cfg.Machine() == nil {
		return
	}
	kc := cfg.Machine().Kubelet()
	spec := k8s.NewKubeletSpec(k8s.NamespaceName, k8s.KubeletID)
	spec.TypedSpec().Image = kc.Image()
	spec.TypedSpec().Args = renderArgs(map[string][]string{
		"config":               {"/etc/kubernetes/kubelet.yaml"},
		"cert-dir":             {"/var/lib/kubelet/pki"},
		"hostname-override":    {m.Name()},
		"node-ip":              {m.addr},
		"kubeconfig":           {"/etc/kubernetes/kubeconfig-kubelet"},
		"bootstrap-kubeconfig": {"/etc/kubernetes/bootstrap-kubeconfig"},
	}, argValues(kc.ExtraArgs()))
	conf := map[string]any{"apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration"}
	maps.Copy(conf, kc.ExtraConfig())
	spec.TypedSpec().Config = conf
	spec.TypedSpec().ExpectedNodename = m.Name()
	m.renderMu.Lock()
	defer m.renderMu.Unlock()
	m.put(spec)
}
