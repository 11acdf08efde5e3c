package commands

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/duration"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/tools/cache"
	watchtools "k8s.io/client-go/tools/watch"
	utilexec "k8s.io/utils/exec"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/internal/kubepki"
	"maesh.dev/ichor/plugin/view"
)

// Exit codes of --wait, --watch and watch.
const (
	ExitFailed      = 2
	ExitTimeout     = 3
	ExitInterrupted = 130
)

// followFlags are the flags of commands that can follow an operation.
type followFlags struct {
	watch, wait bool
	timeout     time.Duration
	grouping    bool
	ascii       bool
	json        bool
}

func (f *followFlags) addFlags(cmd *cobra.Command, waitFlags bool) {
	fl := cmd.Flags()
	if waitFlags {
		fl.BoolVarP(&f.watch, "watch", "w", false, "Follow the operation live until it succeeds or fails (exit 0, or 2 when it fails)")
		fl.BoolVar(&f.wait, "wait", false, "Wait quietly until the operation succeeds or fails, then print the outcome (exit 0, or 2 when it fails)")
	}
	fl.DurationVar(&f.timeout, "timeout", 0, "Give up following after this long, with exit code 3 (like 30m; 0 waits forever); implies --wait")
	fl.BoolVar(&f.grouping, "grouping", true, "Fold machines in the same phase into one row when they do not fit the terminal")
	fl.BoolVar(&f.ascii, "ascii", false, "Use ASCII instead of Unicode icons")
}

func (f *followFlags) complete(cmd *cobra.Command) {
	if f.timeout > 0 && !f.watch && !f.wait {
		f.wait = true
	}
}

func (f *followFlags) following() bool { return f.watch || f.wait }

func (f *followFlags) validate() error {
	if f.timeout < 0 {
		return usageErrorf("--timeout must not be negative, not %s", f.timeout)
	}
	return nil
}

// exitError gives an error the exit code the plugin documents; kubectl's
// error printer honours it.
func exitError(code int, format string, a ...any) error {
	return utilexec.CodeExitError{Err: fmt.Errorf("error: "+format, a...), Code: code}
}

// outcome says whether a followed operation has come to an end: nil error
// when it succeeded, exit code 2 when it failed or was cancelled. A failure observed while a
// retry asked for by this command is still on its way (retryCount not past
// baseline) is the old failure and does not count.
func outcome(op *ichorv1.TalosOperation, retryBaseline int32, command string) (bool, error) {
	if op.APIGoing() {
		return false, nil // followed until the API has gone (apiGone)
	}
	if op.Succeeded() {
		return true, nil
	}
	if op.Cancelled() {
		// It ends once the steps in flight have settled and the lock is let go.
		if !op.Settled() || op.Status.Lock == ichorv1.LockHeld {
			return false, nil
		}
		return true, exitError(ExitFailed, "%s was cancelled: %s", ref(op.Name), view.Clean(op.Status.Message))
	}
	if retryBaseline >= 0 && op.Status.RetryCount <= retryBaseline {
		return false, nil
	}
	if op.Failed() {
		return true, failure(op, command)
	}
	return false, nil
}

func failure(op *ichorv1.TalosOperation, command string) error {
	if op.Refused() {
		checks := view.RefusedChecks(op)
		if len(checks) == 0 {
			return exitError(ExitFailed, "%s was refused by preflight: %s", ref(op.Name), view.Clean(op.Status.Message))
		}
		return exitError(ExitFailed, "%s was refused by preflight, nothing ran:\n  %s\n%s", ref(op.Name), strings.Join(checks, "\n  "), view.RefusedNext(op))
	}
	msg := view.Clean(op.Status.FailureReason)
	if m := op.Status.FailedMachine(); m != nil {
		msg += fmt.Sprintf(" (machine %s, step %s: %s)", view.Clean(m.Name), view.Clean(m.Step), view.Shorten(view.Clean(m.Message)))
	}
	next := fmt.Sprintf("%s retry %s", command, op.Name)
	if op.PausedByOperator() {
		next = fmt.Sprintf("%s operation resume %s", command, op.Name)
	}
	return exitError(ExitFailed, "%s is paused by a failed step (StepFailed): %s; fix the cause, then run: %s", ref(op.Name), msg, next)
}

