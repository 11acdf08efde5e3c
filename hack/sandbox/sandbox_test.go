package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"maesh.dev/ichor/api/compat"
	"maesh.dev/ichor/internal/version"
	"maesh.dev/ichor/sim"
)

// childEnv makes the test binary run the sandbox's main instead of the
// tests, so that a test can start it as a process and interrupt it.
const childEnv = "ICHOR_SANDBOX_TEST_CHILD"

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) == "1" {
		main()
		return
	}
	code := m.Run()
	if bins.dir != "" {
		_ = os.RemoveAll(bins.dir)
	}
	os.Exit(code)
}

func assets(t *testing.T) string {
	t.Helper()
	a := os.Getenv("KUBEBUILDER_ASSETS")
	if a == "" {
		t.Fatal("KUBEBUILDER_ASSETS is not set: run `make test`, or `KUBEBUILDER_ASSETS=$(make -s envtest-assets) go test ./hack/sandbox`")
	}
	return a
}

// bins are the binaries the tests built, once per test binary.
var bins struct {
	once sync.Once
	dir  string
	err  error
}

// buildBinaries builds kubectl-ichor and ichor-controller into one
// directory (returned) with the version this test binary carries, as
// `make build` builds both into bin/.
func buildBinaries(t *testing.T) string {
	t.Helper()
	bins.once.Do(func() {
		if bins.dir, bins.err = os.MkdirTemp("", "ichor-sandbox-test-bin-"); bins.err != nil {
			return
		}
		for name, pkg := range map[string]string{"kubectl-ichor": "maesh.dev/ichor/plugin", "ichor-controller": "maesh.dev/ichor/controller"} {
			if bins.err = buildBinary(filepath.Join(bins.dir, name), pkg, version.Version); bins.err != nil {
				return
			}
		}
	})
	if bins.err != nil {
		t.Fatal(bins.err)
	}
	return bins.dir
}

// buildBinary builds pkg into path, stamped with version.
func buildBinary(path, pkg, v string) error {
	cmd := exec.Command("go", "build", "-ldflags", "-s -w -X maesh.dev/ichor/internal/version.Version="+v, "-o", path, pkg)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("build %s: %v\n%s", pkg, err, out)
	}
	return nil
}

// TestDemo runs the whole walk-through, as `make demo` does, at a faster
// pace (still slow enough that the fault is set on the last control plane
// before the upgrade reaches it on a busy machine), and checks that it
// leaves nothing behind.
func TestDemo(t *testing.T) {
	_, out := runDemoTest(t, 6*time.Minute, "--demo")
	wantLines(t, out,
		"$ kubectl ichor upgrade talos --to v1.13.7 --name talos-upgrade",
		"watch | ", // the live log of the first watch
		"$ kubectl ichor retry talos-upgrade --watch",
		"waiting: PodDisruptionBudget default/web (minAvailable 3", // the drain held by web's budget
	)
}

// TestRecoveryDemo runs the second walk-through, as `make demo-recovery`
// does, on two workers, each running one of the controller's pods: the
// etcd restore ends with the ConfigMaps made after the snapshot gone and
// the operation written back; the shutdown saves its safety snapshot and
// its watch exits 0 when the API goes, which it only does once the
// controller's pod has moved to a control plane (the workers all
// cordoned); after power-on the operation records every machine back and
// no Node stays cordoned.
func TestRecoveryDemo(t *testing.T) {
	dir, out := runDemoTest(t, 12*time.Minute, "--demo=recovery", "--workers", "2")
	wantLines(t, out,
		"$ kubectl ichor restore etcd --from file://"+filepath.Join(dir, fileSnapshot),
		"is back: ichor-controller wrote it back from its journal",
		"$ kubectl ichor shutdown --force --snapshot file://"+filepath.Join(dir, fileShutdownSnapshot),
		"The safety snapshot ",
		"the API went away, as expected",
		"ClusterBack: the cluster came back at",
	)
}

// runDemoTest runs a walk-through (args) at the tests' pace with the
// binaries this test binary built, within timeout: it must exit 0, say it
// ran as described and leave nothing behind. It returns the sandbox's
// directory and what the walk-through printed.
func runDemoTest(t *testing.T, timeout time.Duration, args ...string) (dir, printed string) {
	t.Helper()
	assets(t)
	plugins := buildBinaries(t)
	dir = filepath.Join(t.TempDir(), "sandbox")
	var out, errOut bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	args = append(args, "--pace", "400ms", "--dir", dir, "--plugin-dir", plugins, "--controller", filepath.Join(plugins, "ichor-controller"))
	code := run(ctx, args, &out, &errOut)
	t.Log(out.String())
	if code != 0 {
		t.Fatalf("the demo exited with %d:\n%s", code, errOut.String())
	}
	wantLines(t, out.String(), "The demo ran as described")
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("the sandbox directory %s is still there after the demo (%v)", dir, err)
	}
	return dir, out.String()
}

