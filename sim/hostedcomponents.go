package sim

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
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
	"github.com/siderolabs/talos/pkg/machinery/constants"
	"github.com/siderolabs/talos/pkg/machinery/resources/k8s"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"sigs.k8s.io/yaml"

	"maesh.dev/ichor/internal/controlplane"
	"maesh.dev/ichor/internal/kubepki"
)

// HostedComponents says which of Talos's other control-plane static pods
// each control plane runs beside its kube-apiserver under Spec.Hosted: the
// real kube-controller-manager and kube-scheduler, rendered from its
// machine configuration as Talos renders them, reaching the API through the
// fleet's endpoint (KubePrism), one of each leading at a time (leader
// election, as on a real cluster).
type HostedComponents struct {
	// ControllerManager runs kube-controller-manager with the test world's
	// controllers (controlplane.Controllers).
	ControllerManager bool
	// Scheduler runs kube-scheduler.
	Scheduler bool
	// NodeMonitorGracePeriod, when set, adds the node-lifecycle controllers
	// (controlplane.NodeLifecycleControllers) with this grace period: every
	// Node must then renew its lease (Spec.Kubelet.NodeLease).
	NodeMonitorGracePeriod time.Duration
}

// ComponentStatus is a control plane's hosted kube-controller-manager or
// kube-scheduler.
type ComponentStatus struct {
	// Address is where it serves /healthz and /metrics (host:port, the
	// machine's address); empty when it does not run under Spec.Hosted.
	Address string
	// Ready is true while it runs and answers /healthz.
	Ready bool
	// Starts counts the times it became healthy: one more after each
	// restart (a configuration change, or after it exited).
	Starts int
}

// Component is the state of the machine's hosted kube-controller-manager
// (k8s.ControllerManagerID) or kube-scheduler (k8s.SchedulerID).
func (m *Machine) Component(id string) ComponentStatus {
	for _, c := range m.components {
		if c.pod.id == id {
			c.st.Lock()
			defer c.st.Unlock()
			return ComponentStatus{Address: c.address, Ready: c.proc != nil, Starts: c.starts}
		}
	}
	return ComponentStatus{}
}

// components are a control plane's hosted controller manager and scheduler.
type components []*component

// component is one of them, run as the kubelet runs Talos's static pod:
// started when the machine is up, restarted (stop, render, start) when the
// static pod Talos renders changes (its configuration resource or the
// secrets version), started again after a back-off when it exits (as it
// does when it loses its leader lease), stopped while the machine is down.
type component struct {
	m       *Machine
	pod     staticPod
	address string // the machine's address, a port of its own

	mu     sync.Mutex // the run in flight
	key    string     // what it was rendered from
	cancel context.CancelFunc
	done   chan struct{} // closed when the run has stopped its process
	gen    int

	st     sync.Mutex // what the run reports
	proc   *controlplane.Process
	starts int
}

// startComponents gives each control plane the components h asks for.
func (f *Fleet) startComponents(h HostedComponents) error {
	var pods []staticPod
	for _, p := range staticPodComponents {
		if p.id == k8s.ControllerManagerID && h.ControllerManager || p.id == k8s.SchedulerID && h.Scheduler {
			pods = append(pods, p)
		}
	}
	for _, m := range f.controlPlanes {
		for _, p := range pods {
			// The port stays the machine's across restarts, as 10257 would.
			l, err := net.Listen("tcp", net.JoinHostPort(m.addr, "0"))
			if err != nil {
				return fmt.Errorf("%s: find a port for %s: %w", m.Name(), p.id, err)
			}
			m.components = append(m.components, &component{m: m, pod: p, address: l.Addr().String()})
			_ = l.Close()
		}
	}
	return nil
}

func (cs components) ensure() {
	for _, c := range cs {
		c.ensure()
	}
}

// stop stops them together, as the machine's containers stop.
func (cs components) stop() {
	var wg sync.WaitGroup
	for _, c := range cs {
		wg.Go(c.stop)
	}
	wg.Wait()
}

// componentInput is what a component is rendered from: the Kubernetes
// secrets all control-plane static pods share (apiServerInput, whose
// change is a new secrets version) and the component's own configuration
// resource (its image and extraArgs: a new config version).
type componentInput struct {
	apiServerInput
	key      string
	cluster  string
	podCIDRs []string
}

