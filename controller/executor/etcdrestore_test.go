package executor_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr/testr"
	"github.com/johannesboyne/gofakes3"
	"github.com/johannesboyne/gofakes3/backend/s3mem"
	talosclient "github.com/siderolabs/talos/pkg/machinery/client"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/controller/journal"
	"maesh.dev/ichor/controller/snapshot/snapshottest"
	"maesh.dev/ichor/internal/testcluster"
	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

// TestEtcdRestoreSteps drives the etcd-restore executor's steps on their
// own against a hosted fleet of three control planes (a real etcd behind
// real API servers): the preflight refuses a snapshot that is missing,
// corrupted or newer than the store (but for override); a snapshot taken
// before three ConfigMaps were created is restored, the three are gone,
// every control plane is a healthy member; a rerun of the irreversible
// steps after an earlier run made their call makes none.
func TestEtcdRestoreSteps(t *testing.T) {
	if os.Getenv("KUBEBUILDER_ASSETS") == "" {
		t.Skip("needs KUBEBUILDER_ASSETS (a hosted fleet runs etcd and kube-apiserver)")
	}
	t.Setenv("TMPDIR", t.TempDir()) // where the controller keeps downloaded snapshots
	f, kenv := testcluster.StartHostedFleet(t, sim.Cluster("", 3, 0), testenv.Components{})
	tc, err := talosclient.New(context.Background(), talosclient.WithConfig(f.Talosconfig()))
	if err != nil {
		t.Fatal(err)
	}
	defer tc.Close()
	cps := f.ControlPlanes()
	kc := kenv.Kube
	testenv.CreateConfigMaps(t, kc, "before")
	snap := filepath.Join(t.TempDir(), "etcd.snapshot")
	testcluster.TakeSnapshot(t, tc, cps[0], snap)
	testenv.CreateConfigMaps(t, kc, "after0", "after1", "after2")

	var addrs []string
	for _, cp := range cps {
		addrs = append(addrs, cp.Address())
	}
	rec := cps[1] // not the first: the named machine recovers
	op := &ichorv1.TalosOperation{ObjectMeta: metav1.ObjectMeta{UID: types.UID("restore-test")}, Spec: ichorv1.TalosOperationSpec{
		Kind: ichorv1.KindEtcdRestore, EtcdRestore: &ichorv1.EtcdRestore{Snapshot: "file://" + snap, Machine: rec.Name()},
	}}
	env := func(op *ichorv1.TalosOperation) *executor.Env {
		return &executor.Env{Op: op, Controller: executor.Controller{Namespace: "ichor-system"}, Machine: ichorv1.MachineStatus{Name: rec.Name(), Role: ichorv1.RoleControlPlane},
			Address: rec.Address(), ControlPlanes: addrs, Talos: tc, Kube: kenv.Client, Live: kenv.Client, Clientset: kc, Log: testr.New(t)}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()

	// Preflight: what it finds, said.
	corrupt := filepath.Join(t.TempDir(), "corrupt.snapshot")
	b, _ := os.ReadFile(snap)
	b[len(b)/2] ^= 0xff
	_ = os.WriteFile(corrupt, b, 0o600)
	future := snapshottest.File(t, snapshottest.Put{Rev: 1 << 40, Key: "/registry/x"})
	for _, c := range []struct{ url, want string }{
		{"file://" + snap + ".missing", "snapshot not found: no file"},
		{"file://" + corrupt, "does not verify: SHA-256 mismatch"},
		{"file://" + future, "is at revision 1099511627776, newer than the running store's"},
	} {
		o := op.DeepCopy()
		o.Spec.EtcdRestore.Snapshot = c.url
		if got := (executor.EtcdRestore{}).Check(ctx, env(o)); len(got) != 1 || !strings.Contains(got[0], c.want) {
			t.Errorf("Check(%s) = %q, want %q", c.url, got, c.want)
		}
	}
	o := op.DeepCopy()
	o.Spec.EtcdRestore.Snapshot, o.Spec.Override = "file://"+future, true
	if got := (executor.EtcdRestore{}).Check(ctx, env(o)); len(got) != 0 {
		t.Errorf("with override: %q", got)
	}
	if got := (executor.EtcdRestore{}).Check(ctx, env(op)); len(got) != 0 {
		t.Fatalf("Check refuses the good snapshot: %q", got)
	}
	checkS3(t, ctx, kc, snap, env)

	// The flow, each step's outcome recorded as the driver records it. The
	// recovering machine's first Bootstrap takes effect and its answer is
	// lost: the step must not take the AlreadyExists of its next try for
	// data the reset left.
	rec.Inject(sim.Fault{Kind: sim.FaultLost, Method: "Bootstrap", Code: codes.DeadlineExceeded, Once: true})
	e := env(op)
	for _, s := range (executor.EtcdRestore{}).Steps(op, &e.Machine) {
		e.Machine.Step, e.Machine.Calls = s.Name, 0
		if s.Irreversible {
			e.Machine.Calls = 1
		}
		out := runStep(t, ctx, s, e)
		t.Logf("%s: %s", s.Name, out.Message)
	}
	if !strings.HasPrefix(e.Machine.To, "revision ") || e.Machine.From == e.Machine.To {
		t.Fatalf("revisions recorded: from %q to %q", e.Machine.From, e.Machine.To)
	}
	if got, err := testenv.ConfigMaps(kc); err != nil || got != "before" {
		t.Fatalf("after the restore the ConfigMaps are %q (%v), want only the one from before the snapshot", got, err)
	}
	st := f.Etcd()
	if len(st.Members) != 3 || st.Leader != rec.Name() {
		t.Fatalf("etcd after the restore: %+v", st)
	}
	// The Bootstrap whose answer was lost is sent again, not the upload.
	if late := testcluster.UploadsAfterBootstrap(f.Recorder(), rec.Name()); len(late) != 0 {
		t.Errorf("%s accepted EtcdRecover uploads %v after its Bootstrap", rec.Name(), late)
	}

	// Reruns after the call was made: no reset, no second bootstrap.
	boots := map[string]string{}
	for _, cp := range cps {
		boots[cp.Name()] = cp.BootID()
	}
	for _, name := range []string{executor.StepLeaveOthers, executor.StepResetAll, executor.StepRecover} {
		s := stepNamed(t, e, name)
		e.Machine.Calls = 2
		runStep(t, ctx, s, e)
	}
	for _, cp := range cps {
		if cp.BootID() != boots[cp.Name()] {
			t.Errorf("a rerun of the reset reset %s again", cp.Name())
		}
	}

	takeOver(t, ctx, f, kenv, tc, rec, env)
	fenced(t, ctx, f, kenv, tc, rec, env)
}

// takeOver: a second restore, its tail handed over to a Takeover that is
// killed once the API is gone; a new one resumes from the journal alone
// (the hand-over file and META) and finishes: the objects created after
// the snapshot are gone, the operation (created after it too) is back,
// Succeeded with the snapshot's revision, and the journal is cleared.
func takeOver(t *testing.T, ctx context.Context, f *sim.Fleet, kenv *testenv.Env, tc *talosclient.Client, rec *sim.Machine, env func(*ichorv1.TalosOperation) *executor.Env) {
	kc := kenv.Kube
	_, e, cfg := upToTheHandOver(t, ctx, f, kenv, tc, rec, env, "restore", "second", "later")
	dir := t.TempDir()
	first := &executor.Takeover{Dir: dir, Kube: kenv.Client, Clientset: kc, Log: testr.New(t)}
	kctx, kill := context.WithCancel(ctx)
	if _, err := first.Begin(kctx, e, cfg); err != nil {
		t.Fatal(err)
	}
	if !first.Owns(types.NamespacedName{Namespace: "default", Name: "restore"}) {
		t.Error("the takeover does not say it owns the operation")
	}
	testenv.Eventually(t, 2*time.Minute, "the API gone", func(context.Context) (bool, error) { return !f.HostedEtcd().Serving, nil })
	kill()
	first.Wait()

	second := &executor.Takeover{Dir: dir, Kube: kenv.Client, Clientset: kc, Log: testr.New(t)}
	if err := second.Resume(ctx); err != nil {
		t.Fatal(err)
	}
	second.Wait()
	if got, err := testenv.ConfigMaps(kc); err != nil || got != "before,second" {
		t.Fatalf("after the second restore the ConfigMaps are %q (%v)", got, err)
	}
	var back ichorv1.TalosOperation
	if err := kenv.Client.Get(ctx, client.ObjectKey{Namespace: "default", Name: "restore"}, &back); err != nil {
		t.Fatalf("the operation was not written back: %v", err)
	}
	ms := back.Status.Machines
	if back.Status.Phase != ichorv1.PhaseSucceeded || len(ms) != 1 || ms[0].To != e.Machine.To || back.Spec.Paused {
		t.Fatalf("written back: %+v", back)
	}
	j := journal.Journal{Talos: tc, ControlPlanes: e.ControlPlanes}
	if s, o, err := j.ReadState(ctx); s != nil || o != nil || err != nil {
		t.Fatalf("the journal is not cleared: %+v, %+v, %v", s, o, err)
	}
	if _, err := os.Stat(filepath.Join(dir, "etcd-restore-handover.json")); !os.IsNotExist(err) {
		t.Fatalf("the hand-over file is still there: %v", err)
	}
}

// upToTheHandOver prepares a restore named name, with the steps before
// the hand-over run: the ConfigMap kept is in its snapshot, after is
// created after it. It returns the operation, its Env and the talosconfig.
func upToTheHandOver(t *testing.T, ctx context.Context, f *sim.Fleet, kenv *testenv.Env, tc *talosclient.Client, rec *sim.Machine,
	env func(*ichorv1.TalosOperation) *executor.Env, name, kept, after string) (*ichorv1.TalosOperation, *executor.Env, []byte) {
	t.Helper()
	testenv.CreateConfigMaps(t, kenv.Kube, kept)
	snap := filepath.Join(t.TempDir(), name+".snapshot")
	testcluster.TakeSnapshot(t, tc, rec, snap)
	testenv.CreateConfigMaps(t, kenv.Kube, after)
	op := &ichorv1.TalosOperation{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: name}, Spec: ichorv1.TalosOperationSpec{
		Kind: ichorv1.KindEtcdRestore, MaxUnavailable: 1, EtcdRestore: &ichorv1.EtcdRestore{Snapshot: "file://" + snap, Machine: rec.Name()}}}
	if err := kenv.Client.Create(ctx, op); err != nil {
		t.Fatal(err)
	}
	e := env(op)
	for _, step := range []string{executor.StepCheckSnapshot, executor.StepLeaveOthers} {
		e.Machine.Step = step
		runStep(t, ctx, stepNamed(t, e, step), e)
	}
	cfg, err := f.Talosconfig().Bytes()
	if err != nil {
		t.Fatal(err)
	}
	return op, e, cfg
}

