package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/kubectl/pkg/util/podutils"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/sim"
)

// demoConfig is what --demo adds to the sandbox's flags.
type demoConfig struct {
	// Script is the walk-through --demo runs: scriptTour or scriptRecovery.
	Script string
	// Target is the Talos version the demo upgrades to.
	Target string
	// PluginDir holds kubectl-ichor; it goes first on PATH, where kubectl
	// finds plugins.
	PluginDir string
}

func (d demoConfig) validate(c config) error {
	var errs []error
	if c.ControlPlanes < 2 || c.Workers < 1 {
		errs = append(errs, fmt.Errorf("--demo needs at least 2 control planes (the last gets a fault while the upgrade works on the first) and 1 worker (it is rebooted), not %d and %d", c.ControlPlanes, c.Workers))
	}
	if _, err := os.Stat(filepath.Join(d.PluginDir, "kubectl-ichor")); err != nil {
		errs = append(errs, fmt.Errorf("no kubectl-ichor in %s: run `make build` (make demo does), or point --plugin-dir at it", d.PluginDir))
	}
	if !strings.HasPrefix(d.Target, "v") {
		errs = append(errs, fmt.Errorf("--to %q: write the version with its leading v, like v1.13.7", d.Target))
	}
	return errors.Join(errs...)
}

// Names of the demo's operations, in the namespace of the kubeconfig's context.
const (
	demoNamespace = "default"
	upgradeName   = "talos-upgrade"
	rebootName    = "reboot-worker"
	faultValue    = "error:Upgrade:Internal"
)

// demo is the walk-through: it runs the real kubectl and kubectl ichor as a
// person would, prints what they print, and checks after each step that the
// cluster is in the state the step describes. Checks read the API server
// directly (and the fleet's record, for what only the machines know).
type demo struct {
	sb   *Sandbox
	cfg  demoConfig
	out  *lockedWriter
	env  []string
	step int
	// steps is the number of steps, for the headings.
	steps int
	// short bounds a wait for one reaction; long one for machines to upgrade.
	short, long time.Duration
	bg          []*background
	// target is the worker the reboot drains: the one with the most web
	// pods, so that web's budget holds the drain back.
	target string
	// snapshotRevision is the revision of the recovery's etcd snapshot.
	snapshotRevision int64
}

func runDemo(ctx context.Context, sb *Sandbox, cfg demoConfig, out io.Writer) error {
	machines := len(sb.Fleet.Machines())
	d := &demo{
		sb:    sb,
		cfg:   cfg,
		out:   &lockedWriter{w: out},
		short: 30*time.Second + 10*sb.cfg.Pace,
		// A bound for a stuck demo, not a pace to keep: a drain may wait
		// on a budget until a pod evicted before is Ready elsewhere, which
		// under make test's load took 80 s once (the retry of step 8 then
		// ran out of a 1m36s bound with the upgrade going on).
		long: 3*time.Minute + time.Duration(machines)*15*sb.cfg.Pace,
		env: append(os.Environ(),
			"KUBECONFIG="+sb.Path(fileKubeconfig),
			"TALOSCONFIG="+sb.Path(fileTalosconfig),
			"PATH="+cfg.PluginDir+string(os.PathListSeparator)+os.Getenv("PATH"),
			"NO_COLOR=1"),
	}
	defer d.stopBackground()
	steps := d.tour()
	if cfg.Script == scriptRecovery {
		steps = d.recovery()
	}
	d.steps = len(steps)
	for _, step := range steps {
		if err := step(ctx); err != nil {
			return fmt.Errorf("step %d: %w", d.step, err)
		}
	}
	return nil
}

// tour is the first walk-through (--demo): an upgrade, the lock, a fault,
// a drain held by a budget, a retry.
func (d *demo) tour() []func(context.Context) error {
	return []func(context.Context) error{
		d.cluster, d.upgrade, d.secondOperation, d.fault, d.paused, d.lockPassed, d.drained, d.retry, d.finish,
	}
}

func (d *demo) heading(title string) {
	d.step++
	d.out.printf("\n==> %d/%d %s\n", d.step, d.steps, title)
}

func (d *demo) say(format string, args ...any) { d.out.printf("# "+format+"\n", args...) }

