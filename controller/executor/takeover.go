package executor

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/go-logr/logr"
	talosclient "github.com/siderolabs/talos/pkg/machinery/client"
	clientconfig "github.com/siderolabs/talos/pkg/machinery/client/config"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/journal"
)

// Takeover carries an etcd restore through the part of its flow that
// takes the API away (the reset of every control plane, the recovery, the
// wait for the members) outside the driver: the API, the operation's
// status and the controller's leadership are gone meanwhile, and the
// store the operation was in is rewound after. Its state is journalled in
// META on the control planes before each step (and before each
// irreversible call, its count), and what it needs to reach them (the
// talosconfig, the addresses) in a hand-over file on the controller's own
// disk, so a controller killed at any point resumes from the journal
// without the API. Once etcd is restored it writes the operation back
// (journal.WriteBack) and clears the journal.
type Takeover struct {
	// Dir keeps the hand-over file (a volume of the controller's pod).
	Dir string
	// Pod is the controller's own pod, "namespace/name" (Controller.Pod;
	// empty outside a pod): the journal names it as the restore's owner.
	Pod string
	// Kube and Clientset reach the API once it is back.
	Kube      client.Client
	Clientset kubernetes.Interface
	Log       logr.Logger
	// Dial options for the Talos client (tests redial fast).
	TalosOptions []talosclient.OptionFunc
	// TestHookAfterStep, when set, is called after a step of the tail
	// returns, before the journal records the next: tests kill the
	// controller there. Nil in production.
	TestHookAfterStep func(machine, step string, err error)

	mu    sync.Mutex
	base  context.Context
	owned map[types.NamespacedName]bool
	wg    sync.WaitGroup
}

// handover is what a resumed takeover needs before the API answers: the
// operation it owns (so that the driver leaves it alone from the start),
// the talosconfig and the addresses.
type handover struct {
	Namespace     string   `json:"namespace"`
	Name          string   `json:"name"`
	Talosconfig   []byte   `json:"talosconfig"`
	ControlPlanes []string `json:"controlPlanes"`
	Address       string   `json:"address"`
}

func (h handover) key() types.NamespacedName {
	return types.NamespacedName{Namespace: h.Namespace, Name: h.Name}
}

// tail are the steps the takeover runs, in order: the etcd-restore
// kind's from the reset on (a function: the reset step refers to the
// takeover).
func tail() []Step { return (EtcdRestore{}).Steps(nil, nil)[2:] }

func (t *Takeover) file() string { return filepath.Join(t.Dir, "etcd-restore-handover.json") }

// Owns says whether a takeover carries the operation out now: the driver
// leaves it alone (its status in a rewound store is from before).
func (t *Takeover) Owns(key types.NamespacedName) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.owned[key]
}

// Start gives the takeover the controller's lifetime, on which the tails
// Begin hands over run, and resumes one a killed controller left. The
// controller calls it before its manager starts, whose runnables wait for
// the API that a takeover brings back.
func (t *Takeover) Start(ctx context.Context) error {
	t.mu.Lock()
	t.base = ctx
	t.mu.Unlock()
	return t.Resume(ctx)
}

// lifetime is the context the tails run on: Start's, or ctx without one
// (tests that call Begin on their own).
func (t *Takeover) lifetime(ctx context.Context) context.Context {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.base != nil {
		return t.base
	}
	return ctx
}

