package sim_test

import (
	"bufio"
	"context"
	"crypto/tls"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/siderolabs/crypto/x509"
	"github.com/siderolabs/talos/pkg/machinery/config/generate/secrets"
	"github.com/siderolabs/talos/pkg/machinery/config/types/v1alpha1"
	"github.com/siderolabs/talos/pkg/machinery/resources/k8s"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"

	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

// hostedComponents are both components with the node-lifecycle controllers
// (which take the not-ready taint the API server puts on a new Node off
// once it is Ready): the machines must renew their Node Leases (nodeLeases).
var hostedComponents = sim.HostedComponents{ControllerManager: true, Scheduler: true, NodeMonitorGracePeriod: testenv.NodeGracePeriod}

func nodeLeases(spec sim.Spec) sim.Spec {
	spec.Kubelet.NodeLease = testenv.NodeLease
	return spec
}

// componentStarts are the starts of every control plane's components.
func componentStarts(f *sim.Fleet) map[string]int {
	starts := map[string]int{}
	for _, cp := range f.ControlPlanes() {
		for _, id := range []string{k8s.ControllerManagerID, k8s.SchedulerID} {
			starts[cp.Name()+"/"+id] = cp.Component(id).Starts
		}
	}
	return starts
}

// waitComponentsRestarted waits until every component that ran at before
// has started again and is ready.
func waitComponentsRestarted(t *testing.T, f *sim.Fleet, before map[string]int) {
	t.Helper()
	for _, cp := range f.ControlPlanes() {
		for _, id := range []string{k8s.ControllerManagerID, k8s.SchedulerID} {
			n := before[cp.Name()+"/"+id]
			if n == 0 {
				continue
			}
			testenv.Eventually(t, 3*time.Minute, id+" of "+cp.Name()+" restarted", func(context.Context) (bool, error) {
				st := cp.Component(id)
				return st.Ready && st.Starts > n, nil
			})
		}
	}
}

// leaders are the control planes whose component id leads: its /metrics,
// read with an admin certificate from the machine's cluster.ca (the
// component authenticates and authorizes it through the API, as Talos
// configures it), say leader_election_master_status 1. all is false when
// a control plane that is up did not answer.
func leaders(t *testing.T, f *sim.Fleet, id string) (leading []string, all bool) {
	t.Helper()
	all = true
	for _, cp := range f.ControlPlanes() {
		if cp.Down() {
			continue
		}
		st := cp.Component(id)
		crt, err := sim.AdminCertificate(cp.Config().Cluster().IssuingCA())
		if err != nil {
			t.Fatal(err)
		}
		pair, err := tls.X509KeyPair(crt.Crt, crt.Key)
		if err != nil {
			t.Fatal(err)
		}
		hc := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{
			InsecureSkipVerify: true, // its own self-signed serving certificate
			Certificates:       []tls.Certificate{pair},
		}}}
		resp, err := hc.Get("https://" + st.Address + "/metrics")
		if err != nil || resp.StatusCode != http.StatusOK {
			all = false // between restarts
			continue
		}
		sc := bufio.NewScanner(resp.Body)
		sc.Buffer(nil, 1<<20)
		for sc.Scan() {
			if line := sc.Text(); strings.HasPrefix(line, "leader_election_master_status{") && strings.HasSuffix(line, " 1") {
				leading = append(leading, cp.Name())
			}
		}
		resp.Body.Close()
	}
	return leading, all
}

// oneLeader waits until every control plane that is up answers and
// exactly one's component id leads, and returns that one.
func oneLeader(t *testing.T, f *sim.Fleet, id string) *sim.Machine {
	t.Helper()
	var got []string
	testenv.Eventually(t, 2*time.Minute, "one "+id+" leading", func(context.Context) (bool, error) {
		var all bool
		got, all = leaders(t, f, id)
		return all && len(got) == 1, nil
	})
	return f.Machine(got[0])
}

func mirrorVersions(t *testing.T, kc kubernetes.Interface, cp *sim.Machine, id string) (config, secrets string) {
	t.Helper()
	ctx, cancel := timeout()
	defer cancel()
	pod, err := kc.CoreV1().Pods(metav1.NamespaceSystem).Get(ctx, id+"-"+cp.Name(), metav1.GetOptions{})
	if err != nil {
		return "", ""
	}
	return pod.Annotations["talos.dev/config-version"], pod.Annotations["talos.dev/secrets-version"]
}

