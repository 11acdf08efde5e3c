// Package lock is the cluster lock: a coordination.k8s.io/v1 Lease whose
// holderIdentity names who may do disruptive work right now. It is changed
// only with optimistic concurrency (an update carries the resourceVersion it
// read), so two controllers, or a controller and a Job, can never both
// believe they hold it.
//
// The Lease is not renewed and has no duration: a holder keeps the lock until
// it releases it or until a Judge finds it stale (its operation deleted,
// completed or paused on a failed step; its join or removal done; its Job
// finished), and then the next taker takes it over.
package lock

import (
	"context"
	"errors"
	"fmt"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

// ErrConflict means the Lease changed between read and write; read again.
// It is the API server's conflict (apierrors.IsConflict holds), so the
// reconcilers treat it as any other optimistic-concurrency conflict.
var ErrConflict = apierrors.NewConflict(coordinationv1.Resource("leases"), ichorv1.LockLeaseName,
	errors.New("the cluster lock changed meanwhile; read it again"))

// Annotations on the Lease that explain its last change.
const (
	// TakenOverAnnotation records whom the holder took the lock over from, and why.
	TakenOverAnnotation = "ichor.maesh.dev/taken-over-from"
	// LentByAnnotation names the holder that lent the lock to the present
	// one (an operation to its Job): only the lender takes it back, and the
	// lock is not free while the lender goes on.
	LentByAnnotation = "ichor.maesh.dev/lent-by"
)

// Judge decides whether a holder has finished with the lock without releasing it.
type Judge interface {
	Stale(ctx context.Context, holder string) (stale bool, why string, err error)
}

// Lock takes and releases the cluster lock.
type Lock struct {
	Client    client.Client
	Namespace string
	Judge     Judge
	// Now is the clock; nil means time.Now.
	Now func() time.Time
}

// Result says what Acquire found.
type Result struct {
	// Acquired is true when identity holds the lock now.
	Acquired bool
	// Holder is the holder that keeps it when Acquired is false.
	Holder string
	// Since is when Holder took it.
	Since time.Time
	// TookOver names the stale holder replaced, with why, when that happened.
	TookOver string
}

// State is the lock as it is now.
type State struct {
	Holder string
	Since  time.Time
	// LentBy is the holder that lent the lock to Holder, if it was lent.
	LentBy string
	// TakenOverFrom is the Lease's note of the last takeover, if any.
	TakenOverFrom string
}

func (l *Lock) now() time.Time {
	if l.Now != nil {
		return l.Now()
	}
	return time.Now()
}

// Get reads the lock. A missing Lease is a free lock.
func (l *Lock) Get(ctx context.Context) (State, error) {
	lease, err := l.get(ctx)
	if err != nil || lease == nil {
		return State{}, err
	}
	return stateOf(lease), nil
}

func stateOf(lease *coordinationv1.Lease) State {
	s := State{Holder: ptr.Deref(lease.Spec.HolderIdentity, ""), TakenOverFrom: lease.Annotations[TakenOverAnnotation],
		LentBy: lease.Annotations[LentByAnnotation]}
	if lease.Spec.AcquireTime != nil {
		s.Since = lease.Spec.AcquireTime.Time
	}
	return s
}

func (l *Lock) get(ctx context.Context) (*coordinationv1.Lease, error) {
	lease := &coordinationv1.Lease{}
	err := l.Client.Get(ctx, client.ObjectKey{Namespace: l.Namespace, Name: ichorv1.LockLeaseName}, lease)
	if apierrors.IsNotFound(err) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read cluster lock %s/%s: %w", l.Namespace, ichorv1.LockLeaseName, err)
	}
	return lease, nil
}

// Holds reports whether identity holds the lock: itself, or through the
// holder it lent the lock to.
func (s State) Holds(identity string) bool {
	return s.Holder == identity || (s.Holder != "" && s.LentBy == identity)
}

// Acquire takes the lock for identity when it is free, already identity's
// (or lent by identity: it still holds it, through the borrower), or held by
// a holder the Judge finds stale. A lent lock is stale only once both the
// borrower and the lender are.
func (l *Lock) Acquire(ctx context.Context, identity string) (Result, error) {
	lease, err := l.get(ctx)
	if err != nil {
		return Result{}, err
	}
	if lease == nil {
		return l.create(ctx, identity)
	}
	st := stateOf(lease)
	switch {
	case st.Holds(identity):
		return Result{Acquired: true, Holder: identity, Since: st.Since}, nil
	case st.Holder != "":
		stale, why, err := l.stale(ctx, st)
		if err != nil {
			return Result{}, fmt.Errorf("judge lock holder %s: %w", st.Holder, err)
		}
		if !stale {
			return Result{Holder: st.Holder, Since: st.Since}, nil
		}
		tookOver := st.Holder + " (" + why + ")"
		if err := l.write(ctx, lease, identity, tookOver); err != nil {
			return Result{}, err
		}
		return Result{Acquired: true, Holder: identity, Since: l.now(), TookOver: tookOver}, nil
	}
	if err := l.write(ctx, lease, identity, ""); err != nil {
		return Result{}, err
	}
	return Result{Acquired: true, Holder: identity, Since: l.now()}, nil
}

