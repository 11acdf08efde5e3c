// Package clitest drives the built kubectl-ichor binary through the real
// kubectl (which finds it on PATH) against a real API server.
package clitest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/creack/pty"

	"maesh.dev/ichor/internal/testenv"
)

var (
	env *testenv.Env
	// binDir holds the plugin binary, kubectl-ichor.
	binDir string
)

// pluginVersion is stamped into the test binary.
const pluginVersion = "v0.3.1-test"

func TestMain(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	dir, err := os.MkdirTemp("", "kubectl-ichor-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	binDir = dir
	build := exec.Command("go", "build", "-ldflags", "-s -w -X maesh.dev/ichor/internal/version.Version="+pluginVersion,
		"-o", filepath.Join(dir, "kubectl-ichor"), "maesh.dev/ichor/plugin")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "build kubectl-ichor:", err)
		return 1
	}
	return testenv.Main(m, &env)
}

// pathEnv puts the plugin first on PATH, where kubectl looks for plugins.
func pathEnv() []string {
	return []string{"PATH=" + binDir + string(os.PathListSeparator) + os.Getenv("PATH")}
}

// result is one finished kubectl run.
type result struct {
	out, err string
	code     int
}

// kubectl runs the real kubectl as cluster admin (or with kubeconfig) and
// returns its output and exit code; only a failure to start it is fatal.
func kubectl(t *testing.T, kubeconfig string, args ...string) result {
	t.Helper()
	if kubeconfig == "" {
		kubeconfig = env.Kubeconfig
	}
	out, errOut, err := testenv.RunKubectl(context.Background(), kubeconfig, pathEnv(), args...)
	r := result{out: out, err: errOut}
	var exit *exec.ExitError
	switch {
	case errors.As(err, &exit):
		r.code = exit.ExitCode()
	case err != nil:
		t.Fatalf("kubectl %s: %v", strings.Join(args, " "), err)
	}
	return r
}

// ok runs kubectl and fails the test unless it exits 0.
func ok(t *testing.T, args ...string) string {
	t.Helper()
	r := kubectl(t, "", args...)
	if r.code != 0 {
		t.Fatalf("kubectl %s: exit %d: %s", strings.Join(args, " "), r.code, r.err)
	}
	return r.out
}

// proc is kubectl running in the background, its output collected as it comes.
type proc struct {
	cmd      *exec.Cmd
	tty      *os.File // the terminal's master side, for startTerminal
	mu       sync.Mutex
	out, err bytes.Buffer
	done     chan struct{}
	code     int
}

type lockedWriter struct {
	mu *sync.Mutex
	b  *bytes.Buffer
}

func (w lockedWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

func start(t *testing.T, args ...string) *proc {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	p := &proc{cmd: exec.CommandContext(ctx, testenv.Kubectl, args...), done: make(chan struct{})}
	p.cmd.Env = append(os.Environ(), "KUBECONFIG="+env.Kubeconfig, "NO_COLOR=1")
	p.cmd.Env = append(p.cmd.Env, pathEnv()...)
	p.cmd.Stdout, p.cmd.Stderr = lockedWriter{&p.mu, &p.out}, lockedWriter{&p.mu, &p.err}
	if err := p.cmd.Start(); err != nil {
		cancel()
		t.Fatal(err)
	}
	go func() {
		defer cancel()
		err := p.cmd.Wait()
		var exit *exec.ExitError
		if errors.As(err, &exit) {
			p.code = exit.ExitCode()
		} else if err != nil {
			p.code = -1
		}
		close(p.done)
	}()
	t.Cleanup(func() {
		_ = p.cmd.Process.Kill()
		<-p.done
	})
	return p
}

// startTerminal runs kubectl on a terminal of 120x40, as a person would:
// stdin, stdout and stderr are the terminal, which is the process's
// controlling terminal, so typing Ctrl-C (type) interrupts it. Everything
// it prints is in stdout.
func startTerminal(t testing.TB, args ...string) *proc {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	p := &proc{cmd: exec.CommandContext(ctx, testenv.Kubectl, args...), done: make(chan struct{})}
	p.cmd.Env = append(os.Environ(), "KUBECONFIG="+env.Kubeconfig, "NO_COLOR=1", "TERM=xterm")
	p.cmd.Env = append(p.cmd.Env, pathEnv()...)
	tty, err := pty.StartWithSize(p.cmd, &pty.Winsize{Rows: 40, Cols: 120})
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	p.tty = tty
	copied := make(chan struct{})
	go func() {
		defer close(copied)
		_, _ = io.Copy(lockedWriter{&p.mu, &p.out}, tty) // ends with EIO once the process is gone
	}()
	go func() {
		defer cancel()
		err := p.cmd.Wait()
		var exit *exec.ExitError
		if errors.As(err, &exit) {
			p.code = exit.ExitCode()
		} else if err != nil {
			p.code = -1
		}
		_ = tty.Close()
		<-copied
		close(p.done)
	}()
	t.Cleanup(func() {
		_ = p.cmd.Process.Kill()
		<-p.done
	})
	return p
}

// typeKeys types on the terminal of a process started by startTerminal.
func (p *proc) typeKeys(t testing.TB, keys string) {
	t.Helper()
	if _, err := p.tty.Write([]byte(keys)); err != nil {
		t.Fatal(err)
	}
}

func (p *proc) stdout() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.out.String()
}

func (p *proc) stderr() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.err.String()
}

// wait waits for the process to exit and returns its exit code.
func (p *proc) wait(t testing.TB) int {
	t.Helper()
	select {
	case <-p.done:
		return p.code
	case <-time.After(time.Minute):
		t.Fatalf("kubectl %s still running after a minute; stdout:\n%s\nstderr:\n%s", strings.Join(p.cmd.Args[1:], " "), p.stdout(), p.stderr())
	}
	return -1
}

// waitOutput waits until the process has printed want.
func (p *proc) waitOutput(t testing.TB, want string) {
	t.Helper()
	testenv.Eventually(t, 30*time.Second, fmt.Sprintf("kubectl to print %q", want), func(context.Context) (bool, error) {
		select {
		case <-p.done:
			return false, fmt.Errorf("exited %d; stdout:\n%s\nstderr:\n%s", p.code, p.stdout(), p.stderr())
		default:
		}
		return strings.Contains(p.stdout(), want), nil
	})
}
