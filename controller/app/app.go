// Package app wires ichor-controller: a controller-runtime manager with
// leader election, metrics and health probes, and the reconcilers. main.go
// and the integration tests start the controller through it, so the tests
// run exactly what ships.
package app

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	talosclient "github.com/siderolabs/talos/pkg/machinery/client"
	"google.golang.org/grpc"
	appsv1 "k8s.io/api/apps/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/selection"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	"k8s.io/client-go/kubernetes"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	toolscache "k8s.io/client-go/tools/cache"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/healthz"
	"sigs.k8s.io/controller-runtime/pkg/manager"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	"maesh.dev/ichor/api/compat"
	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/cilium"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/controller/kubeaccess"
	"maesh.dev/ichor/controller/lock"
	"maesh.dev/ichor/controller/membership"
	"maesh.dev/ichor/controller/operation"
	"maesh.dev/ichor/controller/talos"
)

// Scheme knows the built-in types and TalosOperation.
var Scheme = runtime.NewScheme()

func init() {
	utilruntime.Must(clientgoscheme.AddToScheme(Scheme))
	utilruntime.Must(ichorv1.AddToScheme(Scheme))
}

// Options configure the controller.
type Options struct {
	// Namespace is where the controller keeps its lock Lease, leader Lease
	// and reads the talosconfig Secret.
	Namespace string
	// MetricsAddr and ProbeAddr are listen addresses; "0" disables.
	MetricsAddr string
	ProbeAddr   string
	// PprofAddr serves net/http/pprof's profiles when set ("" or "0"
	// disables): the benchmarks take the controller's heap profile there.
	PprofAddr string
	// LeaderElection turns on leader election (on in production).
	LeaderElection bool
	// LeaseDuration, RenewDeadline and RetryPeriod tune leader election;
	// zero keeps controller-runtime's defaults.
	LeaseDuration, RenewDeadline, RetryPeriod time.Duration
	// StepTimeout bounds steps that set none.
	StepTimeout time.Duration
	// Version is reported on the leader Lease.
	Version string
	// Executors overrides the kinds carried out (tests); nil means executor.Default().
	Executors executor.Registry
	Log       logr.Logger
	// TalosDialOptions are added to the Talos client's gRPC dial options.
	// Tests dial through a switch they cut to kill a controller hard, and
	// watch the calls it makes.
	TalosDialOptions []grpc.DialOption
	// TestHookAfterRun is operation.Reconciler.TestHookAfterRun: called
	// after a Run step returns, before status records it. Nil in production.
	TestHookAfterRun func(operation.StepRun)
	// Image is the controller's own image, which the cni kind's Job runs
	// (main.go reads it from the controller's pod).
	Image string
	// ChartDir is where the Cilium chart is (default cilium.ChartDir, the
	// image's), and CiliumChart its pin (default the compatibility table's):
	// tests and the sandbox point them at the test chart.
	ChartDir    string
	CiliumChart *compat.ChartPin
	// Pod is the controller's own pod, "namespace/name" (main.go reads it
	// as OwnPod does; empty outside a pod): a drain evicts it last.
	Pod string
	// Node is the Node the controller's pod runs on (main.go reads
	// $NODE_NAME, the downward API's spec.nodeName): a shutdown takes it
	// last among the workers.
	Node string
	// HandoverDir is where an etcd restore's takeover keeps its hand-over
	// file (default os.TempDir(): the Deployment mounts an emptyDir
	// there, which outlives the container).
	HandoverDir string
}

// Variables that set the listen addresses when the flags do not. The
// Deployment sets neither (a pod has its own network, where :8080 is free);
// the simulated kubelet, whose pods share the host's, sets them to a free
// port so that a rollout's old and new pods can run on one machine.
const (
	MetricsAddrEnv = "ICHOR_METRICS_BIND_ADDRESS"
	ProbeAddrEnv   = "ICHOR_HEALTH_PROBE_BIND_ADDRESS"
)

