package executor

import (
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/siderolabs/crypto/x509"
	talosclient "github.com/siderolabs/talos/pkg/machinery/client"
	clientconfig "github.com/siderolabs/talos/pkg/machinery/client/config"
	"github.com/siderolabs/talos/pkg/machinery/config"
	"github.com/siderolabs/talos/pkg/machinery/config/generate/secrets"
	"github.com/siderolabs/talos/pkg/machinery/config/types/v1alpha1"
	"github.com/siderolabs/talos/pkg/machinery/role"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/machine"
	"maesh.dev/ichor/controller/machineconfig"
	"maesh.dev/ichor/controller/talos"
)

// Stages of the ca-rotation kind's Talos API CA rotation, as `talosctl
// rotate-ca` runs it (pkg/rotate/pki/talos): the new CA and client
// certificate made and stored first, then three stages over every machine,
// each followed by a check of every machine with the credentials the next
// needs.
const (
	// StageCAPrepare makes the new CA and the controller's new client
	// certificate and stores them (the write-ahead) before any machine
	// changes, and checks the current credentials on every machine.
	StageCAPrepare = "prepare-ca"
	// StageCAAccept adds the new CA to machine.acceptedCAs.
	StageCAAccept = "accept-new-ca"
	// StageCAAccepted checks the new client certificate on every machine,
	// then puts it in Secret ichor-talosconfig (trusting both CAs' servers).
	StageCAAccepted = "verify-accepted"
	// StageCASwap makes the new CA machine.ca, the old one accepted.
	StageCASwap = "swap-ca"
	// StageCASwapped checks the new talosconfig (the new CA its only root)
	// on every machine, then puts it in Secret ichor-talosconfig.
	StageCASwapped = "verify-swapped"
	// StageCADrop removes the old CA from machine.acceptedCAs.
	StageCADrop = "drop-old-ca"
	// StageCADropped checks the new talosconfig on every machine, and that
	// the old one is refused by every endpoint.
	StageCADropped = "verify-dropped"
)

// Steps of the ca-rotation kind.
const (
	StepGenerateCA = "generate-ca"
	StepAcceptCA   = "accept-ca"
	StepSwapCA     = "swap-ca"
	StepDropCA     = "drop-ca"
	StepVerifyCA   = "verify-credentials"
)

// CARotationSecret is the Secret, in the controller's namespace beside
// ichor-talosconfig, where a ca-rotation keeps the new CA, the new client
// certificate and the talosconfig it started with, from before the first
// machine changes until the old CA is dropped. It sits there, not in the
// operation's namespace, because it holds the key every Talos client
// certificate of the cluster will be issued by: only the controller reads
// it.
const CARotationSecret = "ichor-talos-ca-rotation"

// Keys of CARotationSecret.
const (
	caKeyOldCA       = "old-ca.crt"
	caKeyNewCA       = "ca.crt"
	caKeyNewCAKey    = "ca.key"
	caKeyClientCrt   = "client.crt"
	caKeyClientKey   = "client.key"
	caKeyTalosconfig = "talosconfig-before"
	caAnnotationUID  = "ichor.maesh.dev/operation-uid"
)

// CARotation rotates the cluster's Talos API CA without the controller
// ever holding credentials no machine accepts: accept the new CA on every
// machine, swap (the new CA issues, the old is accepted), drop the old.
// Each machine's patch is applied live (NO_REBOOT: apid reloads its
// certificates) with the credentials its stage needs, made from what
// CARotationSecret holds; Secret ichor-talosconfig is replaced once the
// new client certificate has answered on every machine. The Kubernetes CA
// follows, in the same three stages on cluster.ca and cluster.acceptedCAs
// (kubernetesca.go).
type CARotation struct{}

// Target implements Executor.
func (CARotation) Target(op *ichorv1.TalosOperation) (string, string) {
	switch talosCA, kubernetesCA := op.Spec.CARotation.Rotates(); {
	case talosCA && kubernetesCA:
		return "talos api and kubernetes ca rotation", ""
	case kubernetesCA:
		return "kubernetes ca rotation", ""
	}
	return "talos api ca rotation", ""
}

// Scope implements Executor: every machine, or one left out would be locked
// out at the drop.
func (CARotation) Scope(op *ichorv1.TalosOperation, nodes []*corev1.Node) ([]*corev1.Node, error) {
	if op.Spec.Machines != nil {
		return nil, errors.New("spec.machines: a CA rotation changes every machine (one left out would refuse the new certificates); remove spec.machines")
	}
	return nodes, nil
}

