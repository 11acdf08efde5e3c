package sim_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"fmt"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/siderolabs/crypto/x509"
	"github.com/siderolabs/talos/pkg/machinery/api/machine"
	"github.com/siderolabs/talos/pkg/machinery/client"
	"github.com/siderolabs/talos/pkg/machinery/config/generate/secrets"
	"github.com/siderolabs/talos/pkg/machinery/config/types/v1alpha1"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"maesh.dev/ichor/internal/kubepki"
	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

// hostedFleet starts a fleet of cps control planes that host the API and
// its etcd (sim.Spec.Hosted), and returns it with a client for its
// endpoint.
func hostedFleet(t *testing.T, cps int) (*sim.Fleet, kubernetes.Interface) {
	t.Helper()
	return startHosted(t, fleetSpec(t, cps, 0), sim.HostedComponents{})
}

// startHosted starts spec with its control planes hosting the API and
// its etcd, and running components.
func startHosted(t *testing.T, spec sim.Spec, components sim.HostedComponents) (*sim.Fleet, kubernetes.Interface) {
	t.Helper()
	spec.Hosted = &sim.Hosted{Assets: os.Getenv("KUBEBUILDER_ASSETS"), Dir: t.TempDir(), Components: components}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	began := time.Now()
	f, err := sim.Start(ctx, spec, nil)
	if err != nil {
		t.Fatalf("start hosted fleet: %v", err)
	}
	t.Cleanup(f.Stop)
	t.Logf("%d API servers ready %s after the fleet started", len(f.ControlPlanes()), time.Since(began).Round(time.Millisecond))
	kc, err := kubernetes.NewForConfig(f.APIConfig())
	if err != nil {
		t.Fatal(err)
	}
	return f, kc
}

// applyAll changes the configuration of every control plane live
// (NO_REBOOT), back to back, and waits until each one's API server has
// restarted and is ready. It returns how long the whole control plane took.
func applyAll(t *testing.T, f *sim.Fleet, fn func(*v1alpha1.Config)) time.Duration {
	t.Helper()
	starts := map[string]int{}
	began := time.Now()
	for _, cp := range f.ControlPlanes() {
		starts[cp.Name()] = cp.APIServer().Starts
		if _, err := newConfigApply(t, f, cp).apply(machine.ApplyConfigurationRequest_NO_REBOOT, false, fn); err != nil {
			t.Fatalf("apply on %s: %v", cp.Name(), err)
		}
	}
	for _, cp := range f.ControlPlanes() {
		testenv.Eventually(t, 3*time.Minute, "the API server of "+cp.Name()+" restarted", func(context.Context) (bool, error) {
			st := cp.APIServer()
			return st.Ready && st.Starts > starts[cp.Name()], nil
		})
		t.Logf("%s: API server restarted in %s", cp.Name(), cp.APIServer().LastStart.Round(time.Millisecond))
	}
	all := time.Since(began)
	t.Logf("control plane of %d restarted in %s", len(f.ControlPlanes()), all.Round(time.Millisecond))
	return all
}

// direct is a client of one control plane's API server with a bearer token.
func direct(t *testing.T, f *sim.Fleet, cp *sim.Machine, token string) kubernetes.Interface {
	t.Helper()
	cfg := &rest.Config{Host: "https://" + cp.APIServer().Address, BearerToken: token,
		TLSClientConfig: rest.TLSClientConfig{CAData: f.APIConfig().CAData}}
	kc, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return kc
}

// authenticates says whether cp's API server accepts the token.
func authenticates(t *testing.T, f *sim.Fleet, cp *sim.Machine, token string) bool {
	t.Helper()
	ctx, cancel := timeout()
	defer cancel()
	_, err := direct(t, f, cp, token).AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsUnauthorized(err) {
		t.Fatalf("self-subject review on %s: %v", cp.Name(), err)
	}
	return err == nil
}

