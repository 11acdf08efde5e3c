package executor

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/siderolabs/crypto/x509"
	talosclient "github.com/siderolabs/talos/pkg/machinery/client"
	"github.com/siderolabs/talos/pkg/machinery/config"
	"github.com/siderolabs/talos/pkg/machinery/config/generate/secrets"
	"github.com/siderolabs/talos/pkg/machinery/config/types/v1alpha1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/machine"
	"maesh.dev/ichor/controller/machineconfig"
	"maesh.dev/ichor/controller/talos"
	"maesh.dev/ichor/internal/kubepki"
)

// Stages of the ca-rotation kind's Kubernetes CA rotation, as `talosctl
// rotate-ca` runs it (pkg/rotate/pki/kubernetes) on cluster.ca and
// cluster.acceptedCAs: the new CA made and stored first, then three stages
// over every machine, each machine's kubelet restarted by its patch (as
// PatchNodeConfigWithKubeletRestart waits for), each stage followed by a
// check with what the next needs.
const (
	// StageK8sCAPrepare makes the new Kubernetes CA and stores it (the
	// write-ahead) before any machine changes, and checks the current
	// kubeconfigs.
	StageK8sCAPrepare = "prepare-kubernetes-ca"
	// StageK8sCAAccept adds the new CA to cluster.acceptedCAs.
	StageK8sCAAccept = "accept-new-kubernetes-ca"
	// StageK8sCAAccepted checks that the API servers accept a client
	// certificate of the new CA, and every Node is Ready.
	StageK8sCAAccepted = "verify-kubernetes-accepted"
	// StageK8sCASwap makes the new CA cluster.ca, the old one accepted.
	StageK8sCASwap = "swap-kubernetes-ca"
	// StageK8sCASwapped checks that every control plane issues kubeconfigs
	// from the new CA and the API servers serve from it.
	StageK8sCASwapped = "verify-kubernetes-swapped"
	// StageK8sCADrop removes the old CA from cluster.acceptedCAs.
	StageK8sCADrop = "drop-old-kubernetes-ca"
	// StageK8sCADropped checks the new kubeconfigs, that they trust the new
	// CA alone, and that a client certificate of the old CA is refused.
	StageK8sCADropped = "verify-kubernetes-dropped"
)

// Steps of the Kubernetes CA rotation.
const (
	StepGenerateK8sCA = "generate-kubernetes-ca"
	StepAcceptK8sCA   = "accept-kubernetes-ca"
	StepSwapK8sCA     = "swap-kubernetes-ca"
	StepDropK8sCA     = "drop-kubernetes-ca"
	StepVerifyK8sCA   = "verify-kubernetes-credentials"
)

// KubernetesCARotationSecret is the Secret, in the controller's namespace,
// where a ca-rotation keeps the old and the new Kubernetes CA (certificate
// and key) from before the first machine changes until the old CA is
// dropped: a controller killed at any point resumes with the same CA. The
// old CA's key lets the last check prove that a client certificate of the
// old CA is refused.
const KubernetesCARotationSecret = "ichor-kubernetes-ca-rotation"

// Keys of KubernetesCARotationSecret.
const (
	k8sKeyOldCA    = "old-ca.crt"
	k8sKeyOldCAKey = "old-ca.key"
	k8sKeyNewCA    = "ca.crt"
	k8sKeyNewCAKey = "ca.key"
)

// k8sCAState is what KubernetesCARotationSecret holds.
type k8sCAState struct {
	old, new *x509.PEMEncodedCertificateAndKey
}

// k8sCAStages are the Kubernetes CA rotation's stages.
func k8sCAStages() []ichorv1.StageStatus {
	cp := []ichorv1.MachineRole{ichorv1.RoleControlPlane}
	return []ichorv1.StageStatus{
		{Name: StageK8sCAPrepare, Roles: cp, Order: ichorv1.StageOnce},
		{Name: StageK8sCAAccept, Order: ichorv1.StageOneAtATime},
		{Name: StageK8sCAAccepted, Roles: cp, Order: ichorv1.StageOnce},
		{Name: StageK8sCASwap, Order: ichorv1.StageOneAtATime},
		{Name: StageK8sCASwapped, Roles: cp, Order: ichorv1.StageOnce},
		{Name: StageK8sCADrop, Order: ichorv1.StageOneAtATime},
		{Name: StageK8sCADropped, Roles: cp, Order: ichorv1.StageOnce},
	}
}

