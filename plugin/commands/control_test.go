package commands

import (
	"bytes"
	"context"
	"strings"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/cli-runtime/pkg/genericiooptions"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

const testNS = "ops"

// sentPatch is one patch the plugin sent, as the API server would get it.
type sentPatch struct {
	Name   string
	Type   types.PatchType
	Data   string
	Owner  string
	DryRun []string
}

type fakeRun struct {
	env     *Env
	client  client.WithWatch
	patches []sentPatch
	out     *bytes.Buffer
	errOut  *bytes.Buffer
}

// newFakeRun is an Env whose client is controller-runtime's fake, recording
// every patch the commands send.
func newFakeRun(t *testing.T, objs ...client.Object) *fakeRun {
	t.Helper()
	streams, _, out, errOut := genericiooptions.NewTestIOStreams()
	r := &fakeRun{out: out, errOut: errOut}
	e := NewEnv("kubectl-ichor", streams)
	ns := testNS
	e.ConfigFlags.Namespace = &ns
	e.Getenv = func(string) string { return "" }
	r.client = fake.NewClientBuilder().WithScheme(Scheme).WithObjects(objs...).
		WithStatusSubresource(&ichorv1.TalosOperation{}).
		WithInterceptorFuncs(interceptor.Funcs{
			Patch: func(ctx context.Context, c client.WithWatch, obj client.Object, patch client.Patch, opts ...client.PatchOption) error {
				data, err := patch.Data(obj)
				if err != nil {
					return err
				}
				po := (&client.PatchOptions{}).ApplyOptions(opts)
				r.patches = append(r.patches, sentPatch{Name: obj.GetName(), Type: patch.Type(), Data: string(data), Owner: po.FieldManager, DryRun: po.DryRun})
				return c.Patch(ctx, obj, patch, opts...)
			},
		}).Build()
	e.NewClient = func() (client.WithWatch, error) { return r.client, nil }
	r.env = e
	return r
}

func (r *fakeRun) run(args ...string) int { return r.env.Execute(args) }

type opState func(*ichorv1.TalosOperation)

func newOp(name string, states ...opState) *ichorv1.TalosOperation {
	op := &ichorv1.TalosOperation{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: testNS, Generation: 1},
		Spec:       ichorv1.TalosOperationSpec{Kind: ichorv1.KindTalos, Talos: &ichorv1.TalosUpgrade{Version: "v1.13.7"}},
		Status:     ichorv1.TalosOperationStatus{Phase: ichorv1.PhaseRunning, ObservedGeneration: 1},
	}
	for _, s := range states {
		s(op)
	}
	return op
}

func operatorPaused(op *ichorv1.TalosOperation) {
	op.Spec.Paused = true
	op.Status.Phase, op.Status.Reason = ichorv1.PhasePaused, ichorv1.ReasonPausedByOperator
}

func stepFailed(op *ichorv1.TalosOperation) {
	op.Status.Phase, op.Status.Reason = ichorv1.PhasePaused, ichorv1.ReasonStepFailed
	op.Status.FailureReason = "upgrade cp-2: installer image pull timed out"
	op.Status.Machines = []ichorv1.MachineStatus{{Name: "cp-2", Role: ichorv1.RoleControlPlane, Phase: ichorv1.MachineFailed, Step: "upgrade", Message: "i/o timeout"}}
}

func retryPending(op *ichorv1.TalosOperation) {
	op.Annotations = map[string]string{ichorv1.RetryAnnotation: ichorv1.RetryRequested}
}

func skipPending(machine string) opState {
	return func(op *ichorv1.TalosOperation) {
		op.Annotations = map[string]string{ichorv1.SkipAnnotation: machine, ichorv1.SkipByAnnotation: "alice"}
	}
}

func succeeded(op *ichorv1.TalosOperation) { op.Status.Phase = ichorv1.PhaseSucceeded }

func refused(op *ichorv1.TalosOperation) { op.Status.Phase = ichorv1.PhaseRefused }

func cancelled(op *ichorv1.TalosOperation) {
	op.Annotations = map[string]string{ichorv1.CancelAnnotation: "alice"}
	op.Status.Phase, op.Status.Reason = ichorv1.PhaseCancelled, "Cancelled"
	op.Status.Message = "cancelled by alice; done on 0/1 machine(s)"
	op.Status.Machines = []ichorv1.MachineStatus{{Name: "cp-2", Role: ichorv1.RoleControlPlane, Phase: ichorv1.MachinePending}}
}

