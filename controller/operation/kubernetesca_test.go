package operation_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/siderolabs/crypto/x509"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/utils/ptr"
	ctrlclient "sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/app"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/controller/operation"
	"maesh.dev/ichor/internal/kubepki"
	"maesh.dev/ichor/internal/testcluster"
	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

// TestKubernetesCARotation rotates the Kubernetes CA of a hosted fleet (3
// control planes whose API servers follow cluster.ca and
// cluster.acceptedCAs, and a worker) with a controller whose own
// credentials are the fleet's first admin kubeconfig, which the rotation
// makes stale: afterwards a client certificate of the old CA is refused by
// every API server, every machine has the new CA as cluster.ca (its key on
// control planes only) and accepts no other, every kubelet restarted once
// per stage, the rotation's Secret is gone, the message says what to do
// with an old kubeconfig, and the same controller then reboots a machine.
// Then a second rotation, with the controller killed right after each
// stage's first step ran (each new one started with the credentials a new
// pod would have then), ends the same way.
func TestKubernetesCARotation(t *testing.T) {
	t.Parallel() // its own hosted fleet and API servers (see TestMain)
	fleet, henv := testcluster.StartHostedFleet(t, sim.Cluster("", 3, 1), testenv.Components{})
	const ns = "default"
	testcluster.WriteTalosconfig(t, henv, fleet, ns)
	obs, err := ctrlclient.New(fleet.FollowingAPIConfig(), ctrlclient.Options{Scheme: app.Scheme})
	if err != nil {
		t.Fatal(err)
	}
	worker := fleet.Machines()[3].Name()

	restarts := kubeletRestarts(fleet)
	oldCA := fleet.ControlPlanes()[0].Config().Cluster().IssuingCA()
	ctl := testcluster.StartController(t, henv.Config, app.Options{Namespace: ns})
	op := createK8sCA(t, obs, ns, "rotate")
	waitOp(t, obs, op, 8*time.Minute)
	if !strings.Contains(op.Status.Message, "a kubeconfig of the old Kubernetes CA") || strings.Contains(op.Status.Message, "talosconfig") {
		t.Errorf("message %q does not say what to do with an old kubeconfig (and only that)", op.Status.Message)
	}
	checkK8sRotated(t, fleet, obs, ns, oldCA, restarts)
	reboot := &ichorv1.TalosOperation{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "reboot"},
		Spec: ichorv1.TalosOperationSpec{Kind: ichorv1.KindNode, Node: &ichorv1.NodeAction{Machine: worker, Action: ichorv1.NodeReboot}}}
	if err := obs.Create(context.Background(), reboot); err != nil {
		t.Fatal(err)
	}
	waitOp(t, obs, reboot, 3*time.Minute)
	ctl.Stop()

	// Again, killed at every stage boundary.
	restarts = kubeletRestarts(fleet)
	oldCA = fleet.ControlPlanes()[0].Config().Cluster().IssuingCA()
	op = createK8sCA(t, obs, ns, "rotate-killed")
	killedAt := killInEachStage(t, obs, ctrlclient.ObjectKeyFromObject(op), 12, 4*time.Minute, func(hook func(operation.StepRun)) *testcluster.Controller {
		return testcluster.StartKillable(t, podCredentials(t, fleet), app.Options{Namespace: ns, TestHookAfterRun: hook})
	})
	if len(killedAt) != 7 {
		t.Errorf("killed in %d stages, want each of the 7 (%v)", len(killedAt), killedAt)
	}
	checkK8sRotated(t, fleet, obs, ns, oldCA, restarts)
}

func createK8sCA(t *testing.T, c ctrlclient.Client, ns, name string) *ichorv1.TalosOperation {
	t.Helper()
	op := &ichorv1.TalosOperation{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: ichorv1.TalosOperationSpec{Kind: ichorv1.KindCARotation, CARotation: &ichorv1.CARotation{Talos: ptr.To(false), Kubernetes: ptr.To(true)}}}
	if err := c.Create(context.Background(), op); err != nil {
		t.Fatal(err)
	}
	return op
}

// waitOp waits until op succeeded, and fails the test if it failed.
func waitOp(t *testing.T, c ctrlclient.Client, op *ichorv1.TalosOperation, within time.Duration) {
	t.Helper()
	testenv.Eventually(t, within, op.Name+" to succeed", func(ctx context.Context) (bool, error) {
		if err := c.Get(ctx, ctrlclient.ObjectKeyFromObject(op), op); err != nil {
			return false, nil //nolint:nilerr // the endpoint may be between API servers
		}
		if op.Failed() {
			t.Fatalf("%s failed: %s: %s", op.Name, op.Status.FailureReason, op.Status.Message)
		}
		return op.Succeeded(), nil
	})
}

