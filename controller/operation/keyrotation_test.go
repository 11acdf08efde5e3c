package operation_test

import (
	"context"
	stdx509 "crypto/x509"
	"encoding/pem"
	"fmt"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	ctrlclient "sigs.k8s.io/controller-runtime/pkg/client"

	talosclient "github.com/siderolabs/talos/pkg/machinery/client"
	"github.com/siderolabs/talos/pkg/machinery/constants"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/app"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/controller/machine"
	"maesh.dev/ichor/controller/operation"
	"maesh.dev/ichor/internal/testcluster"
	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

// TestServiceAccountKeyRotation rotates the service-account key of a
// hosted fleet (3 control planes whose API servers and controller managers
// follow cluster.serviceAccount.key, 2 workers) that runs a Deployment of 3
// with a budget of minAvailable 2, a DaemonSet, a bare pod and a legacy
// token Secret, with a controller that runs as its ServiceAccount with the
// RBAC of manifests/. Created paused, each machine's message is its plan:
// the control planes take the new key, the pods restart by workload, the
// bare pod is named. Resumed, each controller killed right after a step no
// controller was killed after yet (each new one on a token signed then, as
// a new pod would have), it ends with a token of the old key refused by
// every API server and one signed now taken, the new key (RSA 4096) on
// every control plane, every pod of the Deployment and the DaemonSet
// replaced without the budget ever broken, the bare pod untouched and
// named, the legacy token signed again and taken, and the rotation's
// Secret gone. (The sandbox's TestKeyRotationEndToEnd runs it
// uninterrupted, the controller's own token going stale under it, and
// then has it reboot a machine.)
func TestServiceAccountKeyRotation(t *testing.T) {
	t.Parallel() // its own hosted fleet and API servers (see TestMain)
	fleet, henv := testcluster.StartHostedFleet(t, sim.Cluster("", 3, 2), testenv.Components{ControllerManager: true, Scheduler: true, NodeLifecycle: true})
	const ns, ctrlNS = "default", ichorv1.DefaultNamespace
	installControllerRBAC(t, henv)
	testcluster.WriteTalosconfig(t, henv, fleet, ctrlNS)
	before := startSAWorkloads(t, fleet, henv, ns)

	op := createSAKeyRotation(t, henv.Client, ns, "rotate", true)
	ctl := testcluster.StartController(t, controllerToken(t, henv), app.Options{Namespace: ctrlNS})
	checkSAPlan(t, henv.Client, op, before)
	ctl.Stop()
	budget := followReadiness(t, henv.Kube, ns, "web", "agent")
	patch := ctrlclient.RawPatch(types.MergePatchType, []byte(`{"spec":{"paused":false}}`))
	if err := henv.Client.Patch(context.Background(), op, patch); err != nil {
		t.Fatal(err)
	}
	killedAt := killAtEachStep(t, henv.Client, ctrlclient.ObjectKeyFromObject(op), 16, 4*time.Minute, func(hook func(operation.StepRun)) *testcluster.Controller {
		return testcluster.StartKillable(t, controllerToken(t, henv), app.Options{Namespace: ctrlNS, TestHookAfterRun: hook})
	})
	for _, stage := range []string{executor.StageSAPrepare, executor.StageSASwap, executor.StageSAVerify, executor.StageTokensReissue, executor.StageWorkloadsRestart} {
		if !killedIn(killedAt, stage) {
			t.Errorf("never killed in stage %s (%v)", stage, killedAt)
		}
	}
	if !killedAt[executor.StageSASwap+"/"+executor.StepSwapServiceAccountKey] {
		t.Errorf("never killed between a swap of the service-account key and its record (%v)", killedAt)
	}
	checkSARotated(t, fleet, henv, op, before, budget)
}

func createSAKeyRotation(t *testing.T, c ctrlclient.Client, ns, name string, paused bool) *ichorv1.TalosOperation {
	t.Helper()
	op := &ichorv1.TalosOperation{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: ichorv1.TalosOperationSpec{Kind: ichorv1.KindKeyRotation, Paused: paused,
			KeyRotation: &ichorv1.KeyRotation{ServiceAccount: ptr.To(true), Secretbox: ptr.To(false)}}}
	if err := c.Create(context.Background(), op); err != nil {
		t.Fatal(err)
	}
	return op
}

// installControllerRBAC makes the controller's namespace, ServiceAccount
// and RBAC as manifests/ has them.
func installControllerRBAC(t *testing.T, henv *testenv.Env) {
	t.Helper()
	ctx := context.Background()
	nsObj := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ichorv1.DefaultNamespace}}
	if err := henv.Client.Create(ctx, nsObj); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(henv.Root, "manifests", "controller")
	if _, stderr, err := henv.Kubectl(ctx, nil, "apply", "-f", filepath.Join(dir, "serviceaccount.yaml"), "-f", filepath.Join(dir, "rbac.yaml")); err != nil {
		t.Fatalf("apply the controller's RBAC: %v: %s", err, stderr)
	}
}

