package operation_test

import (
	"context"
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	kstatus "sigs.k8s.io/cli-utils/pkg/kstatus/status"

	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/manifests/argocd"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/sim"
)

// TestFailureAndRetry: a failed step pauses the operation with a
// failureReason and nothing runs by itself; retry=yes is ignored; retry=true
// while spec.paused waits untouched; resuming runs only the failed step
// again, records lastRetry and removes the annotation.
func TestFailureAndRetry(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 1, 3))
	w := func(i int) string { return c.fleet.Machines()[i].Name() }
	c.fleet.Machine(w(2)).Inject(sim.Fault{Kind: sim.FaultError, Method: "Upgrade", Code: codes.Internal})
	before := gather(t)
	c.start()
	c.create("upgrade", talosSpec("v1.13.7"))

	op := c.waitFor("upgrade", "to fail on "+w(2), time.Minute, (*ichorv1.TalosOperation).StepFailed)
	if op.Status.Phase != ichorv1.PhasePaused || op.Status.Reason != ichorv1.ReasonStepFailed || op.Status.FailureReason != "InstallFailed" {
		t.Fatalf("phase %s reason %s failureReason %q", op.Status.Phase, op.Status.Reason, op.Status.FailureReason)
	}
	failed := op.Status.FailedMachine()
	if failed == nil || failed.Name != w(2) || failed.Step != "install" || !strings.Contains(failed.Message, "Internal") {
		t.Fatalf("failed machine: %+v", failed)
	}
	if m := entryOf(op, w(1)); m.Phase != ichorv1.MachineSucceeded {
		t.Fatalf("%s is %s", w(1), m.Phase)
	}
	if got := kstatusOf(t, c, "upgrade"); got.Status != kstatus.FailedStatus || !strings.Contains(got.Message, "InstallFailed") {
		t.Errorf("kstatus of the failed operation: %s %q, want Failed with the failure's reason", got.Status, got.Message)
	}
	if got := argoCDHealthOf(t, c, "upgrade"); got.Status != "Degraded" || !strings.Contains(got.Message, "InstallFailed") {
		t.Errorf("Argo CD health of the failed operation: %s %q, want Degraded with the failure's reason", got.Status, got.Message)
	}
	calls := c.fleet.Recorder().CallCounts()

	// Any other value than "true" is ignored, and left alone.
	c.kubectl("annotate", "talosoperation", "upgrade", ichorv1.RetryAnnotation+"=yes")
	c.patchSpec("upgrade", `{"paused":true}`)
	op = c.waitFor("upgrade", "to observe the pause", time.Minute, func(op *ichorv1.TalosOperation) bool {
		return op.Status.ObservedGeneration == op.Generation
	})
	if op.Status.RetryCount != 0 || op.Annotations[ichorv1.RetryAnnotation] != "yes" || !op.StepFailed() {
		t.Fatalf("retry=yes was acted on: retryCount %d annotation %q failure %q", op.Status.RetryCount, op.Annotations[ichorv1.RetryAnnotation], op.Status.FailureReason)
	}

	// retry=true while spec.paused waits untouched.
	c.kubectl("annotate", "--overwrite", "talosoperation", "upgrade", ichorv1.RetryAnnotation+"=true")
	op = c.waitFor("upgrade", "to see the retry request", time.Minute, func(op *ichorv1.TalosOperation) bool {
		return strings.Contains(op.Status.Message, "a retry is requested and runs when the operation is resumed")
	})
	if op.Status.RetryCount != 0 || op.Status.LastRetry != nil || !op.RetryPending() || !op.StepFailed() {
		t.Fatalf("the retry ran while paused: retryCount %d lastRetry %v pending %v", op.Status.RetryCount, op.Status.LastRetry, op.RetryPending())
	}
	if now := c.fleet.Recorder().CallCounts(); !reflect.DeepEqual(now, calls) {
		t.Fatalf("machines were called while the operation was paused on its failure:\nbefore %v\nafter  %v", calls, now)
	}

	// Fix the cause, then resume: the retry runs the failed step once.
	c.fleet.Machine(w(2)).ClearFaults()
	c.patchSpec("upgrade", `{"paused":false}`)
	op = c.waitSucceeded("upgrade", time.Minute)
	if got := kstatusOf(t, c, "upgrade"); got.Status != kstatus.CurrentStatus {
		t.Errorf("kstatus of the succeeded operation: %s %q, want Current", got.Status, got.Message)
	}
	if got := argoCDHealthOf(t, c, "upgrade"); got.Status != "Healthy" {
		t.Errorf("Argo CD health of the succeeded operation: %s %q, want Healthy", got.Status, got.Message)
	}
	if op.Status.RetryCount != 1 || op.Status.LastRetry == nil || op.RetryPending() {
		t.Errorf("retryCount %d lastRetry %v annotation %q", op.Status.RetryCount, op.Status.LastRetry, op.Annotations[ichorv1.RetryAnnotation])
	}
	if _, ok := op.Annotations[ichorv1.RetryAnnotation]; ok {
		t.Errorf("the retry annotation was not removed")
	}
	rec := c.fleet.Recorder()
	for i, want := range map[int]int{1: 1, 2: 2, 3: 1} {
		if n := rec.Calls(w(i), "MachineService/Upgrade"); n != want {
			t.Errorf("%s: %d upgrade calls, want %d", w(i), n, want)
		}
		if n := rec.UpgradesApplied(w(i)); n != 1 {
			t.Errorf("%s: %d upgrades took effect, want 1", w(i), n)
		}
	}
	if m := entryOf(op, w(2)); m.Attempts != 2 {
		t.Errorf("%s attempts %d, want 2", w(2), m.Attempts)
	}

	// A retry request on an operation with nothing left to run is removed,
	// not kept for later, and an Event says why: one that only this request
	// can have caused.
	seen := eventUIDs(c, "upgrade")
	c.kubectl("annotate", "talosoperation", "upgrade", ichorv1.RetryAnnotation+"=true")
	c.waitFor("upgrade", "to remove the retry request", time.Minute, func(op *ichorv1.TalosOperation) bool { return !op.RetryPending() })
	waitEventWhere(t, c, "upgrade", "a RetryIgnored Event saying the operation has succeeded, after the last request", func(e corev1.Event) bool {
		return e.Type == corev1.EventTypeNormal && e.Reason == "RetryIgnored" && strings.Contains(e.Message, "the operation has succeeded") && !seen[e.UID]
	})
	checkMetrics(t, before)
}

