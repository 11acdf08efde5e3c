package main

import (
	"cmp"
	"context"
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"k8s.io/klog/v2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"

	"maesh.dev/ichor/api/compat"
	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/app"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/internal/controlplane"
	"maesh.dev/ichor/internal/testcluster"
	"maesh.dev/ichor/manifests"
	"maesh.dev/ichor/sim"
)

// The files a sandbox writes in its directory, and nothing else: Stop
// removes exactly these (and the directory once it is empty).
const (
	fileKubeconfig  = "kubeconfig"
	fileTalosconfig = "talosconfig"
	fileEnv         = "env"
	fileState       = "sandbox.json"
	fileSim         = "sim.log"
	fileKCM         = "kube-controller-manager.log"
	fileScheduler   = "kube-scheduler.log"
	fileWorkloads   = "workloads.yaml"
	// fileKustomization installs manifests/ with the controller image the
	// machines run as bin/ichor-controller.
	fileKustomization = "kustomization.yaml"
	// fileSnapshot is the etcd snapshot --demo=recovery restores from;
	// fileShutdownSnapshot the one its shutdown saves first.
	fileSnapshot         = "etcd.snapshot"
	fileShutdownSnapshot = "before-shutdown.snapshot"
	// dirPods holds the files of the pods the machines run as processes
	// (the controller's among them): kubeconfig, token and output.
	dirPods = "pods"
	// dirCharts holds the Cilium charts (Ichor's test chart), as the
	// controller image holds the one it ships.
	dirCharts = "charts"
	// dirControlPlane holds, with hosted control planes, each one's
	// kube-apiserver, kube-controller-manager and kube-scheduler files and
	// logs (<machine>/<component>.log) and etcd's data and log.
	dirControlPlane = "control-plane"
)

// sandboxDirs are the directories a sandbox makes in its directory, removed
// with what they hold.
var sandboxDirs = []string{dirPods, dirCharts, dirControlPlane}

var sandboxFiles = []string{fileKubeconfig, fileTalosconfig, fileEnv, fileState, fileSim, fileKCM, fileScheduler, fileWorkloads, fileKustomization, fileSnapshot, fileShutdownSnapshot}

// The sandbox's kubelets heartbeat as Talos's do (a 40s Node Lease), and
// the node-lifecycle controller waits Kubernetes' default 50s before it
// marks a silent machine Unknown.
const (
	nodeLease       = 40 * time.Second
	nodeGracePeriod = 50 * time.Second
)

//go:embed workloads.yaml
var workloads string

// config is what the flags set.
type config struct {
	// Root is the repository root (manifests/ and bin/ are under it).
	Root string
	// Dir holds the kubeconfig, talosconfig, env file, state and logs.
	Dir string
	// Assets is the directory of kube-apiserver, etcd, kube-controller-manager
	// and kube-scheduler (KUBEBUILDER_ASSETS).
	Assets string
	// Kubectl is the real kubectl that applies the manifests (and runs the demo).
	Kubectl string
	// Controller is the ichor-controller binary the controller's pods (and
	// the Jobs it starts) run: bin/ichor-controller of make build.
	Controller string
	// Images maps more images to binaries the machines run them as, like
	// a second build of ichor-controller to upgrade to (--image).
	Images map[string]string

	Name                   string
	ControlPlanes, Workers int
	Talos, Kubernetes      string
	// TalosOn maps machines to the Talos version they run instead of Talos
	// (--talos-on), like one machine left behind on an older release.
	TalosOn map[string]string
	// Cilium installs the user's Cilium (userCilium); without it the CNI is
	// left to Talos.
	Cilium bool
	// Pace is the length of the shortest simulated step; the others are
	// multiples of it (a reboot takes 3, an install 2).
	Pace time.Duration
	// Hosted makes the control planes host the cluster as on Talos: each
	// runs its own kube-apiserver, kube-controller-manager and
	// kube-scheduler rendered from its machine configuration, and etcd
	// belongs to them (sim.Spec.Hosted). Off, one fixed API server, etcd,
	// controller manager and scheduler run beside the machines.
	Hosted bool
	// Stdout receives kubectl's output while the sandbox starts.
	Stdout io.Writer
}