// display is where a followed operation goes: a terminal view, a log of
// changes, a JSON stream or nothing.
type display interface {
	update(eventType watch.EventType, op *ichorv1.TalosOperation) error
	// tick redraws what depends on the clock; terminals only.
	tick() error
	// note tells the user something about the following itself (not a
	// change of the operation): a line of the view or the log, or of
	// stderr where stdout is the outcome or JSON.
	note(msg string) error
	// close ends the display; the last state stays visible.
	close(last *ichorv1.TalosOperation, err error) error
}

func (e *Env) newDisplay(ctx context.Context, c client.Reader, ff followFlags, out io.Writer) display {
	switch {
	case ff.json:
		return &jsonDisplay{out: out, errOut: e.Streams.ErrOut}
	case ff.wait && !ff.watch:
		return &quietDisplay{e: e, out: out, errOut: e.Streams.ErrOut}
	case e.IsTerminal(out):
		return &ttyDisplay{e: e, ff: ff, out: out, screen: view.NewScreen(out), around: &surroundings{ctx: ctx, c: c, logs: e.lastLogLine}}
	}
	return &logDisplay{e: e, out: out}
}

// surroundings reads what the live view shows besides the operation: which
// failed machines' Nodes are cordoned, and which operations wait for the
// cluster lock. It reads again at most every few seconds, or when the failed
// machines change; what it may not read (RBAC) it leaves out.
type surroundings struct {
	ctx    context.Context
	c      client.Reader
	logs   podLogs
	last   time.Time
	failed string
	facts  view.Options
}

const surroundingsEvery = 3 * time.Second

func (s *surroundings) read(op *ichorv1.TalosOperation, now time.Time) view.Options {
	var failed []string
	for _, m := range op.Status.Machines {
		if m.Phase == ichorv1.MachineFailed {
			failed = append(failed, m.Name)
		}
	}
	key := strings.Join(failed, ",")
	if s.ctx.Err() != nil || (key == s.failed && now.Sub(s.last) < surroundingsEvery) {
		return s.facts
	}
	s.last, s.failed = now, key
	s.facts.Cordoned = map[string]bool{}
	for _, name := range failed[:min(len(failed), 3)] {
		n := &corev1.Node{}
		if err := s.c.Get(s.ctx, types.NamespacedName{Name: name}, n); err == nil && n.Spec.Unschedulable {
			s.facts.Cordoned[name] = true
		}
	}
	s.facts.Queue = nil
	if waiting, unknown, err := lockWaiters(s.ctx, s.c); err == nil && unknown == "" {
		for _, w := range waiting {
			s.facts.Queue = append(s.facts.Queue, view.QueuedOperation{Namespace: w.Namespace, Name: w.Name, Kind: ichorv1.OperationKind(w.Kind)})
		}
	}
	s.facts.Jobs = nil
	if op.Spec.Kind == ichorv1.KindCNI || op.Spec.Kind == ichorv1.KindIchor {
		s.facts.Jobs = operationJobs(s.ctx, s.c, s.logs, op)
	}
	return s.facts
}

