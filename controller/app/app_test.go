package app

import (
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// TestSlimNode: the cache keeps of a Node what Ichor reads and drops the
// rest.
func TestSlimNode(t *testing.T) {
	ready := corev1.NodeCondition{Type: corev1.NodeReady, Status: corev1.ConditionFalse, Reason: "KubeletNotReady", Message: "PLEG is not healthy",
		LastHeartbeatTime: metav1.Unix(100, 0), LastTransitionTime: metav1.Unix(50, 0)}
	meta := metav1.ObjectMeta{Name: "w-1", Labels: map[string]string{"node-role.kubernetes.io/worker": ""},
		Annotations: map[string]string{"ichor.maesh.dev/cordoned-by": "op/ns/a"}}
	spec := corev1.NodeSpec{Unschedulable: true, Taints: []corev1.Taint{{Key: "k", Effect: corev1.TaintEffectNoSchedule}}}
	addresses := []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: "10.5.0.2"}}
	full := &corev1.Node{ObjectMeta: meta, Spec: spec, Status: corev1.NodeStatus{
		Capacity:    corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("4")},
		Allocatable: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("4")},
		Conditions:  []corev1.NodeCondition{{Type: corev1.NodeMemoryPressure, Status: corev1.ConditionFalse}, ready},
		Addresses:   addresses,
		NodeInfo: corev1.NodeSystemInfo{BootID: "b-1", OSImage: "Talos (v1.13.7)", KubeletVersion: "v1.35.0",
			MachineID: "m", KernelVersion: "6.18", Architecture: "amd64"},
		Images:          []corev1.ContainerImage{{Names: []string{"registry.k8s.io/pause:3.10"}, SizeBytes: 1}},
		VolumesInUse:    []corev1.UniqueVolumeName{"v"},
		DaemonEndpoints: corev1.NodeDaemonEndpoints{KubeletEndpoint: corev1.DaemonEndpoint{Port: 10250}},
	}}
	full.ManagedFields = []metav1.ManagedFieldsEntry{{Manager: "kubelet"}}
	want := &corev1.Node{ObjectMeta: meta, Spec: spec, Status: corev1.NodeStatus{
		Conditions: []corev1.NodeCondition{ready},
		Addresses:  addresses,
		NodeInfo:   corev1.NodeSystemInfo{BootID: "b-1", OSImage: "Talos (v1.13.7)", KubeletVersion: "v1.35.0"},
	}}
	for _, tc := range []struct {
		name string
		in   any
		want any
	}{
		{"a Node", full, want},
		{"not a Node", &corev1.Pod{ObjectMeta: meta}, &corev1.Pod{ObjectMeta: meta}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := slimNode(tc.in)
			if err != nil {
				t.Fatal(err)
			}
			if !equality.Semantic.DeepEqual(got, tc.want) {
				t.Errorf("got %+v\nwant %+v", got, tc.want)
			}
		})
	}
}