func (c config) validate() error {
	var errs []error
	if c.ControlPlanes < 1 {
		errs = append(errs, fmt.Errorf("--control-planes %d: a cluster needs at least one control plane", c.ControlPlanes))
	}
	if c.Workers < 1 {
		errs = append(errs, fmt.Errorf("--workers %d: use 1 or more (the controller's pods run on workers; control planes are tainted NoSchedule)", c.Workers))
	}
	if c.Pace <= 0 {
		errs = append(errs, fmt.Errorf("--pace %s: use a positive duration, like 1s", c.Pace))
	}
	if !isExecutable(c.Controller) {
		errs = append(errs, fmt.Errorf("no ichor-controller at %s: run `make build` (make sandbox does), or point --controller at one", c.Controller))
	}
	names := map[string]bool{}
	for _, m := range sim.Cluster(c.Name, c.ControlPlanes, c.Workers).Machines {
		names[m.Name] = true
	}
	for name := range c.TalosOn {
		if !names[name] {
			errs = append(errs, fmt.Errorf("--talos-on %s: no such machine: they are %s-cp-1 ... %s-cp-%d and %s-w-1 ... %s-w-%d",
				name, c.Name, c.Name, c.ControlPlanes, c.Name, c.Name, c.Workers))
		}
	}
	for image, bin := range c.Images {
		if !isExecutable(bin) {
			errs = append(errs, fmt.Errorf("--image %s=%s: not an executable file", image, bin))
		}
	}
	if c.Assets == "" {
		errs = append(errs, errors.New("KUBEBUILDER_ASSETS is not set: run `make sandbox`, or `KUBEBUILDER_ASSETS=$(make -s envtest-assets) go run ./hack/sandbox`"))
	} else {
		for _, bin := range []string{"kube-apiserver", "etcd", "kube-controller-manager", "kube-scheduler"} {
			if _, err := os.Stat(filepath.Join(c.Assets, bin)); err != nil {
				errs = append(errs, fmt.Errorf("no %s in KUBEBUILDER_ASSETS=%s: run `make envtest-assets`", bin, c.Assets))
			}
		}
	}
	return errors.Join(errs...)
}

// durations are the simulated steps at the sandbox's pace: seconds by
// default, so that a person can follow an upgrade machine by machine.
func durations(pace time.Duration) sim.Durations {
	return sim.Durations{
		Stop:           pace,
		Reboot:         3 * pace,
		Install:        2 * pace,
		ImagePull:      pace,
		KubeletRestart: pace,
		PodGrace:       pace,
		DrainTimeout:   60 * pace,
		PodReady:       pace,
		JobPod:         2 * pace,
	}
}

// fleetSpec is the simulated cluster the flags describe, its kubelets
// running pods of image (the controller's) as the controller binary, and
// those of --image as theirs, with their files under dir.
func (c config) fleetSpec(image, dir string, logf func(string, ...any)) sim.Spec {
	spec := sim.Cluster(c.Name, c.ControlPlanes, c.Workers)
	for i := range spec.Machines {
		spec.Machines[i].Talos = cmp.Or(c.TalosOn[spec.Machines[i].Name], c.Talos)
		spec.Machines[i].Kubernetes = c.Kubernetes
	}
	spec.Durations = durations(c.Pace)
	spec.Logf = logf
	spec.Kubelet.NodeLease = nodeLease
	spec.Kubelet.Binaries = map[string]string{image: c.Controller}
	for img, bin := range c.Images {
		spec.Kubelet.Binaries[img] = bin
	}
	spec.Kubelet.Env = testcluster.ProcessEnv()
	// Talos applies kube-proxy, as it does by default; Cilium runs beside
	// it until a switch to kube-proxy replacement.
	spec.KubeProxy = true
	spec.Kubelet.Dir = dir
	return spec
}

func isExecutable(path string) bool {
	st, err := os.Stat(path)
	return err == nil && !st.IsDir() && st.Mode()&0o111 != 0
}