// follow shows one operation until it succeeds (nil), fails (exit 2), the
// timeout passes (exit 3) or the user interrupts (exit 130). retryBaseline
// is the retryCount before a retry this command asked for, or -1.
func (e *Env) follow(ctx context.Context, c client.WithWatch, ns, name string, ff followFlags, out io.Writer, retryBaseline int32) error {
	ctx, stop := signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
	defer stop()
	var deadline <-chan time.Time
	if ff.timeout > 0 {
		t := time.NewTimer(ff.timeout)
		defer t.Stop()
		deadline = t.C
	}
	op, err := e.firstRead(ctx, c, ns, name, ff.timeout, deadline)
	if err != nil {
		return err
	}
	w := watchOperations(ctx, c, ns, name)
	defer func() { w.Stop() }() // the one watching at the end

	d := e.newDisplay(ctx, c, ff, out)
	if err := d.update(watch.Added, op); err != nil {
		return err
	}
	ticker := time.NewTicker(200 * time.Millisecond)
	defer ticker.Stop()
	probe, access := &every{period: time.Second}, &every{period: 2 * time.Second}
	rw := &rewind{first: op.UID}
	// show puts next, a state of the followed name from the watch or a
	// read, on the display; end is another operation of that name, which
	// ends the following.
	show := func(next *ichorv1.TalosOperation) (end, err error) {
		if next.Name != name || (next.UID == op.UID && next.ResourceVersion == op.ResourceVersion) {
			return nil, nil
		}
		// Already shown once: any later state of the same object is a
		// modification, even when a relist reports it as added.
		t := watch.Modified
		switch identify(rw.first, op, next) {
		case anotherOperation:
			return fmt.Errorf("%s was deleted and another operation of that name created (uid %s); follow that one with `%s watch %s -n %s`",
				ref(name), next.UID, e.Name, name, ns), nil
		case writtenBack:
			t = watch.Added
			if err := d.note(writtenBackNote(rw.first, next)); err != nil {
				return nil, err
			}
		}
		op = next
		return nil, d.update(t, op)
	}
	for {
		if done, err := outcome(op, retryBaseline, e.Name); done {
			return finish(d, op, err)
		}
		select {
		case ev, ok := <-w.ResultChan():
			if !ok {
				err := fmt.Errorf("watch of %s ended unexpectedly", ref(name))
				return finish(d, op, err)
			}
			switch ev.Type {
			case watch.Added, watch.Modified:
				// The informer's first list repeats what the Get showed (show
				// passes over it).
				if next, ok := ev.Object.(*ichorv1.TalosOperation); ok {
					if end, err := show(next); err != nil {
						return err
					} else if end != nil {
						return finish(d, op, end)
					}
				}
			case watch.Deleted:
				if !restoring(op) {
					err := fmt.Errorf("%s was deleted", ref(name))
					return finish(d, op, err)
				}
				// The rewind: the restored store predates the operation.
				if gone, ok := ev.Object.(*ichorv1.TalosOperation); ok {
					if err := d.update(watch.Deleted, gone); err != nil {
						return err
					}
				}
				rw.lost = true
				if err := rw.sayAway(d); err != nil {
					return err
				}
			case watch.Error:
				err := fmt.Errorf("watch %s: %v", ref(name), runtime.Object(ev.Object))
				return finish(d, op, err)
			}
		case <-ticker.C:
			if err := d.tick(); err != nil {
				return err
			}
			if op.APIGoing() && probe.due() && apiGone(ctx, c, op) {
				return finishGone(d, op, e.Streams.ErrOut)
			}
			// The informer retries silently while the API is away: say why,
			// and watch anew once it answers again.
			if restoring(op) && probe.due() {
				got, err := readOperation(ctx, c, op)
				say, rewatch := rw.probed(ctx, err)
				if say {
					if err := rw.sayAway(d); err != nil {
						return err
					}
				}
				if rewatch {
					w.Stop()
					w = watchOperations(ctx, c, ns, name)
				}
				// A watch that resumed on the rewound store may miss what it
				// holds (its resourceVersions start below the last one the
				// watch saw): the read shows the write-back all the same.
				if got != nil && (got.UID != op.UID || newerVersion(got, op)) {
					if end, err := show(got); err != nil {
						return err
					} else if end != nil {
						return finish(d, op, end)
					}
				}
			}
			if replacesYourCA(op) && access.due() {
				if err := e.refusedDuringRotation(ctx, c, op); err != nil {
					return finish(d, op, err)
				}
			}
		case <-deadline:
			err := exitError(ExitTimeout, "timed out after %s waiting for %s (%s)", ff.timeout, ref(name), phaseWords(op))
			return finish(d, op, err)
		case <-ctx.Done():
			err := stoppedFollowing(fmt.Sprintf("stopped following %s; the operation keeps running (%s)", ref(name), phaseWords(op)))
			return finish(d, op, err)
		}
	}
}

