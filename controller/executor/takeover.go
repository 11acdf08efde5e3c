package executor

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/go-logr/logr"
	talosclient "github.com/siderolabs/talos/pkg/machinery/client"
	clientconfig "github.com/siderolabs/talos/pkg/machinery/client/config"
	corev1 "k8s.io/api/core/v1"
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
	// Kube and Clientset reach the API once it is back.
	Kube      client.Client
	Clientset kubernetes.Interface
	Log       logr.Logger
	// Dial options for the Talos client (tests redial fast).
	TalosOptions []talosclient.OptionFunc

	mu    sync.Mutex
	owned map[types.NamespacedName]bool
	wg    sync.WaitGroup
}

// handover is what a resumed takeover needs before the API answers.
type handover struct {
	Talosconfig   []byte   `json:"talosconfig"`
	ControlPlanes []string `json:"controlPlanes"`
	Address       string   `json:"address"`
}

// tail are the steps the takeover runs, in order.
var tail = []Step{
	{Name: StepResetAll, Timeout: 20 * time.Minute, Irreversible: true, Run: runResetAll},
	{Name: StepRecover, Timeout: 15 * time.Minute, Irreversible: true, Run: runRecover},
	{Name: StepRestored, Timeout: 15 * time.Minute, Run: runRestored},
}

func (t *Takeover) file() string { return filepath.Join(t.Dir, "etcd-restore-handover.json") }

// Owns says whether a takeover carries the operation out now: the driver
// leaves it alone (its status in a rewound store is from before).
func (t *Takeover) Owns(key types.NamespacedName) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.owned[key]
}

// Begin hands the operation over: the talosconfig (read while the API is
// there), the journal of the operation and its machine, and the hand-over
// file are written, and then the tail runs on ctx (the controller's
// lifetime, not its leadership). It returns once the hand-over is
// durable.
func (t *Takeover) Begin(ctx context.Context, e *Env, talosconfig []byte) error {
	h := handover{Talosconfig: talosconfig, ControlPlanes: e.ControlPlanes, Address: e.Address}
	j := journal.Journal{Talos: e.Talos, ControlPlanes: e.ControlPlanes}
	if err := j.WriteOperation(ctx, e.Op); err != nil {
		return err
	}
	m := e.Machine
	m.Step, m.Calls = tail[0].Name, 0
	st := journal.State{Seq: 1, UID: e.Op.UID, Machine: m}
	if err := j.WriteState(ctx, st); err != nil {
		return err
	}
	b, err := json.Marshal(h)
	if err != nil {
		return err
	}
	if err := os.WriteFile(t.file(), b, 0o600); err != nil {
		return fmt.Errorf("write the hand-over file: %w", err)
	}
	if back, _, err := j.ReadState(ctx); err != nil || back == nil {
		return fmt.Errorf("read the journal back: %v", err)
	}
	t.own(types.NamespacedName{Namespace: e.Op.Namespace, Name: e.Op.Name}, true)
	t.start(ctx, h, e.Talos, false)
	return nil
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
	cfg, err := clientconfig.FromBytes(h.Talosconfig)
	if err != nil {
		return fmt.Errorf("hand-over file %s: %w", t.file(), err)
	}
	c, err := talosclient.New(ctx, append([]talosclient.OptionFunc{talosclient.WithConfig(cfg)}, t.TalosOptions...)...)
	if err != nil {
		return err
	}
	t.start(ctx, h, c, true)
	return nil
}

// Wait waits for the tails running to end (tests).
func (t *Takeover) Wait() { t.wg.Wait() }

func (t *Takeover) start(ctx context.Context, h handover, c *talosclient.Client, closeClient bool) {
	t.wg.Add(1)
	go func() {
		defer t.wg.Done()
		if closeClient {
			defer c.Close()
		}
		if err := t.run(ctx, h, c); err != nil && ctx.Err() == nil {
			t.Log.Error(err, "etcd restore takeover")
		}
	}()
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
	key := types.NamespacedName{Namespace: jop.Namespace, Name: jop.Name}
	t.own(key, true)
	defer t.own(key, false)

	op := &ichorv1.TalosOperation{Spec: jop.Spec}
	op.Namespace, op.Name, op.UID = jop.Namespace, jop.Name, jop.UID
	e := &Env{Op: op, Machine: st.Machine, Address: h.Address, ControlPlanes: h.ControlPlanes, Talos: c,
		Kube: t.Kube, Live: t.Kube, Clientset: t.Clientset, Log: t.Log}
	seq := st.Seq
	for i := t.from(st.Machine.Step); i < len(tail); i++ {
		s := tail[i]
		if e.Machine.Step != s.Name {
			e.Machine.Step, e.Machine.Calls = s.Name, 0
		}
		if s.Irreversible {
			e.Machine.Calls++
		}
		seq++
		if err := j.WriteState(ctx, journal.State{Seq: seq, UID: op.UID, Machine: e.Machine}); err != nil {
			return fmt.Errorf("journal %s: %w", s.Name, err)
		}
		sctx, cancel := context.WithTimeout(ctx, s.Timeout)
		out, err := s.Run(sctx, e)
		cancel()
		if err != nil && ctx.Err() != nil {
			return ctx.Err() // killed: the journal says where to resume
		}
		if err != nil {
			e.Machine.Phase, e.Machine.Message = ichorv1.MachineFailed, err.Error()
			seq++
			_ = j.WriteState(ctx, journal.State{Seq: seq, UID: op.UID, Machine: e.Machine})
			return fmt.Errorf("%s: %w", s.Name, err)
		}
		e.Machine.Message = out.Message
	}
	if _, err := journal.WriteBack(ctx, t.Kube, jop, e.Machine, e.Machine.Message, time.Now()); err != nil {
		return err
	}
	if err := j.Clear(ctx); err != nil {
		return err
	}
	return os.Remove(t.file())
}

// from is the index in tail of the journalled step (the first for one
// before the tail).
func (t *Takeover) from(step string) int {
	for i, s := range tail {
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