// Sandbox is a running sandbox: API server, fleet and controller.
type Sandbox struct {
	cfg config
	env *envtest.Environment
	// Admin is a cluster-admin REST config; Client a client with it.
	Admin  *rest.Config
	Client client.Client
	Fleet  *sim.Fleet
	// ControllerManager and Scheduler are the real kube-controller-manager
	// and kube-scheduler.
	ControllerManager, Scheduler *controlplane.Process
	// Version is the controller binary's version, and Image the image its
	// Deployment runs: the release image at that version.
	Version, Image string
	// userChart is the Cilium chart the user installed, shippedChart the
	// one the controller moves it to (both Ichor's test chart).
	userChart, shippedChart compat.ChartPin

	simLog   *os.File
	logs     []*os.File
	wrote    []string
	stopOnce sync.Once
}

// state is sandbox.json: where things listen, for scripts and for a second
// sandbox to tell that this one is still running.
type state struct {
	PID        int      `json:"pid"`
	APIServer  string   `json:"apiServer"`
	Etcd       string   `json:"etcd"`
	TalosAPI   []string `json:"talosAPI"`
	Kubeconfig string   `json:"kubeconfig"`
}

// Path is the path of one of the sandbox's files.
func (s *Sandbox) Path(name string) string { return filepath.Join(s.cfg.Dir, name) }

// Start brings a sandbox up; on error it has already cleaned up after itself.
func Start(ctx context.Context, cfg config) (_ *Sandbox, err error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	s := &Sandbox{cfg: cfg}
	if err := s.claimDir(); err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			s.Stop()
		}
	}()
	if err := s.openLog(); err != nil {
		return nil, err
	}
	if err := s.controllerImage(ctx); err != nil {
		return nil, err
	}
	if err := s.writeCharts(); err != nil {
		return nil, err
	}
	if err := s.startCluster(ctx); err != nil {
		return nil, err
	}
	if err := s.giveTalosconfig(ctx); err != nil {
		return nil, err
	}
	if cfg.Cilium {
		if err := s.installCilium(ctx); err != nil {
			return nil, err
		}
	}
	if err := s.startWorkloads(ctx); err != nil {
		return nil, err
	}
	if err := s.waitController(ctx); err != nil {
		return nil, err
	}
	return s, s.writeState()
}

// claimDir creates the directory, refusing one that a live sandbox uses
// and removing what a dead one left behind.
func (s *Sandbox) claimDir() error {
	if b, err := os.ReadFile(s.Path(fileState)); err == nil {
		var st state
		if json.Unmarshal(b, &st) == nil && st.PID > 0 && st.PID != os.Getpid() && alive(st.PID) {
			return fmt.Errorf("a sandbox (pid %d) is already running with its files in %s: use it, or stop it with Ctrl-C in its terminal (kill -INT %d)", st.PID, s.cfg.Dir, st.PID)
		}
	}
	for _, f := range sandboxFiles {
		_ = os.Remove(s.Path(f))
	}
	for _, d := range sandboxDirs {
		_ = os.RemoveAll(s.Path(d))
	}
	if err := os.MkdirAll(s.cfg.Dir, 0o700); err != nil {
		return fmt.Errorf("sandbox directory: %w", err)
	}
	// Claim it before the slow start, so that a second sandbox is refused at once.
	return s.write(fileState, []byte(fmt.Sprintf(`{"pid":%d}`+"\n", os.Getpid())), 0o600)
}

func alive(pid int) bool {
	p, err := os.FindProcess(pid)
	return err == nil && p.Signal(syscall.Signal(0)) == nil
}

func (s *Sandbox) write(name string, data []byte, mode os.FileMode) error {
	if err := os.WriteFile(s.Path(name), data, mode); err != nil {
		return err
	}
	s.remember(name)
	return nil
}

func (s *Sandbox) remember(name string) {
	for _, w := range s.wrote {
		if w == name {
			return
		}
	}
	s.wrote = append(s.wrote, name)
}

func (s *Sandbox) createLog(name string) (*os.File, error) {
	f, err := os.OpenFile(s.Path(name), os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600)
	if err != nil {
		return nil, err
	}
	s.remember(name)
	s.logs = append(s.logs, f)
	return f, nil
}