// answerWait is how long the first read of a follow asks again an API
// server that gives no answer: one that restarts (a rotation of its CA, an
// upgrade of its control plane) is back well within it.
const answerWait = time.Minute

// firstRead reads the operation to follow. An API server that gives no
// answer (a connection refused or cut, a read that times out) is asked
// again every second, which is said once, for up to answerWait or until
// the timeout (exit 3) or an interrupt (130); an answer, a refusal or
// NotFound included, is final.
func (e *Env) firstRead(ctx context.Context, c client.Reader, ns, name string, timeout time.Duration, deadline <-chan time.Time) (*ichorv1.TalosOperation, error) {
	giveUp := time.NewTimer(answerWait)
	defer giveUp.Stop()
	for said := false; ; said = true {
		op, err := readOperation(ctx, c, &ichorv1.TalosOperation{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}})
		if !noAnswer(ctx, err) {
			return op, err
		}
		if !said {
			fmt.Fprintf(e.Streams.ErrOut, "the API server does not answer (%v); asking again for up to %s\n", err, answerWait)
		}
		select {
		case <-time.After(time.Second):
		case <-giveUp.C:
			return nil, err
		case <-deadline:
			return nil, exitError(ExitTimeout, "timed out after %s waiting for the API server to answer: %v", timeout, err)
		case <-ctx.Done():
			return nil, stoppedFollowing(fmt.Sprintf("stopped waiting for the API server to answer: %v", err))
		}
	}
}

// rewind is what following an etcd restore through its rewind keeps: the
// API goes away while every control plane is reset and comes back on the
// snapshot's store, where the operation does not exist until
// ichor-controller writes it back from its journal, a new object.
type rewind struct {
	first types.UID // the followed operation's UID before the restore
	away  bool      // awayNote was said
	// lost: the API has not answered, or the operation was deleted, since
	// the watch started. The informer's watch resumes from the last
	// resourceVersion it saw, which a store rewound to an older snapshot
	// may not reach for a long time: it would wait without a word.
	lost bool
}

// probed decides, from a read of the restore in progress (err), whether to
// say that the API is away, and whether to watch anew: the API answers
// again (the operation, or not found on the rewound store) after it was
// lost.
func (r *rewind) probed(ctx context.Context, err error) (say, rewatch bool) {
	if ctx.Err() != nil {
		return false, false
	}
	away := restoreAway(ctx, err)
	answered := err == nil || apierrors.IsNotFound(err)
	if answered && r.lost {
		r.lost = false
		return away && !r.away, true
	}
	if away && !answered {
		r.lost = true
	}
	return away && !r.away, false
}

const awayNote = "the API is away while etcd is restored; the operation is written back when the restore ends"

// sayAway says awayNote, once.
func (r *rewind) sayAway(d display) error {
	if r.away {
		return nil
	}
	r.away = true
	return d.note(awayNote)
}

// restoring: op is an etcd restore that has not finished, whose API may
// be away and which may be gone from the rewound store, as expected.
func restoring(op *ichorv1.TalosOperation) bool {
	return op.Spec.Kind == ichorv1.KindEtcdRestore && !op.Finished()
}

// restoreAway: the read of a restore in progress ended in err because the
// restore is under way: no answer, a server error (etcd down behind the
// API server), or not found (the store rewound, not yet written back).
func restoreAway(ctx context.Context, err error) bool {
	var status apierrors.APIStatus
	switch {
	case err == nil || ctx.Err() != nil:
		return false
	case apierrors.IsNotFound(err), noAnswer(ctx, err):
		return true
	case errors.As(err, &status):
		code := status.Status().Code
		return code >= 500 || code == 429
	}
	return false
}

