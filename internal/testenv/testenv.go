// Package testenv starts a real kube-apiserver and etcd (envtest, with the
// binaries `make envtest-assets` builds from source), installs Ichor's CRD from
// manifests/, and hands out clients. Every integration test uses it; a package
// starts one API server in TestMain and shares it between its tests, each of
// which works in a namespace of its own. With(Components{...}) adds the
// real kube-controller-manager and kube-scheduler for the packages whose
// tests need a working cluster.
package testenv

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	"k8s.io/client-go/kubernetes"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/internal/controlplane"
	"maesh.dev/ichor/internal/repo"
)

// Kubectl is the real kubectl that tests drive; $KUBECTL overrides it.
var Kubectl = "/usr/bin/kubectl"

func init() {
	if k := os.Getenv("KUBECTL"); k != "" {
		Kubectl = k
	}
}

// Scheme knows the built-in types and TalosOperation.
var Scheme = runtime.NewScheme()

func init() {
	utilruntime.Must(clientgoscheme.AddToScheme(Scheme))
	utilruntime.Must(ichorv1.AddToScheme(Scheme))
}

// Env is a running API server with clients for it.
type Env struct {
	// Config is a cluster-admin REST config.
	Config *rest.Config
	// Client is a controller-runtime client with Scheme.
	Client client.Client
	// Kube is a typed client-go clientset.
	Kube kubernetes.Interface
	// Kubeconfig is the path of a cluster-admin kubeconfig for the real kubectl.
	Kubeconfig string
	// Root is the repository root (where go.mod is).
	Root string

	env *envtest.Environment // nil for an attached Env
	dir string
	// saKey is the file of the API server's service-account signing key.
	saKey string
	// auditLog is the API server's audit log of AuditedUser's requests.
	auditLog string
	seq      atomic.Int64
	// stops end what was started beside the API server, before it stops.
	stops []func()
	// components are what StartComponents started; kcm the controller manager.
	components Components
	kcm        *controlplane.Process
}

// Start starts kube-apiserver and etcd from $KUBEBUILDER_ASSETS and installs
// the CRD from manifests/crd.
func Start() (*Env, error) {
	assets := os.Getenv("KUBEBUILDER_ASSETS")
	if assets == "" {
		return nil, errors.New("KUBEBUILDER_ASSETS is not set: run `make test`, or `KUBEBUILDER_ASSETS=$(make -s envtest-assets) go test ./...`")
	}
	root, err := RepoRoot()
	if err != nil {
		return nil, err
	}
	env := &envtest.Environment{
		BinaryAssetsDirectory: assets,
		CRDDirectoryPaths:     []string{filepath.Join(root, "manifests", "crd")},
		ErrorIfCRDPathMissing: true,
		Scheme:                Scheme,
	}
	controlplane.ServiceCIDRArg(env)
	auditDir, err := os.MkdirTemp("", "ichor-audit-")
	if err != nil {
		return nil, err
	}
	audit, auditLog, err := auditArgs(auditDir)
	if err != nil {
		return nil, err
	}
	for k, v := range audit {
		env.ControlPlane.GetAPIServer().Configure().Set(k, v)
	}
	if os.Getenv("KUBEBUILDER_CONTROLPLANE_START_TIMEOUT") == "" {
		env.ControlPlaneStartTimeout = controlplane.StartTimeout
	}
	cfg, err := env.Start()
	if err != nil {
		return nil, fmt.Errorf("start envtest from %s: %w", assets, err)
	}
	e := &Env{Config: cfg, Root: root, env: env, auditLog: auditLog}
	e.stops = append(e.stops, func() { _ = os.RemoveAll(auditDir) })
	if err := e.init(); err != nil {
		_ = env.Stop()
		_ = os.RemoveAll(auditDir)
		return nil, err
	}
	return e, nil
}

func (e *Env) init() error {
	if err := e.initClients(); err != nil {
		return err
	}
	var err error
	if e.dir, err = os.MkdirTemp("", "ichor-testenv-"); err != nil {
		return err
	}
	e.saKey = filepath.Join(e.env.ControlPlane.APIServer.CertDir, "sa-signer.key")
	e.Kubeconfig, err = e.UserKubeconfig("ichor-test-admin", "system:masters")
	return err
}

func (e *Env) initClients() error {
	// The default QPS of 5 would make the tests wait on the client, not on the server.
	e.Config.QPS, e.Config.Burst = 1000, 2000
	var err error
	if e.Client, err = client.New(e.Config, client.Options{Scheme: Scheme}); err != nil {
		return fmt.Errorf("controller-runtime client: %w", err)
	}
	if e.Kube, err = kubernetes.NewForConfig(e.Config); err != nil {
		return fmt.Errorf("clientset: %w", err)
	}
	return nil
}

