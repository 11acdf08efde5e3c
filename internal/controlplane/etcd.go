package controlplane

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"time"
)

// Etcd says how to run one etcd: the flags its control plane chose (its
// name, data directory and URLs), and where it serves clients.
type Etcd struct {
	// Assets is the directory of the binaries (KUBEBUILDER_ASSETS).
	Assets string
	// Args are the flags.
	Args []string
	// ClientURL is the URL it serves clients on, for the readiness probe.
	ClientURL string
	// ClientTLS, for an https ClientURL, is the probe's TLS: the etcd CA
	// trusted, a client certificate it issued presented.
	ClientTLS *tls.Config
	// Log receives its output; nil discards it.
	Log io.Writer
}

// StartEtcd starts etcd with e.Args and waits until its /readyz answers ok
// (it serves: it has a leader), or ctx ends, which stops it.
func StartEtcd(ctx context.Context, e Etcd) (*Process, error) {
	bin := filepath.Join(e.Assets, "etcd")
	if _, err := os.Stat(bin); err != nil {
		return nil, fmt.Errorf("%s is missing: run `make envtest-assets`, which builds it: %w", bin, err)
	}
	p, err := startProcess("etcd", bin, e.Args, e.Log)
	if err != nil {
		return nil, err
	}
	hc := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{TLSClientConfig: e.ClientTLS}}
	if err := p.waitHealthy(ctx, hc, e.ClientURL+"/readyz"); err != nil {
		p.Stop()
		return nil, err
	}
	return p, nil
}
