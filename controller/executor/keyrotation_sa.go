package executor

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/siderolabs/crypto/x509"
	"github.com/siderolabs/talos/pkg/machinery/config"
	"github.com/siderolabs/talos/pkg/machinery/config/types/v1alpha1"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/machine"
)

// Stages of the key-rotation kind's service-account key rotation. Talos
// 1.13 renders one service-account key for kube-apiserver (signing and
// verifying) and kube-controller-manager, so the rotation is a cut-over:
// every token the old key signed is refused from the moment its control
// plane's API server takes the new one. The control planes therefore take
// it back to back, and what held the old key's tokens gets new ones:
// legacy token Secrets are reissued, then the pods are restarted.
const (
	// StageSAPrepare makes the new key and a probe token of the old one
	// and stores them, with the old key, before any machine changes.
	StageSAPrepare = "prepare-service-account-key"
	// StageSASwap puts the new key in cluster.serviceAccount.key, one
	// control plane at a time, each API server restarted and Ready before
	// the next.
	StageSASwap = "swap-service-account-key"
	// StageSAVerify checks on every API server that the probe of the old
	// key is refused and a token signed now is taken.
	StageSAVerify = "verify-service-account-key"
	// StageTokensReissue has the tokens controller sign a new token for
	// every legacy token Secret of the old key, and removes the rotation's
	// Secret.
	StageTokensReissue = "reissue-legacy-tokens"
	// StageWorkloadsRestart restarts, machine by machine, the pods whose
	// projected tokens the old key signed (spec.keyRotation.restartWorkloads).
	StageWorkloadsRestart = "restart-workloads"
)

// Steps of the service-account key rotation.
const (
	StepGenerateServiceAccountKey = "generate-service-account-key"
	StepSwapServiceAccountKey     = "swap-service-account-key"
	StepVerifyServiceAccountKey   = "verify-service-account-key"
	StepReissueTokens             = "reissue-legacy-tokens"
	StepRestartPods               = "restart-pods"
)

// ServiceAccountKeyRotationSecret is the Secret, in the controller's
// namespace, where a key rotation keeps the old and the new
// service-account key and a token the old key signed, from before the
// first control plane changes until the legacy tokens are reissued: a
// controller killed at any point resumes with the same key, and the probe
// proves the old key refused everywhere.
const ServiceAccountKeyRotationSecret = "ichor-service-account-key-rotation"

// Keys of ServiceAccountKeyRotationSecret.
const (
	saKeyOld   = "old.key"
	saKeyNew   = "new.key"
	saKeyProbe = "probe.token"
)

// probeLifetime is how long the probe token lives: it must outlive the
// rotation up to its check, or its refusal would prove nothing (its age
// would refuse it too). It is a token of the controller namespace's
// default ServiceAccount, which holds no role, and the swap voids it.
const probeLifetime = 7 * 24 * time.Hour

// saState is what ServiceAccountKeyRotationSecret holds.
type saState struct {
	oldKey, newKey []byte
	probe          string
}

// saStages are the service-account key rotation's stages. The legacy
// tokens are reissued before the pods restart, so that a restarted pod
// that reads one (an environment variable from a token Secret is read
// once, at the container's start) reads the new one.
func saStages(restart bool) []ichorv1.StageStatus {
	cp := []ichorv1.MachineRole{ichorv1.RoleControlPlane}
	out := []ichorv1.StageStatus{
		{Name: StageSAPrepare, Roles: cp, Order: ichorv1.StageOnce},
		{Name: StageSASwap, Roles: cp, Order: ichorv1.StageOneAtATime},
		{Name: StageSAVerify, Roles: cp, Order: ichorv1.StageOnce},
		{Name: StageTokensReissue, Roles: cp, Order: ichorv1.StageOnce},
	}
	if restart {
		out = append(out, ichorv1.StageStatus{Name: StageWorkloadsRestart, Order: ichorv1.StageOneAtATime})
	}
	return out
}

// saSteps are the steps of stage, or nil for a stage not of the
// service-account key rotation.
func saSteps(stage string) []Step {
	switch stage {
	case StageSAPrepare:
		return []Step{generateSAKeyStep()}
	case StageSASwap:
		return apiServerPatchSteps(StepSwapServiceAccountKey, swapSAKey)
	case StageSAVerify:
		return []Step{verifySAKeyStep()}
	case StageTokensReissue:
		return []Step{reissueTokensStep()}
	case StageWorkloadsRestart:
		return []Step{restartPodsStep()}
	}
	return nil
}

