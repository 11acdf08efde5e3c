package clitest

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"strings"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"maesh.dev/ichor/api/compat"
	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/internal/testenv"
)

func getOp(t *testing.T, ns, name string) *ichorv1.TalosOperation {
	t.Helper()
	op := &ichorv1.TalosOperation{}
	if err := env.Client.Get(context.Background(), client.ObjectKey{Namespace: ns, Name: name}, op); err != nil {
		t.Fatal(err)
	}
	return op
}

func createOp(t testing.TB, ns, name string) *ichorv1.TalosOperation {
	t.Helper()
	op := &ichorv1.TalosOperation{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec:       ichorv1.TalosOperationSpec{Kind: ichorv1.KindTalos, Talos: &ichorv1.TalosUpgrade{Version: "v1.13.7"}},
	}
	if err := env.Client.Create(context.Background(), op); err != nil {
		t.Fatal(err)
	}
	return op
}

// setStatus plays the controller's part: it writes the operation's status.
func setStatus(t testing.TB, op *ichorv1.TalosOperation, status ichorv1.TalosOperationStatus) {
	t.Helper()
	status.ObservedGeneration = op.Generation
	op.Status = status
	if err := env.Client.Status().Update(context.Background(), op); err != nil {
		t.Fatal(err)
	}
}

func failedStatus() ichorv1.TalosOperationStatus {
	return ichorv1.TalosOperationStatus{
		Phase: ichorv1.PhasePaused, Reason: ichorv1.ReasonStepFailed, Lock: ichorv1.LockHeld,
		FailureReason: "upgrade of cp-1 failed", Message: "paused: a step failed", Progress: "0/1",
		Machines: []ichorv1.MachineStatus{{Name: "cp-1", Role: ichorv1.RoleControlPlane, Phase: ichorv1.MachineFailed, Step: "upgrade", Message: "installer image pull: i/o timeout"}},
	}
}

func TestVersion(t *testing.T) {
	ctx := context.Background()
	r := kubectl(t, "", "ichor", "version")
	want := "Client Version: " + pluginVersion + "\nController Version: unknown (no leader Lease ichor-system/ichor-controller-leader: is ichor-controller running? (see --controller-namespace))\n"
	if r.code != 0 || r.out != want {
		t.Errorf("without a controller: exit %d, stdout %q, want %q (stderr %q)", r.code, r.out, want, r.err)
	}

	// A controller of its own namespace, as a leader Lease with its version.
	ns := env.Namespace(t)
	lease := &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: ichorv1.LeaderLeaseName,
		Annotations: map[string]string{ichorv1.VersionAnnotation: "v0.3.0"}}}
	if err := env.Client.Create(ctx, lease); err != nil {
		t.Fatal(err)
	}
	r = kubectl(t, "", "ichor", "version", "--controller-namespace", ns)
	if want := "Client Version: " + pluginVersion + "\nController Version: v0.3.0\n"; r.code != 0 || r.out != want || r.err != "" {
		t.Errorf("same minor: exit %d, stdout %q, stderr %q; want %q and no warning", r.code, r.out, r.err, want)
	}
	lease.Annotations[ichorv1.VersionAnnotation] = "v0.4.0"
	if err := env.Client.Update(ctx, lease); err != nil {
		t.Fatal(err)
	}
	r = kubectl(t, "", "ichor", "version", "--controller-namespace", ns)
	if !strings.Contains(r.err, "WARNING: plugin "+pluginVersion+" and ichor-controller v0.4.0 differ in minor version") {
		t.Errorf("skew gave no warning: stderr %q", r.err)
	}
	out := ok(t, "ichor", "version", "--controller-namespace", ns, "-o", "json")
	var info struct{ ClientVersion, ControllerVersion string }
	if err := json.Unmarshal([]byte(out), &info); err != nil || info.ClientVersion != pluginVersion || info.ControllerVersion != "v0.4.0" {
		t.Errorf("version -o json = %s (%v)", out, err)
	}
	if out := ok(t, "ichor", "version", "--client"); out != "Client Version: "+pluginVersion+"\n" {
		t.Errorf("version --client = %q", out)
	}
}

