package lock_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/lock"
	"maesh.dev/ichor/internal/testenv"
)

var env *testenv.Env

func TestMain(m *testing.M) { os.Exit(testenv.Main(m, &env)) }

func newLock(ns string) *lock.Lock {
	judge := lock.ClusterJudge{Client: env.Client}
	return &lock.Lock{Client: env.Client, Namespace: ns, Judge: judge, Queue: lock.ClusterQueue{Operations: env.Client, Judge: judge}}
}

// world makes the objects that hold the lock, in one namespace.
type world struct {
	t  *testing.T
	ns string
}

func newWorld(t *testing.T) *world { return &world{t: t, ns: env.Namespace(t)} }

func (w *world) op(name string, st ichorv1.TalosOperationStatus, spec ...ichorv1.TalosOperationSpec) *ichorv1.TalosOperation {
	w.t.Helper()
	op := &ichorv1.TalosOperation{ObjectMeta: metav1.ObjectMeta{Namespace: w.ns, Name: name},
		Spec: ichorv1.TalosOperationSpec{Kind: ichorv1.KindCNI}}
	if len(spec) > 0 {
		op.Spec = spec[0]
	}
	if err := env.Client.Create(context.Background(), op); err != nil {
		w.t.Fatal(err)
	}
	w.setStatus(op, st)
	return op
}

func (w *world) setStatus(op *ichorv1.TalosOperation, st ichorv1.TalosOperationStatus) {
	w.t.Helper()
	op.Status = st
	if err := env.Client.Status().Update(context.Background(), op); err != nil {
		w.t.Fatal(err)
	}
}

// holds is an operation holding the lock under its own identity.
func holds(op *ichorv1.TalosOperation) lock.Holder {
	return lock.ForOperation(op, ichorv1.OperationIdentity(op.Namespace, op.Name))
}

func (w *world) node(name string, ready bool) *corev1.Node {
	w.t.Helper()
	n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: w.ns + "-" + name, Labels: map[string]string{ichorv1.ControlPlaneLabel: ""}}}
	if err := env.Client.Create(context.Background(), n); err != nil {
		w.t.Fatal(err)
	}
	w.t.Cleanup(func() { _ = env.Client.Delete(context.Background(), n) })
	status := corev1.ConditionFalse
	if ready {
		status = corev1.ConditionTrue
	}
	n.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: status}}
	if err := env.Client.Status().Update(context.Background(), n); err != nil {
		w.t.Fatal(err)
	}
	return n
}

func (w *world) job(name string, done batchv1.JobConditionType) *batchv1.Job {
	w.t.Helper()
	ctx := context.Background()
	job := &batchv1.Job{ObjectMeta: metav1.ObjectMeta{Namespace: w.ns, Name: name}, Spec: batchv1.JobSpec{
		Template: corev1.PodTemplateSpec{Spec: corev1.PodSpec{RestartPolicy: corev1.RestartPolicyNever,
			Containers: []corev1.Container{{Name: "helm", Image: "helm"}}}}}}
	if err := env.Client.Create(ctx, job); err != nil {
		w.t.Fatal(err)
	}
	if done == "" {
		return job
	}
	now := metav1.Now()
	job.Status.StartTime = &now
	if done == batchv1.JobComplete {
		job.Status.CompletionTime = &now
		job.Status.Succeeded = 1
		job.Status.Conditions = []batchv1.JobCondition{{Type: batchv1.JobSuccessCriteriaMet, Status: corev1.ConditionTrue, LastTransitionTime: now}}
	} else {
		job.Status.Failed = 1
		job.Status.Conditions = []batchv1.JobCondition{{Type: batchv1.JobFailureTarget, Status: corev1.ConditionTrue, LastTransitionTime: now}}
	}
	job.Status.Conditions = append(job.Status.Conditions, batchv1.JobCondition{Type: done, Status: corev1.ConditionTrue, LastTransitionTime: now})
	if err := env.Client.Status().Update(ctx, job); err != nil {
		w.t.Fatal(err)
	}
	return job
}

var (
	running = ichorv1.TalosOperationStatus{Phase: ichorv1.PhaseRunning}
	failed  = ichorv1.TalosOperationStatus{Phase: ichorv1.PhasePaused, Reason: ichorv1.ReasonStepFailed, FailureReason: "UpgradeFailed"}
	// inFlight failed on one machine while another still reboots.
	inFlight = ichorv1.TalosOperationStatus{Phase: ichorv1.PhasePaused, Reason: ichorv1.ReasonStepFailed, FailureReason: "UpgradeFailed",
		Machines: []ichorv1.MachineStatus{{Name: "w1", Role: ichorv1.RoleWorker, Phase: ichorv1.MachineFailed, Step: "install"}, {Name: "w2", Role: ichorv1.RoleWorker, Phase: ichorv1.MachineInProgress, Step: "reboot"}}}
)

func mustAcquire(t *testing.T, l *lock.Lock, h lock.Holder) lock.Result {
	t.Helper()
	res, err := l.Acquire(context.Background(), lock.Request{Holder: h})
	if err != nil || !res.Acquired {
		t.Fatalf("%s takes the lock: %+v %v", h, res, err)
	}
	return res
}

