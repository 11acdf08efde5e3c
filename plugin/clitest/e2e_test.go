package clitest

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	talosclient "github.com/siderolabs/talos/pkg/machinery/client"
	"google.golang.org/grpc/codes"
	coordinationv1 "k8s.io/api/coordination/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"

	"maesh.dev/ichor/controller/app"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/internal/testcluster"
	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

// withController starts a simulated fleet and ichor-controller, whose
// namespace the plugin is pointed at.
func withController(t *testing.T) (ns, ctrlNS string, fleet *sim.Fleet) {
	t.Helper()
	return withControllerOf(t, nil)
}

// withControllerOf is withController with a controller that carries out
// the kinds of kinds (nil: every kind), as an older one would.
func withControllerOf(t *testing.T, kinds executor.Registry) (ns, ctrlNS string, fleet *sim.Fleet) {
	t.Helper()
	// The operations earlier tests left (with made-up status) are not this controller's to run.
	testcluster.DeleteOperations(env)
	ns, ctrlNS = env.Namespace(t), env.Namespace(t)
	fleet = testcluster.StartFleet(t, env, sim.Cluster("", 1, 2), ns)
	testcluster.WriteTalosconfig(t, env, fleet, ctrlNS)
	testcluster.StartController(t, rest.CopyConfig(env.Config), app.Options{Namespace: ctrlNS, LeaderElection: true, Executors: kinds,
		LeaseDuration: 2 * time.Second, RenewDeadline: 1500 * time.Millisecond, RetryPeriod: 200 * time.Millisecond})
	return ns, ctrlNS, fleet
}

// TestUpgradeWaitAgainstAFleet: `kubectl ichor upgrade talos --to V --wait`
// exits 0 once a real controller has upgraded the fleet, and 2 when a step
// fails; `watch` of the failed operation exits 2 with the machine's message;
// `retry` then lets it finish.
func TestUpgradeWaitAgainstAFleet(t *testing.T) {
	ns, ctrlNS, fleet := withController(t)

	r := kubectl(t, "", "ichor", "upgrade", "talos", "--to", "1.13.6", "--name", "first", "-n", ns, "--wait", "--timeout", "2m")
	if r.code != 0 {
		t.Fatalf("upgrade --wait: exit %d\nstdout %s\nstderr %s", r.code, r.out, r.err)
	}
	for _, m := range fleet.Machines() {
		if m.Version() != "v1.13.6" {
			t.Errorf("%s runs %s", m.Name(), m.Version())
		}
	}
	if out := ok(t, "ichor", "version", "--controller-namespace", ctrlNS); !strings.Contains(out, "v0.0.0-test") {
		t.Errorf("version does not show the controller's: %q", out)
	}

	w2 := fleet.Machines()[2].Name()
	fleet.Machine(w2).Inject(sim.Fault{Kind: sim.FaultError, Method: "LifecycleService/Upgrade", Code: codes.Internal})
	r = kubectl(t, "", "ichor", "upgrade", "talos", "--to", "v1.13.7", "--name", "second", "-n", ns, "--wait", "--timeout", "2m")
	if r.code != 2 {
		t.Fatalf("upgrade --wait of a failing operation: exit %d, want 2\nstdout %s\nstderr %s", r.code, r.out, r.err)
	}
	if !strings.Contains(r.err, w2) || !strings.Contains(r.err, "kubectl ichor retry second") {
		t.Errorf("the failure does not name the machine and the way out: %q", r.err)
	}

	r = kubectl(t, "", "ichor", "watch", "second", "-n", ns, "--timeout", "1m")
	if r.code != 2 {
		t.Fatalf("watch of a failed operation: exit %d, want 2; stderr %s", r.code, r.err)
	}
	if !strings.Contains(r.out+r.err, "simulated fault") {
		t.Errorf("watch does not print the failed machine's message:\nstdout %s\nstderr %s", r.out, r.err)
	}

	fleet.Machine(w2).ClearFaults()
	r = kubectl(t, "", "ichor", "retry", "second", "-n", ns, "--wait", "--timeout", "2m")
	if r.code != 0 {
		t.Fatalf("retry --wait: exit %d\nstdout %s\nstderr %s", r.code, r.out, r.err)
	}
	op := getOp(t, ns, "second")
	if !op.Succeeded() || op.Status.RetryCount != 1 || fleet.Machine(w2).Version() != "v1.13.7" {
		t.Errorf("after retry: phase %s retries %d %s on %s", op.Status.Phase, op.Status.RetryCount, w2, fleet.Machine(w2).Version())
	}
}

