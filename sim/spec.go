package sim

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/blang/semver/v4"
	"github.com/siderolabs/talos/pkg/machinery/compatibility"
	"k8s.io/client-go/rest"
)

// Role is a machine's role in the cluster.
type Role string

// The two roles a machine can have.
const (
	ControlPlane Role = "controlplane"
	Worker       Role = "worker"
)

// Defaults used by Cluster and for empty MachineSpec fields.
const (
	DefaultTalos      = "v1.12.4"
	DefaultKubernetes = "1.35.0"
	DefaultPlatform   = "metal"
	// EmptySchematic is Image Factory's ID of the schematic without
	// customisations (talosctl's constants.ImageFactoryEmptySchematicID).
	EmptySchematic = "376567988ad370138ad8b2698212367b8edcb69b5fd68c80be1f2ec7d603b4ba"
)

// Spec describes a fleet.
type Spec struct {
	// Name is the cluster name; it prefixes the machine names Cluster makes
	// and names the talosconfig context. Default "sim".
	Name string
	// Machines, in any order. At least one must be a control plane: the
	// control planes' listeners are the Talos API endpoints.
	Machines []MachineSpec
	// Durations of the simulated steps; zero fields take DefaultDurations.
	Durations Durations
	// Unbootstrapped starts the control planes with empty etcd data, waiting
	// for a Bootstrap call, instead of as a running etcd cluster.
	Unbootstrapped bool
	// Unpublished are versions (e.g. "v1.13.70", a typo) the simulated
	// registry does not have: pulling an image tagged with one (an
	// installer, a Kubernetes component) is NotFound, as Talos answers when
	// containerd's resolver finds no such tag.
	Unpublished []string
	// Logf, when set, receives one line per notable event (sequences,
	// faults, errors of the simulated kubelet). Tests pass t.Logf.
	Logf func(format string, args ...any)
	// APIServer is the cluster's API server as its admin reaches it (host,
	// CA, credentials): a control plane's Kubeconfig call returns a
	// kubeconfig for it, and pods that run a binary reach it at its host
	// with its CA, as their ServiceAccount. Optional.
	APIServer *rest.Config
	// Kubelet says how the machines play their kubelets.
	Kubelet Kubelet
	// Hosted, when set, makes the control planes host the cluster's API:
	// each runs its own kube-apiserver, rendered from its machine
	// configuration, behind one endpoint (Fleet.APIConfig), and Start
	// takes no client (the fleet makes its own for the endpoint). Without
	// it the API server is the fixed one the client passed to Start
	// reaches.
	Hosted *Hosted
	// KubeProxy makes the control planes apply Talos's kube-proxy
	// bootstrap manifest while cluster.proxy is enabled (creating what is
	// missing, recording it in the inventory ConfigMap), as Talos does.
	KubeProxy bool
}

// Kubelet configures the machines' kubelets (see the package
// documentation, "Kubelets").
type Kubelet struct {
	// NodeLease is how long a machine's Node Lease lasts (rounded up to
	// whole seconds); the machine renews it every quarter of that while it
	// is up. Zero means no Leases: then run no node-lifecycle controller,
	// which would mark every Node NotReady. Talos's kubelets use 40s.
	NodeLease time.Duration
	// Binaries maps image patterns (path.Match syntax, like
	// "ghcr.io/maesh-dev/ichor-controller:*") to local executables: a
	// container whose image matches runs that executable as a process.
	Binaries map[string]string
	// Env is added to the environment of every such process, before the
	// container's own variables (which win), as a container runtime adds
	// its own. The processes of all pods share the host's network, where a
	// real kubelet gives each pod a network namespace of its own: tests set
	// listen addresses here (a free port, 127.0.0.1:0) so that two pods of
	// one Deployment on one machine do not both bind the same port.
	Env map[string]string
	// Dir holds the files of those processes (kubeconfig, token, output,
	// their /tmp); empty means a temporary directory that Stop removes.
	Dir string
}