// TestHostedControllerManagerServiceAccountKey: each control plane's
// controller manager signs with its machine's cluster.serviceAccount.key;
// after the key changes on every control plane, the components restart
// (their mirror pods with a new secrets version) and a token the
// controller manager issues for a new ServiceAccount verifies with the new
// key on every API server.
func TestHostedControllerManagerServiceAccountKey(t *testing.T) {
	f, kc := startHosted(t, nodeLeases(fleetSpec(t, 2, 0)), hostedComponents)
	oneLeader(t, f, k8s.ControllerManagerID)
	versions := map[string]string{}
	for _, cp := range f.ControlPlanes() {
		for _, id := range []string{k8s.ControllerManagerID, k8s.SchedulerID} {
			testenv.Eventually(t, time.Minute, "the mirror pod "+id+"-"+cp.Name(), func(context.Context) (bool, error) {
				_, versions[id+cp.Name()] = mirrorVersions(t, kc, cp, id)
				return versions[id+cp.Name()] != "", nil
			})
		}
	}

	key, err := x509.NewECDSAKey()
	if err != nil {
		t.Fatal(err)
	}
	before := componentStarts(f)
	applyAll(t, f, func(cfg *v1alpha1.Config) {
		cfg.ClusterConfig.ClusterServiceAccount = &x509.PEMEncodedKey{Key: key.GetPrivateKeyPEM()}
	})
	waitComponentsRestarted(t, f, before)
	for _, cp := range f.ControlPlanes() {
		for _, id := range []string{k8s.ControllerManagerID, k8s.SchedulerID} {
			testenv.Eventually(t, time.Minute, "the mirror pod "+id+"-"+cp.Name()+" with a new secrets version", func(context.Context) (bool, error) {
				_, v := mirrorVersions(t, kc, cp, id)
				return v != "" && v != versions[id+cp.Name()], nil
			})
		}
	}

	ctx, cancel := timeout()
	defer cancel()
	if _, err := kc.CoreV1().ServiceAccounts("default").Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "robot"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	secret := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: "robot-token", Annotations: map[string]string{corev1.ServiceAccountNameKey: "robot"}},
		Type:       corev1.SecretTypeServiceAccountToken,
	}
	if _, err := kc.CoreV1().Secrets("default").Create(ctx, secret, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	var tok string
	testenv.Eventually(t, 2*time.Minute, "the token controller fills robot-token", func(ctx context.Context) (bool, error) {
		s, err := kc.CoreV1().Secrets("default").Get(ctx, "robot-token", metav1.GetOptions{})
		if err != nil {
			return false, nil //nolint:nilerr // the endpoint may be between API servers
		}
		tok = string(s.Data[corev1.ServiceAccountTokenKey])
		return tok != "", nil
	})
	// Each API server checks a legacy token against the Secret as its own
	// informer has it: one that has not seen the Secret filled yet refuses
	// the token for a moment, as a real one does. One signed with the old
	// key is refused for good.
	for _, cp := range f.ControlPlanes() {
		testenv.Eventually(t, time.Minute, cp.Name()+" accepts the token the controller manager issued after the key changed (signed with the new key)",
			func(context.Context) (bool, error) { return authenticates(t, f, cp, tok), nil })
	}
}

// TestHostedComponentsLeaderElection: one controller manager and one
// scheduler lead at a time; with the leading controller manager's control
// plane off (one of three: etcd keeps its quorum), another takes over, and
// a DaemonSet rolls out on every worker.
func TestHostedComponentsLeaderElection(t *testing.T) {
	f, kc := startHosted(t, nodeLeases(fleetSpec(t, 3, 2)), hostedComponents)
	kcm := oneLeader(t, f, k8s.ControllerManagerID)
	oneLeader(t, f, k8s.SchedulerID)

	c := talos(t, f)
	shutdownForce(t, c, kcm)
	if st := kcm.Component(k8s.ControllerManagerID); st.Ready {
		t.Fatalf("the controller manager of %s runs while its machine is off", kcm.Name())
	}

	labels := map[string]string{"app": "agent"}
	ds := &appsv1.DaemonSet{
		ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "agent"},
		Spec: appsv1.DaemonSetSpec{
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "agent", Image: "registry.k8s.io/pause:3.10"}}},
			},
		},
	}
	testenv.Eventually(t, time.Minute, "the DaemonSet created", func(ctx context.Context) (bool, error) {
		_, err := kc.AppsV1().DaemonSets("default").Create(ctx, ds, metav1.CreateOptions{})
		return err == nil, nil
	})
	var last appsv1.DaemonSetStatus
	defer func() {
		if t.Failed() {
			t.Logf("the DaemonSet's last status: %+v", last)
			nodes, err := kc.CoreV1().Nodes().List(context.Background(), metav1.ListOptions{})
			if err == nil {
				for _, n := range nodes.Items {
					t.Logf("node %s: labels %v taints %v unschedulable %v", n.Name, n.Labels, n.Spec.Taints, n.Spec.Unschedulable)
				}
			}
		}
	}()
	testenv.Eventually(t, 3*time.Minute, "the DaemonSet rolled out on both workers", func(ctx context.Context) (bool, error) {
		d, err := kc.AppsV1().DaemonSets("default").Get(ctx, "agent", metav1.GetOptions{})
		if err != nil {
			return false, nil //nolint:nilerr // the endpoint may be between API servers
		}
		last = d.Status
		return d.Status.DesiredNumberScheduled == 2 && d.Status.NumberReady == 2, nil
	})
	if got := oneLeader(t, f, k8s.ControllerManagerID); got == kcm {
		t.Errorf("the controller manager of %s leads while it is off", kcm.Name())
	}
}

