package operation_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/siderolabs/talos/pkg/machinery/constants"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/app"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/controller/operation"
	"maesh.dev/ichor/internal/testcluster"
	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

// withKubernetes makes the controller carry out the kubernetes kind, which
// the default registry still refuses (no kube-proxy stage or
// removed-items checks yet).
func withKubernetes(o *app.Options) {
	o.Executors = executor.Registry{ichorv1.KindKubernetes: executor.KubernetesUpgrade{}}
}

// TestKubernetesStages: a Kubernetes upgrade pulls the new images, then
// moves every control plane's kube-apiserver, then kube-controller-manager,
// then kube-scheduler mirror pod to the new image and configuration
// version, then every kubelet, through a controller killed after the
// pre-pull and each image patch on cp-2 (one in every stage) and on w-1,
// before status records it: each image is applied once
// per machine, live, and every machine ends on the new versions.
func TestKubernetesStages(t *testing.T) {
	c := newCluster(t, sim.Cluster("", 2, 2))
	const to = "v1.35.1"
	c.create("k8s", ichorv1.TalosOperationSpec{Kind: ichorv1.KindKubernetes, Kubernetes: &ichorv1.KubernetesUpgrade{Version: to}, MaxUnavailable: 2})
	cp2, w1 := c.fleet.Machines()[1].Name(), c.fleet.Machines()[2].Name()
	var mu sync.Mutex
	runs, kills := map[string]int{}, 0
	var op *ichorv1.TalosOperation
	for restarts := 0; op == nil; restarts++ {
		if restarts > 8 {
			t.Fatal("still not done after 8 controllers")
		}
		var ctl atomic.Pointer[testcluster.Controller]
		gone := make(chan struct{})
		// The odd runs are the first of a stage, the even ones their reruns.
		hook := func(s operation.StepRun) {
			mu.Lock()
			defer mu.Unlock()
			if (s.Step != executor.StepPatchImage && s.Step != executor.StepPullImages) || s.Err != nil || (s.Machine != cp2 && s.Machine != w1) {
				return
			}
			key := s.Machine + "/" + s.Step
			if runs[key]++; runs[key]%2 == 1 {
				kills++
				ctl.Load().Kill()
				close(gone)
			}
		}
		o := app.Options{Namespace: c.ctrlNS, TestHookAfterRun: hook}
		withKubernetes(&o)
		ctl.Store(testcluster.StartKillable(t, env.Config, o))
		testenv.Eventually(t, 2*time.Minute, "the controller killed after a patch, or the operation done", func(ctx context.Context) (bool, error) {
			select {
			case <-gone:
				return true, nil
			default:
			}
			got := c.get("k8s")
			if got.Failed() {
				t.Fatalf("failed: %s: %s", got.Status.FailureReason, got.Status.Message)
			}
			if got.Succeeded() {
				op = got
			}
			return op != nil, nil
		})
		ctl.Load().Stop()
	}
	if kills != 7 {
		t.Errorf("%d kills, want 7: the pre-pull and four stages on %s, the pre-pull and one on %s", kills, cp2, w1)
	}

	for i, s := range op.Status.Stages {
		if s.FinishedAt == nil || i > 0 && s.StartedAt.Before(op.Status.Stages[i-1].FinishedAt) {
			t.Errorf("stage %s ran %v to %v, the one before ended %v", s.Name, s.StartedAt, s.FinishedAt, op.Status.Stages[max(i-1, 0)].FinishedAt)
		}
	}
	rec := c.fleet.Recorder()
	for _, m := range c.fleet.Machines() {
		want := 1
		if m.Role() == sim.ControlPlane {
			want = 4
			for _, component := range []string{executor.StageAPIServer, executor.StageControllerManager, executor.StageScheduler} {
				p := &corev1.Pod{}
				if err := env.Client.Get(context.Background(), client.ObjectKey{Namespace: "kube-system", Name: component + "-" + m.Name()}, p); err != nil {
					t.Fatal(err)
				}
				if img := p.Spec.Containers[0].Image; img != "registry.k8s.io/"+component+":"+to || p.Annotations[constants.AnnotationStaticPodConfigVersion] == "1" {
					t.Errorf("%s: mirror pod %s runs %s at configuration version %s", m.Name(), component, img, p.Annotations[constants.AnnotationStaticPodConfigVersion])
				}
			}
		}
		if n := rec.Calls(m.Name(), "MachineService/ApplyConfiguration"); n != want {
			t.Errorf("%s: %d configurations applied, want %d", m.Name(), n, want)
		}
		if got := c.node(m.Name()).Status.NodeInfo.KubeletVersion; got != to {
			t.Errorf("%s: kubelet %s, want %s", m.Name(), got, to)
		}
	}
}
