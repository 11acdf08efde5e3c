package machineconfig_test

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cosi-project/runtime/pkg/safe"
	talosclient "github.com/siderolabs/talos/pkg/machinery/client"
	"github.com/siderolabs/talos/pkg/machinery/config/types/v1alpha1"
	v1alpha1res "github.com/siderolabs/talos/pkg/machinery/resources/v1alpha1"
	"github.com/siderolabs/talos/pkg/machinery/role"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"

	"maesh.dev/ichor/controller/machineconfig"
	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

var fleets atomic.Int32

// worker starts a fleet of one control plane and one worker (without an API
// server) and returns the worker's configuration access over the real
// machinery client with roles (os:admin if none).
func worker(t *testing.T, d sim.Durations, roles ...role.Role) (machineconfig.Machine, *sim.Machine, *sim.Fleet) {
	t.Helper()
	spec := sim.Cluster(fmt.Sprintf("mc%d", fleets.Add(1)), 1, 1)
	spec.Durations = d
	spec.Logf = t.Logf
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	f, err := sim.Start(ctx, spec, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.Stop)
	if len(roles) == 0 {
		roles = []role.Role{role.Admin}
	}
	cfg, err := f.ClientConfig(roles...)
	if err != nil {
		t.Fatal(err)
	}
	c, err := talosclient.New(context.Background(), talosclient.WithConfig(cfg), talosclient.WithGRPCDialOptions(grpc.WithConnectParams(grpc.ConnectParams{
		Backoff: backoff.Config{BaseDelay: 5 * time.Millisecond, Multiplier: 1.6, MaxDelay: 50 * time.Millisecond}, MinConnectTimeout: 5 * time.Second,
	})))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	w := f.Machines()[1]
	return machineconfig.Machine{Talos: c, Node: w.Address()}, w, f
}

func parse(t *testing.T, texts ...string) []machineconfig.Patch {
	t.Helper()
	ps, err := machineconfig.ParsePatches(texts)
	if err != nil {
		t.Fatal(err)
	}
	return ps
}