func kubeletRestarts(f *sim.Fleet) map[string]int {
	out := map[string]int{}
	for _, m := range f.Machines() {
		out[m.Name()] = m.KubeletRestarts()
	}
	return out
}

// podCredentials are what a controller pod started now would reach the
// API with: current trust and a valid identity (in a cluster, its
// ServiceAccount token and the kube-root-ca.crt the controller manager
// publishes); here the admin kubeconfig a control plane issues now.
func podCredentials(t *testing.T, f *sim.Fleet) *rest.Config {
	t.Helper()
	tc := dialEndpoint(t, f.Talosconfig(), f.Endpoints()[0])
	var rc *rest.Config
	testenv.Eventually(t, time.Minute, "a kubeconfig from a control plane", func(ctx context.Context) (bool, error) {
		data, err := tc.Kubeconfig(ctx)
		if err != nil {
			return false, nil //nolint:nilerr // the machine may be applying a stage
		}
		rc, err = clientcmd.RESTConfigFromKubeConfig(data)
		return err == nil, err
	})
	rc.Host = f.APIConfig().Host
	return rc
}

// checkK8sRotated: every machine's cluster.ca is a new CA (its key on
// control planes only) and accepts no other; every API server refuses a
// client certificate of oldCA and accepts one of the new CA, serving from
// it; every kubelet restarted once per stage (3) since restarts; the
// rotation's Secret is gone.
func checkK8sRotated(t *testing.T, f *sim.Fleet, c ctrlclient.Client, ns string, oldCA *x509.PEMEncodedCertificateAndKey, restarts map[string]int) {
	t.Helper()
	newCA := f.ControlPlanes()[0].Config().Cluster().IssuingCA()
	if sameCert(newCA.Crt, oldCA.Crt) {
		t.Fatal("cluster.ca is still the old CA")
	}
	for _, m := range f.Machines() {
		cl := m.Config().Cluster()
		if !sameCert(cl.IssuingCA().Crt, newCA.Crt) || (len(cl.IssuingCA().Key) > 0) != (m.Role() == sim.ControlPlane) {
			t.Errorf("%s: cluster.ca is not the new CA (with its key on a control plane only)", m.Name())
		}
		if n := len(cl.AcceptedCAs()); n != 0 {
			t.Errorf("%s: cluster.acceptedCAs holds %d CA(s), want none", m.Name(), n)
		}
		if n := m.KubeletRestarts() - restarts[m.Name()]; n != 3 {
			t.Errorf("%s: the kubelet restarted %d times, want once in each of the 3 stages", m.Name(), n)
		}
	}
	for _, cp := range f.ControlPlanes() {
		for what, ca := range map[string]*x509.PEMEncodedCertificateAndKey{"old": oldCA, "new": newCA} {
			err := listWith(t, cp.APIServer().Address, newCA.Crt, ca)
			if want := what == "new"; (err == nil) != want {
				t.Errorf("%s: a client certificate of the %s CA: %v", cp.Name(), what, err)
			}
			if what == "old" && err != nil && !apierrors.IsUnauthorized(err) {
				t.Errorf("%s: a client certificate of the old CA: %v, want 401", cp.Name(), err)
			}
		}
	}
	err := c.Get(context.Background(), ctrlclient.ObjectKey{Namespace: ns, Name: executor.KubernetesCARotationSecret}, &corev1.Secret{})
	if !apierrors.IsNotFound(err) {
		t.Errorf("Secret %s after the rotation: %v, want it removed", executor.KubernetesCARotationSecret, err)
	}
}

// listWith lists Nodes on the API server at address trusting serverCA, with
// an admin client certificate of clientCA.
func listWith(t *testing.T, address string, serverCA []byte, clientCA *x509.PEMEncodedCertificateAndKey) error {
	t.Helper()
	crt, err := kubepki.Admin(clientCA)
	if err != nil {
		t.Fatal(err)
	}
	kc, err := kubernetes.NewForConfig(&rest.Config{Host: "https://" + address,
		TLSClientConfig: rest.TLSClientConfig{CAData: serverCA, CertData: crt.Crt, KeyData: crt.Key}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = kc.CoreV1().Nodes().List(ctx, metav1.ListOptions{Limit: 1})
	return err
}

func sameCert(a, b []byte) bool { return strings.TrimSpace(string(a)) == strings.TrimSpace(string(b)) }
