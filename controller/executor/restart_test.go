package executor

import (
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

// pod is a pod of ns/name created at created (seconds after swapTime),
// owned by a controller of kind/owner ("" for none), with the API access
// volume unless noToken.
func pod(name, kind, owner string, created int, noToken bool) corev1.Pod {
	ns, n, _ := strings.Cut(name, "/")
	p := corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: n, CreationTimestamp: metav1.NewTime(swapTime.Add(time.Duration(created) * time.Second))}}
	if kind != "" {
		p.OwnerReferences = []metav1.OwnerReference{{Kind: kind, Name: owner, UID: types.UID(kind + owner), Controller: ptr.To(true)}}
	}
	if !noToken {
		p.Spec.Volumes = []corev1.Volume{{Name: "kube-api-access", VolumeSource: corev1.VolumeSource{Projected: &corev1.ProjectedVolumeSource{
			Sources: []corev1.VolumeProjection{{ServiceAccountToken: &corev1.ServiceAccountTokenProjection{Path: "token"}}}}}}}
	}
	return p
}

var swapTime = time.Date(2026, 5, 1, 12, 0, 0, 0, time.UTC)

// workloadOf names a pod's workload as the API would: a ReplicaSet web-x
// is the Deployment web's.
func workloadOf(p *corev1.Pod, ref *metav1.OwnerReference) string {
	if ref.Kind == "ReplicaSet" {
		d, _, _ := strings.Cut(ref.Name, "-")
		return "Deployment " + p.Namespace + "/" + d
	}
	return ref.Kind + " " + p.Namespace + "/" + ref.Name
}

// TestSortPods: the pods restarted are those holding a projected
// ServiceAccount token created before the swap finished (the same second
// counts: creation times have a second's resolution) and brought back by
// a controller; bare pods and Jobs' pods are named; mirror pods, pods
// terminating or finished, and pods without a token are left alone.
func TestSortPods(t *testing.T) {
	mirror := pod("kube-system/kube-apiserver-cp-1", "Node", "cp-1", -60, false)
	mirror.Annotations = map[string]string{corev1.MirrorPodAnnotationKey: "x"}
	terminating := pod("default/web-1-old", "ReplicaSet", "web-1", -60, false)
	terminating.DeletionTimestamp = ptr.To(metav1.NewTime(swapTime))
	done := pod("default/pi-abc", "Job", "pi", -60, false)
	done.Status.Phase = corev1.PodSucceeded
	custom := pod("default/vault-0", "StatefulSet", "vault", -60, true)
	custom.Spec.Volumes = []corev1.Volume{{Name: "vault-token", VolumeSource: corev1.VolumeSource{Projected: &corev1.ProjectedVolumeSource{
		Sources: []corev1.VolumeProjection{{ConfigMap: &corev1.ConfigMapProjection{}}, {ServiceAccountToken: &corev1.ServiceAccountTokenProjection{Audience: "vault", Path: "t"}}}}}}}
	tests := []struct {
		name    string
		pods    []corev1.Pod
		swapped time.Time
		restart []string
		named   []string
	}{
		{"before the swap, by any controller", []corev1.Pod{
			pod("default/web-1-a", "ReplicaSet", "web-1", -60, false), pod("kube-system/agent-x", "DaemonSet", "agent", -1, false),
			pod("db/pg-0", "StatefulSet", "pg", 0, false), pod("default/custom-1", "Cluster", "c", -5, false)}, swapTime,
			[]string{"default/web-1-a Deployment default/web", "kube-system/agent-x DaemonSet kube-system/agent", "db/pg-0 StatefulSet db/pg", "default/custom-1 Cluster default/c"}, nil},
		{"created after the swap", []corev1.Pod{pod("default/web-1-b", "ReplicaSet", "web-1", 1, false)}, swapTime, nil, nil},
		{"planned before anything ran: every pod", []corev1.Pod{pod("default/web-1-b", "ReplicaSet", "web-1", 3600, false)}, time.Time{},
			[]string{"default/web-1-b Deployment default/web"}, nil},
		{"no token, mirror, terminating, finished", []corev1.Pod{pod("default/quiet", "ReplicaSet", "q-1", -60, true), mirror, terminating, done}, swapTime, nil, nil},
		{"a token of its own audience", []corev1.Pod{custom}, swapTime, []string{"default/vault-0 StatefulSet default/vault"}, nil},
		{"bare and a Job's: named", []corev1.Pod{pod("default/bare", "", "", -60, false), pod("default/pi-xyz", "Job", "pi", -60, false),
			pod("default/late-bare", "", "", 10, false)}, swapTime, nil, []string{"default/bare (no controller)", "default/pi-xyz (Job pi)"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := sortPods(tt.pods, tt.swapped, workloadOf)
			var restart []string
			for _, rp := range got.restart {
				restart = append(restart, podKey(rp.pod)+" "+rp.workload)
			}
			if !reflect.DeepEqual(restart, tt.restart) || !reflect.DeepEqual(got.named, tt.named) {
				t.Errorf("restart %q named %q, want %q and %q", restart, got.named, tt.restart, tt.named)
			}
		})
	}
}