// openLog creates sim.log, where the machines log what happens to them and
// where the clients of this process (envtest's, the fleet's) log too.
func (s *Sandbox) openLog() error {
	f, err := s.createLog(fileSim)
	if err != nil {
		return err
	}
	s.simLog = f
	log := zap.New(zap.WriteTo(f), zap.UseDevMode(true))
	ctrl.SetLogger(log)
	klog.SetLogger(log)
	return nil
}

// startCluster starts the API, Ichor's manifests in it, and the machines:
// with hosted control planes the machines first (they run the API), else
// the fixed API server and components, then the machines.
func (s *Sandbox) startCluster(ctx context.Context) error {
	if s.cfg.Hosted {
		if err := s.startHostedFleet(ctx); err != nil {
			return err
		}
		return s.install(ctx)
	}
	if err := s.startAPIServer(); err != nil {
		return err
	}
	if err := s.install(ctx); err != nil {
		return err
	}
	if err := s.startControlPlane(ctx); err != nil {
		return err
	}
	return s.startFleet(ctx)
}

// startAPIServer starts etcd and kube-apiserver (both on loopback: envtest
// binds them to 127.0.0.1) and writes an admin kubeconfig.
func (s *Sandbox) startAPIServer() error {
	s.env = &envtest.Environment{BinaryAssetsDirectory: s.cfg.Assets, ControlPlaneStartTimeout: controlplane.StartTimeout}
	controlplane.ServiceCIDRArg(s.env)
	cfg, err := s.env.Start()
	if err != nil {
		s.env = nil
		return fmt.Errorf("start kube-apiserver and etcd from %s: %w", s.cfg.Assets, err)
	}
	cfg.QPS, cfg.Burst = 200, 400
	s.Admin = cfg
	if s.Client, err = client.New(cfg, client.Options{Scheme: app.Scheme}); err != nil {
		return err
	}
	admin, err := s.env.AddUser(envtest.User{Name: "ichor-sandbox-admin", Groups: []string{"system:masters"}}, nil)
	if err != nil {
		return fmt.Errorf("admin user: %w", err)
	}
	kc, err := admin.KubeConfig()
	if err != nil {
		return err
	}
	if kc, err = renameContext(kc, kubeContext); err != nil {
		return err
	}
	return s.write(fileKubeconfig, kc, 0o600)
}

// kubeContext names the kubeconfig's cluster, user and context.
const kubeContext = "ichor-sandbox"

// renameContext names the kubeconfig's cluster, user and context after the
// sandbox, so that it reads well in `kubectl config get-contexts`.
func renameContext(data []byte, name string) ([]byte, error) {
	kc, err := clientcmd.Load(data)
	if err != nil {
		return nil, fmt.Errorf("read envtest's kubeconfig: %w", err)
	}
	ctx := kc.Contexts[kc.CurrentContext]
	if ctx == nil {
		return nil, errors.New("envtest's kubeconfig has no current context")
	}
	cluster, user := kc.Clusters[ctx.Cluster], kc.AuthInfos[ctx.AuthInfo]
	kc.Clusters = map[string]*clientcmdapi.Cluster{name: cluster}
	kc.AuthInfos = map[string]*clientcmdapi.AuthInfo{name: user}
	ctx.Cluster, ctx.AuthInfo, ctx.Namespace = name, name, metav1.NamespaceDefault
	kc.Contexts = map[string]*clientcmdapi.Context{name: ctx}
	kc.CurrentContext = name
	return clientcmd.Write(*kc)
}

// controllerImage reads the controller binary's version: its Deployment
// runs the release image of that version, which the machines run as the
// binary.
func (s *Sandbox) controllerImage(ctx context.Context) error {
	out, err := exec.CommandContext(ctx, s.cfg.Controller, "version").Output()
	if err != nil {
		return fmt.Errorf("%s version: %w", s.cfg.Controller, err)
	}
	s.Version = strings.TrimSpace(string(out))
	s.Image = executor.ReleaseImage + ":" + s.Version
	return nil
}