// busiestWorker is the worker that runs the most web pods.
func (d *demo) busiestWorker(ctx context.Context) (string, error) {
	pods, err := d.pods(ctx, "web")
	if err != nil {
		return "", err
	}
	count := map[string]int{}
	for _, p := range pods {
		count[p.Spec.NodeName]++
	}
	best := ""
	for _, w := range d.machines(sim.Worker) {
		if best == "" || count[w] > count[best] {
			best = w
		}
	}
	return best, nil
}

func (d *demo) pods(ctx context.Context, app string) ([]corev1.Pod, error) {
	var pods corev1.PodList
	if err := d.sb.Client.List(ctx, &pods, client.InNamespace(demoNamespace), client.MatchingLabels{"app": app}); err != nil {
		return nil, err
	}
	return pods.Items, nil
}

// faulty is the machine that gets the fault: the last control plane, so
// that the upgrade has not reached it yet when the fault is set, and so
// that, cordoned and failed, it does not count against the workers' budget
// of the reboot that takes the lock over.
func (d *demo) faulty() string { m := d.machines(sim.ControlPlane); return m[len(m)-1] }

func (d *demo) machines(role sim.Role) []string {
	var out []string
	for _, m := range d.sb.Fleet.Machines() {
		if m.Role() == role {
			out = append(out, m.Name())
		}
	}
	return out
}

// 1. The cluster as it is, and the versions of plugin and controller.
func (d *demo) cluster(ctx context.Context) error {
	c := d.sb.cfg
	d.heading(fmt.Sprintf("A Talos cluster of %d control planes and %d workers (simulated), Ichor installed, workloads running", c.ControlPlanes, c.Workers))
	if _, err := d.run(ctx, 0, "kubectl", "get", "nodes", "-o", "wide"); err != nil {
		return err
	}
	if err := d.nodesRun(ctx, c.Talos); err != nil {
		return err
	}
	d.say("The real kube-controller-manager and kube-scheduler run the workloads; the simulated machines are their kubelets.")
	if _, err := d.run(ctx, 0, "kubectl", "get", "deployments,statefulsets,daemonsets,poddisruptionbudgets"); err != nil {
		return err
	}
	if _, err := d.run(ctx, 0, "kubectl", "get", "pods", "-o", "wide"); err != nil {
		return err
	}
	var err error
	if d.target, err = d.busiestWorker(ctx); err != nil {
		return err
	}
	out, err := d.run(ctx, 0, "kubectl", "ichor", "version")
	if err != nil {
		return err
	}
	if !strings.Contains(out, "Client Version: ") || !strings.Contains(out, "Controller Version: "+d.sb.Version+"\n") {
		return fmt.Errorf("kubectl ichor version should print the plugin's version and the controller's (%s), printed:\n%s", d.sb.Version, out)
	}
	return nil
}

// nodesRun checks that every machine's Node is Ready and reports Talos v.
func (d *demo) nodesRun(ctx context.Context, v string) error {
	var nodes corev1.NodeList
	if err := d.sb.Client.List(ctx, &nodes); err != nil {
		return err
	}
	want := len(d.sb.Fleet.Machines())
	if len(nodes.Items) != want {
		return fmt.Errorf("expected %d Nodes, found %d", want, len(nodes.Items))
	}
	for _, n := range nodes.Items {
		if img := n.Status.NodeInfo.OSImage; img != "Talos ("+v+")" {
			return fmt.Errorf("expected Node %s to run Talos %s, its osImage is %q", n.Name, v, img)
		}
		if !nodeReady(&n) {
			return fmt.Errorf("expected Node %s to be Ready", n.Name)
		}
		if n.Spec.Unschedulable {
			return fmt.Errorf("expected Node %s to be uncordoned", n.Name)
		}
	}
	return nil
}