// sameName says what an operation of the followed name seen with new state is.
type sameName int

const (
	sameOperation    sameName = iota
	writtenBack               // re-made by ichor-controller from its journal after the rewind
	anotherOperation          // deleted and created anew by someone
)

// identify tells next, seen under the followed name, from last, the state
// shown; first is the UID the followed operation had at the start.
func identify(first types.UID, last, next *ichorv1.TalosOperation) sameName {
	switch {
	case next.UID == last.UID:
		return sameOperation
	case first != "" && next.Annotations[ichorv1.RestoredFromAnnotation] == string(first):
		return writtenBack
	}
	return anotherOperation
}

func writtenBackNote(first types.UID, op *ichorv1.TalosOperation) string {
	return fmt.Sprintf("%s is back: ichor-controller wrote it back from its journal on the restored store (a new object, uid %s; it was %s)",
		ref(op.Name), view.Clean(string(op.UID)), view.Clean(string(first)))
}

// every says when something done periodically is due.
type every struct {
	period time.Duration
	last   time.Time
}

func (e *every) due() bool {
	if time.Since(e.last) < e.period {
		return false
	}
	e.last = time.Now()
	return true
}

// apiGone says whether the API server no longer answers: a read of the
// operation gets no answer at all (an answer, even an error, is the API).
func apiGone(ctx context.Context, c client.Reader, op *ichorv1.TalosOperation) bool {
	_, err := readOperation(ctx, c, op)
	return noAnswer(ctx, err)
}

// readOperation reads the operation of op's name from the API server
// (etcd itself, not a watch cache), within a few seconds: it, the API's
// refusal, or why no answer came.
func readOperation(ctx context.Context, c client.Reader, op *ichorv1.TalosOperation) (*ichorv1.TalosOperation, error) {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	got := &ichorv1.TalosOperation{}
	if err := c.Get(ctx, client.ObjectKeyFromObject(op), got); err != nil {
		return nil, err
	}
	return got, nil
}

// newerVersion: got is a later state of the object op is (its
// resourceVersion, etcd's revision, is higher).
func newerVersion(got, op *ichorv1.TalosOperation) bool {
	a, errA := strconv.ParseUint(got.ResourceVersion, 10, 64)
	b, errB := strconv.ParseUint(op.ResourceVersion, 10, 64)
	return got.UID == op.UID && errA == nil && errB == nil && a > b
}

// noAnswer: err is no answer of the API server's (a connection refused or
// cut, a timeout), not an interrupt of the user's.
func noAnswer(ctx context.Context, err error) bool {
	var status apierrors.APIStatus
	return err != nil && !errors.As(err, &status) && ctx.Err() == nil
}

// replacesYourCA: op is a rotation of the Kubernetes CA under way, which
// makes the user's kubeconfig stale (its trust in the API servers at the
// swap, a client certificate of the old CA at the drop).
func replacesYourCA(op *ichorv1.TalosOperation) bool {
	_, kubernetes := op.Spec.CARotation.Rotates()
	return op.Spec.Kind == ichorv1.KindCARotation && kubernetes && !op.Finished()
}

// refusedDuringRotation reads op, and says what to do when the API server
// refuses the user's credentials: the informer behind the watch would try
// again and again without a word until the timeout.
func (e *Env) refusedDuringRotation(ctx context.Context, c client.Reader, op *ichorv1.TalosOperation) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	err := c.Get(ctx, client.ObjectKeyFromObject(op), &ichorv1.TalosOperation{})
	if err == nil || !(apierrors.IsUnauthorized(err) || kubepki.UntrustedServer(err)) {
		return nil
	}
	return fmt.Errorf("the API server no longer accepts your kubeconfig (%v): %s replaces the Kubernetes CA that the kubeconfig's "+
		"trust or client certificate is of; the operation keeps running: take a new kubeconfig from a control plane "+
		"(`talosctl -n <control plane> kubeconfig --force`), then follow it again with `%s watch %s -n %s`",
		err, ref(op.Name), e.Name, op.Name, op.Namespace)
}