// install applies manifests/ with the real kubectl, as an admin installs
// Ichor into a cluster, and waits until the CRD is served. A kustomization
// in the sandbox's directory over manifests/ sets the controller's image
// to the one the machines run as the controller binary, and points it at
// the sandbox's charts (where the image has the one it ships).
func (s *Sandbox) install(ctx context.Context) error {
	dir, err := filepath.Abs(s.cfg.Dir)
	if err != nil {
		return fmt.Errorf("install Ichor: %w", err)
	}
	base, err := filepath.Rel(dir, filepath.Join(s.cfg.Root, "manifests"))
	if err != nil {
		return fmt.Errorf("install Ichor: %w", err)
	}
	kustomization := fmt.Sprintf(`resources:
  - %s
images:
  - name: %s
    newTag: %s
patches:
  - target: {kind: Deployment, name: %s}
    patch: |-
      - {op: add, path: /spec/template/spec/containers/0/args/-, value: %q}
      - {op: add, path: /spec/template/spec/containers/0/args/-, value: %q}
`, base, executor.ReleaseImage, s.Version, manifests.Deployment, "--chart-dir="+s.Path(dirCharts), "--chart-digest="+s.shippedChart.Digest)
	if err := s.write(fileKustomization, []byte(kustomization), 0o600); err != nil {
		return err
	}
	if _, err := s.kubectl(ctx, "apply", "--server-side", "-k", dir); err != nil {
		return fmt.Errorf("install Ichor: %w", err)
	}
	_, err = s.kubectl(ctx, "wait", "--for=condition=Established", "--timeout=60s", "crd/talosoperations.ichor.maesh.dev")
	return err
}

// kubectl runs the real kubectl with the sandbox's kubeconfig, copying its
// output to cfg.Stdout.
func (s *Sandbox) kubectl(ctx context.Context, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, s.cfg.Kubectl, args...)
	cmd.Env = append(os.Environ(), "KUBECONFIG="+s.Path(fileKubeconfig))
	var out, errOut strings.Builder
	cmd.Stdout, cmd.Stderr = io.MultiWriter(&out, s.cfg.Stdout), &errOut
	if err := cmd.Run(); err != nil {
		return out.String(), fmt.Errorf("kubectl %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(errOut.String()))
	}
	return out.String(), nil
}

// startControlPlane starts the real kube-controller-manager (node
// lifecycle included: the machines renew their Node Leases) and
// kube-scheduler against the API server, each logging to a file.
func (s *Sandbox) startControlPlane(ctx context.Context) error {
	o := controlplane.Options{
		Assets:                 s.cfg.Assets,
		Kubeconfig:             s.Path(fileKubeconfig),
		ServiceAccountKey:      filepath.Join(s.env.ControlPlane.APIServer.CertDir, "sa-signer.key"),
		NodeMonitorGracePeriod: nodeGracePeriod,
	}
	var err error
	if o.Log, err = s.createLog(fileKCM); err != nil {
		return err
	}
	if s.ControllerManager, err = controlplane.StartControllerManager(ctx, o); err != nil {
		return fmt.Errorf("%w (see %s)", err, s.Path(fileKCM))
	}
	if o.Log, err = s.createLog(fileScheduler); err != nil {
		return err
	}
	if s.Scheduler, err = controlplane.StartScheduler(ctx, o); err != nil {
		return fmt.Errorf("%w (see %s)", err, s.Path(fileScheduler))
	}
	return nil
}

// webReadyPaces is how many paces web's pods take to become Ready.
const webReadyPaces = 10

// startWorkloads applies workloads.yaml with the real kubectl, as an
// operator's cluster would have them, and waits until they are Ready.
func (s *Sandbox) startWorkloads(ctx context.Context) error {
	// web's replacements take longer to be Ready than a drain takes to ask
	// again, so its budget visibly holds a drain back (and is not already
	// satisfied again by the time the next eviction comes).
	manifest := strings.NewReplacer("WEB_READY_AFTER", (webReadyPaces * s.cfg.Pace).String(),
		"READY_AFTER", s.cfg.Pace.String()).Replace(workloads)
	if err := s.write(fileWorkloads, []byte(manifest), 0o600); err != nil {
		return err
	}
	if _, err := s.kubectl(ctx, "apply", "-f", s.Path(fileWorkloads)); err != nil {
		return fmt.Errorf("start the workloads: %w", err)
	}
	for _, w := range []string{"deployment/web", "daemonset/node-agent", "statefulset/db"} {
		if _, err := s.kubectl(ctx, "rollout", "status", "--timeout=2m", "-n", metav1.NamespaceDefault, w); err != nil {
			return fmt.Errorf("the workloads did not become Ready: %w", err)
		}
	}
	_, err := s.kubectl(ctx, "wait", "--for=condition=Ready", "--timeout=2m", "-n", metav1.NamespaceDefault, "pod/debug")
	return err
}

