package main

import (
	"context"
	"fmt"
	"io"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/cilium"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/manifests"
	"maesh.dev/ichor/sim"
)

// secondVersion is the build an ichor operation upgrades the sandbox to.
const secondVersion = "v0.2.0"

// TestJobsEndToEnd runs issue 17's Jobs in the sandbox, through the plugin
// and the real kubectl, with the controller as its Deployment's pods: a
// cni operation moves the user's Cilium to the shipped chart through a Job
// whose init container took the lock, while a Talos upgrade created after
// it waits for that Job; a switch to kube-proxy replacement removes
// kube-proxy, disables it on every machine and reboots each once within the
// budget; and an ichor operation to a second build ends with every
// controller pod on that build, which marked it Succeeded.
func TestJobsEndToEnd(t *testing.T) {
	assets(t)
	bin := buildBinaries(t)
	second := filepath.Join(t.TempDir(), "ichor-controller")
	if err := buildBinary(second, "maesh.dev/ichor/controller", secondVersion); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	sb := startInProcess(ctx, t, "--controller", filepath.Join(bin, "ichor-controller"),
		"--image", executor.ReleaseImage+":"+secondVersion+"="+second,
		"--control-planes", "1", "--workers", "2", "--pace", "200ms")
	plugin := func(args ...string) string {
		t.Helper()
		return mustIchor(ctx, t, sb, bin, args...)
	}

	t.Run("cni through a Job holding the lock, a Talos upgrade waiting for it", func(t *testing.T) {
		plugin("upgrade", "cni", "--name", "cni-1")
		waitOp(t, sb, "cni-1", "to lend the lock to its Job", func(op *ichorv1.TalosOperation) bool {
			return len(op.Status.Machines) > 0 && op.Status.Machines[0].Step == executor.StepCilium
		})
		plugin("upgrade", "talos", "--to", "v1.12.7", "--name", "talos-1")
		waited := waitOp(t, sb, "talos-1", "to wait for the Cilium Job", (*ichorv1.TalosOperation).WaitingForLock)
		plugin("watch", "cni-1")
		plugin("watch", "talos-1")

		if !strings.HasPrefix(waited.Status.LockHolder, "job/"+cilium.Namespace+"/ichor-cni-") {
			t.Errorf("talos-1 waited for %q, want the Cilium Job", waited.Status.LockHolder)
		}
		var jobs batchv1.JobList
		if err := sb.Client.List(ctx, &jobs, client.InNamespace(cilium.Namespace)); err != nil || len(jobs.Items) != 1 {
			t.Fatalf("Jobs in %s: %d (%v), want the cni operation's one", cilium.Namespace, len(jobs.Items), err)
		}
		job := jobs.Items[0]
		id := ichorv1.JobIdentity(job.Namespace, job.Name)
		if init := job.Spec.Template.Spec.InitContainers; job.Status.Succeeded != 1 || len(init) != 1 ||
			!slices.Equal(init[0].Args[:4], []string{"lock", "acquire", "--identity", id}) || waited.Status.LockHolder != id {
			t.Errorf("Job %s (%d succeeded) did not hold the lock from its init container: %+v", job.Name, job.Status.Succeeded, init)
		}
		ds := &appsv1.DaemonSet{}
		if err := sb.Client.Get(ctx, client.ObjectKey{Namespace: cilium.Namespace, Name: cilium.DaemonSet}, ds); err != nil ||
			ds.Spec.Template.Spec.Containers[0].Image != "quay.io/cilium/cilium:v"+sb.shippedChart.Version {
			t.Errorf("Cilium's agents after cni-1: %v %v", ds.Spec.Template.Spec.Containers, err)
		}
	})

	t.Run("switch to kube-proxy replacement", func(t *testing.T) {
		rec := sb.Fleet.Recorder()
		rec.Reset()
		plugin("upgrade", "cni", "--kube-proxy-replacement=true", "--name", "kpr", "--watch")

		if err := sb.Client.Get(ctx, client.ObjectKey{Namespace: "kube-system", Name: "kube-proxy"}, &appsv1.DaemonSet{}); !apierrors.IsNotFound(err) {
			t.Errorf("kube-proxy's DaemonSet is still there (%v)", err)
		}
		for _, m := range sb.Fleet.Machines() {
			if m.Config().Cluster().Proxy().Enabled() {
				t.Errorf("%s: cluster.proxy is not disabled", m.Name())
			}
			reboots := 0
			for _, a := range rec.Actions(m.Name()) {
				if a.Kind == sim.ActionReboot {
					reboots++
				}
			}
			if reboots != 1 {
				t.Errorf("%s rebooted %d times, want once", m.Name(), reboots)
			}
		}
		if cps, workers := rec.MaxDown(); cps > 1 || workers > 1 {
			t.Errorf("%d control planes and %d workers were down at once; the budget is 1 of each", cps, workers)
		}
	})

	t.Run("ichor to a second build", func(t *testing.T) {
		plugin("upgrade", "ichor", "--to", secondVersion, "--name", "ichor-1", "--watch")

		op := waitOp(t, sb, "ichor-1", "to have succeeded", (*ichorv1.TalosOperation).Succeeded)
		if want := "finished by ichor-controller " + secondVersion; len(op.Status.Machines) != 1 || !strings.HasSuffix(op.Status.Machines[0].Message, want) {
			t.Errorf("ichor-1 was marked done as %+v, want it %s", op.Status.Machines, want)
		}
		var pods corev1.PodList
		if err := sb.Client.List(ctx, &pods, client.InNamespace(ichorv1.DefaultNamespace), client.MatchingLabels{"app.kubernetes.io/name": manifests.Deployment}); err != nil || len(pods.Items) != 2 {
			t.Fatalf("%d controller pods (%v), want the Deployment's 2", len(pods.Items), err)
		}
		for _, p := range pods.Items {
			if img := p.Spec.Containers[0].Image; img != executor.ReleaseImage+":"+secondVersion {
				t.Errorf("controller pod %s runs %s, want the second build", p.Name, img)
			}
		}
		if out := plugin("version"); !strings.Contains(out, "Controller Version: "+secondVersion) {
			t.Errorf("kubectl ichor version after the upgrade:\n%s", out)
		}
	})
}

