package commands

import (
	"context"
	"slices"
	"strings"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/plugin/view"
)

// podLogs returns the last line a pod's container logged.
type podLogs func(ctx context.Context, namespace, pod, container string) (string, error)

// lockContainer is the init container of Ichor's Jobs that takes the
// cluster lock (controller/executor's JobLockContainer).
const lockContainer = "lock"

// operationJobs reads the Jobs an operation started (found by their
// ichor.maesh.dev/operation-uid label, in any namespace) and where each
// one's newest pod stands. What the user may not read is left out.
func operationJobs(ctx context.Context, c client.Reader, logs podLogs, op *ichorv1.TalosOperation) []view.JobRun {
	var jobs batchv1.JobList
	if err := c.List(ctx, &jobs, client.MatchingLabels{ichorv1.JobOperationUIDLabel: string(op.UID)}); err != nil {
		return nil
	}
	slices.SortFunc(jobs.Items, func(a, b batchv1.Job) int { return a.CreationTimestamp.Compare(b.CreationTimestamp.Time) })
	var out []view.JobRun
	for i := range jobs.Items {
		job := &jobs.Items[i]
		var pods corev1.PodList
		var newest *corev1.Pod
		if err := c.List(ctx, &pods, client.InNamespace(job.Namespace), client.MatchingLabels{batchv1.JobNameLabel: job.Name}); err == nil {
			for j := range pods.Items {
				if newest == nil || newest.CreationTimestamp.Before(&pods.Items[j].CreationTimestamp) {
					newest = &pods.Items[j]
				}
			}
		}
		run, container := jobRun(job, newest)
		if container != "" && logs != nil {
			if line, err := logs(ctx, newest.Namespace, newest.Name, container); err == nil && line != "" {
				run.LastLine = line
			}
		}
		out = append(out, run)
	}
	return out
}

// jobRun says where a Job stands from the Job and its newest pod (nil when
// it has none), and which container's log to read for its last line.
func jobRun(job *batchv1.Job, pod *corev1.Pod) (view.JobRun, string) {
	run := view.JobRun{Namespace: job.Namespace, Name: job.Name, Phase: "Pending"}
	for _, c := range job.Status.Conditions {
		if c.Status == corev1.ConditionTrue && (c.Type == batchv1.JobComplete || c.Type == batchv1.JobFailed) {
			run.Phase = "Succeeded"
			if c.Type == batchv1.JobFailed {
				run.Phase = "Failed"
			}
		}
	}
	if pod == nil {
		if run.Phase == "Pending" {
			run.Phase = "Pending (no pod yet)"
		}
		return run, ""
	}
	statuses := append(slices.Clone(pod.Status.InitContainerStatuses), pod.Status.ContainerStatuses...)
	if run.Phase == "Pending" {
		run.Phase = string(pod.Status.Phase)
	}
	var ended *corev1.ContainerStatus
	for i := range statuses {
		st := &statuses[i]
		switch {
		case st.State.Running != nil && st.Name == lockContainer:
			run.Phase = "waiting for the cluster lock"
			return run, st.Name
		case st.State.Running != nil:
			return run, st.Name
		case st.State.Terminated != nil:
			if ended == nil || st.State.Terminated.ExitCode != 0 || ended.State.Terminated.ExitCode == 0 {
				ended = st
			}
		}
	}
	if ended != nil {
		msg := strings.TrimSpace(ended.State.Terminated.Message)
		run.LastLine = msg[strings.LastIndex(msg, "\n")+1:]
	}
	return run, ""
}

// lastLogLine is podLogs through the API server (pods/log).
func (e *Env) lastLogLine(ctx context.Context, namespace, pod, container string) (string, error) {
	cs, err := e.Factory.KubernetesClientSet()
	if err != nil {
		return "", err
	}
	raw, err := cs.CoreV1().Pods(namespace).GetLogs(pod, &corev1.PodLogOptions{Container: container, TailLines: ptr.To[int64](1)}).DoRaw(ctx)
	if err != nil {
		return "", err
	}
	s := strings.TrimSpace(string(raw))
	return s[strings.LastIndex(s, "\n")+1:], nil
}
