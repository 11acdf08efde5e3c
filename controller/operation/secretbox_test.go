package operation_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/siderolabs/talos/pkg/machinery/config/types/v1alpha1"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	ctrlclient "sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/app"
	"maesh.dev/ichor/controller/encryption"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/controller/machineconfig"
	"maesh.dev/ichor/controller/operation"
	"maesh.dev/ichor/internal/repo"
	"maesh.dev/ichor/internal/testcluster"
	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

// TestSecretboxKeyRotation migrates a hosted fleet (3 control planes whose
// API servers encrypt Secrets with the keys of their machine configuration)
// from aescbc alone to a new secretbox key, the controller killed after
// every step it runs (before its result is recorded), while a reader on
// every API server lists every Secret in a loop and a writer keeps updating
// some: the readers meet no Secret they cannot read and miss none, the
// writer's Secrets hold what it last wrote (nothing clobbered), its writes
// were refused only while the API servers switched keys, and afterwards
// every Secret's value in etcd is sealed with the new secretbox key, the
// only key the control planes hold. Before that, without the freeze's
// policy, the rotation is refused. (The sandbox's TestKeyRotationEndToEnd
// rotates a secretbox key to a new one, uninterrupted.)
func TestSecretboxKeyRotation(t *testing.T) {
	t.Parallel() // its own hosted fleet and API servers (see TestMain)
	fleet, henv := testcluster.StartHostedFleet(t, sim.Cluster("", 3, 0), testenv.Components{})
	const ns = "default"
	testcluster.WriteTalosconfig(t, henv, fleet, ns)
	ctl := testcluster.StartController(t, henv.Config, app.Options{Namespace: ns})

	// Without the freeze's policy, preflight refuses, and says how to fix it.
	refused := createKeyRotation(t, henv.Client, ns, "no-freeze")
	testenv.Eventually(t, 2*time.Minute, "the rotation refused", func(ctx context.Context) (bool, error) {
		err := henv.Client.Get(ctx, ctrlclient.ObjectKeyFromObject(refused), refused)
		return err == nil && refused.Refused(), nil //nolint:nilerr // the endpoint may be between API servers
	})
	if !conditionSays(refused, "ValidatingAdmissionPolicyBinding "+executor.SecretWriteFreeze, "kubectl apply -k manifests") {
		t.Errorf("the refusal does not say that the freeze's policy is missing and how to install it: %+v", refused.Status.Conditions)
	}
	ctl.Stop()

	installSecretFreeze(t, henv, ns)
	stable := seedSecrets(t, henv.Kube, 30)
	original := fleet.ControlPlanes()[0].Config().Cluster().SecretboxEncryptionSecret()
	toAESCBCOnly(t, fleet)
	tr := startTraffic(t, fleet, henv.Kube, stable)
	op := createKeyRotation(t, henv.Client, ns, "rotate-killed")
	killedAt := killAtEachStep(t, henv.Client, ctrlclient.ObjectKeyFromObject(op), 40, 4*time.Minute, func(hook func(operation.StepRun)) *testcluster.Controller {
		return testcluster.StartKillable(t, henv.Config, app.Options{Namespace: ns, TestHookAfterRun: hook})
	})
	t.Logf("killed after %d steps: %v", len(killedAt), killedAt)
	for _, stage := range []string{executor.StageSecretboxPrepare, executor.StageBridgeRewrap, executor.StageFreeze, executor.StageSecretboxSwitch,
		executor.StageThaw, executor.StageSecretboxRewrap, executor.StageBridgeDrop, executor.StageSecretboxVerify} {
		if !killedIn(killedAt, stage) {
			t.Errorf("never killed in stage %s (%v)", stage, killedAt)
		}
	}
	if !killedAt[executor.StageSecretboxSwitch+"/"+executor.StepSwitchSecretbox] {
		t.Errorf("never killed between a switch of the secretbox key and its record (%v)", killedAt)
	}
	tr.check(t, henv.Kube)
	checkSecretboxRotated(t, fleet, henv, ns, stable)
	if fleet.ControlPlanes()[0].Config().Cluster().SecretboxEncryptionSecret() == original {
		t.Error("the secretbox key is the one the cluster had before it moved to aescbc, not a new one")
	}
	if err := henv.Client.Get(context.Background(), ctrlclient.ObjectKeyFromObject(op), op); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(op.Status.Message, "take a new snapshot now") {
		t.Errorf("message %q does not say what to do afterwards", op.Status.Message)
	}
}

