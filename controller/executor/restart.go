package executor

import (
	"context"
	"fmt"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/kubectl/pkg/drain"
	podutils "k8s.io/kubectl/pkg/util/podutils"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/machine"
	"maesh.dev/ichor/controller/watchlist"
)

// restartPodsStep restarts the machine's pods that hold a projected
// ServiceAccount token signed before every API server took the new key
// (created before the swap stage finished): the kubelet renews such a
// token only when it nears its expiry, which may be a year away, and
// every API server refuses it meanwhile. Each is evicted (the Eviction
// API: PodDisruptionBudgets are honoured, a refused eviction waits and is
// asked again, and the message names the budget that holds it), one pod
// of a workload at a time: the next pod of a workload goes once the one
// before is gone and its controller has as many Ready pods as before. The
// controller's own pod goes last. Pods that nothing would bring back (bare
// pods, Jobs' pods) are not evicted: the message names them. A run again
// finds the restarted pods replaced by newer ones and restarts the rest;
// its time is the reconciler's step timeout (--step-timeout).
func restartPodsStep() Step {
	return Step{Name: StepRestartPods, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		if e.Node == nil || !machine.Ready(e.Node) {
			return Outcome{}, Fail("NodeNotReady", "%s is not Ready (%s): its pods cannot restart while its kubelet does not answer; "+
				"bring it back and retry, or skip it (kubectl ichor operation skip) and restart its pods once it is back", e.Machine.Name, notReady(e.Node))
		}
		swapped := stageFinished(e.Op, StageSASwap)
		if swapped.IsZero() {
			return Outcome{}, fmt.Errorf("stage %s has not finished: the pods to restart are those created before it did", StageSASwap)
		}
		plan, err := planRestart(ctx, e, swapped)
		if err != nil {
			return Outcome{}, err
		}
		if err := restartInRounds(ctx, e, restartRounds(plan.restart, e.Controller.Pod)); err != nil {
			return Outcome{}, Fail("RestartFailed", "%w; fix what holds it back, then retry (the pods restarted already are not restarted again)", err)
		}
		// After a restart of the controller, the pods restarted before it
		// are no longer this run's: none is left.
		return Outcome{Message: plan.words("restarted", "no pod left to restart", ichorv1.MachineMessageMax)}, nil
	}}
}

// stageFinished is when the operation's stage name finished (zero if it
// has not).
func stageFinished(op *ichorv1.TalosOperation, name string) time.Time {
	for _, s := range op.Status.Stages {
		if s.Name == name && s.FinishedAt != nil {
			return s.FinishedAt.Time
		}
	}
	return time.Time{}
}

// restartPlan is what the restart does on one machine.
type restartPlan struct {
	// restart are the pods it evicts, by namespace and name.
	restart []restartPod
	// named are the pods that hold a token of the old key but that
	// nothing would bring back: "ns/name (why)".
	named []string
}

// restartPod is a pod to restart and the workload it belongs to, as
// messages name it ("Deployment default/web").
type restartPod struct {
	pod      *corev1.Pod
	workload string
}

// planRestart lists the machine's pods and sorts them: those to restart
// (created before swapped; zero: whenever) and those to name.
func planRestart(ctx context.Context, e *Env, swapped time.Time) (restartPlan, error) {
	list, err := watchlist.Pods(ctx, e.Clientset.CoreV1().Pods(""), metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("spec.nodeName", e.Machine.Name).String()})
	if err != nil {
		return restartPlan{}, fmt.Errorf("list the pods of %s: %w", e.Machine.Name, err)
	}
	w := &workloads{cs: e.Clientset, names: map[types.UID]string{}}
	return sortPods(list.Items, swapped, func(p *corev1.Pod, ref *metav1.OwnerReference) string { return w.of(ctx, p, ref) }), nil
}

// sortPods sorts pods into those to restart, with their workloads, and
// those to name, in the order listed.
func sortPods(pods []corev1.Pod, swapped time.Time, workload func(p *corev1.Pod, ref *metav1.OwnerReference) string) restartPlan {
	var out restartPlan
	for i := range pods {
		p := &pods[i]
		restart, why := fateOf(p, swapped)
		switch {
		case restart:
			out.restart = append(out.restart, restartPod{pod: p, workload: workload(p, metav1.GetControllerOf(p))})
		case why != "":
			out.named = append(out.named, fmt.Sprintf("%s (%s)", podKey(p), why))
		}
	}
	return out
}

// fateOf says whether the pod is restarted, or else why it is named (""
// when it holds no token of the old key to renew: a mirror pod, one
// already terminating or finished, one without a projected ServiceAccount
// token, one created after swapped).
func fateOf(p *corev1.Pod, swapped time.Time) (restart bool, why string) {
	switch {
	case p.Annotations[corev1.MirrorPodAnnotationKey] != "", p.DeletionTimestamp != nil,
		p.Status.Phase == corev1.PodSucceeded, p.Status.Phase == corev1.PodFailed,
		!holdsProjectedToken(p), !swapped.IsZero() && p.CreationTimestamp.After(swapped):
		return false, ""
	}
	ref := metav1.GetControllerOf(p)
	switch {
	case ref == nil:
		return false, "no controller"
	case ref.Kind == "Job":
		return false, "Job " + ref.Name
	}
	return true, ""
}

