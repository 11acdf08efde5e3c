package argocd_test

import (
	"os"
	"regexp"
	"testing"

	"sigs.k8s.io/yaml"

	"maesh.dev/ichor/manifests/argocd"
)

// TestReadmeSnippet: the argocd-cm snippet in the README carries health.lua
// as it is, under the key Argo CD reads it from.
func TestReadmeSnippet(t *testing.T) {
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	blocks := regexp.MustCompile("(?s)```yaml\n(.*?)```").FindAllSubmatch(readme, -1)
	var found int
	for _, b := range blocks {
		var cm struct {
			Data map[string]string `json:"data"`
		}
		if err := yaml.Unmarshal(b[1], &cm); err != nil {
			continue
		}
		script, ok := cm.Data[argocd.ConfigKey]
		if !ok {
			continue
		}
		found++
		if script != argocd.Script {
			t.Errorf("the README's argocd-cm snippet differs from manifests/argocd/health.lua; paste the file again, indented under %s: |", argocd.ConfigKey)
		}
	}
	if found != 1 {
		t.Errorf("the README has %d yaml blocks with data.%s, want 1", found, argocd.ConfigKey)
	}
}

// TestCheckUnseenGeneration: until ichor-controller has seen the latest
// spec, the operation is Progressing whatever its old status says.
func TestCheckUnseenGeneration(t *testing.T) {
	stalled := []any{map[string]any{"type": "Stalled", "status": "True", "reason": "InstallFailed", "message": "InstallFailed on w1"}}
	for _, tt := range []struct {
		name string
		obj  map[string]any
		want string
	}{
		{"no status", map[string]any{"metadata": map[string]any{"generation": int64(1)}}, "Progressing"},
		{"an older generation", map[string]any{"metadata": map[string]any{"generation": int64(2)}, "status": map[string]any{"observedGeneration": int64(1), "phase": "Succeeded", "conditions": stalled}}, "Progressing"},
		{"this generation", map[string]any{"metadata": map[string]any{"generation": int64(2)}, "status": map[string]any{"observedGeneration": int64(2), "phase": "Paused", "conditions": stalled}}, "Degraded"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got, err := argocd.Check(tt.obj)
			if err != nil {
				t.Fatal(err)
			}
			if got.Status != tt.want {
				t.Errorf("%s (%q), want %s", got.Status, got.Message, tt.want)
			}
		})
	}
}
