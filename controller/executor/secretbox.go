package executor

import (
	"context"
	"fmt"
	"time"

	"github.com/siderolabs/talos/pkg/machinery/config"
	"github.com/siderolabs/talos/pkg/machinery/config/types/v1alpha1"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/encryption"
)

// Stages of the key-rotation kind's secretbox key rotation. Talos renders
// one secretbox key (key2) and one aescbc key (key1), secretbox first, and
// the API server writes with the first and reads with any: two secretbox
// keys never stand side by side, and a key changed in place makes every
// Secret under the old one unreadable. So every Secret crosses over on the
// aescbc key, which both sides read, and the one moment where the API
// servers cannot all read what the others write (some on the old
// secretbox key, some on the new, each writing with its own) is held
// without writes: Secret writes are refused while the control planes
// switch, and no Secret is ever unreadable.
const (
	// StageSecretboxPrepare makes the new secretbox key and picks the
	// bridge (the aescbc key the cluster has, or a new one) and stores
	// them, with the keys the cluster has, before any machine changes.
	StageSecretboxPrepare = "prepare-secretbox-key"
	// StageBridgeAdd puts the bridge in cluster.aescbcEncryptionSecret:
	// every API server reads it (and still writes with the old key).
	StageBridgeAdd = "add-aescbc-bridge"
	// StageBridgeRewrap re-encrypts every Secret under the bridge, in etcd.
	StageBridgeRewrap = "reencrypt-to-bridge"
	// StageFreeze refuses Secret writes on every API server, then
	// re-encrypts under the bridge what was written since.
	StageFreeze = "freeze-secret-writes"
	// StageSecretboxSwitch puts the new key in
	// cluster.secretboxEncryptionSecret, one control plane at a time.
	StageSecretboxSwitch = "switch-secretbox-key"
	// StageThaw lets Secret writes through again: every API server writes
	// with the new key.
	StageThaw = "thaw-secret-writes"
	// StageSecretboxRewrap re-encrypts every Secret under the new key.
	StageSecretboxRewrap = "reencrypt-to-new-key"
	// StageBridgeDrop removes cluster.aescbcEncryptionSecret.
	StageBridgeDrop = "drop-aescbc-bridge"
	// StageSecretboxVerify checks that every Secret is under the new key
	// and read by every API server, and removes the rotation's Secret.
	StageSecretboxVerify = "verify-secretbox-key"
)

// Steps of the secretbox key rotation.
const (
	StepGenerateSecretbox = "generate-secretbox-key"
	StepAddBridge         = "add-aescbc-bridge"
	StepRewrap            = "reencrypt-secrets"
	StepFreeze            = "freeze-secret-writes"
	StepSwitchSecretbox   = "switch-secretbox-key"
	StepThaw              = "thaw-secret-writes"
	StepDropBridge        = "drop-aescbc-bridge"
	StepVerifySecretbox   = "verify-secretbox-key"
)

// SecretboxRotationSecret is the Secret, in the controller's namespace,
// where a key rotation keeps the secretbox and aescbc keys the cluster had,
// the new secretbox key and the bridge, from before the first machine
// changes until every Secret is under the new key.
const SecretboxRotationSecret = "ichor-secretbox-key-rotation"

// Keys of SecretboxRotationSecret.
const (
	sbKeyOldSecretbox = "secretbox-old"
	sbKeyOldAESCBC    = "aescbc-old"
	sbKeyNewSecretbox = "secretbox-new"
	sbKeyBridge       = "aescbc-bridge"
)

// secretboxState is what SecretboxRotationSecret holds.
type secretboxState struct {
	// oldSecretbox and oldAESCBC are what the cluster had ("" for none).
	oldSecretbox, oldAESCBC string
	newSecretbox, bridge    encryption.Key
}

// ring is every key a Secret may be stored under during the rotation.
func (s *secretboxState) ring() encryption.Ring {
	r := encryption.Ring{s.newSecretbox, s.bridge}
	if s.oldSecretbox != "" {
		r = append(r, encryption.Key{Provider: encryption.Secretbox, Secret: s.oldSecretbox})
	}
	return r
}

// secretboxStages are the secretbox key rotation's stages.
func secretboxStages() []ichorv1.StageStatus {
	cp := []ichorv1.MachineRole{ichorv1.RoleControlPlane}
	once := func(name string) ichorv1.StageStatus {
		return ichorv1.StageStatus{Name: name, Roles: cp, Order: ichorv1.StageOnce}
	}
	each := func(name string) ichorv1.StageStatus {
		return ichorv1.StageStatus{Name: name, Roles: cp, Order: ichorv1.StageOneAtATime}
	}
	return []ichorv1.StageStatus{
		once(StageSecretboxPrepare), each(StageBridgeAdd), once(StageBridgeRewrap), once(StageFreeze),
		each(StageSecretboxSwitch), once(StageThaw), once(StageSecretboxRewrap), each(StageBridgeDrop), once(StageSecretboxVerify),
	}
}