func TestAcquireAndRelease(t *testing.T) {
	ctx := context.Background()
	w := newWorld(t)
	l := newLock(w.ns)
	// Both holders exist and run, so neither is stale.
	a, b := holds(w.op("a", running)), holds(w.op("b", running))

	if st, err := l.Get(ctx); err != nil || !st.Free() {
		t.Fatalf("a missing Lease is a free lock: %+v %v", st, err)
	}
	if res := mustAcquire(t, l, a); res.AlreadyHeld {
		t.Errorf("a free lock taken is not already held: %+v", res)
	}
	if res := mustAcquire(t, l, a); !res.AlreadyHeld {
		t.Errorf("acquire again by the holder: %+v", res)
	}
	if res, err := l.Acquire(ctx, lock.Request{Holder: b}); err != nil || res.Acquired || res.Holder != a.Identity {
		t.Fatalf("b must wait for a: %+v %v", res, err)
	}
	if _, released, err := l.Release(ctx, b); err != nil || released {
		t.Fatalf("b released a lock it does not hold: %v %v", released, err)
	}
	if st, _ := l.Get(ctx); st.Holder != a {
		t.Fatalf("holder changed to %s", st.Holder)
	}
	if _, released, err := l.Release(ctx, a); err != nil || !released {
		t.Fatalf("release: %v %v", released, err)
	}
	if st, _ := l.Get(ctx); !st.Free() {
		t.Fatalf("released lock still held by %s", st.Holder)
	}
	if res := mustAcquire(t, l, b); res.TookOver != "" {
		t.Fatalf("acquire after release is no takeover: %+v", res)
	}
}

// TestOneIdentityTwoHolders: two holders that share an identity (two
// resets of one control plane; a reset and a removal of it) are two
// holders: the second waits, and neither can release the other's lock.
func TestOneIdentityTwoHolders(t *testing.T) {
	ctx := context.Background()
	w := newWorld(t)
	l := newLock(w.ns)
	cp := w.node("cp", true)
	id := ichorv1.MachineIdentity(cp.Name)
	reset := ichorv1.TalosOperationSpec{Kind: ichorv1.KindNode, Node: &ichorv1.NodeAction{Machine: cp.Name, Action: ichorv1.NodeReset}}
	first := lock.ForOperation(w.op("reset-1", running, reset), id)
	second := lock.ForOperation(w.op("reset-2", running, reset), id)
	removal := lock.ForNode(cp)
	if first.Identity != second.Identity || first.Identity != removal.Identity {
		t.Fatalf("identities %s, %s, %s: the test wants one", first.Identity, second.Identity, removal.Identity)
	}
	mustAcquire(t, l, first)
	for _, other := range []lock.Holder{second, removal} {
		if res, err := l.Acquire(ctx, lock.Request{Holder: other}); err != nil || res.Acquired {
			t.Errorf("%s took the lock %s holds: %+v %v", other, first, res, err)
		}
		if _, released, err := l.Release(ctx, other); err != nil || released {
			t.Errorf("%s released the lock %s holds: %v", other, first, err)
		}
		if err := l.Confirm(ctx, other); !isNotHeld(err, id) {
			t.Errorf("%s confirmed the lock %s holds: %v", other, first, err)
		}
	}
	if st, _ := l.Get(ctx); st.Holder != first {
		t.Errorf("holder %s, want %s", st.Holder, first)
	}
}

func isNotHeld(err error, holder string) bool {
	var nh *lock.NotHeldError
	return errors.As(err, &nh) && nh.Holder == holder
}

// TestOnlyOneWins: many takers at once, each with its own view; optimistic
// concurrency lets exactly one of them hold the lock.
func TestOnlyOneWins(t *testing.T) {
	ctx := context.Background()
	ns := env.Namespace(t)
	const takers = 8
	var wg sync.WaitGroup
	won := make(chan lock.Holder, takers)
	for i := range takers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			l := &lock.Lock{Client: env.Client, Namespace: ns, Judge: neverStale{}}
			name := fmt.Sprintf("taker-%d", i)
			h := lock.Holder{Identity: ichorv1.JobIdentity(ns, name), UID: types.UID(name),
				Object: ichorv1.LockObject{Kind: ichorv1.ObjectJob, Namespace: ns, Name: name}}
			res, err := l.Acquire(ctx, lock.Request{Holder: h})
			if err != nil && !errors.Is(err, lock.ErrConflict) {
				t.Errorf("acquire %s: %v", h, err)
			}
			if err == nil && res.Acquired {
				won <- h
			}
		}()
	}
	wg.Wait()
	close(won)
	var winners []lock.Holder
	for h := range won {
		winners = append(winners, h)
	}
	if len(winners) != 1 {
		t.Fatalf("winners = %v, want exactly one", winners)
	}
	l := &lock.Lock{Client: env.Client, Namespace: ns}
	if st, _ := l.Get(ctx); st.Holder != winners[0] {
		t.Fatalf("Lease holder %s, winner %s", st.Holder, winners[0])
	}
}

type neverStale struct{}

func (neverStale) Stale(context.Context, lock.Holder) (lock.Verdict, error) {
	return lock.Verdict{}, nil
}

// judgeFunc is a Judge that does what the test says, between a taker's
// read of the Lease and its write.
type judgeFunc func(context.Context, lock.Holder) (lock.Verdict, error)

func (f judgeFunc) Stale(ctx context.Context, h lock.Holder) (lock.Verdict, error) { return f(ctx, h) }

