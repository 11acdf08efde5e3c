package operation_test

import (
	"context"
	"errors"
	"io"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"k8s.io/utils/ptr"

	"github.com/siderolabs/talos/pkg/machinery/api/common"
	"github.com/siderolabs/talos/pkg/machinery/api/machine"
	talosclient "github.com/siderolabs/talos/pkg/machinery/client"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/controller/executor"
	"maesh.dev/ichor/controller/machineconfig"
	"maesh.dev/ichor/sim"
)

// TestKubernetesPrePull: before the first image patch, the pre-pull stage
// pulls the new kube-apiserver, kube-controller-manager and kube-scheduler
// into the control plane's CRI namespace and the kubelet (its -fat suffix
// kept) into every machine's system namespace, through the deprecated
// ImagePull as talosctl does; a machine whose Talos answers it
// Unimplemented is skipped, and the upgrade goes on.
func TestKubernetesPrePull(t *testing.T) {
	spec := sim.Cluster("", 1, 2)
	for i := range spec.Machines {
		spec.Machines[i].Talos = "v1.13.7" // ImageService.List, to read the images back
	}
	c := newCluster(t, spec)
	const to = "v1.35.1"
	ms := c.fleet.Machines()
	cp, fat, noPull := ms[0], ms[1], ms[2]
	applyDirect(t, c.fleet, fat, machineconfig.NoReboot, "machine:\n  kubelet:\n    image: ghcr.io/siderolabs/kubelet:v1.35.0-fat\n")
	noPull.Inject(sim.Fault{Kind: sim.FaultError, Method: "ImagePull", Code: codes.Unimplemented})
	since := time.Now()
	c.create("k8s", ichorv1.TalosOperationSpec{Kind: ichorv1.KindKubernetes, Kubernetes: &ichorv1.KubernetesUpgrade{Version: to}, MaxUnavailable: 2})
	c.start()

	rec := c.fleet.Recorder()
	firstPatch := func() time.Time {
		for _, a := range rec.Handled("", "MachineService/ApplyConfiguration") {
			if a.At.After(since) {
				return a.At
			}
		}
		return time.Time{}
	}
	op := c.waitFor("k8s", "to patch its first image", time.Minute, func(op *ichorv1.TalosOperation) bool {
		if op.Failed() {
			t.Fatalf("failed: %s: %s", op.Status.FailureReason, op.Status.Message)
		}
		return !firstPatch().IsZero()
	})
	if s := op.Status.Stages[0]; s.Name != executor.StagePrePull || s.FinishedAt == nil || s.Progress != "3/3" {
		t.Errorf("first stage %s finished %v with %s, want %s finished on 3/3", s.Name, s.FinishedAt, s.Progress, executor.StagePrePull)
	}
	for _, p := range rec.Handled("", "MachineService/ImagePull") {
		if !p.Accepted() || !p.At.Before(firstPatch()) {
			t.Errorf("%s: ImagePull at %v answered %v; the first patch was at %v", p.Machine, p.At, p.Err, firstPatch())
		}
	}

	want := map[string]map[common.ContainerdNamespace][]string{
		cp.Name(): {
			common.ContainerdNamespace_NS_CRI:    {"registry.k8s.io/kube-apiserver:" + to, "registry.k8s.io/kube-controller-manager:" + to, "registry.k8s.io/kube-scheduler:" + to},
			common.ContainerdNamespace_NS_SYSTEM: {"ghcr.io/siderolabs/kubelet:" + to},
		},
		fat.Name():    {common.ContainerdNamespace_NS_SYSTEM: {"ghcr.io/siderolabs/kubelet:" + to + "-fat"}},
		noPull.Name(): {},
	}
	for _, m := range ms {
		for _, ns := range []common.ContainerdNamespace{common.ContainerdNamespace_NS_CRI, common.ContainerdNamespace_NS_SYSTEM} {
			if got := listImages(t, c.fleet, m, ns); !slices.Equal(got, want[m.Name()][ns]) {
				t.Errorf("%s: namespace %s holds %v, want %v", m.Name(), ns, got, want[m.Name()][ns])
			}
		}
	}
	if n := rec.Calls(noPull.Name(), "ImagePull"); n != 1 {
		t.Errorf("%s: %d ImagePull calls, want 1 (the kubelet, answered Unimplemented)", noPull.Name(), n)
	}
}