// conditionSays reports whether one of op's conditions says every one of
// words.
func conditionSays(op *ichorv1.TalosOperation, words ...string) bool {
	for _, c := range op.Status.Conditions {
		if !slices.ContainsFunc(words, func(w string) bool { return !strings.Contains(c.Message, w) }) {
			return true
		}
	}
	return false
}

func killedIn(killedAt map[string]bool, stage string) bool {
	for k := range killedAt {
		if strings.HasPrefix(k, stage+"/") {
			return true
		}
	}
	return false
}

func createKeyRotation(t *testing.T, c ctrlclient.Client, ns, name string) *ichorv1.TalosOperation {
	t.Helper()
	op := &ichorv1.TalosOperation{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: ichorv1.TalosOperationSpec{Kind: ichorv1.KindKeyRotation, KeyRotation: &ichorv1.KeyRotation{ServiceAccount: ptr.To(false), Secretbox: ptr.To(true)}}}
	if err := c.Create(context.Background(), op); err != nil {
		t.Fatal(err)
	}
	return op
}

// installSecretFreeze installs the policy manifests/policies/secretfreeze.yaml
// with its param in the controller's namespace ns.
func installSecretFreeze(t *testing.T, henv *testenv.Env, ns string) {
	t.Helper()
	root, err := repo.Root()
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(root + "/manifests/policies/secretfreeze.yaml")
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.CreateTemp(t.TempDir(), "freeze-*.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteString(strings.ReplaceAll(string(b), "namespace: ichor-system", "namespace: "+ns)); err != nil {
		t.Fatal(err)
	}
	_ = f.Close()
	if _, stderr, err := henv.Kubectl(context.Background(), nil, "apply", "-f", f.Name()); err != nil {
		t.Fatalf("install the freeze policy: %v: %s", err, stderr)
	}
}

// seedSecrets creates n Secrets over a few namespaces and returns what each
// holds, by namespace/name.
func seedSecrets(t *testing.T, kc kubernetes.Interface, n int) map[string]string {
	t.Helper()
	ctx := context.Background()
	out := map[string]string{}
	for i := range n {
		ns := []string{"default", "kube-system", "kube-public"}[i%3]
		s := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: fmt.Sprintf("stable-%d", i)}, StringData: map[string]string{"v": fmt.Sprint(i * i)}}
		if _, err := kc.CoreV1().Secrets(ns).Create(ctx, s, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		out[ns+"/"+s.Name] = fmt.Sprint(i * i)
	}
	return out
}

// traffic is a reader on every API server, listing every Secret in a loop,
// and a writer updating a few Secrets through the fleet's endpoint.
type traffic struct {
	cancel context.CancelFunc
	wg     sync.WaitGroup
	stable map[string]string

	reads      atomic.Int64
	mu         sync.Mutex
	unreadable []string          // errors an API server answered a read with, and Secrets missing or changed
	written    map[string]string // the churn Secrets' last value written
	// unsure are the values written since, whose answer never came (the
	// write cut by check's cancel, a connection lost): the Secret may hold
	// any of them instead.
	unsure  map[string][]string
	refused int // writes the freeze refused
}

const churn = 4

func startTraffic(t *testing.T, f *sim.Fleet, kc kubernetes.Interface, stable map[string]string) *traffic {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	tr := &traffic{cancel: cancel, stable: stable, written: map[string]string{}, unsure: map[string][]string{}}
	for i := range churn {
		name := fmt.Sprintf("churn-%d", i)
		s := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: name}, StringData: map[string]string{"v": "0"}}
		if _, err := kc.CoreV1().Secrets("default").Create(ctx, s, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			t.Fatal(err)
		}
		cur, err := kc.CoreV1().Secrets("default").Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		tr.written[name] = string(cur.Data["v"])
	}
	for _, cp := range f.ControlPlanes() {
		rc := f.APIConfig()
		rc.Host = "https://" + cp.APIServer().Address
		rc.Timeout = 10 * time.Second
		tr.wg.Go(func() { tr.read(ctx, cp, rc) })
	}
	tr.wg.Go(func() { tr.write(ctx, kc) })
	t.Cleanup(cancel)
	return tr
}