// wantLines checks that the demo printed each of wants.
func wantLines(t *testing.T, printed string, wants ...string) {
	t.Helper()
	for _, want := range wants {
		if !strings.Contains(printed, want) {
			t.Errorf("the demo's output lacks %q", want)
		}
	}
}

// TestInterrupt starts the sandbox as `make sandbox` does, checks what it
// wrote and that everything listens on loopback only, then interrupts it:
// it must exit 0, stop every server and remove its files. A second sandbox
// on the same directory is refused while the first runs.
func TestInterrupt(t *testing.T) {
	assets(t)
	bin := buildBinaries(t)
	dir := filepath.Join(t.TempDir(), "sandbox")
	// A file of the user's in the directory stays.
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	mine := filepath.Join(dir, "notes.txt")
	if err := os.WriteFile(mine, []byte("mine"), 0o600); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd, stdout, errOut := startSandbox(ctx, t, "--dir", dir, "--controller", filepath.Join(bin, "ichor-controller"), "--control-planes", "1", "--workers", "1", "--pace", "100ms")
	printed := waitReady(t, stdout, errOut)

	st := readState(t, filepath.Join(dir, fileState))
	if st.PID != cmd.Process.Pid {
		t.Errorf("sandbox.json names pid %d, the sandbox is %d", st.PID, cmd.Process.Pid)
	}
	addrs := append([]string{st.APIServer, st.Etcd}, st.TalosAPI...)
	for _, a := range addrs {
		if !loopback(t, a) {
			t.Errorf("%s does not listen on loopback", a)
		}
		if !answers(a) {
			t.Errorf("nothing answers at %s while the sandbox runs", a)
		}
	}
	for _, want := range []string{"source " + filepath.Join(dir, fileEnv), "kubectl ichor upgrade talos", "sim.ichor.maesh.dev/fault="} {
		if !strings.Contains(printed, want) {
			t.Errorf("the sandbox's instructions lack %q:\n%s", want, printed)
		}
	}
	// The kubeconfig works with the real kubectl, and the machines and Ichor are there.
	kubectl := defaultKubectl()
	nodes, err := exec.Command(kubectl, "--kubeconfig", filepath.Join(dir, fileKubeconfig), "get", "nodes", "-o", "name").CombinedOutput()
	if err != nil || strings.Count(string(nodes), "node/") != 2 {
		t.Errorf("kubectl get nodes with the sandbox's kubeconfig: %v\n%s", err, nodes)
	}
	secret, err := exec.Command(kubectl, "--kubeconfig", filepath.Join(dir, fileKubeconfig), "get", "secret", "-n", "ichor-system", "ichor-talosconfig", "-o", "name").CombinedOutput()
	if err != nil {
		t.Errorf("the talosconfig Secret: %v\n%s", err, secret)
	}
	// The controller runs as its Deployment's pods, one of which leads.
	pods, err := exec.Command(kubectl, "--kubeconfig", filepath.Join(dir, fileKubeconfig), "get", "pods", "-n", "ichor-system", "-l", "app.kubernetes.io/name=ichor-controller",
		"-o", `jsonpath={range .items[*]}{.metadata.name} {.status.phase}{"\n"}{end}`).CombinedOutput()
	if err != nil || strings.Count(string(pods), " Running\n") != 2 {
		t.Errorf("the ichor-controller Deployment's pods: %v\n%s; want 2 Running", err, pods)
	}
	leader, err := exec.Command(kubectl, "--kubeconfig", filepath.Join(dir, fileKubeconfig), "get", "lease", "-n", "ichor-system", "ichor-controller-leader",
		"-o", `jsonpath={.metadata.annotations.ichor\.maesh\.dev/version}`).CombinedOutput()
	if err != nil || string(leader) != version.Version {
		t.Errorf("the leader Lease names version %q (%v), want the controller binary's %s", leader, err, version.Version)
	}
	envFile, err := os.ReadFile(filepath.Join(dir, fileEnv))
	if err != nil || !strings.Contains(string(envFile), "export KUBECONFIG="+filepath.Join(dir, fileKubeconfig)) {
		t.Errorf("env file: %v\n%s", err, envFile)
	}

	// A second sandbox on the same directory is refused and changes nothing.
	o, err := parseFlags([]string{"--dir", dir, "--controller", filepath.Join(bin, "ichor-controller")}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Start(ctx, o.config); err == nil || !strings.Contains(err.Error(), fmt.Sprintf("a sandbox (pid %d) is already running", cmd.Process.Pid)) {
		t.Errorf("a second sandbox on %s: %v", dir, err)
	}
	if _, err := os.Stat(filepath.Join(dir, fileKubeconfig)); err != nil {
		t.Errorf("the refused second sandbox touched the first one's files: %v", err)
	}

	if err := cmd.Process.Signal(syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("the sandbox did not exit cleanly on SIGINT: %v\n%s", err, errOut.String())
	}
	for _, a := range addrs {
		if answers(a) {
			t.Errorf("%s still answers after the sandbox stopped", a)
		}
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != 1 || entries[0].Name() != "notes.txt" {
		var names []string
		for _, e := range entries {
			names = append(names, e.Name())
		}
		t.Errorf("after the sandbox stopped, %s holds %v; want only the user's notes.txt", dir, names)
	}
}

// waitReady reads the sandbox's output until it says it is ready.
func waitReady(t *testing.T, r io.Reader, errOut *bytes.Buffer) string {
	t.Helper()
	lines := make(chan string)
	go func() {
		defer close(lines)
		sc := bufio.NewScanner(r)
		for sc.Scan() {
			lines <- sc.Text()
		}
	}()
	var printed strings.Builder
	deadline := time.After(3 * time.Minute)
	ready := false
	for {
		select {
		case line, ok := <-lines:
			if !ok {
				if !ready {
					t.Fatalf("the sandbox ended before it was ready:\n%s\n%s", printed.String(), errOut.String())
				}
				return printed.String()
			}
			printed.WriteString(line + "\n")
			if strings.Contains(line, "(ready)") {
				ready = true
			}
			if ready && strings.HasPrefix(line, "Ctrl-C stops everything") {
				go func() {
					for range lines {
					}
				}()
				return printed.String()
			}
		case <-deadline:
			t.Fatalf("the sandbox was not ready within 3m:\n%s\n%s", printed.String(), errOut.String())
		}
	}
}

func readState(t *testing.T, path string) state {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var st state
	if err := json.Unmarshal(b, &st); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return st
}

func hostPort(t *testing.T, addr string) string {
	t.Helper()
	if strings.Contains(addr, "://") {
		u, err := url.Parse(addr)
		if err != nil {
			t.Fatal(err)
		}
		return u.Host
	}
	return addr
}

func loopback(t *testing.T, addr string) bool {
	host, _, err := net.SplitHostPort(hostPort(t, addr))
	if err != nil {
		t.Fatalf("address %q: %v", addr, err)
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

func answers(addr string) bool {
	if u, err := url.Parse(addr); err == nil && u.Host != "" {
		addr = u.Host
	}
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		return false
	}
	c.Close()
	return true
}

// TestFlags: bad flags are refused with what to do, before anything starts.
func TestFlags(t *testing.T) {
	plugins := t.TempDir()
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--control-planes", "0"}, "at least one control plane"},
		{[]string{"--workers", "0"}, "use 1 or more"},
		{[]string{"--controller", filepath.Join(plugins, "ichor-controller")}, "no ichor-controller at " + filepath.Join(plugins, "ichor-controller") + ": run `make build`"},
		{[]string{"--image", "ghcr.io/maesh-dev/ichor-controller:v0.2.0"}, "write IMAGE=BINARY"},
		{[]string{"--pace", "0s"}, "positive duration"},
		{[]string{"--talos-on", "v1.12.4"}, "write MACHINE=VERSION"},
		{[]string{"--talos-on", "sandbox-w-9=v1.12.4"}, "--talos-on sandbox-w-9: no such machine"},
		{[]string{"extra"}, "takes flags only"},
		{[]string{"--demo", "--workers", "0", "--plugin-dir", plugins}, "at least 2 control planes"},
		{[]string{"--demo", "--plugin-dir", plugins}, "no kubectl-ichor in " + plugins},
		{[]string{"--demo", "--to", "1.13.7", "--plugin-dir", plugins}, "leading v"},
		{[]string{"--demo=restore", "--plugin-dir", plugins}, "write --demo (the tour) or --demo=recovery"},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "sandbox")
			var errOut bytes.Buffer
			code := run(context.Background(), append(tc.args, "--dir", dir), io.Discard, &errOut)
			if code == 0 || !strings.Contains(errOut.String(), tc.want) {
				t.Errorf("exit %d, stderr %q; want an error with %q", code, errOut.String(), tc.want)
			}
			if _, err := os.Stat(dir); !os.IsNotExist(err) {
				t.Errorf("a refused start created %s", dir)
			}
		})
	}
}