// stale judges a holder; a lent lock is stale when borrower and lender are.
func (l *Lock) stale(ctx context.Context, st State) (bool, string, error) {
	stale, why, err := l.Judge.Stale(ctx, st.Holder)
	if err != nil || !stale || st.LentBy == "" {
		return stale, why, err
	}
	lenderStale, lenderWhy, err := l.Judge.Stale(ctx, st.LentBy)
	if err != nil || !lenderStale {
		return false, "", err
	}
	return true, fmt.Sprintf("%s; lent by %s, %s", why, st.LentBy, lenderWhy), nil
}

// Lend hands the lock from lender, which must hold it, to borrower in one
// guarded write, so it is never free between them. The Lease records the
// lender: the lender still holds the lock (Holds), and takes it back with
// Reclaim once the borrower is done. Lending again to the same borrower
// changes nothing.
func (l *Lock) Lend(ctx context.Context, lender, borrower string) error {
	lease, err := l.get(ctx)
	if err != nil {
		return err
	}
	st := State{}
	if lease != nil {
		st = stateOf(lease)
	}
	if st.Holder == borrower && st.LentBy == lender {
		return nil
	}
	if lease == nil || st.Holder != lender {
		return fmt.Errorf("%s cannot lend the cluster lock to %s: it is held by %q", lender, borrower, st.Holder)
	}
	return l.writeLent(ctx, lease, borrower, lender)
}

// Reclaim takes a lock that lender lent back from its borrower. It reports
// whether lender holds the lock in its own name now (false when it had not
// lent it and does not hold it).
func (l *Lock) Reclaim(ctx context.Context, lender string) (bool, error) {
	lease, err := l.get(ctx)
	if err != nil || lease == nil {
		return false, err
	}
	st := stateOf(lease)
	switch {
	case st.Holder == lender && st.LentBy == "":
		return true, nil
	case st.Holder == "" || st.LentBy != lender:
		return false, nil
	}
	return true, l.writeLent(ctx, lease, lender, "")
}

// writeLent sets the holder and who lent it the lock, keeping the time the
// lock was first taken: lending and reclaiming are one holding.
func (l *Lock) writeLent(ctx context.Context, lease *coordinationv1.Lease, holder, lentBy string) error {
	lease = lease.DeepCopy()
	now := metav1.NewMicroTime(l.now())
	lease.Spec.HolderIdentity, lease.Spec.RenewTime = &holder, &now
	if lease.Annotations == nil {
		lease.Annotations = map[string]string{}
	}
	if lentBy == "" {
		delete(lease.Annotations, LentByAnnotation)
	} else {
		lease.Annotations[LentByAnnotation] = lentBy
	}
	err := l.Client.Update(ctx, lease)
	if apierrors.IsConflict(err) {
		return ErrConflict
	}
	if err != nil {
		return fmt.Errorf("update cluster lock %s/%s: %w", l.Namespace, ichorv1.LockLeaseName, err)
	}
	return nil
}

func (l *Lock) create(ctx context.Context, identity string) (Result, error) {
	now := metav1.NewMicroTime(l.now())
	lease := &coordinationv1.Lease{
		ObjectMeta: metav1.ObjectMeta{Namespace: l.Namespace, Name: ichorv1.LockLeaseName,
			Labels: map[string]string{"app.kubernetes.io/part-of": "ichor"}},
		Spec: coordinationv1.LeaseSpec{HolderIdentity: &identity, AcquireTime: &now, RenewTime: &now},
	}
	err := l.Client.Create(ctx, lease)
	if apierrors.IsAlreadyExists(err) {
		return Result{}, ErrConflict
	}
	if err != nil {
		return Result{}, fmt.Errorf("create cluster lock %s/%s: %w", l.Namespace, ichorv1.LockLeaseName, err)
	}
	return Result{Acquired: true, Holder: identity, Since: now.Time}, nil
}

// write sets the holder (empty frees the lock) with the resourceVersion read.
func (l *Lock) write(ctx context.Context, lease *coordinationv1.Lease, identity, tookOver string) error {
	lease = lease.DeepCopy()
	now := metav1.NewMicroTime(l.now())
	if identity == "" {
		lease.Spec.HolderIdentity, lease.Spec.AcquireTime = nil, nil
	} else {
		lease.Spec.HolderIdentity, lease.Spec.AcquireTime = &identity, &now
	}
	lease.Spec.RenewTime = &now
	delete(lease.Annotations, LentByAnnotation)
	if tookOver != "" {
		if lease.Annotations == nil {
			lease.Annotations = map[string]string{}
		}
		lease.Annotations[TakenOverAnnotation] = tookOver
	}
	err := l.Client.Update(ctx, lease)
	if apierrors.IsConflict(err) {
		return ErrConflict
	}
	if err != nil {
		return fmt.Errorf("update cluster lock %s/%s: %w", l.Namespace, ichorv1.LockLeaseName, err)
	}
	return nil
}

// Release frees the lock if identity holds it, and reports how long it was
// held. Releasing a lock held by someone else (or nobody) changes nothing.
// A borrower's release gives the lock back to its lender, never frees it.
func (l *Lock) Release(ctx context.Context, identity string) (held time.Duration, released bool, err error) {
	lease, err := l.get(ctx)
	if err != nil || lease == nil {
		return 0, false, err
	}
	st := stateOf(lease)
	if st.Holder != identity {
		return 0, false, nil
	}
	if st.LentBy != "" {
		return 0, true, l.writeLent(ctx, lease, st.LentBy, "")
	}
	if err := l.write(ctx, lease, "", ""); err != nil {
		return 0, false, err
	}
	if !st.Since.IsZero() {
		held = l.now().Sub(st.Since)
	}
	return held, true, nil
}
