// Package controlplane runs the real kube-controller-manager and
// kube-scheduler (the binaries `make envtest-assets` builds beside
// kube-apiserver) against an API server, so that the test world and the
// sandbox are a working cluster: Deployments, ReplicaSets, DaemonSets,
// StatefulSets and Jobs make pods, the scheduler binds them to Nodes, the
// disruption controller computes PodDisruptionBudgets (evictions need it),
// the garbage collector and the namespace controller clean up, and
// ServiceAccounts get tokens. The simulated machines (package sim) play the
// kubelets.
package controlplane

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"sigs.k8s.io/controller-runtime/pkg/envtest"
)

// Controllers are the kube-controller-manager controllers the test world
// runs: those that make and remove pods, compute disruption budgets, clean
// up after deletions, and give ServiceAccounts their tokens and CA.
var Controllers = []string{
	"job-controller", "deployment-controller", "replicaset-controller", "daemonset-controller",
	"statefulset-controller", "disruption-controller", "garbage-collector-controller",
	"namespace-controller", "serviceaccount-controller", "serviceaccount-token-controller",
	"root-ca-certificate-publisher-controller", "clusterrole-aggregation-controller",
	"ttl-after-finished-controller", "pod-garbage-collector-controller", "endpointslice-controller",
}

// NodeLifecycleControllers watch Node heartbeats (Node Leases): a Node whose
// lease is not renewed within the grace period is marked Unknown, tainted
// unreachable, and its pods NotReady. Run them only where every Node's
// kubelet renews its lease, or every Node goes NotReady.
var NodeLifecycleControllers = []string{"node-lifecycle-controller", "taint-eviction-controller"}

// Options say how to run the components.
type Options struct {
	// Assets is the directory of the binaries (KUBEBUILDER_ASSETS).
	Assets string
	// Kubeconfig is a system:masters kubeconfig for the API server.
	Kubeconfig string
	// ServiceAccountKey is the API server's service-account signing key
	// (envtest's <cert dir>/sa-signer.key): the token controller signs the
	// ServiceAccount token Secrets with it.
	ServiceAccountKey string
	// NodeMonitorGracePeriod, when set, adds NodeLifecycleControllers with
	// this grace period (--node-monitor-grace-period; Kubernetes' default is
	// 50s).
	NodeMonitorGracePeriod time.Duration
	// Log receives the components' output; nil discards it.
	Log io.Writer
}

// Process is a running component.
type Process struct {
	name     string
	cmd      *exec.Cmd
	done     chan struct{}
	err      error
	stopping bool
	mu       sync.Mutex
	stopOnce sync.Once
}

// StartControllerManager starts kube-controller-manager with Controllers
// (and NodeLifecycleControllers when o.NodeMonitorGracePeriod is set) and
// waits until it is healthy.
func StartControllerManager(ctx context.Context, o Options) (*Process, error) {
	args := append([]string{"--service-account-private-key-file=" + o.ServiceAccountKey}, ControllerArgs(o.NodeMonitorGracePeriod)...)
	return start(ctx, "kube-controller-manager", o, args...)
}

// ControllerArgs are the flags that choose the controller manager's
// controllers: Controllers, and NodeLifecycleControllers with their
// periods when grace (--node-monitor-grace-period) is set.
func ControllerArgs(grace time.Duration) []string {
	controllers := append([]string(nil), Controllers...)
	var args []string
	if grace > 0 {
		controllers = append(controllers, NodeLifecycleControllers...)
		period := min(grace/4, 5*time.Second)
		args = append(args, "--node-monitor-grace-period="+grace.String(), "--node-monitor-period="+period.String(),
			"--node-startup-grace-period="+(2*grace).String())
	}
	return append(args, "--controllers="+strings.Join(controllers, ","))
}

// StartScheduler starts kube-scheduler with its default profile and waits
// until it is healthy.
func StartScheduler(ctx context.Context, o Options) (*Process, error) {
	return start(ctx, "kube-scheduler", o)
}

func start(ctx context.Context, name string, o Options, extra ...string) (*Process, error) {
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	// Served on loopback only, for /healthz; nothing else uses it.
	address := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	args := append([]string{
		"--kubeconfig=" + o.Kubeconfig, "--leader-elect=false",
		"--bind-address=127.0.0.1", "--secure-port=" + strconv.Itoa(port),
	}, extra...)
	return StartComponent(ctx, Component{Name: name, Assets: o.Assets, Args: args, Address: address, Log: o.Log})
}

