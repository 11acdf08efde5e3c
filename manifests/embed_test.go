package manifests_test

import (
	"context"
	"slices"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"

	"maesh.dev/ichor/manifests"
)

// The manifests the binary carries render as `kubectl kustomize manifests`
// does: the same objects, the image set where asked.
func TestObjectsAreTheKustomizeOutput(t *testing.T) {
	out, _, err := env.Kubectl(context.Background(), nil, "kustomize", env.Root+"/manifests")
	if err != nil {
		t.Fatal(err)
	}
	var want []string
	for _, doc := range splitYAML(out) {
		var o struct {
			Kind     string `json:"kind"`
			Metadata struct{ Namespace, Name string }
		}
		if err := yaml.Unmarshal([]byte(doc), &o); err != nil {
			t.Fatal(err)
		}
		want = append(want, o.Kind+" "+o.Metadata.Namespace+"/"+o.Metadata.Name)
	}
	objs, err := manifests.Objects("registry.local/ichor-controller:v9.9.9")
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	image := ""
	for _, u := range objs {
		got = append(got, u.GetKind()+" "+u.GetNamespace()+"/"+u.GetName())
		if u.GetKind() == "Deployment" {
			image = u.Object["spec"].(map[string]any)["template"].(map[string]any)["spec"].(map[string]any)["containers"].([]any)[0].(map[string]any)["image"].(string)
		}
	}
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Fatalf("embedded objects:\n%v\nkubectl kustomize:\n%v", got, want)
	}
	if image != "registry.local/ichor-controller:v9.9.9" {
		t.Fatalf("the controller image is %q", image)
	}
}

func splitYAML(s string) []string {
	var out []string
	for _, d := range strings.Split("\n"+s, "\n---\n") {
		if strings.TrimSpace(d) != "" {
			out = append(out, d)
		}
	}
	return out
}
