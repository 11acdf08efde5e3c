// Package kubepki issues Kubernetes client certificates from a Kubernetes
// CA as Talos's kubeconfig generator (pkg/kubeconfig) does: the simulator
// issues its machines' admin kubeconfigs with it, and the controller the
// certificates it proves a rotated CA with.
package kubepki

import (
	"crypto/tls"
	stdx509 "crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"time"

	"github.com/siderolabs/crypto/x509"
	"github.com/siderolabs/talos/pkg/machinery/constants"
)

// Admin is an admin client certificate from ca, as Talos's Kubeconfig
// call issues it (CN admin, O system:masters).
func Admin(ca *x509.PEMEncodedCertificateAndKey) (*x509.PEMEncodedCertificateAndKey, error) {
	return ClientCertificate(ca, constants.KubernetesAdminCertCommonName, constants.KubernetesAdminCertOrganization)
}

// ClientCertificate is a client certificate from ca for commonName in
// organization, valid from a minute ago (Talos allows for clock skew) for
// a year.
func ClientCertificate(ca *x509.PEMEncodedCertificateAndKey, commonName, organization string) (*x509.PEMEncodedCertificateAndKey, error) {
	auth, err := x509.NewCertificateAuthorityFromCertificateAndKey(ca)
	if err != nil {
		return nil, fmt.Errorf("kubernetes CA: %w", err)
	}
	kp, err := x509.NewKeyPair(auth,
		x509.CommonName(commonName),
		x509.Organization(organization),
		x509.NotBefore(time.Now().Add(-time.Minute)),
		x509.NotAfter(time.Now().Add(365*24*time.Hour)),
		x509.KeyUsage(stdx509.KeyUsageDigitalSignature|stdx509.KeyUsageKeyEncipherment),
		x509.ExtKeyUsage([]stdx509.ExtKeyUsage{stdx509.ExtKeyUsageClientAuth}),
	)
	if err != nil {
		return nil, fmt.Errorf("%s certificate: %w", commonName, err)
	}
	return &x509.PEMEncodedCertificateAndKey{Crt: kp.CrtPEM, Key: kp.KeyPEM}, nil
}

// IssuedBy checks that the PEM client certificate crt verifies with the
// PEM CA bundle ca.
func IssuedBy(crt, ca []byte) error {
	pool := stdx509.NewCertPool()
	if !pool.AppendCertsFromPEM(ca) {
		return errors.New("no CA certificate")
	}
	blk, _ := pem.Decode(crt)
	if blk == nil {
		return errors.New("no certificate")
	}
	c, err := stdx509.ParseCertificate(blk.Bytes)
	if err != nil {
		return err
	}
	_, err = c.Verify(stdx509.VerifyOptions{Roots: pool, KeyUsages: []stdx509.ExtKeyUsage{stdx509.ExtKeyUsageClientAuth}})
	return err
}

// UntrustedServer says whether err is a TLS handshake that did not trust
// the server's certificate (its issuer is not among the client's roots):
// what a client whose trust predates a swap of the Kubernetes CA gets.
func UntrustedServer(err error) bool {
	var ua stdx509.UnknownAuthorityError
	var cv *tls.CertificateVerificationError
	return errors.As(err, &ua) || errors.As(err, &cv)
}
