package operation

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/executor"
)

var update = flag.Bool("update", false, "rewrite the golden files in testdata/ from the current output")

// schedule is a whole operation played through the driver's decisions
// without an API server or machines: every Run step launched in a turn has
// finished by the next one (or failed, as fails says), every Wait step is
// done the second time it is checked, the lock is held and preflight
// passes. Each turn's decisions (the Events it leaves) and derived status
// make one reviewable log.
type schedule struct {
	name                   string
	controlPlanes, workers int
	maxUnavailable         int32
	// held carry the hold annotation from the start.
	held []string
	// fails names the machine and step that fail on their first attempt.
	fails map[string]string
	// before runs operator actions before the numbered turn.
	before map[int]func(s *scheduleRun)
}

var schedules = []schedule{
	{
		name: "3cp-5w-max2-w3-held-w4-fails-retry", controlPlanes: 3, workers: 5, maxUnavailable: 2,
		held:  []string{"w3"},
		fails: map[string]string{"w4": "install"},
		before: map[int]func(*scheduleRun){
			// The operator asks for a retry once the failure is there.
			26: func(s *scheduleRun) { s.annotate(ichorv1.RetryAnnotation, ichorv1.RetryRequested) },
		},
	},
	{
		name: "1cp-3w-paused-and-resumed", controlPlanes: 1, workers: 3, maxUnavailable: 1,
		before: map[int]func(*scheduleRun){
			2: func(s *scheduleRun) { s.persisted.Spec.Paused = true },
			8: func(s *scheduleRun) { s.persisted.Spec.Paused = false },
		},
	},
}

func TestSchedules(t *testing.T) {
	for _, sc := range schedules {
		t.Run(sc.name, func(t *testing.T) {
			got := sc.play(t)
			path := filepath.Join("testdata", "schedules", sc.name+".golden")
			if *update {
				if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			want, err := os.ReadFile(path)
			if err != nil {
				t.Fatalf("%v (run with -update to write it)", err)
			}
			if got != string(want) {
				t.Errorf("the schedule differs from %s (-update rewrites it):\n%s", path, got)
			}
		})
	}
}

// scheduleRun is a schedule being played.
type scheduleRun struct {
	r         *Reconciler
	persisted *ichorv1.TalosOperation
	nodes     []*corev1.Node
	log       *strings.Builder
	waits     map[string]bool
}

func (s *scheduleRun) annotate(k, v string) {
	if s.persisted.Annotations == nil {
		s.persisted.Annotations = map[string]string{}
	}
	s.persisted.Annotations[k] = v
}

func (sc schedule) play(t *testing.T) string {
	t.Helper()
	clock := time.Date(2026, 1, 2, 3, 0, 0, 0, time.UTC)
	s := &scheduleRun{log: &strings.Builder{}, waits: map[string]bool{}}
	s.r = &Reconciler{Now: func() time.Time { return clock }, Recorder: logRecorder{s.log}, StepTimeout: time.Hour}
	s.r.runner = newRunner(s.r.now)
	s.r.Executors = executor.Registry{ichorv1.KindTalos: scheduleExec{s}}
	for i := range sc.controlPlanes + sc.workers {
		name, labels := fmt.Sprintf("w%d", i-sc.controlPlanes+1), map[string]string{}
		if i < sc.controlPlanes {
			name, labels = fmt.Sprintf("cp%d", i+1), map[string]string{ichorv1.ControlPlaneLabel: ""}
		}
		n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}}
		n.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue}}
		for _, h := range sc.held {
			if h == name {
				n.Annotations = map[string]string{ichorv1.UpgradeHoldAnnotation: "a disk is replaced"}
			}
		}
		s.nodes = append(s.nodes, n)
	}
	s.persisted = &ichorv1.TalosOperation{ObjectMeta: metav1.ObjectMeta{Namespace: "ops", Name: "upgrade", UID: "u1", Generation: 1},
		Spec: ichorv1.TalosOperationSpec{Kind: ichorv1.KindTalos, Talos: &ichorv1.TalosUpgrade{Version: "v1.13.7"}, MaxUnavailable: sc.maxUnavailable}}
	fmt.Fprintf(s.log, "%d control planes + %d workers, maxUnavailable %d, held %v, failing %v\n", sc.controlPlanes, sc.workers, sc.maxUnavailable, sc.held, sc.fails)
	last := ""
	for turn := 1; turn <= 60; turn++ {
		if act := sc.before[turn]; act != nil {
			act(s)
		}
		s.finishLaunched(sc.fails)
		tn := s.r.newTurn(s.persisted, logr.Discard())
		tn.exec, tn.nodes = s.r.Executors[ichorv1.KindTalos], s.nodes
		if !tn.started() {
			if err := tn.plan(); err != nil {
				t.Fatal(err)
			}
		}
		tn.collect()
		if _, stopped := tn.reconcileStopped(context.Background()); !stopped {
			tn.op.Status.Lock = ichorv1.LockHeld
			if !tn.started() {
				tn.start()
			}
			if _, err := tn.reconcileRunning(context.Background()); err != nil {
				t.Fatal(err)
			}
		}
		deriveStatus(tn.op, tn.now, tn.why)
		tn.announce()
		// A turn that changes nothing is left out.
		st := tn.op.Status
		line := fmt.Sprintf("%s %s %s: %s", st.Phase, st.Progress, orDash(st.Reason), st.Message)
		for _, m := range st.Machines {
			if m.Stopped {
				line += fmt.Sprintf(" [%s stopped before %s]", m.Name, m.Step)
			}
		}
		if line != last || len(tn.events) > 0 {
			fmt.Fprintf(s.log, "turn %d: %s\n", turn, line)
			last = line
		}
		for _, e := range tn.events {
			e()
		}
		if tn.dropRetry {
			delete(tn.op.Annotations, ichorv1.RetryAnnotation)
		}
		s.persisted = tn.op
		if tn.op.Succeeded() {
			break
		}
		clock = clock.Add(time.Minute)
	}
	return s.log.String()
}