// k8sCASteps are the steps of stage, or nil for a stage not of the
// Kubernetes CA rotation.
func k8sCASteps(stage string) []Step {
	switch stage {
	case StageK8sCAPrepare:
		return []Step{generateK8sCAStep()}
	case StageK8sCAAccept:
		return []Step{k8sCAPatchStep(StepAcceptK8sCA, acceptNewK8sCA)}
	case StageK8sCAAccepted:
		return []Step{verifyK8sCAStep(k8sAccepted)}
	case StageK8sCASwap:
		return []Step{k8sCAPatchStep(StepSwapK8sCA, swapK8sCA)}
	case StageK8sCASwapped:
		return []Step{verifyK8sCAStep(k8sSwapped)}
	case StageK8sCADrop:
		return []Step{k8sCAPatchStep(StepDropK8sCA, dropOldK8sCA)}
	case StageK8sCADropped:
		return []Step{verifyK8sCAStep(k8sDropped)}
	}
	return nil
}

func readK8sCAState(ctx context.Context, e *Env) (*k8sCAState, error) {
	d, err := readRotationSecret(ctx, e, KubernetesCARotationSecret)
	if d == nil || err != nil {
		return nil, err
	}
	return &k8sCAState{
		old: &x509.PEMEncodedCertificateAndKey{Crt: d[k8sKeyOldCA], Key: d[k8sKeyOldCAKey]},
		new: &x509.PEMEncodedCertificateAndKey{Crt: d[k8sKeyNewCA], Key: d[k8sKeyNewCAKey]},
	}, nil
}

func mustK8sCAState(ctx context.Context, e *Env) (*k8sCAState, error) {
	s, err := readK8sCAState(ctx, e)
	if err != nil {
		return nil, err
	}
	if s == nil {
		return nil, errK8sCAStateMissing(e)
	}
	return s, nil
}

func errK8sCAStateMissing(e *Env) error {
	return Fail("CAStateMissing", "Secret %s/%s, which holds this rotation's new Kubernetes CA, is gone or another operation's: "+
		"the machines may accept a CA Ichor no longer knows; read cluster.ca and cluster.acceptedCAs with `talosctl get machineconfig -o yaml` before anything else",
		e.Controller.Namespace, KubernetesCARotationSecret)
}

// generateK8sCAStep makes the new Kubernetes CA and stores it, once: a run
// again finds it stored and keeps it. The current CA is cluster.ca of this
// control plane's active configuration (talosctl reads the KubernetesRoot
// resource, the same value); the current kubeconfigs are checked.
func generateK8sCAStep() Step {
	return Step{Name: StepGenerateK8sCA, Timeout: 3 * time.Minute, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		if err := e.requireAddress(); err != nil {
			return Outcome{}, err
		}
		s, err := writeAhead(ctx, e, readK8sCAState, mustK8sCAState, func() (*k8sCAState, error) { return newK8sCAState(ctx, e) },
			func(s *k8sCAState) error {
				return storeRotationSecret(ctx, e, KubernetesCARotationSecret, map[string][]byte{
					k8sKeyOldCA: s.old.Crt, k8sKeyOldCAKey: s.old.Key, k8sKeyNewCA: s.new.Crt, k8sKeyNewCAKey: s.new.Key})
			})
		if err != nil {
			return Outcome{}, err
		}
		if err := k8sBefore.verify(ctx, e, s); err != nil {
			return Outcome{}, err
		}
		return Outcome{Message: fmt.Sprintf("new Kubernetes CA stored in Secret %s/%s; %s", e.Controller.Namespace, KubernetesCARotationSecret, k8sBefore)}, nil
	}}
}