// HonourHold implements Executor: a held machine would be locked out too.
func (CARotation) HonourHold() bool { return false }

// Check implements Executor.
func (CARotation) Check(_ context.Context, e *Env) []string {
	var out []string
	if e.Node != nil && !machine.Ready(e.Node) {
		out = append(out, fmt.Sprintf("%s is not Ready: every machine takes each stage of a CA rotation, so bring it back first", e.Machine.Name))
	}
	return out
}

// Stages implements Stager: the Talos API CA's stages, then the
// Kubernetes CA's (its patches go through the Talos API, with the
// credentials the first rotation left in Secret ichor-talosconfig).
func (CARotation) Stages(op *ichorv1.TalosOperation) []ichorv1.StageStatus {
	cp := []ichorv1.MachineRole{ichorv1.RoleControlPlane}
	var out []ichorv1.StageStatus
	talosCA, kubernetesCA := op.Spec.CARotation.Rotates()
	if talosCA {
		out = append(out,
			ichorv1.StageStatus{Name: StageCAPrepare, Roles: cp, Order: ichorv1.StageOnce},
			ichorv1.StageStatus{Name: StageCAAccept, Order: ichorv1.StageOneAtATime},
			ichorv1.StageStatus{Name: StageCAAccepted, Roles: cp, Order: ichorv1.StageOnce},
			ichorv1.StageStatus{Name: StageCASwap, Order: ichorv1.StageOneAtATime},
			ichorv1.StageStatus{Name: StageCASwapped, Roles: cp, Order: ichorv1.StageOnce},
			ichorv1.StageStatus{Name: StageCADrop, Order: ichorv1.StageOneAtATime},
			ichorv1.StageStatus{Name: StageCADropped, Roles: cp, Order: ichorv1.StageOnce},
		)
	}
	if kubernetesCA {
		out = append(out, k8sCAStages()...)
	}
	return out
}

// Steps implements Executor.
func (CARotation) Steps(op *ichorv1.TalosOperation, _ *ichorv1.MachineStatus) []Step {
	switch op.Status.Stage {
	case StageCAPrepare:
		return []Step{generateCAStep()}
	case StageCAAccept:
		return []Step{caPatchStep(StepAcceptCA, credsBefore, acceptNewCA)}
	case StageCAAccepted:
		return []Step{verifyCAStep(credsBridge, true, false)}
	case StageCASwap:
		return []Step{caPatchStep(StepSwapCA, credsBridge, swapCA)}
	case StageCASwapped:
		return []Step{verifyCAStep(credsNew, true, false)}
	case StageCADrop:
		return []Step{caPatchStep(StepDropCA, credsNew, dropOldCA)}
	case StageCADropped:
		return []Step{verifyCAStep(credsNew, false, true)}
	}
	return k8sCASteps(op.Status.Stage)
}

// caState is what CARotationSecret holds.
type caState struct {
	oldCA  []byte
	newCA  *x509.PEMEncodedCertificateAndKey
	client *x509.PEMEncodedCertificateAndKey
	before *clientconfig.Config
}

// creds are the credentials of one stage, made from the state.
type creds int

const (
	// credsBefore: the talosconfig the rotation started with.
	credsBefore creds = iota
	// credsBridge: the new client certificate, trusting servers of both CAs
	// (during the swap a machine serves from one or the other).
	credsBridge
	// credsNew: the new client certificate, the new CA its only root.
	credsNew
)

func (c creds) String() string {
	return [...]string{"the talosconfig the rotation started with", "the new client certificate (trusting both CAs)", "the new talosconfig"}[c]
}

// config is the talosconfig of c: the starting one's context, endpoints
// and nodes with c's CA and certificate.
func (s *caState) config(c creds) (*clientconfig.Config, error) {
	if c == credsBefore {
		return s.before, nil
	}
	ctx := s.before.Contexts[s.before.Context]
	if ctx == nil {
		return nil, fmt.Errorf("the talosconfig the rotation started with has no context %q", s.before.Context)
	}
	roots := s.newCA.Crt
	if c == credsBridge {
		roots = append(append(bytes.Clone(s.oldCA), '\n'), s.newCA.Crt...)
	}
	cfg := clientconfig.NewConfig(s.before.Context, ctx.Endpoints, roots, s.client)
	cfg.Contexts[s.before.Context].Nodes = ctx.Nodes
	return cfg, nil
}