// controllerToken is what a controller pod started now reaches the API
// with: a token of its ServiceAccount, signed by the key the API server
// that answers holds now.
func controllerToken(t *testing.T, henv *testenv.Env) *rest.Config {
	t.Helper()
	var tok string
	testenv.Eventually(t, time.Minute, "a token of the controller's ServiceAccount", func(ctx context.Context) (bool, error) {
		tr, err := henv.Kube.CoreV1().ServiceAccounts(ichorv1.DefaultNamespace).CreateToken(ctx, "ichor-controller", &authenticationv1.TokenRequest{}, metav1.CreateOptions{})
		if err != nil {
			return false, nil //nolint:nilerr // the endpoint may be between API servers
		}
		tok = tr.Status.Token
		return true, nil
	})
	return &rest.Config{Host: henv.Config.Host, TLSClientConfig: rest.TLSClientConfig{CAData: henv.Config.CAData}, BearerToken: tok, QPS: 100, Burst: 200}
}

// saWorld is what the test looks at before a rotation.
type saWorld struct {
	ns        string
	bare      types.UID // the bare pod, on the first worker
	bareOn    string
	restarted map[types.UID]string // the Deployment's and DaemonSet's pods
	pods      map[string]int       // of each of them
	legacy    string               // the legacy token Secret's token
	oldToken  string               // a token of the old key
	oldKey    []byte
}

// startSAWorkloads runs the workloads (a Deployment web of 3 with a
// budget of minAvailable 2, a DaemonSet agent, a bare pod, a legacy token
// Secret) and returns the world they make.
func startSAWorkloads(t *testing.T, fleet *sim.Fleet, henv *testenv.Env, ns string) *saWorld {
	t.Helper()
	bareOn := fleet.Machines()[3].Name()
	agent := daemonSetOf(ns, "agent") // on the control planes too
	agent.Spec.Template.Spec.Tolerations = []corev1.Toleration{{Key: constants.LabelNodeRoleControlPlane, Operator: corev1.TolerationOpExists}}
	for _, obj := range []ctrlclient.Object{
		deploymentOf(ns, "web", 3, time.Second), pdbOf(ns, "web", 2), agent,
		&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "bare", Labels: labels("bare")},
			Spec: corev1.PodSpec{NodeName: bareOn, Containers: []corev1.Container{{Name: "bare", Image: "registry.k8s.io/pause:3.10"}}}},
		&corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "legacy"}},
		&corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "legacy-token", Annotations: map[string]string{corev1.ServiceAccountNameKey: "legacy"}},
			Type: corev1.SecretTypeServiceAccountToken},
	} {
		testenv.Eventually(t, time.Minute, "create "+obj.GetName(), func(ctx context.Context) (bool, error) {
			err := henv.Client.Create(ctx, obj)
			return err == nil || apierrors.IsAlreadyExists(err), nil // the ServiceAccount default may not be there yet
		})
	}
	waitHealthy(t, henv.Client, ns, "web", 3)
	waitHealthy(t, henv.Client, ns, "agent", len(fleet.Machines()))
	waitHealthy(t, henv.Client, ns, "bare", 1)
	return saWorldOf(t, fleet, henv, ns)
}

