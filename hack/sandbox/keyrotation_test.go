package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	authenticationv1 "k8s.io/api/authentication/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/encryption"
	"maesh.dev/ichor/internal/testenv"
)

// TestKeyRotationEndToEnd is issue 15's done-when for the keys, in a
// sandbox with the controller as its Deployment's pods and the RBAC and
// policies of manifests/, through the plugin and the real kubectl:
// `kubectl ichor rotate keys --yes --watch` replaces both keys while a
// reader lists every Secret in a loop through the cluster's endpoint;
// afterwards a token signed with the old service-account key is refused
// by every API server, every pod of web (a Deployment behind a budget of
// 3 of 4) was restarted and the budget held throughout, the reader met no
// error, every Secret's value in etcd is sealed with the new secretbox
// key, and the controller, whose own token went stale, then reboots a
// machine.
func TestKeyRotationEndToEnd(t *testing.T) {
	assets(t)
	bin := buildBinaries(t)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	sb := startInProcess(ctx, t, "--controller", filepath.Join(bin, "ichor-controller"),
		"--control-planes", "3", "--workers", "2", "--pace", "200ms", "--cilium=false")
	kube, err := kubernetes.NewForConfig(sb.Admin)
	if err != nil {
		t.Fatal(err)
	}
	waitWeb(ctx, t, kube, 4)
	webBefore := podUIDs(ctx, t, kube, "app=web")
	oldToken, err := kube.CoreV1().ServiceAccounts(demoNamespace).CreateToken(ctx, "default",
		&authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: ptrTo[int64](3600)}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	budget := watchBudget(ctx, t, kube, "web")
	reads := readSecretsLoop(ctx, t, sb.Admin)

	mustIchor(ctx, t, sb, bin, "rotate", "keys", "--yes", "--watch", "--name", "keys")
	op := waitOp(t, sb, "keys", "to have succeeded", (*ichorv1.TalosOperation).Succeeded)
	if !strings.Contains(op.Status.Message, "take a new snapshot now") || !strings.Contains(op.Status.Message, "signed with the old service-account key is refused") {
		t.Errorf("the operation's message does not say what to do afterwards: %q", op.Status.Message)
	}

	if n, errs := reads(); n == 0 || len(errs) > 0 {
		t.Errorf("the reader listed every Secret %d times, with errors %v", n, errs)
	}
	if lowest := budget(); lowest < 0 {
		t.Errorf("web's budget was broken: %d pods below what it allows", -lowest)
	}
	waitWeb(ctx, t, kube, 4)
	for uid := range podUIDs(ctx, t, kube, "app=web") {
		if webBefore[uid] {
			t.Errorf("web's pod %s is one from before the rotation: not restarted", uid)
		}
	}
	for _, cp := range sb.Fleet.ControlPlanes() {
		rc := rest.CopyConfig(sb.Admin)
		rc.Host = "https://" + cp.APIServer().Address
		direct, err := kubernetes.NewForConfig(rc)
		if err != nil {
			t.Fatal(err)
		}
		review, err := direct.AuthenticationV1().TokenReviews().Create(ctx, &authenticationv1.TokenReview{Spec: authenticationv1.TokenReviewSpec{Token: oldToken.Status.Token}}, metav1.CreateOptions{})
		if err != nil || review.Status.Authenticated {
			t.Errorf("%s: a token signed with the old service-account key: authenticated %v (%v)", cp.Name(), review != nil && review.Status.Authenticated, err)
		}
	}
	tc, err := sb.Fleet.EtcdClientTLS()
	if err != nil {
		t.Fatal(err)
	}
	etcd, err := etcdClient(sb.Fleet.HostedEtcd().ClientURL, tc)
	if err != nil {
		t.Fatal(err)
	}
	defer etcd.Close()
	key := encryption.Key{Provider: encryption.Secretbox, Secret: sb.Fleet.ControlPlanes()[0].Config().Cluster().SecretboxEncryptionSecret()}
	if outside, total, err := encryption.Outside(ctx, etcd, key, 5); err != nil || len(outside) > 0 {
		t.Errorf("of %d Secrets in etcd, not sealed with the new secretbox key (key2): %v (%v)", total, outside, err)
	}

	worker := sb.Fleet.Machines()[len(sb.Fleet.Machines())-1].Name()
	mustIchor(ctx, t, sb, bin, "node", "reboot", worker, "--yes", "--watch", "--name", "reboot-after")
}