func newK8sCAState(ctx context.Context, e *Env) (*k8sCAState, error) {
	var active config.Provider
	if err := untilAnswers(ctx, func() (err error) { active, err = configMachine(e).Active(ctx); return err }); err != nil {
		return nil, configFail(err)
	}
	cur := active.Cluster().IssuingCA()
	if cur == nil || len(cur.Crt) == 0 || len(cur.Key) == 0 {
		return nil, Fail("NoKubernetesCA", "%s's configuration has no cluster.ca with its key", e.Machine.Name)
	}
	ca, err := secrets.NewKubernetesCA(time.Now(), nil)
	if err != nil {
		return nil, fmt.Errorf("new Kubernetes CA: %w", err)
	}
	return &k8sCAState{old: cur, new: &x509.PEMEncodedCertificateAndKey{Crt: ca.CrtPEM, Key: ca.KeyPEM}}, nil
}

// k8sCAPatch changes a machine's cluster section for one stage; it reports
// false when the machine already carries the change.
type k8sCAPatch func(s *k8sCAState, cp bool, c *v1alpha1.ClusterConfig) bool

func acceptNewK8sCA(s *k8sCAState, _ bool, c *v1alpha1.ClusterConfig) bool {
	if hasCA(c.ClusterAcceptedCAs, s.new.Crt) || (c.ClusterCA != nil && sameCert(c.ClusterCA.Crt, s.new.Crt)) {
		return false
	}
	c.ClusterAcceptedCAs = append(c.ClusterAcceptedCAs, &x509.PEMEncodedCertificate{Crt: s.new.Crt})
	return true
}

// swapK8sCA is talosctl's swapCAs: the old CA accepted, the new one
// issuing (a worker's cluster.ca is the certificate alone).
func swapK8sCA(s *k8sCAState, cp bool, c *v1alpha1.ClusterConfig) bool {
	if c.ClusterCA != nil && sameCert(c.ClusterCA.Crt, s.new.Crt) {
		return false
	}
	accepted := slices.DeleteFunc(slices.Clone(c.ClusterAcceptedCAs), func(a *x509.PEMEncodedCertificate) bool { return sameCert(a.Crt, s.new.Crt) })
	if !hasCA(accepted, s.old.Crt) {
		accepted = append(accepted, &x509.PEMEncodedCertificate{Crt: s.old.Crt})
	}
	c.ClusterAcceptedCAs = accepted
	c.ClusterCA = &x509.PEMEncodedCertificateAndKey{Crt: s.new.Crt}
	if cp {
		c.ClusterCA.Key = s.new.Key
	}
	return true
}

func dropOldK8sCA(s *k8sCAState, _ bool, c *v1alpha1.ClusterConfig) bool {
	if !hasCA(c.ClusterAcceptedCAs, s.old.Crt) {
		return false
	}
	c.ClusterAcceptedCAs = slices.DeleteFunc(slices.Clone(c.ClusterAcceptedCAs), func(a *x509.PEMEncodedCertificate) bool { return sameCert(a.Crt, s.old.Crt) })
	return true
}

// k8sCAPatchStep applies one stage's change to the machine live and waits
// for the kubelet's restart that it brings (Talos restarts the kubelet when
// its accepted CAs change), as PatchNodeConfigWithKubeletRestart: the
// kubelet healthy first, then the apply, then the kubelet gone and back
// healthy. A machine that already carries the change (a run again after a
// restart) is not applied again: its kubelet is waited for, healthy.
func k8sCAPatchStep(name string, patch k8sCAPatch) Step {
	return Step{Name: name, Timeout: 3 * time.Minute, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		if err := e.requireAddress(); err != nil {
			return Outcome{}, err
		}
		s, err := mustK8sCAState(ctx, e)
		if err != nil {
			return Outcome{}, err
		}
		mc := configMachine(e)
		var active config.Provider
		if err := untilAnswers(ctx, func() (err error) { active, err = mc.Active(ctx); return err }); err != nil {
			return Outcome{}, configFail(err)
		}
		changed := false
		ch, err := machineconfig.PlanOn(active, []machineconfig.Patch{machineconfig.Typed(name, func(cfg *v1alpha1.Config) error {
			if cfg.ClusterConfig == nil {
				return errors.New("the configuration has no cluster section")
			}
			changed = patch(s, e.Machine.Role == ichorv1.RoleControlPlane, cfg.ClusterConfig)
			return nil
		})})
		if err != nil {
			return Outcome{}, configFail(err)
		}
		if err := kubeletHealthy(ctx, e); err != nil {
			return Outcome{}, err
		}
		if !changed || ch.Applied() {
			return Outcome{Message: "already done; the kubelet is healthy"}, nil
		}
		if _, err := mc.ApplyRestarting(ctx, ch.Config, "kubelet"); err != nil {
			return Outcome{}, configFail(err)
		}
		if err := untilAnswers(ctx, func() error { return mc.Verify(ctx, ch.To) }); err != nil {
			return Outcome{}, configFail(err)
		}
		return Outcome{Message: "applied live; the kubelet restarted and is healthy"}, nil
	}}
}