func nodeReady(n *corev1.Node) bool {
	for _, c := range n.Status.Conditions {
		if c.Type == corev1.NodeReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// 2. Start the upgrade and follow it live in the background.
func (d *demo) upgrade(ctx context.Context) error {
	d.heading("Upgrade Talos to " + d.cfg.Target + " and follow it live")
	d.say("Control planes go first, one at a time, then the workers. Not on a terminal, watch prints a log of changes.")
	if _, err := d.run(ctx, 0, "kubectl", "ichor", "upgrade", "talos", "--to", d.cfg.Target, "--name", upgradeName); err != nil {
		return err
	}
	d.startBackground(ctx, "watch", "kubectl", "ichor", "watch", upgradeName)
	_, err := d.waitOp(ctx, upgradeName, "to run and hold the cluster lock", d.short, func(op *ichorv1.TalosOperation) (bool, error) {
		if op.Status.Phase == ichorv1.PhaseRefused {
			return false, fmt.Errorf("preflight refused the upgrade: %s", op.Status.Message)
		}
		return op.Status.Phase == ichorv1.PhaseRunning && op.Status.Lock == ichorv1.LockHeld, nil
	})
	return err
}

// 3. A second operation waits for the lock the upgrade holds.
func (d *demo) secondOperation(ctx context.Context) error {
	w := d.target
	d.heading("A second operation waits for the cluster lock")
	d.say("Disruptive work never overlaps: a reboot of %s (it runs the most web pods) waits until the upgrade lets go of the lock.", w)
	if _, err := d.run(ctx, 0, "kubectl", "ichor", "node", "reboot", w, "--name", rebootName); err != nil {
		return err
	}
	holder := ichorv1.OperationIdentity(demoNamespace, upgradeName)
	if _, err := d.waitOp(ctx, rebootName, "to wait for the lock ("+ichorv1.ReasonClusterLockHeld+", held by "+holder+")", d.short, func(op *ichorv1.TalosOperation) (bool, error) {
		if op.Status.Phase == ichorv1.PhaseRunning || op.Succeeded() {
			return false, fmt.Errorf("%s is %s while %s holds the lock", rebootName, op.Status.Phase, upgradeName)
		}
		return op.Status.Reason == ichorv1.ReasonClusterLockHeld && op.Status.LockHolder == holder, nil
	}); err != nil {
		return err
	}
	out, err := d.run(ctx, 0, "kubectl", "ichor", "lock")
	if err != nil {
		return err
	}
	if !strings.Contains(out, upgradeName) || !strings.Contains(out, demoNamespace+"/"+rebootName) {
		return fmt.Errorf("kubectl ichor lock should name the holder %s and the waiting %s, printed:\n%s", upgradeName, rebootName, out)
	}
	_, err = d.run(ctx, 0, "kubectl", "get", "talosoperations")
	return err
}

// 4. A fault on the last worker, set through its Node as anyone can.
func (d *demo) fault(ctx context.Context) error {
	w := d.faulty()
	d.heading("A fault: the Talos upgrade call on " + w + " will fail")
	if _, err := d.run(ctx, 0, "kubectl", "annotate", "node", w, sim.FaultAnnotation+"="+faultValue); err != nil {
		return err
	}
	m := d.sb.Fleet.Machine(w)
	if err := d.poll(ctx, "the simulated "+w+" to take the fault "+faultValue, d.short, func(context.Context) (bool, error) {
		for _, f := range m.Faults() {
			if f.String() == faultValue {
				return true, nil
			}
		}
		return false, nil
	}); err != nil {
		return err
	}
	// Only if the upgrade has not started on the machine yet is it sure to meet the fault.
	op, err := d.get(ctx, upgradeName)
	if err != nil {
		return err
	}
	if e := machineEntry(op, w); e == nil || e.Phase != ichorv1.MachinePending {
		return fmt.Errorf("the upgrade reached %s before the fault was set (its entry: %+v): run the demo with a slower --pace", w, e)
	}
	return nil
}

// 5. The upgrade reaches the faulty machine and pauses; watch says so.
func (d *demo) paused(ctx context.Context) error {
	w := d.faulty()
	d.heading("The upgrade pauses on the failed step (the watch ends with exit code 2)")
	watch := d.bg[0]
	code, err := watch.wait(ctx, d.long)
	if err != nil {
		return err
	}
	if code != 2 {
		return fmt.Errorf("expected kubectl ichor watch to end with exit code 2 when the step failed, it ended with %d", code)
	}
	op, err := d.get(ctx, upgradeName)
	if err != nil {
		return err
	}
	failed := op.Status.FailedMachine()
	if op.Status.Phase != ichorv1.PhasePaused || op.Status.Reason != ichorv1.ReasonStepFailed || op.Status.FailureReason == "" || failed == nil || failed.Name != w {
		return fmt.Errorf("expected %s Paused by a failed step on %s, it is %s (reason %q, failureReason %q, failed machine %v)",
			upgradeName, w, op.Status.Phase, op.Status.Reason, op.Status.FailureReason, failed)
	}
	want := ichorv1.MachineSucceeded
	for _, m := range op.Status.Machines {
		switch {
		case m.Name == w:
			want = ichorv1.MachinePending
		case m.Phase != want:
			return fmt.Errorf("expected the machines before %s upgraded and those after it untouched, %s is %s", w, m.Name, m.Phase)
		}
	}
	d.say("Nothing is retried by itself and nothing is rolled back; the machines done stay done.")
	_, err = d.run(ctx, 0, "kubectl", "get", "talosoperation", upgradeName, "-o", "wide")
	return err
}

// 6. Paused on a failure, the upgrade lets the waiting reboot take the
// lock; its drain waits for web's budget.
func (d *demo) lockPassed(ctx context.Context) error {
	d.heading("A holder paused on a failed step lets go of the lock: the reboot runs, its drain held by a budget")
	d.say("The drain evicts %s's pods; web's PodDisruptionBudget (minAvailable 3 of 4) lets one go at a time,", d.target)
	d.say("each once its replacement, placed on another machine by the scheduler, is Ready. The watch says so.")
	out, err := d.run(ctx, 0, "kubectl", "ichor", "watch", rebootName, "--timeout", d.long.String())
	if err != nil {
		return err
	}
	if held := "PodDisruptionBudget " + demoNamespace + "/web"; !strings.Contains(out, held) {
		return fmt.Errorf("expected the watch to say the drain of %s waited for %s, it printed:\n%s", d.target, held, out)
	}
	op, err := d.get(ctx, rebootName)
	if err != nil {
		return err
	}
	if !op.Succeeded() {
		return fmt.Errorf("expected %s to succeed, it is %s: %s", rebootName, op.Status.Phase, op.Status.Message)
	}
	var events corev1.EventList
	if err := d.sb.Client.List(ctx, &events, client.InNamespace(demoNamespace)); err != nil {
		return err
	}
	for _, e := range events.Items {
		if e.InvolvedObject.Name == rebootName && e.Reason == "LockTakenOver" {
			d.say("Event on %s: %s %s", rebootName, e.Reason, e.Message)
			return nil
		}
	}
	return fmt.Errorf("expected a LockTakenOver Event on %s", rebootName)
}

// 7. The drained machine's pods run elsewhere, Ready, and the budget held.
func (d *demo) drained(ctx context.Context) error {
	d.heading("The pods " + d.target + " ran now run on other machines")
	if _, err := d.run(ctx, 0, "kubectl", "get", "pods", "-o", "wide", "-l", "app in (web,db)"); err != nil {
		return err
	}
	return d.poll(ctx, "4 web and 3 db pods Ready, none of them on "+d.target, d.short, func(ctx context.Context) (bool, error) {
		for app, want := range map[string]int{"web": 4, "db": 3} {
			pods, err := d.pods(ctx, app)
			if err != nil {
				return false, err
			}
			ready := 0
			for _, p := range pods {
				if p.Spec.NodeName == d.target && p.DeletionTimestamp == nil {
					return false, fmt.Errorf("pod %s is still on the drained %s", p.Name, d.target)
				}
				if podReady(&p) {
					ready++
				}
			}
			if ready != want {
				return false, nil
			}
		}
		return true, nil
	})
}

// podReady is a pod that is Ready and not on its way out.
func podReady(p *corev1.Pod) bool { return p.DeletionTimestamp == nil && podutils.IsPodReady(p) }

// 8. Fix the cause, retry, and follow the upgrade to its end.
func (d *demo) retry(ctx context.Context) error {
	w := d.faulty()
	d.heading("Fix the cause, then kubectl ichor retry (the same as annotating " + ichorv1.RetryAnnotation + "=true)")
	if _, err := d.run(ctx, 0, "kubectl", "annotate", "node", w, sim.FaultAnnotation+"-"); err != nil {
		return err
	}
	m := d.sb.Fleet.Machine(w)
	if err := d.poll(ctx, "the simulated "+w+" to drop its fault", d.short, func(context.Context) (bool, error) {
		return len(m.Faults()) == 0, nil
	}); err != nil {
		return err
	}
	if _, err := d.run(ctx, 0, "kubectl", "ichor", "retry", upgradeName, "--watch", "--timeout", d.long.String()); err != nil {
		return err
	}
	op, err := d.get(ctx, upgradeName)
	if err != nil {
		return err
	}
	if !op.Succeeded() || op.Status.RetryCount != 1 || op.Status.LastRetry == nil || op.RetryPending() {
		return fmt.Errorf("expected %s Succeeded after one retry, it is %s with retryCount %d, lastRetry %v, retry annotation %q",
			upgradeName, op.Status.Phase, op.Status.RetryCount, op.Status.LastRetry, op.Annotations[ichorv1.RetryAnnotation])
	}
	return nil
}

// 9. Every machine runs the target; nothing overlapped; the lock is free.
func (d *demo) finish(ctx context.Context) error {
	d.heading("Done: every machine runs " + d.cfg.Target + ", and the cluster lock is free")
	if _, err := d.run(ctx, 0, "kubectl", "get", "nodes", "-o", "wide"); err != nil {
		return err
	}
	if err := d.nodesRun(ctx, d.cfg.Target); err != nil {
		return err
	}
	if _, err := d.run(ctx, 0, "kubectl", "get", "talosoperations", "-o", "wide"); err != nil {
		return err
	}
	out, err := d.run(ctx, 0, "kubectl", "ichor", "lock")
	if err != nil {
		return err
	}
	if !strings.Contains(out, "<none>") {
		return fmt.Errorf("expected the cluster lock to be free, kubectl ichor lock printed:\n%s", out)
	}
	rec := d.sb.Fleet.Recorder()
	if o := rec.Overlaps(); len(o) > 0 {
		return fmt.Errorf("expected no two disruptive actions at once, the machines saw %d overlaps, the first %+v", len(o), o[0])
	}
	if cps, workers := rec.MaxDown(); cps > 1 || workers > 1 {
		return fmt.Errorf("expected at most one machine down at a time, the machines saw %d control planes and %d workers down at once", cps, workers)
	}
	d.say("The machines' own record agrees: no two disruptive actions overlapped, and never more than one machine was down.")
	return nil
}

func machineEntry(op *ichorv1.TalosOperation, name string) *ichorv1.MachineStatus {
	for i := range op.Status.Machines {
		if op.Status.Machines[i].Name == name {
			return &op.Status.Machines[i]
		}
	}
	return nil
}

func (d *demo) get(ctx context.Context, name string) (*ichorv1.TalosOperation, error) {
	op := &ichorv1.TalosOperation{}
	err := d.sb.Client.Get(ctx, client.ObjectKey{Namespace: demoNamespace, Name: name}, op)
	if err != nil {
		return nil, fmt.Errorf("get %s: %w", name, err)
	}
	return op, nil
}

// waitOp waits until the operation satisfies cond, and says what it last
// saw when it does not in time.
func (d *demo) waitOp(ctx context.Context, name, what string, timeout time.Duration, cond func(*ichorv1.TalosOperation) (bool, error)) (*ichorv1.TalosOperation, error) {
	var last *ichorv1.TalosOperation
	err := d.poll(ctx, name+" "+what, timeout, func(ctx context.Context) (bool, error) {
		op, err := d.get(ctx, name)
		if err != nil {
			return false, nil
		}
		last = op
		return cond(op)
	})
	if err != nil && last != nil {
		err = fmt.Errorf("%w; last seen: phase %q reason %q lock %q holder %q progress %q: %s",
			err, last.Status.Phase, last.Status.Reason, last.Status.Lock, last.Status.LockHolder, last.Status.Progress, last.Status.Message)
	}
	return last, err
}

// poll waits for cond with a deadline; an error from cond ends the wait.
func (d *demo) poll(ctx context.Context, what string, timeout time.Duration, cond func(context.Context) (bool, error)) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	err := wait.PollUntilContextCancel(ctx, 50*time.Millisecond, true, cond)
	if err != nil && (errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled)) {
		return fmt.Errorf("expected %s within %s", what, timeout)
	}
	return err
}

