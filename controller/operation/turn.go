package operation

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"time"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/controller/lock"
	"maesh.dev/ichor/controller/machine"
	"maesh.dev/ichor/controller/plan"
	"maesh.dev/ichor/controller/preflight"
	"maesh.dev/ichor/controller/talos"
)

// turn is one reconcile of one operation: the scope every phase works in.
// It reads the clock when it begins, so every time a turn records or judges
// (a machine's start, a step's deadline, the completion) is the same
// instant; only the turn that starts the operation reads it again, once it
// holds the cluster lock (start).
type turn struct {
	r *Reconciler
	// now is the turn's time, read when the turn begins (and by start).
	now metav1.Time
	// persisted is the operation as read, and once write has saved the
	// working copy, as written: only steps it records may start. The phases
	// never change it.
	persisted *ichorv1.TalosOperation
	// op is the working copy. The phases change its facts (machines, the
	// failure, the lock, the checks, startTime); deriveStatus then sets its
	// phase, reason, message and conditions; write saves it.
	op  *ichorv1.TalosOperation
	log logr.Logger

	// exec is the executor of the operation's kind, set by prepare (nil
	// when this controller does not carry the kind out).
	exec executor.Executor
	// nodes are every Node as the cache has them (the cache's own objects:
	// read-only), listed by prepare.
	nodes []*corev1.Node
	// byName and cps index nodes; node and controlPlanes build them on first use.
	byName map[string]*corev1.Node
	cps    []string
	// talos is the turn's hold on the Talos API client, set by prepare once
	// a talosconfig is usable; the steps it launches take holds of their own.
	talos *talos.Use

	// why says why the operation cannot move on right now, when no status
	// field says it (the lock's holder and since when, the budget): the
	// phases set it, deriveStatus puts it in the message.
	why string
	// dropRetry and dropSkip remove the retry and the skip request's
	// annotations once status is written.
	dropRetry, dropSkip bool
	// canLaunch says the steps that persisted status records as in progress
	// may start once status is written.
	canLaunch bool
	// lockSeen is the Lease as acquire read it, holding the lock: launch's
	// Confirm writes it without reading it again.
	lockSeen lock.Seen
	// checkedAt is when the checks before the lock began their reads, once
	// they passed; freeAt, for a free lock that acquire took, when its
	// Lease was last known free (checkOnceHeld).
	checkedAt, freeAt time.Time
	// events are emitted once status is written.
	events []func()
}

func (r *Reconciler) newTurn(op *ichorv1.TalosOperation, log logr.Logger) *turn {
	return &turn{r: r, now: metav1.NewTime(r.now()), persisted: op, op: op.DeepCopy(), log: log}
}

// event queues an Event on the operation, emitted once status is written.
func (t *turn) event(eventType, reason, format string, args ...any) {
	op := t.persisted
	t.events = append(t.events, func() {
		t.r.Recorder.Eventf(op, nil, eventType, reason, reason, format, args...)
	})
}

// started reports whether the operation has started running (its machines
// are fixed from then on).
func (t *turn) started() bool { return t.op.Status.StartTime != nil }

// prepare finds the executor, lists the Nodes, (re)plans an operation that
// has not started and connects to the Talos API. It returns true when the
// turn has decided already: the operation is refused, or no talosconfig is
// usable (said in the TalosAPIReady condition).
func (t *turn) prepare(ctx context.Context) (bool, error) {
	op := t.op
	t.exec = t.r.Executors[op.Spec.Kind]
	if t.exec == nil {
		t.refuse([]preflight.Failure{{Check: CheckKindSupported, Message: ichorv1.KindNotCarriedOut(op.Spec.Kind, t.r.Executors.Kinds())}})
		return true, nil
	}
	if op.Refused() {
		// spec.override was set on a refused operation: check it again and run it that way.
		setChecks(op, nil, false)
	}
	if err := t.loadNodes(ctx); err != nil {
		return true, err
	}
	if !t.started() {
		if err := t.plan(); err != nil {
			t.refuse([]preflight.Failure{{Check: preflight.MachinesInScope, Message: err.Error()}})
			return true, nil
		}
	}
	tc, err := t.r.Talos.Use(ctx)
	var cfgErr *talos.ConfigError
	if errors.As(err, &cfgErr) {
		meta.SetStatusCondition(&op.Status.Conditions, metav1.Condition{Type: ConditionTalosAPI, Status: metav1.ConditionFalse,
			Reason: cfgErr.Reason, Message: cfgErr.Message, ObservedGeneration: op.Generation})
		return true, nil
	}
	if err != nil {
		return true, err
	}
	meta.RemoveStatusCondition(&op.Status.Conditions, ConditionTalosAPI)
	t.talos = tc
	return false, nil
}

