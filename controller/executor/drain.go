package executor

import (
	"context"
	"fmt"
	"regexp"
	"sort"
	"strings"
	"sync"

	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
)

// drainReport turns a drain's progress into the step's message (through
// Env.Progress): how many pods are left and, while evictions are refused,
// which PodDisruptionBudget holds them and how many pods it holds. It is
// the drain helper's ErrOut and its eviction callbacks.
type drainReport struct {
	ctx context.Context
	e   *Env
	// doing names what the evictions are for: "draining", "restarting".
	doing string
	mu    sync.Mutex
	// left are the pods being evicted or deleted that are not gone yet;
	// held maps each one whose eviction a budget refused to that budget.
	left map[string]bool
	held map[string]string
	last string
}

func newDrainReport(ctx context.Context, e *Env, doing string) *drainReport {
	return &drainReport{ctx: ctx, e: e, doing: doing, left: map[string]bool{}, held: map[string]string{}}
}

func podKey(p *corev1.Pod) string { return p.Namespace + "/" + p.Name }

// started is called before every eviction attempt of a pod. A pod a
// budget held stays held until it is gone: the message changes when
// something does, not with every attempt.
func (r *drainReport) started(pod *corev1.Pod, _ bool) {
	r.mu.Lock()
	known := r.left[podKey(pod)]
	r.left[podKey(pod)] = true
	r.mu.Unlock()
	if !known {
		r.report()
	}
}

// finished is called when a pod is gone (or its eviction failed for good).
func (r *drainReport) finished(pod *corev1.Pod, _ bool, _ error) {
	r.mu.Lock()
	delete(r.left, podKey(pod))
	delete(r.held, podKey(pod))
	r.mu.Unlock()
	r.report()
}

// refused matches the drain helper's line for an eviction the API server
// refused with 429 (a disruption budget allows no disruption now).
var refused = regexp.MustCompile(`^error when evicting pods/"([^"]+)" -n "([^"]+)" \(will retry after [^)]*\): (.*disruption budget.*)$`)

// Write takes the drain helper's error lines.
func (r *drainReport) Write(p []byte) (int, error) {
	r.e.Log.V(1).Info(strings.TrimSpace(string(p)))
	for _, line := range strings.Split(strings.TrimSpace(string(p)), "\n") {
		m := refused.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		budget := r.budget(m[2], m[1])
		r.mu.Lock()
		r.held[m[2]+"/"+m[1]] = budget
		r.mu.Unlock()
	}
	r.report()
	return len(p), nil
}

// budget describes the PodDisruptionBudget that holds the pod: one that
// selects it, preferably one that allows no disruption now (its status
// may already have moved on since the refusal).
func (r *drainReport) budget(ns, name string) string {
	pod, err := r.e.Clientset.CoreV1().Pods(ns).Get(r.ctx, name, metav1.GetOptions{})
	if err != nil {
		return "a PodDisruptionBudget"
	}
	pdbs, err := r.e.Clientset.PolicyV1().PodDisruptionBudgets(ns).List(r.ctx, metav1.ListOptions{})
	if err != nil {
		return "a PodDisruptionBudget"
	}
	var match *policyv1.PodDisruptionBudget
	for i := range pdbs.Items {
		pdb := &pdbs.Items[i]
		sel, err := metav1.LabelSelectorAsSelector(pdb.Spec.Selector)
		if err != nil || sel.Empty() || !sel.Matches(labels.Set(pod.Labels)) {
			continue
		}
		if match == nil || pdb.Status.DisruptionsAllowed == 0 && match.Status.DisruptionsAllowed > 0 {
			match = pdb
		}
	}
	if match == nil {
		return "a PodDisruptionBudget"
	}
	return describeBudget(match)
}

// describeBudget is "PodDisruptionBudget ns/web (minAvailable 3, 3 of 4 healthy)".
func describeBudget(pdb *policyv1.PodDisruptionBudget) string {
	rule := ""
	switch {
	case pdb.Spec.MinAvailable != nil:
		rule = "minAvailable " + pdb.Spec.MinAvailable.String()
	case pdb.Spec.MaxUnavailable != nil:
		rule = "maxUnavailable " + pdb.Spec.MaxUnavailable.String()
	}
	return fmt.Sprintf("PodDisruptionBudget %s/%s (%s, %d of %d healthy)", pdb.Namespace, pdb.Name, rule, pdb.Status.CurrentHealthy, pdb.Status.ExpectedPods)
}

// report sets the step's message when it changed.
func (r *drainReport) report() {
	r.mu.Lock()
	msg := r.message()
	changed := msg != r.last
	r.last = msg
	r.mu.Unlock()
	if changed {
		r.e.report(msg)
	}
}

func (r *drainReport) message() string {
	if len(r.left) == 0 {
		return ""
	}
	msg := fmt.Sprintf("%s: %s left", r.doing, pods(len(r.left)))
	byBudget := map[string]int{}
	for _, b := range r.held {
		byBudget[b]++
	}
	var holds []string
	for b, n := range byBudget {
		holds = append(holds, fmt.Sprintf("%s holds %s", b, pods(n)))
	}
	sort.Strings(holds)
	if len(holds) > 0 {
		msg += "; waiting: " + strings.Join(holds, "; ")
	}
	return msg
}

func pods(n int) string {
	if n == 1 {
		return "1 pod"
	}
	return fmt.Sprintf("%d pods", n)
}

// notReady says why a Node is not Ready, from its Ready condition: the
// kubelet's own words or the node-lifecycle controller's.
func notReady(n *corev1.Node) string {
	if n == nil {
		return "its Node is gone"
	}
	for _, c := range n.Status.Conditions {
		if c.Type == corev1.NodeReady {
			return fmt.Sprintf("Node Ready=%s: %s: %s", c.Status, c.Reason, c.Message)
		}
	}
	return "its Node reports no Ready condition"
}
