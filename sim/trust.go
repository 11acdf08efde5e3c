package sim

import (
	"bytes"
	"crypto/tls"
	stdx509 "crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"slices"
	"sync"
	"time"

	ctls "github.com/siderolabs/crypto/tls"
	"github.com/siderolabs/crypto/x509"
	"github.com/siderolabs/talos/pkg/machinery/config"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// apiTrust is what a machine's apid serves and trusts, derived from its
// active configuration as Talos's OSRoot and API controllers derive it
// (internal/app/machined/pkg/controllers/secrets/root.go and api.go): the
// issuing CA is machine.ca (a worker's holds the certificate only), the
// accepted CAs are machine.acceptedCAs then machine.ca's certificate, and a
// control plane's server certificate is issued by machine.ca for its
// address.
type apiTrust struct {
	cfg config.Provider // the configuration it was derived from
	// issuing is the DER of machine.ca's certificate.
	issuing []byte
	// accepted are the DER of every accepted CA certificate.
	accepted [][]byte
	pool     *stdx509.CertPool
	server   *tls.Certificate // control planes only
}

// accepts reports whether a certificate issued by the CA whose DER is ca
// is accepted.
func (t *apiTrust) accepts(ca []byte) bool {
	return slices.ContainsFunc(t.accepted, func(a []byte) bool { return bytes.Equal(a, ca) })
}

// trustCache holds a machine's apiTrust for its current configuration.
type trustCache struct {
	mu sync.Mutex
	t  *apiTrust
}

// trust is the machine's apiTrust for its active configuration, derived
// again when the configuration changed (as apid reloads on a change of
// the secrets.API resource: the accepted CAs and a new server
// certificate, for the next handshake; connections already open stay).
func (m *Machine) trust() (*apiTrust, error) {
	cfg := m.Config()
	m.trustCache.mu.Lock()
	defer m.trustCache.mu.Unlock()
	if t := m.trustCache.t; t != nil && t.cfg == cfg {
		return t, nil
	}
	t, err := deriveTrust(cfg, m)
	if err != nil {
		return nil, fmt.Errorf("%s: Talos API certificates: %w", m.Name(), err)
	}
	// A server certificate issued by the same CA is kept: Talos issues a
	// new one when its inputs change, which the client cannot tell apart.
	if old := m.trustCache.t; old != nil && old.server != nil && t.server == nil && bytes.Equal(old.issuing, t.issuing) {
		t.server = old.server
	}
	if t.server == nil && m.spec.Role == ControlPlane {
		if t.server, err = serverCertificate(cfg, m); err != nil {
			return nil, fmt.Errorf("%s: server certificate: %w", m.Name(), err)
		}
	}
	m.trustCache.t = t
	return t, nil
}

func deriveTrust(cfg config.Provider, m *Machine) (*apiTrust, error) {
	sec := cfg.Machine().Security()
	t := &apiTrust{cfg: cfg, pool: stdx509.NewCertPool()}
	var pems [][]byte
	for _, ca := range sec.AcceptedCAs() {
		pems = append(pems, ca.Crt)
	}
	if ca := sec.IssuingCA(); ca != nil && len(ca.Crt) > 0 {
		pems = append(pems, ca.Crt)
		der, err := certDER(ca.Crt)
		if err != nil {
			return nil, fmt.Errorf("machine.ca: %w", err)
		}
		t.issuing = der
	}
	for _, p := range pems {
		der, err := certDER(p)
		if err != nil {
			return nil, fmt.Errorf("machine.acceptedCAs: %w", err)
		}
		t.accepted = append(t.accepted, der)
		if !t.pool.AppendCertsFromPEM(p) {
			return nil, errors.New("failed to parse CA certs into a CertPool")
		}
	}
	return t, nil
}

func serverCertificate(cfg config.Provider, m *Machine) (*tls.Certificate, error) {
	ca, err := x509.NewCertificateAuthorityFromCertificateAndKey(cfg.Machine().Security().IssuingCA())
	if err != nil {
		return nil, fmt.Errorf("failed to parse CA certificate: %w", err)
	}
	kp, err := x509.NewKeyPair(ca,
		x509.CommonName(m.Name()),
		x509.IPAddresses([]net.IP{net.ParseIP(m.addr)}),
		x509.DNSNames([]string{m.Name()}),
		x509.NotAfter(time.Now().Add(x509.DefaultCertificateValidityDuration)),
		x509.KeyUsage(stdx509.KeyUsageDigitalSignature),
		x509.ExtKeyUsage([]stdx509.ExtKeyUsage{stdx509.ExtKeyUsageServerAuth}),
	)
	if err != nil {
		return nil, err
	}
	return kp.Certificate, nil
}

func certDER(p []byte) ([]byte, error) {
	b, _ := pem.Decode(p)
	if b == nil || b.Type != "CERTIFICATE" {
		return nil, errors.New("not a PEM certificate")
	}
	return b.Bytes, nil
}

// apidTLS is the server side of a control plane's apid TLS, as
// internal/app/apid/pkg/provider builds it with siderolabs/crypto: mutual
// TLS 1.3 whose client CAs and server certificate are asked of the
// provider at every handshake, and a client certificate that must be for
// client authentication only (apid's verifyExtKeyUsage).
func apidTLS(m *Machine) (*tls.Config, error) {
	p := &trustProvider{m: m}
	cfg, err := ctls.New(
		ctls.WithClientAuthType(ctls.Mutual),
		ctls.WithDynamicClientCA(p),
		ctls.WithServerCertificateProvider(p),
	)
	if err != nil {
		return nil, err
	}
	cfg.VerifyPeerCertificate = verifyExtKeyUsage
	return cfg, nil
}

// trustProvider is a ctls.CertificateProvider reading the machine's
// current apiTrust.
type trustProvider struct{ m *Machine }

func (p *trustProvider) GetCA() ([]byte, error) {
	t, err := p.m.trust()
	if err != nil {
		return nil, err
	}
	var out []byte
	for _, der := range t.accepted {
		out = append(out, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})...)
	}
	return out, nil
}

