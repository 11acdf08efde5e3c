// Package kubeaccess keeps the controller's access to the Kubernetes API
// through a rotation of the Kubernetes CA: when the API server refuses
// the controller's own credentials (its trust in the server's certificate
// is stale: x509; or its client certificate is: 401), requests go with
// current ones the Talos API issues (a control plane's Kubeconfig), until
// the controller's own work again.
package kubeaccess

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"maesh.dev/ichor/internal/kubepki"
)

// Source fetches an admin kubeconfig through the Talos API.
type Source func(ctx context.Context) ([]byte, error)

// RetryOwn is how often, while the fallback is in use, a request tries the
// controller's own credentials first.
const RetryOwn = 30 * time.Second

// Wrap is cfg whose requests fail over to credentials from source when
// cfg's are refused. Every client made from it shares one fallback.
func Wrap(cfg *rest.Config, source Source, log logr.Logger) *rest.Config {
	f := &failover{source: source, log: log, dial: cfg.Dial, proxy: cfg.Proxy}
	out := rest.CopyConfig(cfg)
	prev := out.WrapTransport
	out.WrapTransport = func(rt http.RoundTripper) http.RoundTripper {
		if prev != nil {
			rt = prev(rt)
		}
		return &roundTripper{own: rt, f: f}
	}
	return out
}

// failover is the fallback credentials the clients share.
type failover struct {
	source Source
	log    logr.Logger
	dial   func(ctx context.Context, network, address string) (net.Conn, error)
	proxy  func(*http.Request) (*url.URL, error)

	mu       sync.Mutex
	fallback http.RoundTripper // nil while the own credentials work
	tried    time.Time         // when a request last tried the own ones
}

// use says whether a request goes with the fallback, and takes the turn
// to try the own credentials when it is due.
func (f *failover) use() http.RoundTripper {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fallback == nil || time.Since(f.tried) >= RetryOwn {
		f.tried = time.Now()
		return nil
	}
	return f.fallback
}

// ownWork records that the own credentials were accepted.
func (f *failover) ownWork() {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fallback != nil {
		f.fallback = nil
		f.log.Info("the controller's own Kubernetes credentials work again; the ones from the Talos API are no longer used")
	}
}

// renew fetches current credentials through the Talos API, unless another
// request did since stale was seen.
func (f *failover) renew(ctx context.Context, stale http.RoundTripper) (http.RoundTripper, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fallback != nil && f.fallback != stale {
		return f.fallback, nil
	}
	data, err := f.source(ctx)
	if err != nil {
		return nil, fmt.Errorf("the Kubernetes API refused the controller's credentials, and none came from the Talos API: %w", err)
	}
	rc, err := clientcmd.RESTConfigFromKubeConfig(data)
	if err != nil {
		return nil, fmt.Errorf("the kubeconfig from the Talos API: %w", err)
	}
	rc.Dial, rc.Proxy = f.dial, f.proxy // reached as the own config reaches the API
	rt, err := rest.TransportFor(rc)
	if err != nil {
		return nil, fmt.Errorf("the kubeconfig from the Talos API: %w", err)
	}
	f.log.Info("the Kubernetes API refused the controller's credentials: using an admin kubeconfig from the Talos API until they work again")
	f.fallback = rt
	return rt, nil
}

type roundTripper struct {
	own http.RoundTripper
	f   *failover
}

// RoundTrip sends req with the own credentials, or the fallback's when
// those are in use or the own are refused. The request keeps its URL (the
// API server the controller addresses; Talos's serving certificate names
// the kubernetes Service and the endpoint both); only credentials and
// trust change. A request whose body cannot be sent again is not retried.
func (r *roundTripper) RoundTrip(req *http.Request) (*http.Response, error) {
	fb := r.f.use()
	if fb == nil {
		resp, err := r.own.RoundTrip(req)
		if !refused(resp, err) || !replayable(req) {
			if err == nil && resp.StatusCode != http.StatusUnauthorized {
				r.f.ownWork()
			}
			return resp, err
		}
		discard(resp)
	}
	for attempt := 0; ; attempt++ {
		if fb == nil {
			var err error
			if fb, err = r.f.renew(req.Context(), nil); err != nil {
				return nil, err
			}
		}
		again, err := withoutAuth(req)
		if err != nil {
			return nil, err
		}
		resp, err := fb.RoundTrip(again)
		if !refused(resp, err) || attempt > 0 {
			return resp, err
		}
		// The fallback went stale too (fetched before a later stage).
		discard(resp)
		if fb, err = r.f.renew(req.Context(), fb); err != nil {
			return nil, err
		}
	}
}

// refused: the server's certificate is not trusted, or the client is not
// authenticated.
func refused(resp *http.Response, err error) bool {
	if err != nil {
		return kubepki.UntrustedServer(err)
	}
	return resp.StatusCode == http.StatusUnauthorized
}

func replayable(req *http.Request) bool {
	return req.Body == nil || req.Body == http.NoBody || req.GetBody != nil
}

// withoutAuth is req again, without the own credentials' header (the
// fallback's transport sets its own).
func withoutAuth(req *http.Request) (*http.Request, error) {
	out := req.Clone(req.Context())
	out.Header.Del("Authorization")
	if req.Body != nil && req.Body != http.NoBody {
		body, err := req.GetBody()
		if err != nil {
			return nil, err
		}
		out.Body = body
	}
	return out, nil
}

func discard(resp *http.Response) {
	if resp != nil && resp.Body != nil {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<16))
		_ = resp.Body.Close()
	}
}