// read lists every Secret on one API server until ctx ends. A server that
// does not answer (restarting) is not a read; an answer that is an error,
// or a list without a seeded Secret or with another value in it, is an
// unreadable Secret.
func (tr *traffic) read(ctx context.Context, cp *sim.Machine, rc *rest.Config) {
	kc, err := kubernetes.NewForConfig(rc)
	if err != nil {
		tr.fail(err.Error())
		return
	}
	for ctx.Err() == nil {
		list, err := kc.CoreV1().Secrets("").List(ctx, metav1.ListOptions{})
		switch {
		case ctx.Err() != nil:
			return
		case err != nil && answered(err):
			tr.fail(fmt.Sprintf("%s: list: %v", cp.Name(), err))
		case err == nil:
			tr.reads.Add(1)
			got := map[string]string{}
			for _, s := range list.Items {
				got[s.Namespace+"/"+s.Name] = string(s.Data["v"])
			}
			for key, v := range tr.stable {
				if got[key] != v {
					tr.fail(fmt.Sprintf("%s: %s reads %q, want %q", cp.Name(), key, got[key], v))
				}
			}
		}
		select {
		case <-ctx.Done():
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// answered reports whether err is an API server's answer, not the absence
// of one: a server stopping or starting is unavailable, which is not a
// Secret it cannot read.
func answered(err error) bool {
	status, ok := err.(apierrors.APIStatus)
	if !ok {
		return false
	}
	code := status.Status().Code
	return code != 0 && code != 503 && code != 429
}

func (tr *traffic) fail(what string) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	if len(tr.unreadable) < 20 {
		tr.unreadable = append(tr.unreadable, what)
	}
}

// write updates the churn Secrets in turn until ctx ends, and keeps what
// each last holds by its writes.
func (tr *traffic) write(ctx context.Context, kc kubernetes.Interface) {
	for n := 1; ctx.Err() == nil; n++ {
		name := fmt.Sprintf("churn-%d", n%churn)
		cur, err := kc.CoreV1().Secrets("default").Get(ctx, name, metav1.GetOptions{})
		sent := err == nil
		if sent {
			cur.Data = map[string][]byte{"v": []byte(strconv.Itoa(n))}
			_, err = kc.CoreV1().Secrets("default").Update(ctx, cur, metav1.UpdateOptions{})
		}
		tr.mu.Lock()
		switch {
		case err == nil:
			tr.written[name] = strconv.Itoa(n)
			tr.unsure[name] = nil
		case apierrors.IsForbidden(err) && strings.Contains(err.Error(), executor.SecretWriteFreeze):
			tr.refused++
		case sent && !isAnswer(err):
			tr.unsure[name] = append(tr.unsure[name], strconv.Itoa(n))
		}
		tr.mu.Unlock()
		select {
		case <-ctx.Done():
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// check stops the traffic and fails the test for any Secret a reader could
// not read, any churn Secret that does not hold its last write, and a
// freeze that refused no write.
func (tr *traffic) check(t *testing.T, kc kubernetes.Interface) {
	t.Helper()
	tr.cancel()
	tr.wg.Wait()
	tr.mu.Lock()
	defer tr.mu.Unlock()
	t.Logf("%d reads over the API servers, %d writes refused by the freeze", tr.reads.Load(), tr.refused)
	for _, u := range tr.unreadable {
		t.Errorf("unreadable: %s", u)
	}
	if tr.reads.Load() == 0 {
		t.Error("no read went through")
	}
	if tr.refused == 0 {
		t.Error("no write was refused: the freeze was never seen")
	}
	for name, v := range tr.written {
		s, err := kc.CoreV1().Secrets("default").Get(context.Background(), name, metav1.GetOptions{})
		if err != nil || string(s.Data["v"]) != v && !slices.Contains(tr.unsure[name], string(s.Data["v"])) {
			t.Errorf("%s holds %q (%v), want its last write %q (or one unanswered since: %v)", name, s.Data["v"], err, v, tr.unsure[name])
		}
	}
}

// isAnswer reports whether err is the API server's answer that the write
// did not happen, rather than a call cut before its answer came or a
// timeout (after which the write may still land).
func isAnswer(err error) bool {
	var status apierrors.APIStatus
	return errors.As(err, &status) && !apierrors.IsTimeout(err) && !apierrors.IsServerTimeout(err)
}

// checkSecretboxRotated: every control plane holds one new secretbox key
// and no aescbc key, every Secret's value in etcd is sealed with that key
// and the seeded ones still read as seeded, the rotation's Secret and the
// freeze are gone.
func checkSecretboxRotated(t *testing.T, f *sim.Fleet, henv *testenv.Env, ns string, stable map[string]string) {
	t.Helper()
	ctx := context.Background()
	key := f.ControlPlanes()[0].Config().Cluster().SecretboxEncryptionSecret()
	for _, cp := range f.ControlPlanes() {
		c := cp.Config().Cluster()
		if c.SecretboxEncryptionSecret() != key || c.AESCBCEncryptionSecret() != "" {
			t.Errorf("%s: secretbox %t of the first's, aescbc set %t; want the first's secretbox key only", cp.Name(), c.SecretboxEncryptionSecret() == key, c.AESCBCEncryptionSecret() != "")
		}
	}
	sb := encryption.Key{Provider: encryption.Secretbox, Secret: key}
	outside, total, err := encryption.Outside(ctx, etcdOf(t, f), sb, 10)
	if err != nil || len(outside) > 0 || total < len(stable) {
		t.Errorf("of %d Secrets in etcd, not under the new key: %v (%v)", total, outside, err)
	}
	for key, v := range stable {
		ns, name, _ := strings.Cut(key, "/")
		s, err := henv.Kube.CoreV1().Secrets(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil || string(s.Data["v"]) != v {
			t.Errorf("%s reads %q (%v), want %q", key, s.Data["v"], err, v)
		}
	}
	for what, obj := range map[string]ctrlclient.Object{
		"the rotation's Secret": &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: executor.SecretboxRotationSecret}},
		"the freeze":            &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: executor.SecretWriteFreeze}},
	} {
		if err := henv.Client.Get(ctx, ctrlclient.ObjectKeyFromObject(obj), obj); !apierrors.IsNotFound(err) {
			t.Errorf("%s after the rotation: %v, want it gone", what, err)
		}
	}
}

// toAESCBCOnly moves the cluster from its secretbox key to a new aescbc
// key alone, with no writer running: aescbc beside secretbox on every
// control plane, every Secret re-encrypted under it, then secretbox
// removed.
func toAESCBCOnly(t *testing.T, f *sim.Fleet) {
	t.Helper()
	aes, err := encryption.NewKey(encryption.AESCBC)
	if err != nil {
		t.Fatal(err)
	}
	old := encryption.Key{Provider: encryption.Secretbox, Secret: f.ControlPlanes()[0].Config().Cluster().SecretboxEncryptionSecret()}
	applyCluster(t, f, func(c *v1alpha1.ClusterConfig) { c.ClusterAESCBCEncryptionSecret = aes.Secret })
	if _, err := (encryption.Rewrap{KV: etcdOf(t, f), Ring: encryption.Ring{old, aes}, To: aes}).Run(context.Background()); err != nil {
		t.Fatal(err)
	}
	applyCluster(t, f, func(c *v1alpha1.ClusterConfig) { c.ClusterSecretboxEncryptionSecret = "" })
}

// applyCluster changes every control plane's cluster section live and
// waits until its API server restarted.
func applyCluster(t *testing.T, f *sim.Fleet, change func(*v1alpha1.ClusterConfig)) {
	t.Helper()
	for _, cp := range f.ControlPlanes() {
		starts := cp.APIServer().Starts
		tc := dialEndpoint(t, f.Talosconfig(), f.Endpoints()[0])
		mc := machineconfig.Machine{Talos: tc, Node: cp.Address()}
		ch, err := mc.Plan(context.Background(), []machineconfig.Patch{machineconfig.Typed("encryption", func(cfg *v1alpha1.Config) error {
			change(cfg.ClusterConfig)
			return nil
		})})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := mc.Apply(context.Background(), ch.Config, machineconfig.NoReboot); err != nil {
			t.Fatalf("apply on %s: %v", cp.Name(), err)
		}
		testenv.Eventually(t, 3*time.Minute, "the API server of "+cp.Name()+" restarted", func(context.Context) (bool, error) {
			st := cp.APIServer()
			return st.Ready && st.Starts > starts, nil
		})
	}
}

// etcdOf is a client of the fleet's etcd itself, with a client
// certificate of the etcd CA.
func etcdOf(t *testing.T, f *sim.Fleet) *clientv3.Client {
	t.Helper()
	tc, err := f.EtcdClientTLS()
	if err != nil {
		t.Fatal(err)
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{f.HostedEtcd().ClientURL}, TLS: tc, DialTimeout: 10 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cli.Close() })
	return cli
}