func readSAState(ctx context.Context, e *Env) (*saState, error) {
	d, err := readRotationSecret(ctx, e, ServiceAccountKeyRotationSecret)
	if d == nil || err != nil {
		return nil, err
	}
	return &saState{oldKey: d[saKeyOld], newKey: d[saKeyNew], probe: string(d[saKeyProbe])}, nil
}

func mustSAState(ctx context.Context, e *Env) (*saState, error) {
	s, err := readSAState(ctx, e)
	if err != nil {
		return nil, err
	}
	if s == nil {
		return nil, Fail("KeyStateMissing", "Secret %s/%s, which holds this rotation's new service-account key, is gone or another operation's: "+
			"the control planes may hold a key Ichor no longer knows; read cluster.serviceAccount.key of every control plane "+
			"with `talosctl get machineconfig -o yaml` before anything else", e.Controller.Namespace, ServiceAccountKeyRotationSecret)
	}
	return s, nil
}

// generateSAKeyStep makes the new key (RSA 4096, as Talos makes it) and a
// probe token the old key signs, and stores them with the old key, once:
// a run again finds them stored and keeps them. Every control plane must
// hold the same key, and the probe must be taken now (its refusal later
// is the proof that the old key is gone).
func generateSAKeyStep() Step {
	return Step{Name: StepGenerateServiceAccountKey, Timeout: 2 * time.Minute, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		if err := e.requireAddress(); err != nil {
			return Outcome{}, err
		}
		if _, err := writeAhead(ctx, e, readSAState, mustSAState, func() (*saState, error) { return newSAState(ctx, e) },
			func(s *saState) error {
				return storeRotationSecret(ctx, e, ServiceAccountKeyRotationSecret, map[string][]byte{
					saKeyOld: s.oldKey, saKeyNew: s.newKey, saKeyProbe: []byte(s.probe)})
			}); err != nil {
			return Outcome{}, err
		}
		return Outcome{Message: fmt.Sprintf("new service-account key stored in Secret %s/%s, with a token of the old key to prove it refused",
			e.Controller.Namespace, ServiceAccountKeyRotationSecret)}, nil
	}}
}

// newSAState reads the key every control plane holds, makes the new one,
// and takes a probe token signed with the old one.
func newSAState(ctx context.Context, e *Env) (*saState, error) {
	old, err := clusterSAKey(ctx, e)
	if err != nil {
		return nil, err
	}
	k, err := x509.NewRSAKey()
	if err != nil {
		return nil, fmt.Errorf("new service-account key: %w", err)
	}
	cs, err := adminClient(ctx, e)
	if err != nil {
		return nil, err
	}
	probe, err := requestToken(ctx, cs, e.Controller.Namespace, probeLifetime)
	if err != nil {
		return nil, err
	}
	if ok, err := authenticates(ctx, cs, probe); err != nil || !ok {
		return nil, fmt.Errorf("the probe token of the old key is not taken by the API server (%v): its refusal after the swap would prove nothing; retry", err)
	}
	return &saState{oldKey: old, newKey: k.KeyPEM, probe: probe}, nil
}

// clusterSAKey is the service-account key every control plane holds;
// control planes that disagree are refused (a rotation left half way by
// hand, or a machine configured apart): their API servers refuse each
// other's tokens already.
func clusterSAKey(ctx context.Context, e *Env) ([]byte, error) {
	var key []byte
	for i, cp := range e.ControlPlanes {
		mc := configMachine(e)
		mc.Node = cp
		var active config.Provider
		if err := untilAnswers(ctx, func() (err error) { active, err = mc.Active(ctx); return err }); err != nil {
			return nil, configFail(err)
		}
		sa := active.Cluster().ServiceAccount()
		if sa == nil || len(sa.Key) == 0 {
			return nil, Fail("NoServiceAccountKey", "the control plane at %s has no cluster.serviceAccount.key", cp)
		}
		if i == 0 {
			key = sa.Key
			continue
		}
		if !sameCert(sa.Key, key) {
			return nil, Fail("ServiceAccountKeysDiffer", "the control planes at %s and %s hold different service-account keys (cluster.serviceAccount.key): "+
				"their API servers refuse each other's tokens already; give every control plane the same key first", e.ControlPlanes[0], cp)
		}
	}
	return key, nil
}

