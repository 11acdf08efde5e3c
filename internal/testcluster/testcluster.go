// Package testcluster puts the parts of an Ichor cluster together for
// integration tests: a simulated Talos fleet whose Nodes live in a testenv
// API server, the fleet's talosconfig in Secret ichor-talosconfig, and
// ichor-controller running in-process exactly as its binary runs it.
//
// Nodes are cluster-scoped and the controller sees every Node, so tests
// that use a fleet run one after another in a package; each removes its
// Nodes, operations and pods when it ends.
//
// With testenv's Components the world is a working cluster: the fleet's
// machines run the pods the real controllers make and the real scheduler
// binds, and IchorBinaries lets pods of Ichor's image run the real
// ichor-controller binary.
package testcluster

import (
	"context"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap/zapcore"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/app"
	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

// StartFleet starts a fleet whose Nodes live in env, named after opsNS when
// spec has no name, logging to the test unless spec has a Logf, with
// env's API server as the cluster's (Kubeconfig calls, processes of pods)
// and, where env runs the node-lifecycle controller, Node Leases. When the
// test ends it deletes the operations in opsNS, the namespace and its pods,
// stops the fleet and waits until its Nodes are gone.
func StartFleet(t testing.TB, env *testenv.Env, spec sim.Spec, opsNS string) *sim.Fleet {
	t.Helper()
	if spec.Name == "" {
		spec.Name = "f" + strings.TrimPrefix(opsNS, "t")
		spec.Name = spec.Name[:min(len(spec.Name), 12)]
	}
	if spec.Logf == nil {
		spec.Logf = Logf(t)
	}
	if spec.APIServer == nil {
		spec.APIServer = env.Config
	}
	if env.NodeLifecycle() && spec.Kubelet.NodeLease == 0 {
		// The node-lifecycle controller would mark Nodes without Leases NotReady.
		spec.Kubelet.NodeLease = testenv.NodeLease
	}
	fleet, err := sim.Start(context.Background(), spec, env.Kube)
	if err != nil {
		t.Fatalf("start fleet: %v", err)
	}
	t.Cleanup(func() { cleanup(t, env, fleet, opsNS) })
	return fleet
}

func cleanup(t testing.TB, env *testenv.Env, fleet *sim.Fleet, opsNS string) {
	ctx := context.Background()
	DeleteOperations(env, client.InNamespace(opsNS))
	deleteWorkloads(t, env, opsNS)
	fleet.Stop()
	_ = env.Client.DeleteAllOf(ctx, &corev1.Node{})
	testenv.Eventually(t, 30*time.Second, "the fleet's Nodes to be gone", func(ctx context.Context) (bool, error) {
		var nodes corev1.NodeList
		err := env.Client.List(ctx, &nodes)
		return err == nil && len(nodes.Items) == 0, err
	})
}

// deleteWorkloads deletes the test's namespace and its pods: the next
// test's fleet has Nodes of the same names, whose kubelets would otherwise
// run this test's pods (and a drain would wait for them), and its
// controllers would make new ones. Once the namespace is terminating no
// pod can be created in it; the pods left are removed at once, as the
// pod-GC controller removes the pods of a Node that is gone.
func deleteWorkloads(t testing.TB, env *testenv.Env, ns string) {
	ctx := context.Background()
	err := env.Client.Delete(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}})
	if err != nil && !apierrors.IsNotFound(err) {
		t.Errorf("delete namespace %s: %v", ns, err)
		return
	}
	zero := int64(0)
	testenv.Eventually(t, 30*time.Second, "the pods of "+ns+" to be gone", func(ctx context.Context) (bool, error) {
		if err := env.Client.DeleteAllOf(ctx, &corev1.Pod{}, client.InNamespace(ns), client.GracePeriodSeconds(zero)); err != nil {
			return false, err
		}
		var pods corev1.PodList
		err := env.Client.List(ctx, &pods, client.InNamespace(ns))
		return err == nil && len(pods.Items) == 0, err
	})
}

// DeleteOperations deletes operations, finalizers and all: a controller
// started next must not see operations an earlier test left behind.
func DeleteOperations(env *testenv.Env, opts ...client.ListOption) {
	ctx := context.Background()
	var ops ichorv1.TalosOperationList
	if err := env.Client.List(ctx, &ops, opts...); err != nil {
		return
	}
	for i := range ops.Items {
		op := &ops.Items[i]
		_ = env.Client.Patch(ctx, op, client.RawPatch(types.MergePatchType, []byte(`{"metadata":{"finalizers":null}}`)))
		_ = env.Client.Delete(ctx, op)
	}
}

// WriteTalosconfig stores the fleet's os:admin talosconfig in Secret
// ichor-talosconfig in the controller's namespace.
func WriteTalosconfig(t testing.TB, env *testenv.Env, fleet *sim.Fleet, ctrlNS string) {
	t.Helper()
	data, err := fleet.Talosconfig().Bytes()
	if err != nil {
		t.Fatal(err)
	}
	secret := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ctrlNS, Name: ichorv1.TalosconfigSecret},
		Data: map[string][]byte{ichorv1.TalosconfigKey: data}}
	if err := env.Client.Create(context.Background(), secret); err != nil {
		t.Fatal(err)
	}
}