// secretboxSteps are the steps of stage, or nil for a stage not of the
// secretbox key rotation.
func secretboxSteps(stage string) []Step {
	switch stage {
	case StageSecretboxPrepare:
		return []Step{generateSecretboxStep()}
	case StageBridgeAdd:
		return apiServerPatchSteps(StepAddBridge, secretboxChange(addBridge))
	case StageBridgeRewrap:
		return []Step{rewrapStep(func(s *secretboxState) encryption.Key { return s.bridge })}
	case StageFreeze:
		return whileFrozen([]Step{freezeStep()})
	case StageSecretboxSwitch:
		return whileFrozen(apiServerPatchSteps(StepSwitchSecretbox, secretboxChange(switchSecretbox)))
	case StageThaw:
		return whileFrozen([]Step{thawStep()})
	case StageSecretboxRewrap:
		return []Step{rewrapStep(func(s *secretboxState) encryption.Key { return s.newSecretbox })}
	case StageBridgeDrop:
		return apiServerPatchSteps(StepDropBridge, secretboxChange(dropBridge))
	case StageSecretboxVerify:
		return []Step{verifySecretboxStep()}
	}
	return nil
}

func readSecretboxState(ctx context.Context, e *Env) (*secretboxState, error) {
	d, err := readRotationSecret(ctx, e, SecretboxRotationSecret)
	if d == nil || err != nil {
		return nil, err
	}
	return &secretboxState{
		oldSecretbox: string(d[sbKeyOldSecretbox]), oldAESCBC: string(d[sbKeyOldAESCBC]),
		newSecretbox: encryption.Key{Provider: encryption.Secretbox, Secret: string(d[sbKeyNewSecretbox])},
		bridge:       encryption.Key{Provider: encryption.AESCBC, Secret: string(d[sbKeyBridge])},
	}, nil
}

func mustSecretboxState(ctx context.Context, e *Env) (*secretboxState, error) {
	s, err := readSecretboxState(ctx, e)
	if err != nil {
		return nil, err
	}
	if s == nil {
		return nil, Fail("KeyStateMissing", "Secret %s/%s, which holds this rotation's keys, is gone or another operation's: "+
			"Secrets may be encrypted with a key Ichor no longer knows; read cluster.secretboxEncryptionSecret and cluster.aescbcEncryptionSecret "+
			"of every control plane with `talosctl get machineconfig -o yaml` before anything else", e.Controller.Namespace, SecretboxRotationSecret)
	}
	return s, nil
}

// generateSecretboxStep makes the new secretbox key and the bridge and
// stores them with the keys the cluster has, once: a run again finds them
// stored and keeps them. Every control plane must hold the same keys.
func generateSecretboxStep() Step {
	return Step{Name: StepGenerateSecretbox, Timeout: 2 * time.Minute, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		if err := e.requireAddress(); err != nil {
			return Outcome{}, err
		}
		s, err := writeAhead(ctx, e, readSecretboxState, mustSecretboxState, func() (*secretboxState, error) { return newSecretboxState(ctx, e) },
			func(s *secretboxState) error {
				return storeRotationSecret(ctx, e, SecretboxRotationSecret, map[string][]byte{
					sbKeyOldSecretbox: []byte(s.oldSecretbox), sbKeyOldAESCBC: []byte(s.oldAESCBC),
					sbKeyNewSecretbox: []byte(s.newSecretbox.Secret), sbKeyBridge: []byte(s.bridge.Secret)})
			})
		if err != nil {
			return Outcome{}, err
		}
		return Outcome{Message: fmt.Sprintf("new secretbox key stored in Secret %s/%s; %s", e.Controller.Namespace, SecretboxRotationSecret, bridgeWords(s))}, nil
	}}
}

func bridgeWords(s *secretboxState) string {
	if s.oldAESCBC != "" {
		return "the cluster's aescbc key is the bridge"
	}
	return "a new aescbc key is the bridge"
}