// TestKubernetesPrePullOffOrRefused: with prePullImages false nothing is
// pulled and the first stage patches kube-apiserver; an image the registry
// does not have fails the pre-pull with Talos's words and what to do, and
// nothing is patched.
func TestKubernetesPrePullOffOrRefused(t *testing.T) {
	const to = "v1.35.1"
	tests := []struct {
		name        string
		prePull     bool
		unpublished []string
		// failed is what the failed step's message says; empty: no failure.
		failed []string
	}{
		{name: "off", prePull: false},
		{name: "not in the registry", prePull: true, unpublished: []string{to},
			failed: []string{"nothing has moved yet", "make registry.k8s.io/kube-apiserver:" + to + " available", "then retry", "containerd namespace k8s.io", "NotFound: error pulling image"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			spec := sim.Cluster("", 1, 1)
			spec.Unpublished = tt.unpublished
			c := newCluster(t, spec)
			c.create("k8s", ichorv1.TalosOperationSpec{Kind: ichorv1.KindKubernetes, MaxUnavailable: 1,
				Kubernetes: &ichorv1.KubernetesUpgrade{Version: to, PrePullImages: ptr.To(tt.prePull)}})
			c.start()
			rec := c.fleet.Recorder()
			op := c.waitFor("k8s", "to patch an image or fail", time.Minute, func(op *ichorv1.TalosOperation) bool {
				return op.Failed() || rec.Calls("", "ApplyConfiguration") > 0
			})
			if tt.failed == nil {
				if op.Failed() {
					t.Fatalf("failed: %s: %s", op.Status.FailureReason, op.Status.Message)
				}
				if n := rec.Calls("", "ImagePull"); n != 0 {
					t.Errorf("%d ImagePull calls, want none", n)
				}
				if s := op.Status.Stages[0].Name; s != executor.StageAPIServer {
					t.Errorf("first stage %s, want %s", s, executor.StageAPIServer)
				}
				return
			}
			m := op.Status.FailedMachine()
			if m == nil || op.Status.FailureReason != "PullFailed" || op.Status.Stage != executor.StagePrePull {
				t.Fatalf("stage %s, failure %q, machine %+v; want PullFailed in %s", op.Status.Stage, op.Status.FailureReason, m, executor.StagePrePull)
			}
			for _, s := range tt.failed {
				if !strings.Contains(m.Message, s) {
					t.Errorf("message %q does not say %q", m.Message, s)
				}
			}
			if n := rec.Calls("", "ApplyConfiguration"); n != 0 {
				t.Errorf("%d configurations applied after a failed pre-pull", n)
			}
		})
	}
}

// listImages lists the images in a machine's CRI containerd namespace ns
// through the Talos API.
func listImages(t *testing.T, f *sim.Fleet, m *sim.Machine, ns common.ContainerdNamespace) []string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	tc, err := talosclient.New(ctx, talosclient.WithConfig(f.Talosconfig()))
	if err != nil {
		t.Fatal(err)
	}
	defer tc.Close() //nolint:errcheck
	stream, err := tc.ImageClient.List(talosclient.WithNode(ctx, m.Address()), &machine.ImageServiceListRequest{
		Containerd: &common.ContainerdInstance{Driver: common.ContainerDriver_CRI, Namespace: ns}})
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for {
		r, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("%s: list images in %s: %v", m.Name(), ns, err)
		}
		out = append(out, r.Name)
	}
	slices.Sort(out)
	return out
}
