package sim_test

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/kubectl/pkg/util/podutils"
	"k8s.io/utils/ptr"

	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

// waitPod waits until the pod satisfies cond and returns it.
func waitPod(t *testing.T, ns, name, what string, cond func(*corev1.Pod) bool) *corev1.Pod {
	t.Helper()
	var last *corev1.Pod
	defer func() {
		if t.Failed() && last != nil {
			t.Logf("pod %s last seen: phase %s, conditions %+v, containers %+v", name, last.Status.Phase, last.Status.Conditions, last.Status.ContainerStatuses)
		}
	}()
	testenv.Eventually(t, 30*time.Second, "pod "+name+" "+what, func(ctx context.Context) (bool, error) {
		p, err := env.Kube.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		last = p
		return cond(p), nil
	})
	return last
}

func annotate(pod *corev1.Pod, kv ...string) {
	if pod.Annotations == nil {
		pod.Annotations = map[string]string{}
	}
	for i := 0; i+1 < len(kv); i += 2 {
		pod.Annotations[kv[i]] = kv[i+1]
	}
}

func createPod(t *testing.T, pod *corev1.Pod) *corev1.Pod {
	t.Helper()
	created, err := env.Kube.CoreV1().Pods(pod.Namespace).Create(context.Background(), pod, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create pod %s: %v", pod.Name, err)
	}
	return created
}

func plainPod(ns, name, nodeName string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: corev1.PodSpec{
			NodeName:                     nodeName,
			AutomountServiceAccountToken: ptr.To(false),
			Containers:                   []corev1.Container{{Name: "c", Image: "registry.k8s.io/pause:3.10"}},
		},
	}
}

// TestPodsRun: a pod bound to a machine's Node starts (an IP from the
// machine, a running container), becomes Ready after its readiness delay,
// goes NotReady with its container dead while the machine is down, and
// comes back Ready with its restart count up after the machine boots.
func TestPodsRun(t *testing.T) {
	f := start(t, fleetSpec(t, 1, 1))
	w := f.Machines()[1]
	ns := namespace(t)
	pod := plainPod(ns, "web", w.Name())
	annotate(pod, sim.ReadyAfterAnnotation, "1s")
	createPod(t, pod)

	running := waitPod(t, ns, "web", "Running", func(p *corev1.Pod) bool { return p.Status.Phase == corev1.PodRunning })
	if podutils.IsPodReady(running) {
		t.Error("Ready before its readiness delay")
	}
	if running.Status.HostIP != w.Address() || net.ParseIP(running.Status.PodIP) == nil || running.Status.PodIP == w.Address() {
		t.Errorf("hostIP %q podIP %q; want the machine's address and a pod IP of its own", running.Status.HostIP, running.Status.PodIP)
	}
	cs := running.Status.ContainerStatuses
	if len(cs) != 1 || cs[0].State.Running == nil || !strings.HasPrefix(cs[0].ContainerID, "containerd://") || cs[0].RestartCount != 0 {
		t.Errorf("container status %+v", cs)
	}
	waitPod(t, ns, "web", "Ready", podutils.IsPodReady)

	release := w.Inject(sim.Fault{Kind: sim.FaultNoReturn})
	before := w.BootID()
	if err := talos(t, f).Reboot(on(w)); err != nil {
		t.Fatal(err)
	}
	down := waitPod(t, ns, "web", "NotReady while its machine is down", func(p *corev1.Pod) bool { return !podutils.IsPodReady(p) })
	if !w.Down() {
		t.Fatal("the pod went NotReady while its machine was up")
	}
	if s := down.Status.ContainerStatuses[0].State.Terminated; s == nil || s.ExitCode != 255 {
		t.Errorf("container of a down machine: %+v", down.Status.ContainerStatuses[0].State)
	}
	release()
	waitRebooted(t, w, before)
	back := waitPod(t, ns, "web", "Ready again", podutils.IsPodReady)
	c := back.Status.ContainerStatuses[0]
	if c.RestartCount != 1 || c.LastTerminationState.Terminated == nil || c.LastTerminationState.Terminated.ExitCode != 255 || c.State.Running == nil {
		t.Errorf("after the boot: restarts %d, last state %+v, state %+v", c.RestartCount, c.LastTerminationState, c.State)
	}
}