// TestCreateEachKind creates an operation of every kind through kubectl and
// checks what landed in the API server.
func TestCreateEachKind(t *testing.T) {
	ns := env.Namespace(t)
	// The machines the node actions name exist: the plugin checks.
	for _, name := range []string{"worker-1", "worker-2", "cp-1"} {
		node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}}
		if err := env.Client.Create(context.Background(), node); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = env.Client.Delete(context.Background(), node) })
	}
	patch := filepath.Join(t.TempDir(), "patch.yaml")
	if err := os.WriteFile(patch, []byte("machine:\n  sysctls:\n    vm.max_map_count: \"262144\"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		args []string
		want ichorv1.TalosOperationSpec
	}{
		{"talos", []string{"upgrade", "talos", "--to", "1.13.7", "--schematic", strings.Repeat("ab", 32), "--max-unavailable", "3", "-l", "zone=a"},
			ichorv1.TalosOperationSpec{Kind: ichorv1.KindTalos, MaxUnavailable: 3, Machines: &metav1.LabelSelector{MatchLabels: map[string]string{"zone": "a"}},
				Talos: &ichorv1.TalosUpgrade{Version: "v1.13.7", Schematic: strings.Repeat("ab", 32), ImageRepository: "factory.talos.dev", RebootMode: ichorv1.RebootModeDefault}}},
		{"kubernetes", []string{"upgrade", "kubernetes", "--to", "v1.36.2", "--paused"},
			ichorv1.TalosOperationSpec{Kind: ichorv1.KindKubernetes, MaxUnavailable: 1, Paused: true, Kubernetes: &ichorv1.KubernetesUpgrade{Version: "v1.36.2", PrePullImages: ptr.To(true)}}},
		{"ichor", []string{"upgrade", "ichor", "--to", "0.2.0"},
			ichorv1.TalosOperationSpec{Kind: ichorv1.KindIchor, MaxUnavailable: 1, Ichor: &ichorv1.IchorUpgrade{Version: "v0.2.0"}}},
		{"cni", []string{"upgrade", "cni", "--chart-version", "1.18.4", "--kube-proxy-replacement=false"},
			ichorv1.TalosOperationSpec{Kind: ichorv1.KindCNI, MaxUnavailable: 1, CNI: &ichorv1.CNIChange{ChartVersion: "1.18.4", KubeProxyReplacement: ptr.To(false)}}},
		{"config", []string{"config", "apply", "-f", patch, "--mode", "auto"},
			ichorv1.TalosOperationSpec{Kind: ichorv1.KindConfig, MaxUnavailable: 1, Config: &ichorv1.ConfigRollout{Mode: ichorv1.ConfigModeAuto, Patches: []string{"machine:\n  sysctls:\n    vm.max_map_count: \"262144\"\n"}}}},
		{"node-reboot", []string{"node", "reboot", "worker-1"},
			ichorv1.TalosOperationSpec{Kind: ichorv1.KindNode, MaxUnavailable: 1, Node: &ichorv1.NodeAction{Machine: "worker-1", Action: ichorv1.NodeReboot}}},
		{"node-restart-service", []string{"node", "restart-service", "worker-1", "--service", "kubelet"},
			ichorv1.TalosOperationSpec{Kind: ichorv1.KindNode, MaxUnavailable: 1, Node: &ichorv1.NodeAction{Machine: "worker-1", Action: ichorv1.NodeRestartService, Service: "kubelet"}}},
		{"node-etcd-defrag", []string{"node", "etcd-defrag", "cp-1"},
			ichorv1.TalosOperationSpec{Kind: ichorv1.KindNode, MaxUnavailable: 1, Node: &ichorv1.NodeAction{Machine: "cp-1", Action: ichorv1.NodeEtcdDefrag}}},
		{"node-reset", []string{"node", "reset", "worker-2", "--wipe", "ephemeral", "--graceful=false", "-y"},
			ichorv1.TalosOperationSpec{Kind: ichorv1.KindNode, MaxUnavailable: 1, Node: &ichorv1.NodeAction{Machine: "worker-2", Action: ichorv1.NodeReset,
				Reset: &ichorv1.ResetOptions{Wipe: ichorv1.WipeEphemeral, Graceful: ptr.To(false)}}}},
		{"shutdown", []string{"shutdown", "--force", "--yes"},
			ichorv1.TalosOperationSpec{Kind: ichorv1.KindShutdown, MaxUnavailable: 1, Shutdown: &ichorv1.ClusterShutdown{Force: true}}},
		{"rotate-ca", []string{"rotate", "ca", "--kubernetes", "-y"},
			ichorv1.TalosOperationSpec{Kind: ichorv1.KindCARotation, MaxUnavailable: 1, CARotation: &ichorv1.CARotation{Talos: ptr.To(false), Kubernetes: ptr.To(true)}}},
		{"rotate-ca-talos", []string{"rotate", "ca", "--talos", "-y"},
			ichorv1.TalosOperationSpec{Kind: ichorv1.KindCARotation, MaxUnavailable: 1, CARotation: &ichorv1.CARotation{Talos: ptr.To(true), Kubernetes: ptr.To(false)}}},
		{"rotate-keys", []string{"rotate", "keys", "-y"},
			ichorv1.TalosOperationSpec{Kind: ichorv1.KindKeyRotation, MaxUnavailable: 1, KeyRotation: &ichorv1.KeyRotation{ServiceAccount: ptr.To(true), Secretbox: ptr.To(true), RestartWorkloads: ptr.To(true)}}},
		{"rotate-keys-no-restart", []string{"rotate", "keys", "--service-account", "--no-restart", "-y"},
			ichorv1.TalosOperationSpec{Kind: ichorv1.KindKeyRotation, MaxUnavailable: 1, KeyRotation: &ichorv1.KeyRotation{ServiceAccount: ptr.To(true), Secretbox: ptr.To(false), RestartWorkloads: ptr.To(false)}}},
		{"restore-etcd", []string{"restore", "etcd", "--from", "s3://backups/etcd.snapshot", "--secret", "ichor-etcd-snapshot", "--machine", "cp-1", "-y"},
			ichorv1.TalosOperationSpec{Kind: ichorv1.KindEtcdRestore, MaxUnavailable: 1, EtcdRestore: &ichorv1.EtcdRestore{Snapshot: "s3://backups/etcd.snapshot", Secret: "ichor-etcd-snapshot", Machine: "cp-1"}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			args := append([]string{"ichor", "-n", ns}, tt.args...)
			out := ok(t, append(args, "-o", "name")...)
			name, found := strings.CutPrefix(strings.TrimSpace(out), "talosoperation.ichor.maesh.dev/")
			if !found || !strings.HasPrefix(name, tt.name[:strings.IndexAny(tt.name+"-", "-")]) && !strings.HasPrefix(name, tt.args[0]) {
				t.Fatalf("-o name printed %q", out)
			}
			got := getOp(t, ns, name)
			if !reflect.DeepEqual(got.Spec, tt.want) {
				t.Errorf("spec of %s:\n%+v\nwant\n%+v", name, got.Spec, tt.want)
			}
		})
	}

	t.Run("named, kubectl-style output", func(t *testing.T) {
		out := ok(t, "ichor", "-n", ns, "upgrade", "talos", "--to", "v1.13.7", "--name", "named")
		if out != "talosoperation.ichor.maesh.dev/named created\n" {
			t.Errorf("stdout %q", out)
		}
	})
}

// TestCreateRefusesWhatTheControllerWould: a machine that is not a Node,
// and a kind the running controller (its leader Lease says which) does not
// carry out, are refused with the controller's words before anything is
// created, exit 1.
func TestCreateRefusesWhatTheControllerWould(t *testing.T) {
	ns, ctrl := env.Namespace(t), env.Namespace(t)
	lease := &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Namespace: ctrl, Name: ichorv1.LeaderLeaseName,
		Annotations: map[string]string{ichorv1.VersionAnnotation: "v0.3.0", ichorv1.KindsAnnotation: "talos,node"}}}
	if err := env.Client.Create(context.Background(), lease); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		args []string
		err  string
	}{
		{[]string{"node", "reboot", "no-such-node"},
			"error: ichor-controller would refuse this operation, so nothing was created:\n  MachinesInScope: machine no-such-node is not a Node of this cluster: check the name with `kubectl get nodes`\n"},
		{[]string{"node", "reboot", "no-such-node", "-l", "zone=a"},
			"error: ichor-controller would refuse this operation, so nothing was created:\n  MachinesInScope: machine no-such-node is not a Node that spec.machines selects: check the name (`kubectl get nodes`) or drop the selector\n"},
		{[]string{"rotate", "ca", "--yes"},
			"error: ichor-controller would refuse this operation, so nothing was created:\n  KindSupported: this ichor-controller does not carry out kind ca-rotation yet (it carries out talos, node)\n"},
		{[]string{"rotate", "keys", "--service-account", "--yes", "--dry-run=server"},
			"error: ichor-controller would refuse this operation, so nothing was created:\n  KindSupported: this ichor-controller does not carry out kind key-rotation yet (it carries out talos, node)\n"},
	}
	for _, tt := range tests {
		r := kubectl(t, "", append([]string{"ichor", "-n", ns, "--controller-namespace", ctrl}, tt.args...)...)
		if r.code != 1 || r.err != tt.err {
			t.Errorf("%v: exit %d, stderr\n%q\nwant exit 1 and\n%q", tt.args, r.code, r.err, tt.err)
		}
	}
	list := &ichorv1.TalosOperationList{}
	if err := env.Client.List(context.Background(), list, client.InNamespace(ns)); err != nil || len(list.Items) != 0 {
		t.Errorf("refused creates left %d operations (%v)", len(list.Items), err)
	}
}

