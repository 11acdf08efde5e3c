package sim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
	"k8s.io/kubectl/pkg/util/podutils"
)

// Pod annotations that change what a machine's kubelet does with a pod whose
// containers do not run a binary (Kubelet.Binaries). Values that do not
// parse are ignored, with a log line.
const (
	// ReadyAfterAnnotation is how long the pod's containers take to become
	// ready once started (a Go duration, like "2s"); default
	// Durations.PodReady. It applies to every pod.
	ReadyAfterAnnotation = "sim.ichor.maesh.dev/ready-after"
	// RunForAnnotation is how long the containers run before they exit (a
	// Go duration). Default: Durations.JobPod for a Job's pod; other pods
	// run until deleted.
	RunForAnnotation = "sim.ichor.maesh.dev/run-for"
	// ExitCodeAnnotation is the exit code of containers that exit (default 0).
	ExitCodeAnnotation = "sim.ichor.maesh.dev/exit-code"
)

// Exit codes and reasons the container runtime reports.
const (
	exitStartError = 128 // the process could not be started (containerd's StartError)
	exitLost       = 255 // the container died with its machine
	reasonLost     = "Unknown"
)

// kubelet is the part of every machine's kubelet that runs pods, for a whole
// fleet: each pod bound to one of its Nodes is started (init containers in
// order, then the containers), becomes Running and then Ready, has its
// containers exit as their process or the pod's annotations say, goes
// NotReady while its machine is down and restarts (restart counts up) when
// it boots, goes with the machine on a reset, and is removed once its grace
// period ends when deleted. Everything is driven by the fleet's Pod informer
// and the machines' transitions; timers only time what a container does.
type kubelet struct {
	k *kube

	mu   sync.Mutex
	pods map[types.UID]*podRun
	// ips is the last pod IP handed out per machine.
	ips map[string]int
	// removing holds the pods whose removal after their grace period is due.
	removing map[types.UID]bool
	dir      string // Kubelet.Dir, or a temporary one made on first use
	tempDir  bool
}

func newKubelet(k *kube) *kubelet {
	return &kubelet{k: k, pods: map[types.UID]*podRun{}, ips: map[string]int{}, removing: map[types.UID]bool{}}
}

// validate reports the problems of a Kubelet spec.
func (s Kubelet) validate() []error {
	var errs []error
	if s.NodeLease < 0 {
		errs = append(errs, fmt.Errorf("Kubelet.NodeLease %s: use 0 (no Leases) or a positive duration", s.NodeLease))
	}
	for pattern, bin := range s.Binaries {
		if _, err := path.Match(pattern, ""); err != nil {
			errs = append(errs, fmt.Errorf("Kubelet.Binaries: image pattern %q: %w", pattern, err))
		}
		if st, err := os.Stat(bin); err != nil || st.IsDir() || st.Mode()&0o111 == 0 {
			errs = append(errs, fmt.Errorf("Kubelet.Binaries[%q]: %s is not an executable file", pattern, bin))
		}
	}
	return errs
}

// podRun is what one pod's kubelet knows: the state of its containers.
type podRun struct {
	kl  *kubelet
	m   *Machine
	uid types.UID

	mu    sync.Mutex
	pod   *corev1.Pod // as first seen: its spec does not change
	phase corev1.PodPhase
	start metav1.Time
	ip    string
	init  []*ctr
	main  []*ctr
	// initDone counts the init containers that completed in this sandbox.
	initDone int
	// sandbox is false while the machine is down (no containers run).
	sandbox bool
	// gen changes whenever the containers start over, so that timers and
	// process exits of an earlier start are ignored.
	gen    int
	timers []*time.Timer
	dead   bool // deleted, or the fleet stopped: nothing more happens
}

// ctr is one container's state, as the runtime reports it.
type ctr struct {
	spec     corev1.Container
	init     bool
	state    corev1.ContainerState
	last     corev1.ContainerState
	ready    bool
	restarts int32
	id       string
	proc     *process
}

