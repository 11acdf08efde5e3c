package sim

import (
	"context"
	"crypto/sha256"
	stdx509 "crypto/x509"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/siderolabs/crypto/x509"
	"github.com/siderolabs/talos/pkg/machinery/config"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	apiserverv1 "k8s.io/apiserver/pkg/apis/apiserver/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/yaml"

	"maesh.dev/ichor/internal/controlplane"
	"maesh.dev/ichor/internal/kubepki"
)

// Hosted makes the control planes host the Kubernetes API (Spec.Hosted):
// each runs its own kube-apiserver on its own address, with the flags and
// files Talos renders from that machine's configuration, all storing in
// the etcd the control planes run (see hostedEtcd), behind one endpoint
// that balances across those that are up.
type Hosted struct {
	// Assets is the directory of the kube-apiserver, etcd and etcdutl
	// binaries (KUBEBUILDER_ASSETS).
	Assets string
	// Dir holds each API server's rendered files and log, and etcd's data
	// and log; empty means a temporary directory that Stop removes.
	Dir string
	// Components are the controller manager and scheduler each control
	// plane runs too.
	Components HostedComponents
}

// hosting is the fleet's side of Spec.Hosted: the endpoint and the admin
// credentials its clients use.
type hosting struct {
	spec   Hosted
	dir    string
	ownDir bool
	lb     *controlplane.Balancer
	admin  *x509.PEMEncodedCertificateAndKey
	ca     []byte // cluster.ca as the fleet started
	etcd   *hostedEtcd
	// port is the cluster.controlPlane.localAPIServerPort the fleet's
	// configurations start with: free on every control plane's address.
	port int
	mu   sync.Mutex
	kube *kube // set once the fleet's Kubernetes side runs
}

func newHosting(f *Fleet) (*hosting, error) {
	h := &hosting{spec: *f.spec.Hosted, dir: f.spec.Hosted.Dir, ca: f.secrets.Certs.K8s.Crt}
	if h.spec.Assets == "" {
		return nil, errors.New("sim.Spec.Hosted needs Assets (the directory of kube-apiserver and etcd, KUBEBUILDER_ASSETS)")
	}
	if h.dir == "" {
		dir, err := os.MkdirTemp("", "ichor-sim-apiserver-")
		if err != nil {
			return nil, err
		}
		h.dir, h.ownDir = dir, true
	}
	var err error
	if h.admin, err = AdminCertificate(f.secrets.Certs.K8s); err != nil {
		return nil, err
	}
	if h.etcd, err = newHostedEtcd(f, h.spec.Assets, h.dir); err != nil {
		return nil, err
	}
	if h.lb, err = controlplane.NewBalancer("127.0.0.1:0"); err != nil {
		return nil, err
	}
	return h, nil
}

// AdminCertificate is an admin client certificate from a Kubernetes CA,
// as Talos's kubeconfig generator issues it (CN admin, O system:masters).
func AdminCertificate(ca *x509.PEMEncodedCertificateAndKey) (*x509.PEMEncodedCertificateAndKey, error) {
	return kubepki.Admin(ca)
}

// config is an admin REST config for the endpoint.
func (h *hosting) config() *rest.Config {
	return &rest.Config{
		Host: "https://" + h.lb.Address(),
		TLSClientConfig: rest.TLSClientConfig{
			CAData: h.ca, CertData: h.admin.Crt, KeyData: h.admin.Key,
		},
		QPS: 1000, Burst: 2000,
	}
}

func (h *hosting) setKube(k *kube) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.kube = k
}

func (h *hosting) kubeSide() *kube {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.kube
}

func (h *hosting) close() {
	h.etcd.stop()
	h.lb.Close()
	if h.ownDir {
		_ = os.RemoveAll(h.dir)
	}
}

// waitReady waits until every control plane that booted has its API server
// ready.
func (f *Fleet) waitAPIServers(ctx context.Context) error {
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		waiting := ""
		for _, m := range f.controlPlanes {
			if m.Pending() || m.APIServer().Ready {
				continue
			}
			waiting = m.Name()
			m.apiServer.mu.Lock()
			err := m.apiServer.failed
			m.apiServer.mu.Unlock()
			if err != nil {
				return fmt.Errorf("%s: kube-apiserver: %w", m.Name(), err)
			}
		}
		if waiting == "" {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("kube-apiserver of %s is not ready (its log is in %s): %w", waiting, f.hosting.dir, ctx.Err())
		case <-tick.C:
		}
	}
}