// TestRetryWithKubectlAnnotate is the specification's own recipe, with
// the real kubectl and nothing else.
func TestRetryWithKubectlAnnotate(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 1, 1))
	w1 := c.fleet.Machines()[1].Name()
	c.fleet.Machine(w1).Inject(sim.Fault{Kind: sim.FaultError, Method: "Upgrade", Code: codes.Internal, Once: true})
	c.start()
	c.create("upgrade", talosSpec("v1.13.7"))
	c.waitFor("upgrade", "to fail", time.Minute, (*ichorv1.TalosOperation).StepFailed)
	c.kubectl("annotate", "talosoperation", "upgrade", "ichor.maesh.dev/retry=true")
	op := c.waitSucceeded("upgrade", time.Minute)
	if op.Status.RetryCount != 1 || op.Status.LastRetry == nil || op.RetryPending() {
		t.Errorf("retryCount %d lastRetry %v pending %v", op.Status.RetryCount, op.Status.LastRetry, op.RetryPending())
	}
}

// keepRetryAnnotation makes the API server refuse to remove the retry
// annotation from operations in the cluster's namespace (a real
// ValidatingAdmissionPolicy), so the controller's removal fails. It
// returns the function that lifts the refusal.
func keepRetryAnnotation(t *testing.T, c *cluster, name string) (lift func()) {
	t.Helper()
	ctx := context.Background()
	policy := &admissionregistrationv1.ValidatingAdmissionPolicy{
		ObjectMeta: metav1.ObjectMeta{Name: "keep-retry-" + c.ns},
		Spec: admissionregistrationv1.ValidatingAdmissionPolicySpec{
			FailurePolicy: ptr.To(admissionregistrationv1.Fail),
			MatchConstraints: &admissionregistrationv1.MatchResources{ResourceRules: []admissionregistrationv1.NamedRuleWithOperations{{
				RuleWithOperations: admissionregistrationv1.RuleWithOperations{Operations: []admissionregistrationv1.OperationType{admissionregistrationv1.Update},
					Rule: admissionregistrationv1.Rule{APIGroups: []string{ichorv1.GroupVersion.Group}, APIVersions: []string{"*"}, Resources: []string{"talosoperations"}}},
			}}},
			Validations: []admissionregistrationv1.Validation{{
				Expression: fmt.Sprintf(`!(has(oldObject.metadata.annotations) && %[1]q in oldObject.metadata.annotations) || (has(object.metadata.annotations) && %[1]q in object.metadata.annotations)`, ichorv1.RetryAnnotation),
				Message:    "the test keeps the retry annotation",
			}},
		},
	}
	binding := &admissionregistrationv1.ValidatingAdmissionPolicyBinding{
		ObjectMeta: metav1.ObjectMeta{Name: policy.Name},
		Spec: admissionregistrationv1.ValidatingAdmissionPolicyBindingSpec{PolicyName: policy.Name,
			ValidationActions: []admissionregistrationv1.ValidationAction{admissionregistrationv1.Deny},
			MatchResources: &admissionregistrationv1.MatchResources{NamespaceSelector: &metav1.LabelSelector{
				MatchLabels: map[string]string{"kubernetes.io/metadata.name": c.ns}}}},
	}
	for _, o := range []client.Object{policy, binding} {
		if err := env.Client.Create(ctx, o); err != nil {
			t.Fatal(err)
		}
	}
	lift = func() {
		for _, o := range []client.Object{binding, policy} {
			if err := env.Client.Delete(ctx, o); err != nil && !notFound(err) {
				t.Error(err)
			}
		}
	}
	t.Cleanup(lift)
	// The policy is in force once a dry run of the removal is refused (a
	// value other than "true" is never acted on by the controller).
	c.kubectl("annotate", "--overwrite", "talosoperation", name, ichorv1.RetryAnnotation+"=not-yet")
	testenv.Eventually(t, 30*time.Second, "the policy to refuse removing the retry annotation", func(ctx context.Context) (bool, error) {
		op := &ichorv1.TalosOperation{ObjectMeta: metav1.ObjectMeta{Namespace: c.ns, Name: name}}
		patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:null}}}`, ichorv1.RetryAnnotation)
		err := env.Client.Patch(ctx, op, client.RawPatch(types.MergePatchType, []byte(patch)), client.DryRunAll)
		return err != nil && strings.Contains(err.Error(), "keeps the retry annotation"), nil
	})
	return lift
}

// TestRetryConsumedOnce: a retry request is consumed by the failure it was
// made for. When its annotation cannot be removed and the step fails again,
// the leftover annotation does not retry the new failure; once it is
// removed, a new request does. A request on a finished operation is
// removed with an Event saying why.
func TestRetryConsumedOnce(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 1, 1))
	w1 := c.fleet.Machines()[1].Name()
	c.fleet.Machine(w1).Inject(sim.Fault{Kind: sim.FaultError, Method: "Upgrade", Code: codes.Internal})
	c.start()
	c.create("upgrade", talosSpec("v1.13.7"))
	c.waitFor("upgrade", "to fail", time.Minute, (*ichorv1.TalosOperation).StepFailed)
	lift := keepRetryAnnotation(t, c, "upgrade")

	c.kubectl("annotate", "--overwrite", "talosoperation", "upgrade", ichorv1.RetryAnnotation+"=true")
	op := c.waitFor("upgrade", "to fail again after one retry", time.Minute, func(op *ichorv1.TalosOperation) bool {
		m := entryOf(op, w1)
		return op.StepFailed() && m.Phase == ichorv1.MachineFailed && m.Attempts >= 2
	})
	if m := entryOf(op, w1); op.Status.RetryCount != 1 || m.Attempts != 2 || !op.RetryPending() || !op.Status.RetryConsumed {
		t.Fatalf("retryCount %d attempts %d annotation %q consumed %v; want 1, 2, the annotation left, consumed",
			op.Status.RetryCount, m.Attempts, op.Annotations[ichorv1.RetryAnnotation], op.Status.RetryConsumed)
	}
	lift()
	op = c.waitFor("upgrade", "to remove the consumed request", time.Minute, func(op *ichorv1.TalosOperation) bool {
		return !op.RetryPending() && !op.Status.RetryConsumed
	})
	if m := entryOf(op, w1); op.Status.RetryCount != 1 || m.Attempts != 2 || !op.StepFailed() {
		t.Fatalf("the leftover request retried the second failure: retryCount %d attempts %d failure %q", op.Status.RetryCount, m.Attempts, op.Status.FailureReason)
	}

	// A new request is a new retry.
	c.fleet.Machine(w1).ClearFaults()
	c.kubectl("annotate", "talosoperation", "upgrade", ichorv1.RetryAnnotation+"=true")
	op = c.waitSucceeded("upgrade", time.Minute)
	if m := entryOf(op, w1); op.Status.RetryCount != 2 || m.Attempts != 3 {
		t.Errorf("retryCount %d attempts %d, want 2 and 3", op.Status.RetryCount, m.Attempts)
	}

	// On a finished operation a request is removed, with an Event saying why.
	c.kubectl("annotate", "talosoperation", "upgrade", ichorv1.RetryAnnotation+"=true")
	c.waitFor("upgrade", "to remove the request", time.Minute, func(op *ichorv1.TalosOperation) bool { return !op.RetryPending() })
	e := waitEvent(t, c, "upgrade", corev1.EventTypeNormal, "RetryIgnored")
	if !strings.Contains(e.Message, "has succeeded") {
		t.Errorf("RetryIgnored Event %q does not say the operation has succeeded", e.Message)
	}
}

// served is the operation as the API server serves it.
func served(t *testing.T, c *cluster, name string) *unstructured.Unstructured {
	t.Helper()
	u := &unstructured.Unstructured{}
	u.SetGroupVersionKind(ichorv1.GroupVersion.WithKind("TalosOperation"))
	if err := env.Client.Get(context.Background(), keyOf(c.ns, name), u); err != nil {
		t.Fatal(err)
	}
	return u
}

// kstatusOf computes with kstatus (as Flux does) the status of the
// operation as the API server serves it.
func kstatusOf(t *testing.T, c *cluster, name string) *kstatus.Result {
	t.Helper()
	res, err := kstatus.Compute(served(t, c, name))
	if err != nil {
		t.Fatal(err)
	}
	return res
}

// argoCDHealthOf runs Argo CD's health check on the operation as the API
// server serves it.
func argoCDHealthOf(t *testing.T, c *cluster, name string) argocd.Health {
	t.Helper()
	h, err := argocd.Check(served(t, c, name).Object)
	if err != nil {
		t.Fatal(err)
	}
	return h
}
