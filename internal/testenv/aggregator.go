package testenv

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// StartClusterRoleAggregator runs kube-controller-manager's ClusterRole
// aggregation controller (the clusterrole-aggregator binary that
// `make envtest-assets` builds beside kube-apiserver) until Stop. envtest
// runs no controller manager, so without it the built-in admin, edit and view
// roles never take in the rules of the roles labelled to aggregate into them.
func (e *Env) StartClusterRoleAggregator() error {
	bin := filepath.Join(os.Getenv("KUBEBUILDER_ASSETS"), "clusterrole-aggregator")
	if _, err := os.Stat(bin); err != nil {
		return fmt.Errorf("%s is missing: run `make envtest-assets`, which builds it: %w", bin, err)
	}
	cmd := exec.Command(bin, "--kubeconfig", e.Kubeconfig)
	var out syncBuffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", bin, err)
	}
	done := make(chan struct{})
	var stopping atomic.Bool
	go func() {
		err := cmd.Wait()
		if !stopping.Load() {
			// Tests waiting on aggregated roles will time out; say why.
			fmt.Fprintf(os.Stderr, "testenv: clusterrole-aggregator exited: %v\n%s", err, out.String())
		}
		close(done)
	}()
	var once sync.Once
	e.stops = append(e.stops, func() {
		once.Do(func() {
			stopping.Store(true)
			_ = cmd.Process.Signal(syscall.SIGTERM)
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				_ = cmd.Process.Kill()
				<-done
			}
		})
	})
	return nil
}

// syncBuffer is a bytes.Buffer the process writes while another goroutine reads it.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