func waitingForLock(op *ichorv1.TalosOperation) {
	op.Status.Phase, op.Status.Reason = ichorv1.PhasePaused, ichorv1.ReasonClusterLockHeld
	op.Status.Lock, op.Status.LockHolder = ichorv1.LockWaiting, ichorv1.OperationIdentity("ops", "first")
}

const (
	annotationPatch = `{"metadata":{"annotations":{"ichor.maesh.dev/retry":"true"}}}`
	bothPatch       = `{"metadata":{"annotations":{"ichor.maesh.dev/retry":"true"}},"spec":{"paused":false}}`
)

// TestControlPatches runs pause, resume and retry on operations in each
// state and checks the exact merge patch sent (or that none was), what was
// printed and the exit code.
func TestControlPatches(t *testing.T) {
	tests := []struct {
		name      string
		op        *ichorv1.TalosOperation
		args      []string
		patch     string // "" when nothing may be sent
		dryRun    []string
		out       string
		errOut    string
		code      int
		wantAfter func(*ichorv1.TalosOperation) bool
	}{
		{name: "pause running", op: newOp("a"), args: []string{"operation", "pause", "a"},
			patch: `{"spec":{"paused":true}}`, out: "talosoperation.ichor.maesh.dev/a paused\n",
			wantAfter: func(op *ichorv1.TalosOperation) bool { return op.Spec.Paused }},
		{name: "pause paused", op: newOp("a", operatorPaused), args: []string{"operation", "pause", "a"},
			out: "talosoperation.ichor.maesh.dev/a already paused\n"},
		{name: "pause failed", op: newOp("a", stepFailed), args: []string{"op", "pause", "a"},
			patch: `{"spec":{"paused":true}}`, out: "talosoperation.ichor.maesh.dev/a paused\n"},
		{name: "pause succeeded", op: newOp("a", succeeded), args: []string{"operation", "pause", "a"},
			errOut: "error: talosoperation \"a\" is Succeeded; nothing to pause\n", code: 1},
		{name: "pause server dry run", op: newOp("a"), args: []string{"operation", "pause", "a", "--dry-run=server"},
			patch: `{"spec":{"paused":true}}`, dryRun: []string{metav1.DryRunAll}, out: "talosoperation.ichor.maesh.dev/a paused (server dry run)\n",
			wantAfter: func(op *ichorv1.TalosOperation) bool { return !op.Spec.Paused }},
		{name: "pause client dry run", op: newOp("a"), args: []string{"operation", "pause", "a", "--dry-run=client"},
			out: "talosoperation.ichor.maesh.dev/a paused (dry run)\n"},
		{name: "pause -o name", op: newOp("a"), args: []string{"operation", "pause", "talosoperation.ichor.maesh.dev/a", "-o", "name"},
			patch: `{"spec":{"paused":true}}`, out: "talosoperation.ichor.maesh.dev/a\n"},

		{name: "resume operator-paused", op: newOp("a", operatorPaused), args: []string{"operation", "resume", "a"},
			patch: `{"spec":{"paused":false}}`, out: "talosoperation.ichor.maesh.dev/a resumed\n",
			wantAfter: func(op *ichorv1.TalosOperation) bool { return !op.Spec.Paused && !op.RetryPending() }},
		{name: "resume failed", op: newOp("a", stepFailed), args: []string{"operation", "resume", "a"},
			patch: annotationPatch, out: "talosoperation.ichor.maesh.dev/a resumed (retrying the failed step)\n",
			wantAfter: func(op *ichorv1.TalosOperation) bool { return op.RetryPending() }},
		{name: "resume paused and failed", op: newOp("a", stepFailed, operatorPaused), args: []string{"operation", "resume", "a"},
			patch: bothPatch, out: "talosoperation.ichor.maesh.dev/a resumed (retrying the failed step)\n",
			wantAfter: func(op *ichorv1.TalosOperation) bool { return !op.Spec.Paused && op.RetryPending() }},
		{name: "resume paused, failed, retry pending", op: newOp("a", stepFailed, operatorPaused, retryPending), args: []string{"operation", "resume", "a"},
			patch: `{"spec":{"paused":false}}`, out: "talosoperation.ichor.maesh.dev/a resumed (the pending retry runs now)\n"},
		{name: "resume failed, retry pending", op: newOp("a", stepFailed, retryPending), args: []string{"operation", "resume", "a"},
			out: "talosoperation.ichor.maesh.dev/a already resumed (retry pending)\n"},
		{name: "resume running", op: newOp("a"), args: []string{"operation", "resume", "a"},
			out: "talosoperation.ichor.maesh.dev/a already resumed\n"},
		{name: "resume waiting for the lock", op: newOp("a", waitingForLock), args: []string{"operation", "resume", "a"},
			out:    "talosoperation.ichor.maesh.dev/a already resumed\n",
			errOut: "talosoperation.ichor.maesh.dev/a is not paused by an operator: it waits for the cluster lock, held by ichor-controller/op/ops/first, and starts when that finishes (see: kubectl ichor lock)\n"},
		{name: "resume refused", op: newOp("a", refused), args: []string{"operation", "resume", "a"},
			errOut: "error: talosoperation \"a\" is Refused (preflight said no and nothing ran); nothing to resume: fix what was refused and create a new operation\n", code: 1},

		{name: "retry failed", op: newOp("a", stepFailed), args: []string{"retry", "a"},
			patch: annotationPatch, out: "talosoperation.ichor.maesh.dev/a retry requested\n",
			wantAfter: func(op *ichorv1.TalosOperation) bool { return op.RetryPending() && !op.Spec.Paused }},
		{name: "retry under operation", op: newOp("a", stepFailed), args: []string{"operation", "retry", "a"},
			patch: annotationPatch, out: "talosoperation.ichor.maesh.dev/a retry requested\n"},
		{name: "retry failed and paused", op: newOp("a", stepFailed, operatorPaused), args: []string{"retry", "a"},
			patch: annotationPatch, out: "talosoperation.ichor.maesh.dev/a retry requested\n",
			errOut:    "talosoperation.ichor.maesh.dev/a is paused by an operator: the retry runs once you resume it (kubectl ichor operation resume a)\n",
			wantAfter: func(op *ichorv1.TalosOperation) bool { return op.RetryPending() && op.Spec.Paused }},
		{name: "retry pending", op: newOp("a", stepFailed, retryPending), args: []string{"retry", "a"},
			out: "talosoperation.ichor.maesh.dev/a retry already requested (pending)\n"},
		{name: "retry running", op: newOp("a"), args: []string{"retry", "a"},
			out:    "talosoperation.ichor.maesh.dev/a has nothing to retry\n",
			errOut: "talosoperation.ichor.maesh.dev/a has no failed step (Running); retry runs a failed step again\n"},
		{name: "retry succeeded", op: newOp("a", succeeded), args: []string{"retry", "a"},
			errOut: "error: talosoperation \"a\" is Succeeded; nothing to retry\n", code: 1},
		{name: "retry missing", op: newOp("a"), args: []string{"retry", "b"},
			errOut: "Error from server (NotFound): talosoperations.ichor.maesh.dev \"b\" not found\n", code: 1},
		{name: "skip failed", op: newOp("a", stepFailed), args: []string{"operation", "skip", "a", "cp-2"},
			patch: `{"metadata":{"annotations":{"ichor.maesh.dev/skip":"cp-2"}}}`, out: "talosoperation.ichor.maesh.dev/a skip of cp-2 requested\n",
			errOut: "Ichor's cordon on cp-2, if it left one, stays: --uncordon lifts it (or kubectl uncordon cp-2)\n",
			wantAfter: func(op *ichorv1.TalosOperation) bool {
				req, ok := op.SkipRequested()
				return ok && req.Machine == "cp-2" && !req.Uncordon
			}},
		{name: "skip --uncordon", op: newOp("a", stepFailed), args: []string{"operation", "skip", "a", "cp-2", "--uncordon"},
			patch: `{"metadata":{"annotations":{"ichor.maesh.dev/skip":"cp-2","ichor.maesh.dev/skip-uncordon":"true"}}}`, out: "talosoperation.ichor.maesh.dev/a skip of cp-2 requested\n"},
		{name: "skip client dry run", op: newOp("a", stepFailed), args: []string{"operation", "skip", "a", "cp-2", "--dry-run=client"},
			out: "talosoperation.ichor.maesh.dev/a skip of cp-2 requested (dry run)\n", errOut: "Ichor's cordon on cp-2, if it left one, stays: --uncordon lifts it (or kubectl uncordon cp-2)\n"},
		{name: "skip unknown machine", op: newOp("a", stepFailed), args: []string{"operation", "skip", "a", "w-9"},
			errOut: "error: cannot skip w-9 in talosoperation \"a\": it has no machine \"w-9\"; its machines: cp-2\n", code: 1},
		{name: "skip a step in flight", op: newOp("a", func(op *ichorv1.TalosOperation) {
			op.Status.Machines = []ichorv1.MachineStatus{{Name: "w-1", Role: ichorv1.RoleWorker, Phase: ichorv1.MachineInProgress, Step: "install"}}
		}), args: []string{"operation", "skip", "a", "w-1"},
			errOut: "error: cannot skip w-1 in talosoperation \"a\": w-1 has a step in flight (install), and an irreversible call may be under way on it: wait until the step has ended, then skip it if it failed\n", code: 1},
		{name: "skip succeeded", op: newOp("a", stepFailed, succeeded), args: []string{"operation", "skip", "a", "cp-2"},
			errOut: "error: talosoperation \"a\" is Succeeded; nothing to skip\n", code: 1},
		{name: "skip pending", op: newOp("a", stepFailed, skipPending("cp-2")), args: []string{"operation", "skip", "a", "cp-2"},
			out: "talosoperation.ichor.maesh.dev/a skip of cp-2 already requested (pending)\n"},
		{name: "skip another pending", op: newOp("a", stepFailed, skipPending("w-1")), args: []string{"operation", "skip", "a", "cp-2"},
			errOut: "error: talosoperation \"a\" has a skip of w-1 pending: wait until ichor-controller has acted on it (its ichor.maesh.dev/skip annotation goes), then skip cp-2\n", code: 1},
		{name: "skip without a machine", op: newOp("a", stepFailed), args: []string{"operation", "skip", "a"},
			errOut: "error: accepts 2 arg(s), received 1\nSee 'kubectl ichor operation skip -h' for help and examples\n", code: 1},
		{name: "retry not an operation", op: newOp("a"), args: []string{"retry", "pod/a"},
			errOut: "error: \"pod/a\" is not a TalosOperation: give NAME or talosoperation/NAME\nSee 'kubectl ichor retry -h' for help and examples\n", code: 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := newFakeRun(t, tt.op)
			code := r.run(tt.args...)
			if code != tt.code {
				t.Errorf("exit code %d, want %d (stderr %q)", code, tt.code, r.errOut.String())
			}
			if r.out.String() != tt.out {
				t.Errorf("stdout %q, want %q", r.out.String(), tt.out)
			}
			if r.errOut.String() != tt.errOut {
				t.Errorf("stderr %q, want %q", r.errOut.String(), tt.errOut)
			}
			switch {
			case tt.patch == "" && len(r.patches) > 0:
				t.Errorf("sent %+v, want no patch", r.patches)
			case tt.patch != "":
				want := []sentPatch{{Name: "a", Type: types.MergePatchType, Data: tt.patch, Owner: FieldManager, DryRun: tt.dryRun}}
				if len(r.patches) != 1 || r.patches[0].Data != want[0].Data || r.patches[0].Type != want[0].Type ||
					r.patches[0].Owner != want[0].Owner || strings.Join(r.patches[0].DryRun, ",") != strings.Join(tt.dryRun, ",") {
					t.Errorf("sent %+v, want %+v", r.patches, want)
				}
			}
			if tt.wantAfter != nil {
				after := &ichorv1.TalosOperation{}
				if err := r.client.Get(context.Background(), client.ObjectKeyFromObject(tt.op), after); err != nil {
					t.Fatal(err)
				}
				if !tt.wantAfter(after) {
					t.Errorf("operation after the command is not as expected: spec.paused=%v annotations=%v", after.Spec.Paused, after.Annotations)
				}
			}
		})
	}
}