// podChanged plays the kubelet's part for a pod bound to one of the fleet's
// Nodes: a new one starts (if its machine runs), one being deleted
// (deletionTimestamp set, also after an eviction) is stopped and removed
// once its grace period (at most Durations.PodGrace) ends.
func (kl *kubelet) podChanged(pod *corev1.Pod) {
	m := kl.k.f.byName[pod.Spec.NodeName]
	if m == nil {
		return
	}
	if pod.DeletionTimestamp != nil {
		kl.terminate(m, pod)
		return
	}
	kl.mu.Lock()
	run := kl.pods[pod.UID]
	if run == nil && !m.Down() && !terminal(pod.Status.Phase) {
		run = &podRun{kl: kl, m: m, uid: pod.UID, pod: pod.DeepCopy()}
		kl.pods[pod.UID] = run
		kl.mu.Unlock()
		run.do(run.startSandbox)
		return
	}
	kl.mu.Unlock()
	if run != nil && !m.Down() {
		// As the kubelet's status manager does: a status someone else
		// changed (the node-lifecycle controller marks the pods of a Node
		// it saw NotReady) is set back to what runs.
		run.resync(pod)
	}
}

// resync writes the pod's status again when the API server's phase or
// readiness differs from what the kubelet runs.
func (r *podRun) resync(pod *corev1.Pod) {
	r.mu.Lock()
	if r.dead || !r.sandbox {
		r.mu.Unlock()
		return
	}
	ready := r.phase == corev1.PodRunning
	for _, c := range r.main {
		ready = ready && c.ready
	}
	inSync := pod.Status.Phase == r.phase && podutils.IsPodReady(pod) == ready
	r.mu.Unlock()
	if !inSync {
		r.do(func() {})
	}
}

// podGone forgets a pod that left the API server.
func (kl *kubelet) podGone(pod *corev1.Pod) {
	kl.mu.Lock()
	run := kl.pods[pod.UID]
	delete(kl.pods, pod.UID)
	kl.mu.Unlock()
	if run != nil {
		run.do(func() { run.stop(true) })
		kl.removeFiles(pod)
	}
	if m := kl.k.f.byName[pod.Spec.NodeName]; m != nil && isMirror(pod) && !m.Down() {
		// A mirror pod deleted by someone comes back: the static pod runs.
		kl.k.staticPods(m, true)
	}
}

func terminal(p corev1.PodPhase) bool { return p == corev1.PodSucceeded || p == corev1.PodFailed }

// down stops the machine's pods as the machine goes down: their containers
// die (and show so), they turn NotReady, and stay so until it boots.
func (kl *kubelet) down(m *Machine) {
	for _, run := range kl.runsOn(m) {
		run.do(func() {
			run.stop(false)
			for _, c := range run.containers() {
				if c.state.Running != nil {
					c.state = terminatedState(c, exitLost, reasonLost, fmt.Sprintf("machine %s went down", m.Name()))
				}
				c.ready = false
			}
			run.sandbox = false
		})
	}
}

// boot restarts the machine's pods when it is back: their containers start
// again from the first init container, each one that ran counting a
// restart, and pods bound to it while it was down start for the first time.
func (kl *kubelet) boot(m *Machine) {
	for _, run := range kl.runsOn(m) {
		run.do(run.restartSandbox)
	}
	for _, pod := range kl.k.podsOn(m) {
		if pod.DeletionTimestamp != nil {
			kl.terminate(m, pod)
		} else {
			kl.podChanged(pod)
		}
	}
}

// reset removes every pod bound to the machine at once: a reset wipes
// what ran there. Controllers make new ones.
func (kl *kubelet) reset(ctx context.Context, m *Machine) {
	zero := int64(0)
	for _, pod := range kl.k.podsOn(m) {
		err := kl.k.cs.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{
			GracePeriodSeconds: &zero, Preconditions: &metav1.Preconditions{UID: &pod.UID},
		})
		if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
			kl.k.f.logf("%s: reset: remove pod %s/%s: %v", m.Name(), pod.Namespace, pod.Name, err)
		}
	}
}

// stopAll ends every process when the fleet stops.
func (kl *kubelet) stopAll() {
	kl.mu.Lock()
	runs := make([]*podRun, 0, len(kl.pods))
	for _, r := range kl.pods {
		runs = append(runs, r)
	}
	kl.mu.Unlock()
	for _, run := range runs {
		run.mu.Lock()
		run.stop(true)
		run.mu.Unlock()
	}
	kl.mu.Lock()
	dir, temp := kl.dir, kl.tempDir
	kl.mu.Unlock()
	if temp {
		_ = os.RemoveAll(dir)
	}
}

func (kl *kubelet) runsOn(m *Machine) []*podRun {
	kl.mu.Lock()
	defer kl.mu.Unlock()
	var out []*podRun
	for _, r := range kl.pods {
		if r.m == m {
			out = append(out, r)
		}
	}
	return out
}