// TestCreateSaysTheVerdict: against a real controller, a create without
// --watch or --wait waits briefly for the first verdict: a refusal exits 2
// with what would pass, an accepted operation says how to follow it. The
// plugin's own refusal of a kind the controller does not carry out says
// what the controller says when it refuses one itself.
func TestCreateSaysTheVerdict(t *testing.T) {
	older := executor.Default()
	delete(older, ichorv1.KindKeyRotation)
	ns, ctrlNS, _ := withControllerOf(t, older)
	testenv.Eventually(t, 30*time.Second, "the leader Lease to carry the kinds", func(ctx context.Context) (bool, error) {
		lease := &coordinationv1.Lease{}
		err := env.Client.Get(ctx, client.ObjectKey{Namespace: ctrlNS, Name: ichorv1.LeaderLeaseName}, lease)
		return err == nil && lease.Annotations[ichorv1.KindsAnnotation] != "", client.IgnoreNotFound(err)
	})

	// Each failed check once, with what would pass, then the override.
	r := kubectl(t, "", "ichor", "upgrade", "talos", "--to", "v1.10.9", "--name", "backwards", "-n", ns, "--controller-namespace", ctrlNS)
	if r.code != 2 || r.out != "talosoperation.ichor.maesh.dev/backwards created\n" {
		t.Errorf("a refused create: exit %d\nstdout %q\nstderr %q", r.code, r.out, r.err)
	}
	golden(t, "testdata/create-refused.golden", r.err)
	r = kubectl(t, "", "ichor", "upgrade", "talos", "--to", "v1.13.7", "--name", "forwards", "-n", ns, "--controller-namespace", ctrlNS, "-o", "name")
	if r.code != 0 || r.out != "talosoperation.ichor.maesh.dev/forwards\n" || !strings.HasPrefix(r.err, "ichor-controller checked it: it ") ||
		!strings.HasSuffix(r.err, "; follow it with: kubectl ichor watch forwards\n") {
		t.Errorf("an accepted create: exit %d\nstdout %q\nstderr %q", r.code, r.out, r.err)
	}

	// The controller's own words for a kind it does not carry out (this
	// one is older than the key-rotation kind)...
	direct := &ichorv1.TalosOperation{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "direct"},
		Spec: ichorv1.TalosOperationSpec{Kind: ichorv1.KindKeyRotation, KeyRotation: &ichorv1.KeyRotation{}}}
	if err := env.Client.Create(context.Background(), direct); err != nil {
		t.Fatal(err)
	}
	var said string
	testenv.Eventually(t, 30*time.Second, "the controller to refuse the key rotation", func(ctx context.Context) (bool, error) {
		op := getOp(t, ns, "direct")
		if c := meta.FindStatusCondition(op.Status.Conditions, ichorv1.CheckKindSupported); c != nil {
			said = c.Message
		}
		return said != "", nil
	})
	// ...are the plugin's, before it creates anything.
	r = kubectl(t, "", "ichor", "rotate", "keys", "--yes", "-n", ns, "--controller-namespace", ctrlNS)
	if want := "error: ichor-controller would refuse this operation, so nothing was created:\n  KindSupported: " + said + "\n"; r.code != 1 || r.err != want {
		t.Errorf("rotate keys: exit %d, stderr\n%q\nwant\n%q", r.code, r.err, want)
	}
	// Following it says so, without an override that cannot run it.
	r = kubectl(t, "", "ichor", "watch", "direct", "-n", ns, "--controller-namespace", ctrlNS, "-o", "json")
	if r.code != 2 {
		t.Errorf("watch of a refused key rotation: exit %d, stderr %q", r.code, r.err)
	}
	golden(t, "testdata/watch-refused-kind.golden", r.err)
}