// Begin hands the operation over: the journal of the operation and its
// machine (carried on from an earlier Begin of the same operation, whose
// reset may have been made, or from another controller's whose pod is
// gone: mayContinue), once the snapshot is on this controller's disk; then
// the hand-over file with the talosconfig (read while the API is there),
// and then the tail runs on the
// takeover's lifetime (Start's context: the controller's, not its
// leadership; ctx without one). It returns once the hand-over is durable,
// with a channel that gives the tail's end.
func (t *Takeover) Begin(ctx context.Context, e *Env, talosconfig []byte) (<-chan error, error) {
	h := handover{Namespace: e.Op.Namespace, Name: e.Op.Name, Talosconfig: talosconfig, ControlPlanes: e.ControlPlanes, Address: e.Address}
	j := journal.Journal{Talos: e.Talos, ControlPlanes: e.ControlPlanes}
	st, _, err := j.ReadState(ctx)
	if err != nil {
		return nil, err
	}
	switch {
	case st == nil:
		m := e.Machine
		m.Step, m.Calls = tail()[0].Name, 0
		st = &journal.State{UID: e.Op.UID, Machine: m}
	case st.UID != e.Op.UID:
		return nil, fmt.Errorf("the journal in META (keys 0x%x, 0x%x) holds another operation's etcd restore (uid %s) that did not finish: "+
			"see the README's etcd restore section; once that restore is dealt with, clear the keys (talosctl meta delete) and retry", journal.StateKey, journal.OperationKey, st.UID)
	default:
		if err := t.mayContinue(ctx, st); err != nil {
			return nil, err
		}
		st.Machine.Phase = ichorv1.MachineInProgress // a retry after a failure of the tail
	}
	// The recovery uploads the snapshot once the API, and with it an s3://
	// snapshot's credentials, is gone: it must be on this controller's
	// disk now. Not only when continuing another's journal: a replica that
	// took the lead after check-snapshot ran elsewhere starts a fresh one
	// without a copy too.
	if _, err := fetchSnapshot(ctx, e); err != nil {
		return nil, fmt.Errorf("the snapshot, which the recovery uploads once the API is gone: %w", err)
	}
	st.Seq++
	st.Owner = t.Pod
	if err := j.WriteOperation(ctx, e.Op); err != nil {
		return nil, err
	}
	if err := j.WriteState(ctx, *st); err != nil {
		return nil, err
	}
	if back, _, err := j.ReadState(ctx); err != nil || back == nil {
		return nil, fmt.Errorf("read the journal back: %v", err)
	}
	if err := t.writeHandover(h); err != nil {
		return nil, err
	}
	t.own(h.key(), true)
	c, err := t.dial(ctx, h)
	if err != nil {
		t.own(h.key(), false)
		return nil, err
	}
	return t.start(t.lifetime(ctx), h, c), nil
}

// HeldError is a journal of the same operation that another controller's
// takeover may be running: the pod it names as the owner is still there.
// A second takeover would make the tail's irreversible calls again.
type HeldError struct {
	// Owner is the pod the journal names; Step the step it journalled.
	Owner, Step string
}

func (e *HeldError) Error() string {
	return fmt.Sprintf("the takeover of pod %s carries this etcd restore out (journalled step %s); "+
		"this controller waits until that takeover ends or its pod is gone", e.Owner, e.Step)
}

// mayContinue says whether this controller may continue the journal st of
// its operation: it owns it, no pod does (a controller outside a pod), its
// tail failed (a retry), or the pod that owns it is gone, and with it the
// takeover and its hand-over file. A pod that exists may still run the
// tail: a HeldError.
func (t *Takeover) mayContinue(ctx context.Context, st *journal.State) error {
	if st.Owner == "" || st.Owner == t.Pod || st.Machine.Phase == ichorv1.MachineFailed {
		return nil
	}
	gone, err := t.podGone(ctx, st.Owner)
	if err != nil {
		return fmt.Errorf("look for pod %s, which the journal names as the etcd restore's owner: %w", st.Owner, err)
	}
	if !gone {
		return &HeldError{Owner: st.Owner, Step: st.Machine.Step}
	}
	t.Log.Info("continuing the etcd restore of a controller whose pod is gone", "owner", st.Owner, "step", st.Machine.Step)
	return nil
}

