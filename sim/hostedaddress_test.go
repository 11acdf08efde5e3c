package sim_test

import (
	"context"
	"crypto/tls"
	stdx509 "crypto/x509"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/siderolabs/crypto/x509"
	"github.com/siderolabs/talos/pkg/machinery/api/machine"
	"github.com/siderolabs/talos/pkg/machinery/client"
	"github.com/siderolabs/talos/pkg/machinery/config/generate/secrets"
	"github.com/siderolabs/talos/pkg/machinery/config/types/v1alpha1"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"k8s.io/client-go/kubernetes"

	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

// TestHostedWhereTalosSaysItIs: a hosted control plane's kube-apiserver
// answers at the machine's address and its configuration's
// cluster.controlPlane.localAPIServerPort (Talos's --secure-port), and
// moves to a new port when the configuration changes it; the client URLs
// EtcdMemberList answers with reach the etcd the API servers store in,
// with a client certificate of the etcd CA and without one refused.
func TestHostedWhereTalosSaysItIs(t *testing.T) {
	f, _ := hostedFleet(t, 2)
	answersAt := func(cp *sim.Machine, port int) {
		t.Helper()
		testenv.Eventually(t, 2*time.Minute, cp.Name()+"'s API server at port "+strconv.Itoa(port), func(ctx context.Context) (bool, error) {
			rc := f.APIConfig()
			rc.Host = "https://" + net.JoinHostPort(cp.Address(), strconv.Itoa(port))
			rc.Timeout = 5 * time.Second
			kc, err := kubernetes.NewForConfig(rc)
			if err != nil {
				return false, err
			}
			return kc.Discovery().RESTClient().Get().AbsPath("/readyz").Do(ctx).Error() == nil, nil
		})
	}
	for _, cp := range f.ControlPlanes() {
		port := cp.Config().Cluster().LocalAPIServerPort()
		if want := net.JoinHostPort(cp.Address(), strconv.Itoa(port)); cp.APIServer().Address != want {
			t.Errorf("%s's API server is at %s, want %s (its configuration's localAPIServerPort)", cp.Name(), cp.APIServer().Address, want)
		}
		answersAt(cp, port)
	}

	// A new port in the configuration moves the API server there.
	cp := f.ControlPlanes()[1]
	l, err := net.Listen("tcp", net.JoinHostPort(cp.Address(), "0"))
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	_ = l.Close()
	if _, err := newConfigApply(t, f, cp).apply(machine.ApplyConfigurationRequest_NO_REBOOT, false, func(c *v1alpha1.Config) {
		c.ClusterConfig.ControlPlane.LocalAPIServerPort = port
	}); err != nil {
		t.Fatal(err)
	}
	answersAt(cp, port)

	// The members' client URLs reach the data.
	ctx, cancel := timeout()
	defer cancel()
	resp, err := talos(t, f).EtcdMemberList(client.WithNode(ctx, f.ControlPlanes()[0].Address()), &machine.EtcdMemberListRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var urls []string
	for _, m := range resp.Messages[0].Members {
		urls = append(urls, m.ClientUrls...)
	}
	got, err := etcdClient(t, f, urls...).Get(ctx, "/registry/namespaces/default")
	if err != nil || len(got.Kvs) != 1 {
		t.Errorf("namespace default through the members' client URLs %v: %v, %v", urls, got, err)
	}

	// etcd requires a client certificate of its CA, as Talos's does.
	other, err := secrets.NewBundle(secrets.NewFixedClock(time.Now()), nil)
	if err != nil {
		t.Fatal(err)
	}
	for what, tc := range map[string]*tls.Config{
		"no client certificate":       {RootCAs: etcdRoots(t, f), MinVersion: tls.VersionTLS12},
		"a certificate of another CA": clientOf(t, other.Certs.Etcd, etcdRoots(t, f)),
	} {
		cli, err := clientv3.New(clientv3.Config{Endpoints: urls, TLS: tc, DialTimeout: 3 * time.Second, Logger: zap.NewNop()})
		if err == nil {
			_, err = cli.Get(ctx, "/registry/namespaces/default")
			_ = cli.Close()
		}
		if err == nil {
			t.Errorf("etcd answers a client with %s", what)
		}
	}
}

// etcdRoots trusts the fleet's etcd CA.
func etcdRoots(t *testing.T, f *sim.Fleet) *stdx509.CertPool {
	t.Helper()
	tc, err := f.EtcdClientTLS()
	if err != nil {
		t.Fatal(err)
	}
	return tc.RootCAs
}

// clientOf presents an etcd client certificate issued by ca.
func clientOf(t *testing.T, ca *x509.PEMEncodedCertificateAndKey, roots *stdx509.CertPool) *tls.Config {
	t.Helper()
	issuer, err := x509.NewCertificateAuthorityFromCertificateAndKey(ca)
	if err != nil {
		t.Fatal(err)
	}
	kp, err := x509.NewKeyPair(issuer, x509.CommonName("intruder"), x509.ExtKeyUsage([]stdx509.ExtKeyUsage{stdx509.ExtKeyUsageClientAuth}))
	if err != nil {
		t.Fatal(err)
	}
	pair, err := tls.X509KeyPair(kp.CrtPEM, kp.KeyPEM)
	if err != nil {
		t.Fatal(err)
	}
	return &tls.Config{Certificates: []tls.Certificate{pair}, RootCAs: roots, MinVersion: tls.VersionTLS12}
}
