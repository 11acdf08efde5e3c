package journal

import (
	"context"
	"fmt"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

// RestoredFromAnnotation marks an operation the controller wrote back
// from the journal, with the UID it had before the store was rewound
// (part of the API: the plugin's watch follows it).
const RestoredFromAnnotation = ichorv1.RestoredFromAnnotation

// WriteBack puts the journalled operation back in the API once its
// work is done and the API answers on the restored store: the operation
// itself when the store still has it (the snapshot postdates it), or one
// made anew with its name, spec and the annotation RestoredFromAnnotation
// when the snapshot predates it; then its final status, the machine as the
// journal last recorded it, Succeeded. A re-made operation is created
// paused, so that no controller starts it before its status says it is
// done, and unpaused after (by a later write-back, when this one ends
// before).
func WriteBack(ctx context.Context, c client.Client, o *Operation, m ichorv1.MachineStatus, message string, now time.Time) (*ichorv1.TalosOperation, error) {
	op := &ichorv1.TalosOperation{}
	err := c.Get(ctx, client.ObjectKey{Namespace: o.Namespace, Name: o.Name}, op)
	switch {
	case apierrors.IsNotFound(err):
		op = &ichorv1.TalosOperation{ObjectMeta: metav1.ObjectMeta{Namespace: o.Namespace, Name: o.Name,
			Annotations: map[string]string{RestoredFromAnnotation: string(o.UID)}}, Spec: o.Spec}
		op.Spec.Paused = true
		if err := c.Create(ctx, op); err != nil {
			return nil, fmt.Errorf("re-create the operation %s/%s: %w", o.Namespace, o.Name, err)
		}
	case err != nil:
		return nil, fmt.Errorf("read the operation %s/%s: %w", o.Namespace, o.Name, err)
	case op.UID != o.UID && op.Annotations[RestoredFromAnnotation] != string(o.UID):
		return nil, fmt.Errorf("the operation %s/%s in the restored store is another one (uid %s, the journal's is %s): not overwritten", o.Namespace, o.Name, op.UID, o.UID)
	}
	t := metav1.NewTime(now)
	m.Phase, m.Message, m.FinishedAt, m.Calls, m.BootID = ichorv1.MachineSucceeded, message, &t, 0, ""
	st := &op.Status
	st.Phase, st.Message, st.Machines, st.CompletionTime = ichorv1.PhaseSucceeded, message, []ichorv1.MachineStatus{m}, &t
	st.Current, st.Progress, st.Lock = "", "1/1", ""
	if st.StartTime == nil {
		st.StartTime = &metav1.Time{Time: o.Created}
	}
	if err := c.Status().Update(ctx, op); err != nil {
		return nil, fmt.Errorf("write the final status of %s/%s: %w", o.Namespace, o.Name, err)
	}
	if op.Spec.Paused && op.Annotations[RestoredFromAnnotation] == string(o.UID) {
		// Re-made here, or by an earlier write-back whose status or
		// unpause did not get through.
		patch := client.MergeFrom(op.DeepCopy())
		op.Spec.Paused = false
		if err := c.Patch(ctx, op, patch); err != nil {
			return nil, fmt.Errorf("unpause the re-created %s/%s: %w", o.Namespace, o.Name, err)
		}
	}
	return op, nil
}