// TestRotateCAEndToEnd: against a real controller and fleet, `kubectl
// ichor rotate ca --talos --wait` exits 0 once the Talos API CA is rotated:
// describe shows the seven stages done and what to do afterwards, and the
// fleet's original talosconfig is refused.
func TestRotateCAEndToEnd(t *testing.T) {
	ns, ctrlNS, fleet := withController(t)
	old := fleet.Talosconfig()

	r := kubectl(t, "", "ichor", "rotate", "ca", "--talos", "-y", "--name", "rot", "-n", ns, "--controller-namespace", ctrlNS, "--wait", "--timeout", "2m")
	if r.code != 0 {
		t.Fatalf("rotate ca --talos --wait: exit %d\nstdout %s\nstderr %s", r.code, r.out, r.err)
	}
	out := ok(t, "ichor", "operation", "describe", "rot", "-n", ns, "--controller-namespace", ctrlNS)
	for _, want := range []string{"Phase:       Succeeded", "Stages:", "prepare-ca", "accept-new-ca", "verify-accepted", "swap-ca",
		"verify-swapped", "drop-old-ca", "verify-dropped",
		"afterwards: a talosconfig of the old Talos API CA is refused by every machine"} {
		if !strings.Contains(out, want) {
			t.Errorf("describe lacks %q:\n%s", want, out)
		}
	}
	tc, err := talosclient.New(context.Background(), talosclient.WithConfig(old))
	if err != nil {
		t.Fatal(err)
	}
	defer tc.Close() //nolint:errcheck
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := tc.Version(ctx); err == nil {
		t.Error("the fleet's original talosconfig still answers after the rotation")
	}
}

// TestRotateKubernetesCAEndToEnd: on a hosted fleet (its API servers follow
// cluster.ca), `kubectl ichor rotate ca --kubernetes --watch` with the
// fleet's first admin kubeconfig follows the rotation until the API server
// refuses that kubeconfig, then says why and what to do instead of waiting
// silently; `watch` with a kubeconfig from a control plane follows it to
// the end; describe shows the seven stages done and what to do with an old
// kubeconfig; and the first kubeconfig is refused.
func TestRotateKubernetesCAEndToEnd(t *testing.T) {
	fleet, henv := testcluster.StartHostedFleet(t, sim.Cluster("", 1, 1), testenv.Components{})
	const ns = "default"
	testcluster.WriteTalosconfig(t, henv, fleet, ns)
	testcluster.StartController(t, henv.Config, app.Options{Namespace: ns})

	r := kubectl(t, henv.Kubeconfig, "ichor", "rotate", "ca", "--kubernetes", "-y", "--name", "rot", "-n", ns, "--controller-namespace", ns, "--watch", "-o", "json", "--timeout", "3m")
	for _, want := range []string{"the API server no longer accepts your kubeconfig", "talosctl -n <control plane> kubeconfig --force",
		"kubectl ichor watch rot -n default"} {
		if r.code != 1 || !strings.Contains(r.err, want) {
			t.Fatalf("rotate ca --kubernetes --watch: exit %d, want 1 saying %q\nstdout %s\nstderr %s", r.code, want, r.out, r.err)
		}
	}

	fresh := kubeconfigFromTalos(t, fleet)
	if r = kubectl(t, fresh, "ichor", "watch", "rot", "-n", ns, "--controller-namespace", ns, "-o", "json", "--timeout", "3m"); r.code != 0 {
		t.Fatalf("watch with a kubeconfig from a control plane: exit %d\nstderr %s", r.code, r.err)
	}
	r = kubectl(t, fresh, "ichor", "operation", "describe", "rot", "-n", ns, "--controller-namespace", ns)
	for _, want := range []string{"Phase:       Succeeded", "prepare-kubernetes-ca", "accept-new-kubernetes-ca", "verify-kubernetes-accepted",
		"swap-kubernetes-ca", "verify-kubernetes-swapped", "drop-old-kubernetes-ca", "verify-kubernetes-dropped",
		"a kubeconfig of the old Kubernetes CA", "talosctl -n <control plane> kubeconfig --force"} {
		if r.code != 0 || !strings.Contains(r.out, want) {
			t.Errorf("describe (exit %d) lacks %q:\n%s%s", r.code, want, r.out, r.err)
		}
	}
	if r = kubectl(t, henv.Kubeconfig, "get", "nodes"); r.code == 0 {
		t.Errorf("the fleet's first kubeconfig still lists the Nodes after the rotation:\n%s", r.out)
	}
}

