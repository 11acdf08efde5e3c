package operation_test

import (
	"bytes"
	"context"
	"fmt"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/johannesboyne/gofakes3"
	"github.com/johannesboyne/gofakes3/backend/s3mem"
	talosclient "github.com/siderolabs/talos/pkg/machinery/client"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/app"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/controller/journal"
	"maesh.dev/ichor/controller/operation"
	"maesh.dev/ichor/controller/snapshot"
	"maesh.dev/ichor/internal/testcluster"
	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

// TestEtcdRestore restores a hosted fleet (three control planes, a real
// etcd behind real API servers) from a snapshot in S3, taken before three
// ConfigMaps and the operation were created, with the credentials of the
// Secret the operation names, through controllers each killed after the
// next step of the flow (before status or the journal records its end),
// then one left to finish: the three are gone, every control plane
// is a healthy member, the operation is back (written from the journal),
// Succeeded with the snapshot's revision, and the journal is cleared.
// Every irreversible call (etcd leave, reset, bootstrap) reaches each
// machine at most once, and no snapshot upload follows the bootstrap.
// The file:// source is restored uninterrupted by the plugin's test
// (TestRestoreEtcdEndToEnd) and the recovery demo.
//
// One fleet for every kill: a hosted run costs a minute of CPU, and each
// kill only restarts the controller.
func TestEtcdRestore(t *testing.T) {
	t.Parallel() // its own hosted fleet and API servers (see TestMain)
	// Every controller of the test shares its hand-over directory
	// (testcluster's, one per test), as containers of one pod share the
	// Deployment's emptyDir; a downloaded snapshot's file is named for its
	// operation's UID.
	fleet, henv := testcluster.StartHostedFleet(t, sim.Cluster("", 3, 0), testenv.Components{})
	ctx := context.Background()
	const ns = "default"
	testcluster.WriteTalosconfig(t, henv, fleet, ns)
	tc, err := talosclient.New(ctx, talosclient.WithConfig(fleet.Talosconfig()))
	if err != nil {
		t.Fatal(err)
	}
	defer tc.Close()
	cps := fleet.ControlPlanes()
	spec := &ichorv1.EtcdRestore{Snapshot: "s3://backups/etcd.snapshot", Secret: "backup-credentials"}
	bucket := s3Server(t, henv, ns, spec.Secret)
	// Taken outside the controller's reach: it must read it from the bucket.
	snap := filepath.Join(t.TempDir(), "etcd.snapshot")
	testcluster.TakeSnapshot(t, tc, cps[0], snap)
	putObject(t, bucket, "etcd.snapshot", snap)
	want, err := snapshot.Verify(snap)
	if err != nil {
		t.Fatal(err)
	}
	testenv.CreateConfigMaps(t, henv.Kube, "after0", "after1", "after2")

	op := &ichorv1.TalosOperation{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "restore"},
		Spec: ichorv1.TalosOperationSpec{Kind: ichorv1.KindEtcdRestore, EtcdRestore: spec}}
	// Controller i is killed right after step i has run; the next one
	// runs it again (its end was not recorded) and goes on to step i+1.
	// The step's name is the boundary: the API is away for most of the
	// flow, so the operation cannot be read to name it.
	for i, step := range []string{executor.StepCheckSnapshot, executor.StepLeaveOthers, executor.StepResetAll, executor.StepRecover, executor.StepRestored} {
		var ctl atomic.Pointer[testcluster.Controller]
		killed := make(chan struct{})
		var once sync.Once
		hook := func(s operation.StepRun) {
			if s.Step == step && s.Err == nil {
				once.Do(func() {
					ctl.Load().Kill()
					close(killed)
				})
			}
		}
		ctl.Store(testcluster.StartKillable(t, henv.Config, app.Options{Namespace: ns, TestHookAfterRun: hook}))
		if i == 0 {
			if err := henv.Client.Create(ctx, op); err != nil {
				t.Fatal(err)
			}
		}
		select {
		case <-killed:
		case <-time.After(5 * time.Minute):
			t.Fatalf("no controller ran %s", step)
		}
		ctl.Load().Stop()
	}
	testcluster.StartController(t, henv.Config, app.Options{Namespace: ns})

	got := &ichorv1.TalosOperation{}
	testenv.Eventually(t, 6*time.Minute, "the operation back and Succeeded", func(ctx context.Context) (bool, error) {
		if err := henv.Client.Get(ctx, client.ObjectKeyFromObject(op), got); err != nil {
			return false, nil // the API is away while the restore works
		}
		if p := got.Status.Phase; p == ichorv1.PhasePaused || p == ichorv1.PhaseRefused {
			return false, fmt.Errorf("the restore is %s: %s %s", p, got.Status.FailureReason, got.Status.Message)
		}
		return got.Succeeded(), nil
	})
	if cms, err := testenv.ConfigMaps(henv.Kube); err != nil || cms != "" {
		t.Errorf("after the restore the ConfigMaps are %q (%v), want those created after the snapshot gone", cms, err)
	}
	ms := got.Status.Machines
	if len(ms) != 1 || ms[0].To != fmt.Sprintf("revision %d", want.Revision) {
		t.Errorf("the operation's machines: %+v, want the snapshot's revision %d", ms, want.Revision)
	}
	if got.Annotations[journal.RestoredFromAnnotation] == "" {
		t.Errorf("the operation was not re-made from the journal: %v", got.Annotations)
	}
	st := fleet.Etcd()
	healthy := 0
	for _, m := range st.Members {
		if m.Healthy {
			healthy++
		}
	}
	if len(st.Members) != 3 || healthy != 3 || st.Leader == "" {
		t.Errorf("etcd after the restore: %+v, want the 3 control planes healthy members with a leader", st)
	}
	var addrs []string
	for _, cp := range cps {
		addrs = append(addrs, cp.Address())
	}
	// The journal is cleared once the operation is written back (a
	// controller killed between the two writes it back again).
	j := journal.Journal{Talos: tc, ControlPlanes: addrs}
	testenv.Eventually(t, 30*time.Second, "the journal cleared", func(ctx context.Context) (bool, error) {
		s, o, err := j.ReadState(ctx)
		return s == nil && o == nil && err == nil, nil
	})
	rec := fleet.Recorder()
	for _, cp := range cps {
		accepted := map[string][]sim.Call{}
		for _, method := range []string{"EtcdLeaveCluster", "Reset", "Bootstrap"} {
			for _, c := range rec.Handled(cp.Name(), method) {
				if c.Accepted() {
					accepted[method] = append(accepted[method], c)
				}
			}
		}
		// The irreversible calls: at most one each. The upload (EtcdRecover)
		// may repeat while Bootstrap is refused, never after it.
		for _, method := range []string{"EtcdLeaveCluster", "Reset", "Bootstrap"} {
			if n := len(accepted[method]); n > 1 {
				t.Errorf("%s accepted %d %s calls, want at most one", cp.Name(), n, method)
			}
		}
		if late := testcluster.UploadsAfterBootstrap(rec, cp.Name()); len(late) != 0 {
			t.Errorf("%s accepted EtcdRecover uploads %v after its Bootstrap", cp.Name(), late)
		}
		if n := len(rec.Handled(cp.Name(), "Reset")); n != 1 {
			t.Errorf("%s got %d Reset calls, want one", cp.Name(), n)
		}
	}
	if n := len(rec.Handled(cps[0].Name(), "Bootstrap")); n == 0 {
		t.Errorf("%s, the recovering machine, was never bootstrapped", cps[0].Name())
	}
}

// s3Server serves a real S3 server (gofakes3) with a bucket "backups"
// for the test, and stores its credentials in the Secret named (before
// the snapshot is taken, so that the restored store has it too).
func s3Server(t *testing.T, henv *testenv.Env, ns, secret string) *s3mem.Backend {
	t.Helper()
	backend := s3mem.New()
	srv := httptest.NewServer(gofakes3.New(backend).Server())
	t.Cleanup(srv.Close)
	if err := backend.CreateBucket("backups"); err != nil {
		t.Fatal(err)
	}
	s := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: secret}, Data: map[string][]byte{
		"AWS_ACCESS_KEY_ID": []byte("ichor"), "AWS_SECRET_ACCESS_KEY": []byte("secret"), "AWS_ENDPOINT_URL": []byte(srv.URL)}}
	if err := henv.Client.Create(context.Background(), s); err != nil {
		t.Fatal(err)
	}
	return backend
}

// putObject uploads the file at path to the bucket "backups" as key.
func putObject(t *testing.T, backend *s3mem.Backend, key, path string) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := backend.PutObject("backups", key, map[string]string{}, bytes.NewReader(b), int64(len(b)), nil); err != nil {
		t.Fatal(err)
	}
}
