package sim

import (
	"crypto/tls"
	stdx509 "crypto/x509"
	"fmt"
	"net"
	"time"

	"github.com/siderolabs/crypto/x509"
)

// A hosted fleet's etcd serves its clients over TLS as Talos's does
// (client-cert-auth, trusted-ca-file cluster.etcd.ca): a serving
// certificate and client certificates issued by the etcd CA, as Talos's
// etcd certificate generator issues them (internal/pkg/etcd/certs.go).

// etcdServerCert is GenerateServerCert's: the member's address and
// localhost, server and client auth, ten years.
func etcdServerCert(ca *x509.PEMEncodedCertificateAndKey, host string) (*x509.PEMEncodedCertificateAndKey, error) {
	return issueEtcd(ca, x509.CommonName(host), x509.DNSNames([]string{"localhost"}),
		x509.IPAddresses([]net.IP{net.ParseIP(host), net.ParseIP("127.0.0.1")}),
		x509.ExtKeyUsage([]stdx509.ExtKeyUsage{stdx509.ExtKeyUsageServerAuth, stdx509.ExtKeyUsageClientAuth}))
}

// etcdClientCert is GenerateClientCert's (kube-apiserver's is named so).
func etcdClientCert(ca *x509.PEMEncodedCertificateAndKey, commonName string) (*x509.PEMEncodedCertificateAndKey, error) {
	return issueEtcd(ca, x509.CommonName(commonName), x509.ExtKeyUsage([]stdx509.ExtKeyUsage{stdx509.ExtKeyUsageClientAuth}))
}

func issueEtcd(ca *x509.PEMEncodedCertificateAndKey, opts ...x509.Option) (*x509.PEMEncodedCertificateAndKey, error) {
	issuer, err := x509.NewCertificateAuthorityFromCertificateAndKey(ca)
	if err != nil {
		return nil, fmt.Errorf("etcd CA: %w", err)
	}
	opts = append(opts, x509.NotAfter(time.Now().Add(87600*time.Hour)),
		x509.KeyUsage(stdx509.KeyUsageDigitalSignature|stdx509.KeyUsageKeyEncipherment))
	kp, err := x509.NewKeyPair(issuer, opts...)
	if err != nil {
		return nil, fmt.Errorf("etcd certificate: %w", err)
	}
	return x509.NewCertificateAndKeyFromKeyPair(kp), nil
}

// etcdClientTLS trusts the etcd CA and presents a client certificate it
// issued, named commonName.
func etcdClientTLS(ca *x509.PEMEncodedCertificateAndKey, commonName string) (*tls.Config, error) {
	crt, err := etcdClientCert(ca, commonName)
	if err != nil {
		return nil, err
	}
	pair, err := tls.X509KeyPair(crt.Crt, crt.Key)
	if err != nil {
		return nil, err
	}
	roots := stdx509.NewCertPool()
	roots.AppendCertsFromPEM(ca.Crt)
	return &tls.Config{Certificates: []tls.Certificate{pair}, RootCAs: roots, MinVersion: tls.VersionTLS12}, nil
}

// EtcdClientTLS is TLS for a client of the fleet's hosted etcd
// (HostedEtcd's ClientURL): the etcd CA trusted, a client certificate it
// issued presented, as a test that reads etcd itself needs.
func (f *Fleet) EtcdClientTLS() (*tls.Config, error) {
	return etcdClientTLS(f.secrets.Certs.Etcd, "sim-test")
}