// podGone says whether the pod ("namespace/name") no longer runs: deleted,
// or ended (an evicted pod's phase is Failed). One that is terminating may
// still run the tail, which its process finishes before it exits.
func (t *Takeover) podGone(ctx context.Context, pod string) (bool, error) {
	ns, name, _ := strings.Cut(pod, "/")
	var p corev1.Pod
	err := t.Kube.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, &p)
	if apierrors.IsNotFound(err) {
		return true, nil
	}
	if err != nil {
		return false, err
	}
	return p.Status.Phase == corev1.PodFailed || p.Status.Phase == corev1.PodSucceeded, nil
}

// writeHandover writes the hand-over file, whole or not at all.
func (t *Takeover) writeHandover(h handover) error {
	b, err := json.Marshal(h)
	if err != nil {
		return err
	}
	tmp := t.file() + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return fmt.Errorf("write the hand-over file: %w", err)
	}
	if err := os.Rename(tmp, t.file()); err != nil {
		return fmt.Errorf("write the hand-over file: %w", err)
	}
	return nil
}

// dial builds the tail's own Talos client from the hand-over: it outlives
// the driver's, which closes with the leadership.
func (t *Takeover) dial(ctx context.Context, h handover) (*talosclient.Client, error) {
	cfg, err := clientconfig.FromBytes(h.Talosconfig)
	if err != nil {
		return nil, fmt.Errorf("hand-over file %s: %w", t.file(), err)
	}
	return talosclient.New(ctx, append([]talosclient.OptionFunc{talosclient.WithConfig(cfg)}, t.TalosOptions...)...)
}

// HandOver is the driver's reset-control-planes step when the controller
// has a takeover: once status records the step (its intent), the tail is
// handed over, and the step waits for it to end (or for the leadership to
// go, when the tail goes on without it). The takeover writes the
// operation's final status itself; the driver leaves the operation alone
// meanwhile (Owns).
func (t *Takeover) HandOver(ctx context.Context, e *Env) (Outcome, error) {
	cfg, err := ReadTalosconfig(ctx, e.Kube, e.Controller.Namespace)
	if err != nil {
		return Outcome{}, err
	}
	done, err := t.Begin(ctx, e, cfg)
	for held := (*HeldError)(nil); errors.As(err, &held); {
		if out, end, err := t.awaitHolder(ctx, e, held); end {
			return out, err
		}
		done, err = t.Begin(ctx, e, cfg)
	}
	if err != nil {
		return Outcome{}, Fail("HandOverFailed", "hand the etcd restore over to the takeover: %w", err)
	}
	e.report("handed over: the takeover resets the control planes and restores etcd; the API goes away meanwhile")
	select {
	case err := <-done:
		if err != nil {
			return Outcome{}, Fail("RestoreFailed", "%w", err)
		}
		return Outcome{Done: true, Message: "etcd restored; the takeover wrote the final status"}, nil
	case <-ctx.Done():
		return Outcome{}, ctx.Err()
	}
}

// awaitHolder waits while the journal's owner, another controller's pod,
// may run the tail (HeldError): it ends the step once that tail ends
// (the journal cleared: the restore done, written back by the owner; or
// failed, which this step then records), and says to Begin again once the
// pod is gone or the journal names another owner. It never starts a
// journal of its own: one cleared meanwhile is the owner's restore done.
func (t *Takeover) awaitHolder(ctx context.Context, e *Env, held *HeldError) (Outcome, bool, error) {
	j := journal.Journal{Talos: e.Talos, ControlPlanes: e.ControlPlanes}
	for {
		e.report(held.Error())
		if err := pause(ctx, 2*time.Second); err != nil {
			return Outcome{}, true, err
		}
		st, _, err := j.ReadState(ctx)
		switch {
		case err != nil:
			continue // the owner's reset under way: the API, and this leadership, go next
		case st == nil:
			return Outcome{Done: true, Message: "etcd restored by the takeover of pod " + held.Owner + ", which wrote the final status"}, true, nil
		case st.UID != e.Op.UID || st.Owner != held.Owner:
			return Outcome{}, false, nil
		case st.Machine.Phase == ichorv1.MachineFailed:
			return Outcome{}, true, Fail("RestoreFailed", "the takeover of pod %s failed at %s: %s", held.Owner, st.Machine.Step, st.Machine.Message)
		}
		if gone, err := t.podGone(ctx, held.Owner); err == nil && gone {
			return Outcome{}, false, nil
		}
	}
}