// TestWalkThrough follows the walk-through the sandbox prints, against that
// sandbox, one printed line after the other in a shell as a person would
// paste them (the plugin this test built goes first on PATH, where make
// build would have put it): each must end as it says, 0 or, where it says
// "exits 2", 2; then every operation it named has succeeded.
func TestWalkThrough(t *testing.T) {
	assets(t)
	plugins := buildBinaries(t)
	dir := filepath.Join(t.TempDir(), "sandbox")
	ctx, cancel := context.WithTimeout(context.Background(), 12*time.Minute)
	defer cancel()
	cmd, stdout, errOut := startSandbox(ctx, t, "--dir", dir, "--controller", filepath.Join(plugins, "ichor-controller"), "--control-planes", "1", "--workers", "2", "--pace", "200ms")
	defer func() {
		_ = cmd.Process.Signal(syscall.SIGINT)
		_ = cmd.Wait()
	}()
	printed := waitReady(t, stdout, errOut)

	cmds := walkCommands(printed)
	var lines []string
	for _, c := range cmds {
		lines = append(lines, c.Line)
	}
	all := strings.Join(lines, "\n")
	for _, want := range []string{"source ", "--name " + walkFirstUpgrade, "--name " + walkReboot,
		sim.FaultAnnotation + "=", "--name " + walkSecondUpgrade + " --watch   # exits 2", "retry " + walkSecondUpgrade} {
		if !strings.Contains(all, want) {
			t.Fatalf("the walk-through has no command with %q:\n%s", want, printed)
		}
	}
	// The shell gets the sandbox's settings from the env file only.
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "KUBECONFIG=") && !strings.HasPrefix(kv, "TALOSCONFIG=") && !strings.HasPrefix(kv, childEnv+"=") {
			env = append(env, kv)
		}
	}
	var sourced []string
	for _, c := range cmds {
		if strings.HasPrefix(c.Line, "source ") {
			sourced = append(sourced, c.Line)
			continue
		}
		script := strings.Join(append(sourced, "export PATH="+plugins+":$PATH", c.Line), "\n")
		sh := exec.CommandContext(ctx, "bash", "-c", script)
		sh.Env = append(env, "NO_COLOR=1")
		out, err := sh.CombinedOutput()
		code := 0
		if exit, ok := err.(*exec.ExitError); ok {
			code = exit.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		t.Logf("$ %s\n%s", c.Line, out)
		if code != c.Exit {
			t.Fatalf("$ %s\nexited %d, the walk-through says %d:\n%s", c.Line, code, c.Exit, out)
		}
	}
	kubeconfig := filepath.Join(dir, fileKubeconfig)
	for _, name := range []string{walkFirstUpgrade, walkReboot, walkSecondUpgrade} {
		phase, err := exec.Command(defaultKubectl(), "--kubeconfig", kubeconfig, "get", "talosoperation", name, "-o", "jsonpath={.status.phase}").CombinedOutput()
		if err != nil || string(phase) != "Succeeded" {
			t.Errorf("operation %s after the walk-through: %v %q; want Succeeded", name, err, phase)
		}
	}
}