// finishGone ends the following of an operation that took the API away,
// once it has: that was the operation's end, not a failure; it says so,
// and how the cluster comes back.
func finishGone(d display, op *ichorv1.TalosOperation, errOut io.Writer) error {
	if err := d.close(op, nil); err != nil {
		return err
	}
	_, err := fmt.Fprintf(errOut, "the API went away, as expected: %s\n", view.Clean(op.Status.Message))
	return err
}

// stoppedFollowing is the end of a watch the user interrupted: not an
// error (nothing went wrong with the operation), but exit code 130, the
// shell's for an interrupt.
func stoppedFollowing(msg string) error {
	return utilexec.CodeExitError{Err: errors.New(msg), Code: ExitInterrupted}
}

func phaseWords(op *ichorv1.TalosOperation) string {
	s := string(op.Status.Phase)
	if s == "" {
		s = "not yet picked up by ichor-controller"
	}
	if op.Status.Reason != "" {
		s += " " + op.Status.Reason
	}
	if op.Status.Progress != "" {
		s += ", " + op.Status.Progress
	}
	return view.Clean(s)
}

// watchOperations watches one operation (name) or every one in the
// namespace (name empty) through an informer, so the watch survives expiry
// and relists.
func watchOperations(ctx context.Context, c client.WithWatch, ns, name string) watch.Interface {
	_, _, w, _ := watchtools.NewIndexerInformerWatcher(operationsListWatch(c, ns, name), &ichorv1.TalosOperation{})
	return w
}

// operationsListWatch lists and watches one operation (name) or every one
// in the namespace (name empty; every namespace with ns empty too).
func operationsListWatch(c client.WithWatch, ns, name string) *cache.ListWatch {
	sel := func(o *metav1.ListOptions) {
		if name != "" {
			o.FieldSelector = fields.OneTermEqualSelector("metadata.name", name).String()
		}
	}
	return &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			sel(&o)
			list := &ichorv1.TalosOperationList{}
			return list, c.List(ctx, list, client.InNamespace(ns), &client.ListOptions{Raw: &o})
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			sel(&o)
			return c.Watch(ctx, &ichorv1.TalosOperationList{}, client.InNamespace(ns), &client.ListOptions{Raw: &o})
		},
	}
}

// finish closes the display and returns the outcome. The outcome's error is
// returned as it is, so kubectl's error printer sees its exit code.
func finish(d display, op *ichorv1.TalosOperation, err error) error {
	if cerr := d.close(op, err); cerr != nil && err == nil {
		return cerr
	}
	return err
}

// summaryLine is the last line of a followed operation that ended well.
func summaryLine(op *ichorv1.TalosOperation) string {
	took := ""
	if st := op.Status; st.StartTime != nil && st.CompletionTime != nil {
		took = " in " + duration.HumanDuration(st.CompletionTime.Sub(st.StartTime.Time))
	}
	return fmt.Sprintf("%s succeeded%s", ref(op.Name), took)
}

// ttyDisplay redraws the live view in place, at most five times a second and
// at least once a second (for the elapsed times).
type ttyDisplay struct {
	e        *Env
	ff       followFlags
	out      io.Writer
	screen   *view.Screen
	around   *surroundings
	op       *ichorv1.TalosOperation
	notes    []string // shown under the view
	dirty    bool
	lastDraw time.Time
}

func (d *ttyDisplay) note(msg string) error {
	d.notes, d.dirty = append(d.notes, msg), true
	return d.draw()
}

func (d *ttyDisplay) update(_ watch.EventType, op *ichorv1.TalosOperation) error {
	d.op, d.dirty = op, true
	if time.Since(d.lastDraw) >= 200*time.Millisecond {
		return d.draw()
	}
	return nil
}