// terminate stops a pod being deleted and removes it once its grace period
// ends; a machine that is down does it when it is back (boot).
func (kl *kubelet) terminate(m *Machine, pod *corev1.Pod) {
	kl.mu.Lock()
	run := kl.pods[pod.UID]
	if kl.removing[pod.UID] {
		kl.mu.Unlock()
		return
	}
	kl.removing[pod.UID] = true
	kl.mu.Unlock()
	grace := kl.k.f.spec.Durations.PodGrace
	if s := pod.DeletionGracePeriodSeconds; s != nil && time.Duration(*s)*time.Second < grace {
		grace = time.Duration(*s) * time.Second
	}
	if run != nil {
		run.do(func() { run.signal(grace) })
	}
	time.AfterFunc(grace, func() { kl.removePod(m, pod) })
}

// removePod deletes a terminating pod for good.
func (kl *kubelet) removePod(m *Machine, pod *corev1.Pod) {
	done := func() {
		kl.mu.Lock()
		delete(kl.removing, pod.UID)
		kl.mu.Unlock()
	}
	if kl.k.f.ctx.Err() != nil || m.Down() {
		done()
		return
	}
	ctx, cancel := kl.k.ctx()
	defer cancel()
	zero := int64(0)
	err := kl.k.cs.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{
		GracePeriodSeconds: &zero,
		Preconditions:      &metav1.Preconditions{UID: &pod.UID},
	})
	done()
	if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) && kl.k.f.ctx.Err() == nil {
		kl.k.f.logf("%s: remove pod %s/%s: %v (retrying)", m.Name(), pod.Namespace, pod.Name, err)
		time.AfterFunc(kl.k.f.spec.Durations.PodGrace, func() { kl.terminate(m, pod) })
	}
}

// nextIP hands out the machine's next pod IP: 10.A.B.C, with A.B the
// machine's index in the fleet and C cycling through 2..254.
func (kl *kubelet) nextIP(m *Machine) string {
	idx := 0
	for i, x := range kl.k.f.machines {
		if x == m {
			idx = i
			break
		}
	}
	kl.mu.Lock()
	defer kl.mu.Unlock()
	n := kl.ips[m.Name()]%253 + 1
	kl.ips[m.Name()] = n
	return fmt.Sprintf("10.%d.%d.%d", 1+idx/256, idx%256, n+1)
}

// do runs f with the pod's lock held and then writes its status, unless the
// pod is gone.
func (r *podRun) do(f func()) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.dead {
		return
	}
	f()
	if !r.dead {
		r.writeStatus()
	}
}

// after runs f (through do) after d, unless the containers started over
// or stopped since.
func (r *podRun) after(d time.Duration, f func()) {
	gen := r.gen
	t := time.AfterFunc(d, func() {
		r.do(func() {
			if r.gen == gen && r.sandbox {
				f()
			}
		})
	})
	r.timers = append(r.timers, t)
}

func (r *podRun) containers() []*ctr { return append(append([]*ctr(nil), r.init...), r.main...) }

// startSandbox starts a pod for the first time.
func (r *podRun) startSandbox() {
	r.start = metav1.Now()
	r.phase = corev1.PodPending
	if r.pod.Spec.HostNetwork {
		r.ip = r.m.addr
	} else {
		r.ip = r.kl.nextIP(r.m)
	}
	for _, c := range r.pod.Spec.InitContainers {
		r.init = append(r.init, &ctr{spec: c, init: true, state: waitingState("PodInitializing")})
	}
	for _, c := range r.pod.Spec.Containers {
		r.main = append(r.main, &ctr{spec: c, state: waitingState("PodInitializing")})
	}
	r.sandbox = true
	r.next()
}

// restartSandbox starts the containers again after the machine booted.
func (r *podRun) restartSandbox() {
	if terminal(r.phase) {
		return
	}
	r.sandbox = true
	if r.pod.Spec.RestartPolicy == corev1.RestartPolicyNever && r.initDone == len(r.init) {
		// Containers that died with the machine do not run again.
		r.phase = r.finalPhase()
		return
	}
	r.initDone = 0
	for _, c := range r.containers() {
		if c.state.Terminated != nil || c.state.Running != nil {
			c.last, c.restarts = c.state, c.restarts+1
		}
		c.state, c.ready = waitingState("PodInitializing"), false
	}
	r.next()
}

// next starts what comes next: the next init container, or the containers.
func (r *podRun) next() {
	r.gen++
	if r.initDone < len(r.init) {
		r.startContainer(r.init[r.initDone])
		return
	}
	r.phase = corev1.PodRunning
	for _, c := range r.main {
		r.startContainer(c)
	}
}

