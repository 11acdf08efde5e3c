// Package journal keeps an operation's state where it outlives the
// Kubernetes API and the store an etcd restore rewinds: Talos's META user
// keys on the control planes (fsynced before MetaWrite answers, kept
// through reboots and EPHEMERAL resets). META is per machine, not
// replicated and without compare-and-swap, so the journal is written to
// every control plane that answers, read back as the newest entry (by
// sequence number) any of them holds, and has one writer: the controller
// that carries the operation out. Values are self-identifying JSON, and a
// key holding anything else (Omni's labels, a user's data) is never
// overwritten. The writer is named in the journal (State.Owner), and
// another controller continues the journal only once that one's pod is
// gone.
package journal

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/cosi-project/runtime/pkg/safe"
	"github.com/cosi-project/runtime/pkg/state"
	talosclient "github.com/siderolabs/talos/pkg/machinery/client"
	"github.com/siderolabs/talos/pkg/machinery/meta"
	"github.com/siderolabs/talos/pkg/machinery/resources/runtime"
	"google.golang.org/grpc/codes"
	"k8s.io/apimachinery/pkg/types"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

// The META keys the journal uses: the state machine in UserReserved2, the
// operation it belongs to in UserReserved3 (UserReserved1 is Omni's).
const (
	StateKey     = meta.UserReserved2
	OperationKey = meta.UserReserved3
)

// Magic opens every value the journal writes.
const Magic = "ichor.maesh.dev/journal/v1"

// maxValue keeps one value far below META's budget (256 KiB shared with
// Talos's own keys).
const maxValue = 8 << 10

// State is where the operation's state machine stands.
type State struct {
	Magic string `json:"magic"`
	// Seq grows with every write: the newest entry on any control plane wins.
	Seq int64 `json:"seq"`
	// UID is the operation's.
	UID types.UID `json:"uid"`
	// Machine is the machine status the steps read (its step, calls, boot
	// ID, from, to, message), as status would hold it.
	Machine ichorv1.MachineStatus `json:"machine"`
	// Owner is the pod ("namespace/name") of the controller whose
	// takeover runs the restore: the one writer. Empty outside a pod.
	Owner string `json:"owner,omitempty"`
	// Written is when the entry was written.
	Written time.Time `json:"written"`
}

// Operation is the journalled operation: enough to write it back.
type Operation struct {
	Magic     string                     `json:"magic"`
	Namespace string                     `json:"namespace"`
	Name      string                     `json:"name"`
	UID       types.UID                  `json:"uid"`
	Created   time.Time                  `json:"created"`
	Spec      ichorv1.TalosOperationSpec `json:"spec"`
}

// Journal reads and writes the journal on a cluster's control planes.
type Journal struct {
	Talos *talosclient.Client
	// ControlPlanes are the control planes' Talos addresses.
	ControlPlanes []string
}

// ForeignError is a META key that holds someone else's data.
type ForeignError struct{ Node, Key, Value string }

func (e *ForeignError) Error() string {
	return fmt.Sprintf("META key %s on %s holds data that is not Ichor's journal (%.40q): Ichor does not overwrite it; clear it (talosctl -n %s meta delete %s) if it is not in use",
		e.Key, e.Node, e.Value, e.Node, e.Key)
}

// WriteOperation journals the operation, once, before its first step that
// takes the API away.
func (j Journal) WriteOperation(ctx context.Context, op *ichorv1.TalosOperation) error {
	return j.write(ctx, OperationKey, Operation{Magic: Magic, Namespace: op.Namespace, Name: op.Name, UID: op.UID,
		Created: op.CreationTimestamp.Time, Spec: op.Spec})
}

// WriteState journals the state machine's next entry.
func (j Journal) WriteState(ctx context.Context, s State) error {
	s.Magic = Magic
	if s.Written.IsZero() {
		s.Written = time.Now().UTC()
	}
	return j.write(ctx, StateKey, s)
}