func token(t *testing.T, kc kubernetes.Interface) string {
	t.Helper()
	ctx, cancel := timeout()
	defer cancel()
	tr, err := kc.CoreV1().ServiceAccounts("default").CreateToken(ctx, "robot", &authenticationv1.TokenRequest{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("token for robot: %v", err)
	}
	return tr.Status.Token
}

func mirrorSecretsVersion(t *testing.T, kc kubernetes.Interface, cp *sim.Machine) string {
	t.Helper()
	ctx, cancel := timeout()
	defer cancel()
	pod, err := kc.CoreV1().Pods(metav1.NamespaceSystem).Get(ctx, "kube-apiserver-"+cp.Name(), metav1.GetOptions{})
	if err != nil {
		return ""
	}
	return pod.Annotations["talos.dev/secrets-version"]
}

func TestHostedServiceAccountKey(t *testing.T) {
	f, kc := hostedFleet(t, 2)
	ctx, cancel := timeout()
	defer cancel()
	if _, err := kc.CoreV1().ServiceAccounts("default").Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "robot"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	old := token(t, kc)
	versions := map[string]string{}
	for _, cp := range f.ControlPlanes() {
		if !authenticates(t, f, cp, old) {
			t.Fatalf("%s refuses a token signed with its own key", cp.Name())
		}
		testenv.Eventually(t, time.Minute, "the mirror pod of "+cp.Name(), func(context.Context) (bool, error) {
			versions[cp.Name()] = mirrorSecretsVersion(t, kc, cp)
			return versions[cp.Name()] != "", nil
		})
	}

	key, err := x509.NewECDSAKey()
	if err != nil {
		t.Fatal(err)
	}
	applyAll(t, f, func(cfg *v1alpha1.Config) {
		cfg.ClusterConfig.ClusterServiceAccount = &x509.PEMEncodedKey{Key: key.GetPrivateKeyPEM()}
	})

	fresh := token(t, kc)
	for _, cp := range f.ControlPlanes() {
		if authenticates(t, f, cp, old) {
			t.Errorf("%s still accepts a token signed with the old service-account key", cp.Name())
		}
		if !authenticates(t, f, cp, fresh) {
			t.Errorf("%s refuses a token signed with the new service-account key", cp.Name())
		}
		testenv.Eventually(t, time.Minute, "the mirror pod of "+cp.Name()+" with a new secrets version", func(context.Context) (bool, error) {
			v := mirrorSecretsVersion(t, kc, cp)
			return v != "" && v != versions[cp.Name()], nil
		})
	}
}

// rawEtcd reads a key from the fleet's etcd itself, bypassing the API
// servers: what is stored, encrypted or not.
func rawEtcd(t *testing.T, f *sim.Fleet, key string) []byte {
	t.Helper()
	ctx, cancel := timeout()
	defer cancel()
	got, err := etcdClient(t, f).Get(ctx, key)
	if err != nil || len(got.Kvs) != 1 {
		t.Fatalf("etcd range %s: %v, %v", key, got, err)
	}
	return got.Kvs[0].Value
}

// etcdClient is a client of the fleet's etcd at urls (where it serves, when
// none), with a client certificate of the etcd CA, as etcd requires.
func etcdClient(t *testing.T, f *sim.Fleet, urls ...string) *clientv3.Client {
	t.Helper()
	if len(urls) == 0 {
		urls = []string{f.HostedEtcd().ClientURL}
	}
	tc, err := f.EtcdClientTLS()
	if err != nil {
		t.Fatal(err)
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: urls, TLS: tc, DialTimeout: 10 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cli.Close() })
	return cli
}

func encryptionKey(t *testing.T) string {
	b := make([]byte, 32)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return base64.StdEncoding.EncodeToString(b)
}