// APIConfig is an admin REST config for the cluster's API as its clients
// reach it: Spec.APIServer, or under Spec.Hosted the fleet's endpoint with
// an admin certificate from the Kubernetes CA.
func (f *Fleet) APIConfig() *rest.Config {
	if f.hosting != nil {
		return f.hosting.config()
	}
	return rest.CopyConfig(f.spec.APIServer)
}

// FollowingAPIConfig is, under Spec.Hosted, an admin REST config for the
// fleet's endpoint whose credentials follow the control planes' Kubernetes
// CA as the kubelets' do (a client certificate from the first control
// plane's cluster.ca, trust in what any control plane accepts now): for a
// test's own look at the cluster through a Kubernetes CA rotation. Nil
// without Spec.Hosted.
func (f *Fleet) FollowingAPIConfig() *rest.Config {
	if f.hosting == nil {
		return nil
	}
	return f.hosting.kubeletConfig(f)
}

// APIServerStatus is a control plane's hosted kube-apiserver.
type APIServerStatus struct {
	// Address is where it serves (host:port); empty without Spec.Hosted.
	Address string
	// Ready is true while it runs, ready, and the endpoint balances to it.
	Ready bool
	// Starts counts the times it became ready.
	Starts int
	// LastStart is how long its last start took, from the stop of its
	// predecessor (or the machine's boot) until it was ready.
	LastStart time.Duration
}

