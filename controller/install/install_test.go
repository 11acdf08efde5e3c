package install

import (
	"bytes"
	"context"
	"os"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/manifests"
)

var env *testenv.Env

func TestMain(m *testing.M) { os.Exit(testenv.Main(m, &env)) }

func newClient(t *testing.T) client.Client {
	c, err := client.New(env.Config, client.Options{Scheme: scheme})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

const crdName = "talosoperations.ichor.maesh.dev"

// The installer applies its own manifests, the controller image set, and
// a second run changes nothing.
func TestInstallApplies(t *testing.T) {
	ctx := context.Background()
	c := newClient(t)
	var out bytes.Buffer
	o := &Options{Image: "registry.local/ichor-controller:v0.2.0", Client: c, Out: &out}
	for range 2 {
		if err := o.Run(ctx); err != nil {
			t.Fatalf("install: %v\n%s", err, out.String())
		}
	}
	objs, err := manifests.Objects("")
	if err != nil {
		t.Fatal(err)
	}
	if lines := strings.Count(out.String(), "applied "); lines != 2*(len(objs)+1) {
		t.Errorf("%d lines say applied, want %d:\n%s", lines, 2*(len(objs)+1), out.String())
	}
	if first := strings.SplitN(out.String(), "\n", 2)[0]; first != "applied CustomResourceDefinition "+crdName {
		t.Errorf("the CRD is not applied first: %s", first)
	}
	d := &appsv1.Deployment{}
	if err := c.Get(ctx, client.ObjectKey{Namespace: "ichor-system", Name: manifests.Deployment}, d); err != nil {
		t.Fatal(err)
	}
	if img := d.Spec.Template.Spec.Containers[0].Image; img != o.Image {
		t.Fatalf("Deployment image %s, want %s", img, o.Image)
	}
}

// A target whose CRD no longer serves a version the cluster stores is
// refused before anything is applied.
func TestInstallRefusesToDropAStoredVersion(t *testing.T) {
	ctx := context.Background()
	c := newClient(t)
	crd := &apiextensionsv1.CustomResourceDefinition{}
	if err := c.Get(ctx, client.ObjectKey{Name: crdName}, crd); err != nil {
		t.Fatal(err)
	}
	// The cluster once stored v1alpha0: a version this build does not serve.
	old := crd.Spec.Versions[0].DeepCopy()
	old.Name, old.Storage = "v1alpha0", false
	crd.Spec.Versions = append(crd.Spec.Versions, *old)
	if err := c.Update(ctx, crd); err != nil {
		t.Fatal(err)
	}
	crd.Status.StoredVersions = append(crd.Status.StoredVersions, "v1alpha0")
	if err := c.Status().Update(ctx, crd); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = c.Get(ctx, client.ObjectKey{Name: crdName}, crd)
		crd.Status.StoredVersions = []string{"v1alpha1"}
		_ = c.Status().Update(ctx, crd)
	})
	before := crd.ResourceVersion
	var out bytes.Buffer
	err := (&Options{Client: c, Out: &out}).Run(ctx)
	if err == nil || !strings.Contains(err.Error(), "stores objects as v1alpha0, which it would drop") {
		t.Fatalf("error %v, want a refusal naming v1alpha0", err)
	}
	if out.Len() > 0 {
		t.Errorf("a refused install applied: %s", out.String())
	}
	if err := c.Get(ctx, client.ObjectKey{Name: crdName}, crd); err != nil || crd.ResourceVersion != before {
		t.Errorf("the CRD changed: %v", err)
	}
}