// TestConfirmBeatsAStaleJudgement: B judges the failed holder A stale from
// what it read; before B writes, A is retried and, before its next step,
// confirms that it holds the lock, reading the Lease again or writing the
// one its Acquire saw before B read it (ConfirmSeen). Exactly one of them
// may believe it holds the lock, whichever order the two writes take.
func TestConfirmBeatsAStaleJudgement(t *testing.T) {
	ctx := context.Background()
	confirms := map[string]func(*lock.Lock, lock.Holder, lock.Result) error{
		"Confirm": func(l *lock.Lock, h lock.Holder, _ lock.Result) error { return l.Confirm(ctx, h) },
		"ConfirmSeen": func(l *lock.Lock, h lock.Holder, acquired lock.Result) error {
			return l.ConfirmSeen(ctx, h, acquired.Seen)
		},
	}
	for name, confirm := range confirms {
		for _, bFirst := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/takeover written first: %v", name, bFirst), func(t *testing.T) {
				w := newWorld(t)
				l := newLock(w.ns)
				aOp := w.op("a", failed)
				a, b := holds(aOp), holds(w.op("b", running))
				mustAcquire(t, l, a)
				seen := mustAcquire(t, l, a) // held already: what ConfirmSeen writes
				var aErr error
				retryA := func() {
					w.setStatus(aOp, running)
					aErr = confirm(l, a, seen)
				}
				// Another controller's Lock on the same Lease, judging by its own reads.
				lb := &lock.Lock{Client: l.Client, Live: l.Live, Namespace: l.Namespace, Queue: l.Queue, Now: l.Now}
				lb.Judge = judgeFunc(func(ctx context.Context, h lock.Holder) (lock.Verdict, error) {
					v, err := l.Judge.Stale(ctx, h)
					if !bFirst {
						retryA()
					}
					return v, err
				})
				res, bErr := lb.Acquire(ctx, lock.Request{Holder: b})
				if bFirst {
					retryA()
				}
				aHolds, bHolds := aErr == nil, bErr == nil && res.Acquired
				if aHolds == bHolds {
					t.Fatalf("a holds: %v (%v); b holds: %v (%+v %v): exactly one may", aHolds, aErr, bHolds, res, bErr)
				}
				if bFirst != bHolds {
					t.Errorf("the first write should win: b holds %v", bHolds)
				}
				if st, _ := l.Get(ctx); (st.Holder == b) != bHolds {
					t.Errorf("Lease holder %s; b believes it holds: %v", st.Holder, bHolds)
				}
			})
		}
	}
}

// countingReader counts the reads of the Lease that go to the API server.
type countingReader struct {
	client.Reader
	reads int
}

func (r *countingReader) Get(ctx context.Context, key client.ObjectKey, obj client.Object, opts ...client.GetOption) error {
	r.reads++
	return r.Reader.Get(ctx, key, obj, opts...)
}

// TestConfirmSeenWritesWithoutReading: confirming on the Lease that
// Acquire saw reads nothing when nobody wrote it since, and reads it again
// when somebody did (a renewal by another replica of the same holder), and
// still confirms.
func TestConfirmSeenWritesWithoutReading(t *testing.T) {
	ctx := context.Background()
	w := newWorld(t)
	live := &countingReader{Reader: env.Client}
	l := newLock(w.ns)
	l.Live = live
	a := holds(w.op("a", running))
	mustAcquire(t, l, a)
	seen := mustAcquire(t, l, a)
	before := live.reads
	if err := l.ConfirmSeen(ctx, a, seen.Seen); err != nil {
		t.Fatalf("ConfirmSeen on an unchanged Lease: %v", err)
	}
	if n := live.reads - before; n != 0 {
		t.Errorf("ConfirmSeen on an unchanged Lease read it %d time(s), want none", n)
	}
	// The write just made changed the Lease under seen.
	before = live.reads
	if err := l.ConfirmSeen(ctx, a, seen.Seen); err != nil {
		t.Fatalf("ConfirmSeen on a Lease written since: %v", err)
	}
	if n := live.reads - before; n != 1 {
		t.Errorf("ConfirmSeen on a Lease written since read it %d time(s), want 1", n)
	}
}

// TestHolderAcquiresFromWhatItSaw: a holder that this Lock saw holding
// the lock acquires it again without reading the Lease (every running
// operation's turn does), and what it saw never lets it disrupt after
// somebody else wrote the Lease: a takeover by another controller's Lock
// makes its Confirm refuse and its next Acquire see the new holder; a
// Lease deleted under it is taken again.
func TestHolderAcquiresFromWhatItSaw(t *testing.T) {
	ctx := context.Background()
	w := newWorld(t)
	live := &countingReader{Reader: env.Client}
	l := newLock(w.ns)
	l.Live = live
	aOp := w.op("a", running)
	a, b := holds(aOp), holds(w.op("b", running))
	mustAcquire(t, l, a)
	before := live.reads
	if res := mustAcquire(t, l, a); !res.AlreadyHeld {
		t.Fatalf("acquire again by the holder: %+v", res)
	}
	if n := live.reads - before; n != 0 {
		t.Errorf("the holder's Acquire read the Lease %d time(s), want none", n)
	}

	// a ends; another controller's Lock judges it stale and takes over.
	w.setStatus(aOp, ichorv1.TalosOperationStatus{Phase: ichorv1.PhaseSucceeded})
	if res := mustAcquire(t, newLock(w.ns), b); res.TookOver == "" {
		t.Fatalf("b took a finished holder's lock without a takeover: %+v", res)
	}
	var notHeld *lock.NotHeldError
	if err := l.Confirm(ctx, a); !errors.As(err, &notHeld) || notHeld.Holder != b.Identity {
		t.Fatalf("a's Confirm after b's takeover: %v, want b holds it", err)
	}
	if res, err := l.Acquire(ctx, lock.Request{Holder: a}); err != nil || res.Acquired || res.Holder != b.Identity {
		t.Fatalf("a's Acquire after its Confirm was refused: %+v %v, want b holds it", res, err)
	}

	// The Lease goes while b's Lock saw b holding it.
	lb := newLock(w.ns)
	mustAcquire(t, lb, b)
	lease := &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Namespace: w.ns, Name: ichorv1.LockLeaseName}}
	if err := env.Client.Delete(ctx, lease); err != nil {
		t.Fatal(err)
	}
	if err := lb.Confirm(ctx, b); err == nil {
		t.Fatal("b confirmed a lock whose Lease is gone")
	}
	if res := mustAcquire(t, lb, b); res.AlreadyHeld {
		t.Errorf("b's Acquire after its Lease went: %+v, want it taken anew", res)
	}
}