// TakenOverError is a journal whose owner is another controller's pod: it
// continued the restore once this one's pod looked gone (deleted while its
// process lived on, cut off with its node), and only it writes now.
type TakenOverError struct{ Owner string }

func (e *TakenOverError) Error() string {
	return fmt.Sprintf("the etcd restore was taken over by the controller of pod %s: this one stops", e.Owner)
}

// ownedBy says, of the journal st, whether this controller still owns it.
func (t *Takeover) ownedBy(st *journal.State) error {
	if st.Owner != "" && st.Owner != t.Pod {
		return &TakenOverError{Owner: st.Owner}
	}
	return nil
}

// Busy says whether a takeover carries an operation out now.
func (t *Takeover) Busy() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.owned) > 0
}

// own marks the operation as the takeover's, or not.
func (t *Takeover) own(key types.NamespacedName, yes bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.owned == nil {
		t.owned = map[types.NamespacedName]bool{}
	}
	if yes {
		t.owned[key] = true
	} else {
		delete(t.owned, key)
	}
}

// Resume picks up a takeover a killed controller left: with a hand-over
// file it reads the journal from the control planes and runs the tail
// from the step journalled. It returns at once; the tail runs on ctx.
func (t *Takeover) Resume(ctx context.Context) error {
	b, err := os.ReadFile(t.file())
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	var h handover
	if err := json.Unmarshal(b, &h); err != nil {
		return fmt.Errorf("hand-over file %s: %w", t.file(), err)
	}
	c, err := t.dial(ctx, h)
	if err != nil {
		return err
	}
	t.own(h.key(), true)
	t.start(ctx, h, c)
	return nil
}

// Wait waits for the tails running to end (tests).
func (t *Takeover) Wait() { t.wg.Wait() }

// start runs the tail in a goroutine with its own client c, the
// operation owned until it ends; the channel gives its end.
func (t *Takeover) start(ctx context.Context, h handover, c *talosclient.Client) <-chan error {
	done := make(chan error, 1)
	t.wg.Add(1)
	go func() {
		defer t.wg.Done()
		defer c.Close()
		defer t.own(h.key(), false)
		err := t.run(ctx, h, c)
		if err != nil && ctx.Err() == nil {
			t.Log.Error(err, "etcd restore takeover")
		}
		done <- err
	}()
	return done
}

