package v1alpha1_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/types"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

func keyOf(ns, name string) types.NamespacedName {
	return types.NamespacedName{Namespace: ns, Name: name}
}

// TestKubectlInstallsAndPrints drives the real kubectl: `kubectl apply -k
// manifests` installs Ichor and `kubectl get talosop` prints the CRD's columns.
func TestKubectlInstallsAndPrints(t *testing.T) {
	ctx := context.Background()
	out, _, err := env.Kubectl(ctx, nil, "apply", "-k", filepath.Join(env.Root, "manifests"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"namespace/ichor-system", "customresourcedefinition.apiextensions.k8s.io/talosoperations.ichor.maesh.dev"} {
		if !strings.Contains(out, want) {
			t.Errorf("kubectl apply output lacks %q:\n%s", want, out)
		}
	}

	ns := env.Namespace(t)
	manifest := `apiVersion: ichor.maesh.dev/v1alpha1
kind: TalosOperation
metadata:
  name: upgrade-talos
  namespace: ` + ns + `
spec:
  kind: talos
  talos:
    version: v1.13.7
`
	path := filepath.Join(t.TempDir(), "op.yaml")
	if err := os.WriteFile(path, []byte(manifest), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, _, err := env.Kubectl(ctx, nil, "apply", "-f", path); err != nil {
		t.Fatal(err)
	}
	op := &ichorv1.TalosOperation{}
	if err := env.Client.Get(ctx, keyOf(ns, "upgrade-talos"), op); err != nil {
		t.Fatal(err)
	}
	op.Status = ichorv1.TalosOperationStatus{Phase: ichorv1.PhaseRunning, Progress: "3/7", Current: "cp-2", Target: "talos v1.13.7", Lock: ichorv1.LockHeld}
	if err := env.Client.Status().Update(ctx, op); err != nil {
		t.Fatal(err)
	}

	tests := []struct {
		args []string
		want []string
	}{
		{[]string{"get", "talosop", "-n", ns}, []string{"NAME", "KIND", "PHASE", "PROGRESS", "CURRENT", "REASON", "FAILURE", "AGE", "upgrade-talos", "talos", "Running", "3/7", "cp-2"}},
		{[]string{"get", "talosop", "-n", ns, "-o", "wide"}, []string{"TARGET", "LOCK", "talos v1.13.7", "Held"}},
		{[]string{"get", "ichor", "-n", ns}, []string{"upgrade-talos", "Running"}},
	}
	for _, tt := range tests {
		out, _, err := env.Kubectl(ctx, nil, tt.args...)
		if err != nil {
			t.Fatal(err)
		}
		for _, w := range tt.want {
			if !strings.Contains(out, w) {
				t.Errorf("kubectl %s lacks %q:\n%s", strings.Join(tt.args, " "), w, out)
			}
		}
	}
	// The wide columns stay out of the default view.
	if out, _, _ := env.Kubectl(ctx, nil, "get", "talosop", "-n", ns); strings.Contains(out, "TARGET") {
		t.Errorf("TARGET shows without -o wide:\n%s", out)
	}

	// A bad object is refused by the API server through kubectl, naming the field.
	bad := strings.Replace(manifest, "v1.13.7", "1.13", 1)
	bad = strings.Replace(bad, "upgrade-talos", "bad", 1)
	if err := os.WriteFile(path, []byte(bad), 0o600); err != nil {
		t.Fatal(err)
	}
	_, stderr, err := env.Kubectl(ctx, nil, "apply", "-f", path)
	if err == nil || !strings.Contains(stderr, "spec.talos.version") {
		t.Errorf("kubectl apply of a bad version: err=%v stderr=%s", err, stderr)
	}
}

// TestGenerateIsIdempotent regenerates deepcopy and the CRD into a copy of
// the tree and diffs it against the checkout, so a change to the types
// without `make generate` fails here.
func TestGenerateIsIdempotent(t *testing.T) {
	gen := os.Getenv("CONTROLLER_GEN")
	if gen == "" {
		t.Fatal("CONTROLLER_GEN is not set: run `make test`")
	}
	tmp := t.TempDir()
	for _, p := range []string{"go.mod", "go.sum", "api", "manifests", "hack/generate.sh", "hack/boilerplate.go.txt"} {
		dst := filepath.Join(tmp, p)
		if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
			t.Fatal(err)
		}
		if out, err := exec.Command("cp", "-a", filepath.Join(env.Root, p), dst).CombinedOutput(); err != nil {
			t.Fatalf("copy %s: %v: %s", p, err, out)
		}
	}
	if out, err := exec.Command(filepath.Join(tmp, "hack/generate.sh"), gen, tmp).CombinedOutput(); err != nil {
		t.Fatalf("generate: %v: %s", err, out)
	}
	for _, p := range []string{"api", "manifests"} {
		out, err := exec.Command("diff", "-r", filepath.Join(env.Root, p), filepath.Join(tmp, p)).CombinedOutput()
		if err != nil {
			t.Errorf("`make generate` is not up to date in %s (run it and commit):\n%s", p, out)
		}
	}
}
