package clitest

import (
	"bytes"
	"context"
	"flag"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/internal/testenv"
)

var update = flag.Bool("update", false, "rewrite the golden files in testdata/ from the current output")

// withStdin runs the real kubectl with stdin and returns its output and exit code.
func withStdin(t *testing.T, stdin string, args ...string) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, testenv.Kubectl, args...)
	cmd.Env = append(append(os.Environ(), "KUBECONFIG="+env.Kubeconfig, "NO_COLOR=1"), pathEnv()...)
	var out, errOut bytes.Buffer
	cmd.Stdin, cmd.Stdout, cmd.Stderr = strings.NewReader(stdin), &out, &errOut
	err := cmd.Run()
	r := result{out: out.String(), err: errOut.String()}
	if exit, ok := err.(*exec.ExitError); ok {
		r.code = exit.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	return r
}

// TestConfigApply: patches from files and standard input land in the
// operation in order, and a client dry run prints the object to create.
func TestConfigApply(t *testing.T) {
	ns := env.Namespace(t)
	labels := "machine:\n  nodeLabels:\n    zone: a\n"
	sysctl := "- op: add\n  path: /machine/sysctls\n  value:\n    vm.max_map_count: \"262144\"\n"
	file := filepath.Join(t.TempDir(), "labels.yaml")
	if err := os.WriteFile(file, []byte(labels), 0o600); err != nil {
		t.Fatal(err)
	}
	r := withStdin(t, sysctl, "ichor", "-n", ns, "config", "apply", "-f", file, "-f", "-", "--mode", "auto", "--name", "labels", "--max-unavailable", "2")
	if r.code != 0 || r.out != "talosoperation.ichor.maesh.dev/labels created\n" {
		t.Fatalf("exit %d, stdout %q, stderr %q", r.code, r.out, r.err)
	}
	got := getOp(t, ns, "labels")
	want := &ichorv1.ConfigRollout{Patches: []string{labels, sysctl}, Mode: ichorv1.ConfigModeAuto}
	if !reflect.DeepEqual(got.Spec.Config, want) || got.Spec.MaxUnavailable != 2 {
		t.Fatalf("spec %+v, config %+v", got.Spec, got.Spec.Config)
	}

	r = withStdin(t, "machine: [oops\n", "ichor", "-n", ns, "config", "apply", "-f", "-")
	if r.code != 1 || !strings.HasPrefix(r.err, "error: patch standard input is not a machine-config patch: ") {
		t.Fatalf("a patch that is not YAML: exit %d, stderr %q", r.code, r.err)
	}

	r = withStdin(t, labels, "ichor", "-n", "prod", "config", "apply", "-f", "-", "--name", "labels", "--dry-run=client")
	if r.code != 0 {
		t.Fatalf("client dry run: exit %d, stderr %q", r.code, r.err)
	}
	golden(t, "testdata/config-apply-dry-run.golden", r.out)
}

func golden(t *testing.T, path, got string) {
	t.Helper()
	if *update {
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run with -update to write it)", err)
	}
	if got != string(want) {
		t.Errorf("%s differs:\n--- got\n%s\n--- want\n%s", path, got, want)
	}
}
