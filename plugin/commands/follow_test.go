package commands

import (
	"context"
	"errors"
	"io"
	"net/url"
	"strings"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/cli-runtime/pkg/genericiooptions"
	utilexec "k8s.io/utils/exec"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
)

func restoreOp(uid types.UID, phase ichorv1.Phase, restoredFrom string) *ichorv1.TalosOperation {
	op := &ichorv1.TalosOperation{ObjectMeta: metav1.ObjectMeta{Name: "r", UID: uid},
		Spec: ichorv1.TalosOperationSpec{Kind: ichorv1.KindEtcdRestore}}
	if restoredFrom != "" {
		op.Annotations = map[string]string{ichorv1.RestoredFromAnnotation: restoredFrom}
	}
	op.Status.Phase = phase
	return op
}

func TestRestoring(t *testing.T) {
	upgrade := restoreOp("u", ichorv1.PhaseRunning, "")
	upgrade.Spec.Kind = ichorv1.KindTalos
	for _, c := range []struct {
		name string
		op   *ichorv1.TalosOperation
		want bool
	}{
		{"a restore running", restoreOp("u", ichorv1.PhaseRunning, ""), true},
		{"a restore not yet picked up", restoreOp("u", "", ""), true},
		{"a restore succeeded", restoreOp("u", ichorv1.PhaseSucceeded, ""), false},
		{"another kind running: a deletion ends its follow", upgrade, false},
	} {
		if got := restoring(c.op); got != c.want {
			t.Errorf("%s: restoring %v, want %v", c.name, got, c.want)
		}
	}
}

func TestIdentify(t *testing.T) {
	last := restoreOp("old", ichorv1.PhaseRunning, "")
	back := restoreOp("new", "", "old")
	for _, c := range []struct {
		name       string
		first      types.UID
		last, next *ichorv1.TalosOperation
		want       sameName
	}{
		{"the same object", "old", last, restoreOp("old", ichorv1.PhaseRunning, ""), sameOperation},
		{"written back from the journal", "old", last, back, writtenBack},
		{"the written-back one again", "old", back, restoreOp("new", ichorv1.PhaseSucceeded, "old"), sameOperation},
		{"created anew by someone", "old", last, restoreOp("new", "", ""), anotherOperation},
		{"written back for another operation", "old", last, restoreOp("new", "", "older"), anotherOperation},
		{"no first UID to match", "", restoreOp("", "", ""), restoreOp("new", "", ""), anotherOperation},
	} {
		if got := identify(c.first, c.last, c.next); got != c.want {
			t.Errorf("%s: %v, want %v", c.name, got, c.want)
		}
	}
}

func TestRewindProbed(t *testing.T) {
	gr := schema.GroupResource{Group: ichorv1.GroupVersion.Group, Resource: "talosoperations"}
	noAnswer := errors.New("dial tcp 127.0.0.1:6443: connect: connection refused")
	notFound := apierrors.NewNotFound(gr, "r")
	unavailable := apierrors.NewServiceUnavailable("etcd is not ready")
	forbidden := apierrors.NewForbidden(gr, "r", errors.New("no"))
	for _, c := range []struct {
		name         string
		lost, said   bool
		err          error
		say, rewatch bool
		lostAfter    bool
	}{
		{"the API answers", false, false, nil, false, false, false},
		{"no answer: say it", false, false, noAnswer, true, false, true},
		{"no answer, said already", true, true, noAnswer, false, false, true},
		{"etcd down behind the API server", false, false, unavailable, true, false, true},
		{"back after no answer: watch anew", true, true, nil, false, true, false},
		{"back on the rewound store, not written back yet", true, true, notFound, false, true, false},
		{"rewound without the API seen away: say it", false, false, notFound, true, false, false},
		{"deleted, then found again: watch anew", true, true, nil, false, true, false},
		{"a refusal is the API answering, not the restore", false, false, forbidden, false, false, false},
	} {
		r := &rewind{lost: c.lost, away: c.said}
		say, rewatch := r.probed(context.Background(), c.err)
		if say != c.say || rewatch != c.rewatch || r.lost != c.lostAfter {
			t.Errorf("%s: say %v rewatch %v lost %v, want %v %v %v", c.name, say, rewatch, r.lost, c.say, c.rewatch, c.lostAfter)
		}
	}
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	if say, rewatch := (&rewind{lost: true}).probed(cancelled, noAnswer); say || rewatch {
		t.Errorf("after an interrupt: say %v rewatch %v, want neither", say, rewatch)
	}
}