// TestTakeFromTheRelease: an operation waiting for the lock takes it,
// without reading the Lease, from the release this Lock wrote for the
// holder before it (an operation's end, in the same controller). The copy
// is only a guarded write's basis: when somebody else took the lock since,
// the waiter waits behind that holder, as a live read shows it; when the
// Lease was deleted since, the waiter creates it.
func TestTakeFromTheRelease(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name string
		// since changes the Lease after the release, through another Lock.
		since func(w *world, c lock.Holder)
		want  func(b, c lock.Holder) string // the holder after b's Acquire
		reads int                           // b's live reads of the Lease
	}{
		{name: "nobody wrote it since", want: func(b, _ lock.Holder) string { return b.Identity }},
		{name: "another controller took it since", since: func(w *world, c lock.Holder) { mustAcquire(w.t, newLock(w.ns), c) },
			want: func(_, c lock.Holder) string { return c.Identity }, reads: 1},
		{name: "it was deleted since", since: func(w *world, _ lock.Holder) {
			lease := &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Namespace: w.ns, Name: ichorv1.LockLeaseName}}
			if err := env.Client.Delete(ctx, lease); err != nil {
				w.t.Fatal(err)
			}
		}, want: func(b, _ lock.Holder) string { return b.Identity }, reads: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := newWorld(t)
			live := &countingReader{Reader: env.Client}
			l := newLock(w.ns)
			l.Live = live
			a, b, c := holds(w.op("a", running)), holds(w.op("b", running)), holds(w.op("c", running))
			mustAcquire(t, l, a)
			if _, released, err := l.Release(ctx, a); err != nil || !released {
				t.Fatalf("a releases: %v %v", released, err)
			}
			if tc.since != nil {
				tc.since(w, c)
			}
			before := live.reads
			res, err := l.Acquire(ctx, lock.Request{Holder: b})
			reads := live.reads - before
			if err != nil {
				t.Fatalf("b's Acquire after a's release: %v", err)
			}
			if reads != tc.reads {
				t.Errorf("b's Acquire read the Lease %d time(s), want %d", reads, tc.reads)
			}
			want := tc.want(b, c)
			if st, _ := l.Current(ctx); st.Holder.Identity != want {
				t.Errorf("the Lease's holder after b's Acquire: %q, want %q", st.Holder.Identity, want)
			}
			if res.Acquired != (want == b.Identity) || (!res.Acquired && res.Holder != want) {
				t.Errorf("b's Acquire: %+v, want the lock held by %s", res, want)
			}
		})
	}
}

// TestFreeFromTheIdleRelease: a take written on the free Lease that this
// Lock's release of an ending holder wrote counts as free (FreeAt) from the
// moment that holder became idle (Ending's idle), since it changed nothing
// from then until its release: a taker's checks made after that moment are
// as good as checks made holding the lock. Not when the holder had work
// still to come (no idle moment), and not when the Lease was written
// between the release and the take: then FreeAt is when the take's Lease
// was seen free, as for any take.
func TestFreeFromTheIdleRelease(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name     string
		idle     bool
		since    func(t *testing.T, w *world) // writes the Lease after the release
		fromIdle bool
	}{
		{name: "a was idle", idle: true, fromIdle: true},
		{name: "a had work to come", idle: false},
		{name: "the Lease was written since", idle: true, since: func(t *testing.T, w *world) {
			lease := &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Namespace: w.ns, Name: ichorv1.LockLeaseName}}
			patch := client.RawPatch(types.MergePatchType, []byte(`{"metadata":{"annotations":{"touched":"yes"}}}`))
			if err := env.Client.Patch(ctx, lease, patch); err != nil {
				t.Fatal(err)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := newWorld(t)
			l := newLock(w.ns)
			a, b := holds(w.op("a", running)), holds(w.op("b", running))
			mustAcquire(t, l, a)
			var idle time.Time
			if tc.idle {
				idle = time.Now()
			}
			done := l.Ending(a, idle)
			releasing := time.Now()
			if _, released, err := l.Release(ctx, a); err != nil || !released {
				t.Fatalf("a releases: %v %v", released, err)
			}
			done()
			written := time.Now()
			if tc.since != nil {
				tc.since(t, w)
				written = time.Now()
			}
			res := mustAcquire(t, l, b)
			switch {
			case tc.fromIdle && !res.FreeAt.Equal(idle):
				t.Errorf("b's take is free from %s, want from a's idle moment %s", res.FreeAt.Format(time.StampMicro), idle.Format(time.StampMicro))
			case !tc.fromIdle && (res.FreeAt.Before(releasing) || (tc.since != nil && res.FreeAt.Before(written))):
				t.Errorf("b's take is free from %s, before the Lease it was written on was seen free (released from %s, last written before %s)",
					res.FreeAt.Format(time.StampMicro), releasing.Format(time.StampMicro), written.Format(time.StampMicro))
			}
		})
	}
}

