package executor

import (
	"context"
	"fmt"
	"strings"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/lock"
)

// Labels and annotations on the Jobs an operation starts.
const (
	// JobOperationUIDLabel names the operation a Job works for.
	JobOperationUIDLabel = ichorv1.JobOperationUIDLabel
	// JobOperationAnnotation is the operation's namespace/name: a change of
	// the Job wakes that operation.
	JobOperationAnnotation = "ichor.maesh.dev/operation"
	// JobMainContainer is the container that does a Job's work (after the
	// lock init container).
	JobMainContainer = "work"
	// JobLockContainer is the init container that takes the cluster lock.
	JobLockContainer = "lock"
	// Binary is the path of ichor-controller in its image.
	Binary = "/ichor-controller"
)

// job is a Job an operation starts: its init container takes the cluster
// lock as job/<namespace>/<name> (which the operation lends it), then its
// container runs ichor-controller with args in image.
type job struct {
	namespace, name, image, serviceAccount string
	args                                   []string
}

// jobName is the Job of this operation, step and attempt: a rerun of the
// step finds the Job it started, a retry starts a new one.
func jobName(e *Env, what string) string {
	uid := strings.ReplaceAll(string(e.Op.UID), "-", "")
	if len(uid) > 10 {
		uid = uid[:10]
	}
	return fmt.Sprintf("ichor-%s-%s-%d", what, uid, e.Machine.Attempts)
}

func (j job) identity() string { return ichorv1.JobIdentity(j.namespace, j.name) }

func (j job) object(e *Env) *batchv1.Job {
	sc := &corev1.SecurityContext{
		AllowPrivilegeEscalation: ptr.To(false),
		ReadOnlyRootFilesystem:   ptr.To(true),
		Capabilities:             &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}},
	}
	container := func(name, image string, args []string) corev1.Container {
		return corev1.Container{Name: name, Image: image, Command: []string{Binary}, Args: args,
			SecurityContext: sc, TerminationMessagePolicy: corev1.TerminationMessageFallbackToLogsOnError}
	}
	lockArgs := []string{"lock", "acquire", "--identity", j.identity(), "--namespace", e.Controller.Namespace, "--wait"}
	return &batchv1.Job{
		ObjectMeta: metav1.ObjectMeta{
			Namespace: j.namespace, Name: j.name,
			Labels: map[string]string{"app.kubernetes.io/part-of": "ichor", "app.kubernetes.io/managed-by": "ichor-controller",
				JobOperationUIDLabel: string(e.Op.UID)},
			Annotations: map[string]string{JobOperationAnnotation: e.Op.Namespace + "/" + e.Op.Name},
		},
		Spec: batchv1.JobSpec{
			// A failed run is a failed step, retried by a new Job: never by itself.
			BackoffLimit: ptr.To[int32](0),
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{"app.kubernetes.io/part-of": "ichor", JobOperationUIDLabel: string(e.Op.UID)}},
				Spec: corev1.PodSpec{
					ServiceAccountName: j.serviceAccount,
					RestartPolicy:      corev1.RestartPolicyNever,
					SecurityContext:    &corev1.PodSecurityContext{RunAsNonRoot: ptr.To(true), SeccompProfile: &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault}},
					// It must run while machines are cordoned and on control planes.
					Tolerations:       []corev1.Toleration{{Operator: corev1.TolerationOpExists}},
					PriorityClassName: "system-cluster-critical",
					InitContainers:    []corev1.Container{container(JobLockContainer, j.image, lockArgs)},
					Containers:        []corev1.Container{container(JobMainContainer, j.image, j.args)},
				},
			},
		},
	}
}

// start creates the Job (a rerun finds it) and lends it the cluster lock,
// in this order: a lock lent to a Job that does not exist yet would be
// judged stale and taken over. Until the lend, the Job's init container
// waits for the lock like any holder.
func (j job) start(ctx context.Context, e *Env) error {
	obj := j.object(e)
	err := e.Kube.Create(ctx, obj)
	if apierrors.IsAlreadyExists(err) {
		// A rerun: lend to the Job that exists, by its UID.
		err = e.Live.Get(ctx, client.ObjectKeyFromObject(obj), obj)
	}
	if err != nil {
		return Fail("JobNotCreated", "create Job %s/%s: %w", j.namespace, j.name, err)
	}
	if err := e.Lock.Lend(ctx, e.Holder, lock.ForJob(obj)); err != nil {
		return fmt.Errorf("lend the cluster lock to Job %s/%s: %w", j.namespace, j.name, err)
	}
	return nil
}

// jobResult is where a Job stands.
type jobResult struct {
	done, failed bool
	// message says what the Job waits for or why it failed (its container's
	// termination message, the end of its log).
	message string
}

// state reads the Job from the API server and, when it failed, why.
func (j job) state(ctx context.Context, e *Env) (jobResult, error) {
	got, err := e.Clientset.BatchV1().Jobs(j.namespace).Get(ctx, j.name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return jobResult{failed: true, message: fmt.Sprintf("Job %s/%s is gone before it finished; a retry starts a new one", j.namespace, j.name)}, nil
	}
	if err != nil {
		return jobResult{}, fmt.Errorf("read Job %s/%s: %w", j.namespace, j.name, err)
	}
	for _, c := range got.Status.Conditions {
		if c.Status != corev1.ConditionTrue {
			continue
		}
		switch c.Type {
		case batchv1.JobComplete:
			return jobResult{done: true}, nil
		case batchv1.JobFailed:
			why := j.podFailure(ctx, e)
			if why == "" {
				why = c.Message
			}
			return jobResult{failed: true, message: fmt.Sprintf("Job %s/%s failed: %s (`kubectl logs -n %s job/%s --all-containers`)",
				j.namespace, j.name, why, j.namespace, j.name)}, nil
		}
	}
	if got.Status.Active == 0 {
		return jobResult{message: fmt.Sprintf("Job %s/%s is starting", j.namespace, j.name)}, nil
	}
	return jobResult{message: fmt.Sprintf("Job %s/%s is running", j.namespace, j.name)}, nil
}

// podFailure is the termination message of the Job's failed container.
func (j job) podFailure(ctx context.Context, e *Env) string {
	pods, err := e.Clientset.CoreV1().Pods(j.namespace).List(ctx, metav1.ListOptions{LabelSelector: batchv1.JobNameLabel + "=" + j.name})
	if err != nil {
		return ""
	}
	for _, p := range pods.Items {
		for _, cs := range append(p.Status.InitContainerStatuses, p.Status.ContainerStatuses...) {
			if t := cs.State.Terminated; t != nil && t.ExitCode != 0 {
				msg := strings.TrimSpace(t.Message)
				if i := strings.LastIndex(msg, "\n"); i >= 0 {
					msg = msg[i+1:]
				}
				if msg == "" {
					msg = t.Reason
				}
				return fmt.Sprintf("container %s exited %d: %s", cs.Name, t.ExitCode, msg)
			}
		}
	}
	return ""
}