// oldCertConfig is the talosconfig the rotation started with, trusting
// both CAs' servers.
func (s *caState) oldCertConfig() (*clientconfig.Config, error) {
	ctx := s.before.Contexts[s.before.Context]
	if ctx == nil {
		return nil, fmt.Errorf("the talosconfig the rotation started with has no context %q", s.before.Context)
	}
	crt, err := base64.StdEncoding.DecodeString(ctx.Crt)
	if err != nil {
		return nil, fmt.Errorf("the talosconfig the rotation started with: crt: %w", err)
	}
	key, err := base64.StdEncoding.DecodeString(ctx.Key)
	if err != nil {
		return nil, fmt.Errorf("the talosconfig the rotation started with: key: %w", err)
	}
	roots := append(append(bytes.Clone(s.oldCA), '\n'), s.newCA.Crt...)
	return clientconfig.NewConfig(s.before.Context, ctx.Endpoints, roots, &x509.PEMEncodedCertificateAndKey{Crt: crt, Key: key}), nil
}

// readCAState reads the operation's state, or nil when there is none (or it
// is another operation's).
func readCAState(ctx context.Context, e *Env) (*caState, error) {
	d, err := readRotationSecret(ctx, e, CARotationSecret)
	if d == nil || err != nil {
		return nil, err
	}
	before, err := clientconfig.FromBytes(d[caKeyTalosconfig])
	if err != nil {
		return nil, fmt.Errorf("Secret %s/%s key %s: %w", e.Controller.Namespace, CARotationSecret, caKeyTalosconfig, err)
	}
	return &caState{
		oldCA:  d[caKeyOldCA],
		newCA:  &x509.PEMEncodedCertificateAndKey{Crt: d[caKeyNewCA], Key: d[caKeyNewCAKey]},
		client: &x509.PEMEncodedCertificateAndKey{Crt: d[caKeyClientCrt], Key: d[caKeyClientKey]},
		before: before,
	}, nil
}

// readRotationSecret reads the data of the rotation Secret name in the
// controller's namespace, or nil when there is none (or it is another
// operation's).
func readRotationSecret(ctx context.Context, e *Env, name string) (map[string][]byte, error) {
	sec := &corev1.Secret{}
	err := e.Live.Get(ctx, client.ObjectKey{Namespace: e.Controller.Namespace, Name: name}, sec)
	if apierrors.IsNotFound(err) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read Secret %s/%s: %w", e.Controller.Namespace, name, err)
	}
	if sec.Annotations[caAnnotationUID] != string(e.Op.UID) {
		return nil, nil
	}
	return sec.Data, nil
}

// mustCAState is readCAState for the stages after the preparation.
func mustCAState(ctx context.Context, e *Env) (*caState, error) {
	s, err := readCAState(ctx, e)
	if err != nil {
		return nil, err
	}
	if s == nil {
		return nil, errCAStateMissing(e)
	}
	return s, nil
}

func errCAStateMissing(e *Env) error {
	return Fail("CAStateMissing", "Secret %s/%s, which holds this rotation's new CA, is gone or another operation's: "+
		"the machines may accept a CA Ichor no longer knows; read machine.ca and machine.acceptedCAs with `talosctl get machineconfig -o yaml` before anything else",
		e.Controller.Namespace, CARotationSecret)
}

// generateCAStep makes the new CA and client certificate and stores them,
// once: a run again (after a restart) finds them stored and keeps them.
// The current CA is machine.ca of this control plane's active
// configuration (talosctl reads it from the OSRoot resource, the same
// value), and the current talosconfig is checked on every machine.
func generateCAStep() Step {
	return Step{Name: StepGenerateCA, Timeout: 2 * time.Minute, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		if err := e.requireAddress(); err != nil {
			return Outcome{}, err
		}
		s, err := writeAhead(ctx, e, readCAState, mustCAState, func() (*caState, error) { return newCAState(ctx, e) },
			func(s *caState) error { return storeCAState(ctx, e, s) })
		if err != nil {
			return Outcome{}, err
		}
		before, _ := s.config(credsBefore)
		if err := verifyEverywhere(ctx, e, before, credsBefore.String()); err != nil {
			return Outcome{}, err
		}
		return Outcome{Message: fmt.Sprintf("new Talos API CA stored in Secret %s/%s; the current talosconfig works on every machine", e.Controller.Namespace, CARotationSecret)}, nil
	}}
}