// MachineSpec describes one machine.
type MachineSpec struct {
	// Name is the hostname and the Kubernetes Node name.
	Name string
	Role Role
	// Talos is the running Talos version, e.g. "v1.12.4" (the v is optional).
	Talos string
	// Kubernetes is the kubelet's (and on a control plane, the control-plane
	// components') version, e.g. "1.35.0".
	Kubernetes string
	// Schematic is the Image Factory schematic ID the machine booted from,
	// served as the "schematic" extension. Empty means the machine was not
	// booted from Image Factory: no schematic extension at all.
	Schematic string
	// Platform, as Version reports it, e.g. "metal", "aws". Default metal.
	Platform string
	// SecureBoot is reported by the COSI SecurityState resource.
	SecureBoot bool
	// ExtensionServices are extension services (e.g. "ext-iscsid") that
	// ServiceRestart accepts, as Talos accepts kubelet and extensions.
	ExtensionServices []string
	// Joins marks a machine that is not part of the cluster when the fleet
	// starts: powered off, with no Node, no etcd membership and no place
	// among the talosconfig's endpoints, until Fleet.Join boots it into the
	// cluster, as a machine being added is.
	Joins bool
}

// Durations are the simulated steps' lengths. They default to milliseconds
// so that tests run fast; the sandbox sets seconds.
type Durations struct {
	// Stop is how long a machine takes to stop its services before it goes
	// down (reboot, upgrade, shutdown, reset), after any drain.
	Stop time.Duration
	// SequenceStart is how long after answering a Reboot, Reset, Shutdown
	// or Upgrade call the machine enters the sequence's stage: Talos runs
	// the sequence in the background once the call has returned. Default 0.
	SequenceStart time.Duration
	// Reboot is how long a machine is down before it answers again.
	Reboot time.Duration
	// Install is how long the installer runs (legacy Upgrade and
	// LifecycleService.Upgrade).
	Install time.Duration
	// ImagePull is how long ImageService.Pull (and the legacy Upgrade's
	// pull) takes.
	ImagePull time.Duration
	// KubeletRestart is how long the kubelet is down after ServiceRestart or
	// a kubelet config change.
	KubeletRestart time.Duration
	// PodGrace caps how long a pod being deleted on a machine's Node lingers
	// before the machine's simulated kubelet removes it: min(the pod's own
	// grace period, PodGrace).
	PodGrace time.Duration
	// DrainTimeout bounds the drain Talos itself does in the legacy upgrade,
	// shutdown and graceful reset sequences (Talos: 10 minutes).
	DrainTimeout time.Duration
	// NodeReady is how long the Node of a joining machine stays NotReady
	// after its kubelet registers it (the CNI starting on it).
	NodeReady time.Duration
	// PodReady is how long a started container takes to become ready
	// (the pod annotation sim.ichor.maesh.dev/ready-after overrides it).
	PodReady time.Duration
	// JobPod is how long the containers of a Job's pod run when their image
	// is not one of Kubelet.Binaries (sim.ichor.maesh.dev/run-for overrides it).
	JobPod time.Duration
}

// DefaultDurations are the test defaults.
func DefaultDurations() Durations {
	return Durations{
		Stop:           5 * time.Millisecond,
		Reboot:         20 * time.Millisecond,
		Install:        10 * time.Millisecond,
		ImagePull:      5 * time.Millisecond,
		KubeletRestart: 5 * time.Millisecond,
		PodGrace:       10 * time.Millisecond,
		DrainTimeout:   10 * time.Second,
		NodeReady:      20 * time.Millisecond,
		PodReady:       10 * time.Millisecond,
		JobPod:         50 * time.Millisecond,
	}
}

func (d Durations) withDefaults() Durations {
	def := DefaultDurations()
	for _, f := range []struct{ v, def *time.Duration }{
		{&d.Stop, &def.Stop}, {&d.Reboot, &def.Reboot}, {&d.Install, &def.Install},
		{&d.ImagePull, &def.ImagePull}, {&d.KubeletRestart, &def.KubeletRestart},
		{&d.PodGrace, &def.PodGrace}, {&d.DrainTimeout, &def.DrainTimeout}, {&d.NodeReady, &def.NodeReady},
		{&d.PodReady, &def.PodReady}, {&d.JobPod, &def.JobPod},
	} {
		if *f.v <= 0 {
			*f.v = *f.def
		}
	}
	return d
}

