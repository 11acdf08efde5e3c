package operation

import (
	"sync"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

// ownWrites remembers, per operation, the operation as this controller
// last wrote it and the resourceVersions its writes replaced since the
// cache last showed its latest. A turn that starts while the cache still
// shows one of those (a step ended before the watch brought the write
// back) works from the write instead of waiting a watch round trip: the
// write's answer is the stored object, and a turn's own writes are still
// guarded by its resourceVersion, so a write by someone else meanwhile
// ends in a conflict, as with any stale read.
type ownWrites struct {
	mu sync.Mutex
	by map[types.UID]*ownWrite
}

type ownWrite struct {
	op       *ichorv1.TalosOperation
	replaced map[string]bool
}

// wrote records that a write replaced resourceVersion before with op (the
// write's answer, which the caller no longer changes).
func (w *ownWrites) wrote(before string, op *ichorv1.TalosOperation) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.by == nil {
		w.by = map[types.UID]*ownWrite{}
	}
	e := w.by[op.UID]
	if e == nil {
		e = &ownWrite{replaced: map[string]bool{}}
		w.by[op.UID] = e
	}
	e.op = op
	e.replaced[before] = true
}

// latest returns the operation a turn should work from, given the cache's
// copy: a copy of this controller's last write when the cache shows a
// version that write replaced, else cached itself. Once the cache shows any
// other version (the write, or someone else's after it) there is nothing
// left to remember.
func (w *ownWrites) latest(cached *ichorv1.TalosOperation) *ichorv1.TalosOperation {
	w.mu.Lock()
	defer w.mu.Unlock()
	e := w.by[cached.UID]
	if e == nil {
		return cached
	}
	if e.replaced[cached.ResourceVersion] {
		return e.op.DeepCopy()
	}
	delete(w.by, cached.UID)
	return cached
}

// failed forgets the operation's last write when a write of it ended in a
// conflict: that write is not the latest any more, so the next turn works
// from the cache. (After an etcd restore rewinds the store, the cache may
// show a version this controller once replaced: working from the write
// again and again would end in a conflict every time.)
func (w *ownWrites) failed(uid types.UID, err error) {
	if apierrors.IsConflict(err) {
		w.forget(uid)
	}
}

// forget drops what is remembered of an operation.
func (w *ownWrites) forget(uid types.UID) {
	w.mu.Lock()
	defer w.mu.Unlock()
	delete(w.by, uid)
}