// TestControlManyNames pauses several operations in one call: each gets its
// patch, and the errors are gathered, kubectl style.
func TestControlManyNames(t *testing.T) {
	r := newFakeRun(t, newOp("a"), newOp("b", operatorPaused), newOp("c", succeeded))
	code := r.run("operation", "pause", "a", "b", "c", "d")
	if code != 1 {
		t.Errorf("exit code %d, want 1", code)
	}
	wantOut := "talosoperation.ichor.maesh.dev/a paused\ntalosoperation.ichor.maesh.dev/b already paused\n"
	if r.out.String() != wantOut {
		t.Errorf("stdout %q, want %q", r.out.String(), wantOut)
	}
	wantErr := "talosoperation \"c\" is Succeeded; nothing to pause\nError from server (NotFound): talosoperations.ichor.maesh.dev \"d\" not found\n"
	if r.errOut.String() != wantErr {
		t.Errorf("stderr %q, want %q", r.errOut.String(), wantErr)
	}
	if len(r.patches) != 1 || r.patches[0].Name != "a" {
		t.Errorf("patches %+v, want one for a", r.patches)
	}
}

func TestOutcome(t *testing.T) {
	tests := []struct {
		name     string
		op       *ichorv1.TalosOperation
		baseline int32
		done     bool
		code     int
	}{
		{"running", newOp("a"), -1, false, 0},
		{"succeeded", newOp("a", succeeded), -1, true, 0},
		{"failed", newOp("a", stepFailed), -1, true, ExitFailed},
		{"refused", newOp("a", refused), -1, true, ExitFailed},
		{"operator paused", newOp("a", operatorPaused), -1, false, 0},
		{"waiting for the lock", newOp("a", waitingForLock), -1, false, 0},
		{"failed, retry pending", newOp("a", stepFailed, retryPending), -1, false, 0},
		{"cancelled, a step in flight", newOp("a", cancelled, func(op *ichorv1.TalosOperation) {
			op.Status.Lock, op.Status.Machines[0].Phase = ichorv1.LockHeld, ichorv1.MachineInProgress
		}), -1, false, 0},
		{"cancelled and settled", newOp("a", cancelled), -1, true, ExitFailed},
		// The controller has removed the annotation but not yet cleared the
		// failure of the retry this command asked for: not the outcome.
		{"old failure after own retry", newOp("a", stepFailed), 0, false, 0},
		{"new failure after own retry", newOp("a", stepFailed, func(op *ichorv1.TalosOperation) { op.Status.RetryCount = 1 }), 0, true, ExitFailed},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			done, err := outcome(tt.op, tt.baseline, "kubectl ichor")
			code := 0
			if err != nil {
				code = err.(interface{ ExitStatus() int }).ExitStatus()
			}
			if done != tt.done || code != tt.code {
				t.Errorf("outcome = %v, exit %d (%v); want %v, exit %d", done, code, err, tt.done, tt.code)
			}
		})
	}
	_, err := outcome(newOp("a", stepFailed), -1, "ichor")
	want := "error: talosoperation.ichor.maesh.dev/a is paused by a failed step (StepFailed): upgrade cp-2: installer image pull timed out (machine cp-2, step upgrade: i/o timeout); fix the cause, then run: ichor retry a"
	if err == nil || err.Error() != want {
		t.Errorf("failure message %q, want %q", err, want)
	}
}

