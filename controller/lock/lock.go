// Package lock is the cluster lock: a coordination.k8s.io/v1 Lease whose
// holderIdentity names who may do disruptive work right now, and whose
// annotations say precisely which object holds it (its UID) and which Jobs
// queue for it. It is changed only with optimistic concurrency (an update
// carries the resourceVersion it read), and every decision reads the Lease
// and the holder from the API server itself, never from a cache, so two
// takers can never both believe they hold it.
//
// The Lease is not renewed and has no duration: a holder keeps the lock until
// it releases it or until a Judge finds it stale (its operation deleted,
// completed or paused on a failed step; its join or removal done; its Job
// finished), and then the next taker in the queue takes it over. Before a
// holder starts a step that disrupts a machine it confirms the hold with a
// guarded write (Confirm): a taker that judged it stale from what it read
// before then cannot take the lock from under that step.
package lock

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/predicate"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

// ErrConflict means the Lease changed between read and write; read again.
// It is the API server's conflict (apierrors.IsConflict holds), so the
// reconcilers treat it as any other optimistic-concurrency conflict.
var ErrConflict = apierrors.NewConflict(coordinationv1.Resource("leases"), ichorv1.LockLeaseName,
	errors.New("the cluster lock changed meanwhile; read it again"))

// NotHeldError is what Confirm returns when the lock is not the holder's.
type NotHeldError struct {
	// Holder is the identity that holds it now ("" when it is free).
	Holder string
}

func (e *NotHeldError) Error() string {
	if e.Holder == "" {
		return "the cluster lock is no longer held: it is free"
	}
	return "the cluster lock is no longer held: " + e.Holder + " holds it"
}

// Annotations on the Lease that explain its last change.
const (
	// TakenOverAnnotation records whom the holder took the lock over from, and why.
	TakenOverAnnotation = "ichor.maesh.dev/taken-over-from"
	// LentByAnnotation names the holder that lent the lock to the present
	// one (an operation to its Job), with LentByObjectAnnotation and
	// LentByUIDAnnotation beside it as for the holder: only the lender takes
	// it back, and the lock is not free while the lender goes on.
	LentByAnnotation       = "ichor.maesh.dev/lent-by"
	LentByObjectAnnotation = "ichor.maesh.dev/lent-by-object"
	LentByUIDAnnotation    = "ichor.maesh.dev/lent-by-uid"
)

// Holder is who holds, or wants, the cluster lock.
type Holder struct {
	// Identity is the Lease's holderIdentity, in the form the specification
	// fixes (ichor-controller/op/<ns>/<name>, ichor-controller/machine/<node>,
	// job/<ns>/<name>). Several holders can share one.
	Identity string
	// Object is the object whose work the hold is for.
	Object ichorv1.LockObject
	// UID is Object's UID: what tells holders of one identity apart.
	UID types.UID
	// Removal is set on a Node holder whose Node is gone while the Lease
	// lists its removal as not settled in etcd yet: the Node being gone does
	// not end the hold.
	Removal bool
}

func (h Holder) String() string {
	if h.Object.Kind == "" {
		return h.Identity
	}
	return fmt.Sprintf("%s (%s %s)", h.Identity, h.Object, h.UID)
}

// ForOperation is an operation holding the lock under identity: its own,
// or its machine's for a control-plane reset.
func ForOperation(op *ichorv1.TalosOperation, identity string) Holder {
	return Holder{Identity: identity, UID: op.UID,
		Object: ichorv1.LockObject{Kind: ichorv1.ObjectOperation, Namespace: op.Namespace, Name: op.Name}}
}

// ForNode is a control-plane join or removal, held as the machine.
func ForNode(node metav1.Object) Holder {
	return Holder{Identity: ichorv1.MachineIdentity(node.GetName()), UID: node.GetUID(),
		Object: ichorv1.LockObject{Kind: ichorv1.ObjectNode, Name: node.GetName()}}
}

// ForJob is a Job holding the lock as job/<ns>/<name>.
func ForJob(job metav1.Object) Holder {
	return Holder{Identity: ichorv1.JobIdentity(job.GetNamespace(), job.GetName()), UID: job.GetUID(),
		Object: ichorv1.LockObject{Kind: ichorv1.ObjectJob, Namespace: job.GetNamespace(), Name: job.GetName()}}
}

// Lock takes and releases the cluster lock.
type Lock struct {
	// Client writes the Lease, and reads it for Get (a cache is fine there).
	Client client.Client
	// Live reads the Lease for every decision (Acquire, Confirm, Release):
	// the API server itself, not a cache. Nil means Client.
	Live      client.Reader
	Namespace string
	Judge     Judge
	// Queue finds the waiters that go before a taker; nil means none do.
	Queue Queue
	// Now is the clock; nil means time.Now.
	Now func() time.Time

	// mu guards last: the Lease as this Lock last read it live or wrote
	// it, and lastAt, when that read or write came back. Confirm makes its
	// guarded write on it, so that confirming costs one round trip while
	// nobody else writes the Lease (a stale one only makes that write
	// conflict, and Confirm reads the Lease again).
	mu     sync.Mutex
	last   *coordinationv1.Lease
	lastAt time.Time
	// confirms has an entry for each holder whose Confirm is under way: the
	// round of Confirms that waits for it, nil while none does (guarded by mu).
	confirms map[Holder]*confirmed
	// ending has an entry for each holder (by UID) whose end this process
	// is recording (Ending; guarded by mu).
	ending map[types.UID]*ending
	// idleRelease is the last release this Lock wrote of a holder that had
	// changed nothing since a known moment (guarded by mu).
	idleRelease idleRelease
}