func newCAState(ctx context.Context, e *Env) (*caState, error) {
	active, err := configMachine(e).Active(ctx)
	if err != nil {
		return nil, configFail(err)
	}
	cur := active.Machine().Security().IssuingCA()
	if cur == nil || len(cur.Crt) == 0 {
		return nil, Fail("NoTalosCA", "%s's configuration has no machine.ca", e.Machine.Name)
	}
	before, err := heldConfig(ctx, e)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	ca, err := secrets.NewTalosCA(now)
	if err != nil {
		return nil, fmt.Errorf("new Talos CA: %w", err)
	}
	newCA := &x509.PEMEncodedCertificateAndKey{Crt: ca.CrtPEM, Key: ca.KeyPEM}
	b := &secrets.Bundle{Clock: secrets.NewFixedClock(now), Certs: &secrets.Certs{OS: newCA}}
	crt, err := b.GenerateTalosAPIClientCertificate(role.MakeSet(role.Admin))
	if err != nil {
		return nil, fmt.Errorf("new client certificate: %w", err)
	}
	return &caState{oldCA: cur.Crt, newCA: newCA, client: crt, before: before}, nil
}

// storeCAState writes the state (see storeRotationSecret).
func storeCAState(ctx context.Context, e *Env, s *caState) error {
	before, err := s.before.Bytes()
	if err != nil {
		return err
	}
	return storeRotationSecret(ctx, e, CARotationSecret, map[string][]byte{caKeyOldCA: s.oldCA, caKeyNewCA: s.newCA.Crt, caKeyNewCAKey: s.newCA.Key,
		caKeyClientCrt: s.client.Crt, caKeyClientKey: s.client.Key, caKeyTalosconfig: before})
}

// writeAhead is a rotation's state as its Secret holds it: read, or else
// made, stored and read back through must (a racing run of the step may
// have stored its own first, and only one may ever be used), once, before
// any machine changes: a run again finds it stored and keeps it.
func writeAhead[S any](ctx context.Context, e *Env, read, must func(context.Context, *Env) (*S, error), make func() (*S, error), store func(*S) error) (*S, error) {
	s, err := read(ctx, e)
	if err != nil || s != nil {
		return s, err
	}
	if s, err = make(); err != nil {
		return nil, err
	}
	if err := store(s); err != nil {
		return nil, err
	}
	return must(ctx, e)
}

// storeRotationSecret writes a rotation's write-ahead state to the Secret
// name in the controller's namespace, replacing another operation's (the
// lock lets one rotation run at a time: one found is left by an operation
// that is gone), and keeping this operation's own: the caller reads it
// back, since a racing run of the step may have stored its own first. The
// operation owns it when it lives in the controller's namespace (an owner
// in another namespace is not one Kubernetes honours).
func storeRotationSecret(ctx context.Context, e *Env, name string, data map[string][]byte) error {
	sec := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: e.Controller.Namespace, Name: name}}
	build := func() {
		sec.Annotations = map[string]string{caAnnotationUID: string(e.Op.UID)}
		sec.Labels = map[string]string{"app.kubernetes.io/part-of": "ichor"}
		sec.OwnerReferences = nil
		if e.Op.Namespace == e.Controller.Namespace {
			sec.OwnerReferences = []metav1.OwnerReference{{APIVersion: ichorv1.GroupVersion.String(), Kind: "TalosOperation",
				Name: e.Op.Name, UID: e.Op.UID, BlockOwnerDeletion: ptr.To(false)}}
		}
		sec.Type = corev1.SecretTypeOpaque
		sec.Data = data
	}
	err := e.Live.Get(ctx, client.ObjectKeyFromObject(sec), sec)
	switch {
	case apierrors.IsNotFound(err):
		build()
		err = e.Live.Create(ctx, sec)
		if apierrors.IsAlreadyExists(err) {
			return nil // a racing run stored first: the caller reads it back
		}
	case err == nil:
		if sec.Annotations[caAnnotationUID] == string(e.Op.UID) {
			return nil
		}
		build()
		err = e.Live.Update(ctx, sec)
	}
	if err != nil {
		return fmt.Errorf("store the new CA in Secret %s/%s: %w", e.Controller.Namespace, name, err)
	}
	return nil
}

// caPatch changes a machine's configuration for one stage; it reports
// false when the machine already carries the change.
type caPatch func(s *caState, cp bool, cfg *v1alpha1.Config) bool