func ptrTo[T any](v T) *T { return &v }

// waitWeb waits until web has n Ready pods.
func waitWeb(ctx context.Context, t *testing.T, kube kubernetes.Interface, n int) {
	t.Helper()
	testenv.Eventually(t, 3*time.Minute, fmt.Sprintf("web's %d pods Ready", n), func(ctx context.Context) (bool, error) {
		pods, err := kube.CoreV1().Pods(demoNamespace).List(ctx, metav1.ListOptions{LabelSelector: "app=web"})
		if err != nil {
			return false, nil //nolint:nilerr // an API server may be restarting
		}
		ready := 0
		for i := range pods.Items {
			if pods.Items[i].DeletionTimestamp == nil && podReady(&pods.Items[i]) {
				ready++
			}
		}
		return ready == n, nil
	})
}

func podUIDs(ctx context.Context, t *testing.T, kube kubernetes.Interface, selector string) map[types.UID]bool {
	t.Helper()
	pods, err := kube.CoreV1().Pods(demoNamespace).List(ctx, metav1.ListOptions{LabelSelector: selector})
	if err != nil {
		t.Fatal(err)
	}
	out := map[types.UID]bool{}
	for _, p := range pods.Items {
		out[p.UID] = true
	}
	return out
}

// watchBudget follows the PodDisruptionBudget name until ctx ends and
// returns a func that says the lowest its healthy pods came to against
// what it wants (below zero: broken). A watch the API servers' restarts
// end is started again.
func watchBudget(ctx context.Context, t *testing.T, kube kubernetes.Interface, name string) func() int {
	t.Helper()
	var mu sync.Mutex
	lowest := 1 << 30
	seen := func(pdb *policyv1.PodDisruptionBudget) {
		if pdb.Status.ObservedGeneration != pdb.Generation || pdb.Status.DesiredHealthy == 0 {
			return
		}
		mu.Lock()
		lowest = min(lowest, int(pdb.Status.CurrentHealthy-pdb.Status.DesiredHealthy))
		mu.Unlock()
	}
	go func() {
		for ctx.Err() == nil {
			w, err := kube.PolicyV1().PodDisruptionBudgets(demoNamespace).Watch(ctx, metav1.ListOptions{FieldSelector: "metadata.name=" + name})
			if err != nil {
				if sleepCtx(ctx, time.Second) != nil {
					return
				}
				continue
			}
			for ev := range w.ResultChan() {
				if pdb, ok := ev.Object.(*policyv1.PodDisruptionBudget); ok && ev.Type != watch.Deleted {
					seen(pdb)
				}
			}
		}
	}()
	return func() int {
		mu.Lock()
		defer mu.Unlock()
		return lowest
	}
}

// readSecretsLoop lists every Secret of the cluster through its endpoint
// until ctx ends; the func it returns says how many lists went through and
// the errors an API server answered with (one that did not answer, while
// it restarts, is not a Secret it cannot read).
func readSecretsLoop(ctx context.Context, t *testing.T, cfg *rest.Config) func() (int, []string) {
	t.Helper()
	kube, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	n := 0
	var errs []string
	go func() {
		for ctx.Err() == nil {
			_, err := kube.CoreV1().Secrets("").List(ctx, metav1.ListOptions{})
			mu.Lock()
			var status apierrors.APIStatus
			switch {
			case err == nil:
				n++
			case errors.As(err, &status) && !slices.Contains([]int32{0, 429, 503}, status.Status().Code) && len(errs) < 10:
				errs = append(errs, err.Error())
			}
			mu.Unlock()
			if sleepCtx(ctx, 50*time.Millisecond) != nil {
				return
			}
		}
	}()
	return func() (int, []string) {
		mu.Lock()
		defer mu.Unlock()
		return n, slices.Clone(errs)
	}
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(d):
		return nil
	}
}

// etcdClient is a client of etcd at url with tc.
func etcdClient(url string, tc *tls.Config) (*clientv3.Client, error) {
	return clientv3.New(clientv3.Config{Endpoints: []string{url}, TLS: tc, DialTimeout: 10 * time.Second, Logger: zap.NewNop()})
}