// TestTakeoverMeetsTheRelease: b judges the holder a over (completed) from
// the Lease it read, and a releases the lock before b writes, as a
// completed operation does right after it records its end. b's guarded
// write conflicts, and the same Acquire takes the free lock from the Lease
// read again: no takeover, and no conflict left for the caller to requeue.
func TestTakeoverMeetsTheRelease(t *testing.T) {
	ctx := context.Background()
	w := newWorld(t)
	la := newLock(w.ns)
	aOp := w.op("a", running)
	a, b := holds(aOp), holds(w.op("b", running))
	mustAcquire(t, la, a)
	w.setStatus(aOp, ichorv1.TalosOperationStatus{Phase: ichorv1.PhaseSucceeded})
	// Another Lock (another controller, or a Job's), judging by its own reads.
	lb := newLock(w.ns)
	judge := lb.Judge
	lb.Judge = judgeFunc(func(ctx context.Context, h lock.Holder) (lock.Verdict, error) {
		v, err := judge.Stale(ctx, h)
		if _, released, rerr := la.Release(ctx, a); rerr != nil || !released {
			t.Fatalf("a releases between b's read and b's write: released %v, %v", released, rerr)
		}
		return v, err
	})
	res, err := lb.Acquire(ctx, lock.Request{Holder: b})
	if err != nil || !res.Acquired {
		t.Fatalf("b's Acquire, its write beaten by a's release: %+v %v, want the lock taken", res, err)
	}
	if res.TookOver != "" {
		t.Errorf("b took the lock over from %q, when a had released it", res.TookOver)
	}
	if st, _ := la.Get(ctx); st.Holder != b {
		t.Errorf("Lease holder %s, want b", st.Holder)
	}
}

// gatedWriter counts the Lease writes, and holds the first one after gate
// is set until gate closes.
type gatedWriter struct {
	client.Client
	mu      sync.Mutex
	writes  int
	gate    chan struct{}
	entered chan struct{}
}

func (w *gatedWriter) Update(ctx context.Context, obj client.Object, opts ...client.UpdateOption) error {
	w.mu.Lock()
	w.writes++
	gate, entered := w.gate, w.entered
	w.gate = nil
	w.mu.Unlock()
	if gate != nil {
		close(entered)
		<-gate
	}
	return w.Client.Update(ctx, obj, opts...)
}

// TestConfirmsShareWrites: five Confirms of one holder, four of them made
// while the first one's write is under way, cost two writes of the Lease
// and no read, and each says the lock is held; after a takeover, Confirms
// made together each refuse.
func TestConfirmsShareWrites(t *testing.T) {
	ctx := context.Background()
	w := newWorld(t)
	writer := &gatedWriter{Client: env.Client}
	live := &countingReader{Reader: env.Client}
	l := newLock(w.ns)
	l.Client, l.Live = writer, live
	aOp := w.op("a", running)
	a := holds(aOp)
	mustAcquire(t, l, a)
	writesBefore, readsBefore := writer.writes, live.reads

	writer.mu.Lock()
	writer.gate, writer.entered = make(chan struct{}), make(chan struct{})
	gate, entered := writer.gate, writer.entered
	writer.mu.Unlock()
	errs := make(chan error, 5)
	confirm := func() { errs <- l.Confirm(ctx, a) }
	go confirm()
	<-entered // the first Confirm's write is under way
	for range 4 {
		go confirm()
	}
	deadline := time.Now().Add(10 * time.Second)
	for lock.ConfirmsWaiting(l, a) < 4 {
		if time.Now().After(deadline) {
			t.Fatalf("%d Confirms wait for the first, want 4", lock.ConfirmsWaiting(l, a))
		}
		time.Sleep(time.Millisecond)
	}
	close(gate)
	for range 5 {
		if err := <-errs; err != nil {
			t.Errorf("a Confirm of the holder: %v", err)
		}
	}
	if n, r := writer.writes-writesBefore, live.reads-readsBefore; n != 2 || r != 0 {
		t.Errorf("five Confirms wrote the Lease %d time(s) and read it %d time(s), want 2 and 0", n, r)
	}

	w.setStatus(aOp, ichorv1.TalosOperationStatus{Phase: ichorv1.PhaseSucceeded})
	b := holds(w.op("b", running))
	mustAcquire(t, newLock(w.ns), b)
	for range 3 {
		go confirm()
	}
	for range 3 {
		var notHeld *lock.NotHeldError
		if err := <-errs; !errors.As(err, &notHeld) || notHeld.Holder != b.Identity {
			t.Errorf("a Confirm after b's takeover: %v, want b holds it", err)
		}
	}
}