// ending is a holder's end being recorded: done closes once its release is
// written or given up; waiting counts the Acquires that wait for it; idle
// is the moment from which the holder changes nothing (zero: unknown).
type ending struct {
	done    chan struct{}
	waiting int
	idle    time.Time
}

// idleRelease is a free Lease (by resourceVersion) that a release wrote,
// and the moment from which its holder had changed nothing.
type idleRelease struct {
	resourceVersion string
	since           time.Time
}

// remember keeps lease as the last one seen.
func (l *Lock) remember(lease *coordinationv1.Lease) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.last, l.lastAt = lease, time.Now()
}

// lastSeen is the last Lease seen, for a guarded write.
func (l *Lock) lastSeen() Seen {
	l.mu.Lock()
	defer l.mu.Unlock()
	return Seen{l.last, l.lastAt}
}

// Ending says that h's end (its operation Succeeded, say) is being written
// by this process, which releases the lock right after: until the returned
// done is called, an Acquire that finds h holding the lock waits for that
// release instead of judging h and taking the lock over. A takeover written
// then would only conflict with the release, and its taker would read the
// Lease again to take the lock free. Call done once the release is written,
// or will not be (the end's write failed): it is what lets the waiters go
// on, and a waiter that finds h still holding the lock then judges it as
// before.
//
// idle, when not zero, is a moment from which h changes nothing in the
// cluster (its last step had ended by then): a take of the free Lease that
// h's release writes then counts as free from idle on (Result.FreeAt), not
// from the release, since nothing that mattered to a taker happened
// between. Zero when h still has work to come (a step that runs once its
// end is written).
func (l *Lock) Ending(h Holder, idle time.Time) (done func()) {
	e := &ending{done: make(chan struct{}), idle: idle}
	l.mu.Lock()
	if l.ending == nil {
		l.ending = map[types.UID]*ending{}
	}
	l.ending[h.UID] = e
	l.mu.Unlock()
	return sync.OnceFunc(func() {
		l.mu.Lock()
		if l.ending[h.UID] == e {
			delete(l.ending, h.UID)
		}
		l.mu.Unlock()
		close(e.done)
	})
}

// endingWait bounds how long an Acquire waits for an ending holder's
// release: that is a turn's status write and a Lease write, and a release
// that takes longer is left to the judge.
var endingWait = 5 * time.Second

// awaitEnd waits for the release of h when this process is recording h's
// end (found), and reports whether it came (ended: false when h is not
// ending here, or its release took longer than endingWait). It calls the
// request's WhileEnding first, when h is ending idle.
func (l *Lock) awaitEnd(ctx context.Context, req Request, h Holder) (found, ended bool, err error) {
	if h.UID == "" {
		return false, false, nil
	}
	l.mu.Lock()
	e := l.ending[h.UID]
	if e != nil {
		e.waiting++
	}
	l.mu.Unlock()
	if e == nil {
		return false, false, nil
	}
	defer func() {
		l.mu.Lock()
		e.waiting--
		l.mu.Unlock()
	}()
	if req.WhileEnding != nil && !e.idle.IsZero() {
		req.WhileEnding(e.idle)
	}
	timer := time.NewTimer(endingWait)
	defer timer.Stop()
	select {
	case <-e.done:
		return true, true, nil
	case <-timer.C:
		return true, false, nil
	case <-ctx.Done():
		return true, false, ctx.Err()
	}
}

// Request is a taker's request for the lock.
type Request struct {
	Holder Holder
	// Place is the taker's place in the queue. Nil takes the lock before
	// every waiter: a control-plane join or removal, which happens whether
	// or not it holds the lock.
	Place *ichorv1.QueuePlace
	// Queue records a taker that has to wait in the Lease's queue, so that
	// the operations see it (a Job: the controller does not list Jobs).
	Queue bool
	// WhileEnding, when set, is called (once, before the wait) when Acquire
	// waits for the release of a holder ending idle since the moment it is
	// given (Ending): a take on that release is free from that moment on
	// (Result.FreeAt), so what the taker reads of the cluster from then
	// counts as read holding the lock, and reading it now overlaps the
	// holder's last writes.
	WhileEnding func(idle time.Time)
}