func (r *podRun) startContainer(c *ctr) {
	c.id = "containerd://" + strings.ReplaceAll(uuid.NewString(), "-", "")
	c.state = corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: metav1.Now()}}
	c.ready = false
	gen := r.gen
	if bin, ok := r.kl.binaryFor(c.spec.Image); ok {
		proc, err := r.spawn(c, bin, func(code int, msg string) {
			r.do(func() {
				if r.gen == gen && r.sandbox {
					r.exited(c, code, msg)
				}
			})
		})
		if err != nil {
			r.kl.k.f.logf("%s: pod %s/%s: container %s: %v", r.m.Name(), r.pod.Namespace, r.pod.Name, c.spec.Name, err)
			c.state = terminatedState(c, exitStartError, "StartError", err.Error())
			r.exited(c, exitStartError, err.Error())
			return
		}
		c.proc = proc
	} else if runFor, ok := r.runFor(); ok || c.init {
		if c.init && !ok {
			runFor = r.readyAfter()
		}
		code := r.annotationInt(ExitCodeAnnotation)
		r.after(runFor, func() { r.exited(c, code, "") })
	}
	if !c.init {
		r.after(r.readyAfter(), func() {
			if c.state.Running != nil {
				c.ready = true
			}
		})
	}
}

// exited records a container's exit and what follows from it: the next
// init container, a restart (restartPolicy), or the pod's end.
func (r *podRun) exited(c *ctr, code int, msg string) {
	c.proc = nil
	reason := "Completed"
	if code != 0 {
		reason = "Error"
	}
	if c.state.Terminated == nil || c.state.Terminated.Reason != "StartError" {
		c.state = terminatedState(c, code, reason, msg)
	}
	c.ready = false
	policy := r.pod.Spec.RestartPolicy
	restart := policy == corev1.RestartPolicyAlways || (policy == corev1.RestartPolicyOnFailure && code != 0)
	if c.init {
		restart = code != 0 && policy != corev1.RestartPolicyNever
		if code == 0 {
			r.initDone++
			r.next()
			return
		}
	}
	if restart {
		// The kubelet's back-off, short: the container runs again.
		r.after(r.readyAfter(), func() {
			c.last, c.restarts = c.state, c.restarts+1
			r.startContainer(c)
		})
		return
	}
	if c.init {
		r.phase = corev1.PodFailed
		return
	}
	for _, o := range r.main {
		if o.state.Terminated == nil {
			return
		}
	}
	r.phase = r.finalPhase()
}

// finalPhase is Succeeded when every container exited 0, else Failed.
func (r *podRun) finalPhase() corev1.PodPhase {
	for _, c := range r.containers() {
		if t := c.state.Terminated; t == nil || t.ExitCode != 0 {
			return corev1.PodFailed
		}
	}
	return corev1.PodSucceeded
}

// signal asks the pod's processes to stop (SIGTERM, SIGKILL after grace),
// as the kubelet does when a pod is deleted.
func (r *podRun) signal(grace time.Duration) {
	r.gen++ // a pod being deleted restarts nothing
	for _, c := range r.containers() {
		if c.proc != nil {
			c.proc.terminate(grace)
		}
	}
}

// stop cancels the pod's timers and kills its processes; with forget, the
// pod is done for good.
func (r *podRun) stop(forget bool) {
	for _, t := range r.timers {
		t.Stop()
	}
	r.timers = nil
	r.gen++
	for _, c := range r.containers() {
		if c.proc != nil {
			c.proc.kill()
			c.proc = nil
		}
	}
	if forget {
		r.dead = true
	}
}

func (r *podRun) readyAfter() time.Duration {
	if d, ok := r.annotationDuration(ReadyAfterAnnotation); ok {
		return d
	}
	return r.kl.k.f.spec.Durations.PodReady
}

// runFor says how long containers without a binary run before they exit.
func (r *podRun) runFor() (time.Duration, bool) {
	if d, ok := r.annotationDuration(RunForAnnotation); ok {
		return d, true
	}
	if ref := metav1.GetControllerOf(r.pod); ref != nil && ref.Kind == "Job" {
		return r.kl.k.f.spec.Durations.JobPod, true
	}
	return 0, false
}

func (r *podRun) annotationDuration(key string) (time.Duration, bool) {
	v, ok := r.pod.Annotations[key]
	if !ok {
		return 0, false
	}
	d, err := time.ParseDuration(v)
	if err != nil || d < 0 {
		r.kl.k.f.logf("pod %s/%s: annotation %s=%q is not a duration; ignored", r.pod.Namespace, r.pod.Name, key, v)
		return 0, false
	}
	return d, true
}

