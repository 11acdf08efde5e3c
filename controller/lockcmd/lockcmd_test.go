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
	if err == nil || err.Error() != "the cluster lock is held by "+firstID+"; use --wait to wait for it" {
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