// Controller is ichor-controller: a manager with every reconciler
// registered, and beside it the etcd restore's takeover, which works while
// the API is gone.
type Controller struct {
	cfg      *rest.Config
	o        Options
	takeover *executor.Takeover
	elected  chan struct{}
	// conn is the Talos connector of the manager built last, where every
	// client's refused Kubernetes credentials are replaced (kubeaccess).
	conn atomic.Pointer[talos.Connector]
}

// New prepares the controller. The manager is built when it starts: a
// manager needs the API to build (its cache maps the kinds it watches),
// and a takeover that a killed controller left has to resume first,
// without it.
func New(cfg *rest.Config, o Options) (*Controller, error) {
	if o.Namespace == "" {
		o.Namespace = ichorv1.DefaultNamespace
	}
	if o.Executors == nil {
		o.Executors = executor.Default()
	}
	c := &Controller{o: o, elected: make(chan struct{})}
	// Every client, the manager's and the takeover's, keeps its access
	// through a Kubernetes CA rotation: on refused credentials, an admin
	// kubeconfig from the Talos API.
	c.cfg = kubeaccess.Wrap(cfg, func(ctx context.Context) ([]byte, error) { return talosKubeconfig(ctx, c.conn.Load()) }, o.Log.WithName("kubeaccess"))
	live, err := client.New(c.cfg, client.Options{Scheme: Scheme})
	if err != nil {
		return nil, fmt.Errorf("client: %w", err)
	}
	cs, err := kubernetes.NewForConfig(c.cfg)
	if err != nil {
		return nil, fmt.Errorf("clientset: %w", err)
	}
	tk := &executor.Takeover{Dir: orDefault(o.HandoverDir, os.TempDir()), Pod: o.Pod, Kube: live, Clientset: cs,
		Log: o.Log.WithName("etcd-restore"), TalosOptions: []talosclient.OptionFunc{talosclient.WithGRPCDialOptions(o.TalosDialOptions...)}}
	if hook := o.TestHookAfterRun; hook != nil {
		tk.TestHookAfterStep = func(machine, step string, err error) {
			hook(operation.StepRun{Machine: machine, Step: step, Err: err})
		}
	}
	c.takeover = tk
	return c, nil
}

// Elected is closed once the controller leads (at once, once its manager
// runs, without leader election).
func (c *Controller) Elected() <-chan struct{} { return c.elected }

// Start resumes a takeover a killed controller left, builds the manager
// (again and again while a takeover works and the API does not answer)
// and runs it until ctx ends or it stops (a lost leadership). It returns
// only once no takeover works: a restore goes on when the leadership is
// lost (the API gone), and a restarted controller would resume it anyway.
func (c *Controller) Start(ctx context.Context) error {
	defer c.takeover.Wait()
	if err := c.takeover.Start(ctx); err != nil {
		return fmt.Errorf("resume the etcd restore: %w", err)
	}
	for {
		mgr, err := build(c.cfg, c.o, c.takeover, &c.conn)
		if err == nil {
			go func() {
				select {
				case <-mgr.Elected():
					close(c.elected)
				case <-ctx.Done():
				}
			}()
			return mgr.Start(ctx)
		}
		if !c.takeover.Busy() {
			return err
		}
		c.o.Log.Info("the API does not answer while an etcd restore works; trying again", "why", err.Error())
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(2 * time.Second):
		}
	}
}

