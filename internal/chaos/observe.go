package chaos

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	watchtools "k8s.io/client-go/tools/watch"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/controller/machine"
	"maesh.dev/ichor/sim"
)

// observer watches what the invariants judge besides the simulator: every
// change of the cluster lock's holder and of the leader, and every version
// of every operation. Watches deliver every change in order (no relist
// coalesces two), so no holder goes unseen.
type observer struct {
	tl *timeline

	mu      sync.Mutex
	changes []LeaseChange
	leader  string
	leaders int // leader changes after the first leader
	ops     map[string][]OpState
}

func newObserver(tl *timeline) *observer {
	return &observer{tl: tl, ops: map[string][]OpState{}}
}

// watchLeases follows the Leases of the controller's namespace: the lock's
// holders and the leader's.
func (o *observer) watchLeases(ctx context.Context, kube kubernetes.Interface, ns string) error {
	leases := kube.CoordinationV1().Leases(ns)
	lw := &cache.ListWatch{WatchFuncWithContext: func(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error) {
		return leases.Watch(ctx, opts)
	}}
	list, err := leases.List(ctx, metav1.ListOptions{})
	if err != nil {
		return fmt.Errorf("list leases: %w", err)
	}
	for i := range list.Items {
		o.lease(&list.Items[i], false)
	}
	return o.follow(ctx, list.ResourceVersion, lw, func(ev watch.Event) {
		if l, ok := ev.Object.(*coordinationv1.Lease); ok {
			o.lease(l, ev.Type == watch.Deleted)
		}
	})
}

// watchOps follows the TalosOperations of ns.
func (o *observer) watchOps(ctx context.Context, c client.WithWatch, ns string) error {
	var list ichorv1.TalosOperationList
	if err := c.List(ctx, &list, client.InNamespace(ns)); err != nil {
		return fmt.Errorf("list operations: %w", err)
	}
	for i := range list.Items {
		o.op(&list.Items[i], false)
	}
	lw := &cache.ListWatch{WatchFuncWithContext: func(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error) {
		return c.Watch(ctx, &ichorv1.TalosOperationList{}, client.InNamespace(ns), &client.ListOptions{Raw: &opts})
	}}
	return o.follow(ctx, list.ResourceVersion, lw, func(ev watch.Event) {
		if op, ok := ev.Object.(*ichorv1.TalosOperation); ok {
			o.op(op, ev.Type == watch.Deleted)
		}
	})
}

// watchNodes follows the fleet's Nodes for the timeline: Ready, cordons
// (and whose), holds.
func (o *observer) watchNodes(ctx context.Context, kube kubernetes.Interface, fleet string) error {
	nodes := kube.CoreV1().Nodes()
	opts := metav1.ListOptions{LabelSelector: sim.FleetLabel + "=" + fleet}
	list, err := nodes.List(ctx, opts)
	if err != nil {
		return fmt.Errorf("list nodes: %w", err)
	}
	seen := map[string]string{}
	lw := &cache.ListWatch{WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
		o.LabelSelector = opts.LabelSelector
		return nodes.Watch(ctx, o)
	}}
	return o.follow(ctx, list.ResourceVersion, lw, func(ev watch.Event) {
		n, ok := ev.Object.(*corev1.Node)
		if !ok {
			return
		}
		state := fmt.Sprintf("ready=%v unschedulable=%v", machine.Ready(n), n.Spec.Unschedulable)
		if by := n.Annotations[executor.CordonedByAnnotation]; by != "" {
			state += " cordoned-by=" + by
		}
		if _, held := n.Annotations[ichorv1.UpgradeHoldAnnotation]; held {
			state += " held"
		}
		if ev.Type == watch.Deleted {
			state = "deleted"
		}
		if seen[n.Name] != state {
			seen[n.Name] = state
			o.tl.add(time.Now(), "node %s: %s", n.Name, state)
		}
	})
}

// follow runs a watch from rv until ctx ends, resuming where it broke.
func (o *observer) follow(ctx context.Context, rv string, lw cache.WatcherWithContext, handle func(watch.Event)) error {
	w, err := watchtools.NewRetryWatcherWithContext(ctx, rv, lw)
	if err != nil {
		return err
	}
	go func() {
		defer w.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case ev, ok := <-w.ResultChan():
				if !ok {
					return
				}
				if ev.Type == watch.Error {
					o.tl.add(time.Now(), "observer: watch error %v", ev.Object)
					continue
				}
				handle(ev)
			}
		}
	}()
	return nil
}