func acceptNewCA(s *caState, _ bool, cfg *v1alpha1.Config) bool {
	if hasCA(cfg.MachineConfig.MachineAcceptedCAs, s.newCA.Crt) || sameCert(machineCA(cfg), s.newCA.Crt) {
		return false
	}
	cfg.MachineConfig.MachineAcceptedCAs = append(cfg.MachineConfig.MachineAcceptedCAs, &x509.PEMEncodedCertificate{Crt: s.newCA.Crt})
	return true
}

// swapCA is talosctl's swapCAs: the old CA accepted, the new one issuing
// (a worker's machine.ca is the certificate alone).
func swapCA(s *caState, cp bool, cfg *v1alpha1.Config) bool {
	if sameCert(machineCA(cfg), s.newCA.Crt) {
		return false
	}
	accepted := slices.DeleteFunc(slices.Clone(cfg.MachineConfig.MachineAcceptedCAs), func(c *x509.PEMEncodedCertificate) bool { return sameCert(c.Crt, s.newCA.Crt) })
	if !hasCA(accepted, s.oldCA) {
		accepted = append(accepted, &x509.PEMEncodedCertificate{Crt: s.oldCA})
	}
	cfg.MachineConfig.MachineAcceptedCAs = accepted
	cfg.MachineConfig.MachineCA = &x509.PEMEncodedCertificateAndKey{Crt: s.newCA.Crt}
	if cp {
		cfg.MachineConfig.MachineCA.Key = s.newCA.Key
	}
	return true
}

func dropOldCA(s *caState, _ bool, cfg *v1alpha1.Config) bool {
	if !hasCA(cfg.MachineConfig.MachineAcceptedCAs, s.oldCA) {
		return false
	}
	cfg.MachineConfig.MachineAcceptedCAs = slices.DeleteFunc(slices.Clone(cfg.MachineConfig.MachineAcceptedCAs), func(c *x509.PEMEncodedCertificate) bool { return sameCert(c.Crt, s.oldCA) })
	return true
}

func machineCA(cfg *v1alpha1.Config) []byte {
	if cfg.MachineConfig == nil || cfg.MachineConfig.MachineCA == nil {
		return nil
	}
	return cfg.MachineConfig.MachineCA.Crt
}

func hasCA(cas []*x509.PEMEncodedCertificate, crt []byte) bool {
	return slices.ContainsFunc(cas, func(c *x509.PEMEncodedCertificate) bool { return sameCert(c.Crt, crt) })
}

func sameCert(a, b []byte) bool {
	return len(a) > 0 && bytes.Equal(bytes.TrimSpace(a), bytes.TrimSpace(b))
}

// caPatchStep applies one stage's change to the machine, live, through a
// client of the stage's credentials, and verifies through COSI that the
// machine runs it. A machine that already carries it is not applied again.
func caPatchStep(name string, c creds, patch caPatch) Step {
	return Step{Name: name, Timeout: 2 * time.Minute, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		if err := e.requireAddress(); err != nil {
			return Outcome{}, err
		}
		s, err := mustCAState(ctx, e)
		if err != nil {
			return Outcome{}, err
		}
		tc, err := dialCreds(ctx, e, s, c)
		if err != nil {
			return Outcome{}, err
		}
		defer tc.Close() //nolint:errcheck
		mc := machineconfig.Machine{Talos: tc, Node: e.Address}
		var active config.Provider
		if err := untilAccepted(ctx, func() error { active, err = mc.Active(ctx); return err }); err != nil {
			var r refusal
			if errors.As(err, &r) {
				return Outcome{}, Fail("CredentialsRefused", "%s does not accept %s: %v", e.Machine.Name, c, r.err)
			}
			return Outcome{}, configFail(err)
		}
		changed := false
		ch, err := machineconfig.PlanOn(active, []machineconfig.Patch{machineconfig.Typed(name, func(cfg *v1alpha1.Config) error {
			if cfg.MachineConfig == nil {
				return errors.New("the configuration has no machine section")
			}
			changed = patch(s, e.Machine.Role == ichorv1.RoleControlPlane, cfg)
			return nil
		})})
		if err != nil {
			return Outcome{}, configFail(err)
		}
		if !changed || ch.Applied() {
			return Outcome{Message: "already done"}, nil
		}
		if _, err := mc.Apply(ctx, ch.Config, machineconfig.NoReboot); err != nil {
			return Outcome{}, configFail(err)
		}
		if err := untilAnswers(ctx, func() error { return mc.Verify(ctx, ch.To) }); err != nil {
			return Outcome{}, configFail(err)
		}
		return Outcome{Message: "applied live"}, nil
	}}
}

