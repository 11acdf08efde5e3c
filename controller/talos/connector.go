// Package talos is Ichor's access to the Talos API: one machinery client
// built from the talosconfig in Secret ichor-talosconfig, and the calls each
// action needs (see shared/TALOS_API.md), every one targeted at one machine
// with client.WithNode (or fanned out with WithNodes where apid allows it).
package talos

import (
	"context"
	"errors"
	"fmt"
	"net"
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

// Connector hands out a Talos client built from the talosconfig Secret,
// rebuilt when the Secret changes.
type Connector struct {
	// Reader reads the Secret (the manager's cache watches just that one).
	Reader    client.Reader
	Namespace string
	// Dialer, when set, opens the connections to the Talos API endpoints
	// (tests cut them at once to kill a controller hard); nil dials TCP.
	Dialer func(ctx context.Context, address string) (net.Conn, error)

	mu     sync.Mutex
	rv     string
	client *talosclient.Client
}

// Client returns the Talos client, or a *ConfigError when the Secret is
// missing or does not hold a usable talosconfig.
func (c *Connector) Client(ctx context.Context) (*talosclient.Client, error) {
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
	if c.client != nil && c.rv == secret.ResourceVersion {
		return c.client, nil
	}
	cl, err := c.newClient(ctx, secret.Data[ichorv1.TalosconfigKey])
	if err != nil {
		return nil, &ConfigError{Reason: "TalosconfigInvalid", Message: fmt.Sprintf(
			"Secret %s/%s key %q: %v", c.Namespace, ichorv1.TalosconfigSecret, ichorv1.TalosconfigKey, err)}
	}
	if c.client != nil {
		_ = c.client.Close()
	}
	c.client, c.rv = cl, secret.ResourceVersion
	return cl, nil
}

func (c *Connector) newClient(ctx context.Context, data []byte) (*talosclient.Client, error) {
	if len(data) == 0 {
		return nil, errors.New("empty: it must hold a talosconfig")
	}
	cfg, err := clientconfig.FromBytes(data)
	if err != nil {
		return nil, fmt.Errorf("not a talosconfig: %w", err)
	}
	opts := []talosclient.OptionFunc{talosclient.WithConfig(cfg)}
	if c.Dialer != nil {
		opts = append(opts, talosclient.WithGRPCDialOptions(grpc.WithContextDialer(c.Dialer)))
	}
	cl, err := talosclient.New(ctx, opts...)
	if err != nil {
		return nil, fmt.Errorf("talosconfig unusable: %w", err)
	}
	return cl, nil
}

// Close releases the client.
func (c *Connector) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.client == nil {
		return nil
	}
	err := c.client.Close()
	c.client = nil
	return err
}
