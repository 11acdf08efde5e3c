package operation_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/types/known/emptypb"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/rest"

	talosclient "github.com/siderolabs/talos/pkg/machinery/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/app"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/sim"
)

// staged is a test-only kind made of three stages, each of one Run step
// named "touch" (the same name in every stage) that makes a real Talos
// call of its own: the control planes one at a time (Version), a
// cluster-wide stage (Hostname), then every machine in the rolling order
// (ServiceList). It logs each run that succeeded, in order.
type staged struct{ log *runLog }

var stagedStages = []ichorv1.StageStatus{
	{Name: "control-planes", Roles: []ichorv1.MachineRole{ichorv1.RoleControlPlane}, Order: ichorv1.StageOneAtATime},
	{Name: "cluster", Order: ichorv1.StageOnce},
	{Name: "everyone", Order: ichorv1.StageRolling},
}

func (staged) Target(*ichorv1.TalosOperation) (string, string) { return "three stages", "" }
func (staged) Scope(_ *ichorv1.TalosOperation, nodes []*corev1.Node) ([]*corev1.Node, error) {
	return nodes, nil
}
func (staged) HonourHold() bool                              { return true }
func (staged) Check(context.Context, *executor.Env) []string { return nil }
func (staged) Stages(*ichorv1.TalosOperation) []ichorv1.StageStatus {
	return slices.Clone(stagedStages)
}

func (s staged) Steps(op *ichorv1.TalosOperation, _ *ichorv1.MachineStatus) []executor.Step {
	stage := op.Status.Stage
	return []executor.Step{{Name: "touch", Timeout: time.Minute, Run: func(ctx context.Context, e *executor.Env) (executor.Outcome, error) {
		ctx = talosclient.WithNode(ctx, e.Address)
		var err error
		switch stage {
		case "control-planes":
			_, err = e.Talos.MachineClient.Version(ctx, &emptypb.Empty{})
		case "cluster":
			_, err = e.Talos.MachineClient.Hostname(ctx, &emptypb.Empty{})
		case "everyone":
			_, err = e.Talos.MachineClient.ServiceList(ctx, &emptypb.Empty{})
		default:
			return executor.Outcome{}, fmt.Errorf("no stage %q", stage)
		}
		if err != nil {
			return executor.Outcome{}, executor.Fail("TouchFailed", "%s: %w", stage, err)
		}
		s.log.add(stage + "/" + e.Machine.Name)
		return executor.Outcome{Message: "touched in " + stage}, nil
	}}}
}

// runLog is the steps that succeeded, in order.
type runLog struct {
	mu   sync.Mutex
	runs []string
}

func (l *runLog) add(run string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.runs = append(l.runs, run)
}

func (l *runLog) all() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.runs)
}

// withStaged makes the controller carry out the kubernetes kind as staged.
func withStaged(log *runLog) controllerOption {
	return func(o *app.Options, _ **rest.Config) { o.Executors[ichorv1.KindKubernetes] = staged{log} }
}

