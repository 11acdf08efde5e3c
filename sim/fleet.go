package sim

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/siderolabs/crypto/x509"
	clientconfig "github.com/siderolabs/talos/pkg/machinery/client/config"
	"github.com/siderolabs/talos/pkg/machinery/config"
	"github.com/siderolabs/talos/pkg/machinery/config/generate/secrets"
	"github.com/siderolabs/talos/pkg/machinery/role"
	"k8s.io/client-go/kubernetes"
)

// maxMachines is the size of a fleet's address block: 127.F.0.1 up to
// 127.F.255.250.
const maxMachines = 256 * 250

// Fleet is a running set of simulated machines.
type Fleet struct {
	spec    Spec
	ctx     context.Context
	cancel  context.CancelFunc
	wg      sync.WaitGroup
	stopped atomic.Bool

	// secrets are the fleet's: the configurations are generated from them,
	// and Talosconfig and ClientConfig mint from their Talos API CA (the
	// machines trust what their own configuration says, apiTrust).
	secrets *secrets.Bundle
	cfgs    *configs
	etcd    *etcdCluster
	rec     *Recorder
	kube    *kube
	hosting *hosting // Spec.Hosted

	machines      []*Machine
	controlPlanes []*Machine
	byName        map[string]*Machine
	byAddr        map[string]*Machine
	block         string // "127.F": the fleet's own loopback addresses
}

// Fleets in one process get distinct address blocks (127.F.x.y) from a
// random start, so two test binaries at once rarely share one either; the
// listeners bind port 0, so even a shared block cannot collide.
var (
	fleetSeq   atomic.Uint32
	octetStart = rand.IntN(254)
)

// Start starts a fleet. With a non-nil kube client every machine creates
// or adopts its Node there and plays its kubelet's part; with nil the fleet
// has no Kubernetes side. ctx bounds only the start; Stop ends the fleet.
func Start(ctx context.Context, spec Spec, kube kubernetes.Interface) (*Fleet, error) {
	spec, err := spec.validate()
	if err != nil {
		return nil, err
	}
	octet := (octetStart+int(fleetSeq.Add(1)))%254 + 1
	f := &Fleet{
		spec:   spec,
		etcd:   nil,
		rec:    newRecorder(),
		byName: map[string]*Machine{},
		byAddr: map[string]*Machine{},
		block:  fmt.Sprintf("127.%d", octet),
	}
	f.ctx, f.cancel = context.WithCancel(context.Background())
	f.etcd = newEtcd(f)
	f.cfgs = &configs{f: f, cache: map[string]config.Provider{}}
	if f.secrets, err = newSecrets(); err != nil {
		return nil, fmt.Errorf("fleet secrets: %w", err)
	}
	for i, ms := range spec.Machines {
		addr := fmt.Sprintf("%s.%d.%d", f.block, i/250, i%250+1)
		m := newMachine(f, ms, addr)
		f.machines = append(f.machines, m)
		f.byName[ms.Name] = m
		f.byAddr[addr] = m
		if ms.Role == ControlPlane {
			f.controlPlanes = append(f.controlPlanes, m)
		}
	}
	if spec.Hosted != nil {
		if err := f.startHosting(kube); err != nil {
			f.Stop()
			return nil, err
		}
	}
	if err := f.start(ctx, kube); err != nil {
		f.Stop()
		return nil, err
	}
	return f, nil
}

func (f *Fleet) start(ctx context.Context, kc kubernetes.Interface) error {
	endpoint := "https://" + f.controlPlanes[0].addr + ":6443"
	for _, m := range f.machines {
		cfg, err := f.cfgs.get(m.spec, endpoint)
		if err != nil {
			return fmt.Errorf("machine %s: %w", m.Name(), err)
		}
		m.cfg, m.persisted = cfg, cfg
	}
	for _, m := range f.controlPlanes {
		ep, err := newEndpoint(f, m)
		if err != nil {
			return err
		}
		m.ep = ep
	}
	var members []*Machine
	for _, m := range f.machines {
		if m.pending {
			// Not provisioned yet: its port stays reserved but refuses.
			if m.ep != nil {
				m.ep.close()
			}
			continue
		}
		m.boot("")
		if m.spec.Role == ControlPlane {
			members = append(members, m)
		}
	}
	if !f.spec.Unbootstrapped {
		f.etcd.bootstrapAll(members)
	}
	if f.hosting != nil {
		if err := f.waitAPIServers(ctx); err != nil {
			return err
		}
		var err error
		if kc, err = kubernetes.NewForConfig(f.hosting.kubeletConfig(f)); err != nil {
			return fmt.Errorf("client for the fleet's API endpoint: %w", err)
		}
	}
	if kc == nil {
		return nil
	}
	// The Nodes are registered once the machines run, as kubelets do.
	k, err := startKube(ctx, f, kc)
	if err != nil {
		return err
	}
	f.kube = k
	if f.hosting != nil {
		f.hosting.setKube(k)
	}
	if err := k.registerAll(ctx); err != nil {
		return err
	}
	for _, m := range f.controlPlanes {
		k.kubeProxyManifest(m)
	}
	return nil
}

// Stop stops every machine, listener and watch. It is safe to call twice.
// The Node objects stay in the API server.
func (f *Fleet) Stop() {
	if !f.stopped.CompareAndSwap(false, true) {
		return
	}
	f.cancel()
	for _, m := range f.controlPlanes {
		if m.ep != nil {
			m.ep.close()
		}
	}
	if f.kube != nil {
		f.kube.stop()
	}
	for _, m := range f.controlPlanes {
		m.components.stop()
		m.apiServer.stop()
	}
	f.wg.Wait()
	if f.hosting != nil {
		f.hosting.close()
	}
}