// TestCreateRefusesBadInput checks that bad input gets a clear error, exit 1,
// and creates nothing.
func TestCreateRefusesBadInput(t *testing.T) {
	ns := env.Namespace(t)
	tests := []struct {
		args []string
		err  string
	}{
		{[]string{"upgrade", "talos", "--to", "1.13"}, "error: invalid --to \"v1.13\": want a version like v1.13.7 (the leading v is optional)\nSee 'kubectl ichor upgrade talos -h' for help and examples\n"},
		{[]string{"upgrade", "talos"}, "error: required flag(s) \"to\" not set\nSee 'kubectl ichor upgrade talos -h' for help and examples\n"},
		{[]string{"upgrade", "talos", "--to", "v1.13.7", "--max-unavailable", "0"}, "error: --max-unavailable must be at least 1, not 0\nSee 'kubectl ichor upgrade talos -h' for help and examples\n"},
		{[]string{"upgrade", "talos", "--to", "v1.13.7", "-l", "zone in (a"}, ""},
		{[]string{"shutdown"}, "error: this shuts down every machine of the cluster; confirm with --yes (-y), as there is no terminal to ask on\n"},
		{[]string{"rotate", "ca", "--talos"}, `re:^error: this replaces the cluster CAs \(Talos\): every client certificate issued by the old CAs stops working\. Afterwards, a talosconfig of the old Talos API CA is refused by every machine .*Secret ichor-talosconfig.*; confirm with --yes \(-y\), as there is no terminal to ask on\n$`},
		{[]string{"rotate", "keys", "--secretbox", "--no-restart", "-y"}, "error: --no-restart is about the workloads a service-account key rotation restarts: add --service-account, or drop --no-restart\nSee 'kubectl ichor rotate keys -h' for help and examples\n"},
		{[]string{"rotate", "keys", "--secretbox"}, `re:^error: this replaces the cluster's keys: Secret writes are refused for the seconds the API servers take to switch secretbox keys\. Afterwards, every Secret is now encrypted with the new secretbox key.*take a new snapshot now.*; confirm with --yes \(-y\), as there is no terminal to ask on\n$`},
		{[]string{"node", "reset", "worker-1"}, ""},
		{[]string{"node", "restart-service", "worker-1"}, "error: --service is required: name the service to restart, like kubelet\nSee 'kubectl ichor node restart-service -h' for help and examples\n"},
		{[]string{"restore", "etcd", "--from", "http://example/x", "-y"}, `re:^The TalosOperation "restore-etcd-\w+" is invalid: spec.etcdRestore.snapshot: Invalid value: "http://example/x": must be a file:// or s3:// URL\n$`},
		{[]string{"upgrade", "talos", "--to", "v1.13.7", "--watch", "--dry-run=server"}, "error: --watch and --wait follow a real operation: they cannot be used with --dry-run\nSee 'kubectl ichor upgrade talos -h' for help and examples\n"},
		{[]string{"config", "apply"}, "error: -f is required: give a machine-config patch file (YAML strategic merge or RFC 6902 JSON patch), or - for standard input\nSee 'kubectl ichor config apply -h' for help and examples\n"},
		{[]string{"config", "apply", "-f", "/nonexistent/patch.yaml"}, "error: read patch /nonexistent/patch.yaml: open /nonexistent/patch.yaml: no such file or directory\n"},
		{[]string{"config", "apply", "-f", "-", "--mode", "no-reboot"}, "error: invalid --mode \"no-reboot\": use auto (reboot only where needed) or reboot\nSee 'kubectl ichor config apply -h' for help and examples\n"},
	}
	for _, tt := range tests {
		r := kubectl(t, "", append([]string{"ichor", "-n", ns}, tt.args...)...)
		if r.code != 1 {
			t.Errorf("%v: exit %d, want 1 (stderr %q)", tt.args, r.code, r.err)
		}
		if re, isRE := strings.CutPrefix(tt.err, "re:"); isRE {
			if !regexp.MustCompile(re).MatchString(r.err) {
				t.Errorf("%v: stderr\n%q\ndoes not match\n%s", tt.args, r.err, re)
			}
		} else if tt.err != "" && r.err != tt.err {
			t.Errorf("%v: stderr\n%q\nwant\n%q", tt.args, r.err, tt.err)
		}
		if tt.err == "" && !strings.HasPrefix(r.err, "error: ") {
			t.Errorf("%v: stderr %q is not a kubectl-style error", tt.args, r.err)
		}
	}
	out := ok(t, "ichor", "-n", ns, "upgrade", "talos", "--to", "v1.13.7", "--dry-run=server")
	if !regexp.MustCompile(`^talosoperation\.ichor\.maesh\.dev/upgrade-talos-\w+ created \(server dry run\)\n$`).MatchString(out) {
		t.Errorf("server dry run printed %q", out)
	}
	dry := ok(t, "ichor", "-n", ns, "upgrade", "talos", "--to", "1.13.7", "--dry-run=client")
	if !regexp.MustCompile(`(?m)^  name: upgrade-talos-[a-z0-9]{5}$`).MatchString(dry) || !strings.Contains(dry, "version: v1.13.7") || strings.Contains(dry, "status:") {
		t.Errorf("client dry run printed\n%s", dry)
	}
	list := &ichorv1.TalosOperationList{}
	if err := env.Client.List(context.Background(), list, client.InNamespace(ns)); err != nil {
		t.Fatal(err)
	}
	if len(list.Items) != 0 {
		t.Errorf("bad input and dry runs created %d operations", len(list.Items))
	}

	// What a client dry run prints, kubectl applies as it is.
	file := filepath.Join(t.TempDir(), "op.yaml")
	if err := os.WriteFile(file, []byte(dry), 0o600); err != nil {
		t.Fatal(err)
	}
	name := regexp.MustCompile(`(?m)^  name: (\S+)$`).FindStringSubmatch(dry)[1]
	if out := ok(t, "apply", "-f", file); out != "talosoperation.ichor.maesh.dev/"+name+" created\n" {
		t.Errorf("kubectl apply of the client dry run printed %q", out)
	}
	if got := getOp(t, ns, name); got.Spec.Talos == nil || got.Spec.Talos.Version != "v1.13.7" {
		t.Errorf("applied operation: %+v", got.Spec)
	}
}

// ages are kubectl's AGE cells (5s, 3m20s, 2d4h): they tick between the
// two commands, and a wider one shifts the columns after it.
var ages = regexp.MustCompile(`(^|\s)\d+[smhdy](\d+[smh])?(\s|$)`)

// maskAge replaces the AGE cells and folds the padding, so tables printed a
// second apart compare equal.
func maskAge(table string) string {
	var lines []string
	for _, l := range strings.Split(strings.TrimRight(table, "\n"), "\n") {
		l = ages.ReplaceAllString(l, "${1}AGE${3}")
		lines = append(lines, strings.Join(strings.Fields(l), " "))
	}
	return strings.Join(lines, "\n")
}