func (c *component) inputs(cfg config.Provider) (componentInput, error) {
	in, err := apiServerInputs(cfg)
	if err != nil {
		return componentInput{}, err
	}
	spec, err := yaml.Marshal(c.pod.config(cfg.Cluster()).Spec())
	if err != nil {
		return componentInput{}, err
	}
	sum := sha256.Sum256(append([]byte(in.key+"|"), spec...))
	return componentInput{apiServerInput: in, key: hex.EncodeToString(sum[:]),
		cluster: cfg.Cluster().Name(), podCIDRs: cfg.Cluster().Network().PodCIDRs()}, nil
}

// ensure starts the component, or restarts it when the machine's
// configuration renders it differently; it returns at once.
func (c *component) ensure() {
	m := c.m
	if m.Down() {
		return
	}
	in, err := c.inputs(m.Config())
	if err != nil {
		m.f.logf("%s: %s: %v", m.Name(), c.pod.id, err)
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cancel != nil && c.key == in.key || m.f.ctx.Err() != nil {
		return
	}
	// The one running stops first, in the background, as the kubelet
	// replaces a static pod.
	prev := c.done
	if c.cancel != nil {
		m.f.logf("%s: %s restarts: its static pod changed", m.Name(), c.pod.id)
		c.cancel()
	}
	c.gen++
	ctx, cancel := context.WithCancel(m.f.ctx)
	done := make(chan struct{})
	c.key, c.cancel, c.done = in.key, cancel, done
	gen := c.gen
	m.f.wg.Go(func() {
		defer close(done)
		if prev != nil {
			<-prev
		}
		c.run(ctx, gen, in)
	})
}

func (c *component) stop() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.stopLocked()
}

func (c *component) stopLocked() {
	if c.cancel == nil {
		return
	}
	c.cancel()
	<-c.done
	c.cancel, c.done, c.key = nil, nil, ""
}