// build builds the manager with every reconciler registered, and stores
// its Talos connector in conn.
func build(cfg *rest.Config, o Options, tk *executor.Takeover, conn *atomic.Pointer[talos.Connector]) (ctrl.Manager, error) {
	mo := ctrl.Options{
		Scheme:                        Scheme,
		Logger:                        o.Log,
		Metrics:                       metricsserver.Options{BindAddress: orDefault(o.MetricsAddr, ":8080")},
		HealthProbeBindAddress:        orDefault(o.ProbeAddr, ":8081"),
		PprofBindAddress:              o.PprofAddr,
		LeaderElection:                o.LeaderElection,
		LeaderElectionID:              ichorv1.LeaderLeaseName,
		LeaderElectionNamespace:       o.Namespace,
		LeaderElectionReleaseOnCancel: true,
		Cache:                         cacheOptions(o.Namespace),
	}
	if o.LeaseDuration > 0 {
		mo.LeaseDuration, mo.RenewDeadline, mo.RetryPeriod = &o.LeaseDuration, &o.RenewDeadline, &o.RetryPeriod
	}
	mgr, err := ctrl.NewManager(cfg, mo)
	if err != nil {
		return nil, fmt.Errorf("new manager: %w", err)
	}
	if err := mgr.AddHealthzCheck("healthz", healthz.Ping); err != nil {
		return nil, err
	}
	if err := mgr.AddReadyzCheck("readyz", healthz.Ping); err != nil {
		return nil, err
	}
	table, err := compat.Default()
	if err != nil {
		return nil, fmt.Errorf("the embedded compatibility table: %w", err)
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("clientset: %w", err)
	}
	lk := newLock(mgr, o.Namespace)
	live, err := client.New(cfg, client.Options{Scheme: Scheme})
	if err != nil {
		return nil, fmt.Errorf("client: %w", err)
	}
	self := executor.Controller{Namespace: o.Namespace, Version: o.Version, Image: o.Image, ChartDir: orDefault(o.ChartDir, cilium.ChartDir), Chart: table.CiliumChart, Pod: o.Pod, Node: o.Node}
	if o.CiliumChart != nil {
		self.Chart = *o.CiliumChart
	}
	self.Takeover = tk
	tc := &talos.Connector{Reader: mgr.GetClient(), Namespace: o.Namespace, DialOptions: o.TalosDialOptions}
	conn.Store(tc)
	// The Talos client closes with the manager, once the steps using it end.
	if err := mgr.Add(manager.RunnableFunc(func(ctx context.Context) error {
		<-ctx.Done()
		return tc.Close()
	})); err != nil {
		return nil, err
	}
	r := &operation.Reconciler{
		Client: mgr.GetClient(), Clientset: cs, Recorder: mgr.GetEventRecorder("ichor-controller"),
		Live: live, Controller: self,
		Lock: lk, Talos: tc,
		Compat: table, Executors: o.Executors, StepTimeout: o.StepTimeout,
		Log: o.Log.WithName("operation"), TestHookAfterRun: o.TestHookAfterRun,
	}
	if err := r.SetupWithManager(mgr); err != nil {
		return nil, fmt.Errorf("set up the operation reconciler: %w", err)
	}
	m := &membership.Reconciler{Client: mgr.GetClient(), Lock: lk, Talos: tc, Recorder: mgr.GetEventRecorder("ichor-controller"), Log: o.Log.WithName("membership")}
	if err := m.SetupWithManager(mgr); err != nil {
		return nil, fmt.Errorf("set up the membership reconciler: %w", err)
	}
	if !o.LeaderElection {
		return mgr, nil
	}
	if err := mgr.Add(&versionReporter{client: mgr.GetClient(), namespace: o.Namespace, version: o.Version, kinds: o.Executors.Kinds(), log: o.Log}); err != nil {
		return nil, err
	}
	return mgr, nil
}

// talosKubeconfig is an admin kubeconfig from the Talos API's endpoint (a
// control plane), through the Talos client the connector built last: the
// Secret it is built from cannot be read while the Kubernetes API refuses
// the controller.
func talosKubeconfig(ctx context.Context, conn *talos.Connector) ([]byte, error) {
	if conn == nil {
		return nil, errors.New("the controller is starting")
	}
	u := conn.Current()
	if u == nil {
		return nil, errors.New("this controller has no Talos client yet (it builds one from Secret " + ichorv1.TalosconfigSecret + ", which it could not read)")
	}
	defer u.Release()
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	return u.Client.Kubeconfig(ctx)
}