// TestGetEqualsKubectlGet checks that the plugin's tables and objects are
// kubectl's own.
func TestGetEqualsKubectlGet(t *testing.T) {
	ns := env.Namespace(t)
	a := createOp(t, ns, "upgrade-a")
	setStatus(t, a, ichorv1.TalosOperationStatus{Phase: ichorv1.PhaseRunning, Progress: "3/7", Current: "cp-2", Target: "talos v1.13.7", Lock: ichorv1.LockHeld})
	b := createOp(t, ns, "upgrade-b")
	setStatus(t, b, ichorv1.TalosOperationStatus{Phase: ichorv1.PhasePaused, Reason: ichorv1.ReasonClusterLockHeld, Lock: ichorv1.LockWaiting, LockHolder: ichorv1.OperationIdentity(ns, "upgrade-a")})
	c := createOp(t, ns, "upgrade-c")
	failed := failedStatus()
	failed.FailureReason = "InstallFailed"
	setStatus(t, c, failed)
	// A failed step: Paused, StepFailed, and the failure's reason in its own column.
	if out := ok(t, "get", "talosop", "upgrade-c", "-n", ns); !regexp.MustCompile(`REASON\s+FAILURE\s+AGE\nupgrade-c\s+talos\s+Paused\s+0/1\s+StepFailed\s+InstallFailed\s`).MatchString(out) {
		t.Errorf("kubectl get of a failed operation:\n%s", out)
	}

	tests := []struct {
		plugin, kubectl []string
		mask            bool
	}{
		{[]string{"ichor", "operation", "list"}, []string{"get", "talosop"}, true},
		{[]string{"ichor", "operation", "get"}, []string{"get", "talosop"}, true},
		{[]string{"ichor", "op", "get", "upgrade-a"}, []string{"get", "talosop", "upgrade-a"}, true},
		{[]string{"ichor", "operation", "list", "-o", "wide"}, []string{"get", "talosop", "-o", "wide"}, true},
		{[]string{"ichor", "operation", "get", "talosoperation/upgrade-b", "-o", "yaml"}, []string{"get", "talosop", "upgrade-b", "-o", "yaml"}, false},
		{[]string{"ichor", "operation", "list", "-o", "name"}, []string{"get", "talosop", "-o", "name"}, false},
		{[]string{"ichor", "operation", "list", "-o", "jsonpath={.items[*].status.phase}"}, []string{"get", "talosop", "-o", "jsonpath={.items[*].status.phase}"}, false},
	}
	for _, tt := range tests {
		got := ok(t, append(tt.plugin, "-n", ns)...)
		want := ok(t, append(tt.kubectl, "-n", ns)...)
		if tt.mask {
			got, want = maskAge(got), maskAge(want)
		}
		if got != want {
			t.Errorf("kubectl %s printed\n%s\nkubectl %s printed\n%s", strings.Join(tt.plugin, " "), got, strings.Join(tt.kubectl, " "), want)
		}
	}
	// Nothing there: the same words on stderr.
	empty := env.Namespace(t)
	got, want := kubectl(t, "", "ichor", "operation", "list", "-n", empty), kubectl(t, "", "get", "talosop", "-n", empty)
	if got.err != want.err || got.out != want.out || got.code != want.code {
		t.Errorf("empty namespace: plugin %+v, kubectl %+v", got, want)
	}
	got, want = kubectl(t, "", "ichor", "operation", "get", "missing", "-n", ns), kubectl(t, "", "get", "talosop", "missing", "-n", ns)
	if got.err != want.err || got.code != want.code {
		t.Errorf("missing operation: plugin %+v, kubectl %+v", got, want)
	}
}

// TestRetryEqualsAnnotate checks that `kubectl ichor retry` leaves the same
// object as `kubectl annotate ... ichor.maesh.dev/retry=true`.
func TestRetryEqualsAnnotate(t *testing.T) {
	ns := env.Namespace(t)
	for _, name := range []string{"by-plugin", "by-annotate"} {
		setStatus(t, createOp(t, ns, name), failedStatus())
	}
	if out := ok(t, "ichor", "retry", "by-plugin", "-n", ns); out != "talosoperation.ichor.maesh.dev/by-plugin retry requested\n" {
		t.Errorf("retry printed %q", out)
	}
	ok(t, "annotate", "talosoperation", "by-annotate", ichorv1.RetryAnnotation+"=true", "-n", ns)
	p, a := getOp(t, ns, "by-plugin"), getOp(t, ns, "by-annotate")
	same := func(what string, x, y any) {
		if !reflect.DeepEqual(x, y) {
			t.Errorf("%s differs: retry left %+v, annotate left %+v", what, x, y)
		}
	}
	same("annotations", p.Annotations, a.Annotations)
	same("labels", p.Labels, a.Labels)
	same("spec", p.Spec, a.Spec)
	same("status", p.Status, a.Status)
	same("generation", p.Generation, a.Generation)
	if !p.RetryPending() {
		t.Errorf("retry left no pending retry: %v", p.Annotations)
	}
	// Again, before the controller has acted: it says so and changes nothing.
	rv := p.ResourceVersion
	if out := ok(t, "ichor", "retry", "by-plugin", "-n", ns); out != "talosoperation.ichor.maesh.dev/by-plugin retry already requested (pending)\n" {
		t.Errorf("second retry printed %q", out)
	}
	if getOp(t, ns, "by-plugin").ResourceVersion != rv {
		t.Error("second retry changed the object")
	}
}

// TestPauseResumeAgainstTheAPIServer pauses and resumes through kubectl and
// checks the objects, and that idempotent calls say so.
func TestPauseResumeAgainstTheAPIServer(t *testing.T) {
	ns := env.Namespace(t)
	op := createOp(t, ns, "op")
	setStatus(t, op, ichorv1.TalosOperationStatus{Phase: ichorv1.PhaseRunning})
	steps := []struct {
		args []string
		out  string
		test func(*ichorv1.TalosOperation) bool
	}{
		{[]string{"operation", "pause", "op"}, "talosoperation.ichor.maesh.dev/op paused\n", func(o *ichorv1.TalosOperation) bool { return o.Spec.Paused }},
		{[]string{"operation", "pause", "op"}, "talosoperation.ichor.maesh.dev/op already paused\n", func(o *ichorv1.TalosOperation) bool { return o.Spec.Paused }},
		{[]string{"operation", "resume", "op"}, "talosoperation.ichor.maesh.dev/op resumed\n", func(o *ichorv1.TalosOperation) bool { return !o.Spec.Paused }},
		{[]string{"operation", "resume", "op"}, "talosoperation.ichor.maesh.dev/op already resumed\n", func(o *ichorv1.TalosOperation) bool { return !o.Spec.Paused }},
	}
	for _, s := range steps {
		if out := ok(t, append([]string{"ichor", "-n", ns}, s.args...)...); out != s.out {
			t.Errorf("%v printed %q, want %q", s.args, out, s.out)
		}
		if got := getOp(t, ns, "op"); !s.test(got) {
			t.Errorf("after %v: spec.paused=%v", s.args, got.Spec.Paused)
		}
	}
	managers := map[string]bool{}
	for _, m := range getOp(t, ns, "op").ManagedFields {
		managers[m.Manager] = true
	}
	if !managers["kubectl-ichor"] {
		t.Errorf("field manager kubectl-ichor missing: %v", managers)
	}
}