// Recorder is the fleet's record of what happened.
func (f *Fleet) Recorder() *Recorder { return f.rec }

// Etcd is a snapshot of the fleet's etcd model.
func (f *Fleet) Etcd() EtcdState { return f.etcd.State() }

// EtcdWrite writes a key to the simulated etcd, as a client would: it
// fails without a leader and moves the revision (to tell a restored
// snapshot from later data).
func (f *Fleet) EtcdWrite() error { return f.etcd.write() }

// Machine is the machine named name, or nil.
func (f *Fleet) Machine(name string) *Machine { return f.byName[name] }

// Machines are all machines in spec order.
func (f *Fleet) Machines() []*Machine { return append([]*Machine(nil), f.machines...) }

// ControlPlanes are the control-plane machines in spec order.
func (f *Fleet) ControlPlanes() []*Machine { return append([]*Machine(nil), f.controlPlanes...) }

// Endpoints are the Talos API listeners ("127.F.0.1:port") of the control
// planes that are part of the cluster (not waiting to join), the
// talosconfig's endpoints.
func (f *Fleet) Endpoints() []string {
	eps := make([]string, 0, len(f.controlPlanes))
	for _, m := range f.controlPlanes {
		if !m.Pending() {
			eps = append(eps, m.ep.address())
		}
	}
	return eps
}

// Join boots a machine that the spec marked Joins into the cluster, as
// adding a machine to a Talos cluster does: it boots with its
// configuration, a control plane joins etcd as a new member (once etcd has
// a leader), its kubelet registers the Node NotReady, and the Node turns
// Ready Durations.NodeReady later.
func (f *Fleet) Join(ctx context.Context, name string) error {
	m := f.byName[name]
	if m == nil {
		return fmt.Errorf("no machine %q in the fleet", name)
	}
	m.mu.Lock()
	pending := m.pending
	m.pending = false
	m.mu.Unlock()
	if !pending {
		return fmt.Errorf("machine %s is already part of the cluster: only a machine the spec marks Joins can join", name)
	}
	if f.kube != nil {
		if err := f.kube.register(ctx, m, false); err != nil {
			return fmt.Errorf("register Node %s: %w", name, err)
		}
	}
	m.boot("")
	f.logf("%s: joined the cluster", name)
	return nil
}

// Talosconfig is an os:admin talosconfig for the fleet: its context is the
// fleet's name, its endpoints the control planes' listeners.
func (f *Fleet) Talosconfig() *clientconfig.Config {
	cfg, err := f.ClientConfig(role.Admin)
	if err != nil {
		panic(err) // the admin role always mints
	}
	return cfg
}

// ClientConfig mints a talosconfig whose client certificate carries roles
// (os:reader, os:operator, os:etcd:backup, ...). No role at all is allowed:
// such a client is refused by every method.
func (f *Fleet) ClientConfig(roles ...role.Role) (*clientconfig.Config, error) {
	crt, err := f.secrets.GenerateTalosAPIClientCertificate(role.MakeSet(roles...))
	if err != nil {
		return nil, fmt.Errorf("mint client certificate for %v: %w", roles, err)
	}
	return f.clientConfigFor(crt), nil
}

func (f *Fleet) clientConfigFor(crt *x509.PEMEncodedCertificateAndKey) *clientconfig.Config {
	return clientconfig.NewConfig(f.spec.Name, f.Endpoints(), f.secrets.Certs.OS.Crt, crt)
}

// CACertificate is the PEM of the fleet's Talos API CA.
func (f *Fleet) CACertificate() []byte { return f.secrets.Certs.OS.Crt }

func (f *Fleet) logf(format string, args ...any) {
	if f.spec.Logf != nil && !f.stopped.Load() {
		f.spec.Logf("sim: "+format, args...)
	}
}

// lookup finds the machine a node metadata value names: its address
// (optionally with a port) or its hostname.
func (f *Fleet) lookup(target string) *Machine {
	if m := f.byAddr[target]; m != nil {
		return m
	}
	if m := f.byName[target]; m != nil {
		return m
	}
	if host, _, ok := cutPort(target); ok {
		return f.byAddr[host]
	}
	return nil
}

func cutPort(s string) (host, port string, ok bool) {
	i := len(s) - 1
	for i >= 0 && s[i] >= '0' && s[i] <= '9' {
		i--
	}
	if i < 0 || s[i] != ':' || i == len(s)-1 {
		return "", "", false
	}
	return s[:i], s[i+1:], true
}

// The Kubernetes and etcd PKI that configs embed takes an RSA key, slow to
// make; fleets in a process share it. Each fleet has a Talos API CA of
// its own, so clients of one fleet are strangers to another.
var shared struct {
	once   sync.Once
	bundle *secrets.Bundle
	err    error
}

func newSecrets() (*secrets.Bundle, error) {
	shared.once.Do(func() {
		shared.bundle, shared.err = secrets.NewBundle(secrets.NewClock(), config.TalosVersionCurrent)
	})
	if shared.err != nil {
		return nil, shared.err
	}
	ca, err := secrets.NewTalosCA(time.Now())
	if err != nil {
		return nil, err
	}
	b := *shared.bundle
	certs := *b.Certs
	certs.OS = &x509.PEMEncodedCertificateAndKey{Crt: ca.CrtPEM, Key: ca.KeyPEM}
	b.Certs = &certs
	b.Clock = secrets.NewClock()
	return &b, nil
}