func TestAdoptOldLease(t *testing.T) {
	ctx := context.Background()
	w := newWorld(t)
	l := newLock(w.ns)
	a, b := holds(w.op("a", running)), holds(w.op("b", running))
	now := metav1.NewMicroTime(metav1.Now().Time)
	old := &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Namespace: w.ns, Name: ichorv1.LockLeaseName},
		Spec: coordinationv1.LeaseSpec{HolderIdentity: ptr.To(a.Identity), AcquireTime: &now}}
	if err := env.Client.Create(ctx, old); err != nil {
		t.Fatal(err)
	}
	if res, err := l.Acquire(ctx, lock.Request{Holder: b}); err != nil || res.Acquired {
		t.Fatalf("b took a's lock: %+v %v", res, err)
	}
	if res := mustAcquire(t, l, a); !res.AlreadyHeld {
		t.Errorf("a adopts its own lock: %+v", res)
	}
	lease := &coordinationv1.Lease{}
	if err := env.Client.Get(ctx, client.ObjectKeyFromObject(old), lease); err != nil || lease.Annotations[ichorv1.LockHolderUIDAnnotation] != string(a.UID) {
		t.Errorf("the adopted Lease records UID %q (%v), want %s", lease.Annotations[ichorv1.LockHolderUIDAnnotation], err, a.UID)
	}
}

func TestTakeoverRules(t *testing.T) {
	ctx := context.Background()
	w := newWorld(t)
	resetSpec := func(node string) ichorv1.TalosOperationSpec {
		return ichorv1.TalosOperationSpec{Kind: ichorv1.KindNode, Node: &ichorv1.NodeAction{Machine: node, Action: ichorv1.NodeReset}}
	}
	opPaused := func(name string, st ichorv1.TalosOperationStatus) *ichorv1.TalosOperation {
		return w.op(name, st, ichorv1.TalosOperationSpec{Kind: ichorv1.KindCNI, Paused: true})
	}
	// An operation deleted and created again under its name is another one.
	recreated := w.op("recreated", running)
	gone := holds(recreated)
	if err := env.Client.Delete(ctx, recreated); err != nil {
		t.Fatal(err)
	}
	w.op("recreated", running)
	cpResetting := w.node("cp-resetting", true)
	deleted := holds(&ichorv1.TalosOperation{ObjectMeta: metav1.ObjectMeta{Namespace: w.ns, Name: "gone", UID: "gone"}})

	tests := []struct {
		name   string
		holder lock.Holder
		want   lock.Verdict
	}{
		{"operation deleted", deleted, lock.Verdict{Stale: true, Over: true, Why: "deleted"}},
		{"operation deleted and created again", gone, lock.Verdict{Stale: true, Over: true, Why: "deleted"}},
		{"operation completed", holds(w.op("done", ichorv1.TalosOperationStatus{Phase: ichorv1.PhaseSucceeded})), lock.Verdict{Stale: true, Over: true, Why: "completed"}},
		{"operation refused", holds(w.op("refused", ichorv1.TalosOperationStatus{Phase: ichorv1.PhaseRefused})), lock.Verdict{Stale: true, Over: true, Why: "refused"}},
		{"operation paused on a failed step", holds(w.op("failed", failed)), lock.Verdict{Stale: true, Why: "paused on a failed step"}},
		{"operation cancelled", holds(w.op("cancelled", ichorv1.TalosOperationStatus{Phase: ichorv1.PhaseCancelled})), lock.Verdict{Stale: true, Over: true, Why: "cancelled"}},
		{"operation cancelled with a step still in flight keeps it", holds(w.op("cancelling", ichorv1.TalosOperationStatus{Phase: ichorv1.PhaseCancelled,
			Machines: []ichorv1.MachineStatus{{Name: "w1", Role: ichorv1.RoleWorker, Phase: ichorv1.MachineInProgress, Step: "reboot"}}})), lock.Verdict{}},
		{"operation failed with a step still in flight keeps it", holds(w.op("failing", inFlight)), lock.Verdict{}},
		{"operation paused by an operator keeps it", holds(opPaused("op-paused", ichorv1.TalosOperationStatus{Phase: ichorv1.PhasePaused, Reason: ichorv1.ReasonPausedByOperator})), lock.Verdict{}},
		{"failed and operator-paused keeps it", holds(opPaused("both", failed)), lock.Verdict{}},
		{"operation running keeps it", holds(w.op("running", running)), lock.Verdict{}},
		{"a reset holding it as the machine, running, keeps it", lock.ForOperation(w.op("reset", running, resetSpec(cpResetting.Name)), ichorv1.MachineIdentity(cpResetting.Name)), lock.Verdict{}},
		{"machine whose Node is gone", lock.ForNode(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: w.ns + "-nope", UID: "nope"}}), lock.Verdict{Stale: true, Over: true, Why: "node gone"}},
		{"machine still joining", lock.ForNode(w.node("cp-joining", false)), lock.Verdict{}},
		{"machine joined", lock.ForNode(w.node("cp-joined", true)), lock.Verdict{Stale: true, Over: true, Why: "join or removal done"}},
		{"machine whose Node was created again", lock.ForNode(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: w.node("cp-again", false).Name, UID: "old"}}), lock.Verdict{Stale: true, Over: true, Why: "node gone"}},
		{"job deleted", lock.ForJob(&batchv1.Job{ObjectMeta: metav1.ObjectMeta{Namespace: w.ns, Name: "gone", UID: "gone"}}), lock.Verdict{Stale: true, Over: true, Why: "deleted"}},
		{"job complete", lock.ForJob(w.job("complete", batchv1.JobComplete)), lock.Verdict{Stale: true, Over: true, Why: "finished"}},
		{"job failed", lock.ForJob(w.job("failed", batchv1.JobFailed)), lock.Verdict{Stale: true, Over: true, Why: "finished"}},
		{"job running", lock.ForJob(w.job("running", "")), lock.Verdict{}},
		{"identity Ichor does not know", lock.Holder{Identity: "someone/else", UID: "x"}, lock.Verdict{}},
	}
	judge := lock.ClusterJudge{Client: env.Client}
	taker := holds(w.op("taker", running))
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			v, err := judge.Stale(ctx, tt.holder)
			if err != nil || v != tt.want {
				t.Fatalf("Stale(%s) = %+v %v, want %+v", tt.holder, v, err, tt.want)
			}
			// And through the Lease: a taker takes over exactly the stale holders.
			l := newLock(env.Namespace(t))
			mustAcquire(t, l, tt.holder)
			res, err := l.Acquire(ctx, lock.Request{Holder: taker})
			if err != nil {
				t.Fatal(err)
			}
			if res.Acquired != tt.want.Stale {
				t.Fatalf("taker acquired=%v, want %v (holder %s)", res.Acquired, tt.want.Stale, res.Holder)
			}
			if tt.want.Stale {
				st, _ := l.Get(ctx)
				if want := tt.holder.Identity + " (" + tt.want.Why + ")"; st.TakenOverFrom != want || res.TookOver != want {
					t.Errorf("takeover note %q / %q, want %q", st.TakenOverFrom, res.TookOver, want)
				}
			}
		})
	}
}

