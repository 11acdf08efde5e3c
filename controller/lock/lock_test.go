package lock_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"testing"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/lock"
	"maesh.dev/ichor/internal/testenv"
)

var env *testenv.Env

func TestMain(m *testing.M) { os.Exit(testenv.Main(m, &env)) }

func newLock(t *testing.T) *lock.Lock {
	return &lock.Lock{Client: env.Client, Namespace: env.Namespace(t), Judge: lock.ClusterJudge{Client: env.Client}}
}

func TestAcquireAndRelease(t *testing.T) {
	ctx := context.Background()
	l := newLock(t)
	// Both holders exist and run, so neither is stale.
	var ids []string
	for _, name := range []string{"a", "b"} {
		op := &ichorv1.TalosOperation{ObjectMeta: metav1.ObjectMeta{Namespace: l.Namespace, Name: name},
			Spec: ichorv1.TalosOperationSpec{Kind: ichorv1.KindCNI}}
		if err := env.Client.Create(ctx, op); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, ichorv1.OperationIdentity(l.Namespace, name))
	}
	a, b := ids[0], ids[1]

	if st, err := l.Get(ctx); err != nil || st.Holder != "" {
		t.Fatalf("a missing Lease is a free lock: %+v %v", st, err)
	}
	res, err := l.Acquire(ctx, a)
	if err != nil || !res.Acquired {
		t.Fatalf("acquire free lock: %+v %v", res, err)
	}
	if res, err = l.Acquire(ctx, a); err != nil || !res.Acquired {
		t.Fatalf("acquire again by the holder: %+v %v", res, err)
	}
	if res, err = l.Acquire(ctx, b); err != nil || res.Acquired || res.Holder != a {
		t.Fatalf("b must wait for a: %+v %v", res, err)
	}
	if _, released, err := l.Release(ctx, b); err != nil || released {
		t.Fatalf("b released a lock it does not hold: %v %v", released, err)
	}
	if st, _ := l.Get(ctx); st.Holder != a {
		t.Fatalf("holder changed to %q", st.Holder)
	}
	if _, released, err := l.Release(ctx, a); err != nil || !released {
		t.Fatalf("release: %v %v", released, err)
	}
	if st, _ := l.Get(ctx); st.Holder != "" {
		t.Fatalf("released lock still held by %q", st.Holder)
	}
	if res, err = l.Acquire(ctx, b); err != nil || !res.Acquired || res.TookOver != "" {
		t.Fatalf("acquire after release: %+v %v", res, err)
	}
}

// TestOnlyOneWins: many takers at once, each with its own view; optimistic
// concurrency lets exactly one of them hold the lock.
func TestOnlyOneWins(t *testing.T) {
	ctx := context.Background()
	ns := env.Namespace(t)
	const takers = 8
	var wg sync.WaitGroup
	won := make(chan string, takers)
	for i := range takers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			l := &lock.Lock{Client: env.Client, Namespace: ns, Judge: neverStale{}}
			id := fmt.Sprintf("job/%s/taker-%d", ns, i)
			res, err := l.Acquire(ctx, id)
			if err != nil && !errors.Is(err, lock.ErrConflict) {
				t.Errorf("acquire %s: %v", id, err)
			}
			if err == nil && res.Acquired {
				won <- id
			}
		}()
	}
	wg.Wait()
	close(won)
	var winners []string
	for id := range won {
		winners = append(winners, id)
	}
	if len(winners) != 1 {
		t.Fatalf("winners = %v, want exactly one", winners)
	}
	l := &lock.Lock{Client: env.Client, Namespace: ns}
	if st, _ := l.Get(ctx); st.Holder != winners[0] {
		t.Fatalf("Lease holder %q, winner %q", st.Holder, winners[0])
	}
}

type neverStale struct{}

func (neverStale) Stale(context.Context, string) (bool, string, error) { return false, "", nil }

