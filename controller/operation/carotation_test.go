package operation_test

import (
	"context"
	"encoding/base64"
	"strings"
	"testing"
	"time"

	talosclient "github.com/siderolabs/talos/pkg/machinery/client"
	clientconfig "github.com/siderolabs/talos/pkg/machinery/client/config"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/utils/ptr"
	ctrlclient "sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/app"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/controller/operation"
	"maesh.dev/ichor/internal/testcluster"
	"maesh.dev/ichor/sim"
)

// TestTalosCARotation rotates the Talos API CA of 3 control planes and a
// worker: afterwards the talosconfig the controller started with is
// refused by every machine, the one Secret ichor-talosconfig holds works on
// every machine, the rotation's own Secret is gone, the operation says what
// an operator must do, and the controller then reboots a machine. Then a
// second rotation, from the CA the first made, with the controller killed
// right after each stage's last step ran (before status records it), a new
// one started each time, ends the same way.
func TestTalosCARotation(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 3, 1))
	worker := c.fleet.Machines()[3].Name()

	ctl := c.start()
	before := heldTalosconfig(t, c)
	c.create("rotate", caSpec())
	op := c.waitSucceeded("rotate", 3*time.Minute)
	if !strings.Contains(op.Status.Message, "afterwards: a talosconfig of the old Talos API CA is refused") {
		t.Errorf("message %q does not say what to do afterwards", op.Status.Message)
	}
	checkRotated(t, c, before)
	c.create("reboot", ichorv1.TalosOperationSpec{Kind: ichorv1.KindNode, Node: &ichorv1.NodeAction{Machine: worker, Action: ichorv1.NodeReboot}})
	c.waitSucceeded("reboot", 2*time.Minute)
	ctl.Stop()

	// Again, killed at every stage boundary.
	before = heldTalosconfig(t, c)
	c.create("rotate-killed", caSpec())
	killedAt := killInEachStage(t, env.Client, keyOf(c.ns, "rotate-killed"), 12, 2*time.Minute, func(hook func(operation.StepRun)) *testcluster.Controller {
		return testcluster.StartKillable(t, env.Config, app.Options{Namespace: c.ctrlNS, TestHookAfterRun: hook})
	})
	if len(killedAt) != 7 {
		t.Errorf("killed in %d stages, want each of the 7 (%v)", len(killedAt), killedAt)
	}
	checkRotated(t, c, before)
	c.start()
	c.create("reboot-again", ichorv1.TalosOperationSpec{Kind: ichorv1.KindNode, Node: &ichorv1.NodeAction{Machine: worker, Action: ichorv1.NodeReboot}})
	c.waitSucceeded("reboot-again", 2*time.Minute)
}

func caSpec() ichorv1.TalosOperationSpec {
	return ichorv1.TalosOperationSpec{Kind: ichorv1.KindCARotation, CARotation: &ichorv1.CARotation{Talos: ptr.To(true), Kubernetes: ptr.To(false)}}
}

func conditionsText(op *ichorv1.TalosOperation) string {
	var b strings.Builder
	for _, c := range op.Status.Conditions {
		b.WriteString(c.Type + ": " + c.Message + "\n")
	}
	return b.String()
}