// Controller is an ichor-controller running in-process.
type Controller struct {
	cancel  context.CancelFunc
	err     error
	exited  chan struct{}
	elected <-chan struct{}
	sw      *Switch
}

// StartController runs the controller with o (its namespace, executors...)
// against cfg until the test ends or Stop is called. Metrics and probes are
// off, and its log goes to the test (or to the file $ICHOR_TEST_LOG).
func StartController(t testing.TB, cfg *rest.Config, o app.Options) *Controller {
	t.Helper()
	o.MetricsAddr, o.ProbeAddr = "0", "0"
	if o.HandoverDir == "" {
		o.HandoverDir = handoverDir(t)
	}
	if o.Version == "" {
		o.Version = "v0.0.0-test"
	}
	o.Log = zap.New(zap.WriteTo(LogSink(t)), zap.UseDevMode(true), func(zo *zap.Options) {
		zo.TimeEncoder = zapcore.RFC3339NanoTimeEncoder
	})
	mgr, err := app.New(cfg, o)
	if err != nil {
		t.Fatalf("new controller: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ctl := &Controller{cancel: cancel, exited: make(chan struct{}), elected: mgr.Elected()}
	go func() {
		ctl.err = mgr.Start(ctx)
		close(ctl.exited)
	}()
	t.Cleanup(ctl.Stop)
	return ctl
}

// handoverDirs are the tests' hand-over directories (testing.TB to its
// directory).
var handoverDirs sync.Map

// handoverDir is where the controllers of one test keep an etcd restore's
// hand-over file (Options.HandoverDir): shared by the controllers the test
// starts one after the other, as by a pod's restarts (one killed mid-restore,
// the next resumes from it), and no other test's. The default, the
// machine's /tmp, is every test's on this machine: a controller of another
// test (another package's, at the same time) would resume the restore from
// it and send its Resets and Bootstraps to this test's machines.
func handoverDir(t testing.TB) string {
	if d, ok := handoverDirs.Load(t); ok {
		return d.(string)
	}
	d := t.TempDir()
	handoverDirs.Store(t, d)
	t.Cleanup(func() { handoverDirs.Delete(t) })
	return d
}

// Stop stops the controller and waits until it has.
func (c *Controller) Stop() {
	c.cancel()
	<-c.exited
}

// Elected is closed once the controller leads (at once without leader
// election).
func (c *Controller) Elected() <-chan struct{} { return c.elected }

// Exited is closed once the controller has stopped: by Stop, by Kill, or
// by itself (a lost leader election ends it, as it ends the binary).
func (c *Controller) Exited() <-chan struct{} { return c.exited }

// Err is why the controller stopped by itself; nil while it runs.
func (c *Controller) Err() error {
	select {
	case <-c.exited:
		return c.err
	default:
		return nil
	}
}

// IchorImage matches Ichor's controller image at any tag, as
// sim.Kubelet.Binaries takes it.
const IchorImage = "ghcr.io/maesh-dev/ichor-controller:*"

// ichorBuilds are the ichor-controller binaries built so far, by version
// ("" for the plain go build).
var ichorBuilds = struct {
	mu    sync.Mutex
	paths map[string]string
}{paths: map[string]string{}}

// IchorBinaries builds ichor-controller (once per test binary, into env's
// directory) and maps Ichor's image to it, for sim.Kubelet.Binaries: pods
// of that image run the real binary.
func IchorBinaries(t testing.TB, env *testenv.Env) map[string]string {
	t.Helper()
	return map[string]string{IchorImage: IchorBinary(t, env, "")}
}

// IchorBinary builds ichor-controller stamped with version (as make build
// stamps a release; "" leaves the default), once per test binary and
// version, into env's directory, and returns its path.
func IchorBinary(t testing.TB, env *testenv.Env, version string) string {
	t.Helper()
	b := &ichorBuilds
	b.mu.Lock()
	defer b.mu.Unlock()
	if p, ok := b.paths[version]; ok {
		return p
	}
	// The file is named as in the image: a container's command names it.
	path := filepath.Join(env.Dir(), "ichor-controller")
	// Stripped, as the image's (and a third of the link's time saved).
	ldflags := "-s -w"
	if version != "" {
		path = filepath.Join(env.Dir(), version, "ichor-controller")
		ldflags += " -X maesh.dev/ichor/internal/version.Version=" + version
	}
	args := []string{"build", "-o", path, "-ldflags", ldflags}
	out, err := exec.Command("go", append(args, "maesh.dev/ichor/controller")...).CombinedOutput()
	if err != nil {
		t.Fatalf("build ichor-controller %s: %v\n%s", version, err, out)
	}
	b.paths[version] = path
	return path
}

// ProcessEnv is sim.Kubelet.Env for pods that run ichor-controller: the
// processes of a fleet's pods share this machine's network, so each
// controller listens for metrics and probes on a port of its own (a free
// one), as it would in a pod's own network.
func ProcessEnv() map[string]string {
	return map[string]string{app.MetricsAddrEnv: "127.0.0.1:0", app.ProbeAddrEnv: "127.0.0.1:0"}
}
