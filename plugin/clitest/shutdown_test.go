package clitest

import (
	"context"
	"io"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/internal/testenv"
)

// TestShutdownWatchEndsWhenTheAPIGoes: `kubectl ichor shutdown --watch`
// follows the operation past the final status that ichor-controller writes
// before the call that takes the API away (Succeeded, the control planes
// shutting down), until the API is gone; it then says that this was
// expected, and how the cluster comes back, and exits 0. The API server is
// reached through a proxy that the test cuts, as the control planes going
// down cut it.
func TestShutdownWatchEndsWhenTheAPIGoes(t *testing.T) {
	ns := env.Namespace(t)
	proxy := newCutProxy(t, env.Config.Host)
	p := start(t, "ichor", "shutdown", "--watch", "-y", "--name", "down", "-n", ns, "--kubeconfig", proxy.kubeconfig(t))
	var op *ichorv1.TalosOperation
	testenv.Eventually(t, 30*time.Second, "the shutdown created", func(ctx context.Context) (bool, error) {
		op = &ichorv1.TalosOperation{}
		return env.Client.Get(ctx, client.ObjectKey{Namespace: ns, Name: "down"}, op) == nil, nil
	})
	p.waitOutput(t, "down phase=Pending")
	begun, done := metav1.NewTime(time.Now().Add(-time.Minute)), metav1.Now()
	final := "the control planes are shutting down together; the API goes away now. To bring the cluster back, power on the control planes first"
	setStatus(t, op, ichorv1.TalosOperationStatus{Phase: ichorv1.PhaseSucceeded, Message: final, StartTime: &begun, CompletionTime: &done,
		Stage: "control-planes", Progress: "1/1", Machines: []ichorv1.MachineStatus{
			{Name: "w-1", Role: ichorv1.RoleWorker, Phase: ichorv1.MachineSucceeded, Message: "down"},
			{Name: "cp-1", Role: ichorv1.RoleControlPlane, Phase: ichorv1.MachineSucceeded, Step: "shutdown-control-planes", Calls: 1, Message: final},
		}})
	p.waitOutput(t, "down phase=Succeeded")
	select {
	case <-p.done:
		t.Fatalf("exited %d at the final status, before the API went away; stderr %q", p.code, p.stderr())
	case <-time.After(2 * time.Second):
	}
	proxy.cut()
	if code := p.wait(t); code != 0 {
		t.Errorf("exit %d, want 0; stderr %q", code, p.stderr())
	}
	if want := "the API went away, as expected: " + final + "\n"; p.stderr() != want {
		t.Errorf("stderr %q, want %q", p.stderr(), want)
	}
}

// cutProxy forwards TCP connections to the API server until cut: then it
// refuses new ones and drops those open, as an API server that is gone.
type cutProxy struct {
	ln     net.Listener
	target string
	mu     sync.Mutex
	conns  []net.Conn
}

func newCutProxy(t *testing.T, host string) *cutProxy {
	t.Helper()
	u, err := url.Parse(host)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &cutProxy{ln: ln, target: u.Host}
	t.Cleanup(p.cut)
	go p.serve()
	return p
}

func (p *cutProxy) serve() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		up, err := net.Dial("tcp", p.target)
		if err != nil {
			c.Close()
			continue
		}
		p.mu.Lock()
		p.conns = append(p.conns, c, up)
		p.mu.Unlock()
		go func() { _, _ = io.Copy(up, c); up.Close() }()
		go func() { _, _ = io.Copy(c, up); c.Close() }()
	}
}

func (p *cutProxy) cut() {
	p.ln.Close()
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.conns {
		c.Close()
	}
	p.conns = nil
}

// kubeconfig is the admin's kubeconfig with the proxy as the server.
func (p *cutProxy) kubeconfig(t *testing.T) string {
	t.Helper()
	cfg, err := clientcmd.LoadFromFile(env.Kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range cfg.Clusters {
		c.Server = "https://" + p.ln.Addr().String()
	}
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(path); err != nil || !strings.HasPrefix(cfg.Clusters[cfg.Contexts[cfg.CurrentContext].Cluster].Server, "https://127.0.0.1:") {
		t.Fatalf("kubeconfig through the proxy: %v", err)
	}
	return path
}