func TestTakeoverRules(t *testing.T) {
	ctx := context.Background()
	ns := env.Namespace(t)
	mkOp := func(name string, paused bool, st ichorv1.TalosOperationStatus, spec ...ichorv1.TalosOperationSpec) string {
		op := &ichorv1.TalosOperation{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
			Spec: ichorv1.TalosOperationSpec{Kind: ichorv1.KindCNI, Paused: paused}}
		if len(spec) > 0 {
			op.Spec = spec[0]
		}
		if err := env.Client.Create(ctx, op); err != nil {
			t.Fatal(err)
		}
		op.Status = st
		if err := env.Client.Status().Update(ctx, op); err != nil {
			t.Fatal(err)
		}
		return ichorv1.OperationIdentity(ns, name)
	}
	mkNode := func(name string, ready bool) string {
		n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: ns + "-" + name, Labels: map[string]string{ichorv1.ControlPlaneLabel: ""}}}
		if err := env.Client.Create(ctx, n); err != nil {
			t.Fatal(err)
		}
		status := corev1.ConditionFalse
		if ready {
			status = corev1.ConditionTrue
		}
		n.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: status}}
		if err := env.Client.Status().Update(ctx, n); err != nil {
			t.Fatal(err)
		}
		return n.Name
	}
	mkJob := func(name string, done batchv1.JobConditionType) string {
		job := &batchv1.Job{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}, Spec: batchv1.JobSpec{
			Template: corev1.PodTemplateSpec{Spec: corev1.PodSpec{RestartPolicy: corev1.RestartPolicyNever,
				Containers: []corev1.Container{{Name: "helm", Image: "helm"}}}}}}
		if err := env.Client.Create(ctx, job); err != nil {
			t.Fatal(err)
		}
		if done != "" {
			now := metav1.Now()
			job.Status.StartTime = &now
			job.Status.CompletionTime = &now
			job.Status.Conditions = []batchv1.JobCondition{{Type: done, Status: corev1.ConditionTrue, LastTransitionTime: now}}
			if done == batchv1.JobComplete {
				job.Status.Conditions = append([]batchv1.JobCondition{{Type: batchv1.JobSuccessCriteriaMet, Status: corev1.ConditionTrue, LastTransitionTime: now}}, job.Status.Conditions...)
				job.Status.Succeeded = 1
			} else {
				job.Status.CompletionTime = nil
				job.Status.Failed = 1
				job.Status.Conditions = append([]batchv1.JobCondition{{Type: batchv1.JobFailureTarget, Status: corev1.ConditionTrue, LastTransitionTime: now}}, job.Status.Conditions...)
			}
			if err := env.Client.Status().Update(ctx, job); err != nil {
				t.Fatal(err)
			}
		}
		return ichorv1.JobIdentity(ns, name)
	}
	failed := ichorv1.TalosOperationStatus{Phase: ichorv1.PhasePaused, Reason: ichorv1.ReasonStepFailed, FailureReason: "upgrade w1: boom"}
	resetSpec := func(node string) ichorv1.TalosOperationSpec {
		return ichorv1.TalosOperationSpec{Kind: ichorv1.KindNode, Node: &ichorv1.NodeAction{Machine: node, Action: ichorv1.NodeReset}}
	}
	readyResetting := mkNode("cp-resetting", true)
	mkOp("reset-op", false, ichorv1.TalosOperationStatus{Phase: ichorv1.PhaseRunning}, resetSpec(readyResetting))

	tests := []struct {
		name   string
		holder string
		stale  bool
		why    string
	}{
		{"operation deleted", ichorv1.OperationIdentity(ns, "gone"), true, "deleted"},
		{"operation completed", mkOp("done", false, ichorv1.TalosOperationStatus{Phase: ichorv1.PhaseSucceeded}), true, "completed"},
		{"operation refused", mkOp("refused", false, ichorv1.TalosOperationStatus{Phase: ichorv1.PhaseRefused}), true, "refused"},
		{"operation paused on a failed step", mkOp("failed", false, failed), true, "paused on a failed step"},
		{"operation paused by an operator keeps it", mkOp("op-paused", true, ichorv1.TalosOperationStatus{Phase: ichorv1.PhasePaused, Reason: ichorv1.ReasonPausedByOperator}), false, ""},
		{"failed and operator-paused keeps it", mkOp("both", true, failed), false, ""},
		{"operation running keeps it", mkOp("running", false, ichorv1.TalosOperationStatus{Phase: ichorv1.PhaseRunning}), false, ""},
		{"machine whose Node is gone", ichorv1.MachineIdentity(ns + "-nope"), true, "node gone"},
		{"machine still joining", ichorv1.MachineIdentity(mkNode("cp-joining", false)), false, ""},
		{"machine joined", ichorv1.MachineIdentity(mkNode("cp-joined", true)), true, "join or removal done"},
		{"machine being reset", ichorv1.MachineIdentity(readyResetting), false, ""},
		{"job deleted", ichorv1.JobIdentity(ns, "gone"), true, "deleted"},
		{"job complete", mkJob("complete", batchv1.JobComplete), true, "finished"},
		{"job failed", mkJob("failed", batchv1.JobFailed), true, "finished"},
		{"job running", mkJob("running", ""), false, ""},
		{"identity Ichor does not know", "someone/else", false, ""},
	}
	judge := lock.ClusterJudge{Client: env.Client}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			stale, why, err := judge.Stale(ctx, tt.holder)
			if err != nil || stale != tt.stale || why != tt.why {
				t.Fatalf("Stale(%s) = %v %q %v, want %v %q", tt.holder, stale, why, err, tt.stale, tt.why)
			}
			// And through the Lease: a taker takes over exactly the stale holders.
			l := &lock.Lock{Client: env.Client, Namespace: env.Namespace(t), Judge: judge}
			if res, err := l.Acquire(ctx, tt.holder); err != nil || !res.Acquired {
				t.Fatalf("seed holder: %+v %v", res, err)
			}
			res, err := l.Acquire(ctx, ichorv1.OperationIdentity(ns, "taker"))
			if err != nil {
				t.Fatal(err)
			}
			if res.Acquired != tt.stale {
				t.Fatalf("taker acquired=%v, want %v (holder %s)", res.Acquired, tt.stale, res.Holder)
			}
			if tt.stale {
				st, _ := l.Get(ctx)
				if want := tt.holder + " (" + tt.why + ")"; st.TakenOverFrom != want || res.TookOver != want {
					t.Errorf("takeover note %q / %q, want %q", st.TakenOverFrom, res.TookOver, want)
				}
			}
		})
	}
}