// kubeletHealthy waits until the machine's kubelet runs and is healthy, or
// the step's deadline.
func kubeletHealthy(ctx context.Context, e *Env) error {
	for {
		ok, err := talos.ServiceHealthy(ctx, e.Talos, e.Address, "kubelet")
		if ok {
			return nil
		}
		if err != nil && !talos.Unreachable(err) {
			return err
		}
		select {
		case <-ctx.Done():
			return Fail("KubeletUnhealthy", "the kubelet of %s is not running and healthy (%v): a Kubernetes CA change restarts it, so it must be healthy first", e.Machine.Name, err)
		case <-time.After(time.Second):
		}
	}
}

// k8sCheck is what a stage's check proves.
type k8sCheck int

const (
	// k8sBefore: every control plane's kubeconfig works, every Node Ready.
	k8sBefore k8sCheck = iota
	// k8sAccepted: and a client certificate of the new CA is accepted.
	k8sAccepted
	// k8sSwapped: every control plane's kubeconfig is issued by the new
	// CA, and works trusting the new CA alone (the API servers serve from it).
	k8sSwapped
	// k8sDropped: and trusts the new CA alone; a client certificate of the
	// old CA is refused.
	k8sDropped
)

func (c k8sCheck) String() string {
	return [...]string{
		"every control plane's kubeconfig works and every Node is Ready",
		"every control plane's kubeconfig and a client certificate of the new Kubernetes CA work, and every Node is Ready",
		"every control plane's kubeconfig is issued by the new Kubernetes CA and works trusting it alone, and every Node is Ready",
		"every control plane's kubeconfig is of the new Kubernetes CA alone and works, every Node is Ready, and a client certificate of the old CA is refused",
	}[c]
}

// verifyK8sCAStep runs check; after the last one it removes the rotation's
// Secret, its work done (a run again that finds it removed checks the
// kubeconfigs the control planes issue now).
func verifyK8sCAStep(check k8sCheck) Step {
	return Step{Name: StepVerifyK8sCA, Timeout: 3 * time.Minute, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		s, err := readK8sCAState(ctx, e)
		if err != nil {
			return Outcome{}, err
		}
		if s == nil && check == k8sDropped {
			if err := k8sBefore.verify(ctx, e, nil); err != nil {
				return Outcome{}, err
			}
			return Outcome{Message: k8sBefore.String() + "; the rotation's Secret was removed"}, nil
		}
		if s == nil {
			return Outcome{}, errK8sCAStateMissing(e)
		}
		if err := check.verify(ctx, e, s); err != nil {
			return Outcome{}, err
		}
		if check == k8sDropped {
			sec := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: e.Controller.Namespace, Name: KubernetesCARotationSecret}}
			if err := e.Live.Delete(ctx, sec); err != nil && !apierrors.IsNotFound(err) {
				return Outcome{}, fmt.Errorf("remove Secret %s/%s: %w", e.Controller.Namespace, KubernetesCARotationSecret, err)
			}
		}
		return Outcome{Message: check.String()}, nil
	}}
}

// verify proves c, waiting (as talosctl retries for 3 minutes) until it
// holds or the step's deadline: the API servers restart through a stage.
func (c k8sCheck) verify(ctx context.Context, e *Env, s *k8sCAState) error {
	var last error
	for {
		if last = c.once(ctx, e, s); last == nil {
			return nil
		}
		var se *StepError
		if errors.As(last, &se) {
			return last
		}
		select {
		case <-ctx.Done():
			return Fail("KubernetesCredentialsRefused", "not yet true after the step's time: %s: %v", c, last)
		case <-time.After(2 * time.Second):
		}
	}
}

