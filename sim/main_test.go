package sim_test

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/siderolabs/talos/pkg/machinery/client"
	clientconfig "github.com/siderolabs/talos/pkg/machinery/client/config"
	"github.com/siderolabs/talos/pkg/machinery/role"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

var env *testenv.Env

func TestMain(m *testing.M) { os.Exit(testenv.Main(m, &env)) }

var fleetSeq atomic.Int32

// fleetSpec is a fleet of cps control planes and workers workers with a
// name of its own, so fleets of parallel tests share the API server.
func fleetSpec(t testing.TB, cps, workers int) sim.Spec {
	spec := sim.Cluster(fmt.Sprintf("f%d", fleetSeq.Add(1)), cps, workers)
	spec.Logf = t.Logf
	return spec
}

// logLines makes the fleet's log also go to the returned function, which
// says the lines so far that contain text.
func logLines(t testing.TB, spec *sim.Spec) func(text string) []string {
	var mu sync.Mutex
	var lines []string
	spec.Logf = func(format string, args ...any) {
		line := fmt.Sprintf(format, args...)
		t.Log(line)
		mu.Lock()
		lines = append(lines, line)
		mu.Unlock()
	}
	return func(text string) []string {
		mu.Lock()
		defer mu.Unlock()
		var out []string
		for _, l := range lines {
			if strings.Contains(l, text) {
				out = append(out, l)
			}
		}
		return out
	}
}

// start starts a fleet whose Nodes live in the test API server.
func start(t testing.TB, spec sim.Spec) *sim.Fleet {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	f, err := sim.Start(ctx, spec, env.Kube)
	if err != nil {
		t.Fatalf("start fleet: %v", err)
	}
	t.Cleanup(f.Stop)
	return f
}

// talos is a machinery client for the fleet with roles (os:admin if none).
func talos(t testing.TB, f *sim.Fleet, roles ...role.Role) *client.Client {
	t.Helper()
	if len(roles) == 0 {
		roles = []role.Role{role.Admin}
	}
	cfg, err := f.ClientConfig(roles...)
	if err != nil {
		t.Fatal(err)
	}
	c, err := client.New(context.Background(), client.WithConfig(cfg), fastReconnect)
	if err != nil {
		t.Fatalf("talos client: %v", err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// fastReconnect makes the client redial a listener that came back within
// milliseconds (gRPC's default backoff starts at a second).
var fastReconnect = client.WithGRPCDialOptions(grpc.WithConnectParams(grpc.ConnectParams{
	Backoff:           backoff.Config{BaseDelay: 5 * time.Millisecond, Multiplier: 1.6, MaxDelay: 50 * time.Millisecond},
	MinConnectTimeout: 5 * time.Second,
}))

func on(m *sim.Machine) context.Context {
	return client.WithNode(context.Background(), m.Address())
}

func timeout() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), 30*time.Second)
}

// wantCode fails unless err carries code (and, if given, contains text).
func wantCode(t testing.TB, err error, code codes.Code, text string) {
	t.Helper()
	if got := client.StatusCode(err); got != code {
		t.Fatalf("want %s, got %v", code, err)
	}
	if text != "" && !strings.Contains(err.Error(), text) {
		t.Fatalf("want an error containing %q, got %v", text, err)
	}
}

// version asks the machine for its Talos version.
func version(t testing.TB, c *client.Client, m *sim.Machine) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(on(m), 10*time.Second)
	defer cancel()
	resp, err := c.Version(ctx)
	if err != nil {
		return "", err
	}
	return resp.Messages[0].Version.Tag, nil
}

func node(t testing.TB, m *sim.Machine) *corev1.Node {
	t.Helper()
	n, err := env.Kube.CoreV1().Nodes().Get(context.Background(), m.Name(), metav1.GetOptions{})
	if err != nil {
		t.Fatalf("get Node %s: %v", m.Name(), err)
	}
	return n
}

func nodeReady(n *corev1.Node) bool {
	for _, c := range n.Status.Conditions {
		if c.Type == corev1.NodeReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// waitNodeReady waits for the machine's Node to be Ready (or not).
func waitNodeReady(t testing.TB, m *sim.Machine, ready bool) {
	t.Helper()
	testenv.Eventually(t, 30*time.Second, fmt.Sprintf("Node %s Ready=%v", m.Name(), ready), func(ctx context.Context) (bool, error) {
		n, err := env.Kube.CoreV1().Nodes().Get(ctx, m.Name(), metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		return nodeReady(n) == ready, nil
	})
}

// waitUp waits until the machine answers again after a boot that changes
// its boot ID from before.
func waitRebooted(t testing.TB, m *sim.Machine, before string) {
	t.Helper()
	testenv.Eventually(t, 30*time.Second, m.Name()+" back with a new boot ID", func(context.Context) (bool, error) {
		return !m.Down() && m.BootID() != before, nil
	})
}

func clientFor(cfg *clientconfig.Config) (*client.Client, error) {
	return client.New(context.Background(), client.WithConfig(cfg), fastReconnect)
}
