package commands

import (
	"testing"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"maesh.dev/ichor/plugin/view"
)

func TestJobRun(t *testing.T) {
	running := corev1.ContainerState{Running: &corev1.ContainerStateRunning{}}
	ended := func(code int32, msg string) corev1.ContainerState {
		return corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: code, Message: msg}}
	}
	pod := func(phase corev1.PodPhase, lock, work corev1.ContainerState) *corev1.Pod {
		return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "kube-system", Name: "p"}, Status: corev1.PodStatus{Phase: phase,
			InitContainerStatuses: []corev1.ContainerStatus{{Name: "lock", State: lock}},
			ContainerStatuses:     []corev1.ContainerStatus{{Name: "work", State: work}}}}
	}
	done := func(typ batchv1.JobConditionType) []batchv1.JobCondition {
		return []batchv1.JobCondition{{Type: typ, Status: corev1.ConditionTrue}}
	}
	for _, tc := range []struct {
		name       string
		conditions []batchv1.JobCondition
		pod        *corev1.Pod
		want       view.JobRun
		logsOf     string
	}{
		{"no pod yet", nil, nil, view.JobRun{Phase: "Pending (no pod yet)"}, ""},
		{"waiting for the lock", nil, pod(corev1.PodPending, running, corev1.ContainerState{}), view.JobRun{Phase: "waiting for the cluster lock"}, "lock"},
		{"working", nil, pod(corev1.PodRunning, ended(0, ""), running), view.JobRun{Phase: "Running"}, "work"},
		{"succeeded", done(batchv1.JobComplete), pod(corev1.PodSucceeded, ended(0, ""), ended(0, "upgraded\ncilium 1.19.6")),
			view.JobRun{Phase: "Succeeded", LastLine: "cilium 1.19.6"}, ""},
		{"failed, the failed container's message", done(batchv1.JobFailed), pod(corev1.PodFailed, ended(0, "took the lock"), ended(1, "step one\nerror: chart digest mismatch")),
			view.JobRun{Phase: "Failed", LastLine: "error: chart digest mismatch"}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			job := &batchv1.Job{ObjectMeta: metav1.ObjectMeta{Namespace: "kube-system", Name: "ichor-cni-1"}, Status: batchv1.JobStatus{Conditions: tc.conditions}}
			tc.want.Namespace, tc.want.Name = job.Namespace, job.Name
			got, logsOf := jobRun(job, tc.pod)
			if got != tc.want || logsOf != tc.logsOf {
				t.Errorf("jobRun = %+v, logs of %q; want %+v, logs of %q", got, logsOf, tc.want, tc.logsOf)
			}
		})
	}
}