// heldTalosconfig is the talosconfig Secret ichor-talosconfig holds.
func heldTalosconfig(t *testing.T, c *cluster) *clientconfig.Config {
	t.Helper()
	sec := &corev1.Secret{}
	if err := env.Client.Get(context.Background(), ctrlclient.ObjectKey{Namespace: c.ctrlNS, Name: ichorv1.TalosconfigSecret}, sec); err != nil {
		t.Fatal(err)
	}
	cfg, err := clientconfig.FromBytes(sec.Data[ichorv1.TalosconfigKey])
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// checkRotated: old's client certificate is refused by every endpoint, on
// a new connection that trusts both CAs' servers (so only the client
// certificate is judged; and so for every machine, a worker being reached
// through them), as is old itself, Secret
// ichor-talosconfig's talosconfig answers on every machine through every
// endpoint, every machine's machine.ca is the new CA and accepts no other,
// and the rotation's Secret is gone.
func checkRotated(t *testing.T, c *cluster, old *clientconfig.Config) {
	t.Helper()
	held := heldTalosconfig(t, c)
	if ca := held.Contexts[held.Context].CA; ca == old.Contexts[old.Context].CA {
		t.Fatal("Secret ichor-talosconfig still trusts the old CA")
	}
	oldCert := withRoots(t, old, old, held)
	for _, ep := range c.fleet.Endpoints() {
		for what, cfg := range map[string]*clientconfig.Config{"the old talosconfig": old, "the old client certificate": oldCert} {
			oc := dialEndpoint(t, cfg, ep)
			for _, m := range c.fleet.Machines() {
				vctx, cancel := context.WithTimeout(talosclient.WithNode(context.Background(), m.Address()), 5*time.Second)
				_, err := oc.Version(vctx)
				cancel()
				if err == nil {
					t.Errorf("%s still answers on %s through %s", what, m.Name(), ep)
				}
			}
		}
		nc := dialEndpoint(t, held, ep)
		for _, m := range c.fleet.Machines() {
			vctx, cancel := context.WithTimeout(talosclient.WithNode(context.Background(), m.Address()), 10*time.Second)
			_, err := nc.Version(vctx)
			cancel()
			if err != nil {
				t.Errorf("Secret ichor-talosconfig's talosconfig on %s through %s: %v", m.Name(), ep, err)
			}
		}
	}
	// Every machine's machine.ca is the new CA (its key on control planes
	// only), and no other CA is accepted.
	newCA, err := base64.StdEncoding.DecodeString(held.Contexts[held.Context].CA)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range c.fleet.Machines() {
		sec := m.Config().Machine().Security()
		ca := sec.IssuingCA()
		if ca == nil || strings.TrimSpace(string(ca.Crt)) != strings.TrimSpace(string(newCA)) || (len(ca.Key) > 0) != (m.Role() == sim.ControlPlane) {
			t.Errorf("%s: machine.ca is not the new CA (with its key on a control plane only)", m.Name())
		}
		if n := len(sec.AcceptedCAs()); n != 0 {
			t.Errorf("%s: machine.acceptedCAs holds %d CA(s), want none", m.Name(), n)
		}
	}
	err = env.Client.Get(context.Background(), ctrlclient.ObjectKey{Namespace: c.ctrlNS, Name: executor.CARotationSecret}, &corev1.Secret{})
	if !apierrors.IsNotFound(err) {
		t.Errorf("Secret %s after the rotation: %v, want it removed", executor.CARotationSecret, err)
	}
}

// withRoots is cfg trusting the CAs of the talosconfigs roots.
func withRoots(t *testing.T, cfg *clientconfig.Config, roots ...*clientconfig.Config) *clientconfig.Config {
	t.Helper()
	var pems []byte
	for _, r := range roots {
		p, err := base64.StdEncoding.DecodeString(r.Contexts[r.Context].CA)
		if err != nil {
			t.Fatal(err)
		}
		pems = append(append(pems, p...), '\n')
	}
	b, err := cfg.Bytes()
	if err != nil {
		t.Fatal(err)
	}
	out, err := clientconfig.FromBytes(b)
	if err != nil {
		t.Fatal(err)
	}
	out.Contexts[out.Context].CA = base64.StdEncoding.EncodeToString(pems)
	return out
}

// dialEndpoint is a new client of cfg through one endpoint only.
func dialEndpoint(t *testing.T, cfg *clientconfig.Config, endpoint string) *talosclient.Client {
	t.Helper()
	b, err := cfg.Bytes()
	if err != nil {
		t.Fatal(err)
	}
	one, err := clientconfig.FromBytes(b)
	if err != nil {
		t.Fatal(err)
	}
	one.Contexts[one.Context].Endpoints = []string{endpoint}
	tc, err := talosclient.New(context.Background(), talosclient.WithConfig(one))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tc.Close() })
	return tc
}