// Result says what Acquire found.
type Result struct {
	// Acquired is true when the taker holds the lock now.
	Acquired bool
	// AlreadyHeld is true when it held it before.
	AlreadyHeld bool
	// Holder is the identity that holds it when Acquired is false ("" when
	// the lock is free but Ahead goes first).
	Holder string
	// Since is when Holder took it.
	Since time.Time
	// Ahead names the waiter that goes first, when that is why the taker waits.
	Ahead string
	// TookOver names the stale holder replaced, with why, when that happened.
	TookOver string
	// Seen is the Lease as Acquire read or wrote it, for ConfirmSeen.
	Seen Seen
	// FreeAt, for a free lock taken (not taken over), is a moment at which
	// the Lease was the free one the take was written on: the read or the
	// write that showed it came back then. The guarded take proves that
	// nobody wrote the Lease from then until the take, so no holder came
	// between: what the taker read of the cluster after FreeAt, it reads
	// as of holding the lock. When the take was written on the Lease that
	// this Lock's release of an idle holder wrote (Ending), it is the
	// moment that holder became idle: the holder changed nothing from then
	// until its release, and nobody wrote the Lease between the release
	// and the take.
	FreeAt time.Time
}

// Seen is a Lease that one of the Lock's calls read from the API server
// itself (or wrote) and in which the taker held the lock.
type Seen struct {
	lease *coordinationv1.Lease
	at    time.Time // when the read or the write came back
}

// State is the lock as it is now.
type State struct {
	// Holder is zero when the lock is free.
	Holder Holder
	Since  time.Time
	// LentBy is the holder that lent the lock to Holder; zero when not lent.
	LentBy Holder
	// TakenOverFrom is the Lease's note of the last takeover, if any.
	TakenOverFrom string
	// Waiting are the Jobs queued in the Lease.
	Waiting []ichorv1.LockWaiter
	// Baseline is when the membership reconciler first ran ("" before).
	Baseline string
	// Removals are the control planes whose Node is gone and whose removal
	// has not settled in etcd.
	Removals []ichorv1.LockRemoval
}

// Free reports whether nobody holds the lock.
func (s State) Free() bool { return s.Holder.Identity == "" }

// HeldBy reports whether h is the holder: the same object, by UID.
func (s State) HeldBy(h Holder) bool { return s.Holder.UID != "" && s.Holder.UID == h.UID }

// Lent reports whether the holder borrowed the lock.
func (s State) Lent() bool { return s.LentBy.Identity != "" }

// Holds reports whether h holds the lock: itself, or through the holder it
// lent the lock to.
func (s State) Holds(h Holder) bool {
	return s.HeldBy(h) || (s.Lent() && s.LentBy.UID != "" && s.LentBy.UID == h.UID)
}

func (l *Lock) now() time.Time {
	if l.Now != nil {
		return l.Now()
	}
	return time.Now()
}

// Get reads the lock through Client. A missing Lease is a free lock.
func (l *Lock) Get(ctx context.Context) (State, error) {
	lease, err := l.read(ctx, l.Client)
	if err != nil || lease == nil {
		return State{}, err
	}
	return stateOf(lease)
}

// Current reads the lock from the API server itself (Live).
func (l *Lock) Current(ctx context.Context) (State, error) {
	lease, err := l.read(ctx, l.live())
	if err != nil || lease == nil {
		return State{}, err
	}
	return stateOf(lease)
}

func stateOf(lease *coordinationv1.Lease) (State, error) {
	a := lease.Annotations
	s := State{TakenOverFrom: a[TakenOverAnnotation], Baseline: a[ichorv1.LockMembershipBaselineAnnotation]}
	if id := ptr.Deref(lease.Spec.HolderIdentity, ""); id != "" {
		s.Holder = holderOf(id, a[ichorv1.LockHolderObjectAnnotation], a[ichorv1.LockHolderUIDAnnotation])
		if a[LentByAnnotation] != "" {
			s.LentBy = holderOf(a[LentByAnnotation], a[LentByObjectAnnotation], a[LentByUIDAnnotation])
		}
	}
	if lease.Spec.AcquireTime != nil {
		s.Since = lease.Spec.AcquireTime.Time
	}
	var err error
	if s.Waiting, err = ichorv1.LockWaitingJobs(a); err != nil {
		return s, err
	}
	if s.Removals, err = ichorv1.LockRemovals(a); err != nil {
		return s, err
	}
	_, s.Holder.Removal = s.Removal(s.Holder.UID)
	return s, nil
}

// Removal returns the pending removal of the gone Node uid, if the Lease
// lists one.
func (s State) Removal(uid types.UID) (ichorv1.LockRemoval, bool) {
	for _, r := range s.Removals {
		if uid != "" && r.UID == uid {
			return r, true
		}
	}
	return ichorv1.LockRemoval{}, false
}

// holderOf reads a holder from the Lease's identity, object and UID.
func holderOf(identity, object, uid string) Holder {
	h := Holder{Identity: identity, UID: types.UID(uid)}
	if o, err := ichorv1.ParseLockObject(object); err == nil {
		h.Object = o
	} else if id, err := ichorv1.ParseLockHolder(identity); err == nil {
		// A Lease from before holders' objects were recorded.
		h.Object = id.Object()
	}
	return h
}