// saChecks are the service-account rotation's refusals, asked once, of
// the first control plane before the rotation has started: the control
// planes hold the same key. Not while a control plane is down (its own
// refusal says to bring it back); one that does not answer is refused
// after a while, not waited for.
func saChecks(ctx context.Context, e *Env) []string {
	if len(e.ControlPlanes) == 0 || e.Address != e.ControlPlanes[0] {
		return nil
	}
	for _, n := range e.Nodes {
		if machine.Role(n) == ichorv1.RoleControlPlane && !machine.Ready(n) {
			return nil
		}
	}
	if s, err := readSAState(ctx, e); err != nil || s != nil {
		return nil // started: its key is stored, the machines may differ
	}
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	if _, err := clusterSAKey(ctx, e); err != nil {
		return []string{err.Error()}
	}
	return nil
}

// swapSAKey is the swap's change: cluster.serviceAccount.key becomes the
// stored new key.
func swapSAKey(ctx context.Context, e *Env) (clusterChange, error) {
	s, err := mustSAState(ctx, e)
	if err != nil {
		return nil, err
	}
	return func(c *v1alpha1.ClusterConfig) bool {
		if c.ClusterServiceAccount != nil && sameCert(c.ClusterServiceAccount.Key, s.newKey) {
			return false
		}
		c.ClusterServiceAccount = &x509.PEMEncodedKey{Key: s.newKey}
		return true
	}, nil
}

// verifySAKeyStep checks, on every API server at its own address, that the
// probe token of the old key is refused and a token it signs now is taken,
// until both hold or the step's deadline (the servers restart).
func verifySAKeyStep() Step {
	return Step{Name: StepVerifyServiceAccountKey, Timeout: 5 * time.Minute, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		s, err := mustSAState(ctx, e)
		if err != nil {
			return Outcome{}, err
		}
		if err := everyAPIServer(ctx, e, "take only the new key's tokens", takesOnlyNewTokens(e, s.probe)); err != nil {
			return Outcome{}, err
		}
		return Outcome{Message: "every API server refuses the old key's token and takes a token it signs now"}, nil
	}}
}

// takesOnlyNewTokens passes when the API server refuses the probe of the
// old key and takes a token it signed itself just now.
func takesOnlyNewTokens(e *Env, probe string) func(ctx context.Context, cs kubernetes.Interface) error {
	return func(ctx context.Context, cs kubernetes.Interface) error {
		old, err := authenticates(ctx, cs, probe)
		switch {
		case err != nil:
			return err
		case old:
			return errors.New("it still takes a token signed with the old key")
		}
		fresh, err := requestToken(ctx, cs, e.Controller.Namespace, 10*time.Minute)
		if err != nil {
			return err
		}
		taken, err := authenticates(ctx, cs, fresh)
		switch {
		case err != nil:
			return err
		case !taken:
			return errors.New("it refuses a token it signed just now")
		}
		return nil
	}
}

// requestToken is a token of the default ServiceAccount of ns, lasting
// for d, signed by the API server cs reaches.
func requestToken(ctx context.Context, cs kubernetes.Interface, ns string, d time.Duration) (string, error) {
	tr := &authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: ptr.To(int64(d.Seconds()))}}
	out, err := cs.CoreV1().ServiceAccounts(ns).CreateToken(ctx, "default", tr, metav1.CreateOptions{})
	if err != nil {
		return "", fmt.Errorf("a token of ServiceAccount %s/default: %w", ns, err)
	}
	return out.Status.Token, nil
}

// authenticates asks the API server cs reaches whether it takes token.
func authenticates(ctx context.Context, cs kubernetes.Interface, token string) (bool, error) {
	tr := &authenticationv1.TokenReview{Spec: authenticationv1.TokenReviewSpec{Token: token}}
	out, err := cs.AuthenticationV1().TokenReviews().Create(ctx, tr, metav1.CreateOptions{})
	if err != nil {
		return false, fmt.Errorf("TokenReview: %w", err)
	}
	return out.Status.Authenticated, nil
}

// adminClient is a clientset of adminConfig.
func adminClient(ctx context.Context, e *Env) (kubernetes.Interface, error) {
	rc, err := adminConfig(ctx, e)
	if err != nil {
		return nil, err
	}
	return kubernetes.NewForConfig(rc)
}

// removeSAState removes the rotation's Secret, its work done; one of
// another operation is left alone.
func removeSAState(ctx context.Context, e *Env) error {
	if s, err := readSAState(ctx, e); s == nil || err != nil {
		return err
	}
	sec := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: e.Controller.Namespace, Name: ServiceAccountKeyRotationSecret}}
	if err := e.Live.Delete(ctx, sec); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("remove Secret %s/%s: %w", e.Controller.Namespace, ServiceAccountKeyRotationSecret, err)
	}
	return nil
}