func TestHostedEncryptionAtRest(t *testing.T) {
	f, kc := hostedFleet(t, 1)
	secrets := kc.CoreV1().Secrets("default")
	create := func(name string) {
		t.Helper()
		ctx, cancel := timeout()
		defer cancel()
		s := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: name}, Data: map[string][]byte{"v": []byte("value of " + name)}}
		if _, err := secrets.Create(ctx, s, metav1.CreateOptions{}); err != nil {
			t.Fatalf("create secret %s: %v", name, err)
		}
	}
	wantPrefix := func(name, want string) {
		t.Helper()
		if raw := rawEtcd(t, f, "/registry/secrets/default/"+name); !bytes.HasPrefix(raw, []byte(want)) {
			t.Errorf("secret %s is stored as %q..., want the prefix %q", name, raw[:min(len(raw), 40)], want)
		}
	}
	readable := func(name string) error {
		ctx, cancel := timeout()
		defer cancel()
		s, err := secrets.Get(ctx, name, metav1.GetOptions{})
		if err == nil && string(s.Data["v"]) != "value of "+name {
			err = fmt.Errorf("secret %s reads %q", name, s.Data["v"])
		}
		return err
	}

	// Talos's generated configuration sets secretbox only.
	create("s0")
	wantPrefix("s0", "k8s:enc:secretbox:v1:key2:")
	// A Secret whose key is gone keeps kube-apiserver from getting ready
	// (its cache cannot list secrets): s0 goes before secretbox does.
	ctx, cancel := timeout()
	defer cancel()
	if err := secrets.Delete(ctx, "s0", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}

	applyAll(t, f, func(cfg *v1alpha1.Config) {
		cfg.ClusterConfig.ClusterSecretboxEncryptionSecret = ""
		cfg.ClusterConfig.ClusterAESCBCEncryptionSecret = encryptionKey(t)
	})
	create("s1")
	wantPrefix("s1", "k8s:enc:aescbc:v1:key1:")

	// Talos's graceful migration: a new secretbox key beside aescbc.
	applyAll(t, f, func(cfg *v1alpha1.Config) {
		cfg.ClusterConfig.ClusterSecretboxEncryptionSecret = encryptionKey(t)
	})
	create("s2")
	wantPrefix("s2", "k8s:enc:secretbox:v1:key2:")
	wantPrefix("s1", "k8s:enc:aescbc:v1:key1:")
	for _, name := range []string{"s1", "s2"} {
		if err := readable(name); err != nil {
			t.Errorf("read %s: %v", name, err)
		}
	}
}

// shutdownForce shuts cp down (no drain) and waits until it is off. The
// answer must arrive, though the machine goes down moments after making it.
func shutdownForce(t *testing.T, c *client.Client, cp *sim.Machine) {
	t.Helper()
	if _, err := c.ShutdownWithResponse(on(cp), client.WithShutdownForce(true)); err != nil {
		t.Fatalf("shutdown %s: %v", cp.Name(), err)
	}
	testenv.Eventually(t, 30*time.Second, cp.Name()+" off", func(context.Context) (bool, error) { return cp.Off(), nil })
}

// TestHostedEtcdMovesOffATakenPort: when another process has bound etcd's
// client port while etcd was stopped (tests in parallel on one machine),
// etcd starts on new ports once its quorum is back, and the API server that
// kept running with the old address is restarted onto the new one: both
// API servers answer again with every object intact.
func TestHostedEtcdMovesOffATakenPort(t *testing.T) {
	f, kc := hostedFleet(t, 3)
	testenv.CreateConfigMaps(t, kc, "cm0")
	c := talos(t, f)
	cps := f.ControlPlanes()
	shutdownForce(t, c, cps[0])
	shutdownForce(t, c, cps[1])
	testenv.Eventually(t, 30*time.Second, "etcd stopped", func(context.Context) (bool, error) { return !f.HostedEtcd().Serving, nil })
	old := f.HostedEtcd().ClientURL
	taken, err := net.Listen("tcp", strings.TrimPrefix(old, "https://"))
	if err != nil {
		t.Fatalf("take etcd's port: %v", err)
	}
	defer taken.Close()

	if err := cps[0].PowerOn(); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, time.Minute, "etcd serving again", func(context.Context) (bool, error) { return f.HostedEtcd().Serving, nil })
	if now := f.HostedEtcd().ClientURL; now == old {
		t.Fatalf("etcd serves on %s, the port taken", now)
	}
	for _, cp := range []*sim.Machine{cps[0], cps[2]} {
		cfg := f.APIConfig()
		cfg.Host = "https://" + cp.APIServer().Address
		one := kubernetes.NewForConfigOrDie(cfg)
		testenv.Eventually(t, 2*time.Minute, cp.Name()+"'s API server answering", func(context.Context) (bool, error) {
			got, err := testenv.ConfigMaps(one)
			return err == nil && got == "cm0", nil
		})
	}
}