// newSecretboxState reads the keys every control plane holds (they must
// agree) and makes the new ones: the bridge is the aescbc key the cluster
// has, or a new one.
func newSecretboxState(ctx context.Context, e *Env) (*secretboxState, error) {
	sb, aescbc, err := clusterEncryption(ctx, e)
	if err != nil {
		return nil, err
	}
	s := &secretboxState{oldSecretbox: sb, oldAESCBC: aescbc}
	if s.newSecretbox, err = encryption.NewKey(encryption.Secretbox); err != nil {
		return nil, err
	}
	s.bridge = encryption.Key{Provider: encryption.AESCBC, Secret: aescbc}
	if aescbc == "" {
		if s.bridge, err = encryption.NewKey(encryption.AESCBC); err != nil {
			return nil, err
		}
	}
	return s, nil
}

// clusterEncryption is the secretbox and aescbc keys every control plane
// holds; control planes that disagree are refused (a rotation left half
// way by hand, or a machine configured apart).
func clusterEncryption(ctx context.Context, e *Env) (secretbox, aescbc string, err error) {
	for i, cp := range e.ControlPlanes {
		var active config.Provider
		mc := configMachine(e)
		mc.Node = cp
		if err := untilAnswers(ctx, func() (err error) { active, err = mc.Active(ctx); return err }); err != nil {
			return "", "", configFail(err)
		}
		sb, aes := active.Cluster().SecretboxEncryptionSecret(), active.Cluster().AESCBCEncryptionSecret()
		if i == 0 {
			secretbox, aescbc = sb, aes
			continue
		}
		if sb != secretbox || aes != aescbc {
			return "", "", Fail("EncryptionKeysDiffer", "the control planes at %s and %s hold different encryption keys "+
				"(cluster.secretboxEncryptionSecret, cluster.aescbcEncryptionSecret): their API servers cannot all read each other's Secrets; "+
				"give every control plane the same keys first", e.ControlPlanes[0], cp)
		}
	}
	return secretbox, aescbc, nil
}

// secretboxChecks are the secretbox rotation's refusals, asked once, of
// the first control plane: the control planes hold the same keys, etcd
// answers with the etcd CA's credentials, the freeze's policy is installed
// and not on already.
func secretboxChecks(ctx context.Context, e *Env) []string {
	if len(e.ControlPlanes) == 0 || e.Address != e.ControlPlanes[0] {
		return nil
	}
	if s, err := readSecretboxState(ctx, e); err != nil || s != nil {
		return nil // started: its keys are stored, the machines may differ
	}
	var out []string
	if _, _, err := clusterEncryption(ctx, e); err != nil {
		out = append(out, err.Error())
	}
	if cli, err := etcdClient(ctx, e); err != nil {
		out = append(out, fmt.Sprintf("etcd cannot be reached to re-encrypt the Secrets: %v", err))
	} else {
		if _, err := encryption.Count(ctx, cli); err != nil {
			out = append(out, fmt.Sprintf("etcd cannot be read to re-encrypt the Secrets: %v", err))
		}
		_ = cli.Close()
	}
	binding := &admissionregistrationv1.ValidatingAdmissionPolicyBinding{}
	if err := e.Live.Get(ctx, objectKey("", SecretWriteFreeze), binding); err != nil {
		out = append(out, fmt.Sprintf("the ValidatingAdmissionPolicyBinding %s, which refuses Secret writes while the API servers switch keys, cannot be read (%v): "+
			"install Ichor's manifests (kubectl apply -k manifests)", SecretWriteFreeze, err))
	}
	cm := &corev1.ConfigMap{}
	if err := e.Live.Get(ctx, objectKey(e.Controller.Namespace, SecretWriteFreeze), cm); err == nil {
		out = append(out, fmt.Sprintf("Secret writes are refused already (ConfigMap %s/%s, by %s): finish or delete that rotation first",
			e.Controller.Namespace, SecretWriteFreeze, cm.Data["operation"]))
	}
	return out
}

// secretboxChange makes a stage's change to a cluster section from the
// stored state; check, when set, must pass first.
func secretboxChange(change func(ctx context.Context, e *Env, s *secretboxState) (clusterChange, error)) clusterChangeOf {
	return func(ctx context.Context, e *Env) (clusterChange, error) {
		s, err := mustSecretboxState(ctx, e)
		if err != nil {
			return nil, err
		}
		return change(ctx, e, s)
	}
}

// addBridge puts the bridge in the aescbc slot (a no-op when it is the
// cluster's own aescbc key).
func addBridge(_ context.Context, _ *Env, s *secretboxState) (clusterChange, error) {
	return func(c *v1alpha1.ClusterConfig) bool {
		if c.ClusterAESCBCEncryptionSecret == s.bridge.Secret {
			return false
		}
		c.ClusterAESCBCEncryptionSecret = s.bridge.Secret
		return true
	}, nil
}