// TestRBACDenied binds a user to a Role that may read operations but not
// create or patch them: the plugin prints the server's refusal as kubectl
// does, exits 1, and nothing changes.
func TestRBACDenied(t *testing.T) {
	ctx := context.Background()
	ns := env.Namespace(t)
	role := &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "talosop-viewer"},
		Rules: []rbacv1.PolicyRule{{APIGroups: []string{"ichor.maesh.dev"}, Resources: []string{"talosoperations"}, Verbs: []string{"get", "list", "watch"}}}}
	binding := &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "viewer"},
		RoleRef:  rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "Role", Name: role.Name},
		Subjects: []rbacv1.Subject{{Kind: "User", APIGroup: "rbac.authorization.k8s.io", Name: "viewer"}}}
	for _, o := range []client.Object{role, binding} {
		if err := env.Client.Create(ctx, o); err != nil {
			t.Fatal(err)
		}
	}
	setStatus(t, createOp(t, ns, "failed"), failedStatus())
	viewer, err := env.UserKubeconfig("viewer")
	if err != nil {
		t.Fatal(err)
	}
	// The viewer may read: the denial below is RBAC's, not a broken kubeconfig.
	if r := kubectl(t, viewer, "ichor", "operation", "list", "-n", ns); r.code != 0 {
		t.Fatalf("viewer cannot list: %s", r.err)
	}
	tests := []struct {
		plugin  []string
		kubectl []string // the same request through kubectl itself, or nil
		err     string
	}{
		{[]string{"upgrade", "talos", "--to", "v1.13.7"}, nil,
			`Error from server (Forbidden): talosoperations.ichor.maesh.dev is forbidden: User "viewer" cannot create resource "talosoperations" in API group "ichor.maesh.dev" in the namespace "` + ns + `"` + "\n"},
		{[]string{"retry", "failed"}, []string{"annotate", "talosoperation", "failed", ichorv1.RetryAnnotation + "=true"},
			`Error from server (Forbidden): talosoperations.ichor.maesh.dev "failed" is forbidden: User "viewer" cannot patch resource "talosoperations" in API group "ichor.maesh.dev" in the namespace "` + ns + `"` + "\n"},
		{[]string{"operation", "pause", "failed"}, []string{"patch", "talosoperation", "failed", "--type=merge", "-p", `{"spec":{"paused":true}}`},
			`Error from server (Forbidden): talosoperations.ichor.maesh.dev "failed" is forbidden: User "viewer" cannot patch resource "talosoperations" in API group "ichor.maesh.dev" in the namespace "` + ns + `"` + "\n"},
		{[]string{"operation", "delete", "failed"}, []string{"delete", "talosoperation", "failed"},
			`Error from server (Forbidden): talosoperations.ichor.maesh.dev "failed" is forbidden: User "viewer" cannot delete resource "talosoperations" in API group "ichor.maesh.dev" in the namespace "` + ns + `"` + "\n"},
	}
	for _, tt := range tests {
		r := kubectl(t, viewer, append([]string{"ichor", "-n", ns}, tt.plugin...)...)
		if r.code != 1 || r.err != tt.err {
			t.Errorf("%v: exit %d, stderr\n%q\nwant exit 1 and\n%q", tt.plugin, r.code, r.err, tt.err)
		}
		if tt.kubectl != nil {
			k := kubectl(t, viewer, append(tt.kubectl, "-n", ns)...)
			if k.err != r.err {
				t.Errorf("%v: kubectl %v prints\n%q\nthe plugin\n%q", tt.plugin, tt.kubectl, k.err, r.err)
			}
		}
	}
	if got := getOp(t, ns, "failed"); got.RetryPending() || got.Spec.Paused || got.DeletionTimestamp != nil {
		t.Errorf("denied requests changed the operation: %+v", got.ObjectMeta)
	}
}

// TestRenamedBinary installs the plugin as `ichor`: help and messages use
// that name.
func TestRenamedBinary(t *testing.T) {
	dir := t.TempDir()
	data, err := os.ReadFile(filepath.Join(binDir, "kubectl-ichor"))
	if err != nil {
		t.Fatal(err)
	}
	ichor := filepath.Join(dir, "ichor")
	if err := os.WriteFile(ichor, data, 0o755); err != nil {
		t.Fatal(err)
	}
	run := func(args ...string) (string, string, int) {
		cmd := exec.Command(ichor, args...)
		cmd.Env = append(os.Environ(), "KUBECONFIG="+env.Kubeconfig)
		var out, errOut strings.Builder
		cmd.Stdout, cmd.Stderr = &out, &errOut
		err := cmd.Run()
		code := 0
		if exit, ok := err.(*exec.ExitError); ok {
			code = exit.ExitCode()
		}
		return out.String(), errOut.String(), code
	}
	help, _, _ := run("--help")
	for _, want := range []string{"ichor starts, watches and steers", `Use "ichor <command> --help"`, `Use "ichor options"`} {
		if !strings.Contains(help, want) {
			t.Errorf("ichor --help lacks %q:\n%s", want, help)
		}
	}
	if strings.Contains(help, "kubectl ichor") || strings.Contains(help, "kubectl-ichor") {
		t.Errorf("ichor --help speaks of kubectl ichor:\n%s", help)
	}
	sub, _, _ := run("upgrade", "talos", "--help")
	if !strings.Contains(sub, "  ichor upgrade talos --to VERSION [options]") || !strings.Contains(sub, "  ichor upgrade talos --to v1.13.7 --watch") {
		t.Errorf("ichor upgrade talos --help:\n%s", sub)
	}
	_, stderr, code := run("upgrade", "talos")
	if code != 1 || stderr != "error: required flag(s) \"to\" not set\nSee 'ichor upgrade talos -h' for help and examples\n" {
		t.Errorf("ichor upgrade talos: exit %d, stderr %q", code, stderr)
	}
	ns := env.Namespace(t)
	setStatus(t, createOp(t, ns, "failed"), failedStatus())
	_, stderr, code = run("watch", "failed", "-n", ns)
	if code != 2 || !strings.Contains(stderr, "fix the cause, then run: ichor retry failed") {
		t.Errorf("ichor watch of a failed operation: exit %d, stderr %q", code, stderr)
	}
	// And through kubectl the same binary says kubectl ichor.
	if out := ok(t, "ichor", "--help"); !strings.Contains(out, `Use "kubectl ichor <command> --help"`) {
		t.Errorf("kubectl ichor --help:\n%s", out)
	}
}