// TestHostedAPIGoesWithTheControlPlanes: with one control plane of three
// off, the other two keep etcd's quorum and the API answers; with two off
// the last one's etcd has no quorum and the API does not answer; with all
// off etcd itself is stopped; once they are powered on etcd starts again
// on the same data and the API answers with every object intact.
func TestHostedAPIGoesWithTheControlPlanes(t *testing.T) {
	f, kc := hostedFleet(t, 3)
	testenv.CreateConfigMaps(t, kc, "cm0", "cm1", "cm2")
	const want = "cm0,cm1,cm2"

	c := talos(t, f)
	cps := f.ControlPlanes()
	shutdown := func(cp *sim.Machine) { t.Helper(); shutdownForce(t, c, cp) }
	shutdown(cps[0])
	if got, err := testenv.ConfigMaps(kc); err != nil || got != want {
		t.Fatalf("with %s down the endpoint answers %q, %v; want %q", cps[0].Name(), got, err, want)
	}
	shutdown(cps[1])
	if got, err := testenv.ConfigMaps(kc); err == nil {
		t.Fatalf("with two of three control planes off (no etcd quorum) the endpoint answers %q", got)
	}
	shutdown(cps[2])
	if got, err := testenv.ConfigMaps(kc); err == nil {
		t.Fatalf("with every control plane off the endpoint answers %q", got)
	}
	etcd := f.HostedEtcd()
	if etcd.Serving {
		t.Fatal("etcd serves with every control plane off")
	}
	if conn, err := net.DialTimeout("tcp", strings.TrimPrefix(etcd.ClientURL, "https://"), time.Second); err == nil {
		conn.Close()
		t.Fatalf("etcd still listens on %s with every control plane off", etcd.ClientURL)
	}

	began := time.Now()
	for _, cp := range cps {
		if err := cp.PowerOn(); err != nil {
			t.Fatal(err)
		}
	}
	testenv.Eventually(t, 3*time.Minute, "the API back", func(context.Context) (bool, error) {
		got, err := testenv.ConfigMaps(kc)
		return err == nil && got == want, nil
	})
	t.Logf("API back %s after power-on (etcd started in %s)", time.Since(began).Round(time.Millisecond), f.HostedEtcd().LastStart.Round(time.Millisecond))
	if starts := f.HostedEtcd().Starts; starts != etcd.Starts+1 {
		t.Fatalf("etcd started %d times after power-on, want once", starts-etcd.Starts)
	}
}

