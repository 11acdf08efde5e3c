package watchlist_test

import (
	"context"
	"os"
	"slices"
	"strconv"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"

	"maesh.dev/ichor/controller/watchlist"
	"maesh.dev/ichor/internal/testenv"
)

var env *testenv.Env

func TestMain(m *testing.M) { os.Exit(testenv.Main(m, &env)) }

// TestPods: the pods that a field or label selector picks, in one
// namespace or all, read through the real API server as a watch-list: the
// audit log has a watch of pods for each read and no list.
func TestPods(t *testing.T) {
	ns, other := env.Namespace(t), env.Namespace(t)
	ctx := context.Background()
	for _, p := range []struct{ ns, name, node, app string }{
		{ns, "a-1", "a", "web"}, {ns, "a-2", "a", "db"}, {ns, "b-1", "b", "web"}, {other, "a-3", "a", "web"},
	} {
		pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: p.ns, Name: p.name, Labels: map[string]string{"app": p.app}},
			Spec: corev1.PodSpec{NodeName: p.node, Containers: []corev1.Container{{Name: "c", Image: "registry.k8s.io/pause:3.10"}}}}
		if err := env.Client.Create(ctx, pod); err != nil {
			t.Fatal(err)
		}
	}
	cfg, err := env.User(testenv.AuditedUser, "system:masters")
	if err != nil {
		t.Fatal(err)
	}
	cs := kubernetes.NewForConfigOrDie(cfg)
	onA := metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("spec.nodeName", "a").String()}
	for _, tc := range []struct {
		name      string
		namespace string
		opts      metav1.ListOptions
		want      []string
	}{
		{"one machine's, every namespace", "", onA, []string{ns + "/a-1", ns + "/a-2", other + "/a-3"}},
		{"one machine's, one namespace", ns, onA, []string{ns + "/a-1", ns + "/a-2"}},
		{"by label", ns, metav1.ListOptions{LabelSelector: "app=web"}, []string{ns + "/a-1", ns + "/b-1"}},
		{"none", ns, metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("spec.nodeName", "c").String()}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			since := time.Now().Add(-time.Millisecond)
			list, err := watchlist.Clientset(cs).CoreV1().Pods(tc.namespace).List(ctx, tc.opts)
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, p := range list.Items {
				got = append(got, p.Namespace+"/"+p.Name)
			}
			slices.Sort(got)
			if !slices.Equal(got, tc.want) {
				t.Errorf("got %v, want %v", got, tc.want)
			}
			if list.ResourceVersion == "" {
				t.Error("the list has no resourceVersion")
			}
			verbs := podRequests(t, since)
			if !slices.Equal(verbs, []string{"watch"}) {
				t.Errorf("requests of pods at the API server: %v, want one watch and no list", verbs)
			}
		})
	}
}

// podRequests are the verbs of the audited user's requests of pods since.
func podRequests(t *testing.T, since time.Time) []string {
	t.Helper()
	reqs, err := env.AuditedRequests()
	if err != nil {
		t.Fatal(err)
	}
	var verbs []string
	for _, r := range reqs {
		if r.Resource == "pods" && !r.At.Before(since) {
			verbs = append(verbs, r.Verb)
		}
	}
	return verbs
}

// TestFakeClientset: client-go's fake clientset cannot stream a
// watch-list (it would never send the bookmark that ends one), so it is
// left as it is and its pods are listed.
func TestFakeClientset(t *testing.T) {
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "p"}}
	cs := fake.NewClientset(pod)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	list, err := watchlist.Clientset(cs).CoreV1().Pods("").List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(list.Items) != 1 || list.Items[0].Name != "p" {
		t.Fatalf("got %+v, want the pod p", list.Items)
	}
}

// TestAsOf: a list as of a resourceVersion shows the pods the API server
// had then (or later), and one as of a version the API server has not
// reached is refused as too large: the version is sent, not dropped.
func TestAsOf(t *testing.T) {
	ns := env.Namespace(t)
	ctx := context.Background()
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "p"},
		Spec: corev1.PodSpec{NodeName: "a", Containers: []corev1.Container{{Name: "c", Image: "registry.k8s.io/pause:3.10"}}}}
	if err := env.Client.Create(ctx, pod); err != nil {
		t.Fatal(err)
	}
	created, err := strconv.ParseUint(pod.ResourceVersion, 10, 64)
	if err != nil {
		t.Fatalf("the pod's resourceVersion %q: %v (etcd's revisions are numbers)", pod.ResourceVersion, err)
	}
	cs := kubernetes.NewForConfigOrDie(env.Config)
	onA := metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("spec.nodeName", "a").String()}
	for _, tc := range []struct {
		name, asOf string
		want       []string
		tooLarge   bool
	}{
		{"now", "", []string{"p"}, false},
		{"as of the pod's creation", pod.ResourceVersion, []string{"p"}, false},
		{"as of a version not reached", strconv.FormatUint(created+1_000_000, 10), nil, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			list, err := watchlist.AsOf(cs, tc.asOf).CoreV1().Pods(ns).List(ctx, onA)
			if tc.tooLarge {
				if !apierrors.HasStatusCause(err, metav1.CauseTypeResourceVersionTooLarge) {
					t.Fatalf("got %v, want the API server's refusal of a resourceVersion too large", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, p := range list.Items {
				got = append(got, p.Name)
			}
			if !slices.Equal(got, tc.want) {
				t.Errorf("got %v, want %v", got, tc.want)
			}
		})
	}
}