// startInProcess starts a sandbox in this process with args, as the
// sandbox's main does, and stops it when the test ends: the test reads its
// machines directly.
func startInProcess(ctx context.Context, t *testing.T, args ...string) *Sandbox {
	t.Helper()
	o, err := parseFlags(append([]string{"--dir", filepath.Join(t.TempDir(), "sandbox")}, args...), io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	sb, err := Start(ctx, o.config)
	if err != nil {
		t.Fatalf("start the sandbox: %v", err)
	}
	t.Cleanup(sb.Stop)
	// Before Stop removes them: a failed test says what each part of the
	// cluster (the controller's pods, the machines, the control planes)
	// did last, as a failed demo does.
	t.Cleanup(func() {
		if t.Failed() {
			var b strings.Builder
			demoFailed(&b, sb)
			t.Log(b.String())
		}
	})
	return sb
}

// waitOp waits until the sandbox's operation name (in the walk-through's
// namespace) meets cond; one that fails or is refused fails the test.
func waitOp(t *testing.T, sb *Sandbox, name, what string, cond func(*ichorv1.TalosOperation) bool) *ichorv1.TalosOperation {
	t.Helper()
	op := &ichorv1.TalosOperation{}
	testenv.Eventually(t, 5*time.Minute, name+" "+what, func(ctx context.Context) (bool, error) {
		if err := sb.Client.Get(ctx, client.ObjectKey{Namespace: demoNamespace, Name: name}, op); err != nil {
			return false, client.IgnoreNotFound(err)
		}
		if op.Failed() || op.Refused() {
			return false, fmt.Errorf("%s ended %s: %s", name, op.Status.Phase, op.Status.Message)
		}
		return cond(op), nil
	})
	return op
}
