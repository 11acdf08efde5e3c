package clitest

import (
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"k8s.io/client-go/rest"

	"maesh.dev/ichor/controller/app"
	"maesh.dev/ichor/internal/testcluster"
	"maesh.dev/ichor/sim"
)

// withController starts a simulated fleet and ichor-controller, whose
// namespace the plugin is pointed at.
func withController(t *testing.T) (ns, ctrlNS string, fleet *sim.Fleet) {
	t.Helper()
	// The operations earlier tests left (with made-up status) are not this controller's to run.
	testcluster.DeleteOperations(env)
	ns, ctrlNS = env.Namespace(t), env.Namespace(t)
	fleet = testcluster.StartFleet(t, env, sim.Cluster("", 1, 2), ns)
	testcluster.WriteTalosconfig(t, env, fleet, ctrlNS)
	testcluster.StartController(t, rest.CopyConfig(env.Config), app.Options{Namespace: ctrlNS, LeaderElection: true,
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
