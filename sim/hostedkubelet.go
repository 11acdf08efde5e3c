package sim

import (
	"bytes"
	"crypto/tls"
	stdx509 "crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sync"
	"time"

	"k8s.io/client-go/rest"
)

// kubeletConfig is the REST config of the fleet's kubelets under
// Spec.Hosted. As a Talos kubelet's, its credentials follow the control
// planes' Kubernetes CA (Talos restarts the kubelet with new ones during a
// CA rotation): a client certificate from the first control plane's
// cluster.ca, issued again when it changes, and trust in the CAs any
// control plane accepts now (its cluster.acceptedCAs and cluster.ca).
func (h *hosting) kubeletConfig(f *Fleet) *rest.Config {
	c := &kubeletCreds{f: f}
	return &rest.Config{
		Host: "https://" + h.lb.Address(),
		Transport: &http.Transport{
			DialContext:         (&net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
			TLSHandshakeTimeout: 10 * time.Second,
			MaxIdleConnsPerHost: 25,
			ForceAttemptHTTP2:   true,
			TLSClientConfig: &tls.Config{
				MinVersion:           tls.VersionTLS12,
				InsecureSkipVerify:   true, // VerifyConnection verifies, against the CAs accepted at the time
				VerifyConnection:     c.verify,
				GetClientCertificate: c.certificate,
			},
		},
		QPS: 1000, Burst: 2000,
	}
}

// kubeletCreds are the kubelets' credentials, renewed as the control
// planes' configuration changes.
type kubeletCreds struct {
	f *Fleet

	mu    sync.Mutex
	ca    []byte // the cluster.ca crt the certificate is from
	cert  *tls.Certificate
	trust []byte // the PEM bundle pool is from
	pool  *stdx509.CertPool
}

func (c *kubeletCreds) certificate(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
	cfg := c.f.controlPlanes[0].Config()
	if cfg == nil || cfg.Cluster() == nil || cfg.Cluster().IssuingCA() == nil {
		return nil, errors.New("the first control plane has no cluster.ca")
	}
	ca := cfg.Cluster().IssuingCA()
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cert != nil && bytes.Equal(c.ca, ca.Crt) {
		return c.cert, nil
	}
	// The sim's kubelets act for every Node and for the fleet: an admin's
	// rights, as the fleet's client had before.
	pem, err := AdminCertificate(ca)
	if err != nil {
		return nil, err
	}
	crt, err := tls.X509KeyPair(pem.Crt, pem.Key)
	if err != nil {
		return nil, err
	}
	c.ca, c.cert = ca.Crt, &crt
	return c.cert, nil
}

func (c *kubeletCreds) verify(cs tls.ConnectionState) error {
	if len(cs.PeerCertificates) == 0 {
		return errors.New("the API server sent no certificate")
	}
	var trust []byte
	for _, m := range c.f.controlPlanes {
		if cfg := m.Config(); cfg != nil && cfg.Cluster() != nil {
			for _, a := range cfg.Cluster().AcceptedCAs() {
				trust = append(trust, a.Crt...)
			}
			if ca := cfg.Cluster().IssuingCA(); ca != nil {
				trust = append(trust, ca.Crt...)
			}
		}
	}
	c.mu.Lock()
	if c.pool == nil || !bytes.Equal(c.trust, trust) {
		c.pool = stdx509.NewCertPool()
		c.pool.AppendCertsFromPEM(trust)
		c.trust = trust
	}
	pool := c.pool
	c.mu.Unlock()
	inter := stdx509.NewCertPool()
	for _, crt := range cs.PeerCertificates[1:] {
		inter.AddCert(crt)
	}
	if _, err := cs.PeerCertificates[0].Verify(stdx509.VerifyOptions{Roots: pool, Intermediates: inter, DNSName: cs.ServerName}); err != nil {
		return fmt.Errorf("the API server's certificate: %w", err)
	}
	return nil
}
