package lockcmd

import (
	"bytes"
	"context"
	"os"
	"strings"
	"testing"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/lock"
	"maesh.dev/ichor/internal/testenv"
)

var env *testenv.Env

func TestMain(m *testing.M) { os.Exit(testenv.Main(m, &env)) }

// run runs `ichor-controller lock args...` and returns its output and error.
func run(t *testing.T, ctx context.Context, args ...string) (string, error) {
	t.Helper()
	c, err := client.NewWithWatch(env.Config, client.Options{Scheme: testenv.Scheme})
	if err != nil {
		t.Fatal(err)
	}
	cmd := newCommand(&options{recheck: 100 * time.Millisecond, client: c})
	var out bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&out)
	cmd.SetArgs(args)
	err = cmd.ExecuteContext(ctx)
	return out.String(), err
}

func job(t *testing.T, ns, name string) *batchv1.Job {
	t.Helper()
	j := &batchv1.Job{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}, Spec: batchv1.JobSpec{
		Template: corev1.PodTemplateSpec{Spec: corev1.PodSpec{RestartPolicy: corev1.RestartPolicyNever,
			Containers: []corev1.Container{{Name: "helm", Image: "helm"}}}}}}
	if err := env.Client.Create(context.Background(), j); err != nil {
		t.Fatal(err)
	}
	return j
}

func TestLockCommand(t *testing.T) {
	ctx := context.Background()
	ns := env.Namespace(t)
	first := job(t, ns, "cilium-helm")
	firstID := ichorv1.JobIdentity(ns, first.Name)
	secondID := ichorv1.JobIdentity(ns, job(t, ns, "other").Name)

	out, err := run(t, ctx, "acquire", "--namespace", ns, "--identity", firstID)
	if err != nil || out != "cluster lock taken by "+firstID+"\n" {
		t.Fatalf("acquire a free lock: %q %v", out, err)
	}
	_, err = run(t, ctx, "acquire", "--namespace", ns, "--identity", secondID)
	if err == nil || err.Error() != "the cluster lock is not free: held by "+firstID+"; use --wait to wait for it" {
		t.Fatalf("acquire a held lock without --wait: %v", err)
	}
	for identity, want := range map[string]string{
		"nobody":                               "--identity",
		ichorv1.JobIdentity(ns, "missing"):     "Job " + ns + "/missing not found: name the Job this runs in",
		ichorv1.OperationIdentity(ns, "an-op"): "only a Job takes the lock with this command",
	} {
		if _, err := run(t, ctx, "acquire", "--namespace", ns, "--identity", identity); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("acquire --identity %s: %v, want an error with %q", identity, err, want)
		}
	}

	// --wait returns once the holder is stale: its Job finished.
	done := make(chan error, 1)
	var waited string
	go func() {
		var err error
		waited, err = run(t, ctx, "acquire", "--namespace", ns, "--identity", secondID, "--wait", "--timeout", "1m")
		done <- err
	}()
	l := &lock.Lock{Client: env.Client, Namespace: ns}
	if st, _ := l.Get(ctx); st.Holder.Identity != firstID || st.Holder.UID != first.UID {
		t.Fatalf("holder %s", st.Holder)
	}
	now := metav1.Now()
	first.Status = batchv1.JobStatus{StartTime: &now, CompletionTime: &now, Succeeded: 1, Conditions: []batchv1.JobCondition{
		{Type: batchv1.JobSuccessCriteriaMet, Status: corev1.ConditionTrue, LastTransitionTime: now},
		{Type: batchv1.JobComplete, Status: corev1.ConditionTrue, LastTransitionTime: now}}}
	if err := env.Client.Status().Update(ctx, first); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil || !strings.Contains(waited, "cluster lock taken by "+secondID+", over from "+firstID+" (finished)") {
			t.Fatalf("acquire --wait: %q %v", waited, err)
		}
	case <-time.After(time.Minute):
		t.Fatal("acquire --wait did not return after the holder finished")
	}

	out, err = run(t, ctx, "release", "--namespace", ns, "--identity", firstID)
	if err != nil || out != firstID+" does not hold the cluster lock; nothing to release\n" {
		t.Fatalf("release by a non-holder: %q %v", out, err)
	}
	out, err = run(t, ctx, "release", "--namespace", ns, "--identity", secondID)
	if err != nil || out != "cluster lock released by "+secondID+"\n" {
		t.Fatalf("release: %q %v", out, err)
	}
	if st, _ := l.Get(ctx); !st.Free() {
		t.Fatalf("still held by %s", st.Holder)
	}

	// --wait gives up at its timeout, saying whom it waited for.
	if _, err := run(t, ctx, "acquire", "--namespace", ns, "--identity", firstID); err != nil {
		t.Fatal(err)
	}
	job(t, ns, "still-running")
	if _, err := run(t, ctx, "release", "--namespace", ns, "--identity", firstID); err != nil {
		t.Fatal(err)
	}
	if _, err := run(t, ctx, "acquire", "--namespace", ns, "--identity", ichorv1.JobIdentity(ns, "still-running")); err != nil {
		t.Fatal(err)
	}
	_, err = run(t, ctx, "acquire", "--namespace", ns, "--identity", secondID, "--wait", "--timeout", "300ms")
	if err == nil || !strings.Contains(err.Error(), "held by "+ichorv1.JobIdentity(ns, "still-running")) {
		t.Fatalf("acquire --wait past its timeout: %v", err)
	}
}