func (l *Lock) live() client.Reader {
	if l.Live != nil {
		return l.Live
	}
	return l.Client
}

func (l *Lock) read(ctx context.Context, r client.Reader) (*coordinationv1.Lease, error) {
	lease := &coordinationv1.Lease{}
	err := r.Get(ctx, client.ObjectKey{Namespace: l.Namespace, Name: ichorv1.LockLeaseName}, lease)
	if apierrors.IsNotFound(err) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read cluster lock %s/%s: %w", l.Namespace, ichorv1.LockLeaseName, err)
	}
	if r == l.live() {
		l.remember(lease.DeepCopy())
	}
	return lease, nil
}

// Acquire takes the lock for the request's holder when it is free, already
// the holder's, or held by a holder the Judge finds stale, and no waiter
// queued before it wants it.
//
// A holder that this Lock last saw holding the lock (its own take or
// Confirm, a live read) still holds it without a read: that is the turn of
// every running operation, and nothing it decides from it disrupts a
// machine without a Confirm, whose guarded write fails (and reads the Lease
// again) if anybody else wrote the Lease since.
//
// A free lock that this Lock last saw free (most often the release it
// wrote for the holder before, in the same controller) is taken on that
// copy, without a read: the take is a guarded write, which conflicts if
// anybody wrote the Lease since. Every other decision, a wait above all,
// rests on a live read, so that the reason it gives is current.
//
// A take whose guarded write conflicts decides once more, at once, from the
// Lease read again: somebody wrote it between the read and the write, most
// often the holder judged over releasing it itself (a completed operation
// lets go right after it records its end). The caller's next turn would
// come to the same decision a requeue later. A holder whose end this
// process is writing (Ending) is not judged at all: Acquire waits for its
// release, then decides on the Lease that the release wrote.
func (l *Lock) Acquire(ctx context.Context, req Request) (Result, error) {
	res, err := l.acquire(ctx, req)
	if errors.Is(err, ErrConflict) {
		res, err = l.acquire(ctx, req)
	}
	return res, err
}

func (l *Lock) acquire(ctx context.Context, req Request) (Result, error) {
	if seen := l.lastSeen(); seen.lease != nil {
		st, err := stateOf(seen.lease)
		switch {
		case err != nil:
		case st.Holds(req.Holder):
			return Result{Acquired: true, AlreadyHeld: true, Holder: req.Holder.Identity, Since: st.Since, Seen: seen}, nil
		case st.Free():
			ahead, err := l.ahead(ctx, req, st.Waiting)
			if err != nil {
				return Result{}, err
			}
			if ahead == "" {
				res, err := l.take(ctx, seen.lease, st, req.Holder, "", seen.at)
				if !apierrors.IsNotFound(err) {
					return res, err
				}
				// Deleted since: the live read below finds no Lease and creates it.
			}
		}
	}
	lease, err := l.read(ctx, l.live())
	if err != nil {
		return Result{}, err
	}
	readAt := time.Now()
	if lease == nil {
		if ahead, err := l.ahead(ctx, req, nil); err != nil || ahead != "" {
			return Result{Ahead: ahead}, err
		}
		return l.create(ctx, req.Holder)
	}
	st, err := stateOf(lease)
	if err != nil {
		return Result{}, err
	}
	me := req.Holder
	awaited := false
	if !st.Free() && !st.Holds(me) {
		found, ended, err := l.awaitEnd(ctx, req, st.Holder)
		if err != nil {
			return Result{}, err
		}
		if ended {
			// Decide again, most often on the free Lease that the release wrote.
			return l.acquire(ctx, req)
		}
		awaited = found
	}
	switch {
	case st.Holds(me):
		// Its own, or lent by it to its Job: it still holds it, through the borrower.
		return Result{Acquired: true, AlreadyHeld: true, Holder: me.Identity, Since: st.Since, Seen: Seen{lease, readAt}}, nil
	case st.Holder.UID == "" && st.Holder.Identity == me.Identity:
		// Taken before holders' UIDs were recorded: it is this holder's.
		if err := l.write(ctx, lease, func(le *coordinationv1.Lease) { setHolder(le, me, st.Since) }); err != nil {
			return Result{}, err
		}
		return Result{Acquired: true, AlreadyHeld: true, Holder: me.Identity, Since: st.Since}, nil
	}
	tookOver := ""
	if !st.Free() {
		v, err := l.stale(ctx, st)
		if err != nil {
			return Result{}, fmt.Errorf("judge lock holder %s: %w", st.Holder.Identity, err)
		}
		if !v.Stale {
			return l.wait(ctx, lease, st, req, Result{Holder: st.Holder.Identity, Since: st.Since})
		}
		if !awaited {
			// The holder's end may have begun here while it was judged (its
			// end written is what makes it completed): await its release
			// rather than take it over.
			_, ended, err := l.awaitEnd(ctx, req, st.Holder)
			if err != nil {
				return Result{}, err
			}
			if ended {
				return l.acquire(ctx, req)
			}
		}
		tookOver = st.Holder.Identity + " (" + v.Why + ")"
	}
	if ahead, err := l.ahead(ctx, req, st.Waiting); err != nil || ahead != "" {
		if err != nil {
			return Result{}, err
		}
		res := Result{Ahead: ahead}
		if tookOver == "" {
			res.Holder = st.Holder.Identity
		}
		return l.wait(ctx, lease, st, req, res)
	}
	return l.take(ctx, lease, st, me, tookOver, readAt)
}

