package talos

import (
	"context"
	"errors"
	"testing"

	"google.golang.org/grpc/connectivity"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/sim"
)

// secretReader serves one Secret, as the manager's cache would.
type secretReader struct {
	client.Reader
	secret *corev1.Secret
}

func (r *secretReader) Get(_ context.Context, _ client.ObjectKey, obj client.Object, _ ...client.GetOption) error {
	r.secret.DeepCopyInto(obj.(*corev1.Secret))
	return nil
}

// set stores data under a new resourceVersion, as any write to the Secret does.
func (r *secretReader) set(data []byte) {
	r.secret.ResourceVersion += "1"
	r.secret.Data = map[string][]byte{ichorv1.TalosconfigKey: data}
}

func talosconfig(t *testing.T, f *sim.Fleet) []byte {
	t.Helper()
	b, err := f.Talosconfig().Bytes()
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func closed(u *Use) bool { return u.Client.Conn().GetState() == connectivity.Shutdown }

// TestConnectorKeepsClientsInUse: the same talosconfig under a new
// resourceVersion keeps the client; a new talosconfig makes a new one, and
// the old one closes only when its last user releases it; an unusable
// talosconfig leaves the current client alone.
func TestConnectorKeepsClientsInUse(t *testing.T) {
	ctx := context.Background()
	fleet, err := sim.Start(ctx, sim.Cluster("conn", 1, 0), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer fleet.Stop()
	r := &secretReader{secret: &corev1.Secret{ObjectMeta: metav1.ObjectMeta{ResourceVersion: "1"}}}
	r.set(talosconfig(t, fleet))
	c := &Connector{Reader: r, Namespace: "ichor-system"}

	first, err := c.Use(ctx)
	if err != nil {
		t.Fatal(err)
	}
	step := first.Another() // a step that outlives the turn
	first.Release()
	first.Release() // twice is harmless

	r.set(r.secret.Data[ichorv1.TalosconfigKey])
	same, err := c.Use(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if same.Client != step.Client {
		t.Errorf("the same talosconfig under a new resourceVersion built a new client")
	}
	same.Release()

	r.set([]byte("not a talosconfig"))
	var cfgErr *ConfigError
	if _, err := c.Use(ctx); !errors.As(err, &cfgErr) || cfgErr.Reason != "TalosconfigInvalid" {
		t.Errorf("an unusable talosconfig: %v", err)
	}
	if closed(step) {
		t.Fatal("an unusable talosconfig closed the client in use")
	}

	r.set(talosconfig(t, fleet))
	rotated, err := c.Use(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if rotated.Client == step.Client {
		t.Fatal("a new talosconfig kept the old client")
	}
	if closed(step) {
		t.Fatal("a new talosconfig closed the old client under its user")
	}
	if _, err := Version(ctx, step.Client, fleet.Machines()[0].Address()); err != nil {
		t.Errorf("the old client, still in use: %v", err)
	}
	step.Release()
	if !closed(step) {
		t.Error("the old client stayed open after its last user released it")
	}

	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if closed(rotated) {
		t.Error("Close closed a client in use")
	}
	rotated.Release()
	if !closed(rotated) {
		t.Error("the client stayed open after Close and its last release")
	}
	if _, err := c.Use(ctx); err == nil {
		t.Error("Use after Close handed out a client")
	}
}