// run renders the component and keeps it running until ctx ends: a start
// that fails, or a process that exits, is retried after a back-off that
// doubles up to 10 seconds (the kubelet's CrashLoopBackOff, shortened).
func (c *component) run(ctx context.Context, gen int, in componentInput) {
	m, h := c.m, c.m.f.hosting
	base := filepath.Join(h.dir, m.Name())
	dir := filepath.Join(base, c.pod.id, strconv.Itoa(gen))
	defer os.RemoveAll(dir)
	args, err := c.render(dir, in)
	if err != nil {
		m.f.logf("%s: %s: %v", m.Name(), c.pod.id, err)
		return
	}
	log, err := os.OpenFile(filepath.Join(base, c.pod.id+".log"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
	if err != nil {
		m.f.logf("%s: %s log: %v", m.Name(), c.pod.id, err)
		return
	}
	defer log.Close()
	backoff := time.Second
	for ctx.Err() == nil {
		began := time.Now()
		p, err := controlplane.StartComponent(ctx, controlplane.Component{
			Name: c.pod.id, Assets: h.spec.Assets, Args: args, Address: c.address, Log: log,
		})
		if err == nil {
			backoff = time.Second
			c.running(p)
			m.f.logf("%s: %s ready in %s", m.Name(), c.pod.id, time.Since(began).Round(time.Millisecond))
			// The mirror pods follow the new static pod.
			if k := h.kubeSide(); k != nil {
				k.staticPods(m, true)
			}
			select {
			case <-p.Done():
				err = p.Unexpected()
			case <-ctx.Done():
				stopping := time.Now()
				p.StopWithin(m.f.stopGrace(false))
				m.f.logf("%s: %s stopped in %s", m.Name(), c.pod.id, time.Since(stopping).Round(time.Millisecond))
			}
			c.running(nil)
		}
		if ctx.Err() != nil {
			return
		}
		m.f.logf("%s: %s: %v; it starts again in %s (its log: %s)", m.Name(), c.pod.id, err, backoff, log.Name())
		if sleep(ctx, backoff) != nil {
			return
		}
		backoff = min(2*backoff, 10*time.Second)
	}
}

func (c *component) running(p *controlplane.Process) {
	c.st.Lock()
	defer c.st.Unlock()
	c.proc = p
	if p != nil {
		c.starts++
	}
}

// render writes the files Talos's RenderSecretsStaticPodController (and,
// for the scheduler, RenderConfigsStaticPodController) writes for the
// component into dir and returns the flags of the static pod Talos's
// ControlPlaneStaticPodController renders, its paths under dir, its
// controllers the test world's.
func (c *component) render(dir string, in componentInput) ([]string, error) {
	h := c.m.f.hosting
	host, port, err := net.SplitHostPort(c.address)
	if err != nil {
		return nil, err
	}
	kubeconfig, err := componentKubeconfig(in, constants.KubernetesControllerManagerOrganization, "https://"+h.lb.Address())
	if c.pod.id == k8s.SchedulerID {
		kubeconfig, err = componentKubeconfig(in, constants.KubernetesSchedulerOrganization, "https://"+h.lb.Address())
	}
	if err != nil {
		return nil, err
	}
	path := func(name string) string { return filepath.Join(dir, name) }
	files := map[string][]byte{"kubeconfig": kubeconfig}
	flags := map[string][]string{
		"bind-address": {host}, "secure-port": {port},
		"kubeconfig": {path("kubeconfig")}, "authentication-kubeconfig": {path("kubeconfig")},
		"authorization-kubeconfig": {path("kubeconfig")},
		"leader-elect":             {"true"}, "profiling": {"false"}, "tls-min-version": {"VersionTLS13"},
	}
	var extra []string
	switch c.pod.id {
	case k8s.ControllerManagerID:
		sa, err := (&x509.PEMEncodedKey{Key: in.saKey}).GetKey()
		if err != nil {
			return nil, fmt.Errorf("cluster.serviceAccount.key: %w", err)
		}
		files["ca.crt"], files["ca.key"], files["service-account.key"] = in.ca, in.caKey, sa.GetPrivateKeyPEM()
		for k, v := range map[string][]string{
			"allocate-node-cidrs": {"true"}, "cluster-cidr": {strings.Join(in.podCIDRs, ",")},
			"service-cluster-ip-range":  {strings.Join(in.serviceCIDRs, ",")},
			"cluster-signing-cert-file": {path("ca.crt")}, "cluster-signing-key-file": {path("ca.key")},
			"configure-cloud-routes": {"false"}, "root-ca-file": {path("ca.crt")},
			"service-account-private-key-file": {path("service-account.key")},
		} {
			flags[k] = v
		}
		extra = append([]string{"--use-service-account-credentials"}, controlplane.ControllerArgs(h.spec.Components.NodeMonitorGracePeriod)...)
	case k8s.SchedulerID:
		delete(flags, "kubeconfig") // in its configuration, as Talos renders it
		files["scheduler-config.yaml"] = []byte("apiVersion: kubescheduler.config.k8s.io/v1\nkind: KubeSchedulerConfiguration\n" +
			"clientConnection:\n  kubeconfig: " + path("kubeconfig") + "\n")
		flags["config"] = []string{path("scheduler-config.yaml")}
		flags["authentication-tolerate-lookup-failure"] = []string{"false"}
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	for name, data := range files {
		if err := os.WriteFile(path(name), data, 0o600); err != nil {
			return nil, err
		}
	}
	return append(renderArgs(flags, nil), extra...), nil
}

// componentKubeconfig is the kubeconfig Talos's secrets controller
// generates for the controller manager or the scheduler (pkg/kubeconfig's
// Generate): a client certificate from cluster.ca for user (its common
// name and organization), the server its local endpoint (KubePrism's,
// here the fleet's), trusting cluster.acceptedCAs and cluster.ca.
func componentKubeconfig(in componentInput, user, server string) ([]byte, error) {
	crt, err := kubepki.ClientCertificate(&x509.PEMEncodedCertificateAndKey{Crt: in.ca, Key: in.caKey}, user, user)
	if err != nil {
		return nil, err
	}
	name := user + "@" + in.cluster
	return clientcmd.Write(clientcmdapi.Config{
		Clusters:       map[string]*clientcmdapi.Cluster{in.cluster: {Server: server, CertificateAuthorityData: bytesJoin(in.accepted)}},
		AuthInfos:      map[string]*clientcmdapi.AuthInfo{name: {ClientCertificateData: crt.Crt, ClientKeyData: crt.Key}},
		Contexts:       map[string]*clientcmdapi.Context{"default@" + in.cluster: {Cluster: in.cluster, AuthInfo: name, Namespace: "default"}},
		CurrentContext: "default@" + in.cluster,
	})
}