func TestUseColor(t *testing.T) {
	tests := []struct {
		mode          ColorMode
		tty           bool
		noColor, term string
		want          bool
	}{
		{ColorAuto, true, "", "xterm", true},
		{ColorAuto, false, "", "xterm", false},
		{ColorAuto, true, "1", "xterm", false},
		{ColorAuto, true, "", "dumb", false},
		{ColorAlways, false, "1", "dumb", true},
		{ColorNever, true, "", "xterm", false},
	}
	for _, tt := range tests {
		e := &Env{Color: tt.mode, IsTerminal: func(any) bool { return tt.tty }, Getenv: func(k string) string {
			return map[string]string{"NO_COLOR": tt.noColor, "TERM": tt.term}[k]
		}}
		if got := e.UseColor(&bytes.Buffer{}); got != tt.want {
			t.Errorf("%+v: UseColor = %v, want %v", tt, got, tt.want)
		}
	}
	var c ColorMode
	if err := c.Set("sometimes"); err == nil {
		t.Error("--color=sometimes accepted")
	}
}

func TestDisplayName(t *testing.T) {
	tests := map[string]string{
		"/usr/local/bin/kubectl-ichor":     "kubectl ichor",
		"kubectl-ichor.exe":                "kubectl ichor",
		"/home/me/.krew/bin/kubectl-ichor": "kubectl ichor",
		"/usr/bin/ichor":                   "ichor",
		"ichor":                            "ichor",
	}
	for argv0, want := range tests {
		if got := DisplayName(argv0); got != want {
			t.Errorf("DisplayName(%q) = %q, want %q", argv0, got, want)
		}
	}
}

