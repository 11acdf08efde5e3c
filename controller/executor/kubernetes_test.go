package executor

import "testing"

// TestRetag: the image moves to the version, keeping the kubelet's flavour
// suffix when asked; a reference without a tag is refused.
func TestRetag(t *testing.T) {
	tests := []struct {
		ref        string
		keepSuffix bool
		want       string
	}{
		{"registry.k8s.io/kube-apiserver:v1.35.0", false, "registry.k8s.io/kube-apiserver:v1.36.2"},
		{"ghcr.io/siderolabs/kubelet:v1.35.0-fat", true, "ghcr.io/siderolabs/kubelet:v1.36.2-fat"},
		{"ghcr.io/siderolabs/kubelet:v1.35.0", true, "ghcr.io/siderolabs/kubelet:v1.36.2"},
		{"mirror.local:5000/kube-scheduler:v1.35.0", false, "mirror.local:5000/kube-scheduler:v1.36.2"},
		{"mirror.local:5000/kube-scheduler", false, ""},
		{"registry.k8s.io/kube-apiserver@sha256:abc", false, ""},
	}
	for _, tt := range tests {
		got, err := retag(tt.ref, "v1.36.2", tt.keepSuffix)
		if got != tt.want || (err != nil) != (tt.want == "") {
			t.Errorf("retag(%q, %v) = %q, %v; want %q", tt.ref, tt.keepSuffix, got, err, tt.want)
		}
	}
}