// Cluster returns the spec of a fleet named name with controlPlanes control
// planes (name-cp-1...) and workers workers (name-w-1...), all on
// DefaultTalos and DefaultKubernetes, booted from EmptySchematic on metal.
// Change the returned machines' fields before Start to vary them.
func Cluster(name string, controlPlanes, workers int) Spec {
	if name == "" {
		name = "sim"
	}
	spec := Spec{Name: name}
	add := func(role Role, prefix string, n int) {
		for i := 1; i <= n; i++ {
			spec.Machines = append(spec.Machines, MachineSpec{
				Name:       fmt.Sprintf("%s-%s-%d", name, prefix, i),
				Role:       role,
				Talos:      DefaultTalos,
				Kubernetes: DefaultKubernetes,
				Schematic:  EmptySchematic,
				Platform:   DefaultPlatform,
			})
		}
	}
	add(ControlPlane, "cp", controlPlanes)
	add(Worker, "w", workers)
	return spec
}

// validate fills defaults in a copy of spec and reports every problem at once.
func (s Spec) validate() (Spec, error) {
	if s.Name == "" {
		s.Name = "sim"
	}
	s.Durations = s.Durations.withDefaults()
	s.Machines = append([]MachineSpec(nil), s.Machines...)
	var errs []error
	seen := map[string]bool{}
	controlPlanes, joining := 0, 0
	for i := range s.Machines {
		m := &s.Machines[i]
		if m.Name == "" {
			errs = append(errs, fmt.Errorf("machine %d has no name", i))
		} else if seen[m.Name] {
			errs = append(errs, fmt.Errorf("machine name %q is used twice: names are hostnames and Node names", m.Name))
		}
		seen[m.Name] = true
		switch m.Role {
		case ControlPlane:
			controlPlanes++
			if m.Joins {
				joining++
			}
		case Worker:
		default:
			errs = append(errs, fmt.Errorf("machine %q: role %q is neither %q nor %q", m.Name, m.Role, ControlPlane, Worker))
		}
		if m.Talos == "" {
			m.Talos = DefaultTalos
		}
		if !strings.HasPrefix(m.Talos, "v") {
			m.Talos = "v" + m.Talos
		}
		if _, err := semver.ParseTolerant(m.Talos); err != nil {
			errs = append(errs, fmt.Errorf("machine %q: Talos version %q: %w", m.Name, m.Talos, err))
		}
		if m.Kubernetes == "" {
			m.Kubernetes = DefaultKubernetes
		}
		m.Kubernetes = strings.TrimPrefix(m.Kubernetes, "v")
		if _, err := compatibility.ParseKubernetesVersion(m.Kubernetes); err != nil {
			errs = append(errs, fmt.Errorf("machine %q: Kubernetes version %q: %w", m.Name, m.Kubernetes, err))
		}
		if m.Platform == "" {
			m.Platform = DefaultPlatform
		}
		for _, svc := range m.ExtensionServices {
			if !strings.HasPrefix(svc, "ext-") {
				errs = append(errs, fmt.Errorf("machine %q: extension service %q must be named ext-<name>, as Talos names them", m.Name, svc))
			}
		}
	}
	errs = append(errs, s.Kubelet.validate()...)
	if controlPlanes == joining {
		errs = append(errs, errors.New("a fleet needs at least one control plane that does not join later: the control planes serve the Talos API endpoints"))
	}
	if len(s.Machines) > maxMachines {
		errs = append(errs, fmt.Errorf("%d machines is more than the %d a fleet's address block holds", len(s.Machines), maxMachines))
	}
	if len(errs) > 0 {
		return s, fmt.Errorf("invalid fleet spec: %w", errors.Join(errs...))
	}
	return s, nil
}