// fenced: a third restore, handed over to the takeover of pod ichor-a,
// whose Reset calls are held in its client while the API is still there,
// as when a controller loses its leadership just after the hand-over. The
// new leader (pod ichor-b) runs the step again: it finds the journal held
// and waits, journalling nothing and calling nothing. ichor-a's takeover
// is killed with its reset unmade, and once its pod is gone ichor-b
// continues the journal; ichor-a resumed then (its container restarted)
// stands down. Every control plane is reset once, and the restore
// finishes.
func fenced(t *testing.T, ctx context.Context, f *sim.Fleet, kenv *testenv.Env, tc *talosclient.Client, rec *sim.Machine, env func(*ichorv1.TalosOperation) *executor.Env) {
	kc := kenv.Kube
	op, e, cfg := upToTheHandOver(t, ctx, f, kenv, tc, rec, env, "restore3", "third", "last")
	putObjects(t, ctx, kenv.Client,
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: e.Controller.Namespace}},
		&corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: e.Controller.Namespace, Name: ichorv1.TalosconfigSecret},
			Data: map[string][]byte{ichorv1.TalosconfigKey: cfg}},
		// No controller manager makes the ServiceAccount a pod is admitted with.
		&corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "default"}},
		controllerPod("ichor-a"), controllerPod("ichor-b"))
	resets := func() (n int) {
		for _, cp := range f.ControlPlanes() {
			for _, c := range f.Recorder().Handled(cp.Name(), "Reset") {
				if c.Accepted() {
					n++
				}
			}
		}
		return n
	}
	before := resets()
	inReset := make(chan struct{}, len(f.ControlPlanes()))
	holdResets := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoke grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		if !strings.HasSuffix(method, "/Reset") {
			return invoke(ctx, method, req, reply, cc, opts...)
		}
		inReset <- struct{}{}
		<-ctx.Done()
		return ctx.Err()
	}

	newTakeover := func(dir, pod string) *executor.Takeover {
		return &executor.Takeover{Dir: dir, Pod: "default/" + pod, Kube: kenv.Client, Clientset: kc, Log: testr.New(t)}
	}
	dirA := t.TempDir()
	a := newTakeover(dirA, "ichor-a")
	a.TalosOptions = []talosclient.OptionFunc{talosclient.WithGRPCDialOptions(grpc.WithChainUnaryInterceptor(holdResets))}
	actx, killA := context.WithCancel(ctx)
	defer killA()
	if _, err := a.Begin(actx, e, cfg); err != nil {
		t.Fatal(err)
	}
	testenv.Receive(t, ctx, inReset, "ichor-a's Reset call")
	j := journal.Journal{Talos: tc, ControlPlanes: e.ControlPlanes}
	held, _, err := j.ReadState(ctx)
	if err != nil || held == nil || held.Machine.Step != executor.StepResetAll || held.Owner != "default/ichor-a" {
		t.Fatalf("the journal during ichor-a's reset: %+v (%v), want its step, owned by default/ichor-a", held, err)
	}

	// The new leader's rerun of the step: held, and it waits.
	b := newTakeover(t.TempDir(), "ichor-b")
	eb := env(op)
	eb.Machine.Step, eb.Machine.Calls = executor.StepResetAll, 2
	var heldErr *executor.HeldError
	if _, err := b.Begin(ctx, eb, cfg); !errors.As(err, &heldErr) || heldErr.Owner != "default/ichor-a" {
		t.Fatalf("Begin of ichor-b while ichor-a holds the journal: %v, want a HeldError naming default/ichor-a", err)
	}
	progress := make(chan string, 16)
	eb.Progress = func(msg string) {
		select {
		case progress <- msg:
		default:
		}
	}
	resetDone, standDown := make(chan struct{}, 1), make(chan struct{})
	b.TestHookAfterStep = func(_, step string, _ error) {
		if step == executor.StepResetAll {
			resetDone <- struct{}{}
			<-standDown
		}
	}
	type ended struct {
		out executor.Outcome
		err error
	}
	handed := make(chan ended, 1)
	go func() {
		out, err := b.HandOver(ctx, eb)
		handed <- ended{out, err}
	}()
	if msg := testenv.Receive(t, ctx, progress, "progress from ichor-b's step"); !strings.Contains(msg, "takeover of pod default/ichor-a carries this etcd restore out") {
		t.Fatalf("ichor-b's step reports %q, want that it waits for ichor-a's takeover", msg)
	}
	if st, _, err := j.ReadState(ctx); err != nil || st.Seq != held.Seq || st.Owner != held.Owner {
		t.Fatalf("ichor-b changed the journal while it waited: %+v (%v), was %+v", st, err, held)
	}

	// ichor-a's takeover dies with its reset unmade; then its pod goes.
	killA()
	a.Wait()
	if b.Owns(types.NamespacedName{Namespace: "default", Name: "restore3"}) {
		t.Fatal("ichor-b took the restore over while ichor-a's pod was there")
	}
	if err := kenv.Client.Delete(ctx, controllerPod("ichor-a")); err != nil {
		t.Fatal(err)
	}
	testenv.Receive(t, ctx, resetDone, "end of ichor-b's reset")
	resumed := newTakeover(dirA, "ichor-a")
	if err := resumed.Resume(ctx); err != nil {
		t.Fatal(err)
	}
	resumed.Wait()
	if _, err := os.Stat(filepath.Join(dirA, "etcd-restore-handover.json")); !os.IsNotExist(err) {
		t.Errorf("ichor-a, resumed after ichor-b continued its restore, kept its hand-over file: %v", err)
	}
	close(standDown)

	res := testenv.Receive(t, ctx, handed, "end of ichor-b's hand-over")
	if res.err != nil || !res.out.Done {
		t.Fatalf("ichor-b's hand-over: %+v, %v", res.out, res.err)
	}
	if n := resets() - before; n != len(f.ControlPlanes()) {
		t.Errorf("%d resets took effect, want one per control plane (%d)", n, len(f.ControlPlanes()))
	}
	if got, err := testenv.ConfigMaps(kc); err != nil || got != "before,second,third" {
		t.Fatalf("after the third restore the ConfigMaps are %q (%v)", got, err)
	}
	var back ichorv1.TalosOperation
	if err := kenv.Client.Get(ctx, client.ObjectKey{Namespace: "default", Name: "restore3"}, &back); err != nil || back.Status.Phase != ichorv1.PhaseSucceeded {
		t.Fatalf("the operation written back: %+v (%v)", back.Status, err)
	}
	if st, _, err := j.ReadState(ctx); st != nil || err != nil {
		t.Fatalf("the journal is not cleared: %+v, %v", st, err)
	}
}