// run reads the journal (retrying while no control plane answers) and
// runs the tail from its step, journalling each step and each
// irreversible call's count before it starts.
func (t *Takeover) run(ctx context.Context, h handover, c *talosclient.Client) error {
	j := journal.Journal{Talos: c, ControlPlanes: h.ControlPlanes}
	var st *journal.State
	var jop *journal.Operation
	for {
		var err error
		st, jop, err = j.ReadState(ctx)
		if err == nil {
			break
		}
		if pause(ctx, 2*time.Second) != nil {
			return err
		}
	}
	if st == nil || jop == nil {
		return os.Remove(t.file()) // nothing journalled: nothing to resume
	}
	if err := t.ownedBy(st); err != nil {
		return errors.Join(err, os.Remove(t.file())) // the other controller carries it out
	}
	if st.Machine.Phase == ichorv1.MachineFailed {
		// Not retried by itself: a retry of the operation hands it over again.
		return fmt.Errorf("the etcd restore of %s/%s failed at %s and waits for a retry: %s", jop.Namespace, jop.Name, st.Machine.Step, st.Machine.Message)
	}

	op := &ichorv1.TalosOperation{Spec: jop.Spec}
	op.Namespace, op.Name, op.UID = jop.Namespace, jop.Name, jop.UID
	e := &Env{Op: op, Machine: st.Machine, Address: h.Address, ControlPlanes: h.ControlPlanes, Talos: c,
		Kube: t.Kube, Live: t.Kube, Clientset: t.Clientset, Log: t.Log}
	seq := st.Seq
	steps := tail()
	for i := t.from(st.Machine.Step); i < len(steps); i++ {
		s := steps[i]
		if e.Machine.Step != s.Name {
			e.Machine.Step, e.Machine.Calls = s.Name, 0
			// Read before each step after the first: another controller
			// may have continued the journal meanwhile.
			if err := t.stillOwned(ctx, j); err != nil {
				return err
			}
		}
		if s.Irreversible {
			e.Machine.Calls++
		}
		seq++
		if err := j.WriteState(ctx, journal.State{Seq: seq, UID: op.UID, Machine: e.Machine, Owner: t.Pod}); err != nil {
			return fmt.Errorf("journal %s: %w", s.Name, err)
		}
		sctx, cancel := context.WithTimeout(ctx, s.Timeout)
		out, err := s.Run(sctx, e)
		cancel()
		if t.TestHookAfterStep != nil {
			t.TestHookAfterStep(e.Machine.Name, s.Name, err)
		}
		if err != nil && ctx.Err() != nil {
			return ctx.Err() // killed: the journal says where to resume
		}
		if err != nil {
			e.Machine.Phase, e.Machine.Message = ichorv1.MachineFailed, err.Error()
			seq++
			_ = j.WriteState(ctx, journal.State{Seq: seq, UID: op.UID, Machine: e.Machine, Owner: t.Pod})
			return fmt.Errorf("%s: %w", s.Name, err)
		}
		e.Machine.Message = out.Message
	}
	// etcd is restored: the operation goes back however long the API
	// takes to answer steadily (a failure here is not the restore's).
	for {
		err := writeBack(ctx, j, t.Kube, jop, e.Machine)
		if err == nil {
			return os.Remove(t.file())
		}
		t.Log.Info("etcd is restored; writing the operation back again", "operation", jop.Namespace+"/"+jop.Name, "why", err.Error())
		if pause(ctx, 2*time.Second) != nil {
			return err
		}
	}
}

// stillOwned reads the journal again and says whether this controller
// still owns it (ownedBy).
func (t *Takeover) stillOwned(ctx context.Context, j journal.Journal) error {
	st, _, err := j.ReadState(ctx)
	if err != nil {
		return fmt.Errorf("read the journal: %w", err)
	}
	if st == nil {
		return errors.New("the journal was cleared while the takeover ran: someone finished the restore by hand")
	}
	return t.ownedBy(st)
}

// writeBack puts the operation back with its final status, then clears
// the journal: a controller killed between the two writes it back again.
func writeBack(ctx context.Context, j journal.Journal, c client.Client, jop *journal.Operation, m ichorv1.MachineStatus) error {
	if _, err := journal.WriteBack(ctx, c, jop, m, m.Message, time.Now()); err != nil {
		return err
	}
	return j.Clear(ctx)
}

// from is the index in tail of the journalled step (the first for one
// before the tail).
func (t *Takeover) from(step string) int {
	for i, s := range tail() {
		if s.Name == step {
			return i
		}
	}
	return 0
}

// ReadTalosconfig reads the controller's talosconfig, for Begin.
func ReadTalosconfig(ctx context.Context, c client.Client, namespace string) ([]byte, error) {
	var s corev1.Secret
	if err := c.Get(ctx, client.ObjectKey{Namespace: namespace, Name: ichorv1.TalosconfigSecret}, &s); err != nil {
		return nil, fmt.Errorf("read the talosconfig: %w", err)
	}
	return s.Data[ichorv1.TalosconfigKey], nil
}