// Component says how to run kube-controller-manager or kube-scheduler with
// flags rendered elsewhere (package sim renders a control plane's from its
// machine configuration, as Talos renders its static pods).
type Component struct {
	// Name is the binary: kube-controller-manager or kube-scheduler.
	Name string
	// Assets is the directory of the binaries (KUBEBUILDER_ASSETS).
	Assets string
	// Args are the flags, --bind-address and --secure-port among them.
	Args []string
	// Address is the host:port it serves /healthz on (its --bind-address
	// and --secure-port).
	Address string
	// Log receives its output; nil discards it.
	Log io.Writer
}

// StartComponent starts c and waits until its /healthz answers ok (or ctx
// ends, which stops it).
func StartComponent(ctx context.Context, c Component) (*Process, error) {
	bin := filepath.Join(c.Assets, c.Name)
	if _, err := os.Stat(bin); err != nil {
		return nil, fmt.Errorf("%s is missing: run `make envtest-assets`, which builds it: %w", bin, err)
	}
	p, err := startProcess(c.Name, bin, c.Args, c.Log)
	if err != nil {
		return nil, err
	}
	hc := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{
		TLSClientConfig: &tls.Config{InsecureSkipVerify: true}, // its own throwaway certificate, on loopback
	}}
	if err := p.waitHealthy(ctx, hc, "https://"+c.Address+"/healthz"); err != nil {
		p.Stop()
		return nil, err
	}
	return p, nil
}

// startProcess starts bin with args, its output to out (nil discards it).
func startProcess(name, bin string, args []string, out io.Writer) (*Process, error) {
	p := &Process{name: name, cmd: exec.Command(bin, args...), done: make(chan struct{})}
	if out == nil {
		out = io.Discard
	}
	p.cmd.Stdout, p.cmd.Stderr = out, out
	if err := p.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", bin, err)
	}
	go func() {
		err := p.cmd.Wait()
		p.mu.Lock()
		p.err = err
		p.mu.Unlock()
		close(p.done)
	}()
	return p, nil
}

// freePort asks the kernel for a free loopback port.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("find a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// ServiceCIDR is the API server's service IP range in the test world and the
// sandbox: Talos's default cluster.network.serviceSubnets, which the
// simulated machines' configurations carry. The bootstrap manifests Talos
// renders from them put the kube-dns Service at its 10th address
// (10.96.0.10), which an API server on envtest's own range (10.0.0.0/24)
// refuses.
const ServiceCIDR = "10.96.0.0/12"

// ServiceCIDRArg sets ServiceCIDR on an envtest API server.
func ServiceCIDRArg(env *envtest.Environment) {
	env.ControlPlane.GetAPIServer().Configure().Set("service-cluster-ip-range", ServiceCIDR)
}

// StartTimeout bounds how long a component (kube-apiserver and etcd too,
// through envtest's ControlPlaneStartTimeout) may take to become healthy:
// envtest's 20s is too short for a kube-apiserver starting on 2 cores that
// several test packages share.
const StartTimeout = 2 * time.Minute

// waitHealthy polls url (the component's /healthz or /readyz) with hc
// until it answers ok.
func (p *Process) waitHealthy(ctx context.Context, hc *http.Client, url string) error {
	ctx, cancel := context.WithTimeout(ctx, StartTimeout)
	defer cancel()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		if resp, err := hc.Get(url); err == nil {
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK && strings.TrimSpace(string(body)) == "ok" {
				return nil
			}
		}
		select {
		case <-p.done:
			return fmt.Errorf("%s exited while starting: %v (see its log)", p.name, p.exitErr())
		case <-ctx.Done():
			return fmt.Errorf("%s did not become healthy on %s: %w", p.name, url, ctx.Err())
		case <-tick.C:
		}
	}
}

func (p *Process) exitErr() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.err
}

// Pid is the process ID.
func (p *Process) Pid() int { return p.cmd.Process.Pid }

// Done is closed when the process has exited.
func (p *Process) Done() <-chan struct{} { return p.done }

// Unexpected reports whether the process exited without Stop, and how.
func (p *Process) Unexpected() error {
	select {
	case <-p.done:
	default:
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stopping {
		return nil
	}
	if p.err == nil {
		return fmt.Errorf("%s exited", p.name)
	}
	return fmt.Errorf("%s exited: %w", p.name, p.err)
}

// Stop ends the process (SIGTERM, SIGKILL after 10 seconds) and waits for
// it. It is safe to call twice.
func (p *Process) Stop() { p.StopWithin(10 * time.Second) }

// StopWithin is Stop with grace instead of 10 seconds before the SIGKILL.
func (p *Process) StopWithin(grace time.Duration) {
	p.stopOnce.Do(func() {
		p.mu.Lock()
		p.stopping = true
		p.mu.Unlock()
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-p.done:
		case <-time.After(grace):
			_ = p.cmd.Process.Kill()
			<-p.done
		}
	})
}