// APIServer is the state of the machine's hosted kube-apiserver.
func (m *Machine) APIServer() APIServerStatus {
	a := m.apiServer
	if a == nil {
		return APIServerStatus{}
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	return APIServerStatus{Address: a.address, Ready: a.proc != nil, Starts: a.starts, LastStart: a.lastStart}
}

// apiServer is a control plane's kube-apiserver under Spec.Hosted, run as
// Talos runs its static pod: started when the machine is up, restarted
// (stop, render, start, wait ready) when what it is rendered from changes,
// stopped while the machine is down.
type apiServer struct {
	m       *Machine
	address string // the machine's address and its configuration's localAPIServerPort

	mu        sync.Mutex
	proc      *controlplane.Process
	cancel    context.CancelFunc // of the start in flight
	gen       int
	inputs    string // what the running (or starting) one was rendered from
	starts    int
	lastStart time.Duration
	failed    error // why the last start failed
}

func newAPIServer(m *Machine) *apiServer { return &apiServer{m: m} }

// pickAPIPort finds a port free on the address of every control plane:
// the cluster.controlPlane.localAPIServerPort of the fleet's
// configurations, where each control plane's kube-apiserver listens on
// its own address, as Talos's does on the machine's (the port is only
// probed; on an address of the fleet's block only a wildcard listener can
// take it meanwhile).
func (f *Fleet) pickAPIPort() (int, error) {
	for range 20 {
		l, err := net.Listen("tcp", net.JoinHostPort(f.controlPlanes[0].addr, "0"))
		if err != nil {
			return 0, fmt.Errorf("find a port for kube-apiserver: %w", err)
		}
		port := l.Addr().(*net.TCPAddr).Port
		free := true
		for _, m := range f.controlPlanes[1:] {
			o, err := net.Listen("tcp", net.JoinHostPort(m.addr, strconv.Itoa(port)))
			if err != nil {
				free = false
				break
			}
			_ = o.Close()
		}
		_ = l.Close()
		if free {
			return port, nil
		}
	}
	return 0, errors.New("find a port for kube-apiserver free on every control plane's address: none in 20 tries")
}

// ensure starts the API server, or restarts it when the machine's
// configuration renders it differently; it returns at once.
func (a *apiServer) ensure() {
	if a == nil {
		return
	}
	if a.m.Down() {
		return
	}
	in, err := apiServerInputs(a.m.Config())
	if err != nil {
		a.m.f.logf("%s: kube-apiserver: %v", a.m.Name(), err)
		return
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.cancel != nil && a.inputs == in.key || a.m.f.ctx.Err() != nil {
		return
	}
	began := time.Now()
	restart := a.cancel != nil
	a.stopLocked()
	// It listens where its configuration says, as Talos's does.
	a.address = net.JoinHostPort(a.m.addr, strconv.Itoa(in.port))
	a.gen++
	gen := a.gen
	ctx, cancel := context.WithCancel(a.m.f.ctx)
	a.cancel, a.inputs = cancel, in.key
	if restart {
		a.m.f.logf("%s: kube-apiserver restarts: its configuration changed", a.m.Name())
	}
	address := a.address
	a.m.f.wg.Go(func() { a.start(ctx, gen, in, address, began) })
}

// stop stops the API server (the machine goes down).
func (a *apiServer) stop() {
	if a == nil {
		return
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	a.stopLocked()
}

func (a *apiServer) stopLocked() {
	if a.cancel != nil {
		a.cancel()
		a.cancel = nil
	}
	if a.address != "" {
		a.m.f.hosting.lb.SetUp(a.address, false)
	}
	if a.proc != nil {
		began := time.Now()
		a.proc.StopWithin(a.m.f.stopGrace(true))
		a.proc = nil
		a.m.f.logf("%s: kube-apiserver stopped in %s", a.m.Name(), time.Since(began).Round(time.Millisecond))
	}
	a.inputs = ""
}

func (a *apiServer) start(ctx context.Context, gen int, in apiServerInput, address string, began time.Time) {
	m, h := a.m, a.m.f.hosting
	dir := filepath.Join(h.dir, m.Name(), strconv.Itoa(gen))
	// Its static pod restarts until etcd answers.
	if h.etcd.wait(ctx) != nil {
		return
	}
	args, err := in.render(dir, address, h.etcd.clientURL())
	if err != nil {
		m.f.logf("%s: kube-apiserver: %v", m.Name(), err)
		return
	}
	log, err := os.OpenFile(filepath.Join(h.dir, m.Name(), "kube-apiserver.log"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
	if err != nil {
		m.f.logf("%s: kube-apiserver log: %v", m.Name(), err)
		return
	}
	defer log.Close()
	// Probed as its machine's admin would be: from its own cluster.ca,
	// which it accepts whatever else it no longer does.
	probe, err := AdminCertificate(&x509.PEMEncodedCertificateAndKey{Crt: in.ca, Key: in.caKey})
	if err != nil {
		m.f.logf("%s: kube-apiserver: %v", m.Name(), err)
		return
	}
	p, err := controlplane.StartAPIServer(ctx, controlplane.APIServer{
		Assets: h.spec.Assets, Args: args, Address: address, Log: log,
		CA: in.ca, ClientCert: probe.Crt, ClientKey: probe.Key,
	})
	if err != nil {
		if ctx.Err() == nil {
			err = fmt.Errorf("%w; the end of its log:\n%s", err, logTail(log.Name()))
			m.f.logf("%s: kube-apiserver: %v", m.Name(), err)
			a.mu.Lock()
			a.failed = err
			a.mu.Unlock()
		}
		return
	}
	a.mu.Lock()
	if a.gen != gen {
		a.mu.Unlock()
		p.Stop()
		return
	}
	a.proc, a.failed = p, nil
	a.starts++
	a.lastStart = time.Since(began)
	h.lb.SetUp(address, true)
	a.mu.Unlock()
	_ = os.RemoveAll(filepath.Join(h.dir, m.Name(), strconv.Itoa(gen-1)))
	m.f.logf("%s: kube-apiserver ready on %s in %s", m.Name(), address, a.lastStart.Round(time.Millisecond))
	// The mirror pods follow the new static pod, now that the API is there.
	if k := h.kubeSide(); k != nil {
		k.staticPods(m, true)
		k.apiBack()
	}
}

// apiServerInput is what a control plane's kube-apiserver is rendered from:
// the Kubernetes part of its machine configuration that Talos's secrets
// and static-pod controllers read.
type apiServerInput struct {
	key               string // a digest of all of it: a change restarts the server
	ca                []byte // cluster.ca's certificate
	caKey             []byte
	accepted          [][]byte // cluster.acceptedCAs, then cluster.ca (Talos's order)
	saKey             []byte
	secretbox, aescbc string
	serviceCIDRs      []string
	endpoint          string
	port              int // cluster.controlPlane.localAPIServerPort
	etcdCA            *x509.PEMEncodedCertificateAndKey
}

func apiServerInputs(cfg config.Provider) (apiServerInput, error) {
	if cfg == nil || cfg.Cluster() == nil {
		return apiServerInput{}, errors.New("the machine configuration has no cluster section")
	}
	c := cfg.Cluster()
	ca, sa := c.IssuingCA(), c.ServiceAccount()
	if ca == nil || len(ca.Key) == 0 {
		return apiServerInput{}, errors.New("cluster.ca has no key: a control plane needs the Kubernetes CA's key to issue the serving certificate")
	}
	if sa == nil || len(sa.Key) == 0 {
		return apiServerInput{}, errors.New("cluster.serviceAccount.key is not set")
	}
	in := apiServerInput{
		ca: ca.Crt, caKey: ca.Key, saKey: sa.Key,
		secretbox: c.SecretboxEncryptionSecret(), aescbc: c.AESCBCEncryptionSecret(),
		serviceCIDRs: c.Network().ServiceCIDRs(), endpoint: c.Endpoint().String(),
		port: c.LocalAPIServerPort(), etcdCA: c.Etcd().CA(),
	}
	if in.etcdCA == nil || len(in.etcdCA.Key) == 0 {
		return apiServerInput{}, errors.New("cluster.etcd.ca has no key: a control plane issues kube-apiserver's etcd client certificate with it")
	}
	for _, a := range c.AcceptedCAs() {
		in.accepted = append(in.accepted, a.Crt)
	}
	in.accepted = append(in.accepted, ca.Crt)
	sum := sha256.New()
	for _, part := range append([][]byte{in.ca, in.caKey, in.saKey, []byte(in.secretbox), []byte(in.aescbc),
		[]byte(strings.Join(in.serviceCIDRs, ",")), []byte(in.endpoint), []byte(strconv.Itoa(in.port)), in.etcdCA.Crt}, in.accepted...) {
		sum.Write([]byte(strconv.Itoa(len(part)) + ":"))
		sum.Write(part)
	}
	in.key = hex.EncodeToString(sum.Sum(nil))
	return in, nil
}

// apiServerFlags are the flags of Talos's kube-apiserver static pod that
// name its secrets, under dir (Talos: /system/secrets/kubernetes/kube-apiserver).
func apiServerFlags(dir string) map[string][]string {
	return map[string][]string{
		"client-ca-file":                   {filepath.Join(dir, "ca.crt")},
		"encryption-provider-config":       {filepath.Join(dir, "encryptionconfig.yaml")},
		"service-account-key-file":         {filepath.Join(dir, "service-account.pub")},
		"service-account-signing-key-file": {filepath.Join(dir, "service-account.key")},
		"etcd-cafile":                      {filepath.Join(dir, "etcd-client-ca.crt")},
		"etcd-certfile":                    {filepath.Join(dir, "etcd-client.crt")},
		"etcd-keyfile":                     {filepath.Join(dir, "etcd-client.key")},
		"tls-cert-file":                    {filepath.Join(dir, "apiserver.crt")},
		"tls-private-key-file":             {filepath.Join(dir, "apiserver.key")},
	}
}

// render writes the files Talos's RenderSecretsStaticPodController writes
// for kube-apiserver into dir and returns the flags to run it with.
func (in apiServerInput) render(dir, address, etcd string) ([]string, error) {
	host, port, err := net.SplitHostPort(address)
	if err != nil {
		return nil, err
	}
	serving, err := servingCertificate(in, host)
	if err != nil {
		return nil, err
	}
	sa, err := (&x509.PEMEncodedKey{Key: in.saKey}).GetKey()
	if err != nil {
		return nil, fmt.Errorf("cluster.serviceAccount.key: %w", err)
	}
	enc, err := encryptionConfig(in.secretbox, in.aescbc)
	if err != nil {
		return nil, err
	}
	// Talos's secrets controller issues it from cluster.etcd.ca, named so.
	etcdClient, err := etcdClientCert(in.etcdCA, "kube-apiserver")
	if err != nil {
		return nil, err
	}
	files := map[string][]byte{
		"etcd-client-ca.crt":    in.etcdCA.Crt,
		"etcd-client.crt":       etcdClient.Crt,
		"etcd-client.key":       etcdClient.Key,
		"ca.crt":                bytesJoin(in.accepted),
		"apiserver.crt":         serving.Crt,
		"apiserver.key":         serving.Key,
		"service-account.pub":   sa.GetPublicKeyPEM(),
		"service-account.key":   in.saKey,
		"encryptionconfig.yaml": enc,
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	for name, data := range files {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o600); err != nil {
			return nil, err
		}
	}
	flags := apiServerFlags(dir)
	for k, v := range map[string][]string{
		"advertise-address": {host}, "bind-address": {host}, "secure-port": {port},
		"allow-privileged": {"true"}, "anonymous-auth": {"false"}, "api-audiences": {in.endpoint},
		"authorization-mode": {"Node,RBAC"}, "enable-admission-plugins": {"NodeRestriction"},
		"enable-bootstrap-token-auth": {"true"}, "profiling": {"false"}, "tls-min-version": {"VersionTLS12"},
		"etcd-servers": {etcd}, "service-account-issuer": {in.endpoint},
		"service-cluster-ip-range": {strings.Join(in.serviceCIDRs, ",")},
		// Loopback addresses cannot be the kubernetes Service's endpoints.
		"endpoint-reconciler-type": {"none"},
	} {
		flags[k] = v
	}
	return renderArgs(flags, nil), nil
}

// logTail is the end of a log file.
func logTail(path string) string {
	b, _ := os.ReadFile(path)
	return string(b[max(0, len(b)-1200):])
}

func bytesJoin(parts [][]byte) []byte {
	var out []byte
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}

// servingCertificate is kube-apiserver's serving certificate, issued from
// cluster.ca as Talos's KubernetesDynamicCertsController issues it, for
// the API server's own address and the endpoint's (loopback, as
// KubePrism's localhost).
func servingCertificate(in apiServerInput, host string) (*x509.PEMEncodedCertificateAndKey, error) {
	ca, err := x509.NewCertificateAuthorityFromCertificateAndKey(&x509.PEMEncodedCertificateAndKey{Crt: in.ca, Key: in.caKey})
	if err != nil {
		return nil, fmt.Errorf("cluster.ca: %w", err)
	}
	kp, err := x509.NewKeyPair(ca,
		x509.IPAddresses([]net.IP{net.ParseIP(host), net.ParseIP("127.0.0.1")}),
		x509.DNSNames([]string{"kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local", "localhost"}),
		x509.CommonName("kube-apiserver"),
		x509.Organization("kube-master"),
		x509.NotBefore(time.Now().Add(-time.Minute)),
		x509.NotAfter(time.Now().Add(365*24*time.Hour)),
		x509.KeyUsage(stdx509.KeyUsageDigitalSignature|stdx509.KeyUsageKeyEncipherment),
		x509.ExtKeyUsage([]stdx509.ExtKeyUsage{stdx509.ExtKeyUsageServerAuth}),
	)
	if err != nil {
		return nil, fmt.Errorf("kube-apiserver serving certificate: %w", err)
	}
	return &x509.PEMEncodedCertificateAndKey{Crt: kp.CrtPEM, Key: kp.KeyPEM}, nil
}

// encryptionConfig is Talos's APIServerEncryptionConfig: one
// configuration for secrets, secretbox (key2) if set, then aescbc (key1)
// if set, then identity.
func encryptionConfig(secretbox, aescbc string) ([]byte, error) {
	var providers []apiserverv1.ProviderConfiguration
	if secretbox != "" {
		providers = append(providers, apiserverv1.ProviderConfiguration{
			Secretbox: &apiserverv1.SecretboxConfiguration{Keys: []apiserverv1.Key{{Name: "key2", Secret: secretbox}}},
		})
	}
	if aescbc != "" {
		providers = append(providers, apiserverv1.ProviderConfiguration{
			AESCBC: &apiserverv1.AESConfiguration{Keys: []apiserverv1.Key{{Name: "key1", Secret: aescbc}}},
		})
	}
	providers = append(providers, apiserverv1.ProviderConfiguration{Identity: &apiserverv1.IdentityConfiguration{}})
	obj := apiserverv1.EncryptionConfiguration{
		TypeMeta:  metav1.TypeMeta{Kind: "EncryptionConfig", APIVersion: apiserverv1.SchemeGroupVersion.Version},
		Resources: []apiserverv1.ResourceConfiguration{{Resources: []string{"secrets"}, Providers: providers}},
	}
	out, err := yaml.Marshal(obj)
	if err != nil {
		return nil, fmt.Errorf("encryption configuration: %w", err)
	}
	return out, nil
}

// startHosting sets the fleet up for Spec.Hosted: the endpoint, and a
// kube-apiserver for each control plane (started as it boots).
func (f *Fleet) startHosting(kc kubernetes.Interface) error {
	if kc != nil {
		return errors.New("with sim.Spec.Hosted the fleet hosts its own API: pass Start a nil client and use Fleet.APIConfig")
	}
	if f.spec.APIServer != nil {
		return errors.New("sim.Spec.APIServer and sim.Spec.Hosted exclude each other: a hosted fleet's API server is its own")
	}
	if f.spec.Unbootstrapped {
		return errors.New("sim.Spec.Hosted needs a bootstrapped fleet: its API servers store in the control planes' etcd, which an unbootstrapped fleet does not run")
	}
	h, err := newHosting(f)
	if err != nil {
		return err
	}
	f.hosting = h
	if h.port, err = f.pickAPIPort(); err != nil {
		return err
	}
	for _, m := range f.controlPlanes {
		m.apiServer = newAPIServer(m)
	}
	if err := f.startComponents(h.spec.Components); err != nil {
		return err
	}
	f.spec.APIServer = h.config()
	return nil
}