// newLock is the cluster lock as the controller uses it: every decision
// reads the Lease and the holders from the API server (the manager's
// APIReader); the queue of operations comes from the cache, which receives
// creations in the order the API server made them.
func newLock(mgr ctrl.Manager, namespace string) *lock.Lock {
	judge := lock.ClusterJudge{Client: mgr.GetAPIReader()}
	return &lock.Lock{Client: mgr.GetClient(), Live: mgr.GetAPIReader(), Namespace: namespace,
		Judge: judge, Queue: lock.ClusterQueue{Operations: mgr.GetClient(), Judge: judge}}
}

// cacheOptions keep the informers lean: the one Secret and the Leases of
// the controller's namespace only, and no managed fields anywhere (Nodes of
// a large cluster dominate memory).
func cacheOptions(ns string) cache.Options {
	return cache.Options{
		DefaultTransform: toolscache.TransformFunc(cache.TransformStripManagedFields()),
		ByObject: map[client.Object]cache.ByObject{
			&corev1.Secret{}: {
				Namespaces: map[string]cache.Config{ns: {}},
				Field:      fields.OneTermEqualSelector("metadata.name", ichorv1.TalosconfigSecret),
			},
			&coordinationv1.Lease{}: {Namespaces: map[string]cache.Config{ns: {}}},
			&corev1.Node{}:          {Transform: slimNode},
			// Only the control-plane static pods, whose image tags are the
			// control plane's Kubernetes version; drains read a machine's
			// pods from the API server (a watch-list), and so does preflight
			// kube-proxy's pods, one per machine.
			&corev1.Pod{}: {
				Namespaces: map[string]cache.Config{"kube-system": {}},
				Label:      controlPlanePods,
			},
			// The metadata of Talos's bootstrap workloads whose rollouts the
			// kubernetes and cni kinds wait for (by name: the RBAC grants no more).
			&appsv1.DaemonSet{}: {
				Namespaces: map[string]cache.Config{"kube-system": {}},
				Field:      fields.OneTermEqualSelector("metadata.name", "kube-proxy"),
			},
			&appsv1.Deployment{}: {
				Namespaces: map[string]cache.Config{"kube-system": {}},
				Field:      fields.OneTermEqualSelector("metadata.name", "coredns"),
			},
		},
	}
}

// controlPlanePods selects the control-plane mirror pods.
var controlPlanePods = func() labels.Selector {
	r, err := labels.NewRequirement("k8s-app", selection.In, []string{"kube-apiserver", "kube-controller-manager", "kube-scheduler"})
	if err != nil {
		panic(err)
	}
	return labels.NewSelector().Add(*r)
}()

// slimNode keeps of a Node what Ichor reads: its metadata (without managed
// fields), its spec, and of its status the addresses, the Ready condition
// and the boot ID, OS image and kubelet version. The rest (the images on
// it, its volumes, capacity, the other conditions, the system's
// details) is most of a real Node's size, and a cache of 5,000 Nodes is
// most of the controller's memory. Nodes are changed with patches, never
// written back from the cache.
func slimNode(obj any) (any, error) {
	n, ok := obj.(*corev1.Node)
	if !ok {
		return obj, nil
	}
	n.ManagedFields = nil
	st := corev1.NodeStatus{Addresses: n.Status.Addresses, NodeInfo: corev1.NodeSystemInfo{
		BootID: n.Status.NodeInfo.BootID, OSImage: n.Status.NodeInfo.OSImage, KubeletVersion: n.Status.NodeInfo.KubeletVersion,
	}}
	for _, c := range n.Status.Conditions {
		if c.Type == corev1.NodeReady {
			st.Conditions = []corev1.NodeCondition{c}
		}
	}
	n.Status = st
	return n, nil
}

func orDefault(s, d string) string {
	if s == "" {
		return d
	}
	return s
}

// Run starts the controller and blocks until ctx is done.
func Run(ctx context.Context, cfg *rest.Config, o Options) error {
	c, err := New(cfg, o)
	if err != nil {
		return err
	}
	return c.Start(ctx)
}