// Stop stops the API server and etcd and removes the files Start wrote.
func (e *Env) Stop() error {
	for _, stop := range e.stops {
		stop()
	}
	if e.dir != "" {
		_ = os.RemoveAll(e.dir)
	}
	if e.env == nil {
		return nil
	}
	return e.env.Stop()
}

// Main is TestMain's body for a package of integration tests: it starts an
// Env into *env, runs each setup (installing manifests, starting helpers),
// runs the tests and stops it.
func Main(m *testing.M, env **Env, setup ...func(*Env) error) int {
	// controller-runtime's global logger, which client-go's reflectors
	// under the tests' caches write to, drops their lines from the start,
	// as it would unset: each controller has its own logger. Unset, it
	// prints a warning with a goroutine stack 30 s in, among the figures
	// of make bench. A package that wants those lines sets it before Main
	// (only the first call counts).
	ctrllog.SetLogger(logr.Discard())
	e, err := Start()
	if err != nil {
		fmt.Fprintln(os.Stderr, "testenv:", err)
		return 1
	}
	*env = e
	for _, s := range setup {
		if err := s(e); err != nil {
			fmt.Fprintln(os.Stderr, "testenv: setup:", err)
			_ = e.Stop()
			return 1
		}
	}
	code := m.Run()
	if err := e.Stop(); err != nil {
		fmt.Fprintln(os.Stderr, "testenv: stop:", err)
	}
	return code
}

// User returns a REST config that authenticates as the named user in groups.
func (e *Env) User(name string, groups ...string) (*rest.Config, error) {
	if e.env == nil {
		return nil, errAttached
	}
	u, err := e.env.AddUser(envtest.User{Name: name, Groups: groups}, nil)
	if err != nil {
		return nil, fmt.Errorf("add user %s: %w", name, err)
	}
	cfg := u.Config()
	cfg.QPS, cfg.Burst = 1000, 2000
	return cfg, nil
}

// UserKubeconfig writes a kubeconfig for the named user and returns its path.
func (e *Env) UserKubeconfig(name string, groups ...string) (string, error) {
	if e.env == nil {
		return "", errAttached
	}
	u, err := e.env.AddUser(envtest.User{Name: name, Groups: groups}, nil)
	if err != nil {
		return "", fmt.Errorf("add user %s: %w", name, err)
	}
	data, err := u.KubeConfig()
	if err != nil {
		return "", fmt.Errorf("kubeconfig for %s: %w", name, err)
	}
	path := filepath.Join(e.dir, fmt.Sprintf("kubeconfig-%s-%d", name, e.seq.Add(1)))
	return path, os.WriteFile(path, data, 0o600)
}

// EtcdURL is the client URL of the Env's etcd. A fleet whose control
// planes host their own API servers (sim.Spec.Hosted) can share it under a
// key prefix of its own.
func (e *Env) EtcdURL() string {
	if e.env == nil {
		return ""
	}
	return e.env.ControlPlane.Etcd.URL.String()
}

// Dir is a directory for the package's files; Stop removes it.
func (e *Env) Dir() string { return e.dir }

// Namespace creates a namespace of the test's own and returns its name.
func (e *Env) Namespace(t testing.TB) string {
	t.Helper()
	name := fmt.Sprintf("t%d-%s", e.seq.Add(1), sanitize(t.Name()))
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}
	if err := e.Client.Create(context.Background(), ns); err != nil {
		t.Fatalf("create namespace %s: %v", name, err)
	}
	return name
}

// Kubectl runs the real kubectl as cluster admin. extraEnv entries are added
// to the environment (PATH for plugins, KUBECONFIG overrides).
func (e *Env) Kubectl(ctx context.Context, extraEnv []string, args ...string) (stdout, stderr string, err error) {
	return RunKubectl(ctx, e.Kubeconfig, extraEnv, args...)
}

// RunKubectl runs the real kubectl with a kubeconfig.
func RunKubectl(ctx context.Context, kubeconfig string, extraEnv []string, args ...string) (stdout, stderr string, err error) {
	if ctx == nil {
		ctx = context.Background()
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, Kubectl, args...)
	cmd.Env = append(os.Environ(), "KUBECONFIG="+kubeconfig, "NO_COLOR=1")
	cmd.Env = append(cmd.Env, extraEnv...)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err = cmd.Run()
	if err != nil {
		err = fmt.Errorf("kubectl %s: %w: %s", strings.Join(args, " "), err, errOut.String())
	}
	return out.String(), errOut.String(), err
}

// RepoRoot finds the repository root by walking up to go.mod.
func RepoRoot() (string, error) { return repo.Root() }

func sanitize(name string) string {
	name = strings.ToLower(name)
	var b strings.Builder
	for _, r := range name {
		if (r >= 'a' && r <= 'z') || (r >= '0' && r <= '9') {
			b.WriteRune(r)
		} else {
			b.WriteByte('-')
		}
	}
	s := strings.Trim(b.String(), "-")
	if len(s) > 40 {
		s = strings.Trim(s[:40], "-")
	}
	return s
}