// controllerPod is a controller's pod, as the journal names its owner.
func controllerPod(name string) *corev1.Pod {
	return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: name},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "controller", Image: "ichor"}}}}
}

// putObjects creates each object.
func putObjects(t *testing.T, ctx context.Context, c client.Client, objs ...client.Object) {
	t.Helper()
	for _, o := range objs {
		if err := c.Create(ctx, o); err != nil {
			t.Fatalf("create %T %s: %v", o, o.GetName(), err)
		}
	}
}

func stepNamed(t *testing.T, e *executor.Env, name string) executor.Step {
	for _, s := range (executor.EtcdRestore{}).Steps(e.Op, &e.Machine) {
		if s.Name == name {
			return s
		}
	}
	t.Fatalf("no step %s", name)
	return executor.Step{}
}

// runStep runs a Run step within its timeout and records its outcome on
// the machine, as the driver does.
func runStep(t *testing.T, ctx context.Context, s executor.Step, e *executor.Env) executor.Outcome {
	t.Helper()
	sctx, cancel := context.WithTimeout(ctx, s.Timeout)
	defer cancel()
	out, err := s.Run(sctx, e)
	if err != nil {
		t.Fatalf("step %s: %v", s.Name, err)
	}
	if out.BootID != "" {
		e.Machine.BootID = out.BootID
	}
	if out.From != "" {
		e.Machine.From = out.From
	}
	if out.To != "" {
		e.Machine.To = out.To
	}
	e.Machine.Message = out.Message
	return out
}

