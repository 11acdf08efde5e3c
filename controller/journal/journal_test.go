package journal_test

import (
	"context"
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/siderolabs/talos/pkg/machinery/api/machine"
	talosclient "github.com/siderolabs/talos/pkg/machinery/client"
	"github.com/siderolabs/talos/pkg/machinery/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/journal"
	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

var env *testenv.Env

func TestMain(m *testing.M) { os.Exit(testenv.Main(m, &env)) }

func fleet(t *testing.T, cps int) (*sim.Fleet, journal.Journal) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	spec := sim.Cluster("", cps, 0)
	spec.Logf = t.Logf
	f, err := sim.Start(ctx, spec, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.Stop)
	c, err := talosclient.New(ctx, talosclient.WithConfig(f.Talosconfig()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	var addrs []string
	for _, cp := range f.ControlPlanes() {
		addrs = append(addrs, cp.Address())
	}
	return f, journal.Journal{Talos: c, ControlPlanes: addrs}
}

func restoreOp() *ichorv1.TalosOperation {
	return &ichorv1.TalosOperation{
		ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "restore", UID: types.UID("uid-1"), CreationTimestamp: metav1.Now()},
		Spec:       ichorv1.TalosOperationSpec{Kind: ichorv1.KindEtcdRestore, MaxUnavailable: 1, EtcdRestore: &ichorv1.EtcdRestore{Snapshot: "file:///s.db"}},
	}
}

// TestJournal: the journal written to every control plane is read back as
// the newest entry, also when the control plane that holds the newest is
// the only one answering, and survives a reset of EPHEMERAL; foreign data
// in the key is refused and left alone; Clear removes only ours.
func TestJournal(t *testing.T) {
	f, j := fleet(t, 3)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cps := f.ControlPlanes()

	if s, o, err := j.ReadState(ctx); s != nil || o != nil || err != nil {
		t.Fatalf("an empty journal reads %v, %v, %v", s, o, err)
	}
	op := restoreOp()
	if err := j.WriteOperation(ctx, op); err != nil {
		t.Fatal(err)
	}
	for seq, step := range []string{"check-snapshot", "etcd-leave-others", "reset-control-planes"} {
		st := journal.State{Seq: int64(seq + 1), UID: op.UID, Machine: ichorv1.MachineStatus{Name: cps[0].Name(), Step: step, To: "revision 7"}}
		if err := j.WriteState(ctx, st); err != nil {
			t.Fatal(err)
		}
	}
	// One control plane down: the others still take the entry.
	if err := j.Talos.Shutdown(talosclient.WithNode(ctx, cps[0].Address()), talosclient.WithShutdownForce(true)); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 30*time.Second, cps[0].Name()+" down", func(context.Context) (bool, error) { return cps[0].Down(), nil })
	if err := j.WriteState(ctx, journal.State{Seq: 4, UID: op.UID, Machine: ichorv1.MachineStatus{Name: cps[1].Name(), Step: "recover-etcd"}}); err != nil {
		t.Fatalf("with %s down: %v", cps[0].Name(), err)
	}
	s, o, err := j.ReadState(ctx)
	if err != nil || s == nil || s.Seq != 4 || s.Machine.Step != "recover-etcd" || o == nil || o.Name != "restore" || o.Spec.EtcdRestore.Snapshot != "file:///s.db" {
		t.Fatalf("read back %+v, %+v, %v", s, o, err)
	}
	// The one that missed it holds an older entry: the newest wins.
	if err := cps[0].PowerOn(); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 30*time.Second, cps[0].Name()+" back", func(context.Context) (bool, error) { return !cps[0].Down(), nil })
	if s, _, err := j.ReadState(ctx); err != nil || s.Seq != 4 {
		t.Fatalf("with a stale control plane: %+v, %v", s, err)
	}

	// A reset that wipes EPHEMERAL keeps it.
	before := cps[1].BootID()
	if err := j.Talos.ResetGeneric(talosclient.WithNode(ctx, cps[1].Address()), &machine.ResetRequest{Reboot: true,
		SystemPartitionsToWipe: []*machine.ResetPartitionSpec{{Label: "EPHEMERAL", Wipe: true}}}); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 30*time.Second, cps[1].Name()+" reset", func(context.Context) (bool, error) {
		return !cps[1].Down() && cps[1].BootID() != before, nil
	})
	only := journal.Journal{Talos: j.Talos, ControlPlanes: j.ControlPlanes[1:2]}
	if s, o, err := only.ReadState(ctx); err != nil || s == nil || s.Seq != 4 || o == nil {
		t.Fatalf("after the reset %s holds %+v, %+v, %v", cps[1].Name(), s, o, err)
	}

	// Foreign data: refused, untouched, and Clear leaves it.
	if err := j.Talos.MetaWrite(talosclient.WithNode(ctx, cps[1].Address()), meta.UserReserved2, []byte("omni labels")); err != nil {
		t.Fatal(err)
	}
	var fe *journal.ForeignError
	if err := j.WriteState(ctx, journal.State{Seq: 5, UID: op.UID}); !errors.As(err, &fe) || !strings.Contains(err.Error(), "not Ichor's journal") {
		t.Fatalf("over foreign data: %v", err)
	}
	if err := j.Clear(ctx); err != nil {
		t.Fatal(err)
	}
	if s, o, err := j.ReadState(ctx); s != nil || o != nil || err != nil {
		t.Fatalf("after Clear: %+v, %+v, %v", s, o, err)
	}
	if err := j.Talos.MetaDelete(talosclient.WithNode(ctx, cps[1].Address()), meta.UserReserved2); err != nil {
		t.Fatalf("Clear removed the foreign value: %v", err)
	}
}