// switchSecretbox puts the new secretbox key in place, the bridge kept.
// Only while Secret writes are refused, and with every Secret under the
// bridge: an API server on the new key cannot read the old one's Secrets,
// nor the old one the new one's. The Secrets are re-encrypted under the
// bridge again first: a write admitted just before the freeze may have
// reached etcd after the freeze's own pass (a pass finds nothing to do
// otherwise).
func switchSecretbox(ctx context.Context, e *Env, s *secretboxState) (clusterChange, error) {
	if err := frozen(ctx, e); err != nil {
		return nil, err
	}
	if _, err := rewrap(ctx, e, s, s.bridge); err != nil {
		return nil, err
	}
	return func(c *v1alpha1.ClusterConfig) bool {
		if c.ClusterSecretboxEncryptionSecret == s.newSecretbox.Secret {
			return false
		}
		c.ClusterSecretboxEncryptionSecret = s.newSecretbox.Secret
		c.ClusterAESCBCEncryptionSecret = s.bridge.Secret
		return true
	}, nil
}

// dropBridge empties the aescbc slot, once every Secret is under the new
// secretbox key.
func dropBridge(ctx context.Context, e *Env, s *secretboxState) (clusterChange, error) {
	if err := allUnder(ctx, e, s.newSecretbox); err != nil {
		return nil, err
	}
	return func(c *v1alpha1.ClusterConfig) bool {
		if c.ClusterAESCBCEncryptionSecret == "" {
			return false
		}
		c.ClusterAESCBCEncryptionSecret = ""
		return true
	}, nil
}

// allUnder fails unless every Secret in etcd is under k.
func allUnder(ctx context.Context, e *Env, k encryption.Key) error {
	cli, err := etcdClient(ctx, e)
	if err != nil {
		return err
	}
	defer cli.Close() //nolint:errcheck
	outside, total, err := encryption.Outside(ctx, cli, k, 5)
	if err != nil {
		return err
	}
	if len(outside) > 0 {
		return Fail("SecretsNotReencrypted", "not every Secret is under the %s yet (of %d, these are not: %v): "+
			"the step before did not finish its work; retry the operation", k, total, outside)
	}
	return nil
}

// rewrapStep re-encrypts every Secret under the key to picks, in etcd.
func rewrapStep(to func(s *secretboxState) encryption.Key) Step {
	return Step{Name: StepRewrap, Timeout: 15 * time.Minute, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		s, err := mustSecretboxState(ctx, e)
		if err != nil {
			return Outcome{}, err
		}
		res, err := rewrap(ctx, e, s, to(s))
		if err != nil {
			return Outcome{}, err
		}
		return Outcome{Message: fmt.Sprintf("every Secret is under the %s: %s", to(s), res)}, nil
	}}
}

func rewrap(ctx context.Context, e *Env, s *secretboxState, to encryption.Key) (encryption.Result, error) {
	cli, err := etcdClient(ctx, e)
	if err != nil {
		return encryption.Result{}, err
	}
	defer cli.Close() //nolint:errcheck
	w := encryption.Rewrap{KV: cli, Ring: s.ring(), To: to, Progress: func(done, total int) {
		if done%100 == 0 || done == total {
			e.report(fmt.Sprintf("re-encrypting Secrets under the %s: %d of %d", to, done, total))
		}
	}}
	res, err := w.Run(ctx)
	if err != nil {
		return res, Fail("ReencryptFailed", "re-encrypt the Secrets under the %s: %w", to, err)
	}
	return res, nil
}

// SecretWriteFreeze names the ConfigMap, in the controller's namespace,
// whose presence makes the ValidatingAdmissionPolicy of the same name
// (manifests/policies/secretfreeze.yaml, its param) refuse every write of
// a Secret, and the policy.
const SecretWriteFreeze = "ichor-secret-write-freeze"

// freezeStep refuses Secret writes (the freeze's ConfigMap), waits until
// every API server refuses them, then re-encrypts under the bridge the
// Secrets written since the stage before.
func freezeStep() Step {
	return Step{Name: StepFreeze, Timeout: 5 * time.Minute, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		s, err := mustSecretboxState(ctx, e)
		if err != nil {
			return Outcome{}, err
		}
		if err := setFreeze(ctx, e, true); err != nil {
			return Outcome{}, err
		}
		if err := everyAPIServer(ctx, e, "refuse Secret writes", refusesWrites(e)); err != nil {
			return Outcome{}, err
		}
		res, err := rewrap(ctx, e, s, s.bridge)
		if err != nil {
			return Outcome{}, err
		}
		return Outcome{Message: fmt.Sprintf("every API server refuses Secret writes; every Secret is under the %s: %s", s.bridge, res)}, nil
	}}
}

