package controlplane

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"time"
)

// APIServer says how to run one kube-apiserver: the flags its control
// plane rendered (package sim renders them from the machine configuration
// as Talos does), and how to tell that it is ready.
type APIServer struct {
	// Assets is the directory of the binaries (KUBEBUILDER_ASSETS).
	Assets string
	// Args are the flags, --secure-port and --bind-address among them.
	Args []string
	// Address is the host:port it serves on, for the readiness probe.
	Address string
	// CA is the PEM of the CA that issued its serving certificate.
	CA []byte
	// ClientCert and ClientKey are an admin client certificate from a CA
	// it accepts: anonymous requests are refused, so /readyz needs one.
	ClientCert, ClientKey []byte
	// Log receives its output; nil discards it.
	Log io.Writer
}

// StartAPIServer starts kube-apiserver with a.Args and waits until its
// /readyz answers ok (or ctx ends, which stops it).
func StartAPIServer(ctx context.Context, a APIServer) (*Process, error) {
	bin := filepath.Join(a.Assets, "kube-apiserver")
	if _, err := os.Stat(bin); err != nil {
		return nil, fmt.Errorf("%s is missing: run `make envtest-assets`, which builds it: %w", bin, err)
	}
	hc, err := a.client()
	if err != nil {
		return nil, err
	}
	p, err := startProcess("kube-apiserver", bin, a.Args, a.Log)
	if err != nil {
		return nil, err
	}
	if err := p.waitHealthy(ctx, hc, "https://"+a.Address+"/readyz"); err != nil {
		p.Stop()
		return nil, err
	}
	return p, nil
}

func (a APIServer) client() (*http.Client, error) {
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(a.CA) {
		return nil, errors.New("kube-apiserver: the CA of its serving certificate is not PEM")
	}
	crt, err := tls.X509KeyPair(a.ClientCert, a.ClientKey)
	if err != nil {
		return nil, fmt.Errorf("kube-apiserver: admin client certificate: %w", err)
	}
	return &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{
		TLSClientConfig: &tls.Config{RootCAs: pool, Certificates: []tls.Certificate{crt}, MinVersion: tls.VersionTLS12},
	}}, nil
}