// checkS3: the same snapshot in a real S3 server (gofakes3), read with the
// credentials of the Secret the operation names, passes the check; a key
// that is not there is refused, saying so.
func checkS3(t *testing.T, ctx context.Context, kc kubernetes.Interface, snap string, env func(*ichorv1.TalosOperation) *executor.Env) {
	t.Helper()
	backend := s3mem.New()
	srv := httptest.NewServer(gofakes3.New(backend).Server())
	t.Cleanup(srv.Close)
	b, err := os.ReadFile(snap)
	if err != nil {
		t.Fatal(err)
	}
	if err := backend.CreateBucket("backups"); err != nil {
		t.Fatal(err)
	}
	if _, err := backend.PutObject("backups", "etcd.snapshot", map[string]string{}, bytes.NewReader(b), int64(len(b)), nil); err != nil {
		t.Fatal(err)
	}
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "ichor-system"}}
	if _, err := kc.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	sec := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: "ichor-system", Name: "ichor-etcd-snapshot"}, Data: map[string][]byte{
		"AWS_ACCESS_KEY_ID": []byte("ichor"), "AWS_SECRET_ACCESS_KEY": []byte("secret"), "AWS_ENDPOINT_URL": []byte(srv.URL)}}
	if _, err := kc.CoreV1().Secrets("ichor-system").Create(ctx, sec, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	for key, want := range map[string]string{"etcd.snapshot": "", "missing.snapshot": `snapshot not found: no object "missing.snapshot" in bucket backups`} {
		op := &ichorv1.TalosOperation{ObjectMeta: metav1.ObjectMeta{UID: types.UID("s3-" + key)}, Spec: ichorv1.TalosOperationSpec{
			Kind: ichorv1.KindEtcdRestore, EtcdRestore: &ichorv1.EtcdRestore{Snapshot: "s3://backups/" + key, Secret: "ichor-etcd-snapshot"}}}
		got := (executor.EtcdRestore{}).Check(ctx, env(op))
		if want == "" && len(got) != 0 || want != "" && (len(got) != 1 || !strings.Contains(got[0], want)) {
			t.Errorf("Check(s3://backups/%s) = %q, want %q", key, got, want)
		}
	}
}