// take writes me as the holder of lease (whose state is st, as of seenAt),
// out of the queue, noting the stale holder it took over from, if any.
func (l *Lock) take(ctx context.Context, lease *coordinationv1.Lease, st State, me Holder, tookOver string, seenAt time.Time) (Result, error) {
	now := l.now()
	err := l.write(ctx, lease, func(le *coordinationv1.Lease) {
		setHolder(le, me, now)
		setWaiting(le, slices.DeleteFunc(st.Waiting, func(w ichorv1.LockWaiter) bool { return w.UID == me.UID }))
		if tookOver != "" {
			metav1.SetMetaDataAnnotation(&le.ObjectMeta, TakenOverAnnotation, tookOver)
		}
	})
	if err != nil {
		return Result{}, err
	}
	res := Result{Acquired: true, Holder: me.Identity, Since: now, TookOver: tookOver}
	if tookOver == "" {
		res.FreeAt = l.freeSince(lease, seenAt)
	}
	return res, nil
}

// freeSince is FreeAt for a take written on the free lease seen at seenAt:
// the moment its releaser became idle when this Lock wrote that release.
func (l *Lock) freeSince(lease *coordinationv1.Lease, seenAt time.Time) time.Time {
	l.mu.Lock()
	defer l.mu.Unlock()
	if r := l.idleRelease; r.resourceVersion != "" && r.resourceVersion == lease.ResourceVersion && r.since.Before(seenAt) {
		return r.since
	}
	return seenAt
}

// ahead names the waiter that goes before the request, if any.
func (l *Lock) ahead(ctx context.Context, req Request, jobs []ichorv1.LockWaiter) (string, error) {
	if req.Place == nil || l.Queue == nil {
		return "", nil
	}
	ahead, err := l.Queue.Ahead(ctx, req.Holder, *req.Place, jobs)
	if err != nil {
		return "", fmt.Errorf("the queue for the cluster lock: %w", err)
	}
	return ahead, nil
}

// wait returns res for a taker that has to wait, first queueing it in the
// Lease when the request asks for that and it is not queued yet.
func (l *Lock) wait(ctx context.Context, lease *coordinationv1.Lease, st State, req Request, res Result) (Result, error) {
	if !req.Queue || req.Place == nil || slices.ContainsFunc(st.Waiting, func(w ichorv1.LockWaiter) bool { return w.UID == req.Holder.UID }) {
		return res, nil
	}
	waiting := append(slices.Clone(st.Waiting), ichorv1.LockWaiter{Identity: req.Holder.Identity, UID: req.Holder.UID, Place: *req.Place})
	return res, l.write(ctx, lease, func(le *coordinationv1.Lease) { setWaiting(le, waiting) })
}

// Place returns where the holder waits in the Lease's queue, if it does.
func (s State) Place(h Holder) (ichorv1.QueuePlace, bool) {
	for _, w := range s.Waiting {
		if w.UID == h.UID {
			return w.Place, true
		}
	}
	return ichorv1.QueuePlace{}, false
}

func (l *Lock) create(ctx context.Context, h Holder) (Result, error) {
	lease := newLease(l.Namespace)
	now := l.now()
	setHolder(lease, h, now)
	if err := l.createLease(ctx, lease); err != nil {
		return Result{}, err
	}
	return Result{Acquired: true, Holder: h.Identity, Since: now}, nil
}

func newLease(namespace string) *coordinationv1.Lease {
	return &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: ichorv1.LockLeaseName,
		Labels: map[string]string{"app.kubernetes.io/part-of": "ichor"}}}
}

// createLease creates the Lease, renewed now; ErrConflict if another
// created it first.
func (l *Lock) createLease(ctx context.Context, lease *coordinationv1.Lease) error {
	lease.Spec.RenewTime = ptr.To(metav1.NewMicroTime(l.now()))
	err := l.Client.Create(ctx, lease)
	if apierrors.IsAlreadyExists(err) {
		return ErrConflict
	}
	if err != nil {
		return fmt.Errorf("create cluster lock %s/%s: %w", l.Namespace, ichorv1.LockLeaseName, err)
	}
	l.remember(lease.DeepCopy()) // as the API server answered
	return nil
}