func (d *ttyDisplay) tick() error {
	if d.dirty || time.Since(d.lastDraw) >= time.Second {
		return d.draw()
	}
	return nil
}

func (d *ttyDisplay) draw() error {
	width, height, err := d.e.TermSize(d.out)
	if err != nil {
		width, height = 120, 40
	}
	o := d.around.read(d.op, time.Now())
	o.Width, o.Height, o.Color, o.ASCII = width, height-1, d.e.UseColor(d.out), d.ff.ascii
	o.Grouping, o.Now, o.Command = d.ff.grouping, d.e.Now(), d.e.Name
	frame := view.Render(d.op, o)
	if len(d.notes) > 0 {
		frame = append(append(frame, ""), d.notes...)
	}
	d.dirty, d.lastDraw = false, time.Now()
	return d.screen.Draw(frame, width)
}

func (d *ttyDisplay) close(last *ichorv1.TalosOperation, err error) error {
	d.op = last
	drawErr := d.draw()
	closeErr := d.screen.Close()
	if err == nil && last.Succeeded() {
		fmt.Fprintln(d.out, summaryLine(last))
	}
	return errors.Join(drawErr, closeErr)
}

// logDisplay prints an append-only, timestamped log of changes.
type logDisplay struct {
	e    *Env
	out  io.Writer
	prev *ichorv1.TalosOperation
}

func (d *logDisplay) update(_ watch.EventType, op *ichorv1.TalosOperation) error {
	for _, l := range view.Changes(d.prev, op, d.e.Now()) {
		if _, err := fmt.Fprintln(d.out, l); err != nil {
			return err
		}
	}
	d.prev = op
	return nil
}

func (d *logDisplay) tick() error { return nil }

func (d *logDisplay) note(msg string) error {
	_, err := fmt.Fprintf(d.out, "%s %s\n", d.e.Now().UTC().Format(time.RFC3339), msg)
	return err
}

func (d *logDisplay) close(last *ichorv1.TalosOperation, err error) error {
	if err == nil && last.Succeeded() {
		_, werr := fmt.Fprintln(d.out, summaryLine(last))
		return werr
	}
	return nil
}

// quietDisplay prints only the outcome (--wait).
type quietDisplay struct {
	e           *Env
	out, errOut io.Writer
}

func (d *quietDisplay) note(msg string) error {
	_, err := fmt.Fprintln(d.errOut, msg)
	return err
}

func (d *quietDisplay) update(watch.EventType, *ichorv1.TalosOperation) error { return nil }
func (d *quietDisplay) tick() error                                           { return nil }
func (d *quietDisplay) close(last *ichorv1.TalosOperation, err error) error {
	if err == nil && last.Succeeded() {
		_, werr := fmt.Fprintln(d.out, summaryLine(last))
		return werr
	}
	return nil
}

// jsonDisplay streams watch events, one JSON object per line, in the shape
// of `kubectl get -w -o json --output-watch-events`.
type jsonDisplay struct {
	out, errOut io.Writer
	enc         *json.Encoder
}

// note goes to stderr: stdout is one watch event per line.
func (d *jsonDisplay) note(msg string) error {
	_, err := fmt.Fprintln(d.errOut, msg)
	return err
}

func (d *jsonDisplay) update(t watch.EventType, op *ichorv1.TalosOperation) error {
	if d.enc == nil {
		d.enc = json.NewEncoder(d.out)
	}
	obj := op.DeepCopy()
	obj.ManagedFields = nil
	obj.APIVersion, obj.Kind = ichorv1.GroupVersion.String(), "TalosOperation"
	return d.enc.Encode(struct {
		Type   watch.EventType         `json:"type"`
		Object *ichorv1.TalosOperation `json:"object"`
	}{t, obj})
}

func (d *jsonDisplay) tick() error { return nil }
func (d *jsonDisplay) close(*ichorv1.TalosOperation, error) error {
	return nil
}