// TestFollowSeesTheWriteBackTheWatchMisses: a watch that resumed on the
// rewound store may never deliver the operation ichor-controller writes
// back (its resourceVersions start below the last one the watch saw). The
// follow of a restore reads the operation itself while it waits, and ends
// Succeeded on the write-back all the same.
func TestFollowSeesTheWriteBackTheWatchMisses(t *testing.T) {
	old := restoreOp("old", ichorv1.PhaseRunning, "")
	old.Namespace = testNS
	back := restoreOp("new", ichorv1.PhaseSucceeded, "old")
	back.Namespace = testNS
	gets := 0
	c := fake.NewClientBuilder().WithScheme(Scheme).WithObjects(old).WithInterceptorFuncs(interceptor.Funcs{
		// The store rewinds and gets the write-back once the follow has
		// read the operation as it was.
		Get: func(ctx context.Context, c client.WithWatch, key client.ObjectKey, obj client.Object, opts ...client.GetOption) error {
			err := c.Get(ctx, key, obj, opts...)
			if gets++; gets == 1 {
				if err := c.Delete(ctx, old.DeepCopy()); err != nil {
					t.Error(err)
				}
				if err := c.Create(ctx, back.DeepCopy()); err != nil {
					t.Error(err)
				}
			}
			return err
		},
		// The informer's list is the store as it was, and its watch says nothing.
		List: func(ctx context.Context, c client.WithWatch, list client.ObjectList, opts ...client.ListOption) error {
			list.(*ichorv1.TalosOperationList).Items = []ichorv1.TalosOperation{*old.DeepCopy()}
			return nil
		},
		Watch: func(context.Context, client.WithWatch, client.ObjectList, ...client.ListOption) (watch.Interface, error) {
			return watch.NewFake(), nil
		},
	}).Build()
	streams, _, out, _ := genericiooptions.NewTestIOStreams()
	e := NewEnv("kubectl-ichor", streams)
	err := e.follow(context.Background(), c, testNS, old.Name, followFlags{watch: true, timeout: 15 * time.Second}, out, -1)
	if err != nil {
		t.Fatalf("follow: %v\n%s", err, out)
	}
	if !strings.Contains(out.String(), "is back: ichor-controller wrote it back from its journal") {
		t.Errorf("the follow did not say the operation was written back:\n%s", out)
	}
	if gets < 2 {
		t.Errorf("the follow read the operation %d times", gets)
	}
}

// TestFirstReadAsksAgain: the first read of a follow asks an API server
// that gives no answer (restarting) again, saying so once, until it
// answers or the timeout passes; an answer of the API's is final at once.
func TestFirstReadAsksAgain(t *testing.T) {
	reset := &url.Error{Op: "Get", URL: "https://127.0.0.1:6443", Err: io.EOF}
	fired := make(chan time.Time, 1)
	fired <- time.Now()
	cases := []struct {
		name      string
		objects   []client.Object
		noAnswers int // the reads that get no answer first (-1: every one)
		deadline  <-chan time.Time
		wantErr   string
		wantGets  int
		wantNote  bool
	}{
		{"the API back after two tries", []client.Object{&ichorv1.TalosOperation{ObjectMeta: metav1.ObjectMeta{Namespace: testNS, Name: "op"}}}, 2, nil, "", 3, true},
		{"not found is an answer", nil, 0, nil, `"op" not found`, 1, false},
		{"no answer until the timeout", nil, -1, fired, "timed out after 1s waiting for the API server to answer: Get \"https://127.0.0.1:6443\": EOF", 1, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			gets := 0
			cl := fake.NewClientBuilder().WithScheme(Scheme).WithObjects(c.objects...).WithInterceptorFuncs(interceptor.Funcs{
				Get: func(ctx context.Context, cl client.WithWatch, key client.ObjectKey, obj client.Object, opts ...client.GetOption) error {
					if gets++; c.noAnswers < 0 || gets <= c.noAnswers {
						return reset
					}
					return cl.Get(ctx, key, obj, opts...)
				},
			}).Build()
			streams, _, _, errOut := genericiooptions.NewTestIOStreams()
			e := NewEnv("kubectl-ichor", streams)
			op, err := e.firstRead(context.Background(), cl, testNS, "op", time.Second, c.deadline)
			switch {
			case c.wantErr == "" && (err != nil || op == nil || op.Name != "op"):
				t.Errorf("firstRead = %v, %v; want the operation", op, err)
			case c.wantErr != "" && (err == nil || !strings.Contains(err.Error(), c.wantErr)):
				t.Errorf("firstRead error %v, want %q", err, c.wantErr)
			}
			var exit utilexec.CodeExitError
			if c.deadline != nil && (!errors.As(err, &exit) || exit.Code != ExitTimeout) {
				t.Errorf("firstRead at the timeout: %#v, want exit code %d", err, ExitTimeout)
			}
			if gets != c.wantGets {
				t.Errorf("%d reads, want %d", gets, c.wantGets)
			}
			if n := strings.Count(errOut.String(), "the API server does not answer"); n != map[bool]int{true: 1}[c.wantNote] {
				t.Errorf("the note is said %d times:\n%s", n, errOut)
			}
		})
	}
}