// setHolder makes h the holder since the given time; a zero h frees the
// lock. The caller sets renewTime.
func setHolder(lease *coordinationv1.Lease, h Holder, since time.Time) {
	for _, k := range []string{LentByAnnotation, LentByObjectAnnotation, LentByUIDAnnotation} {
		delete(lease.Annotations, k)
	}
	if h.Identity == "" {
		lease.Spec.HolderIdentity, lease.Spec.AcquireTime = nil, nil
		delete(lease.Annotations, ichorv1.LockHolderUIDAnnotation)
		delete(lease.Annotations, ichorv1.LockHolderObjectAnnotation)
		return
	}
	acquired := metav1.NewMicroTime(since)
	lease.Spec.HolderIdentity, lease.Spec.AcquireTime = ptr.To(h.Identity), &acquired
	metav1.SetMetaDataAnnotation(&lease.ObjectMeta, ichorv1.LockHolderUIDAnnotation, string(h.UID))
	metav1.SetMetaDataAnnotation(&lease.ObjectMeta, ichorv1.LockHolderObjectAnnotation, h.Object.String())
}

// setList writes list as the Lease's JSON annotation key, or removes the
// annotation when list is empty.
func setList[T any](lease *coordinationv1.Lease, key string, list []T) {
	if len(list) == 0 {
		delete(lease.Annotations, key)
		return
	}
	b, _ := json.Marshal(list) // plain strings and times: cannot fail
	metav1.SetMetaDataAnnotation(&lease.ObjectMeta, key, string(b))
}

func setWaiting(lease *coordinationv1.Lease, waiting []ichorv1.LockWaiter) {
	setList(lease, ichorv1.LockWaitingJobsAnnotation, waiting)
}

func setRemovals(lease *coordinationv1.Lease, rs []ichorv1.LockRemoval) {
	setList(lease, ichorv1.LockRemovalsAnnotation, rs)
}

// write applies change to a copy of lease, renews it, and updates it with
// the resourceVersion read.
func (l *Lock) write(ctx context.Context, lease *coordinationv1.Lease, change func(*coordinationv1.Lease)) error {
	lease = lease.DeepCopy()
	change(lease)
	return l.put(ctx, lease)
}

// put renews lease and updates it with the resourceVersion it carries; on
// success lease is as the API server answered, and the Lease this Lock
// last saw: the caller only reads it from then on.
func (l *Lock) put(ctx context.Context, lease *coordinationv1.Lease) error {
	now := metav1.NewMicroTime(l.now())
	lease.Spec.RenewTime = &now
	err := l.Client.Update(ctx, lease)
	if err != nil {
		// What this Lock saw is not the Lease any more (written since, or
		// gone): the next Acquire reads it again.
		l.remember(nil)
	}
	if apierrors.IsConflict(err) {
		return ErrConflict
	}
	if err != nil {
		return fmt.Errorf("update cluster lock %s/%s: %w", l.Namespace, ichorv1.LockLeaseName, err)
	}
	l.remember(lease) // as the API server answered: its resourceVersion is the new one
	return nil
}