// An operation lends the lock to its Job in one write and takes it back
// once the Job is done: in between nobody else can take it, not even when
// the Job has finished, as long as the operation goes on.
func TestLendToJob(t *testing.T) {
	ctx := context.Background()
	l := newLock(t)
	ns := l.Namespace
	var ids []string
	for _, name := range []string{"lender", "other"} {
		op := &ichorv1.TalosOperation{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
			Spec: ichorv1.TalosOperationSpec{Kind: ichorv1.KindCNI}}
		if err := env.Client.Create(ctx, op); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, ichorv1.OperationIdentity(ns, name))
	}
	lender, other := ids[0], ids[1]
	job := &batchv1.Job{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "cilium"}, Spec: batchv1.JobSpec{
		Template: corev1.PodTemplateSpec{Spec: corev1.PodSpec{RestartPolicy: corev1.RestartPolicyNever,
			Containers: []corev1.Container{{Name: "helm", Image: "helm"}}}}}}
	if err := env.Client.Create(ctx, job); err != nil {
		t.Fatal(err)
	}
	borrower := ichorv1.JobIdentity(ns, job.Name)

	if err := l.Lend(ctx, lender, borrower); err == nil {
		t.Fatal("lent a lock the lender does not hold")
	}
	if res, err := l.Acquire(ctx, lender); err != nil || !res.Acquired {
		t.Fatalf("acquire: %+v %v", res, err)
	}
	for range 2 { // lending again changes nothing
		if err := l.Lend(ctx, lender, borrower); err != nil {
			t.Fatal(err)
		}
	}
	st, _ := l.Get(ctx)
	if st.Holder != borrower || st.LentBy != lender || !st.Holds(lender) || !st.Holds(borrower) || st.Holds(other) {
		t.Fatalf("after lending: %+v", st)
	}
	// The Job's init container finds it holds the lock; the lender still does.
	for _, id := range []string{borrower, lender} {
		if res, err := l.Acquire(ctx, id); err != nil || !res.Acquired {
			t.Fatalf("%s acquire while lent: %+v %v", id, res, err)
		}
	}
	if st2, _ := l.Get(ctx); st2.Holder != borrower {
		t.Fatalf("the lender's acquire took the lock back from the running Job: %+v", st2)
	}
	// The Job finishes: it is stale, but the lender is not, so the lock stays.
	now := metav1.Now()
	job.Status.StartTime, job.Status.CompletionTime, job.Status.Succeeded = &now, &now, 1
	job.Status.Conditions = []batchv1.JobCondition{
		{Type: batchv1.JobSuccessCriteriaMet, Status: corev1.ConditionTrue, LastTransitionTime: now},
		{Type: batchv1.JobComplete, Status: corev1.ConditionTrue, LastTransitionTime: now}}
	if err := env.Client.Status().Update(ctx, job); err != nil {
		t.Fatal(err)
	}
	if res, err := l.Acquire(ctx, other); err != nil || res.Acquired {
		t.Fatalf("another holder took a lent lock whose lender goes on: %+v %v", res, err)
	}
	if ok, err := l.Reclaim(ctx, other); err != nil || ok {
		t.Fatalf("a holder that did not lend it reclaimed it: %v %v", ok, err)
	}
	if ok, err := l.Reclaim(ctx, lender); err != nil || !ok {
		t.Fatalf("reclaim: %v %v", ok, err)
	}
	if st, _ := l.Get(ctx); st.Holder != lender || st.LentBy != "" {
		t.Fatalf("after reclaiming: %+v", st)
	}
	// A borrower's release gives it back, never frees it.
	if err := l.Lend(ctx, lender, borrower); err != nil {
		t.Fatal(err)
	}
	if _, released, err := l.Release(ctx, borrower); err != nil || !released {
		t.Fatalf("release by the borrower: %v %v", released, err)
	}
	if st, _ := l.Get(ctx); st.Holder != lender || st.LentBy != "" {
		t.Fatalf("after the borrower's release: %+v", st)
	}
	// Once the lender is gone too, the finished Job's lock is taken over.
	if err := l.Lend(ctx, lender, borrower); err != nil {
		t.Fatal(err)
	}
	if err := env.Client.Delete(ctx, &ichorv1.TalosOperation{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "lender"}}); err != nil {
		t.Fatal(err)
	}
	res, err := l.Acquire(ctx, other)
	if err != nil || !res.Acquired {
		t.Fatalf("taking over from a finished Job whose lender is gone: %+v %v", res, err)
	}
	if want := borrower + " (finished; lent by " + lender + ", deleted)"; res.TookOver != want {
		t.Fatalf("took over %q, want %q", res.TookOver, want)
	}
	if st, _ := l.Get(ctx); st.LentBy != "" {
		t.Fatalf("the taker's lock still says it was lent: %+v", st)
	}
}