// reboot creates an operation that wants the cluster lock.
func reboot(t *testing.T, ns, name string) *ichorv1.TalosOperation {
	t.Helper()
	op := &ichorv1.TalosOperation{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: ichorv1.TalosOperationSpec{Kind: ichorv1.KindNode, Node: &ichorv1.NodeAction{Machine: "w-1", Action: ichorv1.NodeReboot}}}
	if err := env.Client.Create(context.Background(), op); err != nil {
		t.Fatal(err)
	}
	return op
}

// TestJobHonoursTheQueue: a Job that asks for the cluster lock waits for the
// operations created before it, even when the lock is free to take (its
// holder finished), and the operations created after it wait for it.
func TestJobHonoursTheQueue(t *testing.T) {
	ctx := context.Background()
	ns := env.Namespace(t)
	judge := lock.ClusterJudge{Client: env.Client}
	l := &lock.Lock{Client: env.Client, Namespace: ns, Judge: judge, Queue: lock.ClusterQueue{Operations: env.Client, Judge: judge}}
	holder := job(t, ns, "holder")
	if _, err := run(t, ctx, "acquire", "--namespace", ns, "--identity", ichorv1.JobIdentity(ns, holder.Name)); err != nil {
		t.Fatal(err)
	}
	older := reboot(t, ns, "older")
	waiter := job(t, ns, "cilium-helm")
	waiterID := ichorv1.JobIdentity(ns, waiter.Name)
	finish(t, holder)

	// The lock is free to take over, but the older operation goes first.
	olderID := ichorv1.OperationIdentity(ns, older.Name)
	if _, err := run(t, ctx, "acquire", "--namespace", ns, "--identity", waiterID); err == nil || !strings.Contains(err.Error(), olderID+" goes first") {
		t.Fatalf("acquire with an older operation waiting: %v, want %q", err, olderID+" goes first")
	}
	done := make(chan error, 1)
	var waited string
	go func() {
		var err error
		waited, err = run(t, ctx, "acquire", "--namespace", ns, "--identity", waiterID, "--wait", "--timeout", "1m")
		done <- err
	}()
	testenv.Eventually(t, time.Minute, "the Job to queue in the Lease", func(ctx context.Context) (bool, error) {
		st, err := l.Get(ctx)
		_, queued := st.Place(lock.ForJob(waiter))
		return queued, err
	})
	// An operation created after the Job waits for it; the older one takes the lock.
	newer := reboot(t, ns, "newer")
	newerPlace := newer.QueuePlace()
	newerReq := lock.Request{Holder: lock.ForOperation(newer, ichorv1.OperationIdentity(ns, newer.Name)), Place: &newerPlace}
	if res, err := l.Acquire(ctx, newerReq); err != nil || res.Acquired || res.Ahead != olderID {
		t.Fatalf("the newer operation: %+v %v, want it to wait for %s", res, err, olderID)
	}
	olderPlace := older.QueuePlace()
	if res, err := l.Acquire(ctx, lock.Request{Holder: lock.ForOperation(older, olderID), Place: &olderPlace}); err != nil || !res.Acquired {
		t.Fatalf("the older operation: %+v %v, want it to take the lock", res, err)
	}
	older.Status.Phase = ichorv1.PhaseSucceeded
	if err := env.Client.Status().Update(ctx, older); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil || !strings.Contains(waited, "cluster lock taken by "+waiterID+", over from "+olderID+" (completed)") {
			t.Fatalf("acquire --wait: %q %v", waited, err)
		}
	case <-time.After(time.Minute):
		t.Fatal("acquire --wait did not return after the older operation completed")
	}
	if res, err := l.Acquire(ctx, newerReq); err != nil || res.Acquired || res.Holder != waiterID {
		t.Fatalf("the newer operation: %+v %v, want it to wait for %s", res, err, waiterID)
	}
}

// finish marks a Job complete, as the Job controller would.
func finish(t *testing.T, j *batchv1.Job) {
	t.Helper()
	now := metav1.Now()
	j.Status = batchv1.JobStatus{StartTime: &now, CompletionTime: &now, Succeeded: 1, Conditions: []batchv1.JobCondition{
		{Type: batchv1.JobSuccessCriteriaMet, Status: corev1.ConditionTrue, LastTransitionTime: now},
		{Type: batchv1.JobComplete, Status: corev1.ConditionTrue, LastTransitionTime: now}}}
	if err := env.Client.Status().Update(context.Background(), j); err != nil {
		t.Fatal(err)
	}
}