// kubeconfigFromTalos writes the admin kubeconfig a control plane of fleet
// issues now (`talosctl kubeconfig`) and returns its path.
func kubeconfigFromTalos(t *testing.T, fleet *sim.Fleet) string {
	t.Helper()
	tc, err := talosclient.New(context.Background(), talosclient.WithConfig(fleet.Talosconfig()))
	if err != nil {
		t.Fatal(err)
	}
	defer tc.Close() //nolint:errcheck
	var data []byte
	testenv.Eventually(t, time.Minute, "a kubeconfig from a control plane", func(ctx context.Context) (bool, error) {
		data, err = tc.Kubeconfig(talosclient.WithNode(ctx, fleet.ControlPlanes()[0].Address()))
		return err == nil, nil
	})
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestRestoreEtcdEndToEnd: on a hosted fleet with the controller running,
// `kubectl ichor restore etcd --from file://... -y --watch` follows the
// restore through the API's absence and the rewind (the snapshot predates
// the operation): it says once that the API is away while etcd is
// restored, accepts the operation the controller writes back from its
// journal (a new UID), and exits 0 with the success line.
func TestRestoreEtcdEndToEnd(t *testing.T) {
	t.Setenv("TMPDIR", t.TempDir()) // the controller's hand-over, its pod's emptyDir
	fleet, henv := testcluster.StartHostedFleet(t, sim.Cluster("", 3, 0), testenv.Components{})
	const ns = "default"
	testcluster.WriteTalosconfig(t, henv, fleet, ns)
	tc, err := talosclient.New(context.Background(), talosclient.WithConfig(fleet.Talosconfig()))
	if err != nil {
		t.Fatal(err)
	}
	defer tc.Close() //nolint:errcheck
	snap := filepath.Join(t.TempDir(), "etcd.snapshot")
	testcluster.TakeSnapshot(t, tc, fleet.ControlPlanes()[0], snap)
	testcluster.StartController(t, henv.Config, app.Options{Namespace: ns})

	r := kubectl(t, henv.Kubeconfig, "ichor", "restore", "etcd", "--from", "file://"+snap, "-y", "--name", "rewind", "-n", ns,
		"--controller-namespace", ns, "--watch", "--timeout", "5m")
	if r.code != 0 {
		t.Fatalf("restore etcd --watch: exit %d, want 0\nstdout %s\nstderr %s", r.code, r.out, r.err)
	}
	for _, want := range []string{awayNoteText, "talosoperation.ichor.maesh.dev/rewind is back: ichor-controller wrote it back from its journal"} {
		if n := strings.Count(r.out, want); n != 1 {
			t.Errorf("the output says %q %d times, want once:\n%s", want, n, r.out)
		}
	}
	if lines := strings.Split(strings.TrimSpace(r.out), "\n"); !strings.HasPrefix(lines[len(lines)-1], "talosoperation.ichor.maesh.dev/rewind succeeded") {
		t.Errorf("the output does not end with the success line:\n%s", r.out)
	}
}

const awayNoteText = "the API is away while etcd is restored; the operation is written back when the restore ends"