// startFleet starts the simulated machines (their Nodes appear in the
// fixed API server).
func (s *Sandbox) startFleet(ctx context.Context) error {
	kube, err := kubernetes.NewForConfig(s.Admin)
	if err != nil {
		return err
	}
	spec := s.cfg.fleetSpec(s.Image, s.Path(dirPods), s.logf())
	spec.APIServer = s.Admin
	if s.Fleet, err = sim.Start(ctx, spec, kube); err != nil {
		return fmt.Errorf("start the simulated machines: %w", err)
	}
	return nil
}

// startHostedFleet starts the simulated machines with their control planes
// hosting the cluster (config.Hosted): each one's kube-apiserver,
// kube-controller-manager (node lifecycle included: the machines renew
// their Node Leases) and kube-scheduler, their etcd, behind one endpoint;
// then writes an admin kubeconfig for that endpoint.
func (s *Sandbox) startHostedFleet(ctx context.Context) error {
	spec := s.cfg.fleetSpec(s.Image, s.Path(dirPods), s.logf())
	spec.Hosted = &sim.Hosted{Assets: s.cfg.Assets, Dir: s.Path(dirControlPlane), Components: sim.HostedComponents{
		ControllerManager: true, Scheduler: true, NodeMonitorGracePeriod: nodeGracePeriod,
	}}
	var err error
	if s.Fleet, err = sim.Start(ctx, spec, nil); err != nil {
		return fmt.Errorf("start the simulated machines: %w (their logs: %s)", err, relative(s.Path(dirControlPlane)))
	}
	cfg := s.Fleet.APIConfig()
	cfg.QPS, cfg.Burst = 200, 400
	s.Admin = cfg
	if s.Client, err = client.New(cfg, client.Options{Scheme: app.Scheme}); err != nil {
		return err
	}
	kc, err := clientcmd.Write(clientcmdapi.Config{
		Clusters:       map[string]*clientcmdapi.Cluster{kubeContext: {Server: cfg.Host, CertificateAuthorityData: cfg.CAData}},
		AuthInfos:      map[string]*clientcmdapi.AuthInfo{kubeContext: {ClientCertificateData: cfg.CertData, ClientKeyData: cfg.KeyData}},
		Contexts:       map[string]*clientcmdapi.Context{kubeContext: {Cluster: kubeContext, AuthInfo: kubeContext, Namespace: metav1.NamespaceDefault}},
		CurrentContext: kubeContext,
	})
	if err != nil {
		return err
	}
	return s.write(fileKubeconfig, kc, 0o600)
}

// logf writes a line to sim.log, where the machines log.
func (s *Sandbox) logf() func(string, ...any) {
	var mu sync.Mutex
	return func(format string, args ...any) {
		mu.Lock()
		defer mu.Unlock()
		fmt.Fprintf(s.simLog, "%s %s\n", time.Now().Format(time.RFC3339Nano), fmt.Sprintf(format, args...))
	}
}

// giveTalosconfig writes the machines' talosconfig and gives it to the
// controller the way the README tells an admin to: kubectl create secret.
func (s *Sandbox) giveTalosconfig(ctx context.Context) error {
	tc, err := s.Fleet.Talosconfig().Bytes()
	if err != nil {
		return fmt.Errorf("talosconfig: %w", err)
	}
	if err := s.write(fileTalosconfig, tc, 0o600); err != nil {
		return err
	}
	_, err = s.kubectl(ctx, "create", "secret", "generic", ichorv1.TalosconfigSecret, "-n", ichorv1.DefaultNamespace,
		"--from-file="+ichorv1.TalosconfigKey+"="+s.Path(fileTalosconfig))
	return err
}