// run prints the command, runs it with its output streamed below and
// returns its standard output. An exit code other than want is an error.
func (d *demo) run(ctx context.Context, want int, name string, args ...string) (string, error) {
	d.out.printf("$ %s\n", commandLine(name, args))
	cmd := d.command(ctx, name, args...)
	var out strings.Builder
	pw := d.out.prefixed("")
	cmd.Stdout, cmd.Stderr = io.MultiWriter(&out, pw), pw
	err := cmd.Run()
	pw.flush()
	code := 0
	var exit *exec.ExitError
	switch {
	case errors.As(err, &exit):
		code = exit.ExitCode()
	case err != nil:
		return "", fmt.Errorf("%s: %w", commandLine(name, args), err)
	}
	if code != want {
		return out.String(), fmt.Errorf("expected `%s` to exit with %d, it exited with %d", commandLine(name, args), want, code)
	}
	return out.String(), nil
}

// command is kubectl (the real one) or another program, in the demo's environment.
func (d *demo) command(ctx context.Context, name string, args ...string) *exec.Cmd {
	if name == "kubectl" {
		name = d.sb.cfg.Kubectl
	}
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Env = d.env
	cmd.WaitDelay = 5 * time.Second
	return cmd
}

func commandLine(name string, args []string) string {
	if strings.HasSuffix(name, "/kubectl") {
		name = "kubectl"
	}
	parts := []string{name}
	for _, a := range args {
		parts = append(parts, shellQuote(a))
	}
	return strings.Join(parts, " ")
}