func (c k8sCheck) once(ctx context.Context, e *Env, s *k8sCAState) error {
	var first *rest.Config // the first control plane's, as it issued it
	for _, cp := range e.ControlPlanes {
		rc, err := talosKubeconfig(ctx, e.Talos, cp)
		if err != nil {
			return err
		}
		if first == nil {
			first = rest.CopyConfig(rc)
		}
		if c >= k8sSwapped {
			if err := kubepki.IssuedBy(rc.CertData, s.new.Crt); err != nil {
				return fmt.Errorf("the kubeconfig of %s is not issued by the new Kubernetes CA: %w", cp, err)
			}
			if c == k8sDropped && !sameCert(rc.CAData, s.new.Crt) {
				return fmt.Errorf("the kubeconfig of %s trusts more than the new Kubernetes CA", cp)
			}
			rc.CAData = s.new.Crt
		}
		if err := nodesReady(ctx, rc); err != nil {
			return fmt.Errorf("with the kubeconfig of %s: %w", cp, err)
		}
	}
	switch c {
	case k8sAccepted:
		rc := first
		if err := withClientOf(rc, s.new); err != nil {
			return err
		}
		if err := nodesReady(ctx, rc); err != nil {
			return fmt.Errorf("with a client certificate of the new Kubernetes CA: %w", err)
		}
	case k8sDropped:
		return oldK8sRefused(ctx, e, s, first)
	}
	return nil
}

// oldK8sRefused checks that client certificates of the old CA are refused
// (401) through the endpoint of kubeconfig, each on a new connection (a
// new certificate each: client-go shares a transport only between equal
// TLS configurations), one more than there are control planes, so that
// the endpoint's balancing meets more than one API server.
func oldK8sRefused(ctx context.Context, e *Env, s *k8sCAState, kubeconfig *rest.Config) error {
	for range len(e.ControlPlanes) + 1 {
		rc := rest.CopyConfig(kubeconfig)
		rc.CAData = s.new.Crt
		if err := withClientOf(rc, s.old); err != nil {
			return err
		}
		kc, err := kubernetes.NewForConfig(rc)
		if err != nil {
			return err
		}
		_, err = kc.CoreV1().Nodes().List(ctx, metav1.ListOptions{Limit: 1})
		switch {
		case err == nil:
			return Fail("OldCredentialsAccepted", "the API server still accepts a client certificate of the old Kubernetes CA: it is still trusted there")
		case !apierrors.IsUnauthorized(err):
			return fmt.Errorf("a client certificate of the old Kubernetes CA: %w", err)
		}
	}
	return nil
}

// withClientOf puts an admin client certificate of ca in rc.
func withClientOf(rc *rest.Config, ca *x509.PEMEncodedCertificateAndKey) error {
	crt, err := kubepki.Admin(ca)
	if err != nil {
		return err
	}
	rc.CertData, rc.KeyData = crt.Crt, crt.Key
	return nil
}

// talosKubeconfig is the admin kubeconfig the control plane at node issues
// (the Talos API's Kubeconfig), as a REST config.
func talosKubeconfig(ctx context.Context, c *talosclient.Client, node string) (*rest.Config, error) {
	var data []byte
	err := untilAnswers(ctx, func() (err error) { data, err = c.Kubeconfig(talosclient.WithNode(ctx, node)); return err })
	if err != nil {
		return nil, fmt.Errorf("kubeconfig of %s: %w", node, err)
	}
	rc, err := clientcmd.RESTConfigFromKubeConfig(data)
	if err != nil {
		return nil, fmt.Errorf("kubeconfig of %s: %w", node, err)
	}
	return rc, nil
}

// nodesReady lists the Nodes with rc, as talosctl's verifyConnectivity:
// every one must be Ready.
func nodesReady(ctx context.Context, rc *rest.Config) error {
	kc, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return err
	}
	nodes, err := kc.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return err
	}
	var notReady []string
	for i := range nodes.Items {
		if !machine.Ready(&nodes.Items[i]) {
			notReady = append(notReady, nodes.Items[i].Name)
		}
	}
	if len(notReady) > 0 {
		return fmt.Errorf("Nodes not Ready: %v", notReady)
	}
	return nil
}
