// Package executor holds one executor per operation kind. An executor only
// says which machines are in scope, which steps exist for each machine and
// how each step is done and verified; the operation reconciler drives them,
// records every step in status before it runs (a Chained step: right
// after), and owns the lock, the order and pause, resume and retry, which
// are the same for every kind.
package executor

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/controller-runtime/pkg/client"

	talosclient "github.com/siderolabs/talos/pkg/machinery/client"
	clientconfig "github.com/siderolabs/talos/pkg/machinery/client/config"

	"maesh.dev/ichor/api/compat"
	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/lock"
)

// Executor is what a kind adds to the shared driver.
type Executor interface {
	// Target summarises what the operation moves to (status.target), and the
	// version every machine ends on ("" when the kind changes no version).
	Target(op *ichorv1.TalosOperation) (summary, to string)
	// Scope picks the machines the operation works on from the Nodes that
	// spec.machines selects. An error refuses the operation.
	Scope(op *ichorv1.TalosOperation, nodes []*corev1.Node) ([]*corev1.Node, error)
	// HonourHold says whether the upgrade-hold annotation skips machines.
	HonourHold() bool
	// Check returns the kind's own refusals (besides the version preflight),
	// such as an etcd action on a worker. It may read the Talos API.
	Check(ctx context.Context, e *Env) []string
	// Steps lists a machine's steps in order. It may depend on what earlier
	// steps recorded in the machine's status (its From version, say).
	Steps(op *ichorv1.TalosOperation, m *ichorv1.MachineStatus) []Step
}

// Step is one step on one machine. Exactly one of Run and Wait is set.
type Step struct {
	Name string
	// Run performs the step and returns when it is done or failed. It runs
	// outside the reconcile loop, after the reconciler has recorded in status
	// that the step is starting, and must be idempotent: a restarted
	// controller runs an interrupted step again.
	Run func(ctx context.Context, e *Env) (Outcome, error)
	// Wait checks, on every reconcile (Node events drive them), whether what
	// the step waits for has happened. It must be quick.
	Wait func(ctx context.Context, e *Env) (done bool, o Outcome, err error)
	// Timeout bounds the step; zero means the reconciler's default.
	Timeout time.Duration
	// Irreversible marks a Run step that makes an irreversible call (a
	// reboot, an upgrade that reboots, a shutdown, a reset). Before each
	// run the reconciler counts it in the machine's status (Calls), so the
	// step knows whether an earlier run may have made the call.
	Irreversible bool
	// Chained marks a Run step that may start right after the step before
	// it, in the same run, without a status write between the two: a step
	// that makes no irreversible call and whose start nobody needs recorded
	// before it begins (a check, a read, a cordon and drain). Every status
	// write between a machine's steps is a round trip on the way to its
	// disruption; chaining them takes those off its path. A restarted
	// controller runs the chain again from the step status last recorded,
	// so each step of it must be idempotent, as every Run step is. A chain
	// stops before a step that is not Chained (the one that follows, or the
	// one Outcome.Next jumps to), after a step that is done, and when the
	// operation stops (pause, failure, cancel, delete).
	Chained bool
	// Cordons marks a Chained step that takes the machine out of service (a
	// cordon and drain): in a run, a Confirm of the cluster lock comes right
	// before it, as before a launch, so that it never overlaps a disruption
	// of whoever took the lock over meanwhile; one Confirm covers a cordon
	// and the drain that follows it in the run. The checks and reads
	// chained elsewhere take nothing away and need none.
	Cordons bool
	// Ends, on an Irreversible step, says that the step takes away the
	// API the controller records status in (every control plane shut
	// down together): nothing can record its result. The status write
	// that counts its run (Calls) therefore records the operation's end
	// as well: the machine Succeeded and the operation Succeeded, with
	// Ends as their message (what happens now and what to do next). The
	// step runs only once that write is on the API server, and only by
	// the controller that wrote it; a controller that finds the
	// operation so ended later decides from the machines (EndRecorder).
	Ends string
}

// Outcome is what a finished step records.
type Outcome struct {
	// Done means the machine needs nothing more (it is already on the target).
	Done bool
	// Message replaces the machine's message.
	Message string
	// BootID, From and To, when set, are recorded on the machine.
	BootID string
	From   string
	To     string
	// Next names the step to go to instead of the following one.
	Next string
	// Recheck, from a Wait step that is not done, asks to be checked again
	// after this long: for what Kubernetes cannot announce (the Talos API
	// answering again). Zero waits for the next Node event.
	Recheck time.Duration
}