// TestRestartRounds: a round holds at most one pod of a workload, in the
// order listed, and the controller's own pod comes alone, last.
func TestRestartRounds(t *testing.T) {
	rp := func(name, workload string) restartPod {
		p := pod(name, "ReplicaSet", "x", 0, false)
		return restartPod{pod: &p, workload: workload}
	}
	tests := []struct {
		name string
		pods []restartPod
		self string
		want [][]string
	}{
		{"none", nil, "", nil},
		{"one workload, one at a time", []restartPod{rp("d/web-a", "web"), rp("d/web-b", "web"), rp("d/web-c", "web")}, "",
			[][]string{{"d/web-a"}, {"d/web-b"}, {"d/web-c"}}},
		{"workloads side by side", []restartPod{rp("d/web-a", "web"), rp("d/db-0", "db"), rp("d/web-b", "web"), rp("d/agent", "agent")}, "",
			[][]string{{"d/web-a", "d/db-0", "d/agent"}, {"d/web-b"}}},
		{"the controller's own pod last, alone", []restartPod{rp("ichor/ctl-a", "ctl"), rp("d/web-a", "web"), rp("ichor/ctl-b", "ctl")}, "ichor/ctl-a",
			[][]string{{"d/web-a", "ichor/ctl-b"}, {"ichor/ctl-a"}}},
		{"the controller's own pod alone on the machine", []restartPod{rp("ichor/ctl-a", "ctl")}, "ichor/ctl-a", [][]string{{"ichor/ctl-a"}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var got [][]string
			for _, round := range restartRounds(tt.pods, tt.self) {
				var names []string
				for _, p := range round {
					names = append(names, podKey(p.pod))
				}
				got = append(got, names)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("rounds %q, want %q", got, tt.want)
			}
		})
	}
}

// TestRestartWords: the plan and the step's message say how many pods
// restart, by workload, and name those that cannot be restarted, within
// a machine's message; when they do not all fit, the named pods keep
// their share and what is left out is counted.
func TestRestartWords(t *testing.T) {
	plan := func(restart map[string]int, named ...string) restartPlan {
		var p restartPlan
		for _, w := range []string{"Deployment default/web", "DaemonSet kube-system/agent", "StatefulSet db/pg"} {
			for range restart[w] {
				p.restart = append(p.restart, restartPod{workload: w})
			}
		}
		p.named = named
		return p
	}
	var many []string
	for i := range 40 {
		many = append(many, fmt.Sprintf("team-%d/bare-pod-%d (no controller)", i, i))
	}
	crowded := restartPlan{named: many[:10]}
	for i := range 20 {
		crowded.restart = append(crowded.restart, restartPod{workload: fmt.Sprintf("Deployment team-%d/app", i)})
	}
	tests := []struct {
		name string
		plan restartPlan
		want string
	}{
		{"nothing", plan(nil), "restarts no pod"},
		{"by workload", plan(map[string]int{"Deployment default/web": 2, "DaemonSet kube-system/agent": 1}),
			"restarts 3 pods: Deployment default/web (2), DaemonSet kube-system/agent (1)"},
		{"and the pods left", plan(map[string]int{"Deployment default/web": 1}, "default/bare (no controller)", "default/pi-x (Job pi)"),
			"restarts 1 pod: Deployment default/web (1); not restarted: default/bare (no controller), default/pi-x (Job pi)"},
		{"only pods left", plan(nil, "default/bare (no controller)"), "restarts no pod; not restarted: default/bare (no controller)"},
		{"too many to name", plan(map[string]int{"Deployment default/web": 3, "StatefulSet db/pg": 2}, many...),
			"restarts 5 pods: Deployment default/web (3), StatefulSet db/pg (2); not restarted: team-0/bare-pod-0 (no controller), " +
				"team-1/bare-pod-1 (no controller), team-2/bare-pod-2 (no controller), team-3/bare-pod-3 (no controller) and 36 more"},
		{"too many of both: half the room for the pods left", crowded,
			"restarts 20 pods: Deployment team-0/app (1), Deployment team-1/app (1), Deployment team-2/app (1), Deployment team-3/app (1) and 16 more; " +
				"not restarted: team-0/bare-pod-0 (no controller), team-1/bare-pod-1 (no controller) and 8 more"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := tt.plan.words("restarts", "restarts no pod", ichorv1.MachineMessageMax)
			if got != tt.want {
				t.Errorf("words:\n got %q\nwant %q", got, tt.want)
			}
			if len(got) > ichorv1.MachineMessageMax {
				t.Errorf("%d bytes, more than a machine's message holds (%d)", len(got), ichorv1.MachineMessageMax)
			}
		})
	}
}

// TestFitList: as many items as fit, and how many did not.
func TestFitList(t *testing.T) {
	items := []string{"alpha", "beta", "a-much-longer-gamma"}
	for _, tt := range []struct {
		budget int
		want   string
	}{
		{100, "alpha, beta, a-much-longer-gamma"},
		{32, "alpha, beta, a-much-longer-gamma"},
		{31, "alpha, beta and 1 more"},
		{21, "alpha and 2 more"},
		{15, "3 of them"},
	} {
		if got := fitList(items, tt.budget); got != tt.want {
			t.Errorf("fitList(%d) = %q, want %q", tt.budget, got, tt.want)
		}
	}
}