// waitController waits until the controller's Deployment has rolled out
// (its pods run on the machines as the controller binary, each as the
// Deployment's ServiceAccount) and one of them leads, its version on the
// leader Lease.
func (s *Sandbox) waitController(ctx context.Context) error {
	logs := filepath.Join(relative(s.Path(dirPods)), ichorv1.DefaultNamespace+"_"+manifests.Deployment+"-*", manifests.Container+".log")
	if _, err := s.kubectl(ctx, "rollout", "status", "--timeout=2m", "-n", ichorv1.DefaultNamespace, "deployment/"+manifests.Deployment); err != nil {
		return fmt.Errorf("ichor-controller's pods did not become Ready: %w (their logs: %s)", err, logs)
	}
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	err := wait.PollUntilContextCancel(ctx, 50*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		var lease coordinationv1.Lease
		if err := s.Client.Get(ctx, client.ObjectKey{Namespace: ichorv1.DefaultNamespace, Name: ichorv1.LeaderLeaseName}, &lease); err != nil {
			return false, client.IgnoreNotFound(err)
		}
		return lease.Annotations[ichorv1.VersionAnnotation] == s.Version, nil
	})
	if err != nil {
		return fmt.Errorf("no ichor-controller %s took the leader Lease: %w (their logs: %s)", s.Version, err, logs)
	}
	return nil
}

func (s *Sandbox) writeState() error {
	etcd := s.Fleet.HostedEtcd().ClientURL
	if s.env != nil {
		etcd = s.env.ControlPlane.Etcd.URL.String()
	}
	st := state{
		PID:        os.Getpid(),
		APIServer:  s.Admin.Host,
		Etcd:       etcd,
		TalosAPI:   s.Fleet.Endpoints(),
		Kubeconfig: s.Path(fileKubeconfig),
	}
	b, err := json.MarshalIndent(st, "", "  ")
	if err != nil {
		return err
	}
	if err := s.write(fileState, append(b, '\n'), 0o600); err != nil {
		return err
	}
	env := fmt.Sprintf("# Use the Ichor sandbox: source %s\nexport KUBECONFIG=%s\nexport TALOSCONFIG=%s\nexport PATH=%s:\"$PATH\"\n",
		s.Path(fileEnv), shellQuote(s.Path(fileKubeconfig)), shellQuote(s.Path(fileTalosconfig)), shellQuote(filepath.Join(s.cfg.Root, "bin")))
	return s.write(fileEnv, []byte(env), 0o600)
}

func shellQuote(s string) string {
	if strings.ContainsAny(s, " \t\n'\"\\$`") {
		return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
	}
	return s
}

// Stop stops the fleet (and with it the processes of its pods, the
// controller's, and with hosted control planes theirs), kube-scheduler,
// kube-controller-manager, kube-apiserver and etcd, in that order, and removes the files the sandbox wrote. It is safe
// to call twice.
func (s *Sandbox) Stop() {
	s.stopOnce.Do(func() {
		if s.Fleet != nil {
			s.Fleet.Stop()
		}
		for _, p := range []*controlplane.Process{s.Scheduler, s.ControllerManager} {
			if p != nil {
				p.Stop()
			}
		}
		if s.env != nil {
			if err := s.env.Stop(); err != nil {
				fmt.Fprintln(os.Stderr, "sandbox: stop kube-apiserver and etcd:", err)
			}
		}
		for _, f := range s.logs {
			_ = f.Close()
		}
		for _, name := range s.wrote {
			_ = os.Remove(s.Path(name))
		}
		for _, d := range sandboxDirs {
			_ = os.RemoveAll(s.Path(d))
		}
		_ = os.Remove(s.cfg.Dir) // only if empty: files of the user's stay
	})
}

// relative shortens path for printing when it is under the working directory.
func relative(path string) string {
	wd, err := os.Getwd()
	if err != nil {
		return path
	}
	if rel, err := filepath.Rel(wd, path); err == nil && !strings.HasPrefix(rel, "..") {
		return rel
	}
	return path
}