// holdsProjectedToken reports whether the pod mounts a ServiceAccount
// token (the API access volume every pod gets unless it opts out, or one
// of its own audience).
func holdsProjectedToken(p *corev1.Pod) bool {
	for _, v := range p.Spec.Volumes {
		if v.Projected == nil {
			continue
		}
		for _, s := range v.Projected.Sources {
			if s.ServiceAccountToken != nil {
				return true
			}
		}
	}
	return false
}

// workloads names the workloads pods belong to: their controller, or the
// Deployment of a ReplicaSet, each ReplicaSet read once.
type workloads struct {
	cs    kubernetes.Interface
	names map[types.UID]string
}

func (w *workloads) of(ctx context.Context, p *corev1.Pod, ref *metav1.OwnerReference) string {
	name := ref.Kind + " " + p.Namespace + "/" + ref.Name
	if ref.Kind != "ReplicaSet" {
		return name
	}
	if n, ok := w.names[ref.UID]; ok {
		return n
	}
	rs, err := w.cs.AppsV1().ReplicaSets(p.Namespace).Get(ctx, ref.Name, metav1.GetOptions{})
	if err == nil {
		if d := metav1.GetControllerOf(rs); d != nil && d.Kind == "Deployment" {
			name = "Deployment " + p.Namespace + "/" + d.Name
		}
	}
	w.names[ref.UID] = name
	return name
}

// restartRounds orders the pods to restart in rounds, each with at most
// one pod of a workload (the first round the first pod of each, and so
// on), and the controller's own pod (self, "namespace/name") alone in the
// last: evicting it ends the process that runs the step.
func restartRounds(pods []restartPod, self string) [][]restartPod {
	var rounds [][]restartPod
	var own []restartPod
	taken := map[string]int{} // pods of each workload placed so far
	for _, rp := range pods {
		if self != "" && podKey(rp.pod) == self {
			own = append(own, rp)
			continue
		}
		i := taken[rp.workload]
		taken[rp.workload]++
		if i == len(rounds) {
			rounds = append(rounds, nil)
		}
		rounds[i] = append(rounds[i], rp)
	}
	if len(own) > 0 {
		rounds = append(rounds, own)
	}
	return rounds
}

// restartInRounds evicts each round's pods with kubectl's drain helper
// (which asks again while a budget refuses, and waits until each is
// gone), then waits until their controllers are back, before the next.
func restartInRounds(ctx context.Context, e *Env, rounds [][]restartPod) error {
	report := newDrainReport(ctx, e, "restarting")
	h := &drain.Helper{
		Ctx:                             ctx,
		Client:                          watchlist.Clientset(e.Clientset),
		GracePeriodSeconds:              -1,
		EvictErrorRetryDelay:            5 * time.Second, // kubectl drain's pause when a budget refuses
		Out:                             logWriter{e.Log},
		ErrOut:                          report,
		OnPodDeletionOrEvictionStarted:  report.started,
		OnPodDeletionOrEvictionFinished: report.finished,
	}
	if deadline, ok := ctx.Deadline(); ok {
		h.Timeout = time.Until(deadline)
	}
	for _, round := range rounds {
		before, err := readyBefore(ctx, e.Clientset, round)
		if err != nil {
			return err
		}
		pods := make([]corev1.Pod, len(round))
		for i, rp := range round {
			pods[i] = *rp.pod
		}
		if err := h.DeleteOrEvictPods(pods); err != nil {
			return err
		}
		if err := waitBack(ctx, e, round, before); err != nil {
			return err
		}
	}
	return nil
}

// readyBefore counts, for each pod of a round, the Ready pods of its
// controller right before the round.
func readyBefore(ctx context.Context, cs kubernetes.Interface, round []restartPod) ([]int, error) {
	out := make([]int, len(round))
	for i, rp := range round {
		ready, _, err := controllerReady(ctx, cs, rp.pod)
		if err != nil && !apierrors.IsNotFound(err) {
			return nil, fmt.Errorf("count the Ready pods of %s: %w", rp.workload, err)
		}
		out[i] = ready
	}
	return out, nil
}

// waitBack waits until the controller of each pod of a round has as many
// Ready pods as before it (or as it wants, when it wants fewer now), or
// the step's deadline.
func waitBack(ctx context.Context, e *Env, round []restartPod, before []int) error {
	waiting := ""
	err := wait.PollUntilContextCancel(ctx, time.Second, true, func(ctx context.Context) (bool, error) {
		for i, rp := range round {
			ready, want, err := controllerReady(ctx, e.Clientset, rp.pod)
			if apierrors.IsNotFound(err) {
				continue // its controller is gone: nothing brings the pod back
			}
			target := before[i]
			if want >= 0 {
				target = min(target, want)
			}
			if err != nil || ready < target {
				waiting = fmt.Sprintf("waiting for %s to have %d Ready pods again (%d now)", rp.workload, target, ready)
				if err != nil {
					waiting = fmt.Sprintf("waiting for %s to have %d Ready pods again: %v", rp.workload, target, err)
				}
				e.report("restarting: " + waiting)
				return false, nil
			}
		}
		return true, nil
	})
	if err != nil {
		return fmt.Errorf("%s: %w", waiting, err)
	}
	return nil
}