// thawStep lets Secret writes through again once every API server runs
// the new key, and waits until every API server takes them.
func thawStep() Step {
	return Step{Name: StepThaw, Timeout: 5 * time.Minute, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		if err := setFreeze(ctx, e, false); err != nil {
			return Outcome{}, err
		}
		if err := everyAPIServer(ctx, e, "take Secret writes", takesWrites(e)); err != nil {
			return Outcome{}, err
		}
		return Outcome{Message: "every API server takes Secret writes again, with the new secretbox key"}, nil
	}}
}

// setFreeze creates (on) or deletes the freeze's ConfigMap.
func setFreeze(ctx context.Context, e *Env, on bool) error {
	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: e.Controller.Namespace, Name: SecretWriteFreeze,
		Labels: map[string]string{"app.kubernetes.io/part-of": "ichor"}},
		Data: map[string]string{"operation": e.Op.Namespace + "/" + e.Op.Name}}
	var err error
	if on {
		if err = e.Live.Create(ctx, cm); apierrors.IsAlreadyExists(err) {
			err = nil
		}
	} else if err = e.Live.Delete(ctx, cm); apierrors.IsNotFound(err) {
		err = nil
	}
	if err != nil {
		return fmt.Errorf("ConfigMap %s/%s, which refuses Secret writes while it exists: %w", e.Controller.Namespace, SecretWriteFreeze, err)
	}
	return nil
}

// whileFrozen says, in the failure of a step taken while Secret writes are
// refused, that they stay refused and why: lifting the refusal while the
// control planes hold different secretbox keys would let a Secret be
// written that some API servers cannot read.
func whileFrozen(steps []Step) []Step {
	note := func(err error) error {
		if err == nil {
			return nil
		}
		return fmt.Errorf("%w; Secret writes stay refused until this rotation is retried and finishes "+
			"(the control planes may hold different secretbox keys: do not delete ConfigMap %s by hand)", err, SecretWriteFreeze)
	}
	for i := range steps {
		if run := steps[i].Run; run != nil {
			steps[i].Run = func(ctx context.Context, e *Env) (Outcome, error) {
				o, err := run(ctx, e)
				return o, note(err)
			}
		}
		if wait := steps[i].Wait; wait != nil {
			steps[i].Wait = func(ctx context.Context, e *Env) (bool, Outcome, error) {
				done, o, err := wait(ctx, e)
				return done, o, note(err)
			}
		}
	}
	return steps
}

// frozen fails unless the freeze's ConfigMap is there.
func frozen(ctx context.Context, e *Env) error {
	cm := &corev1.ConfigMap{}
	err := e.Live.Get(ctx, objectKey(e.Controller.Namespace, SecretWriteFreeze), cm)
	if apierrors.IsNotFound(err) {
		return Fail("SecretWritesNotFrozen", "ConfigMap %s/%s is gone, so Secret writes are not refused: switching the secretbox key now could leave Secrets "+
			"no API server reads; retry the operation from its freeze-secret-writes stage", e.Controller.Namespace, SecretWriteFreeze)
	}
	return err
}

// verifySecretboxStep checks that every Secret is under the new key and
// that every API server reads every Secret, then removes the rotation's
// Secret (a run again that finds it removed checks the reads only).
func verifySecretboxStep() Step {
	return Step{Name: StepVerifySecretbox, Timeout: 5 * time.Minute, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		s, err := readSecretboxState(ctx, e)
		if err != nil {
			return Outcome{}, err
		}
		if s != nil {
			if err := allUnder(ctx, e, s.newSecretbox); err != nil {
				return Outcome{}, err
			}
		}
		n := 0
		if err := everyAPIServer(ctx, e, "read every Secret", readsEverySecret(&n)); err != nil {
			return Outcome{}, err
		}
		if s != nil {
			sec := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: e.Controller.Namespace, Name: SecretboxRotationSecret}}
			if err := e.Live.Delete(ctx, sec); err != nil && !apierrors.IsNotFound(err) {
				return Outcome{}, fmt.Errorf("remove Secret %s/%s: %w", e.Controller.Namespace, SecretboxRotationSecret, err)
			}
		}
		return Outcome{Message: fmt.Sprintf("every Secret is under the new secretbox key, and every API server reads all %d", n)}, nil
	}}
}