func (p *trustProvider) GetCACertPool() (*stdx509.CertPool, error) {
	t, err := p.m.trust()
	if err != nil {
		return nil, err
	}
	return t.pool, nil
}

func (p *trustProvider) GetCertificate(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	t, err := p.m.trust()
	if err != nil {
		return nil, err
	}
	return t.server, nil
}

func (p *trustProvider) GetClientCertificate(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
	return nil, errors.New("the simulated apid dials no other apid")
}

// verifyExtKeyUsage is apid's: every leaf of the verified chain must be for
// client authentication and nothing else.
func verifyExtKeyUsage(_ [][]byte, chains [][]*stdx509.Certificate) error {
	if len(chains) == 0 {
		return errors.New("no verified chains")
	}
	for _, c := range chains[0] {
		if c.IsCA {
			continue
		}
		if !slices.Equal(c.ExtKeyUsage, []stdx509.ExtKeyUsage{stdx509.ExtKeyUsageClientAuth}) {
			return fmt.Errorf("certificate %q is missing the client auth extended key usage", c.Subject)
		}
	}
	return nil
}

// proxyTrust is the check of apid's hop from the control plane a client
// reached (owner) to the machine the call names (target), over mutual TLS
// with owner's certificates: target must accept owner's issuing CA (owner's
// client certificate is issued by it), and owner must accept target's (the
// issuer of target's server certificate). A worker's apid is modelled
// as trusting its own machine.ca and acceptedCAs; on Talos it trusts the
// accepted CAs trustd returned when its configuration last changed, which
// a rotation in talosctl's order (control planes before workers, in each
// stage) makes the same set.
func (f *Fleet) proxyTrust(owner, target *Machine) error {
	if owner == target {
		return nil
	}
	o, err := owner.trust()
	if err != nil {
		return status.Error(codes.Internal, err.Error())
	}
	t, err := target.trust()
	if err != nil {
		return status.Error(codes.Internal, err.Error())
	}
	switch {
	case !t.accepts(o.issuing):
		return status.Errorf(codes.Unavailable,
			"connection error: desc = \"error reading server preface: remote error: tls: unknown certificate authority\" (%s does not accept the CA of %s)", target.Name(), owner.Name())
	case !o.accepts(t.issuing):
		return status.Errorf(codes.Unavailable,
			"connection error: desc = \"transport: authentication handshake failed: tls: failed to verify certificate: x509: certificate signed by unknown authority\" (%s does not accept the CA of %s)", owner.Name(), target.Name())
	}
	return nil
}
