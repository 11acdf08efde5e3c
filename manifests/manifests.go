// Package manifests holds Ichor's kustomize base (this directory, which
// `kubectl apply -k manifests` installs) in the binary, so that the ichor
// kind's installer Job applies exactly the manifests of the version it runs:
// Objects renders them as kustomize does.
package manifests

import (
	"embed"
	"fmt"
	"io/fs"
	"path"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
	"sigs.k8s.io/yaml"
)

//go:embed kustomization.yaml namespace.yaml crd controller rbac policies
var base embed.FS

// Controller names the controller's Deployment and its container.
const (
	Deployment = "ichor-controller"
	Container  = "controller"
)

// Objects renders the kustomize base, with the controller's image set to
// image ("" keeps the one the release's kustomization sets).
func Objects(image string) ([]*unstructured.Unstructured, error) {
	mem := filesys.MakeFsInMemory()
	err := fs.WalkDir(base, ".", func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		data, err := base.ReadFile(p)
		if err != nil {
			return err
		}
		if err := mem.MkdirAll(path.Dir("/" + p)); err != nil {
			return err
		}
		return mem.WriteFile("/"+p, data)
	})
	if err != nil {
		return nil, err
	}
	res, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(mem, "/")
	if err != nil {
		return nil, fmt.Errorf("kustomize the manifests: %w", err)
	}
	var out []*unstructured.Unstructured
	for _, r := range res.Resources() {
		data, err := r.MarshalJSON()
		if err != nil {
			return nil, err
		}
		u := &unstructured.Unstructured{}
		if err := u.UnmarshalJSON(data); err != nil {
			return nil, err
		}
		if image != "" && u.GetKind() == "Deployment" && u.GetName() == Deployment {
			if err := setImage(u, image); err != nil {
				return nil, err
			}
		}
		out = append(out, u)
	}
	return out, nil
}

func setImage(u *unstructured.Unstructured, image string) error {
	spec, _ := u.Object["spec"].(map[string]any)
	tmpl, _ := spec["template"].(map[string]any)
	pod, _ := tmpl["spec"].(map[string]any)
	containers, _ := pod["containers"].([]any)
	for _, c := range containers {
		if m, ok := c.(map[string]any); ok && m["name"] == Container {
			m["image"] = image
			return nil
		}
	}
	return fmt.Errorf("Deployment %s has no container %s", Deployment, Container)
}

// YAML is the rendered objects as one multi-document YAML stream.
func YAML(objs []*unstructured.Unstructured) ([]byte, error) {
	var out []byte
	for _, o := range objs {
		b, err := yaml.Marshal(o.Object)
		if err != nil {
			return nil, err
		}
		out = append(append(out, "---\n"...), b...)
	}
	return out, nil
}