// verifyCAStep checks c on every machine, as talosctl's verifyConnectivity;
// then, with hold, puts c in Secret ichor-talosconfig (it works everywhere
// now, and keeps working through the stages to come), and with refuseOld
// checks that the talosconfig the rotation started with is refused by
// every endpoint and removes the rotation's Secret, its work done (a run
// again that finds it removed checks ichor-talosconfig's instead).
func verifyCAStep(c creds, hold, refuseOld bool) Step {
	return Step{Name: StepVerifyCA, Timeout: 2 * time.Minute, Run: func(ctx context.Context, e *Env) (Outcome, error) {
		s, err := readCAState(ctx, e)
		if err != nil {
			return Outcome{}, err
		}
		if s == nil && refuseOld {
			cfg, err := heldConfig(ctx, e)
			if err != nil {
				return Outcome{}, err
			}
			if err := verifyEverywhere(ctx, e, cfg, "the talosconfig of Secret "+ichorv1.TalosconfigSecret); err != nil {
				return Outcome{}, err
			}
			return Outcome{Message: "the new talosconfig works on every machine; the old one was refused by every endpoint"}, nil
		}
		if s == nil {
			return Outcome{}, errCAStateMissing(e)
		}
		cfg, err := s.config(c)
		if err != nil {
			return Outcome{}, err
		}
		if err := verifyEverywhere(ctx, e, cfg, c.String()); err != nil {
			return Outcome{}, err
		}
		msg := fmt.Sprintf("%s works on every machine", c)
		if hold {
			if err := holdCreds(ctx, e, cfg); err != nil {
				return Outcome{}, err
			}
			msg += fmt.Sprintf("; Secret %s/%s holds it", e.Controller.Namespace, ichorv1.TalosconfigSecret)
		}
		if refuseOld {
			if err := oldRefused(ctx, e, s); err != nil {
				return Outcome{}, err
			}
			msg += "; the old talosconfig is refused by every endpoint"
		}
		return Outcome{Message: msg}, nil
	}}
}

func dialCreds(ctx context.Context, e *Env, s *caState, c creds) (*talosclient.Client, error) {
	cfg, err := s.config(c)
	if err != nil {
		return nil, err
	}
	if e.Dial == nil {
		return nil, errors.New("this controller cannot dial the Talos API with other credentials")
	}
	return e.Dial(ctx, cfg)
}

// verifyEverywhere calls Version on every machine of the operation with
// c, through a client of every endpoint (each endpoint's own handshake)
// and through one of them all to every machine (apid's hop). A machine that
// does not answer is waited for, as talosctl retries Unavailable, until
// the step's deadline.
func verifyEverywhere(ctx context.Context, e *Env, cfg *clientconfig.Config, what string) error {
	if e.Dial == nil {
		return errors.New("this controller cannot dial the Talos API with other credentials")
	}
	ep := cfg.Contexts[cfg.Context].Endpoints
	for _, endpoint := range ep {
		one, err := oneEndpoint(cfg, endpoint)
		if err != nil {
			return err
		}
		if err := versionWith(ctx, e, one, "endpoint "+endpoint, what); err != nil {
			return err
		}
	}
	tc, err := e.Dial(ctx, cfg)
	if err != nil {
		return err
	}
	defer tc.Close() //nolint:errcheck
	for _, m := range e.Op.Status.Machines {
		addr := nodeAddress(e, m.Name)
		if addr == "" {
			return Fail("NoNodeAddress", "the Node %s has no InternalIP: its Talos API cannot be checked", m.Name)
		}
		if err := untilAccepted(ctx, func() error { _, err := talos.Version(ctx, tc, addr); return err }); err != nil {
			return Fail("CredentialsRefused", "%s does not answer with %s: %w", m.Name, what, err)
		}
	}
	return nil
}

