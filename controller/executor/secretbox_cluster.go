package executor

import (
	"context"
	"crypto/tls"
	stdx509 "crypto/x509"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/siderolabs/crypto/x509"
	"github.com/siderolabs/talos/pkg/machinery/config"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/talos"
)

// etcdClient is a client of the cluster's etcd at the client URLs its
// members advertise (Talos's EtcdMemberList), with a client certificate
// issued now from the etcd CA of the first control plane's configuration
// (cluster.etcd.ca), as Talos's own etcd clients have: a key rotation
// re-encrypts Secrets in etcd itself.
func etcdClient(ctx context.Context, e *Env) (*clientv3.Client, error) {
	if len(e.ControlPlanes) == 0 {
		return nil, errors.New("no control plane to reach etcd through")
	}
	first := e.ControlPlanes[0]
	var members []talos.Member
	if err := untilAnswers(ctx, func() (err error) { members, err = talos.EtcdMembers(ctx, e.Talos, first); return err }); err != nil {
		return nil, err
	}
	var urls []string
	for _, m := range members {
		urls = append(urls, m.ClientURLs...)
	}
	slices.Sort(urls)
	urls = slices.Compact(urls)
	if len(urls) == 0 {
		return nil, fmt.Errorf("the etcd members %s lists advertise no client URL", first)
	}
	mc := configMachine(e)
	mc.Node = first
	var active config.Provider
	if err := untilAnswers(ctx, func() (err error) { active, err = mc.Active(ctx); return err }); err != nil {
		return nil, configFail(err)
	}
	cfg := clientv3.Config{Endpoints: urls, DialTimeout: 10 * time.Second, Context: ctx, Logger: zap.NewNop()}
	if strings.HasPrefix(urls[0], "https://") {
		tc, err := etcdTLS(active.Cluster().Etcd().CA())
		if err != nil {
			return nil, err
		}
		cfg.TLS = tc
	}
	cli, err := clientv3.New(cfg)
	if err != nil {
		return nil, fmt.Errorf("reach etcd at %v: %w", urls, err)
	}
	return cli, nil
}

// etcdTLS trusts the etcd CA and presents a client certificate it issues
// now, for an hour.
func etcdTLS(ca *x509.PEMEncodedCertificateAndKey) (*tls.Config, error) {
	if ca == nil || len(ca.Key) == 0 {
		return nil, errors.New("the control plane's configuration has no cluster.etcd.ca with its key: etcd cannot be reached")
	}
	issuer, err := x509.NewCertificateAuthorityFromCertificateAndKey(ca)
	if err != nil {
		return nil, fmt.Errorf("cluster.etcd.ca: %w", err)
	}
	kp, err := x509.NewKeyPair(issuer, x509.CommonName("ichor-controller"), x509.Organization("ichor"),
		x509.NotBefore(time.Now().Add(-time.Minute)), x509.NotAfter(time.Now().Add(time.Hour)),
		x509.KeyUsage(stdx509.KeyUsageDigitalSignature|stdx509.KeyUsageKeyEncipherment),
		x509.ExtKeyUsage([]stdx509.ExtKeyUsage{stdx509.ExtKeyUsageClientAuth}))
	if err != nil {
		return nil, fmt.Errorf("an etcd client certificate: %w", err)
	}
	crt, err := tls.X509KeyPair(kp.CrtPEM, kp.KeyPEM)
	if err != nil {
		return nil, err
	}
	roots := stdx509.NewCertPool()
	if !roots.AppendCertsFromPEM(ca.Crt) {
		return nil, errors.New("cluster.etcd.ca: no certificate in it")
	}
	return &tls.Config{Certificates: []tls.Certificate{crt}, RootCAs: roots, MinVersion: tls.VersionTLS12}, nil
}

// everyAPIServer runs check against the kube-apiserver of every control
// plane of the operation, each at its own address, until it passes there
// or the step's deadline: what must hold cluster-wide must hold on every
// API server, not on the one the endpoint picks.
func everyAPIServer(ctx context.Context, e *Env, what string, check func(ctx context.Context, cs kubernetes.Interface) error) error {
	admin, err := adminConfig(ctx, e)
	if err != nil {
		return err
	}
	for _, m := range e.Op.Status.Machines {
		if m.Role != ichorv1.RoleControlPlane || m.Phase == ichorv1.MachineSkipped {
			continue
		}
		address, err := apiServerAddress(ctx, e, m.Name)
		if err != nil {
			return err
		}
		cs, err := kubernetes.NewForConfig(atAPIServer(admin, address))
		if err != nil {
			return err
		}
		for {
			last := check(ctx, cs)
			if last == nil {
				break
			}
			select {
			case <-ctx.Done():
				return Fail("APIServerCheckFailed", "the API server of %s (%s) does not %s: %v", m.Name, address, what, last)
			case <-time.After(time.Second):
			}
		}
	}
	return nil
}

// writeProbe is the Secret a dry-run create asks each API server about:
// whether it takes Secret writes. Nothing is ever written.
func writeProbe(e *Env) *corev1.Secret {
	return &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: e.Controller.Namespace, Name: "ichor-secret-write-probe"}}
}

// refusesWrites passes when the API server refuses a Secret write with
// the freeze's policy.
func refusesWrites(e *Env) func(ctx context.Context, cs kubernetes.Interface) error {
	return func(ctx context.Context, cs kubernetes.Interface) error {
		_, err := cs.CoreV1().Secrets(e.Controller.Namespace).Create(ctx, writeProbe(e), metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		switch {
		case err == nil:
			return fmt.Errorf("it still takes Secret writes: is the ValidatingAdmissionPolicy %s and its binding installed (manifests/policies)?", SecretWriteFreeze)
		case apierrors.IsForbidden(err) && strings.Contains(err.Error(), SecretWriteFreeze):
			return nil
		}
		return err
	}
}

// takesWrites passes when the API server takes a Secret write again.
func takesWrites(e *Env) func(ctx context.Context, cs kubernetes.Interface) error {
	return func(ctx context.Context, cs kubernetes.Interface) error {
		_, err := cs.CoreV1().Secrets(e.Controller.Namespace).Create(ctx, writeProbe(e), metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		if apierrors.IsAlreadyExists(err) {
			return nil
		}
		return err
	}
}

// readsEverySecret lists every Secret of the cluster, a page at a time,
// and counts them into n: a Secret the API server cannot decrypt fails the
// list.
func readsEverySecret(n *int) func(ctx context.Context, cs kubernetes.Interface) error {
	return func(ctx context.Context, cs kubernetes.Interface) error {
		count := 0
		opts := metav1.ListOptions{Limit: 500}
		for {
			list, err := cs.CoreV1().Secrets("").List(ctx, opts)
			if err != nil {
				return err
			}
			count += len(list.Items)
			if list.Continue == "" {
				*n = count
				return nil
			}
			opts.Continue = list.Continue
		}
	}
}

func objectKey(namespace, name string) client.ObjectKey {
	return client.ObjectKey{Namespace: namespace, Name: name}
}
