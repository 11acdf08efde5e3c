package clitest

import (
	"bytes"
	"context"
	"flag"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	ctrlclient "sigs.k8s.io/controller-runtime/pkg/client"

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
// operation in order, with the common flags; a patch that machinery's
// configpatcher does not load is refused before anything is created; a
// client dry run prints the object to create and a server dry run creates
// nothing.
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

	r = withStdin(t, labels, "ichor", "-n", ns, "config", "apply", "-f", "-", "--name", "workers", "--paused",
		"-l", "!node-role.kubernetes.io/control-plane", "--max-unavailable", "3", "-o", "name")
	if r.code != 0 || r.out != "talosoperation.ichor.maesh.dev/workers\n" {
		t.Fatalf("--paused -l --max-unavailable -o name: exit %d, stdout %q, stderr %q", r.code, r.out, r.err)
	}
	got = getOp(t, ns, "workers")
	sel := &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{{Key: "node-role.kubernetes.io/control-plane", Operator: metav1.LabelSelectorOpDoesNotExist}}}
	if s := got.Spec; !s.Paused || s.MaxUnavailable != 3 || !reflect.DeepEqual(s.Machines, sel) || s.Config.Mode != ichorv1.ConfigModeReboot {
		t.Errorf("spec %+v, selector %+v", s, s.Machines)
	}

	// Patches configpatcher does not load: each is refused, exit 1, saying
	// what to fix, and none creates an operation.
	for _, tt := range []struct{ name, patch string }{
		{"unknown-field", "machine:\n  nodeLabelz:\n    zone: a\n"},
		{"wrong-type", "machine:\n  env: 3\n"},
		{"not-yaml", "machine: [oops\n"},
		{"not-a-patch", "just words\n"},
		{"empty", "\n"},
	} {
		r = withStdin(t, tt.patch, "ichor", "-n", ns, "config", "apply", "-f", "-", "--name", "bad-"+tt.name)
		if r.code != 1 || r.out != "" {
			t.Errorf("%s: exit %d, stdout %q, want exit 1 and nothing printed", tt.name, r.code, r.out)
		}
		golden(t, "testdata/config-apply-refused-"+tt.name+".golden", r.err)
	}
	// The same from a file names the file.
	typo := filepath.Join(t.TempDir(), "typo.yaml")
	if err := os.WriteFile(typo, []byte("machine:\n  nodeLabelz:\n    zone: a\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	r = kubectl(t, "", "ichor", "-n", ns, "config", "apply", "-f", file, "-f", typo, "--name", "bad-file")
	if r.code != 1 || !strings.HasPrefix(r.err, "error: patch "+typo+" is not a machine-configuration patch") {
		t.Errorf("a typo'd file: exit %d, stderr %q", r.code, r.err)
	}

	r = withStdin(t, labels, "ichor", "-n", ns, "config", "apply", "-f", "-", "--name", "server-dry", "--dry-run=server")
	if r.code != 0 || r.out != "talosoperation.ichor.maesh.dev/server-dry created (server dry run)\n" {
		t.Errorf("server dry run: exit %d, stdout %q, stderr %q", r.code, r.out, r.err)
	}
	r = withStdin(t, labels, "ichor", "-n", ns, "config", "apply", "-f", "-", "--dry-run=server", "--watch")
	if r.code != 1 || !strings.HasPrefix(r.err, "error: --watch and --wait follow a real operation: they cannot be used with --dry-run") {
		t.Errorf("--dry-run with --watch: exit %d, stderr %q", r.code, r.err)
	}
	list := &ichorv1.TalosOperationList{}
	if err := env.Client.List(context.Background(), list, ctrlclient.InNamespace(ns)); err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, op := range list.Items {
		names = append(names, op.Name)
	}
	if sort.Strings(names); !reflect.DeepEqual(names, []string{"labels", "workers"}) {
		t.Errorf("operations %v, want only labels and workers: a refused patch or a dry run created one", names)
	}

	r = withStdin(t, labels, "ichor", "-n", "prod", "config", "apply", "-f", "-", "--name", "labels", "--dry-run=client")
	if r.code != 0 {
		t.Fatalf("client dry run: exit %d, stderr %q", r.code, r.err)
	}
	golden(t, "testdata/config-apply-dry-run.golden", r.out)
}

// TestConfigApplyAgainstAFleet: against a real controller and simulated
// machines, `config apply --watch` of a node label in mode auto follows the
// operation to the end and shows every machine applied live, and `--wait`
// of a machine.env patch exits 0 once every machine is applied and
// rebooted, which `watch` of the finished operation then shows.
func TestConfigApplyAgainstAFleet(t *testing.T) {
	ns, _, fleet := withController(t)
	boots := map[string]string{}
	for _, m := range fleet.Machines() {
		boots[m.Name()] = m.BootID()
	}

	r := withStdin(t, "machine:\n  nodeLabels:\n    ichor.test/zone: a\n", "ichor", "-n", ns, "config", "apply", "-f", "-",
		"--mode", "auto", "--name", "label", "--watch", "--timeout", "2m")
	if r.code != 0 {
		t.Fatalf("config apply --watch: exit %d\nstdout %s\nstderr %s", r.code, r.out, r.err)
	}
	for _, m := range fleet.Machines() {
		if !regexp.MustCompile(`machine=` + m.Name() + ` \S+->Succeeded .*"applied live"`).MatchString(r.out) {
			t.Errorf("the watch does not show %s applied live:\n%s", m.Name(), r.out)
		}
		if m.BootID() != boots[m.Name()] {
			t.Errorf("%s rebooted for a node label", m.Name())
		}
	}

	r = withStdin(t, "machine:\n  env:\n    HTTP_PROXY: http://proxy.internal:3128\n", "ichor", "-n", ns, "config", "apply", "-f", "-",
		"--mode", "auto", "--name", "env", "--wait", "--timeout", "3m")
	if r.code != 0 {
		t.Fatalf("config apply --wait: exit %d\nstdout %s\nstderr %s", r.code, r.out, r.err)
	}
	r = kubectl(t, "", "ichor", "watch", "env", "-n", ns, "--timeout", "1m")
	if r.code != 0 {
		t.Fatalf("watch of the finished operation: exit %d, stderr %s", r.code, r.err)
	}
	for _, m := range fleet.Machines() {
		if !regexp.MustCompile(`(?m)^.*machine=` + m.Name() + ` .*"applied, rebooted"$`).MatchString(r.out) {
			t.Errorf("the watch does not show %s rebooted:\n%s", m.Name(), r.out)
		}
		if m.BootID() == boots[m.Name()] {
			t.Errorf("%s did not reboot for machine.env", m.Name())
		}
	}
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
