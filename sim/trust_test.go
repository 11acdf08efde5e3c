package sim_test

import (
	"bytes"
	"context"
	"encoding/base64"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/siderolabs/crypto/x509"
	"github.com/siderolabs/talos/pkg/machinery/api/machine"
	"github.com/siderolabs/talos/pkg/machinery/client"
	clientconfig "github.com/siderolabs/talos/pkg/machinery/client/config"
	"github.com/siderolabs/talos/pkg/machinery/config/generate/secrets"
	"github.com/siderolabs/talos/pkg/machinery/config/types/v1alpha1"
	"github.com/siderolabs/talos/pkg/machinery/role"
	"google.golang.org/grpc/codes"

	"maesh.dev/ichor/sim"
)

// TestTalosAPITrustFollowsConfig: each machine's apid trusts machine.ca and
// machine.acceptedCAs of its active configuration, reloaded when it changes
// live, and serves a certificate issued by machine.ca: a client whose CA
// is only in acceptedCAs is let in, and refused at the handshake once it is
// dropped; then a whole rotation in talosctl's three stages, after which
// the fleet's original talosconfig is refused by every endpoint and the new
// one (new CA as its root) works on every machine, and a control plane
// mints talosconfigs from the new CA (`talosctl config new`).
func TestTalosAPITrustFollowsConfig(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	f, err := sim.Start(ctx, fleetSpec(t, 2, 1), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.Stop)
	old := f.Talosconfig()
	oldCA := f.CACertificate()
	newCA := newTalosCA(t)
	newCrt := adminCert(t, newCA)
	roots := func(cas ...[]byte) []byte { return bytes.Join(cas, nil) }
	// bridge trusts both CAs' server certificates and carries the new
	// client certificate; fresh is the talosconfig after the rotation.
	bridge := clientconfig.NewConfig("bridge", f.Endpoints(), roots(oldCA, newCA.Crt), newCrt)
	fresh := clientconfig.NewConfig("fresh", f.Endpoints(), newCA.Crt, newCrt)
	oldBoth := clientconfig.NewConfig("old", f.Endpoints(), roots(oldCA, newCA.Crt), oldAdmin(t, old))

	patchAll := func(fn func(m *sim.Machine, cfg *v1alpha1.Config), with *clientconfig.Config) {
		t.Helper()
		for _, m := range f.Machines() {
			applyWith(t, with, m, func(cfg *v1alpha1.Config) { fn(m, cfg) })
		}
	}
	accepted := func(cas ...[]byte) func(*sim.Machine, *v1alpha1.Config) {
		return func(_ *sim.Machine, cfg *v1alpha1.Config) {
			cfg.MachineConfig.MachineAcceptedCAs = nil
			for _, ca := range cas {
				cfg.MachineConfig.MachineAcceptedCAs = append(cfg.MachineConfig.MachineAcceptedCAs, &x509.PEMEncodedCertificate{Crt: ca})
			}
		}
	}

	// Not accepted yet: refused at the handshake by every endpoint.
	everyEndpointRefuses(t, f, bridge, "before the new CA is accepted")
	patchAll(accepted(newCA.Crt), old)
	everyMachineAnswers(t, f, bridge, "with the new CA in machine.acceptedCAs")
	everyMachineAnswers(t, f, old, "the old talosconfig, the new CA accepted")

	// Dropped again: refused at the handshake, the old one still let in.
	patchAll(accepted(), old)
	everyEndpointRefuses(t, f, bridge, "once the new CA is dropped from machine.acceptedCAs")
	everyMachineAnswers(t, f, old, "the old talosconfig, the new CA dropped")

	// The rotation: accept, swap (the new CA issues, a worker holds its
	// certificate only), drop the old.
	patchAll(accepted(newCA.Crt), old)
	patchAll(func(m *sim.Machine, cfg *v1alpha1.Config) {
		accepted(oldCA)(m, cfg)
		cfg.MachineConfig.MachineCA = &x509.PEMEncodedCertificateAndKey{Crt: newCA.Crt, Key: newCA.Key}
		if m.Role() == sim.Worker {
			cfg.MachineConfig.MachineCA = &x509.PEMEncodedCertificateAndKey{Crt: newCA.Crt}
		}
	}, bridge)
	everyMachineAnswers(t, f, fresh, "after the swap (server certificates from the new CA)")
	everyEndpointRefuses(t, f, old, "after the swap: the old root does not verify the new server certificates")
	everyMachineAnswers(t, f, oldBoth, "the old client certificate, while the old CA is accepted")
	patchAll(accepted(), fresh)
	everyMachineAnswers(t, f, fresh, "after the old CA is dropped")
	everyEndpointRefuses(t, f, oldBoth, "the old client certificate, once the old CA is dropped")

	// talosctl config new, from a control plane: a talosconfig of the new CA.
	c := dial(t, fresh, f.Endpoints()[0])
	resp, err := c.GenerateClientConfiguration(ctx, &machine.GenerateClientConfigurationRequest{Roles: []string{string(role.Admin)}})
	if err != nil {
		t.Fatalf("GenerateClientConfiguration: %v", err)
	}
	minted, err := clientconfig.FromBytes(resp.Messages[0].Talosconfig)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(resp.Messages[0].Ca, newCA.Crt) {
		t.Errorf("GenerateClientConfiguration's CA is not the new one")
	}
	everyMachineAnswers(t, f, minted, "a talosconfig minted by GenerateClientConfiguration")

	// apid's hop to another machine is mutual TLS too: a worker that no
	// longer accepts the control planes' CA is out of reach through them.
	w := f.Machines()[2]
	applyWith(t, fresh, w, func(cfg *v1alpha1.Config) {
		cfg.MachineConfig.MachineCA = &x509.PEMEncodedCertificateAndKey{Crt: newTalosCA(t).Crt}
	})
	vctx, vcancel := context.WithTimeout(client.WithNode(ctx, w.Address()), 10*time.Second)
	defer vcancel()
	if _, err := c.Version(vctx); client.StatusCode(err) != codes.Unavailable || !strings.Contains(err.Error(), "unknown certificate authority") {
		t.Errorf("Version on a worker that accepts another CA: %v, want Unavailable: unknown certificate authority", err)
	}
}