func (r *podRun) annotationInt(key string) int {
	v, ok := r.pod.Annotations[key]
	if !ok {
		return 0
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 0 || n > 255 {
		r.kl.k.f.logf("pod %s/%s: annotation %s=%q is not an exit code (0-255); ignored", r.pod.Namespace, r.pod.Name, key, v)
		return 0
	}
	return n
}

func waitingState(reason string) corev1.ContainerState {
	return corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: reason}}
}

func terminatedState(c *ctr, code int, reason, msg string) corev1.ContainerState {
	t := &corev1.ContainerStateTerminated{ExitCode: int32(code), Reason: reason, Message: msg, FinishedAt: metav1.Now(), ContainerID: c.id}
	if c.state.Running != nil {
		t.StartedAt = c.state.Running.StartedAt
	}
	return corev1.ContainerState{Terminated: t}
}

// writeStatus patches the pod's status with what the kubelet owns: phase,
// IPs, its four conditions and the container statuses. Conditions others
// own (PodScheduled, DisruptionTarget) stay as they are.
func (r *podRun) writeStatus() {
	ctx, cancel := r.kl.k.ctx()
	defer cancel()
	// The UID is a precondition, as the kubelet's status patch has it: a
	// pod deleted and made again under its name (a StatefulSet's) is
	// another pod, which this run must not write (its IP would merge into
	// the new pod's podIPs, two of one family, and every later write of
	// the new pod's kubelet would be refused).
	data, err := json.Marshal(map[string]any{"metadata": map[string]any{"uid": r.uid}, "status": r.status()})
	if err != nil {
		r.kl.k.f.logf("pod %s/%s: status: %v", r.pod.Namespace, r.pod.Name, err)
		return
	}
	_, err = r.kl.k.cs.CoreV1().Pods(r.pod.Namespace).Patch(ctx, r.pod.Name, types.StrategicMergePatchType, data, metav1.PatchOptions{}, "status")
	switch {
	case apierrors.IsNotFound(err), apierrors.IsConflict(err):
		r.stop(true)
	case err != nil && r.kl.k.f.ctx.Err() == nil && !errors.Is(err, context.Canceled):
		r.kl.k.f.logf("pod %s/%s: write status: %v", r.pod.Namespace, r.pod.Name, err)
	}
}

// status is the pod status the kubelet reports, as a strategic merge patch:
// container states name all three of running, waiting and terminated so
// that the one that no longer holds is cleared.
func (r *podRun) status() map[string]any {
	now := metav1.Now()
	allReady := r.sandbox && r.phase == corev1.PodRunning
	var unready, uninit []string
	for _, c := range r.main {
		if !c.ready {
			allReady = false
			unready = append(unready, c.spec.Name)
		}
	}
	for i, c := range r.init {
		if i >= r.initDone {
			uninit = append(uninit, c.spec.Name)
		}
	}
	cond := func(typ corev1.PodConditionType, ok bool, reason, msg string) map[string]any {
		c := map[string]any{"type": typ, "status": corev1.ConditionFalse, "lastTransitionTime": now, "reason": reason, "message": msg}
		if ok {
			c["status"], c["reason"], c["message"] = corev1.ConditionTrue, nil, nil
		}
		if prev := r.condition(typ); prev != nil && (prev.Status == corev1.ConditionTrue) == ok {
			c["lastTransitionTime"] = prev.LastTransitionTime
		}
		return c
	}
	readyReason, readyMsg := "ContainersNotReady", fmt.Sprintf("containers with unready status: [%s]", strings.Join(unready, " "))
	if terminal(r.phase) {
		readyReason, readyMsg = "PodCompleted", ""
	}
	initOK := len(uninit) == 0 || r.phase == corev1.PodSucceeded
	st := map[string]any{
		"phase":     r.phase,
		"hostIP":    r.m.addr,
		"hostIPs":   replaceList(map[string]string{"ip": r.m.addr}),
		"podIP":     r.ip,
		"podIPs":    replaceList(map[string]string{"ip": r.ip}),
		"startTime": r.start,
		"conditions": []map[string]any{
			cond(corev1.PodReadyToStartContainers, r.sandbox, "", ""),
			cond(corev1.PodInitialized, initOK, "ContainersNotInitialized", fmt.Sprintf("containers with incomplete status: [%s]", strings.Join(uninit, " "))),
			cond(corev1.ContainersReady, allReady, readyReason, readyMsg),
			cond(corev1.PodReady, allReady, readyReason, readyMsg),
		},
		"containerStatuses": containerStatuses(r.main),
	}
	if len(r.init) > 0 {
		st["initContainerStatuses"] = containerStatuses(r.init)
	}
	return st
}