func (o *observer) lease(l *coordinationv1.Lease, deleted bool) {
	now := time.Now()
	holder := ptr.Deref(l.Spec.HolderIdentity, "")
	if deleted {
		holder = ""
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	switch l.Name {
	case ichorv1.LeaderLeaseName:
		if holder != "" && holder != o.leader {
			if o.leader != "" {
				o.leaders++
			}
			o.leader = holder
			o.tl.add(now, "leader: %s", holder)
		}
	case ichorv1.LockLeaseName:
		prev := ""
		if n := len(o.changes); n > 0 {
			prev = o.changes[n-1].Holder
		}
		if holder == prev {
			return
		}
		at := now
		// The writer's own times are earlier than the watch: whoever acts
		// under the new holder acts after its write, so after them.
		if t := l.Spec.AcquireTime; holder != "" && t != nil && t.Before(&metav1.MicroTime{Time: at}) {
			at = t.Time
		}
		if t := l.Spec.RenewTime; holder == "" && !deleted && t != nil && t.Before(&metav1.MicroTime{Time: at}) {
			at = t.Time
		}
		if n := len(o.changes); n > 0 && at.Before(o.changes[n-1].At) {
			at = o.changes[n-1].At // never before the change it follows
		}
		o.changes = append(o.changes, LeaseChange{At: at, Seen: now, Holder: holder})
		o.tl.add(at, "lock: %s", orNobody(holder))
	}
}

func (o *observer) op(op *ichorv1.TalosOperation, deleted bool) {
	st := opState(op)
	st.Gone = deleted
	o.mu.Lock()
	defer o.mu.Unlock()
	vs := o.ops[st.Name]
	if n := len(vs); n > 0 {
		if diff := vs[n-1].diff(st); diff != "" {
			o.tl.add(st.Seen, "op %s: %s", st.Name, diff)
		}
	} else {
		o.tl.add(st.Seen, "op %s: seen, %s", st.Name, st.summary())
	}
	o.ops[st.Name] = append(vs, st)
}

func opState(op *ichorv1.TalosOperation) OpState {
	s := OpState{
		Seen: time.Now(), Name: op.Name, Kind: string(op.Spec.Kind), MaxUnavailable: int(op.Spec.MaxUnavailable),
		Phase: string(op.Status.Phase), Reason: op.Status.Reason, FailureReason: op.Status.FailureReason, Message: op.Status.Message,
		Paused: op.Spec.Paused, Deleting: !op.DeletionTimestamp.IsZero(),
	}
	if n := op.Spec.Node; n != nil {
		s.NodeAction, s.Machine = string(n.Action), n.Machine
	}
	if t := op.Spec.Talos; t != nil {
		s.Target = t.Version
	}
	for _, m := range op.Status.Machines {
		s.Machines = append(s.Machines, MachineState{Name: m.Name, Phase: string(m.Phase), Step: m.Step, From: m.From, To: m.To,
			Message: m.Message, Attempts: m.Attempts})
	}
	return s
}

func (s OpState) summary() string {
	parts := []string{orDash(s.Phase)}
	for _, p := range []string{s.Reason, s.FailureReason} {
		if p != "" {
			parts = append(parts, p)
		}
	}
	return strings.Join(parts, " ")
}

// diff says what changed from s to n, for the timeline.
func (s OpState) diff(n OpState) string {
	var parts []string
	if n.Gone {
		return "gone"
	}
	if s.Phase != n.Phase || s.Reason != n.Reason || s.FailureReason != n.FailureReason {
		parts = append(parts, n.summary())
	}
	if s.Paused != n.Paused {
		parts = append(parts, fmt.Sprintf("paused=%v", n.Paused))
	}
	if !s.Deleting && n.Deleting {
		parts = append(parts, "deleting")
	}
	was := map[string]MachineState{}
	for _, m := range s.Machines {
		was[m.Name] = m
	}
	for _, m := range n.Machines {
		if p := was[m.Name]; p.Phase != m.Phase || p.Step != m.Step || p.Attempts != m.Attempts {
			parts = append(parts, fmt.Sprintf("%s %s %s/%d", m.Name, m.Phase, orDash(m.Step), m.Attempts))
		}
	}
	return strings.Join(parts, "; ")
}

// snapshot copies what was observed into h.
func (o *observer) snapshot(h *History) {
	o.mu.Lock()
	defer o.mu.Unlock()
	h.Lease = append([]LeaseChange(nil), o.changes...)
	h.Ops = make(map[string][]OpState, len(o.ops))
	for k, v := range o.ops {
		h.Ops[k] = append([]OpState(nil), v...)
	}
}

// holderAttempt is the lock's holder as last seen, and the attempt its
// operation (if it is one) is at on machine.
func (o *observer) holderAttempt(machine string) (string, int32) {
	o.mu.Lock()
	defer o.mu.Unlock()
	holder := ""
	if n := len(o.changes); n > 0 {
		holder = o.changes[n-1].Holder
	}
	id, err := ichorv1.ParseLockHolder(holder)
	if err != nil {
		return holder, 0
	}
	var attempt int32
	for name, vs := range o.ops {
		if name != id.Name && (id.Kind != ichorv1.HolderMachine || len(vs) == 0 || vs[len(vs)-1].Machine != id.Name) {
			continue
		}
		for _, m := range vs[len(vs)-1].Machines {
			if m.Name == machine && m.Attempts > attempt {
				attempt = m.Attempts
			}
		}
	}
	return holder, attempt
}

func (o *observer) leaderChanges() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.leaders
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