func TestNormalizeVersion(t *testing.T) {
	tests := []struct{ in, want, err string }{
		{"v1.13.7", "v1.13.7", ""},
		{"1.13.7", "v1.13.7", ""},
		{" 1.13.7 ", "v1.13.7", ""},
		{"v1.14.0-beta.1", "v1.14.0-beta.1", ""},
		{"1.13", "", `invalid --to "v1.13": want a version like v1.13.7 (the leading v is optional)`},
		{"latest", "", `invalid --to "latest": want a version like v1.13.7 (the leading v is optional)`},
		{"", "", "--to is required: give a version like v1.13.7"},
	}
	for _, tt := range tests {
		got, err := normalizeVersion("to", tt.in)
		if got != tt.want || (err == nil) != (tt.err == "") || (err != nil && err.Error() != tt.err) {
			t.Errorf("normalizeVersion(%q) = %q, %v; want %q, %q", tt.in, got, err, tt.want, tt.err)
		}
	}
}

// TestCompletionFiltersByVerb checks that each verb offers the operations it
// can act on.
func TestCompletionFiltersByVerb(t *testing.T) {
	r := newFakeRun(t, newOp("running"), newOp("paused", operatorPaused), newOp("failed", stepFailed),
		newOp("pending-retry", stepFailed, retryPending), newOp("done", succeeded))
	tests := map[string]string{
		"pause":  "failed\npending-retry\nrunning\n",
		"resume": "failed\npaused\n",
		"retry":  "failed\n",
	}
	for verb, want := range tests {
		r.out.Reset()
		if code := r.run("__complete", "operation", verb, ""); code != 0 {
			t.Fatalf("__complete %s: exit %d: %s", verb, code, r.errOut)
		}
		got := strings.SplitN(r.out.String(), ":", 2)[0]
		if got != want {
			t.Errorf("completion of %s offers %q, want %q", verb, got, want)
		}
	}
}