// plan (re)builds the machine list of an operation that has not started, so
// that Nodes joining or holds added while it waits are taken into account.
func (t *turn) plan() error {
	op := t.op
	selected, err := t.selected()
	if err != nil {
		return err
	}
	inScope, err := t.exec.Scope(op, selected)
	if err != nil {
		return err
	}
	if len(inScope) == 0 {
		if op.Spec.Machines != nil {
			return errors.New("spec.machines selects no Node: check the selector against `kubectl get nodes --show-labels`")
		}
		return errors.New("the cluster has no Nodes")
	}
	summary, to := t.exec.Target(op)
	self := ""
	if s, ok := t.exec.(executor.StopsMachines); ok && s.StopsMachines() {
		self = t.r.Controller.Node
	}
	ms := make([]plan.Machine, 0, len(inScope))
	for _, n := range inScope {
		m := plan.Machine{Name: n.Name, Role: machine.Role(n), Labels: n.Labels, Annotations: n.Annotations, Last: self != "" && n.Name == self}
		// From is a version only for kinds that move machines to one; the
		// others leave it to their steps (a config rollout keeps status
		// small: only the fingerprint it applies, in To).
		if to != "" {
			m.Version = machine.TalosVersion(n)
		}
		ms = append(ms, m)
	}
	op.Status.Target = summary
	op.Status.Machines = plan.Initial(ms, to, t.exec.HonourHold())
	op.Status.Stages = nil
	if s, ok := t.exec.(executor.Stager); ok {
		op.Status.Stages = s.Stages(op)
	}
	return nil
}

func (t *turn) selected() ([]*corev1.Node, error) {
	if t.op.Spec.Machines == nil {
		return t.nodes, nil
	}
	sel, err := metav1.LabelSelectorAsSelector(t.op.Spec.Machines)
	if err != nil {
		return nil, fmt.Errorf("spec.machines: %w", err)
	}
	var out []*corev1.Node
	for _, n := range t.nodes {
		if sel.Matches(labels.Set(n.Labels)) {
			out = append(out, n)
		}
	}
	return out, nil
}

// loadNodes reads every Node into t.nodes, once a turn.
func (t *turn) loadNodes(ctx context.Context) error {
	if t.nodes != nil {
		return nil
	}
	nodes, err := t.r.nodes.list(ctx)
	if err != nil {
		return err
	}
	t.nodes = nodes
	return nil
}

// node returns the machine's Node (nil if gone), from an index built once per turn.
func (t *turn) node(name string) *corev1.Node {
	if t.byName == nil {
		t.byName = make(map[string]*corev1.Node, len(t.nodes))
		for _, n := range t.nodes {
			t.byName[n.Name] = n
		}
	}
	return t.byName[name]
}

// controlPlanes are the Talos addresses of every control plane, computed once per turn.
func (t *turn) controlPlanes() []string {
	if t.cps != nil {
		return t.cps
	}
	t.cps = []string{}
	for _, n := range t.nodes {
		if machine.Role(n) == ichorv1.RoleControlPlane {
			if a := machine.Address(n); a != "" {
				t.cps = append(t.cps, a)
			}
		}
	}
	sort.Strings(t.cps)
	return t.cps
}

// releaseTalos lets go of the turn's hold on the Talos client.
func (t *turn) releaseTalos() {
	if t.talos != nil {
		t.talos.Release()
	}
}

func (t *turn) key(name string) machineKey { return machineKey{op: t.persisted.UID, machine: name} }

// stepEnv is the Env of a step on machine m: env, without the other
// machines' entries and Nodes for a MachineBound kind.
func (t *turn) stepEnv(m ichorv1.MachineStatus) *executor.Env {
	e := t.env(m)
	if mb, ok := t.exec.(executor.MachineBound); ok && mb.MachineBound() {
		e.Op, e.Nodes = withoutMachines(e.Op), nil
	}
	return e
}

// withoutMachines is op without status.machines: a shallow copy, read-only
// as op is.
func withoutMachines(op *ichorv1.TalosOperation) *ichorv1.TalosOperation {
	out := *op
	out.Status.Machines = nil
	return &out
}

// env is what the kind's code on machine m may use: its checks, its plan,
// what it records of an ended operation (stepEnv for its steps).
func (t *turn) env(m ichorv1.MachineStatus) *executor.Env {
	n := t.node(m.Name)
	addr := ""
	if n != nil {
		addr = machine.Address(n)
	}
	e := &executor.Env{
		Op: t.persisted, Machine: m, Node: n, Address: addr, ControlPlanes: t.controlPlanes(),
		Kube: t.r.Client, Clientset: t.r.Clientset,
		Identity: ichorv1.OperationIdentity(t.op.Namespace, t.op.Name), Log: t.log,
		Nodes: t.nodes, Live: t.r.live(), Lock: t.r.Lock, Holder: t.holder(), Controller: t.r.Controller,
	}
	if t.talos != nil {
		e.Talos = t.talos.Client
	}
	if t.r.Talos != nil {
		e.Dial = t.r.Talos.Dial
	}
	return e
}