// TestPodOfAnEarlierMachine: a pod bound to a Node name before this
// machine registered it, whose status has another machine's addresses (a
// fleet of the same names ran it before), runs with this machine's
// addresses alone: a status that merged both would have two of one family,
// which the API server refuses.
func TestPodOfAnEarlierMachine(t *testing.T) {
	ctx := context.Background()
	spec := fleetSpec(t, 1, 1)
	ns := namespace(t)
	pod := createPod(t, plainPod(ns, "web", spec.Machines[1].Name))
	pod.Status = corev1.PodStatus{Phase: corev1.PodRunning, HostIP: "127.99.0.1", HostIPs: []corev1.HostIP{{IP: "127.99.0.1"}},
		PodIP: "10.99.0.1", PodIPs: []corev1.PodIP{{IP: "10.99.0.1"}}}
	if _, err := env.Kube.CoreV1().Pods(ns).UpdateStatus(ctx, pod, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	w := start(t, spec).Machines()[1]
	p := waitPod(t, ns, "web", "running on "+w.Name()+" at its address", func(p *corev1.Pod) bool {
		return p.Status.HostIP == w.Address() && p.Status.Phase == corev1.PodRunning
	})
	if h, ips := p.Status.HostIPs, p.Status.PodIPs; len(h) != 1 || h[0].IP != w.Address() || len(ips) != 1 || ips[0].IP != p.Status.PodIP {
		t.Errorf("hostIPs %v podIPs %v (podIP %s); want %s's and the pod's own alone", h, ips, p.Status.PodIP, w.Name())
	}
}

// TestPodsEnd: how containers without a binary end: a Job's pod completes
// after the default delay, annotations change the delay and the exit code,
// and restartPolicy decides between the pod's end and a restart.
func TestPodsEnd(t *testing.T) {
	f := start(t, fleetSpec(t, 1, 1))
	w := f.Machines()[1]
	ns := namespace(t)
	job := plainPod(ns, "job", w.Name())
	job.Spec.RestartPolicy = corev1.RestartPolicyNever
	job.OwnerReferences = []metav1.OwnerReference{{APIVersion: "batch/v1", Kind: "Job", Name: "job", UID: "job-uid", Controller: ptr.To(true)}}
	failing := plainPod(ns, "failing", w.Name())
	failing.Spec.RestartPolicy = corev1.RestartPolicyNever
	annotate(failing, sim.RunForAnnotation, "100ms", sim.ExitCodeAnnotation, "3")
	crashing := plainPod(ns, "crashing", w.Name())
	annotate(crashing, sim.RunForAnnotation, "100ms", sim.ExitCodeAnnotation, "1")
	forever := plainPod(ns, "forever", w.Name())
	for _, p := range []*corev1.Pod{job, failing, crashing, forever} {
		createPod(t, p)
	}

	got := waitPod(t, ns, "job", "Succeeded", func(p *corev1.Pod) bool { return p.Status.Phase == corev1.PodSucceeded })
	if s := got.Status.ContainerStatuses[0].State.Terminated; s == nil || s.ExitCode != 0 || s.Reason != "Completed" {
		t.Errorf("a Job's pod ends with %+v", got.Status.ContainerStatuses[0].State)
	}
	got = waitPod(t, ns, "failing", "Failed", func(p *corev1.Pod) bool { return p.Status.Phase == corev1.PodFailed })
	if s := got.Status.ContainerStatuses[0].State.Terminated; s == nil || s.ExitCode != 3 || s.Reason != "Error" {
		t.Errorf("exit-code 3 ends with %+v", got.Status.ContainerStatuses[0].State)
	}
	waitPod(t, ns, "crashing", "restarted twice (restartPolicy Always)", func(p *corev1.Pod) bool {
		return p.Status.Phase == corev1.PodRunning && p.Status.ContainerStatuses[0].RestartCount >= 2
	})
	if p := waitPod(t, ns, "forever", "Ready", podutils.IsPodReady); p.Status.Phase != corev1.PodRunning || p.Status.ContainerStatuses[0].RestartCount != 0 {
		t.Errorf("a pod without run-for: phase %s, restarts %d", p.Status.Phase, p.Status.ContainerStatuses[0].RestartCount)
	}
}

// TestPodsKeepTheirGracePeriod: a deleted pod stays (terminating) until
// its grace period ends, not longer than Durations.PodGrace: the pod with a
// short grace period is gone no earlier than its deletionTimestamp, the one
// with the default 30 s is gone well before its own.
func TestPodsKeepTheirGracePeriod(t *testing.T) {
	spec := fleetSpec(t, 1, 1)
	spec.Durations.PodGrace = 5 * time.Second
	f := start(t, spec)
	w := f.Machines()[1]
	ns := namespace(t)
	ctx := context.Background()
	short, long := createPod(t, plainPod(ns, "short", w.Name())), createPod(t, plainPod(ns, "long", w.Name()))
	for _, p := range []*corev1.Pod{short, long} {
		waitPod(t, ns, p.Name, "Running", func(p *corev1.Pod) bool { return p.Status.Phase == corev1.PodRunning })
	}
	list, err := env.Kube.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	wt, err := env.Kube.CoreV1().Pods(ns).Watch(ctx, metav1.ListOptions{ResourceVersion: list.ResourceVersion})
	if err != nil {
		t.Fatal(err)
	}
	defer wt.Stop()
	deadline := map[string]time.Time{}
	for name, grace := range map[string]*int64{"short": ptr.To[int64](2), "long": nil} {
		if err := env.Kube.CoreV1().Pods(ns).Delete(ctx, name, metav1.DeleteOptions{GracePeriodSeconds: grace}); err != nil {
			t.Fatal(err)
		}
		p, err := env.Kube.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil || p.DeletionTimestamp == nil {
			t.Fatalf("pod %s after its deletion: %v", name, err)
		}
		deadline[name] = p.DeletionTimestamp.Time
	}
	timeout := time.After(30 * time.Second)
	for len(deadline) > 0 {
		select {
		case ev := <-wt.ResultChan():
			p, ok := ev.Object.(*corev1.Pod)
			if !ok || ev.Type != watch.Deleted || deadline[p.Name].IsZero() {
				continue
			}
			gone := time.Now()
			if p.Name == "short" && gone.Before(deadline["short"]) {
				t.Errorf("pod short removed at %s, before its grace period ended (%s)", gone.Format(time.StampMilli), deadline["short"].Format(time.StampMilli))
			}
			if p.Name == "long" && !gone.Before(deadline["long"]) {
				t.Errorf("pod long removed at %s, after Durations.PodGrace (its own grace period ends %s)", gone.Format(time.StampMilli), deadline["long"].Format(time.StampMilli))
			}
			delete(deadline, p.Name)
		case <-timeout:
			t.Fatalf("pods still there: %v", deadline)
		}
	}
}

// TestPodsGoWithAReset: a reset wipes what ran on the machine, so its pods
// are gone from the API server, while another machine's stay.
func TestPodsGoWithAReset(t *testing.T) {
	f := start(t, fleetSpec(t, 1, 2))
	w1, w2 := f.Machines()[1], f.Machines()[2]
	ns := namespace(t)
	gone := createPod(t, plainPod(ns, "on-reset", w1.Name()))
	kept := createPod(t, plainPod(ns, "elsewhere", w2.Name()))
	waitPod(t, ns, gone.Name, "Ready", podutils.IsPodReady)
	before := w1.BootID()
	if err := talos(t, f).Reset(on(w1), false, true); err != nil {
		t.Fatal(err)
	}
	waitPodGone(t, gone)
	waitRebooted(t, w1, before)
	if !podExists(t, kept) {
		t.Fatal("a reset removed another machine's pod")
	}
}

// TestPodsRunBinaries: containers whose image maps to a binary run it as a
// process: init containers first, in order, then the container, each with
// its command, args and environment (downward API included) and a
// kubeconfig for the pod's ServiceAccount, whose RBAC is the pod's own;
// the exit code is the container's. The binary is the real kubectl.
func TestPodsRunBinaries(t *testing.T) {
	spec := fleetSpec(t, 1, 1)
	spec.APIServer = env.Config
	spec.Kubelet.Binaries = map[string]string{"example.com/kubectl:*": testenv.Kubectl}
	f := start(t, spec)
	w := f.Machines()[1]
	ns := namespace(t)
	ctx := context.Background()
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "writer"}}
	if _, err := env.Kube.CoreV1().ServiceAccounts(ns).Create(ctx, sa, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	kubectlPod := func(name, sa string, init [][]string, args ...string) *corev1.Pod {
		p := plainPod(ns, name, w.Name())
		p.Spec.ServiceAccountName = sa
		p.Spec.RestartPolicy = corev1.RestartPolicyNever
		c := corev1.Container{
			Name: "main", Image: "example.com/kubectl:v1.32", Command: []string{"/usr/bin/kubectl"}, Args: args,
			TerminationMessagePolicy: corev1.TerminationMessageFallbackToLogsOnError,
			Env: []corev1.EnvVar{
				{Name: "POD_NAME", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "metadata.name"}}},
				{Name: "NODE", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "spec.nodeName"}}},
			},
		}
		p.Spec.Containers = []corev1.Container{c}
		for i, a := range init {
			ic := c
			ic.Name, ic.Args = "init-"+string(rune('a'+i)), a
			p.Spec.InitContainers = append(p.Spec.InitContainers, ic)
		}
		return p
	}

	// Without a binding the ServiceAccount may not create ConfigMaps.
	createPod(t, kubectlPod("denied", "writer", nil, "create", "configmap", "x"))
	got := waitPod(t, ns, "denied", "Failed", func(p *corev1.Pod) bool { return p.Status.Phase == corev1.PodFailed })
	if s := got.Status.ContainerStatuses[0].State.Terminated; s == nil || s.ExitCode != 1 || !strings.Contains(s.Message, "forbidden") || !strings.Contains(s.Message, "system:serviceaccount:"+ns+":writer") {
		t.Fatalf("kubectl as the pod's ServiceAccount without RBAC: %+v", got.Status.ContainerStatuses[0].State)
	}

	role := &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "writer"},
		Rules: []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"configmaps"}, Verbs: []string{"create", "get"}}}}
	binding := &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "writer"},
		RoleRef:  rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "Role", Name: "writer"},
		Subjects: []rbacv1.Subject{{Kind: "ServiceAccount", Name: "writer", Namespace: ns}}}
	if _, err := env.Kube.RbacV1().Roles(ns).Create(ctx, role, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := env.Kube.RbacV1().RoleBindings(ns).Create(ctx, binding, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// The first init container writes, the second reads what it wrote (so
	// they ran in order), the container writes the downward API's values.
	createPod(t, kubectlPod("allowed", "writer", [][]string{
		{"create", "configmap", "first"},
		{"get", "configmap", "first"},
	}, "create", "configmap", "from-$(POD_NAME)", "--from-literal=node=$(NODE)"))
	got = waitPod(t, ns, "allowed", "Succeeded", func(p *corev1.Pod) bool { return p.Status.Phase == corev1.PodSucceeded })
	for _, s := range append(got.Status.InitContainerStatuses, got.Status.ContainerStatuses...) {
		if s.State.Terminated == nil || s.State.Terminated.ExitCode != 0 {
			t.Errorf("container %s: %+v", s.Name, s.State)
		}
	}
	cm, err := env.Kube.CoreV1().ConfigMaps(ns).Get(ctx, "from-allowed", metav1.GetOptions{})
	if err != nil || cm.Data["node"] != w.Name() {
		t.Fatalf("the container's ConfigMap: %+v, %v", cm, err)
	}

	// An init container that fails fails the pod, and the container never runs.
	createPod(t, kubectlPod("init-fails", "writer", [][]string{{"get", "configmap", "missing"}}, "create", "configmap", "never"))
	got = waitPod(t, ns, "init-fails", "Failed", func(p *corev1.Pod) bool { return p.Status.Phase == corev1.PodFailed })
	if s := got.Status.InitContainerStatuses[0].State.Terminated; s == nil || s.ExitCode != 1 {
		t.Errorf("the failing init container: %+v", got.Status.InitContainerStatuses[0].State)
	}
	if _, err := env.Kube.CoreV1().ConfigMaps(ns).Get(ctx, "never", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("the container ran after its init container failed: %v", err)
	}
}

// TestPodsHaveTheirOwnTmp: a process's /tmp (TMPDIR) is its pod's, never
// the machine's. An emptyDir mounted at /tmp keeps what the container wrote
// there across its restart, and a second pod on the machine does not see
// it: with the machine's /tmp shared, another process's ichor-controller
// found a sandbox controller's etcd restore hand-over there and ran that
// restore's steps again. A container without such a volume gets a
// directory of its own.
func TestPodsHaveTheirOwnTmp(t *testing.T) {
	spec := fleetSpec(t, 1, 1)
	spec.APIServer = env.Config
	spec.Kubelet.Binaries = map[string]string{"example.com/sh:*": "/bin/sh"}
	spec.Kubelet.Dir = t.TempDir()
	f := start(t, spec)
	w := f.Machines()[1]
	ns := namespace(t)
	mark := "mark-" + ns
	t.Cleanup(func() { _ = os.Remove(filepath.Join(os.TempDir(), mark)) }) // where a shared /tmp has it
	shPod := func(name, script string) *corev1.Pod {
		p := plainPod(ns, name, w.Name())
		p.Spec.ServiceAccountName = "default"
		p.Spec.Containers = []corev1.Container{{Name: "main", Image: "example.com/sh:1", Command: []string{"/bin/sh", "-c", script},
			TerminationMessagePolicy: corev1.TerminationMessageFallbackToLogsOnError}}
		return p
	}
	// The first run leaves the mark and fails; the restart finds it and
	// succeeds. A container that finds it at once found another's. /tmp is
	// where a process without TMPDIR looks, as os.TempDir does.
	for _, name := range []string{"first", "second"} {
		p := shPod(name, `d="${TMPDIR:-/tmp}"; test -f "$d/`+mark+`" && exit 0; touch "$d/`+mark+`"; exit 1`)
		p.Spec.RestartPolicy = corev1.RestartPolicyOnFailure
		p.Spec.Containers[0].VolumeMounts = []corev1.VolumeMount{{Name: "tmp", MountPath: "/tmp"}}
		p.Spec.Volumes = []corev1.Volume{{Name: "tmp", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}}}
		createPod(t, p)
		got := waitPod(t, ns, name, "Succeeded", func(p *corev1.Pod) bool { return p.Status.Phase == corev1.PodSucceeded })
		if n := got.Status.ContainerStatuses[0].RestartCount; n != 1 {
			t.Errorf("pod %s succeeded after %d restarts, want 1: it should find the mark it left in its emptyDir, and only that", name, n)
		}
	}

	p := shPod("no-volume", `echo "${TMPDIR:-/tmp}"; exit 1`)
	p.Spec.RestartPolicy = corev1.RestartPolicyNever
	createPod(t, p)
	got := waitPod(t, ns, "no-volume", "Failed", func(p *corev1.Pod) bool { return p.Status.Phase == corev1.PodFailed })
	if s := got.Status.ContainerStatuses[0].State.Terminated; s == nil || !strings.HasPrefix(s.Message, spec.Kubelet.Dir+string(filepath.Separator)) {
		t.Errorf("a container without a volume at /tmp has TMPDIR %+v, want a directory of its own under Kubelet.Dir %s", s, spec.Kubelet.Dir)
	}
}