// TestEtcdRestoreScope: the recovering machine is the named control plane,
// or the first by name; a worker or a machine that is not a Node is refused.
func TestEtcdRestoreScope(t *testing.T) {
	node := func(name string, cp bool) *corev1.Node {
		n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{}}}
		if cp {
			n.Labels[ichorv1.ControlPlaneLabel] = ""
		}
		return n
	}
	nodes := []*corev1.Node{node("w-1", false), node("cp-2", true), node("cp-1", true), node("cp-3", true)}
	for machine, want := range map[string]string{
		"":      "cp-1",
		"cp-3":  "cp-3",
		"w-1":   "error: w-1 is a worker",
		"cp-9":  "error: machine cp-9 is not a Node",
		"cp-2 ": "error: not a Node",
	} {
		op := &ichorv1.TalosOperation{Spec: ichorv1.TalosOperationSpec{Kind: ichorv1.KindEtcdRestore,
			EtcdRestore: &ichorv1.EtcdRestore{Snapshot: "file:///s.db", Machine: machine}}}
		got, err := executor.EtcdRestore{}.Scope(op, nodes)
		res := ""
		if err != nil {
			res = "error: " + err.Error()
		} else if len(got) == 1 {
			res = got[0].Name
		}
		if !strings.HasPrefix(want, "error: ") && res != want || strings.HasPrefix(want, "error: ") && !strings.Contains(res, strings.TrimPrefix(want, "error: ")) {
			t.Errorf("machine %q: %q, want %q", machine, res, want)
		}
	}
	if _, err := (executor.EtcdRestore{}).Scope(&ichorv1.TalosOperation{Spec: ichorv1.TalosOperationSpec{EtcdRestore: &ichorv1.EtcdRestore{}}},
		[]*corev1.Node{node("w-1", false)}); err == nil || !strings.Contains(err.Error(), "no control plane") {
		t.Errorf("workers only: %v", err)
	}
}