// TestLendToJob: an operation lends the lock to its Job in one write and
// takes it back once the Job is done: in between nobody else can take it,
// not even when the Job has finished, as long as the operation goes on.
func TestLendToJob(t *testing.T) {
	ctx := context.Background()
	w := newWorld(t)
	l := newLock(w.ns)
	lenderOp := w.op("lender", running)
	lender, other := holds(lenderOp), holds(w.op("other", running))
	job := w.job("cilium", "")
	borrower := lock.ForJob(job)

	if err := l.Lend(ctx, lender, borrower); err == nil {
		t.Fatal("lent a lock the lender does not hold")
	}
	mustAcquire(t, l, lender)
	for range 2 { // lending again changes nothing
		if err := l.Lend(ctx, lender, borrower); err != nil {
			t.Fatal(err)
		}
	}
	st, _ := l.Get(ctx)
	if st.Holder != borrower || st.LentBy != lender || !st.Holds(lender) || !st.Holds(borrower) || st.Holds(other) {
		t.Fatalf("after lending: %+v", st)
	}
	// The Job's init container finds it holds the lock; the lender still
	// does, and may confirm it.
	for _, h := range []lock.Holder{borrower, lender} {
		if res := mustAcquire(t, l, h); !res.AlreadyHeld {
			t.Fatalf("%s acquire while lent: %+v", h, res)
		}
		if err := l.Confirm(ctx, h); err != nil {
			t.Fatalf("%s confirm while lent: %v", h, err)
		}
	}
	if st2, _ := l.Get(ctx); st2.Holder != borrower {
		t.Fatalf("the lender's acquire took the lock back from the running Job: %+v", st2)
	}
	// The Job finishes: it is stale, but the lender is not, so the lock stays.
	now := metav1.Now()
	job.Status.StartTime, job.Status.CompletionTime, job.Status.Succeeded = &now, &now, 1
	job.Status.Conditions = []batchv1.JobCondition{
		{Type: batchv1.JobSuccessCriteriaMet, Status: corev1.ConditionTrue, LastTransitionTime: now},
		{Type: batchv1.JobComplete, Status: corev1.ConditionTrue, LastTransitionTime: now}}
	if err := env.Client.Status().Update(ctx, job); err != nil {
		t.Fatal(err)
	}
	if res, err := l.Acquire(ctx, lock.Request{Holder: other}); err != nil || res.Acquired {
		t.Fatalf("another holder took a lent lock whose lender goes on: %+v %v", res, err)
	}
	if ok, err := l.Reclaim(ctx, other); err != nil || ok {
		t.Fatalf("a holder that did not lend it reclaimed it: %v %v", ok, err)
	}
	if ok, err := l.Reclaim(ctx, lender); err != nil || !ok {
		t.Fatalf("reclaim: %v %v", ok, err)
	}
	if st, _ := l.Get(ctx); st.Holder != lender || st.Lent() {
		t.Fatalf("after reclaiming: %+v", st)
	}
	// A borrower's release gives it back, never frees it.
	if err := l.Lend(ctx, lender, borrower); err != nil {
		t.Fatal(err)
	}
	if _, released, err := l.Release(ctx, borrower); err != nil || !released {
		t.Fatalf("release by the borrower: %v %v", released, err)
	}
	if st, _ := l.Get(ctx); st.Holder != lender || st.Lent() {
		t.Fatalf("after the borrower's release: %+v", st)
	}
	// Once the lender is gone too, the finished Job's lock is taken over.
	if err := l.Lend(ctx, lender, borrower); err != nil {
		t.Fatal(err)
	}
	if err := env.Client.Delete(ctx, lenderOp); err != nil {
		t.Fatal(err)
	}
	res := mustAcquire(t, l, other)
	if want := borrower.Identity + " (finished; lent by " + lender.Identity + ", deleted)"; res.TookOver != want {
		t.Fatalf("took over %q, want %q", res.TookOver, want)
	}
	if st, _ := l.Get(ctx); st.Lent() {
		t.Fatalf("the taker's lock still says it was lent: %+v", st)
	}
}