// TestStages runs an operation made of three stages through a controller
// killed in a step of the first stage and between the first and the
// second, paused across that boundary, and failed in the third: each
// stage starts only once the one before has finished everywhere, a pause
// holds the next stage back, and a retry runs the failed step of the
// third stage again and leaves the first two as they were.
func TestStages(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 2, 2))
	name := func(i int) string { return c.fleet.Machines()[i].Name() }
	cp1, cp2, w1, w2 := name(0), name(1), name(2), name(3)
	c.fleet.Machine(cp2).Inject(sim.Fault{Kind: sim.FaultHang, Method: "Version"})
	c.fleet.Machine(w2).Inject(sim.Fault{Kind: sim.FaultError, Method: "ServiceList", Code: codes.Internal})
	log := &runLog{}
	ctl := c.startKillableWith(withStaged(log))
	c.create("k8s", ichorv1.TalosOperationSpec{Kind: ichorv1.KindKubernetes, Kubernetes: &ichorv1.KubernetesUpgrade{Version: "v1.35.1"}, MaxUnavailable: 2})

	// Killed within the first stage, its step on cp2 in flight.
	op := c.waitFor("k8s", "to work on "+cp2+" in the first stage", time.Minute, func(op *ichorv1.TalosOperation) bool {
		m := entryOf(op, cp2)
		return op.Status.Stage == "control-planes" && m != nil && m.Phase == ichorv1.MachineInProgress
	})
	if got := phases(op); got != fmt.Sprintf("%s=Succeeded %s=InProgress %s=Pending %s=Pending", cp1, cp2, w1, w2) {
		t.Fatalf("in the first stage: %s", got)
	}
	ctl.Kill()
	ctl = c.startKillableWith(withStaged(log))

	// Paused while cp2's step hangs: once it ends the stage is done, and
	// the next waits for the resume.
	c.patchSpec("k8s", `{"paused":true}`)
	c.fleet.Machine(cp2).ClearFaults()
	c.waitFor("k8s", "to finish the first stage, paused", time.Minute, func(op *ichorv1.TalosOperation) bool {
		return op.Status.Stages[0].FinishedAt != nil && op.Status.Reason == ichorv1.ReasonPausedByOperator && op.Status.ObservedGeneration == op.Generation
	})

	// Killed between the two stages. The new controller's turn on a retry
	// request (ignored: nothing failed) leaves the next stage waiting.
	ctl.Kill()
	c.startKillableWith(withStaged(log))
	c.kubectl("annotate", "talosoperation", "k8s", ichorv1.RetryAnnotation+"=true")
	op = c.waitFor("k8s", "to drop the retry request", time.Minute, func(op *ichorv1.TalosOperation) bool { return !op.RetryPending() })
	if op.Status.Stage != "control-planes" || op.Status.Stages[1].StartedAt != nil || op.Status.Stages[0].Progress != "2/2" || len(log.all()) != 2 {
		t.Fatalf("paused after the first stage: stage %q, stages %+v, steps run %v", op.Status.Stage, op.Status.Stages, log.all())
	}
	c.patchSpec("k8s", `{"paused":false}`)
	op = c.waitFor("k8s", "to fail on "+w2+" in the last stage", time.Minute, (*ichorv1.TalosOperation).StepFailed)
	if op.Status.Stage != "everyone" || op.Status.FailedMachine().Name != w2 {
		t.Fatalf("failed in stage %q on %+v", op.Status.Stage, op.Status.FailedMachine())
	}
	before := slices.Clone(op.Status.Stages[:2])

	c.fleet.Machine(w2).ClearFaults()
	c.kubectl("annotate", "talosoperation", "k8s", ichorv1.RetryAnnotation+"=true")
	op = c.waitSucceeded("k8s", time.Minute)
	if m := entryOf(op, w2); m.Attempts != 2 {
		t.Errorf("%s: %d attempts in the last stage, want 2", w2, m.Attempts)
	}
	for i, s := range op.Status.Stages[:2] {
		if !s.StartedAt.Equal(before[i].StartedAt) || !s.FinishedAt.Equal(before[i].FinishedAt) {
			t.Errorf("stage %s changed with the retry: %+v, before %+v", s.Name, s, before[i])
		}
	}
	// Each step succeeded once, stage after stage, control planes first;
	// the two workers went together.
	want := []string{"control-planes/" + cp1, "control-planes/" + cp2, "cluster/" + cp1,
		"everyone/" + cp1, "everyone/" + cp2, "everyone/" + w1, "everyone/" + w2}
	got := log.all()
	if len(got) == len(want) {
		slices.Sort(got[5:])
	}
	if !slices.Equal(got, want) {
		t.Errorf("steps that succeeded, in order:\n got %v\nwant %v", got, want)
	}
}

// phases lists each machine's phase.
func phases(op *ichorv1.TalosOperation) string {
	var s []string
	for _, m := range op.Status.Machines {
		s = append(s, m.Name+"="+string(m.Phase))
	}
	return strings.Join(s, " ")
}