// TestEtcdRestoreRefusesControllerOnControlPlane: a controller whose pod
// runs on a control plane (the downward API's node name) is refused, with
// what to do; one on a worker, or outside a pod, goes on to the snapshot.
func TestEtcdRestoreRefusesControllerOnControlPlane(t *testing.T) {
	nodes := []*corev1.Node{
		{ObjectMeta: metav1.ObjectMeta{Name: "cp-1", Labels: map[string]string{ichorv1.ControlPlaneLabel: ""}}},
		{ObjectMeta: metav1.ObjectMeta{Name: "w-1"}},
	}
	op := &ichorv1.TalosOperation{Spec: ichorv1.TalosOperationSpec{Kind: ichorv1.KindEtcdRestore,
		EtcdRestore: &ichorv1.EtcdRestore{Snapshot: "file://" + filepath.Join(t.TempDir(), "missing.db")}}}
	for node, want := range map[string]string{
		"cp-1": "the controller runs on the control plane cp-1, which the restore resets with EPHEMERAL wiped (its pod and the restore's hand-over with it): " +
			"move the controller to a worker first (kubectl -n ichor-system delete pod ichor-controller-abc once cp-1 is cordoned, or a nodeSelector/affinity on the Deployment), then retry",
		"w-1": "snapshot not found",
		"":    "snapshot not found",
	} {
		e := &executor.Env{Op: op, Nodes: nodes, Controller: executor.Controller{Namespace: "ichor-system", Pod: "ichor-system/ichor-controller-abc", Node: node}}
		got := (executor.EtcdRestore{}).Check(context.Background(), e)
		if len(got) != 1 || !strings.Contains(got[0], want) {
			t.Errorf("controller on %q: %q, want %q", node, got, want)
		}
	}
}

