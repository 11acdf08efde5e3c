package operation_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/sim"
)

// runningJob creates a Job that has not finished.
func (c *cluster) runningJob(name string) *batchv1.Job {
	c.t.Helper()
	job := &batchv1.Job{ObjectMeta: metav1.ObjectMeta{Namespace: c.ns, Name: name}, Spec: batchv1.JobSpec{
		Template: corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Annotations: map[string]string{sim.RunForAnnotation: "1h"}},
			Spec: corev1.PodSpec{RestartPolicy: corev1.RestartPolicyNever,
				Containers: []corev1.Container{{Name: "helm", Image: "helm"}}}}}}
	if err := env.Client.Create(context.Background(), job); err != nil {
		c.t.Fatal(err)
	}
	return job
}

// finishJob marks a Job complete, as the Job controller would (which may
// run too, and change the Job meanwhile).
func (c *cluster) finishJob(job *batchv1.Job) {
	c.t.Helper()
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		if err := env.Client.Get(context.Background(), client.ObjectKeyFromObject(job), job); err != nil {
			return err
		}
		now := metav1.Now()
		start := job.Status.StartTime // the Job controller's, if it set one: immutable
		if start == nil {
			start = &now
		}
		job.Status = batchv1.JobStatus{StartTime: start, CompletionTime: &now, Succeeded: 1, Conditions: []batchv1.JobCondition{
			{Type: batchv1.JobSuccessCriteriaMet, Status: corev1.ConditionTrue, LastTransitionTime: now},
			{Type: batchv1.JobComplete, Status: corev1.ConditionTrue, LastTransitionTime: now}}}
		return env.Client.Status().Update(context.Background(), job)
	})
	if err != nil {
		c.t.Fatal(err)
	}
}

// holdLeaseFor writes the lock Lease as a holder outside the controller
// would have taken it.
func (c *cluster) holdLeaseFor(identity string) {
	c.t.Helper()
	now := metav1.NewMicroTime(time.Now())
	lease := &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Namespace: c.ctrlNS, Name: ichorv1.LockLeaseName},
		Spec: coordinationv1.LeaseSpec{HolderIdentity: ptr.To(identity), AcquireTime: &now}}
	if err := env.Client.Create(context.Background(), lease); err != nil {
		c.t.Fatal(err)
	}
}

// TestWaitersInCreationOrder: one `kubectl apply -f` creates three
// operations within a second, in an order their names sort against. They
// queue behind a Job that holds the lock, a new controller takes over while
// they wait, and they run in the order the API server created them.
func TestWaitersInCreationOrder(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 1, 3))
	job := c.runningJob("cilium-helm")
	c.holdLeaseFor(ichorv1.JobIdentity(c.ns, job.Name))
	first := c.start()
	names := []string{"z-first", "m-second", "a-third"}
	workers := map[string]string{}
	manifest := ""
	for i, name := range names {
		workers[name] = c.fleet.Machines()[1+i].Name()
		manifest += fmt.Sprintf("---\napiVersion: ichor.maesh.dev/v1alpha1\nkind: TalosOperation\nmetadata: {name: %s, namespace: %s}\nspec: {kind: node, node: {machine: %s, action: reboot}}\n",
			name, c.ns, workers[name])
	}
	path := filepath.Join(t.TempDir(), "ops.yaml")
	if err := os.WriteFile(path, []byte(manifest), 0o600); err != nil {
		t.Fatal(err)
	}
	c.kubectl("apply", "-f", path)
	for _, name := range names {
		op := c.waitFor(name, "to wait for the Job", time.Minute, func(op *ichorv1.TalosOperation) bool {
			return op.WaitingForLock()
		})
		t.Logf("%s created %s", name, op.CreationTimestamp.UTC().Format(time.RFC3339))
	}
	// A restarted controller (or a new leader) orders them the same way.
	first.Stop()
	c.start()
	c.finishJob(job)
	var last time.Time
	for i, name := range names {
		c.waitSucceeded(name, time.Minute)
		acts := c.fleet.Recorder().Actions(workers[name])
		if len(acts) == 0 {
			t.Fatalf("%s rebooted nothing", name)
		}
		if acts[0].Start.Before(last) {
			t.Errorf("%s ran before %s, which the API server created before it", name, names[i-1])
		}
		last = acts[0].Start
	}
}