// TestHostedComponentsKubernetesCARotation: through Talos's rotation of
// cluster.ca (accept the new CA, swap, drop the old one), the components
// restart with client certificates from the machine's cluster.ca and trust
// its serving CA, so that once the old CA is dropped they still work (a
// Deployment's pods run), and the controller manager publishes the new CA
// as kube-root-ca.crt (its --root-ca-file).
func TestHostedComponentsKubernetesCARotation(t *testing.T) {
	f, kc := startHosted(t, nodeLeases(fleetSpec(t, 2, 1)), hostedComponents)
	oldCA := f.ControlPlanes()[0].Config().Cluster().IssuingCA()
	ca, err := secrets.NewKubernetesCA(time.Now(), nil)
	if err != nil {
		t.Fatal(err)
	}
	newCA := &x509.PEMEncodedCertificateAndKey{Crt: ca.CrtPEM, Key: ca.KeyPEM}
	for _, step := range []func(*v1alpha1.Config){
		func(cfg *v1alpha1.Config) {
			cfg.ClusterConfig.ClusterAcceptedCAs = []*x509.PEMEncodedCertificate{{Crt: newCA.Crt}}
		},
		func(cfg *v1alpha1.Config) {
			cfg.ClusterConfig.ClusterCA = newCA
			cfg.ClusterConfig.ClusterAcceptedCAs = []*x509.PEMEncodedCertificate{{Crt: oldCA.Crt}}
		},
		func(cfg *v1alpha1.Config) { cfg.ClusterConfig.ClusterAcceptedCAs = nil },
	} {
		before := componentStarts(f)
		applyAll(t, f, step)
		waitComponentsRestarted(t, f, before)
	}

	// The endpoint now serves from the new CA: a client that trusts it.
	cfg := f.APIConfig()
	admin, err := sim.AdminCertificate(newCA)
	if err != nil {
		t.Fatal(err)
	}
	cfg.CAData, cfg.CertData, cfg.KeyData = newCA.Crt, admin.Crt, admin.Key
	kc, err = kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	labels := map[string]string{"app": "web"}
	dep := &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "web"},
		Spec: appsv1.DeploymentSpec{
			Replicas: ptr.To[int32](2),
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "web", Image: "registry.k8s.io/pause:3.10"}}},
			},
		},
	}
	testenv.Eventually(t, time.Minute, "the Deployment created", func(ctx context.Context) (bool, error) {
		_, err := kc.AppsV1().Deployments("default").Create(ctx, dep, metav1.CreateOptions{})
		return err == nil, nil
	})
	testenv.Eventually(t, 3*time.Minute, "2 web pods ready after the rotation", func(ctx context.Context) (bool, error) {
		d, err := kc.AppsV1().Deployments("default").Get(ctx, "web", metav1.GetOptions{})
		if err != nil {
			return false, nil //nolint:nilerr // the endpoint may be between API servers
		}
		return d.Status.ReadyReplicas == 2, nil
	})
	ctx, cancel := timeout()
	defer cancel()
	if _, err := kc.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "after-rotation"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, time.Minute, "kube-root-ca.crt in after-rotation is the new CA", func(ctx context.Context) (bool, error) {
		cm, err := kc.CoreV1().ConfigMaps("after-rotation").Get(ctx, "kube-root-ca.crt", metav1.GetOptions{})
		if err != nil {
			return false, nil //nolint:nilerr // not published yet
		}
		return cm.Data["ca.crt"] == string(newCA.Crt), nil
	})
}