// TestNodeLeases: a running machine renews its Node Lease (owned by its
// Node) every quarter of Kubelet.NodeLease; a machine that is down does
// not, until it is back.
func TestNodeLeases(t *testing.T) {
	spec := fleetSpec(t, 1, 1)
	spec.Kubelet.NodeLease = 2 * time.Second
	f := start(t, spec)
	w := f.Machines()[1]
	renewed := func() time.Time {
		l, err := env.Kube.CoordinationV1().Leases(corev1.NamespaceNodeLease).Get(context.Background(), w.Name(), metav1.GetOptions{})
		if err != nil || l.Spec.RenewTime == nil {
			return time.Time{}
		}
		return l.Spec.RenewTime.Time
	}
	var first time.Time
	testenv.Eventually(t, 30*time.Second, "the Lease renewed", func(context.Context) (bool, error) {
		if first.IsZero() {
			first = renewed()
			return false, nil
		}
		return renewed().After(first), nil
	})
	l, err := env.Kube.CoordinationV1().Leases(corev1.NamespaceNodeLease).Get(context.Background(), w.Name(), metav1.GetOptions{})
	if err != nil || len(l.OwnerReferences) != 1 || l.OwnerReferences[0].Kind != "Node" || l.OwnerReferences[0].Name != w.Name() || *l.Spec.LeaseDurationSeconds != 2 {
		t.Fatalf("the Lease %+v, %v", l, err)
	}

	release := w.Inject(sim.Fault{Kind: sim.FaultNoReturn})
	before := w.BootID()
	if err := talos(t, f).Reboot(on(w)); err != nil {
		t.Fatal(err)
	}
	waitNodeReady(t, w, false)
	last := renewed()
	// Three renewal periods without a renewal: the machine is down.
	deadline := time.Now().Add(1500 * time.Millisecond)
	for time.Now().Before(deadline) {
		if r := renewed(); r.After(last) && w.Down() {
			t.Fatalf("a down machine renewed its Lease (%s after %s)", r, last)
		}
		time.Sleep(100 * time.Millisecond)
	}
	release()
	waitRebooted(t, w, before)
	testenv.Eventually(t, 30*time.Second, "the Lease renewed after the boot", func(context.Context) (bool, error) {
		return renewed().After(last), nil
	})
}