// authenticatesWith says whether cp's API server, verified with serverCA,
// accepts a client certificate issued from clientCA; a failed TLS
// verification of the server is an error.
func authenticatesWith(t *testing.T, cp *sim.Machine, serverCA []byte, clientCA *x509.PEMEncodedCertificateAndKey) (bool, error) {
	t.Helper()
	crt, err := sim.AdminCertificate(clientCA)
	if err != nil {
		t.Fatal(err)
	}
	kc, err := kubernetes.NewForConfig(&rest.Config{Host: "https://" + cp.APIServer().Address,
		TLSClientConfig: rest.TLSClientConfig{CAData: serverCA, CertData: crt.Crt, KeyData: crt.Key}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := timeout()
	defer cancel()
	_, err = kc.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
	if apierrors.IsUnauthorized(err) {
		return false, nil
	}
	return err == nil, err
}

// TestHostedKubernetesCA: the API server serves a certificate from
// cluster.ca and accepts clients of cluster.ca and cluster.acceptedCAs,
// through Talos's rotation (accept the new CA, swap, drop the old one):
// once the old CA is dropped, a client certificate it issued is refused.
// The machine's Kubeconfig follows each stage, and each restarts the
// kubelet.
func TestHostedKubernetesCA(t *testing.T) {
	f, _ := hostedFleet(t, 1)
	cp := f.ControlPlanes()[0]
	oldCA := cp.Config().Cluster().IssuingCA()
	ca, err := secrets.NewKubernetesCA(time.Now(), nil)
	if err != nil {
		t.Fatal(err)
	}
	newCA := &x509.PEMEncodedCertificateAndKey{Crt: ca.CrtPEM, Key: ca.KeyPEM}
	want := func(step string, serverCA []byte, client *x509.PEMEncodedCertificateAndKey, accepted bool) {
		t.Helper()
		ok, err := authenticatesWith(t, cp, serverCA, client)
		if err != nil || ok != accepted {
			t.Errorf("%s: accepted %v, %v; want accepted %v", step, ok, err, accepted)
		}
	}
	// The Kubeconfig call follows, as Talos's: a certificate from cluster.ca
	// now, trusting cluster.acceptedCAs and cluster.ca; and every stage
	// restarts the kubelet once.
	tc := talos(t, f)
	restarts := cp.KubeletRestarts()
	kubeconfigFrom := func(step string, issuer []byte, trusts ...[]byte) {
		t.Helper()
		if n := cp.KubeletRestarts(); n != restarts+1 {
			t.Errorf("%s: the kubelet restarted %d times, want once", step, n-restarts)
		}
		restarts = cp.KubeletRestarts()
		data, err := tc.Kubeconfig(on(cp))
		if err != nil {
			t.Fatal(err)
		}
		rc, err := clientcmd.RESTConfigFromKubeConfig(data)
		if err != nil {
			t.Fatal(err)
		}
		if string(rc.CAData) != string(bytes.Join(trusts, nil)) {
			t.Errorf("%s: the kubeconfig trusts\n%s\nwant\n%s", step, rc.CAData, bytes.Join(trusts, nil))
		}
		if err := kubepki.IssuedBy(rc.CertData, issuer); err != nil {
			t.Errorf("%s: the kubeconfig's certificate: %v", step, err)
		}
		kc, err := kubernetes.NewForConfig(rc)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := timeout()
		defer cancel()
		if _, err := kc.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{}); err != nil {
			t.Errorf("%s: the kubeconfig does not work: %v", step, err)
		}
	}

	applyAll(t, f, func(cfg *v1alpha1.Config) {
		cfg.ClusterConfig.ClusterAcceptedCAs = []*x509.PEMEncodedCertificate{{Crt: newCA.Crt}}
	})
	want("new CA accepted: old client", oldCA.Crt, oldCA, true)
	kubeconfigFrom("new CA accepted", oldCA.Crt, newCA.Crt, oldCA.Crt)
	want("new CA accepted: new client", oldCA.Crt, newCA, true)

	applyAll(t, f, func(cfg *v1alpha1.Config) {
		cfg.ClusterConfig.ClusterCA = newCA
		cfg.ClusterConfig.ClusterAcceptedCAs = []*x509.PEMEncodedCertificate{{Crt: oldCA.Crt}}
	})
	if _, err := authenticatesWith(t, cp, oldCA.Crt, oldCA); err == nil {
		t.Error("after the swap the serving certificate still verifies with the old CA")
	}
	want("swapped: old client", newCA.Crt, oldCA, true)
	want("swapped: new client", newCA.Crt, newCA, true)
	kubeconfigFrom("swapped", newCA.Crt, oldCA.Crt, newCA.Crt)

	applyAll(t, f, func(cfg *v1alpha1.Config) {
		cfg.ClusterConfig.ClusterAcceptedCAs = nil
	})
	want("old CA dropped: old client", newCA.Crt, oldCA, false)
	want("old CA dropped: new client", newCA.Crt, newCA, true)
	kubeconfigFrom("old CA dropped", newCA.Crt, newCA.Crt)
}
