package executor

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr/testr"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/journal"
	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

// TestHandOverAwaitsTheHolder: a hand-over that finds its operation's
// journal held by another controller's pod waits, calling nothing, and
// ends with that takeover's end: done once the journal is cleared (the
// owner wrote the restore back), the owner's failure once it journals
// one. TestEtcdRestoreSteps runs the third end, the owner's pod gone. A
// journal whose owner's pod is gone is not continued without the
// snapshot, which the recovery needs once the API is gone.
func TestHandOverAwaitsTheHolder(t *testing.T) {
	cases := []struct {
		name string
		// ownerGone leaves the owner's pod out; the snapshot is missing then.
		ownerGone bool
		end       func(ctx context.Context, j journal.Journal, st journal.State) error
		want      func(out Outcome, err error) string // what is wrong, or ""
	}{
		{"the owner's restore written back", false, func(ctx context.Context, j journal.Journal, _ journal.State) error { return j.Clear(ctx) },
			func(out Outcome, err error) string {
				if err != nil || !out.Done || !strings.Contains(out.Message, "restored by the takeover of pod ichor-system/ichor-a") {
					return "want the step done by ichor-a's takeover"
				}
				return ""
			}},
		{"the owner's tail failed", false, func(ctx context.Context, j journal.Journal, st journal.State) error {
			st.Seq++
			st.Machine.Phase, st.Machine.Message = ichorv1.MachineFailed, "the control planes did not come back"
			return j.WriteState(ctx, st)
		}, func(_ Outcome, err error) string {
			var se *StepError
			if !errors.As(err, &se) || se.Reason != "RestoreFailed" || !strings.Contains(se.Error(), "ichor-a failed at reset-control-planes: the control planes did not come back") {
				return "want ichor-a's failure, RestoreFailed"
			}
			return ""
		}},
		{"the owner's pod gone, the snapshot not here", true, nil, func(_ Outcome, err error) string {
			var se *StepError
			if !errors.As(err, &se) || se.Reason != "HandOverFailed" || !strings.Contains(se.Error(), "the snapshot, which the recovery uploads once the API is gone") {
				return "want HandOverFailed for the snapshot"
			}
			return ""
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			f, tc := fleet(t, sim.Cluster("", 3, 0))
			cps := f.ControlPlanes()
			e := env(f, tc, cps[0], ichorv1.TalosOperationSpec{Kind: ichorv1.KindEtcdRestore,
				EtcdRestore: &ichorv1.EtcdRestore{Machine: cps[0].Name(), Snapshot: "file://" + t.TempDir() + "/etcd.snapshot"}})
			e.Op.Namespace, e.Op.Name, e.Op.UID = "default", "restore", types.UID("restore")
			e.Machine.Step, e.Machine.Calls = StepResetAll, 2
			e.Controller.Namespace = "ichor-system"
			objs := []client.Object{&corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: "ichor-system", Name: ichorv1.TalosconfigSecret}}}
			if !c.ownerGone {
				objs = append(objs, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ichor-system", Name: "ichor-a"}})
			}
			e.Kube = fake.NewClientBuilder().WithObjects(objs...).Build()
			j := journal.Journal{Talos: tc, ControlPlanes: e.ControlPlanes}
			st := journal.State{Seq: 5, UID: e.Op.UID, Owner: "ichor-system/ichor-a", Machine: ichorv1.MachineStatus{
				Name: cps[0].Name(), Role: ichorv1.RoleControlPlane, Phase: ichorv1.MachineInProgress, Step: StepResetAll, Calls: 1}}
			if err := errors.Join(j.WriteOperation(ctx, e.Op), j.WriteState(ctx, st)); err != nil {
				t.Fatal(err)
			}
			progress := make(chan string, 16)
			e.Progress = func(msg string) {
				select {
				case progress <- msg:
				default:
				}
			}
			b := &Takeover{Dir: t.TempDir(), Pod: "ichor-system/ichor-b", Kube: e.Kube, Log: testr.New(t)}
			type ended struct {
				out Outcome
				err error
			}
			handed := make(chan ended, 1)
			go func() {
				out, err := b.HandOver(ctx, e)
				handed <- ended{out, err}
			}()
			if c.end != nil {
				if msg := testenv.Receive(t, ctx, progress, "progress from the step"); !strings.Contains(msg, "takeover of pod ichor-system/ichor-a carries this etcd restore out") {
					t.Fatalf("the step reports %q, want that it waits for ichor-a's takeover", msg)
				}
				if err := c.end(ctx, j, st); err != nil {
					t.Fatal(err)
				}
			}
			res := testenv.Receive(t, ctx, handed, "end of the hand-over with ichor-a's takeover")
			if what := c.want(res.out, res.err); what != "" {
				t.Errorf("HandOver = %+v, %v: %s", res.out, res.err, what)
			}
			for _, cp := range cps {
				if n := f.Recorder().Calls(cp.Name(), "Reset"); n != 0 {
					t.Errorf("%s got %d Reset calls while the journal was held", cp.Name(), n)
				}
			}
			if got, _, err := j.ReadState(ctx); err == nil && got != nil && got.Owner != st.Owner {
				t.Errorf("the journal names %q as its owner, want %q", got.Owner, st.Owner)
			}
		})
	}
}