// TestWalkTargets: the walk-through's versions come from the compatibility
// table, the nearest first.
func TestWalkTargets(t *testing.T) {
	table, err := compat.Default()
	if err != nil {
		t.Fatal(err)
	}
	newest := table.Newest()
	before, _ := table.Latest(compat.Minor{Major: newest.Minor.Major, Minor: newest.Minor.Minor - 1})
	for _, tc := range []struct {
		running string
		want    []string
	}{
		{"v1.12.4", []string{"v1.12.7", "v1.13.7"}},
		{before.String(), []string{newest.Latest.String()}},
		{newest.Latest.String(), nil},
		{"not a version", nil},
	} {
		if got := walkTargets(tc.running, table); !slices.Equal(got, tc.want) {
			t.Errorf("walkTargets(%s) = %v, want %v", tc.running, got, tc.want)
		}
	}
}

// startSandbox starts this test binary as a sandbox with args: its stdout
// piped, its stderr kept.
func startSandbox(ctx context.Context, t *testing.T, args ...string) (*exec.Cmd, io.Reader, *bytes.Buffer) {
	t.Helper()
	cmd := exec.CommandContext(ctx, os.Args[0], args...)
	cmd.Env = append(os.Environ(), childEnv+"=1")
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	errOut := &bytes.Buffer{}
	cmd.Stderr = errOut
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	return cmd, stdout, errOut
}