func timeout(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func state(t *testing.T, m machineconfig.Machine, patches []machineconfig.Patch, ch machineconfig.Change) machineconfig.State {
	t.Helper()
	s, _, err := m.StateOf(timeout(t), patches, ch.To)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// TestApplyLive: a node label applies without a reboot, the machine then
// carries it, and planning it again finds it applied.
func TestApplyLive(t *testing.T) {
	m, w, f := worker(t, sim.Durations{})
	ctx := timeout(t)
	patches := parse(t, "machine:\n  nodeLabels:\n    zone: a\n")
	ch, err := m.Plan(ctx, patches)
	if err != nil {
		t.Fatal(err)
	}
	if diff, err := ch.Diff(); ch.Applied() || err != nil || !strings.Contains(diff, "zone: a") {
		t.Fatalf("plan: %+v, diff %q (%v)", ch, diff, err)
	}
	if s := state(t, m, patches, ch); s != machineconfig.NotApplied {
		t.Fatalf("before the apply: %s", s)
	}
	dry, err := m.DryRun(ctx, ch.Config, machineconfig.Auto)
	if err != nil || dry.Reboot {
		t.Fatalf("dry run: %+v, %v", dry, err)
	}
	if s := state(t, m, patches, ch); s != machineconfig.NotApplied {
		t.Fatalf("a dry run applied: %s", s)
	}
	boot := w.BootID()
	res, err := m.Apply(ctx, ch.Config, machineconfig.Auto)
	if err != nil || res.Reboot {
		t.Fatalf("apply: %+v, %v", res, err)
	}
	if err := m.Verify(ctx, ch.To); err != nil {
		t.Fatal(err)
	}
	if s := state(t, m, patches, ch); s != machineconfig.Applied {
		t.Fatalf("after the apply: %s", s)
	}
	if w.Config().Machine().NodeLabels()["zone"] != "a" || w.BootID() != boot {
		t.Fatalf("the machine runs labels %v, boot %s (was %s)", w.Config().Machine().NodeLabels(), w.BootID(), boot)
	}
	again, err := m.Plan(ctx, patches)
	if err != nil || !again.Applied() || again.To != ch.To {
		t.Fatalf("planned again: %+v, %v", again, err)
	}
	if n := f.Recorder().Calls(w.Name(), "ApplyConfiguration"); n != 2 {
		t.Fatalf("%d ApplyConfiguration calls, want 2 (the dry run and the apply)", n)
	}
}

// TestApplyReboot: a change that needs a reboot is refused live, and in
// reboot mode waits persisted for the reboot, after which it is active.
func TestApplyReboot(t *testing.T) {
	// Stopping takes long enough to see the change waiting for the reboot.
	m, w, _ := worker(t, sim.Durations{Stop: 3 * time.Second})
	ctx := timeout(t)
	patches := parse(t, "machine:\n  env:\n    HTTP_PROXY: http://proxy:3128\n")
	ch, err := m.Plan(ctx, patches)
	if err != nil {
		t.Fatal(err)
	}
	if dry, err := m.DryRun(ctx, ch.Config, machineconfig.Auto); err != nil || !dry.Reboot {
		t.Fatalf("dry run in auto: %+v, %v", dry, err)
	}
	_, err = m.DryRun(ctx, ch.Config, machineconfig.NoReboot)
	if machineconfig.Reason(err) != machineconfig.ReasonNeedsReboot || !strings.Contains(err.Error(), "Talos says \"this config change can't be applied in immediate mode") {
		t.Fatalf("a dry run without reboot: %v", err)
	}
	boot := w.BootID()
	res, err := m.Apply(ctx, ch.Config, machineconfig.Reboot)
	if err != nil || !res.Reboot {
		t.Fatalf("apply: %+v, %v", res, err)
	}
	if s := state(t, m, patches, ch); s != machineconfig.AwaitingReboot {
		t.Fatalf("after the apply: %s", s)
	}
	if err := m.Verify(ctx, ch.To); machineconfig.Reason(err) != machineconfig.ReasonNotActive {
		t.Fatalf("verified before the reboot: %v", err)
	}
	_, err = m.Apply(ctx, ch.Config, machineconfig.Reboot)
	if machineconfig.Reason(err) != machineconfig.ReasonRebootPending {
		t.Fatalf("a second apply while rebooting: %v", err)
	}
	testenv.Eventually(t, 30*time.Second, "the machine back with a new boot", func(context.Context) (bool, error) {
		return !w.Down() && w.BootID() != boot, nil
	})
	if err := m.Verify(ctx, ch.To); err != nil {
		t.Fatal(err)
	}
	if s := state(t, m, patches, ch); s != machineconfig.Applied {
		t.Fatalf("after the reboot: %s", s)
	}
}

// TestApplyRefused: Talos's refusals change nothing and say what to do; an
// apply without a mode is never sent.
func TestApplyRefused(t *testing.T) {
	m, w, f := worker(t, sim.Durations{})
	ctx := timeout(t)
	before, err := machineconfig.Fingerprint(w.Config())
	if err != nil {
		t.Fatal(err)
	}
	tooNew, err := m.Plan(ctx, []machineconfig.Patch{machineconfig.Typed("kubelet image", func(c *v1alpha1.Config) error {
		c.MachineConfig.MachineKubelet.KubeletImage = "ghcr.io/siderolabs/kubelet:v1.40.0"
		return nil
	})})
	if err != nil {
		t.Fatal(err)
	}
	for _, mode := range []machineconfig.Mode{machineconfig.Auto, machineconfig.Reboot} {
		_, err := m.Apply(ctx, tooNew.Config, mode)
		if machineconfig.Reason(err) != machineconfig.ReasonInvalid || !strings.Contains(err.Error(), "kubelet image is not valid") {
			t.Fatalf("%s: an invalid configuration: %v", mode, err)
		}
	}
	calls := f.Recorder().Calls(w.Name(), "ApplyConfiguration")
	if _, err := m.Apply(ctx, tooNew.Config, ""); err == nil || !strings.Contains(err.Error(), "always named") {
		t.Fatalf("an apply without a mode: %v", err)
	}
	if f.Recorder().Calls(w.Name(), "ApplyConfiguration") != calls {
		t.Fatal("an apply without a mode was sent")
	}
	reader, _, _ := worker(t, sim.Durations{}, role.Reader)
	ok, err := reader.Plan(ctx, parse(t, "machine:\n  nodeLabels:\n    zone: a\n"))
	if err == nil {
		_, err = reader.Apply(ctx, ok.Config, machineconfig.Auto)
	}
	if machineconfig.Reason(err) != machineconfig.ReasonNotPermitted || !strings.Contains(err.Error(), "os:admin") {
		t.Fatalf("os:reader: %v", err)
	}
	if after, _ := machineconfig.Fingerprint(w.Config()); after != before {
		t.Fatal("a refused apply changed the configuration")
	}
}

// TestDiverged: a change planned before someone else changed the machine's
// configuration is neither applied nor appliable.
func TestDiverged(t *testing.T) {
	m, _, _ := worker(t, sim.Durations{})
	ctx := timeout(t)
	minePatches := parse(t, `[{"op": "add", "path": "/machine/certSANs/-", "value": "10.9.9.9"}]`)
	mine, err := m.Plan(ctx, minePatches)
	if err != nil {
		t.Fatal(err)
	}
	theirs, err := m.Plan(ctx, parse(t, "machine:\n  nodeLabels:\n    team: b\n"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.Apply(ctx, theirs.Config, machineconfig.NoReboot); err != nil {
		t.Fatal(err)
	}
	if s := state(t, m, minePatches, mine); s != machineconfig.Diverged {
		t.Fatalf("after someone else's apply: %s", s)
	}
}

// TestApplyRestarting: a kubelet change applies live and returns once the
// kubelet has restarted and is healthy.
func TestApplyRestarting(t *testing.T) {
	m, w, _ := worker(t, sim.Durations{KubeletRestart: 200 * time.Millisecond})
	ctx := timeout(t)
	ch, err := m.Plan(ctx, []machineconfig.Patch{machineconfig.Typed("kubelet image", func(c *v1alpha1.Config) error {
		c.MachineConfig.MachineKubelet.KubeletImage = "ghcr.io/siderolabs/kubelet:v1.35.2"
		return nil
	})})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.ApplyRestarting(ctx, ch.Config, "kubelet"); err != nil {
		t.Fatal(err)
	}
	svc, err := safe.StateGetByID[*v1alpha1res.Service](talosclient.WithNode(ctx, m.Node), m.Talos.COSI, "kubelet")
	if err != nil {
		t.Fatal(err)
	}
	if !svc.TypedSpec().Running || !svc.TypedSpec().Healthy || w.KubeletVersion() != "1.35.2" {
		t.Fatalf("after the apply: kubelet %+v, version %s", svc.TypedSpec(), w.KubeletVersion())
	}
}