// Env is what a step may use. Everything in it is read-only; a step reports
// what to record through its Outcome.
type Env struct {
	Op      *ichorv1.TalosOperation
	Machine ichorv1.MachineStatus
	// Node is the machine's Node as the cache has it now (nil if it is gone).
	Node *corev1.Node
	// Address is the machine's Talos node address.
	Address string
	// ControlPlanes are the Talos addresses of every control plane.
	ControlPlanes []string
	Talos         *talosclient.Client
	// Dial builds a Talos client of other credentials than the Secret's
	// (the caller closes it), dialled as the Secret's is: a CA rotation
	// proves new credentials on every machine before the Secret holds them.
	Dial      func(ctx context.Context, cfg *clientconfig.Config) (*talosclient.Client, error)
	Kube      client.Client
	Clientset kubernetes.Interface
	// Identity is the operation's lock identity (it marks the cordons it makes).
	Identity string
	Log      logr.Logger
	// Nodes are every Node of the cluster, as the cache has them (read-only):
	// for cluster-wide steps, which change every machine.
	Nodes []*corev1.Node
	// Live reads from and writes to the API server, not the cache: for
	// objects the controller does not cache (DaemonSets, ConfigMaps).
	Live client.Client
	// Lock is the cluster lock, which a step lends to the Job it starts.
	Lock *lock.Lock
	// Holder is who holds the lock for the operation (by its UID): the
	// lender of a lend, and who takes the lock back.
	Holder lock.Holder
	// Controller is what the controller running the step knows of itself.
	Controller Controller
	// Progress, when set, replaces the machine's message while a Run step
	// runs (a drain says what it waits for); the reconciler records it.
	Progress func(message string)
}

// report passes a Run step's progress on, if anyone listens.
func (e *Env) report(message string) {
	if e.Progress != nil {
		e.Progress(message)
	}
}

// Controller is what a step knows of the controller that runs it.
type Controller struct {
	// Namespace is the controller's namespace, where the cluster lock is.
	Namespace string
	// Version is this controller's version.
	Version string
	// Image is the controller's own image, which the cni kind's Job runs.
	Image string
	// ChartDir is where the image keeps the Cilium chart, and Chart its pin.
	ChartDir string
	Chart    compat.ChartPin
	// Pod is the controller's own pod, "namespace/name" (empty outside
	// one): a drain of its machine evicts it last.
	Pod string
	// Node is the Node the controller's pod runs on (the downward API's
	// spec.nodeName; empty outside a pod): a kind that shuts machines
	// down (StopsMachines) takes it last in its tier.
	Node string
	// Takeover carries an etcd restore on outside the driver once the
	// step that takes the API away begins (nil: the steps run in place,
	// as when they are tested on their own).
	Takeover *Takeover
}

// StepError is a failed step. The reconciler pauses the operation with
// Reason as status.failureReason and never retries it by itself.
type StepError struct {
	// Reason is a CamelCase word for status.failureReason.
	Reason string
	// RetryFrom is the step a retry runs again; empty means the failed step.
	RetryFrom string
	Err       error
}

func (e *StepError) Error() string { return e.Err.Error() }
func (e *StepError) Unwrap() error { return e.Err }

// Fail builds a StepError.
func Fail(reason string, format string, args ...any) error {
	return &StepError{Reason: reason, Err: fmt.Errorf(format, args...)}
}

// Reason is the failureReason of a step's error: the StepError's own, or
// one made from the step's name.
func Reason(step string, err error) string {
	var se *StepError
	if errors.As(err, &se) && se.Reason != "" {
		return se.Reason
	}
	return FailureReason(step)
}

// FailureReason turns a step name into the failureReason of an error that
// did not name one: "etcd-health" fails as "EtcdHealthFailed".
func FailureReason(step string) string {
	var b strings.Builder
	up := true
	for _, r := range step {
		if r == '-' || r == '_' || r == ' ' {
			up = true
			continue
		}
		if up {
			r = unicode.ToUpper(r)
			up = false
		}
		b.WriteRune(r)
	}
	return b.String() + "Failed"
}

// Registry maps kinds to their executors.
type Registry map[ichorv1.OperationKind]Executor