// Confirm checks, with a guarded write to the Lease, that h still holds the
// lock: call it right before a step that disrupts a machine. A taker that
// judged h stale from an earlier read then fails to take the lock (its
// write conflicts with this one); if it took the lock first, Confirm
// returns a *NotHeldError and nothing may start. The write is made on the
// Lease as this Lock last saw it, and on a fresh read when that is stale.
//
// Confirms of one holder that overlap share their writes, as a group
// commit does: a Confirm that finds another under way waits for it to end,
// then one write answers every Confirm that waited (each of them began
// before that write, so its answer is as fresh as a write of its own).
// Without that, the machines of a batch that reach their drains together
// would each write the Lease, conflict with each other, and read it again.
func (l *Lock) Confirm(ctx context.Context, h Holder) error {
	l.mu.Lock()
	next, underWay := l.confirms[h]
	if !underWay {
		if l.confirms == nil {
			l.confirms = map[Holder]*confirmed{}
		}
		l.confirms[h] = nil
		l.mu.Unlock()
		err := l.ConfirmSeen(ctx, h, l.lastSeen())
		go l.confirmWaiters(context.WithoutCancel(ctx), h)
		return err
	}
	if next == nil {
		next = &confirmed{done: make(chan struct{})}
		l.confirms[h] = next
	}
	next.waiting++
	l.mu.Unlock()
	select {
	case <-next.done:
		return next.err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// confirmWaiters answers, one write for each round, the Confirms of h
// that waited for the one before, until none waits.
func (l *Lock) confirmWaiters(ctx context.Context, h Holder) {
	for {
		l.mu.Lock()
		next := l.confirms[h]
		if next == nil {
			delete(l.confirms, h)
			l.mu.Unlock()
			return
		}
		l.confirms[h] = nil
		l.mu.Unlock()
		wctx, cancel := context.WithTimeout(ctx, confirmTimeout)
		next.err = l.ConfirmSeen(wctx, h, l.lastSeen())
		cancel()
		close(next.done)
	}
}

// confirmed is the answer to one round of Confirms.
type confirmed struct {
	done    chan struct{}
	err     error
	waiting int // the Confirms that wait for it
}

// confirmTimeout bounds a shared Confirm's write, which runs for several
// callers and so under none of their contexts.
const confirmTimeout = 30 * time.Second

// ConfirmSeen is Confirm that makes its guarded write on the Lease seen
// (Acquire's, when h already held the lock) without reading it again: the
// write carries the resourceVersion seen, so it succeeds only if nobody
// wrote the Lease since, exactly as when it is read first. When somebody
// did, it reads the Lease again and confirms from that.
func (l *Lock) ConfirmSeen(ctx context.Context, h Holder, seen Seen) error {
	if seen.lease != nil {
		if st, err := stateOf(seen.lease); err == nil && st.Holds(h) {
			if err := l.write(ctx, seen.lease, func(*coordinationv1.Lease) {}); !errors.Is(err, ErrConflict) {
				return err
			}
		}
	}
	return l.update(ctx, func(st State, lease *coordinationv1.Lease) (bool, error) {
		if !st.Holds(h) {
			return false, &NotHeldError{Holder: st.Holder.Identity}
		}
		return true, nil // the write renews it
	})
}

// Release frees the lock if h holds it (by UID), and reports how long it was
// held. Releasing a lock held by another holder (or nobody) changes nothing.
// A borrower's release gives the lock back to its lender, never frees it.
func (l *Lock) Release(ctx context.Context, h Holder) (held time.Duration, released bool, err error) {
	var freed *coordinationv1.Lease
	err = l.update(ctx, func(st State, lease *coordinationv1.Lease) (bool, error) {
		released, freed = st.HeldBy(h), nil
		switch {
		case released && st.Lent():
			setHolder(lease, st.LentBy, st.Since) // a borrower gives it back
		case released:
			setHolder(lease, Holder{}, time.Time{})
			freed = lease // update writes it in place
			if !st.Since.IsZero() {
				held = l.now().Sub(st.Since)
			}
		}
		return released, nil
	})
	if err == nil && freed != nil {
		l.releasedIdle(h, freed)
	}
	return held, released, err
}

// releasedIdle notes the free Lease that h's release wrote when h is
// ending idle here (Ending): a take written on it is free from then on.
func (l *Lock) releasedIdle(h Holder, freed *coordinationv1.Lease) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if e := l.ending[h.UID]; e != nil && !e.idle.IsZero() {
		l.idleRelease = idleRelease{resourceVersion: freed.ResourceVersion, since: e.idle}
	}
}

// stale judges the holder; a lent lock is stale only once borrower and
// lender both are (and over once both are over).
func (l *Lock) stale(ctx context.Context, st State) (Verdict, error) {
	v, err := l.Judge.Stale(ctx, st.Holder)
	if err != nil || !v.Stale || !st.Lent() {
		return v, err
	}
	lender, err := l.Judge.Stale(ctx, st.LentBy)
	if err != nil || !lender.Stale {
		return Verdict{}, err
	}
	return Verdict{Stale: true, Over: v.Over && lender.Over,
		Why: fmt.Sprintf("%s; lent by %s, %s", v.Why, st.LentBy.Identity, lender.Why)}, nil
}

// Lend hands the lock from lender, which must hold it in its own name, to
// borrower in one guarded write, so it is never free between them. The
// Lease records the lender: the lender still holds the lock (Holds), and
// takes it back with Reclaim once the borrower is done. Lending again to the
// same borrower changes nothing.
func (l *Lock) Lend(ctx context.Context, lender, borrower Holder) error {
	return l.update(ctx, func(st State, lease *coordinationv1.Lease) (bool, error) {
		switch {
		case st.HeldBy(borrower) && st.Lent() && st.LentBy.UID == lender.UID:
			return false, nil
		case !st.HeldBy(lender) || st.Lent():
			return false, fmt.Errorf("%s cannot lend the cluster lock to %s: it is held by %q", lender.Identity, borrower.Identity, st.Holder.Identity)
		}
		setHolder(lease, borrower, st.Since)
		metav1.SetMetaDataAnnotation(&lease.ObjectMeta, LentByAnnotation, lender.Identity)
		metav1.SetMetaDataAnnotation(&lease.ObjectMeta, LentByObjectAnnotation, lender.Object.String())
		metav1.SetMetaDataAnnotation(&lease.ObjectMeta, LentByUIDAnnotation, string(lender.UID))
		return true, nil
	})
}

// Reclaim takes a lock that lender lent back from its borrower. It reports
// whether lender holds the lock in its own name now (false when it had not
// lent it and does not hold it).
func (l *Lock) Reclaim(ctx context.Context, lender Holder) (held bool, err error) {
	err = l.update(ctx, func(st State, lease *coordinationv1.Lease) (bool, error) {
		held = false
		switch {
		case st.HeldBy(lender) && !st.Lent():
			held = true
			return false, nil
		case !st.Lent() || st.LentBy.UID != lender.UID:
			return false, nil
		}
		held = true
		setHolder(lease, lender, st.Since) // lending and reclaiming are one holding
		return true, nil
	})
	return held, err
}

// Withdraw takes h out of the Lease's queue (a Job that stops waiting).
func (l *Lock) Withdraw(ctx context.Context, h Holder) error {
	return l.update(ctx, func(st State, lease *coordinationv1.Lease) (bool, error) {
		if _, queued := st.Place(h); !queued {
			return false, nil
		}
		setWaiting(lease, slices.DeleteFunc(st.Waiting, func(w ichorv1.LockWaiter) bool { return w.UID == h.UID }))
		return true, nil
	})
}

// RecordBaseline records, once, that the membership reconciler has run in
// the cluster (at the given time), creating the Lease free if it is
// missing. It reports the baseline the Lease holds now.
func (l *Lock) RecordBaseline(ctx context.Context, at time.Time) (string, error) {
	var baseline string
	err := l.upsert(ctx, func(st State, lease *coordinationv1.Lease) (bool, error) {
		if baseline = st.Baseline; baseline != "" {
			return false, nil
		}
		baseline = at.UTC().Format(time.RFC3339)
		metav1.SetMetaDataAnnotation(&lease.ObjectMeta, ichorv1.LockMembershipBaselineAnnotation, baseline)
		return true, nil
	})
	return baseline, err
}

// PutRemoval records r in the Lease's pending removals (replacing the
// entry of its UID, if any), creating the Lease free if it is missing.
func (l *Lock) PutRemoval(ctx context.Context, r ichorv1.LockRemoval) error {
	return l.upsert(ctx, func(st State, lease *coordinationv1.Lease) (bool, error) {
		rs := slices.DeleteFunc(slices.Clone(st.Removals), func(o ichorv1.LockRemoval) bool { return o.UID == r.UID })
		setRemovals(lease, append(rs, r))
		return true, nil
	})
}

// EndRemoval takes the removal of the gone Node h stands for off the
// Lease's list and, in the same write, releases the lock if h holds it. It
// reports whether it released the lock.
func (l *Lock) EndRemoval(ctx context.Context, h Holder) (released bool, err error) {
	err = l.update(ctx, func(st State, lease *coordinationv1.Lease) (bool, error) {
		_, listed := st.Removal(h.UID)
		released = st.HeldBy(h)
		if released {
			setHolder(lease, Holder{}, time.Time{})
		}
		if listed {
			setRemovals(lease, slices.DeleteFunc(slices.Clone(st.Removals), func(o ichorv1.LockRemoval) bool { return o.UID == h.UID }))
		}
		return listed || released, nil
	})
	return released, err
}

// upsert is update on a Lease that it creates, free, when it is missing.
func (l *Lock) upsert(ctx context.Context, change func(State, *coordinationv1.Lease) (bool, error)) error {
	return l.change(ctx, true, change)
}

// update reads the Lease live, lets change decide on a copy, and writes the
// copy if change says so, reading again while the Lease changes under it. A
// missing Lease is a free lock with nothing to change.
func (l *Lock) update(ctx context.Context, change func(State, *coordinationv1.Lease) (bool, error)) error {
	return l.change(ctx, false, change)
}

func (l *Lock) change(ctx context.Context, create bool, change func(State, *coordinationv1.Lease) (bool, error)) error {
	return retry.OnError(retry.DefaultRetry, func(err error) bool { return errors.Is(err, ErrConflict) }, func() error {
		lease, err := l.read(ctx, l.live())
		if err != nil {
			return err
		}
		if lease == nil && !create {
			_, err := change(State{}, &coordinationv1.Lease{})
			return err
		}
		st := State{}
		if lease == nil {
			lease = newLease(l.Namespace)
		} else if st, err = stateOf(lease); err != nil {
			return err
		} else {
			lease = lease.DeepCopy()
		}
		if write, err := change(st, lease); err != nil || !write {
			return err
		}
		if lease.ResourceVersion == "" {
			return l.createLease(ctx, lease)
		}
		return l.put(ctx, lease)
	})
}

// Changed passes the events of the lock Lease that can change whose turn it
// is: a new holder, or a change of the Jobs queued in it. It drops the
// writes that only renew the hold (Confirm's), which change nothing for
// anyone else.
func Changed() predicate.Funcs {
	return predicate.Funcs{UpdateFunc: func(e event.UpdateEvent) bool {
		a, b := e.ObjectOld.GetAnnotations(), e.ObjectNew.GetAnnotations()
		la, okA := e.ObjectOld.(*coordinationv1.Lease)
		lb, okB := e.ObjectNew.(*coordinationv1.Lease)
		return !okA || !okB || ptr.Deref(la.Spec.HolderIdentity, "") != ptr.Deref(lb.Spec.HolderIdentity, "") ||
			a[ichorv1.LockHolderUIDAnnotation] != b[ichorv1.LockHolderUIDAnnotation] ||
			a[ichorv1.LockWaitingJobsAnnotation] != b[ichorv1.LockWaitingJobsAnnotation]
	}}
}