// controllerReady counts the Ready pods, not terminating, of the pod's
// controller, and how many it wants (-1 for a kind Ichor does not know,
// whose pods it counts across the namespace).
func controllerReady(ctx context.Context, cs kubernetes.Interface, p *corev1.Pod) (ready, want int, err error) {
	ref := metav1.GetControllerOf(p)
	sel, want, err := controllerSelector(ctx, cs, p.Namespace, ref)
	if err != nil {
		return 0, want, err
	}
	pods, err := cs.CoreV1().Pods(p.Namespace).List(ctx, metav1.ListOptions{LabelSelector: sel.String()})
	if err != nil {
		return 0, want, err
	}
	for i := range pods.Items {
		q := &pods.Items[i]
		if c := metav1.GetControllerOf(q); c != nil && c.UID == ref.UID && q.DeletionTimestamp == nil && podutils.IsPodReady(q) {
			ready++
		}
	}
	return ready, want, nil
}

// controllerSelector is the selector of the controller ref and how many
// pods it wants: its replicas, or for a DaemonSet the machines it is
// scheduled on; every pod and -1 for other kinds.
func controllerSelector(ctx context.Context, cs kubernetes.Interface, ns string, ref *metav1.OwnerReference) (labels.Selector, int, error) {
	var sel *metav1.LabelSelector
	want := -1
	switch ref.Kind {
	case "ReplicaSet":
		rs, err := cs.AppsV1().ReplicaSets(ns).Get(ctx, ref.Name, metav1.GetOptions{})
		if err != nil {
			return nil, want, err
		}
		sel, want = rs.Spec.Selector, int(ptrOr(rs.Spec.Replicas, 1))
	case "StatefulSet":
		ss, err := cs.AppsV1().StatefulSets(ns).Get(ctx, ref.Name, metav1.GetOptions{})
		if err != nil {
			return nil, want, err
		}
		sel, want = ss.Spec.Selector, int(ptrOr(ss.Spec.Replicas, 1))
	case "DaemonSet":
		ds, err := cs.AppsV1().DaemonSets(ns).Get(ctx, ref.Name, metav1.GetOptions{})
		if err != nil {
			return nil, want, err
		}
		sel, want = ds.Spec.Selector, int(ds.Status.DesiredNumberScheduled)
	default:
		return labels.Everything(), want, nil
	}
	s, err := metav1.LabelSelectorAsSelector(sel)
	return s, want, err
}

func ptrOr(p *int32, def int32) int32 {
	if p == nil {
		return def
	}
	return *p
}

// words says what the plan does, in at most budget bytes: "restarts 3
// pods: Deployment default/web (2), DaemonSet default/agent (1); not
// restarted: default/bare (no controller)", verb being "restarts" or
// "restarted", and none what it says when no pod restarts. When it does
// not all fit, the pods not restarted (which the operator must restart)
// keep at least half of the room.
func (p restartPlan) words(verb, none string, budget int) string {
	head := none
	if len(p.restart) > 0 {
		head = verb + " " + pods(len(p.restart)) + ": "
	}
	const namedHead = "; not restarted: "
	var byWorkload []string
	counts := map[string]int{}
	for _, rp := range p.restart {
		if counts[rp.workload] == 0 {
			byWorkload = append(byWorkload, rp.workload)
		}
		counts[rp.workload]++
	}
	for i, w := range byWorkload {
		byWorkload[i] = fmt.Sprintf("%s (%d)", w, counts[w])
	}
	room := budget - len(head)
	if len(p.named) > 0 {
		room -= len(namedHead)
	}
	named := fitList(p.named, room-min(len(strings.Join(byWorkload, ", ")), room/2))
	out := head + fitList(byWorkload, room-len(named))
	if len(p.named) > 0 {
		out += namedHead + named
	}
	return out
}

// fitList joins items with ", " in at most budget bytes, the last ones
// left out as "and N more" when they do not all fit.
func fitList(items []string, budget int) string {
	if all := strings.Join(items, ", "); len(all) <= budget {
		return all
	}
	out := ""
	for i, it := range items {
		next := it
		if i > 0 {
			next = out + ", " + it
		}
		if len(next)+len(fmt.Sprintf(" and %d more", len(items)-i-1)) > budget {
			if out == "" {
				return fmt.Sprintf("%d of them", len(items))
			}
			return fmt.Sprintf("%s and %d more", out, len(items)-i)
		}
		out = next
	}
	return out
}
