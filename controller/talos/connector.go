// Package talos is Ichor's access to the Talos API: one machinery client
// built from the talosconfig in Secret ichor-talosconfig, and the calls each
// action needs (see shared/TALOS_API.md), every one targeted at one machine
// with client.WithNode (or fanned out with WithNodes where apid allows it).
package talos

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"

	"google.golang.org/grpc"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"sigs.k8s.io/controller-runtime/pkg/client"

	talosclient "github.com/siderolabs/talos/pkg/machinery/client"
	clientconfig "github.com/siderolabs/talos/pkg/machinery/client/config"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

// ConfigError says why there is no usable talosconfig. The operation
// reconciler shows it as a condition on the operations instead of failing.
type ConfigError struct {
	// Reason is TalosconfigMissing or TalosconfigInvalid.
	Reason  string
	Message string
}

func (e *ConfigError) Error() string { return e.Message }

// Connector hands out the Talos client built from the talosconfig Secret.
// It builds a new client only when the Secret's talosconfig changes, not on
// any other change of the Secret (a label, a refresh that writes the same
// data), and the client it replaces stays open until every user of it has
// released it: a step in flight finishes on the client it started with.
type Connector struct {
	// Reader reads the Secret (the manager's cache watches just that one).
	Reader    client.Reader
	Namespace string
	// DialOptions are added to the Talos client's gRPC dial options (tests
	// dial through a switch they cut to kill a controller hard, and watch
	// the calls it makes).
	DialOptions []grpc.DialOption

	mu      sync.Mutex
	current *conn
	closed  bool
}

// conn is one client and the talosconfig it was built from.
type conn struct {
	client *talosclient.Client
	data   []byte
	users  int
	// retired: a newer client replaced it (or the Connector closed); it
	// closes when its last user releases it.
	retired bool
}

// Use is one user's hold on a Talos client. The client stays open until
// every Use of it is released.
type Use struct {
	Client *talosclient.Client
	c      *Connector
	conn   *conn
	once   sync.Once
}

// Use returns a hold on the Talos client, or a *ConfigError when the Secret
// is missing or does not hold a usable talosconfig. The caller releases it.
func (c *Connector) Use(ctx context.Context) (*Use, error) {
	secret := &corev1.Secret{}
	err := c.Reader.Get(ctx, client.ObjectKey{Namespace: c.Namespace, Name: ichorv1.TalosconfigSecret}, secret)
	if apierrors.IsNotFound(err) {
		return nil, &ConfigError{Reason: "TalosconfigMissing", Message: fmt.Sprintf(
			"Secret %s/%s not found: create it from an os:admin talosconfig with `kubectl -n %s create secret generic %s --from-file=%s=./talosconfig`",
			c.Namespace, ichorv1.TalosconfigSecret, c.Namespace, ichorv1.TalosconfigSecret, ichorv1.TalosconfigKey)}
	}
	if err != nil {
		return nil, fmt.Errorf("read Secret %s/%s: %w", c.Namespace, ichorv1.TalosconfigSecret, err)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil, errors.New("the Talos connector is closed: the controller is stopping")
	}
	data := secret.Data[ichorv1.TalosconfigKey]
	if c.current == nil || !bytes.Equal(c.current.data, data) {
		cl, err := c.newClient(ctx, data)
		if err != nil {
			return nil, &ConfigError{Reason: "TalosconfigInvalid", Message: fmt.Sprintf(
				"Secret %s/%s key %q: %v", c.Namespace, ichorv1.TalosconfigSecret, ichorv1.TalosconfigKey, err)}
		}
		c.retireLocked()
		c.current = &conn{client: cl, data: bytes.Clone(data)}
	}
	c.current.users++
	return &Use{Client: c.current.client, c: c, conn: c.current}, nil
}

// Current is a hold on the client the Connector built last, without
// reading the Secret (nil when it has built none, or is closed): for the
// one who needs the Talos API when the Kubernetes API refuses the
// controller, so that the Secret cannot be read.
func (c *Connector) Current() *Use {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed || c.current == nil {
		return nil
	}
	c.current.users++
	return &Use{Client: c.current.client, c: c, conn: c.current}
}

// Another is a further hold on the same client, for a user that outlives
// this one (a step that runs after the reconcile that started it).
func (u *Use) Another() *Use {
	u.c.mu.Lock()
	defer u.c.mu.Unlock()
	u.conn.users++
	return &Use{Client: u.Client, c: u.c, conn: u.conn}
}

// Release ends the hold; releasing twice is harmless.
func (u *Use) Release() {
	u.once.Do(func() {
		u.c.mu.Lock()
		defer u.c.mu.Unlock()
		u.conn.users--
		if u.conn.retired && u.conn.users == 0 {
			_ = u.conn.client.Close()
		}
	})
}

// retireLocked retires the current client: closed now if nobody uses it,
// or by its last user's Release.
func (c *Connector) retireLocked() {
	if c.current == nil {
		return
	}
	c.current.retired = true
	if c.current.users == 0 {
		_ = c.current.client.Close()
	}
	c.current = nil
}

func (c *Connector) newClient(ctx context.Context, data []byte) (*talosclient.Client, error) {
	if len(data) == 0 {
		return nil, errors.New("empty: it must hold a talosconfig")
	}
	cfg, err := clientconfig.FromBytes(data)
	if err != nil {
		return nil, fmt.Errorf("not a talosconfig: %w", err)
	}
	return c.Dial(ctx, cfg)
}

// Dial builds a Talos client of other credentials than the Secret's, with
// the Connector's dial options: a CA rotation proves credentials on every
// machine before the Secret holds them. The caller closes it.
func (c *Connector) Dial(ctx context.Context, cfg *clientconfig.Config) (*talosclient.Client, error) {
	opts := []talosclient.OptionFunc{talosclient.WithConfig(cfg)}
	if len(c.DialOptions) > 0 {
		opts = append(opts, talosclient.WithGRPCDialOptions(c.DialOptions...))
	}
	cl, err := talosclient.New(ctx, opts...)
	if err != nil {
		return nil, fmt.Errorf("talosconfig unusable: %w", err)
	}
	return cl, nil
}

// Close stops handing out clients and closes the current one once its
// users have released it.
func (c *Connector) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.closed = true
	c.retireLocked()
	return nil
}