func newTalosCA(t *testing.T) *x509.PEMEncodedCertificateAndKey {
	t.Helper()
	ca, err := secrets.NewTalosCA(time.Now())
	if err != nil {
		t.Fatal(err)
	}
	return &x509.PEMEncodedCertificateAndKey{Crt: ca.CrtPEM, Key: ca.KeyPEM}
}

func adminCert(t *testing.T, ca *x509.PEMEncodedCertificateAndKey) *x509.PEMEncodedCertificateAndKey {
	t.Helper()
	b := &secrets.Bundle{Clock: secrets.NewFixedClock(time.Now()), Certs: &secrets.Certs{OS: ca}}
	crt, err := b.GenerateTalosAPIClientCertificate(role.MakeSet(role.Admin))
	if err != nil {
		t.Fatal(err)
	}
	return crt
}

// oldAdmin is the client certificate of a talosconfig.
func oldAdmin(t *testing.T, cfg *clientconfig.Config) *x509.PEMEncodedCertificateAndKey {
	t.Helper()
	ctx := cfg.Contexts[cfg.Context]
	crt, key, err := decode(ctx.Crt, ctx.Key)
	if err != nil {
		t.Fatal(err)
	}
	return &x509.PEMEncodedCertificateAndKey{Crt: crt, Key: key}
}

// dial is a fresh client of cfg through one endpoint: a new connection,
// so a new handshake.
func dial(t *testing.T, cfg *clientconfig.Config, endpoint string) *client.Client {
	t.Helper()
	one := *cfg
	one.Contexts = map[string]*clientconfig.Context{}
	for name, c := range cfg.Contexts {
		cc := *c
		cc.Endpoints = []string{endpoint}
		one.Contexts[name] = &cc
	}
	c, err := client.New(context.Background(), client.WithConfig(&one))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// everyMachineAnswers: Version on every machine through every endpoint.
func everyMachineAnswers(t *testing.T, f *sim.Fleet, cfg *clientconfig.Config, when string) {
	t.Helper()
	for _, ep := range f.Endpoints() {
		c := dial(t, cfg, ep)
		for _, m := range f.Machines() {
			ctx, cancel := context.WithTimeout(client.WithNode(context.Background(), m.Address()), 10*time.Second)
			_, err := c.Version(ctx)
			cancel()
			if err != nil {
				t.Fatalf("%s: Version on %s through %s: %v", when, m.Name(), ep, err)
			}
		}
	}
}

// everyEndpointRefuses: a new connection to each endpoint fails its TLS
// handshake.
func everyEndpointRefuses(t *testing.T, f *sim.Fleet, cfg *clientconfig.Config, when string) {
	t.Helper()
	for _, ep := range f.Endpoints() {
		c := dial(t, cfg, ep)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		_, err := c.Version(ctx)
		cancel()
		// The client sees the server's alert ("tls: unknown certificate
		// authority"), its own verdict ("x509: ..."), or, in TLS 1.3 where
		// the client's handshake ends before the server's verdict, the
		// connection the server closed ("broken pipe", "reset").
		if err == nil || client.StatusCode(err) != codes.Unavailable ||
			!slices.ContainsFunc([]string{"tls:", "x509:", "broken pipe", "connection reset"}, func(s string) bool { return strings.Contains(err.Error(), s) }) {
			t.Fatalf("%s: Version through %s: %v, want a refused TLS handshake", when, ep, err)
		}
	}
}

// applyWith changes a machine's active configuration live (NO_REBOOT)
// through a client of cfg.
func applyWith(t *testing.T, cfg *clientconfig.Config, m *sim.Machine, fn func(*v1alpha1.Config)) {
	t.Helper()
	c, err := client.New(context.Background(), client.WithConfig(cfg))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close() //nolint:errcheck
	a := configApply{t: t, c: c, ctx: client.WithNode(context.Background(), m.Address())}
	if _, err := a.apply(machine.ApplyConfigurationRequest_NO_REBOOT, false, fn); err != nil {
		t.Fatalf("apply on %s: %v", m.Name(), err)
	}
}

// decode reads a talosconfig's base64 certificate and key.
func decode(crt, key string) ([]byte, []byte, error) {
	c, err := base64.StdEncoding.DecodeString(crt)
	if err != nil {
		return nil, nil, err
	}
	k, err := base64.StdEncoding.DecodeString(key)
	return c, k, err
}