// TestWatchFollowsToTheEnd plays the controller: it moves an operation
// through its phases while `kubectl ichor watch` (not on a terminal, so the
// change log) follows it, and checks the log and the exit codes.
func TestWatchFollowsToTheEnd(t *testing.T) {
	ns := env.Namespace(t)

	t.Run("failed step exits 2 with the machine's message", func(t *testing.T) {
		op := createOp(t, ns, "fails")
		p := start(t, "ichor", "watch", "fails", "-n", ns, "--timeout", "1m")
		p.waitOutput(t, "fails phase=Pending")
		setStatus(t, op, ichorv1.TalosOperationStatus{Phase: ichorv1.PhaseRunning, Lock: ichorv1.LockHeld, Progress: "0/1",
			Machines: []ichorv1.MachineStatus{{Name: "cp-1", Role: ichorv1.RoleControlPlane, Phase: ichorv1.MachineInProgress, Step: "upgrade", Message: "installing v1.13.7"}}})
		p.waitOutput(t, `machine=cp-1 InProgress step=upgrade "installing v1.13.7"`)
		setStatus(t, op, failedStatus())
		if code := p.wait(t); code != 2 {
			t.Errorf("exit %d, want 2; stderr %q", code, p.stderr())
		}
		out := p.stdout()
		for _, want := range []string{"fails phase=Running progress=0/1 lock=Held", `machine=cp-1 InProgress->Failed step=upgrade "installer image pull: i/o timeout"`} {
			if !strings.Contains(out, want) {
				t.Errorf("log lacks %q:\n%s", want, out)
			}
		}
		wantErr := "error: talosoperation.ichor.maesh.dev/fails is paused by a failed step (StepFailed): upgrade of cp-1 failed (machine cp-1, step upgrade: installer image pull: i/o timeout); fix the cause, then run: kubectl ichor retry fails\n"
		if p.stderr() != wantErr {
			t.Errorf("stderr %q, want %q", p.stderr(), wantErr)
		}
	})

	t.Run("success exits 0", func(t *testing.T) {
		op := createOp(t, ns, "works")
		p := start(t, "ichor", "watch", "--latest", "-n", ns)
		p.waitOutput(t, "works phase=Pending")
		start, done := metav1.NewTime(time.Now().Add(-90*time.Second)), metav1.Now()
		setStatus(t, op, ichorv1.TalosOperationStatus{Phase: ichorv1.PhaseSucceeded, Progress: "1/1", StartTime: &start, CompletionTime: &done})
		if code := p.wait(t); code != 0 {
			t.Errorf("exit %d, want 0; stderr %q", code, p.stderr())
		}
		if !strings.Contains(p.stdout(), "talosoperation.ichor.maesh.dev/works succeeded in 90s\n") {
			t.Errorf("no summary line:\n%s", p.stdout())
		}
	})

	t.Run("resume --wait ignores the failure its retry clears", func(t *testing.T) {
		op := createOp(t, ns, "retried")
		setStatus(t, op, failedStatus())
		p := start(t, "ichor", "operation", "resume", "retried", "-n", ns, "--wait", "--timeout", "1m")
		testenv.Eventually(t, 30*time.Second, "the retry annotation", func(ctx context.Context) (bool, error) {
			return getOp(t, ns, "retried").RetryPending(), nil
		})
		// The controller acts on the retry: the annotation goes first (the
		// failure is still in status), then the retried step succeeds.
		cur := getOp(t, ns, "retried")
		delete(cur.Annotations, ichorv1.RetryAnnotation)
		if err := env.Client.Update(context.Background(), cur); err != nil {
			t.Fatal(err)
		}
		setStatus(t, cur, ichorv1.TalosOperationStatus{Phase: ichorv1.PhaseSucceeded, Progress: "1/1", RetryCount: 1})
		if code := p.wait(t); code != 0 {
			t.Errorf("exit %d, want 0; stdout %q stderr %q", code, p.stdout(), p.stderr())
		}
	})

	t.Run("refused exits 2", func(t *testing.T) {
		op := createOp(t, ns, "refused")
		setStatus(t, op, ichorv1.TalosOperationStatus{Phase: ichorv1.PhaseRefused, Message: "preflight refused",
			Conditions: []metav1.Condition{{Type: "TalosUpgradePath", Status: metav1.ConditionFalse, Reason: "MinorSkipped", Message: "upgrade to v1.12.7 first", LastTransitionTime: metav1.Now()}}})
		r := kubectl(t, "", "ichor", "watch", "refused", "-n", ns)
		if r.code != 2 || !strings.Contains(r.err, "was refused by preflight, nothing ran:\n  TalosUpgradePath: upgrade to v1.12.7 first\nfix what the failed checks say, then create a new operation; "+ichorv1.OverrideHint+"\n") {
			t.Errorf("exit %d, stderr %q", r.code, r.err)
		}
	})

	t.Run("timeout exits 3", func(t *testing.T) {
		createOp(t, ns, "slow")
		r := kubectl(t, "", "ichor", "watch", "slow", "-n", ns, "--timeout", "1s")
		if r.code != 3 || !strings.HasPrefix(r.err, "error: timed out after 1s waiting for talosoperation.ichor.maesh.dev/slow") {
			t.Errorf("exit %d, stderr %q", r.code, r.err)
		}
	})

	t.Run("-o json streams watch events", func(t *testing.T) {
		op := createOp(t, ns, "streamed")
		p := start(t, "ichor", "watch", "streamed", "-n", ns, "-o", "json")
		p.waitOutput(t, `"type":"ADDED"`)
		setStatus(t, op, ichorv1.TalosOperationStatus{Phase: ichorv1.PhaseSucceeded})
		if code := p.wait(t); code != 0 {
			t.Fatalf("exit %d: %s", code, p.stderr())
		}
		var phases []string
		for _, l := range strings.Split(strings.TrimSpace(p.stdout()), "\n") {
			var ev struct {
				Type   string
				Object ichorv1.TalosOperation
			}
			if err := json.Unmarshal([]byte(l), &ev); err != nil {
				t.Fatalf("line %q: %v", l, err)
			}
			if ev.Object.Kind != "TalosOperation" || ev.Object.ManagedFields != nil {
				t.Errorf("event object kind %q, managedFields %v", ev.Object.Kind, ev.Object.ManagedFields)
			}
			phases = append(phases, ev.Type+":"+string(ev.Object.Status.Phase))
		}
		if want := []string{"ADDED:", "MODIFIED:Succeeded"}; !reflect.DeepEqual(phases, want) {
			t.Errorf("events %v, want %v", phases, want)
		}
	})

	t.Run("deleted exits 1", func(t *testing.T) {
		op := createOp(t, ns, "deleted")
		p := start(t, "ichor", "watch", "deleted", "-n", ns)
		p.waitOutput(t, "deleted phase=Pending")
		ok(t, "ichor", "operation", "delete", "deleted", "-n", ns, "--wait")
		if code := p.wait(t); code != 1 || !strings.Contains(p.stderr(), "talosoperation.ichor.maesh.dev/deleted was deleted") {
			t.Errorf("exit %d, stderr %q", code, p.stderr())
		}
		if err := env.Client.Get(context.Background(), client.ObjectKeyFromObject(op), &ichorv1.TalosOperation{}); !apierrors.IsNotFound(err) {
			t.Errorf("operation still there: %v", err)
		}
	})
}