// TestEtcdRestoreLeavesNothingWhileJournalled: with the journal in META
// holding a restore (this operation's, handed over before the store was
// rewound to a snapshot that has it again; or another's), etcd-leave-others
// fails saying so and no control plane is asked to leave etcd.
func TestEtcdRestoreLeavesNothingWhileJournalled(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	spec := sim.Cluster("", 3, 0)
	spec.Logf = t.Logf
	f, err := sim.Start(ctx, spec, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Stop()
	tc, err := talosclient.New(ctx, talosclient.WithConfig(f.Talosconfig()))
	if err != nil {
		t.Fatal(err)
	}
	defer tc.Close()
	var addrs []string
	for _, cp := range f.ControlPlanes() {
		addrs = append(addrs, cp.Address())
	}
	j := journal.Journal{Talos: tc, ControlPlanes: addrs}
	if err := j.WriteState(ctx, journal.State{Seq: 1, UID: "handed-over", Machine: ichorv1.MachineStatus{Step: executor.StepRecover}}); err != nil {
		t.Fatal(err)
	}
	leave := (executor.EtcdRestore{}).Steps(nil, nil)[1]
	for uid, want := range map[types.UID]string{"handed-over": "RestoreHandedOver", "another": "RestoreUnderWay"} {
		op := &ichorv1.TalosOperation{ObjectMeta: metav1.ObjectMeta{UID: uid}, Spec: ichorv1.TalosOperationSpec{Kind: ichorv1.KindEtcdRestore, EtcdRestore: &ichorv1.EtcdRestore{}}}
		e := &executor.Env{Op: op, Machine: ichorv1.MachineStatus{Name: f.ControlPlanes()[0].Name(), Step: leave.Name, Calls: 1},
			Address: addrs[0], ControlPlanes: addrs, Talos: tc, Log: testr.New(t)}
		_, err := leave.Run(ctx, e)
		if got := executor.Reason(leave.Name, err); got != want || !strings.Contains(fmt.Sprint(err), "recover-etcd") {
			t.Errorf("op %s: %s (%v), want %s naming the journalled step", uid, got, err, want)
		}
	}
	for _, cp := range f.ControlPlanes() {
		if n := len(f.Recorder().Handled(cp.Name(), "EtcdLeaveCluster")); n != 0 {
			t.Errorf("%s was asked %d times to leave etcd", cp.Name(), n)
		}
	}
}