// replaceList is a strategic-merge-patch list that replaces the one the API
// has instead of merging into it by key, as the kubelet's patch (two-way,
// from the pod's status in the API) deletes the addresses it no longer
// reports: a pod bound to a Node name that a machine of another address
// had before keeps none of that machine's, which would make two of one
// family, and every status write refused.
func replaceList(items ...map[string]string) []map[string]string {
	return append(items, map[string]string{"$patch": "replace"})
}

func (r *podRun) condition(typ corev1.PodConditionType) *corev1.PodCondition {
	obj, ok, _ := r.kl.k.pods.GetIndexer().GetByKey(r.pod.Namespace + "/" + r.pod.Name)
	if !ok {
		return nil
	}
	for _, c := range obj.(*corev1.Pod).Status.Conditions {
		if c.Type == typ {
			return &c
		}
	}
	return nil
}

func containerStatuses(cs []*ctr) []map[string]any {
	out := make([]map[string]any, 0, len(cs))
	for _, c := range cs {
		started := c.state.Running != nil
		st := map[string]any{
			"name": c.spec.Name, "image": c.spec.Image, "imageID": imageID(c.spec.Image),
			"ready": c.ready, "started": started, "restartCount": c.restarts,
			"state": stateJSON(c.state), "lastState": stateJSON(c.last),
		}
		if c.id != "" {
			st["containerID"] = c.id
		}
		out = append(out, st)
	}
	return out
}

func stateJSON(s corev1.ContainerState) map[string]any {
	out := map[string]any{"running": nil, "waiting": nil, "terminated": nil}
	switch {
	case s.Running != nil:
		out["running"] = s.Running
	case s.Waiting != nil:
		out["waiting"] = s.Waiting
	case s.Terminated != nil:
		out["terminated"] = s.Terminated
	}
	return out
}

// imageID is the image's digest as the runtime reports it, made up.
func imageID(image string) string { return pinned(image) }

// binaryFor finds the executable an image runs (Kubelet.Binaries).
func (kl *kubelet) binaryFor(image string) (string, bool) {
	for pattern, bin := range kl.k.f.spec.Kubelet.Binaries {
		if ok, _ := path.Match(pattern, image); ok {
			return bin, true
		}
	}
	return "", false
}

// The fleet's hooks into the kubelets. A nil kube (no API server) has
// none: each does nothing.

// kubeletStarted is a machine's kubelet starting with the fleet: it holds
// its Node Lease and mirrors its static pods.
func (k *kube) kubeletStarted(m *Machine) {
	if k == nil {
		return
	}
	k.leases.up(m)
	k.staticPods(m, true)
}

// resumePods is the kubelet of a machine that booted: its Lease renewed
// again, its static pods back, its pods restarted and the pods deleted
// while it was down removed.
func (k *kube) resumePods(m *Machine) {
	if k == nil {
		return
	}
	k.leases.up(m)
	k.staticPods(m, true)
	k.kubelet.boot(m)
}

// resetPods removes the machine's pods: a reset wipes what ran there.
func (k *kube) resetPods(ctx context.Context, m *Machine) {
	if k == nil || !k.f.apiStores() {
		return
	}
	k.kubelet.reset(ctx, m)
}

// configChanged re-renders a control plane's static pods, in the
// background, after a change of its active configuration (a new image
// replaces the pod).
func (k *kube) configChanged(m *Machine) {
	if k == nil || m.Down() || k.f.ctx.Err() != nil {
		return
	}
	k.f.wg.Go(func() { k.staticPods(m, true) })
}

func (k *kube) podChanged(obj any) {
	if pod, ok := obj.(*corev1.Pod); ok {
		k.kubelet.podChanged(pod)
	}
}

func (k *kube) podDeleted(obj any) {
	if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = tomb.Obj
	}
	if pod, ok := obj.(*corev1.Pod); ok {
		k.kubelet.podGone(pod)
	}
	k.mu.Lock()
	close(k.podsGone)
	k.podsGone = make(chan struct{})
	k.mu.Unlock()
}

func isMirror(pod *corev1.Pod) bool {
	_, ok := pod.Annotations[corev1.MirrorPodAnnotationKey]
	return ok
}