// untilAccepted is untilAnswers for a call made with credentials being
// proved: a handshake refused on the credentials (talos.Refused) for
// refusedFor in a row ends it, as a refusal, where waiting would only
// reach the step's deadline. Not at once: Talos takes a changed
// configuration's certificates a moment after the apply answers (talosctl
// retries Unavailable for 10 s).
func untilAccepted(ctx context.Context, call func() error) error {
	var since time.Time
	return untilAnswers(ctx, func() error {
		err := call()
		if !talos.Refused(err) {
			since = time.Time{}
			return err
		}
		if since.IsZero() {
			since = time.Now()
		}
		if time.Since(since) >= refusedFor {
			return refusal{err}
		}
		return err
	})
}

// refusedFor is how long untilAccepted lets a refusal last.
const refusedFor = 15 * time.Second

// refusal is a refused handshake, hidden from talos.Unreachable.
type refusal struct{ err error }

func (r refusal) Error() string { return r.err.Error() }

// versionWith calls Version on the endpoint of cfg itself.
func versionWith(ctx context.Context, e *Env, cfg *clientconfig.Config, where, what string) error {
	tc, err := e.Dial(ctx, cfg)
	if err != nil {
		return err
	}
	defer tc.Close() //nolint:errcheck
	if err := untilAccepted(ctx, func() error { _, err := tc.Version(ctx); return err }); err != nil {
		return Fail("CredentialsRefused", "%s does not answer with %s: %w", where, what, err)
	}
	return nil
}

func oneEndpoint(cfg *clientconfig.Config, endpoint string) (*clientconfig.Config, error) {
	b, err := cfg.Bytes()
	if err != nil {
		return nil, err
	}
	one, err := clientconfig.FromBytes(b)
	if err != nil {
		return nil, err
	}
	one.Contexts[one.Context].Endpoints = []string{endpoint}
	return one, nil
}

// heldConfig is the talosconfig of Secret ichor-talosconfig, read live.
func heldConfig(ctx context.Context, e *Env) (*clientconfig.Config, error) {
	sec := &corev1.Secret{}
	key := client.ObjectKey{Namespace: e.Controller.Namespace, Name: ichorv1.TalosconfigSecret}
	if err := e.Live.Get(ctx, key, sec); err != nil {
		return nil, fmt.Errorf("read Secret %s: %w", key, err)
	}
	cfg, err := clientconfig.FromBytes(sec.Data[ichorv1.TalosconfigKey])
	if err != nil {
		return nil, fmt.Errorf("Secret %s: %w", key, err)
	}
	return cfg, nil
}

// holdCreds puts cfg in Secret ichor-talosconfig, unless it holds it already.
func holdCreds(ctx context.Context, e *Env, cfg *clientconfig.Config) error {
	data, err := cfg.Bytes()
	if err != nil {
		return err
	}
	sec := &corev1.Secret{}
	key := client.ObjectKey{Namespace: e.Controller.Namespace, Name: ichorv1.TalosconfigSecret}
	if err := e.Live.Get(ctx, key, sec); err != nil {
		return fmt.Errorf("read Secret %s: %w", key, err)
	}
	if bytes.Equal(sec.Data[ichorv1.TalosconfigKey], data) {
		return nil
	}
	if sec.Data == nil {
		sec.Data = map[string][]byte{}
	}
	sec.Data[ichorv1.TalosconfigKey] = data
	if err := e.Live.Update(ctx, sec); err != nil {
		return fmt.Errorf("write the new talosconfig to Secret %s: %w", key, err)
	}
	return nil
}

// oldRefused checks that a new connection with the client certificate of
// the talosconfig the rotation started with is refused by every endpoint
// (trusting both CAs' servers, so that only the client certificate is
// judged), then removes the rotation's Secret: the new CA's key is in the
// control planes' configuration, the new credentials in ichor-talosconfig.
func oldRefused(ctx context.Context, e *Env, s *caState) error {
	old, err := s.oldCertConfig()
	if err != nil {
		return err
	}
	for _, endpoint := range old.Contexts[old.Context].Endpoints {
		one, err := oneEndpoint(old, endpoint)
		if err != nil {
			return err
		}
		tc, err := e.Dial(ctx, one)
		if err != nil {
			return err
		}
		rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		_, err = tc.Version(rctx)
		cancel()
		_ = tc.Close()
		if err == nil {
			return Fail("OldCredentialsAccepted", "endpoint %s still accepts the client certificate the rotation started with: the old CA is still trusted there", endpoint)
		}
	}
	sec := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: e.Controller.Namespace, Name: CARotationSecret}}
	if err := e.Live.Delete(ctx, sec); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("remove Secret %s/%s: %w", e.Controller.Namespace, CARotationSecret, err)
	}
	return nil
}