// TestLockAndDescribe shows the cluster lock and an operation in detail.
func TestLockAndDescribe(t *testing.T) {
	ctx := context.Background()
	ctrl := env.Namespace(t)
	ns := env.Namespace(t)
	holder := createOp(t, ns, "holder")
	setStatus(t, holder, ichorv1.TalosOperationStatus{Phase: ichorv1.PhaseRunning, Lock: ichorv1.LockHeld, Progress: "2/5",
		Machines: []ichorv1.MachineStatus{{Name: "cp-1", Role: ichorv1.RoleControlPlane, Phase: ichorv1.MachineSucceeded}, {Name: "cp-2", Role: ichorv1.RoleControlPlane, Phase: ichorv1.MachineInProgress, Step: "reboot", Message: "waiting for \x1b[2Jboot"}}})
	for _, name := range []string{"second", "third"} {
		setStatus(t, createOp(t, ns, name), ichorv1.TalosOperationStatus{Phase: ichorv1.PhasePaused, Reason: ichorv1.ReasonClusterLockHeld,
			Lock: ichorv1.LockWaiting, LockHolder: ichorv1.OperationIdentity(ns, "holder")})
	}
	acquired := metav1.NewMicroTime(time.Now().Add(-3 * time.Minute))
	removal := `[{"node":"cp-9","uid":"u9","since":"` + acquired.UTC().Format(time.RFC3339) + `","etcd":"etcd still lists member cp-9"}]`
	lease := &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Namespace: ctrl, Name: ichorv1.LockLeaseName,
		Annotations: map[string]string{ichorv1.LockRemovalsAnnotation: removal}},
		Spec: coordinationv1.LeaseSpec{HolderIdentity: ptr.To(ichorv1.OperationIdentity(ns, "holder")), AcquireTime: &acquired}}
	if err := env.Client.Create(ctx, lease); err != nil {
		t.Fatal(err)
	}
	out := ok(t, "ichor", "lock", "--controller-namespace", ctrl)
	for _, want := range []string{
		"Lease:    " + ctrl + "/ichor-cluster-lock",
		"Holder:   ichor-controller/op/" + ns + "/holder (Running, 2/5)",
		"Removal:  cp-9, gone from Kubernetes 3m",
		", not yet from etcd: etcd still lists member cp-9",
		", in the order they get it",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("lock output lacks %q:\n%s", want, out)
		}
	}
	// Since reads 3m ago, or 3m1s (and more on a busy machine): the
	// plugin runs a moment after the Lease is written.
	if since := regexp.MustCompile(`Since: .*\(3m(\d+s)? ago\)`); !since.MatchString(out) {
		t.Errorf("lock output's Since is not about 3m ago:\n%s", out)
	}
	// Waiters come from every namespace (other tests' too), oldest first.
	second, third := strings.Index(out, ns+"/second (talos"), strings.Index(out, ns+"/third (talos")
	if second < 0 || third < second {
		t.Errorf("lock output does not list second, then third:\n%s", out)
	}
	free := ok(t, "ichor", "lock", "--controller-namespace", env.Namespace(t), "-o", "json")
	var info struct {
		Holder  string
		Waiting []struct{ Name string }
	}
	if err := json.Unmarshal([]byte(free), &info); err != nil || info.Holder != "" || len(info.Waiting) < 2 {
		t.Errorf("lock -o json of a free lock: %s (%v)", free, err)
	}

	ev := &corev1.Event{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "holder.1"},
		InvolvedObject: corev1.ObjectReference{APIVersion: ichorv1.GroupVersion.String(), Kind: "TalosOperation", Namespace: ns, Name: "holder", UID: holder.UID},
		Type:           corev1.EventTypeNormal, Reason: "MachineUpgraded", Message: "cp-1 runs v1.13.7", Source: corev1.EventSource{Component: "ichor-controller"},
		LastTimestamp: metav1.Now(), FirstTimestamp: metav1.Now(), Count: 1}
	if err := env.Client.Create(ctx, ev); err != nil {
		t.Fatal(err)
	}
	out = ok(t, "ichor", "operation", "describe", "holder", "-n", ns, "--controller-namespace", ctrl)
	for _, want := range []string{
		"Name:        holder", "Phase:       Running", "Progress:    2/5", "Lock:        Held",
		"Spec:\n  kind: talos", "version: v1.13.7",
		"Machines:\n  NAME  ROLE          PHASE       STEP    ATTEMPTS",
		"cp-2  controlplane  InProgress  reboot  0",
		"waiting for ^[[2Jboot",
		"Cluster lock:\n  Holder:   ichor-controller/op/" + ns + "/holder",
		"Events:\n  TYPE    REASON           AGE",
		"Normal  MachineUpgraded", "ichor-controller  cp-1 runs v1.13.7",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("describe lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "\x1b") {
		t.Error("describe passed an escape character from the server to the terminal")
	}
}