// TestAwaitTheEndingRelease: b's Acquire finds the lock held by a, whose
// end this process is writing (Ending), and waits for a's release instead
// of judging a: once a releases, b takes the lock free from the Lease the
// release wrote, without reading it again and without a takeover. When a's
// end is given up without a release (its status write failed, so a runs
// on), b waits behind a, as the judge says; when a's release takes longer
// than the wait, b judges a completed and takes the lock over, as before.
func TestAwaitTheEndingRelease(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name string
		// status is a's, as b's Acquire finds it.
		status ichorv1.TalosOperationStatus
		// end is what a's turn does once b waits for it (nil: nothing,
		// within the wait); done lets b go on.
		end func(t *testing.T, l *lock.Lock, a lock.Holder, done func())
		// taken says whether b takes the lock (from a, when tookOver).
		taken, tookOver bool
		// judged is how many times b's Acquire asks the judge; reads counts
		// the live reads of the Lease, a's release's included.
		judged, reads int
		// idle: a ends idle (Ending's idle moment), and b's WhileEnding is
		// called with it.
		idle bool
		// endsWhileJudged: a's end begins (Ending) while b's Acquire judges
		// a, after it found no end under way; a's status, as the judge
		// reads it, already shows the end written.
		endsWhileJudged bool
	}{
		{name: "a releases", status: running, end: releases, taken: true, reads: 2},
		{name: "a releases, idle", status: running, end: releases, taken: true, reads: 2, idle: true},
		{name: "a's end is given up", status: running, end: func(_ *testing.T, _ *lock.Lock, _ lock.Holder, done func()) { done() },
			judged: 1, reads: 2},
		{name: "a's release takes too long", status: ichorv1.TalosOperationStatus{Phase: ichorv1.PhaseSucceeded},
			taken: true, tookOver: true, judged: 1, reads: 1},
		{name: "a's end begins while b judges it", status: ichorv1.TalosOperationStatus{Phase: ichorv1.PhaseSucceeded},
			endsWhileJudged: true, end: releases, taken: true, judged: 1, reads: 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			wait := time.Minute
			if tc.end == nil {
				wait = 100 * time.Millisecond
			}
			defer lock.SetEndingWait(wait)()
			w := newWorld(t)
			l := newLock(w.ns)
			a, b := holds(w.op("a", tc.status)), holds(w.op("b", running))
			mustAcquire(t, l, a)
			var idle time.Time
			if tc.idle {
				idle = time.Now()
			}
			// done is read once b waits for a's release, which comes after
			// the judge that sets it when a's end begins there.
			done := func() {}
			judge, judged := l.Judge, 0
			l.Judge = judgeFunc(func(ctx context.Context, h lock.Holder) (lock.Verdict, error) {
				judged++
				if tc.endsWhileJudged && judged == 1 {
					done = l.Ending(a, idle)
				}
				return judge.Stale(ctx, h)
			})
			live := &countingReader{Reader: env.Client}
			l.Live = live
			if !tc.endsWhileJudged {
				done = l.Ending(a, idle)
			}
			defer func() { done() }()
			got := make(chan lock.Result, 1)
			var whileEnding []time.Time
			go func() {
				res, err := l.Acquire(ctx, lock.Request{Holder: b, WhileEnding: func(at time.Time) { whileEnding = append(whileEnding, at) }})
				if err != nil {
					t.Errorf("b's Acquire: %v", err)
				}
				got <- res
			}()
			if tc.end != nil {
				testenv.Eventually(t, 30*time.Second, "b waiting for a's release", func(context.Context) (bool, error) {
					return lock.EndWaiting(l, a) == 1, nil
				})
				tc.end(t, l, a, done)
			}
			var res lock.Result
			select {
			case res = <-got:
			case <-time.After(30 * time.Second):
				t.Fatal("b's Acquire did not return")
			}
			want := a
			if tc.taken {
				want = b
			}
			if res.Acquired != tc.taken || res.Holder != want.Identity || (res.TookOver != "") != tc.tookOver {
				t.Errorf("b's Acquire: %+v, want acquired %v by %s, a takeover %v", res, tc.taken, want.Identity, tc.tookOver)
			}
			if judged != tc.judged || live.reads != tc.reads {
				t.Errorf("b's Acquire asked the judge %d time(s), and the Lease was read %d time(s), want %d and %d", judged, live.reads, tc.judged, tc.reads)
			}
			if st, _ := l.Current(ctx); st.Holder != want {
				t.Errorf("the Lease's holder: %s, want %s", st.Holder, want)
			}
			if tc.idle && (len(whileEnding) != 1 || !whileEnding[0].Equal(idle) || !res.FreeAt.Equal(idle)) {
				t.Errorf("b's WhileEnding was called with %v and its take is free from %s: want once with a's idle moment %s, free from then",
					whileEnding, res.FreeAt.Format(time.StampMicro), idle.Format(time.StampMicro))
			}
			if !tc.idle && len(whileEnding) > 0 {
				t.Errorf("b's WhileEnding was called (%v) for a holder not ending idle", whileEnding)
			}
		})
	}
}

// releases is a's release, then its done, in TestAwaitTheEndingRelease.
func releases(t *testing.T, l *lock.Lock, a lock.Holder, done func()) {
	if _, released, err := l.Release(context.Background(), a); err != nil || !released {
		t.Errorf("a releases: %v %v", released, err)
	}
	done()
}