// write stores v at key on every control plane that answers; it fails
// when none took it, when one holds foreign data there, or when one that
// answers refuses.
func (j Journal) write(ctx context.Context, key uint8, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	if len(b) > maxValue {
		return fmt.Errorf("journal entry of %d bytes exceeds %d", len(b), maxValue)
	}
	stored, down := 0, []string{}
	for _, node := range j.ControlPlanes {
		cur, found, err := readKey(ctx, j.Talos, node, key)
		if unreachable(err) {
			down = append(down, node)
			continue
		}
		if err != nil {
			return err
		}
		if found && !strings.Contains(cur, Magic) {
			return &ForeignError{Node: node, Key: keyID(key), Value: cur}
		}
		err = j.Talos.MetaWrite(talosclient.WithNode(ctx, node), key, b)
		if unreachable(err) {
			down = append(down, node)
			continue
		}
		if err != nil {
			return fmt.Errorf("write the journal to META %s on %s: %w", keyID(key), node, err)
		}
		stored++
	}
	if stored == 0 {
		return fmt.Errorf("no control plane took the journal (%s do not answer)", strings.Join(down, ", "))
	}
	return nil
}

// ReadState returns the newest state any control plane holds (nil when
// none holds one) and the operation it belongs to (nil when none is
// journalled). Control planes that do not answer are passed over; an
// error means none answered.
func (j Journal) ReadState(ctx context.Context) (*State, *Operation, error) {
	var newest *State
	ops := map[types.UID]*Operation{}
	answered := false
	for _, node := range j.ControlPlanes {
		var s State
		ok, err := readJSON(ctx, j.Talos, node, StateKey, &s)
		if unreachable(err) {
			continue
		}
		if err != nil {
			return nil, nil, err
		}
		answered = true
		if ok && (newest == nil || s.Seq > newest.Seq) {
			newest = &s
		}
		var o Operation
		if ok, err := readJSON(ctx, j.Talos, node, OperationKey, &o); err == nil && ok {
			ops[o.UID] = &o
		}
	}
	if !answered {
		return nil, nil, errors.New("no control plane answers: the journal cannot be read")
	}
	if newest == nil {
		return nil, nil, nil
	}
	return newest, ops[newest.UID], nil
}

// Clear deletes the journal's keys on every control plane, leaving
// foreign data alone; a control plane that does not answer fails it.
func (j Journal) Clear(ctx context.Context) error {
	for _, node := range j.ControlPlanes {
		for _, key := range []uint8{StateKey, OperationKey} {
			cur, found, err := readKey(ctx, j.Talos, node, key)
			if err != nil {
				return err
			}
			if !found || !strings.Contains(cur, Magic) {
				continue
			}
			err = j.Talos.MetaDelete(talosclient.WithNode(ctx, node), key)
			if err != nil && talosclient.StatusCode(err) != codes.NotFound {
				return fmt.Errorf("clear the journal in META %s on %s: %w", keyID(key), node, err)
			}
		}
	}
	return nil
}

// readJSON decodes our value at key; false when the key is absent or not ours.
func readJSON(ctx context.Context, c *talosclient.Client, node string, key uint8, v any) (bool, error) {
	cur, found, err := readKey(ctx, c, node, key)
	if err != nil || !found || !strings.Contains(cur, Magic) {
		return false, err
	}
	if err := json.Unmarshal([]byte(cur), v); err != nil {
		return false, fmt.Errorf("META %s on %s: %w", keyID(key), node, err)
	}
	return true, nil
}

func readKey(ctx context.Context, c *talosclient.Client, node string, key uint8) (string, bool, error) {
	r, err := safe.StateGetByID[*runtime.MetaKey](talosclient.WithNode(ctx, node), c.COSI, keyID(key))
	if state.IsNotFoundError(err) {
		return "", false, nil
	}
	if err != nil {
		return "", false, fmt.Errorf("read META %s on %s: %w", keyID(key), node, err)
	}
	return r.TypedSpec().Value, true, nil
}

func keyID(key uint8) string { return runtime.MetaKeyTagToID(key) }

// unreachable is a machine that does not answer (COSI wraps the status in
// its error text).
func unreachable(err error) bool {
	if err == nil {
		return false
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return true
	}
	switch talosclient.StatusCode(err) {
	case codes.Unavailable, codes.DeadlineExceeded:
		return true
	}
	s := err.Error()
	return strings.Contains(s, "code = Unavailable") || strings.Contains(s, "code = DeadlineExceeded")
}
