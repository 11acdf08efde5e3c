package ciliumcmd

import (
	"bytes"
	"context"
	"strings"
	"testing"
)

// Bad flags are refused before anything is read, saying what to pass.
func TestUpgradeFlags(t *testing.T) {
	tests := []struct {
		args []string
		want string
	}{
		{nil, "--kube-proxy-replacement is required: true (Cilium replaces kube-proxy) or false (kube-proxy runs)"},
		{[]string{"--kube-proxy-replacement=maybe"}, `--kube-proxy-replacement "maybe": say true or false`},
		{[]string{"--kube-proxy-replacement=true", "--chart-digest="}, "--chart-version and --chart-digest are required"},
		{[]string{"--kube-proxy-replacement=false", "--timeout=0s"}, "--timeout must be positive"},
		// The image's chart is checked before the cluster is touched.
		{[]string{"--kube-proxy-replacement=false", "--chart-dir", "/nonexistent", "--kubeconfig", "/nonexistent"},
			"the Cilium chart 1.19.6 is not in this image"},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			cmd := New()
			var out bytes.Buffer
			cmd.SetOut(&out)
			cmd.SetErr(&out)
			cmd.SetArgs(append([]string{"upgrade"}, tt.args...))
			err := cmd.ExecuteContext(context.Background())
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error %v, want %q", err, tt.want)
			}
		})
	}
}