// Default is the registry of the kinds this controller carries out.
func Default() Registry {
	return Registry{
		ichorv1.KindTalos:       TalosUpgrade{},
		ichorv1.KindKubernetes:  KubernetesUpgrade{},
		ichorv1.KindCNI:         CNIChange{},
		ichorv1.KindIchor:       IchorUpgrade{},
		ichorv1.KindConfig:      NewConfigRollout(),
		ichorv1.KindNode:        NodeAction{},
		ichorv1.KindCARotation:  CARotation{},
		ichorv1.KindKeyRotation: NewKeyRotation(),
		ichorv1.KindShutdown:    ClusterShutdown{},
		ichorv1.KindEtcdRestore: EtcdRestore{},
	}
}

// Kinds lists the kinds the registry carries out, in the API's order.
func (r Registry) Kinds() []ichorv1.OperationKind {
	var out []ichorv1.OperationKind
	for _, k := range ichorv1.Kinds {
		if r[k] != nil {
			out = append(out, k)
		}
	}
	return out
}

// Planner is implemented by executors that can say, before anything runs,
// what the operation would do to each machine. While the operation has not
// started, the driver calls Plan instead of Check and shows the plan as each
// Pending machine's message, so that an operation created paused can be
// reviewed before it is resumed.
type Planner interface {
	// Plan says in a few words what the operation would do to the machine
	// ("plan: changes, needs a reboot"), and the kind's refusals as Check
	// returns them but without the machine's name: the driver names the
	// machines, once per refusal. It may read the Talos API; it changes
	// nothing.
	Plan(ctx context.Context, e *Env) (plan string, refusals []string)
}

// MachineBound is implemented by the kinds whose steps read nothing of the
// other machines (MachineBound returns true): neither their entries in
// status (Env.Op.Status.Machines) nor their Nodes (Env.Nodes). Their
// steps' Env has the operation without status.machines, and no Nodes. A
// step holds its Env until it ends, and with them each turn's copy of
// every machine's entry, and the Nodes as that turn read them, would stay
// in memory for as long as a step that turn started runs: at 5,000
// machines, a few megabytes a turn.
type MachineBound interface {
	MachineBound() bool
}

// LockIdentifier is implemented by executors whose operations take the
// cluster lock under another identity than the operation's own (a
// control-plane reset is a removal, held under the machine's identity). An
// empty identity means the operation's own.
type LockIdentifier interface {
	LockIdentity(op *ichorv1.TalosOperation, role ichorv1.MachineRole) string
}

// Stager is implemented by the kinds made of stages. The driver runs the
// stages in order, each over its machines (those of its roles) in its
// order, and begins a stage only once the one before has finished on every
// machine: each machine's phase and step in status are then its own within
// the stage in progress (status.stage), which Steps reads to give the
// machine's steps there. A machine skipped stays skipped in the stages
// after. The step names of one stage may be used again in another.
type Stager interface {
	// Stages lists the stages in order: name, roles and order of each
	// (ichorv1.StageStatus without its times and progress).
	Stages(op *ichorv1.TalosOperation) []ichorv1.StageStatus
}

// StopsMachines is implemented by kinds that leave the machines they are
// done with powered off. The machine the controller runs on
// (Controller.Node) goes last in its tier, so that the others are done
// before the step that ends this process (its drain, its shutdown); and a
// worker the operation is done with counts no more against
// maxUnavailable: it is down on purpose.
type StopsMachines interface {
	StopsMachines() bool
}

// EndRecorder is implemented by kinds with a step that Ends the
// operation. The driver calls Ended on every turn of an operation so
// ended, with the machine whose step ended it, until it says it is done
// with it: the kind looks at the machines (did the call go out, has the
// cluster come back), records what it found in the operation's
// conditions, and may ask for the ending step to run again (relaunch:
// the controller that wrote its intent did not make its call, or may not
// have) or to be looked at again after a while.
type EndRecorder interface {
	Ended(ctx context.Context, e *Env) (EndState, error)
}

// EndState is what an EndRecorder found of an ended operation.
type EndState struct {
	// Condition, when set, is recorded in the operation's conditions.
	Condition *metav1.Condition
	// Relaunch runs the ending step again, its run counted first (Calls):
	// it decides from the machines whether the call was made.
	Relaunch bool
	// Uncordon lifts the cordons the operation made.
	Uncordon bool
	// Done: nothing more to look at.
	Done bool
	// Recheck looks again after this long (zero: at the next event).
	Recheck time.Duration
}