// finishLaunched gives a result to every Run step that persisted status
// records in progress: as the runner would once the step has ended.
func (s *scheduleRun) finishLaunched(fails map[string]string) {
	for _, m := range s.persisted.Status.Machines {
		if m.Phase != ichorv1.MachineInProgress || m.Stopped || !isRun(m.Step) {
			continue
		}
		var err error
		if fails[m.Name] == m.Step && m.Attempts == 1 {
			err = executor.Fail("InstallFailed", "the installer image could not be pulled")
		}
		k := machineKey{op: s.persisted.UID, machine: m.Name}
		s.r.runner.results[k] = result{ran: []ranStep{{name: m.Step}}, attempt: m.Attempts, err: err}
	}
}

func isRun(step string) bool { return step != executor.StepRebooted }

// scheduleExec is an executor whose steps do nothing: the schedule says
// how they end.
type scheduleExec struct{ s *scheduleRun }

func (scheduleExec) Target(*ichorv1.TalosOperation) (string, string) {
	return "talos v1.13.7", "v1.13.7"
}
func (scheduleExec) Scope(_ *ichorv1.TalosOperation, nodes []*corev1.Node) ([]*corev1.Node, error) {
	return nodes, nil
}
func (scheduleExec) HonourHold() bool                              { return true }
func (scheduleExec) Check(context.Context, *executor.Env) []string { return nil }

func (x scheduleExec) Steps(*ichorv1.TalosOperation, *ichorv1.MachineStatus) []executor.Step {
	run := func(name string) executor.Step {
		return executor.Step{Name: name, Run: func(context.Context, *executor.Env) (executor.Outcome, error) {
			return executor.Outcome{}, errors.New("the schedule finishes steps itself")
		}}
	}
	wait := executor.Step{Name: executor.StepRebooted, Wait: func(_ context.Context, e *executor.Env) (bool, executor.Outcome, error) {
		k := fmt.Sprintf("%s/%d", e.Machine.Name, e.Machine.Attempts)
		if x.s.waits[k] {
			return true, executor.Outcome{}, nil
		}
		x.s.waits[k] = true
		return false, executor.Outcome{Message: "waiting for the machine to come back"}, nil
	}}
	return []executor.Step{run(executor.StepDrain), run(executor.StepInstall), wait, run(executor.StepUncordon)}
}

// logRecorder writes Events to the schedule's log.
type logRecorder struct{ b *strings.Builder }

func (l logRecorder) Eventf(_ runtime.Object, _ runtime.Object, eventType, reason, _, note string, args ...any) {
	fmt.Fprintf(l.b, "    %s %s: %s\n", eventType, reason, fmt.Sprintf(note, args...))
}

func (l logRecorder) AnnotatedEventf(o runtime.Object, r runtime.Object, _ map[string]string, eventType, reason, action, note string, args ...any) {
	l.Eventf(o, r, eventType, reason, action, note, args...)
}