// saWorldOf records the world as it is now.
func saWorldOf(t *testing.T, fleet *sim.Fleet, henv *testenv.Env, ns string) *saWorld {
	t.Helper()
	w := &saWorld{ns: ns, restarted: map[types.UID]string{}, pods: map[string]int{}, bareOn: fleet.Machines()[3].Name(), oldKey: fleet.ControlPlanes()[0].Config().Cluster().ServiceAccount().Key}
	for _, app := range []string{"web", "agent"} {
		for _, p := range podsOf(t, henv.Client, ns, app) {
			if !holdsToken(&p) {
				t.Fatalf("pod %s holds no ServiceAccount token: the test shows nothing", p.Name)
			}
			w.restarted[p.UID] = p.Name
			w.pods[app]++
		}
	}
	bare := podsOf(t, henv.Client, ns, "bare")
	if len(bare) != 1 {
		t.Fatalf("%d bare pods", len(bare))
	}
	w.bare = bare[0].UID
	testenv.Eventually(t, time.Minute, "the tokens controller to sign legacy-token", func(ctx context.Context) (bool, error) {
		s, err := henv.Kube.CoreV1().Secrets(ns).Get(ctx, "legacy-token", metav1.GetOptions{})
		if err != nil {
			return false, nil //nolint:nilerr // the endpoint may be between API servers
		}
		w.legacy = string(s.Data[corev1.ServiceAccountTokenKey])
		return w.legacy != "", nil
	})
	tr, err := henv.Kube.CoreV1().ServiceAccounts(ns).CreateToken(context.Background(), "default", &authenticationv1.TokenRequest{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	w.oldToken = tr.Status.Token
	return w
}

func holdsToken(p *corev1.Pod) bool {
	for _, v := range p.Spec.Volumes {
		if v.Projected != nil {
			for _, s := range v.Projected.Sources {
				if s.ServiceAccountToken != nil {
					return true
				}
			}
		}
	}
	return false
}

// checkSAPlan: while the operation waits paused, every machine's message
// is its plan: the control planes take the new key, the Deployment's 3
// pods and the DaemonSet's (one a machine) restart, the bare pod is named
// on its machine; nothing ran.
func checkSAPlan(t *testing.T, c ctrlclient.Client, op *ichorv1.TalosOperation, w *saWorld) {
	t.Helper()
	testenv.Eventually(t, time.Minute, "a plan on every machine", func(ctx context.Context) (bool, error) {
		if err := c.Get(ctx, ctrlclient.ObjectKeyFromObject(op), op); err != nil {
			return false, nil //nolint:nilerr // the endpoint may be between API servers
		}
		for _, m := range op.Status.Machines {
			if !strings.HasPrefix(m.Message, "plan: ") {
				return false, nil
			}
		}
		return len(op.Status.Machines) == 5 && op.Status.Reason == ichorv1.ReasonPausedByOperator, nil
	})
	web, agents := 0, 0
	for _, m := range op.Status.Machines {
		t.Logf("%s: %s", m.Name, m.Message)
		if takes := strings.Contains(m.Message, "takes the new service-account key (its API server restarts)"); takes != (m.Role == ichorv1.RoleControlPlane) {
			t.Errorf("%s (%s): the plan %q says wrong whether it takes the new key", m.Name, m.Role, m.Message)
		}
		web += countIn(m.Message, "Deployment "+w.ns+"/web")
		agents += countIn(m.Message, "DaemonSet "+w.ns+"/agent")
		if names := strings.Contains(m.Message, "not restarted: "+w.ns+"/bare (no controller)"); names != (m.Name == w.bareOn) {
			t.Errorf("%s: the plan %q says wrong whether the bare pod is there", m.Name, m.Message)
		}
	}
	if web != 3 || agents != 5 {
		t.Errorf("the plans restart %d pods of web and %d of agent, want 3 and 5", web, agents)
	}
	if op.Status.StartTime != nil {
		t.Error("the paused operation started")
	}
}

// countIn is the pod count a plan gives a workload: "Deployment ns/web (2)".
func countIn(message, workload string) int {
	m := regexp.MustCompile(regexp.QuoteMeta(workload) + ` \((\d+)\)`).FindStringSubmatch(message)
	if m == nil {
		return 0
	}
	n, _ := strconv.Atoi(m[1])
	return n
}

// checkSARotated: every API server refuses the old key's token and takes
// one it signs now; every control plane holds one new RSA 4096 key; the
// Deployment's and the DaemonSet's pods were all replaced, never fewer
// than 2 of web healthy; the bare pod is untouched and named; the legacy
// token was signed again and is taken; the rotation's Secret is gone.
func checkSARotated(t *testing.T, fleet *sim.Fleet, henv *testenv.Env, op *ichorv1.TalosOperation, w *saWorld, budget *readiness) {
	t.Helper()
	ctx := context.Background()
	checkNewKey(t, fleet, w.oldKey)
	for _, cp := range fleet.ControlPlanes() {
		rc := rest.CopyConfig(henv.Config)
		rc.Host = "https://" + cp.APIServer().Address
		kc, err := kubernetes.NewForConfig(rc)
		if err != nil {
			t.Fatal(err)
		}
		if reviewed(t, kc, w.oldToken) {
			t.Errorf("%s takes a token of the old key", cp.Name())
		}
		tr, err := kc.CoreV1().ServiceAccounts(w.ns).CreateToken(ctx, "default", &authenticationv1.TokenRequest{}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if !reviewed(t, kc, tr.Status.Token) {
			t.Errorf("%s refuses a token it signed now", cp.Name())
		}
	}
	waitHealthy(t, henv.Client, w.ns, "web", 3)
	waitHealthy(t, henv.Client, w.ns, "agent", len(fleet.Machines()))
	for _, app := range []string{"web", "agent"} {
		for _, p := range podsOf(t, henv.Client, w.ns, app) {
			if w.restarted[p.UID] != "" {
				t.Errorf("pod %s was not restarted", p.Name)
			}
		}
	}
	if n := budget.least("web"); n < 2 {
		t.Errorf("web's budget (minAvailable 2) was broken: %s", budget.broken("web"))
	}
	// Each pod restarted once: none made after the swap was restarted.
	if web, agents := budget.madeSince("web"), budget.madeSince("agent"); web != w.pods["web"] || agents != w.pods["agent"] {
		t.Errorf("%d web and %d agent pods made during the rotation, want one for each restarted (%d and %d)", web, agents, w.pods["web"], w.pods["agent"])
	}
	checkSALeftAndReissued(t, henv, op, w)
}

// checkNewKey: every control plane holds the same new key, RSA 4096.
func checkNewKey(t *testing.T, fleet *sim.Fleet, old []byte) {
	t.Helper()
	key := fleet.ControlPlanes()[0].Config().Cluster().ServiceAccount().Key
	for _, cp := range fleet.ControlPlanes() {
		if k := cp.Config().Cluster().ServiceAccount().Key; !sameCert(k, key) || sameCert(k, old) {
			t.Errorf("%s: cluster.serviceAccount.key is not the new key every control plane holds", cp.Name())
		}
	}
	block, _ := pem.Decode(key)
	if block == nil {
		t.Fatal("the new key is not PEM")
	}
	rsa, err := stdx509.ParsePKCS1PrivateKey(block.Bytes)
	if err != nil {
		t.Fatalf("the new key: %v", err)
	}
	if bits := rsa.N.BitLen(); bits != 4096 {
		t.Errorf("the new key is RSA %d, want 4096 as Talos makes it", bits)
	}
}

// checkSALeftAndReissued: the bare pod is untouched and named on its
// machine, the legacy token was signed again and is taken, the rotation's
// Secret is gone.
func checkSALeftAndReissued(t *testing.T, henv *testenv.Env, op *ichorv1.TalosOperation, w *saWorld) {
	t.Helper()
	ctx := context.Background()
	if err := henv.Client.Get(ctx, ctrlclient.ObjectKeyFromObject(op), op); err != nil {
		t.Fatal(err)
	}
	if bare := podsOf(t, henv.Client, w.ns, "bare"); len(bare) != 1 || bare[0].UID != w.bare {
		t.Errorf("the bare pod was touched: %v", bare)
	}
	named := false
	for _, m := range op.Status.Machines {
		t.Logf("%s: %s", m.Name, m.Message)
		named = named || m.Name == w.bareOn && strings.Contains(m.Message, "not restarted: "+w.ns+"/bare (no controller)")
	}
	if !named {
		t.Errorf("%s's message does not name the bare pod: %+v", w.bareOn, op.Status.Machines)
	}
	s, err := henv.Kube.CoreV1().Secrets(w.ns).Get(ctx, "legacy-token", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if tok := string(s.Data[corev1.ServiceAccountTokenKey]); tok == w.legacy || !reviewed(t, henv.Kube, tok) {
		t.Errorf("the legacy token was not signed again with the new key (changed: %v)", tok != w.legacy)
	}
	err = henv.Client.Get(ctx, ctrlclient.ObjectKey{Namespace: ichorv1.DefaultNamespace, Name: executor.ServiceAccountKeyRotationSecret}, &corev1.Secret{})
	if !apierrors.IsNotFound(err) {
		t.Errorf("Secret %s after the rotation: %v, want it removed", executor.ServiceAccountKeyRotationSecret, err)
	}
}

// reviewed asks the API server kc reaches whether it takes token.
func reviewed(t *testing.T, kc kubernetes.Interface, token string) bool {
	t.Helper()
	tr, err := kc.AuthenticationV1().TokenReviews().Create(context.Background(), &authenticationv1.TokenReview{Spec: authenticationv1.TokenReviewSpec{Token: token}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return tr.Status.Authenticated
}

// TestServiceAccountKeyPreflight: a key rotation is refused while a
// control plane is down, naming it and saying why; nothing runs.
func TestServiceAccountKeyPreflight(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 3, 1))
	cp2 := c.fleet.ControlPlanes()[1]
	tc := dialEndpoint(t, c.fleet.Talosconfig(), c.fleet.Endpoints()[0])
	if err := tc.Shutdown(talosclient.WithNode(context.Background(), cp2.Address())); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, time.Minute, cp2.Name()+"'s Node NotReady", func(ctx context.Context) (bool, error) {
		var n corev1.Node
		if err := env.Client.Get(ctx, keyOfNode(cp2.Name()), &n); err != nil {
			return false, err
		}
		return !machine.Ready(&n), nil
	})
	c.start(func(o *app.Options, _ **rest.Config) {
		o.Executors[ichorv1.KindKeyRotation] = executor.NewKeyRotation()
	})
	c.create("rotate", ichorv1.TalosOperationSpec{Kind: ichorv1.KindKeyRotation, KeyRotation: &ichorv1.KeyRotation{Secretbox: ptr.To(false)}})
	op := c.waitFor("rotate", "to be refused", time.Minute, func(op *ichorv1.TalosOperation) bool { return op.Status.Phase == ichorv1.PhaseRefused })
	want := fmt.Sprintf("%s: not Ready: every control plane takes the new keys and restarts its API server, so bring it back first", cp2.Name())
	found := false
	for _, cond := range op.Status.Conditions {
		found = found || strings.Contains(cond.Message, want)
	}
	if !found {
		t.Errorf("refused without saying %q: %s, %+v", want, op.Status.Message, op.Status.Conditions)
	}
	if n := c.fleet.Recorder().Calls("", "ApplyConfiguration"); n != 0 {
		t.Errorf("%d configurations applied, want none", n)
	}
}