// TestKubectlCompletesThePlugin installs the completion helper that kubectl
// (1.26+) runs for plugins and completes through kubectl itself.
func TestKubectlCompletesThePlugin(t *testing.T) {
	ns := env.Namespace(t)
	setStatus(t, createOp(t, ns, "failed-op"), failedStatus())
	setStatus(t, createOp(t, ns, "running-op"), ichorv1.TalosOperationStatus{Phase: ichorv1.PhaseRunning})
	script := ok(t, "ichor", "completion", "kubectl")
	if err := os.WriteFile(filepath.Join(binDir, "kubectl_complete-ichor"), []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	out := ok(t, "__complete", "ichor", "retry", "-n", ns, "")
	if got := strings.Split(out, "\n")[0]; got != "failed-op" || strings.Contains(out, "running-op") {
		t.Errorf("kubectl completes retry with\n%s", out)
	}
	out = ok(t, "__complete", "ichor", "operation", "pause", "-n", ns, "")
	if !strings.Contains(out, "running-op") {
		t.Errorf("kubectl completes pause with\n%s", out)
	}
	// --to offers the versions of the compatibility table, newest first.
	table, err := compat.Default()
	if err != nil {
		t.Fatal(err)
	}
	out = ok(t, "__complete", "ichor", "upgrade", "talos", "--to", "")
	if want := table.Newest().Latest.String() + "\n"; !strings.HasPrefix(out, want) || !strings.Contains(out, table.Oldest().Latest.String()+"\n") {
		t.Errorf("kubectl completes --to with\n%s\nwant %s first", out, want)
	}
	out = ok(t, "__complete", "ichor", "upgrade", "kubernetes", "--to", "v1.3")
	if !regexp.MustCompile(`^v1\.3\d\.\n`).MatchString(out) {
		t.Errorf("kubectl completes kubernetes --to with\n%s", out)
	}
}

// TestHelp: a command's help lists its own flags, the global ones are
// behind 'options' (as kubectl's are), and a subcommand that does not exist
// is called unknown, with a suggestion.
func TestHelp(t *testing.T) {
	sub := ok(t, "ichor", "upgrade", "talos", "--help")
	for _, want := range []string{"--to='':", "--max-unavailable=0:", `Use "kubectl ichor options" for a list of global command-line options`} {
		if !strings.Contains(sub, want) {
			t.Errorf("upgrade talos --help lacks %q:\n%s", want, sub)
		}
	}
	for _, global := range []string{"--kubeconfig", "--as-group", "--controller-namespace", "--color"} {
		if strings.Contains(sub, global) {
			t.Errorf("upgrade talos --help lists the global flag %s:\n%s", global, sub)
		}
	}
	opts := ok(t, "ichor", "options")
	for _, want := range []string{"The following options can be passed to any command:", "--kubeconfig=''", "-n, --namespace=''", "--controller-namespace='ichor-system'", "--color=auto"} {
		if !strings.Contains(opts, want) {
			t.Errorf("options lacks %q:\n%s", want, opts)
		}
	}
	tests := []struct {
		args []string
		err  string
	}{
		{[]string{"upgrade", "talso", "--to", "1.13.7"}, "error: unknown command \"talso\" for \"kubectl ichor upgrade\"; did you mean talos?\nSee 'kubectl ichor upgrade -h' for help and examples\n"},
		{[]string{"operation", "lsit"}, "error: unknown command \"lsit\" for \"kubectl ichor operation\"; did you mean list?\nSee 'kubectl ichor operation -h' for help and examples\n"},
		{[]string{"node", "frobnicate", "w-1"}, "error: unknown command \"frobnicate\" for \"kubectl ichor node\"\nSee 'kubectl ichor node -h' for help and examples\n"},
	}
	for _, tt := range tests {
		r := kubectl(t, "", append([]string{"ichor"}, tt.args...)...)
		if r.code != 1 || r.err != tt.err {
			t.Errorf("%v: exit %d, stderr\n%q\nwant exit 1 and\n%q", tt.args, r.code, r.err, tt.err)
		}
	}
	// Without a subcommand, a group prints its help.
	if out := ok(t, "ichor", "upgrade"); !strings.Contains(out, "Available Commands:\n") || !strings.Contains(out, "  talos ") {
		t.Errorf("upgrade without a subcommand printed\n%s", out)
	}
}

// TestCompat prints the compatibility table the plugin embeds and checks
// combinations against it.
func TestCompat(t *testing.T) {
	want, err := compat.Default()
	if err != nil {
		t.Fatal(err)
	}
	var got compat.Table
	if err := json.Unmarshal([]byte(ok(t, "ichor", "compat", "-o", "json")), &got); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(&got, want) {
		t.Errorf("compat -o json = %+v, want the embedded table %+v", got, want)
	}
	table := ok(t, "ichor", "compat")
	if lines := strings.Count(table, "\n"); lines != len(want.Combinations)+1 {
		t.Errorf("compat printed %d lines for %d combinations:\n%s", lines, len(want.Combinations), table)
	}
	newest := want.Newest()
	if out := ok(t, "ichor", "compat", "--talos", newest.Latest.String()); !strings.Contains(out, newest.Minor.String()+"   "+newest.Latest.String()) ||
		strings.Contains(out, want.Oldest().Latest.String()) {
		t.Errorf("compat --talos %s:\n%s", newest.Latest, out)
	}
	r := kubectl(t, "", "ichor", "compat", "--talos", newest.Latest.String(), "--kubernetes", "v1.20.0")
	if r.code != 1 || !strings.HasPrefix(r.err, "error: Kubernetes v1.20.0 with Talos "+newest.Latest.String()+" is not in Ichor's compatibility table") {
		t.Errorf("unsupported combination: exit %d, stderr %q", r.code, r.err)
	}
}

// TestWatchOnATerminal follows operations on a real terminal: the live view
// says that a failed machine was left cordoned, gives the cause in full and
// lists the operations queued for the lock; Ctrl-C stops following, says
// the operation keeps running and exits 130.
func TestWatchOnATerminal(t *testing.T) {
	ctx := context.Background()
	ns, other := env.Namespace(t), env.Namespace(t)
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "cp-cordoned"}, Spec: corev1.NodeSpec{Unschedulable: true}}
	if err := env.Client.Create(ctx, node); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = env.Client.Delete(ctx, node) })
	failed := failedStatus()
	failed.Machines[0].Name = node.Name
	failed.Machines[0].Message = "pull factory.talos.dev/metal-installer/376567988ad370138ad8b2698212367b8edcb69b5fd68c80be1f2ec7d603b4ba:v1.13.70: " +
		"rpc error: code = NotFound desc = failed to pull image: failed to resolve reference: factory.talos.dev/metal-installer/376567988ad370138ad8b2698212367b8edcb69b5fd68c80be1f2ec7d603b4ba:v1.13.70: not found"
	setStatus(t, createOp(t, ns, "held-up"), failed)
	setStatus(t, createOp(t, other, "next-in-line"), ichorv1.TalosOperationStatus{Phase: ichorv1.PhasePaused, Reason: ichorv1.ReasonClusterLockHeld,
		Lock: ichorv1.LockWaiting, LockHolder: ichorv1.OperationIdentity(ns, "held-up")})

	p := startTerminal(t, "ichor", "watch", "held-up", "-n", ns)
	if code := p.wait(t); code != 2 {
		t.Fatalf("watch of a failed operation on a terminal: exit %d, want 2:\n%s", code, p.stdout())
	}
	out := p.stdout()
	for _, want := range []string{
		node.Name + " at step upgrade; " + node.Name + " was left cordoned",
		"Cause:   pull factory.talos.dev/metal-installer/37656798…:v1.13.70: rpc error: code = NotFound",
		"metal-installer/37656798…:v1.13.70: not found",
		"Queue:   ",
		other + "/next-in-line (talos)",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("the live view lacks %q:\n%s", want, out)
		}
	}

	running := createOp(t, ns, "long-one")
	setStatus(t, running, ichorv1.TalosOperationStatus{Phase: ichorv1.PhaseRunning, Lock: ichorv1.LockHeld, Progress: "0/1",
		Machines: []ichorv1.MachineStatus{{Name: "w-1", Role: ichorv1.RoleWorker, Phase: ichorv1.MachineInProgress, Step: "drain", From: "v1.12.4", To: "v1.13.7"}}})
	p = startTerminal(t, "ichor", "watch", "long-one", "-n", ns)
	p.waitOutput(t, "v1.12.4 → v1.13.7  InProgress")
	p.typeKeys(t, "\x03") // Ctrl-C
	if code := p.wait(t); code != 130 {
		t.Errorf("Ctrl-C: exit %d, want 130:\n%s", code, p.stdout())
	}
	if want := "stopped following talosoperation.ichor.maesh.dev/long-one; the operation keeps running (Running, 0/1)"; !strings.Contains(p.stdout(), want) || strings.Contains(p.stdout(), "error:") {
		t.Errorf("Ctrl-C printed\n%s\nwant %q and no error", p.stdout(), want)
	}
	if got := getOp(t, ns, "long-one"); got.DeletionTimestamp != nil || got.Spec.Paused {
		t.Errorf("stopping the watch touched the operation: %+v", got.ObjectMeta)
	}
}

// TestDescribeSaysWhatToDoAfterwards: describe of a Talos CA rotation that
// has not succeeded yet says what the operator must do once it has (take
// the new talosconfig); a reboot says nothing of the kind.
func TestDescribeSaysWhatToDoAfterwards(t *testing.T) {
	ns := env.Namespace(t)
	ok(t, "ichor", "-n", ns, "rotate", "ca", "--talos", "-y", "--name", "rot")
	out := ok(t, "ichor", "-n", ns, "operation", "describe", "rot")
	if !strings.Contains(out, "Afterwards:  a talosconfig of the old Talos API CA is refused by every machine since the old CA was dropped: take the new one from Secret ichor-talosconfig") {
		t.Errorf("describe of a Talos CA rotation does not say what to do afterwards:\n%s", out)
	}
	ok(t, "ichor", "-n", ns, "upgrade", "talos", "--to", "v1.13.7", "--name", "up")
	if out := ok(t, "ichor", "-n", ns, "operation", "describe", "up"); strings.Contains(out, "Afterwards:") {
		t.Errorf("describe of an upgrade says something to do afterwards:\n%s", out)
	}
}
