// Package conflict handles optimistic-concurrency conflicts in the
// reconcilers. A conflict is normal for a controller (the object changed
// between read and write: another writer, a cache that is behind): the
// reconcile reads again and goes on. It is not an error to log with a stack
// trace, which is what controller-runtime does with an error a reconciler
// returns.
package conflict

import (
	"time"

	"github.com/go-logr/logr"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
)

// Retry is how soon a reconcile that lost a conflict runs again; the watch
// event of the write that won usually brings it back sooner.
const Retry = 50 * time.Millisecond

// Requeue passes a reconcile's result on, except that a conflict (also
// wrapped, as the cluster lock's ErrConflict is) becomes a requeue after
// Retry, logged at debug level with what was being done.
func Requeue(log logr.Logger, res reconcile.Result, err error) (reconcile.Result, error) {
	if err == nil || !apierrors.IsConflict(err) {
		return res, err
	}
	log.V(1).Info("conflict: the object changed meanwhile; reconciling again", "conflict", err.Error())
	return reconcile.Result{RequeueAfter: Retry}, nil
}