// background is a command running beside the demo, its output printed as
// it comes with a prefix.
type background struct {
	cmd    *exec.Cmd
	cancel context.CancelFunc
	done   chan struct{}
	code   int
	err    error
}

func (d *demo) startBackground(ctx context.Context, prefix, name string, args ...string) {
	d.out.printf("$ %s &    (in the background; its lines start with %q)\n", commandLine(name, args), prefix+" |")
	ctx, cancel := context.WithCancel(ctx)
	cmd := d.command(ctx, name, args...)
	pw := d.out.prefixed(prefix + " | ")
	cmd.Stdout, cmd.Stderr = pw, pw
	b := &background{cmd: cmd, cancel: cancel, done: make(chan struct{})}
	d.bg = append(d.bg, b)
	if b.err = cmd.Start(); b.err != nil {
		close(b.done)
		return
	}
	go func() {
		defer close(b.done)
		err := cmd.Wait()
		pw.flush()
		var exit *exec.ExitError
		if errors.As(err, &exit) {
			b.code = exit.ExitCode()
		} else {
			b.err = err
		}
	}()
}

// wait waits for the command to end and returns its exit code.
func (b *background) wait(ctx context.Context, timeout time.Duration) (int, error) {
	select {
	case <-b.done:
		if b.err != nil {
			return 0, fmt.Errorf("%s: %w", commandLine(b.cmd.Path, b.cmd.Args[1:]), b.err)
		}
		return b.code, nil
	case <-time.After(timeout):
		return 0, fmt.Errorf("expected `%s` to end within %s", commandLine(b.cmd.Path, b.cmd.Args[1:]), timeout)
	case <-ctx.Done():
		return 0, ctx.Err()
	}
}

// stopBackground ends what still runs in the background: the demo leaves
// nothing behind, even when a step failed.
func (d *demo) stopBackground() {
	for _, b := range d.bg {
		b.cancel()
		<-b.done
	}
}

// lockedWriter serialises the demo's output and the background commands'.
type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) printf(format string, args ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	fmt.Fprintf(l.w, format, args...)
}

// prefixed is a writer that prints whole lines, each with prefix.
func (l *lockedWriter) prefixed(prefix string) *lineWriter {
	return &lineWriter{l: l, prefix: prefix}
}

type lineWriter struct {
	l      *lockedWriter
	prefix string
	mu     sync.Mutex
	buf    []byte
}

func (p *lineWriter) Write(b []byte) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.buf = append(p.buf, b...)
	for {
		i := strings.IndexByte(string(p.buf), '\n')
		if i < 0 {
			return len(b), nil
		}
		p.l.printf("%s%s\n", p.prefix, p.buf[:i])
		p.buf = p.buf[i+1:]
	}
}

// flush prints a last line without a newline.
func (p *lineWriter) flush() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.buf) > 0 {
		p.l.printf("%s%s\n", p.prefix, p.buf)
		p.buf = nil
	}
}