// TestConfirmation asks on a terminal before a kind that can take the
// cluster down, creates it on yes, and refuses (exit 1, nothing created) on
// anything else.
func TestConfirmation(t *testing.T) {
	// No controller runs here (no leader Lease): the create says so.
	const notChecked = "down is not checked yet: no leader Lease ichor-system/ichor-controller-leader: is ichor-controller running? (see --controller-namespace); follow it with: kubectl ichor watch down\n"
	tests := []struct {
		answer  string
		created bool
		errOut  string
	}{
		{"y\n", true, "This shuts down every machine of the cluster.\nProceed? [y/N]: " + notChecked},
		{"yes\n", true, "This shuts down every machine of the cluster.\nProceed? [y/N]: " + notChecked},
		{"n\n", false, "This shuts down every machine of the cluster.\nProceed? [y/N]: error: aborted by user\n"},
		{"\n", false, "This shuts down every machine of the cluster.\nProceed? [y/N]: error: aborted by user\n"},
		{"", false, "This shuts down every machine of the cluster.\nProceed? [y/N]: error: aborted: no answer\n"},
	}
	for _, tt := range tests {
		r := newFakeRun(t)
		r.env.Streams.In = strings.NewReader(tt.answer)
		r.env.IsTerminal = func(s any) bool { return s == r.env.Streams.In }
		code := r.run("shutdown", "--name", "down")
		list := &ichorv1.TalosOperationList{}
		if err := r.client.List(context.Background(), list); err != nil {
			t.Fatal(err)
		}
		if (len(list.Items) == 1) != tt.created || (code == 0) != tt.created {
			t.Errorf("answer %q: exit %d, %d operations created", tt.answer, code, len(list.Items))
		}
		if r.errOut.String() != tt.errOut {
			t.Errorf("answer %q: stderr %q, want %q", tt.answer, r.errOut.String(), tt.errOut)
		}
		if tt.created && r.out.String() != "talosoperation.ichor.maesh.dev/down created\n" {
			t.Errorf("answer %q: stdout %q", tt.answer, r.out.String())
		}
	}
}