// TestWriteBack: an operation the restored store lacks is made anew,
// Succeeded with the journal's machine, and not paused; one it still has
// gets its final status; another operation of the same name is refused.
func TestWriteBack(t *testing.T) {
	ctx := context.Background()
	ns := env.Namespace(t)
	op := restoreOp()
	op.Namespace = ns
	o := &journal.Operation{Namespace: ns, Name: op.Name, UID: op.UID, Created: time.Now().Add(-time.Minute), Spec: op.Spec}
	m := ichorv1.MachineStatus{Name: "cp-1", Role: ichorv1.RoleControlPlane, Phase: ichorv1.MachineInProgress, Step: "etcd-restored", From: "revision 90", To: "revision 7", Calls: 1}
	got, err := journal.WriteBack(ctx, env.Client, o, m, "etcd restored to revision 7", time.Now())
	if err != nil {
		t.Fatal(err)
	}
	check := func(what string) *ichorv1.TalosOperation {
		t.Helper()
		var cur ichorv1.TalosOperation
		if err := env.Client.Get(ctx, client.ObjectKey{Namespace: ns, Name: op.Name}, &cur); err != nil {
			t.Fatal(err)
		}
		ms := cur.Status.Machines
		if cur.Status.Phase != ichorv1.PhaseSucceeded || cur.Spec.Paused || len(ms) != 1 || ms[0].To != "revision 7" || ms[0].Phase != ichorv1.MachineSucceeded ||
			!strings.Contains(cur.Status.Message, "revision 7") {
			t.Fatalf("%s: %+v", what, cur)
		}
		return &cur
	}
	cur := check("re-created")
	if cur.Annotations[journal.RestoredFromAnnotation] != "uid-1" || cur.UID != got.UID {
		t.Fatalf("annotations %v", cur.Annotations)
	}
	// Written back again (a controller killed after the first): the same object.
	if _, err := journal.WriteBack(ctx, env.Client, o, m, "etcd restored to revision 7", time.Now()); err != nil {
		t.Fatal(err)
	}
	if again := check("written back twice"); again.UID != cur.UID {
		t.Fatal("a second write-back made another object")
	}
	// A write-back that ended after the re-creation, before its status and
	// unpause: the next one finishes it.
	patch := client.MergeFrom(cur.DeepCopy())
	cur.Spec.Paused = true
	if err := env.Client.Patch(ctx, cur, patch); err != nil {
		t.Fatal(err)
	}
	if _, err := journal.WriteBack(ctx, env.Client, o, m, "etcd restored to revision 7", time.Now()); err != nil {
		t.Fatal(err)
	}
	check("written back after one left it paused")
	other := *o
	other.UID = "uid-2"
	if _, err := journal.WriteBack(ctx, env.Client, &other, m, "x", time.Now()); err == nil || !strings.Contains(err.Error(), "another one") {
		t.Fatalf("over another operation: %v", err)
	}
}
