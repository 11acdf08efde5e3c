package sim_test

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/cosi-project/runtime/pkg/safe"
	"github.com/siderolabs/talos/pkg/machinery/api/common"
	"github.com/siderolabs/talos/pkg/machinery/api/machine"
	"github.com/siderolabs/talos/pkg/machinery/client"
	"github.com/siderolabs/talos/pkg/machinery/config/types/v1alpha1"
	configres "github.com/siderolabs/talos/pkg/machinery/resources/config"
	"github.com/siderolabs/talos/pkg/machinery/resources/runtime"
	"github.com/siderolabs/talos/pkg/machinery/role"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

// TestRebootEndpoint: a rebooting control plane stops answering on its
// listener and its Node turns NotReady; it comes back on the same address
// with a new boot ID. The no-return fault holds it down long enough to look.
func TestRebootEndpoint(t *testing.T) {
	f := start(t, fleetSpec(t, 3, 0))
	cp := f.ControlPlanes()[0]
	ctx, cancel := timeout()
	defer cancel()
	c, err := client.New(ctx, client.WithConfig(f.Talosconfig()), client.WithEndpoints(cp.Endpoint()), fastReconnect)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	before := cp.BootID()
	clear := cp.Inject(sim.Fault{Kind: sim.FaultNoReturn})
	if err := c.Reboot(ctx); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 30*time.Second, "the endpoint to go away", func(context.Context) (bool, error) {
		_, err := c.Version(ctx)
		return client.StatusCode(err) == codes.Unavailable, nil
	})
	if conn, err := net.Dial("tcp", cp.Endpoint()); err == nil {
		conn.Close()
		t.Fatalf("%s still accepts connections while down", cp.Endpoint())
	}
	waitNodeReady(t, cp, false)
	if !cp.Down() {
		t.Fatal("machine not down")
	}
	// The other control planes answer for the rest of the fleet.
	other := talos(t, f)
	if _, err := version(t, other, f.ControlPlanes()[1]); err != nil {
		t.Fatalf("another control plane: %v", err)
	}
	_, err = version(t, other, cp)
	wantCode(t, err, codes.Unavailable, "connection refused")

	clear()
	waitRebooted(t, cp, before)
	testenv.Eventually(t, 30*time.Second, "the endpoint to answer again", func(context.Context) (bool, error) {
		_, err := c.Version(ctx)
		return err == nil, nil
	})
	rc, err := c.Read(ctx, "/proc/sys/kernel/random/boot_id")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(rc)
	if id := strings.TrimSpace(string(b)); id == before || id != cp.BootID() {
		t.Fatalf("boot ID after reboot %q, before %q, machine says %q", id, before, cp.BootID())
	}
	waitNodeReady(t, cp, true)
	if n := node(t, cp); n.Status.NodeInfo.BootID != cp.BootID() {
		t.Fatalf("Node bootID %q, want %q", n.Status.NodeInfo.BootID, cp.BootID())
	}
	acts := f.Recorder().Actions(cp.Name())
	if len(acts) != 1 || acts[0].Kind != sim.ActionReboot || acts[0].End.IsZero() {
		t.Fatalf("recorded actions %+v, want one finished reboot", acts)
	}
}

// TestEvents: EventsWatchV2 gets the hello, then the reboot's events tagged
// with its actor ID, and the stream breaks when the machine goes down;
// after the boot a new watch sees the machine Running and ready.
func TestEvents(t *testing.T) {
	f := start(t, fleetSpec(t, 1, 1))
	w := f.Machines()[1]
	c := talos(t, f)
	ctx, cancel := timeout()
	defer cancel()
	ch := make(chan client.EventResult, 100)
	if err := c.EventsWatchV2(on(w), ch, client.WithTailEvents(-1)); err != nil {
		t.Fatal(err)
	}
	before := w.BootID()
	resp, err := c.RebootWithResponse(client.WithNode(ctx, w.Address()), client.WithPowerCycle)
	if err != nil {
		t.Fatal(err)
	}
	actor := resp.Messages[0].ActorId
	var sawSequence, sawStop bool
	for done := false; !done; {
		select {
		case ev := <-ch:
			if ev.Error != nil {
				if client.StatusCode(errors.Unwrap(ev.Error)) != codes.Unavailable && !strings.Contains(ev.Error.Error(), "Unavailable") {
					t.Fatalf("the watch ended with %v, want Unavailable", ev.Error)
				}
				done = true
				continue
			}
			switch p := ev.Event.Payload.(type) {
			case *machine.SequenceEvent:
				sawSequence = sawSequence || p.Sequence == "reboot" && ev.Event.ActorID == actor
			case *machine.TaskEvent:
				sawStop = sawStop || p.Task == "stopAllServices"
			}
		case <-ctx.Done():
			t.Fatal("no end of the event stream")
		}
	}
	if !sawSequence || !sawStop {
		t.Fatalf("reboot sequence event with actor %s: %v, stopAllServices: %v", actor, sawSequence, sawStop)
	}
	waitRebooted(t, w, before)

	ch = make(chan client.EventResult, 100)
	if err := c.EventsWatchV2(client.WithNode(ctx, w.Address()), ch, client.WithTailEvents(-1)); err != nil {
		t.Fatal(err)
	}
	for {
		var ev client.EventResult
		select {
		case ev = <-ch:
		case <-ctx.Done():
			t.Fatal("no MachineStatusEvent RUNNING ready after the boot")
		}
		if ev.Error != nil {
			t.Fatal(ev.Error)
		}
		if p, ok := ev.Event.Payload.(*machine.MachineStatusEvent); ok && p.Stage == machine.MachineStatusEvent_RUNNING && p.Status.Ready {
			break
		}
	}
}

// TestShutdownPowerOn: a shutdown drains (cordoning as Talos does), goes
// down and stays off until PowerOn; then the machine is back, uncordoned.
func TestShutdownPowerOn(t *testing.T) {
	f := start(t, fleetSpec(t, 1, 1))
	w := f.Machines()[1]
	c := talos(t, f)
	before := w.BootID()
	if err := c.Shutdown(on(w)); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 30*time.Second, "the machine off", func(context.Context) (bool, error) { return w.Off(), nil })
	waitNodeReady(t, w, false)
	if n := node(t, w); !n.Spec.Unschedulable || n.Annotations["talos.dev/cordoned"] != "true" {
		t.Fatalf("a shutting down machine's Node is cordoned by Talos; got unschedulable=%v annotations=%v", n.Spec.Unschedulable, n.Annotations)
	}
	_, err := version(t, c, w)
	wantCode(t, err, codes.Unavailable, "")
	if err := f.Machine(f.ControlPlanes()[0].Name()).PowerOn(); err == nil {
		t.Fatal("PowerOn of a running machine must fail")
	}
	if err := w.PowerOn(); err != nil {
		t.Fatal(err)
	}
	waitRebooted(t, w, before)
	waitNodeReady(t, w, true)
	if n := node(t, w); n.Spec.Unschedulable {
		t.Fatal("Talos uncordons the Node it cordoned")
	}
	acts := f.Recorder().Actions(w.Name())
	if len(acts) != 1 || acts[0].Kind != sim.ActionShutdown || acts[0].End.IsZero() || acts[0].Down.IsZero() ||
		acts[0].Down.Before(acts[0].Start) || acts[0].End.Before(acts[0].Down) {
		t.Fatalf("actions %+v", acts)
	}
}

// TestReset: a reset with reboot comes back with a new boot ID, without
// reboot it stays off; bad wipe requests are refused as Talos refuses them.
func TestReset(t *testing.T) {
	f := start(t, fleetSpec(t, 1, 2))
	w1, w2 := f.Machines()[1], f.Machines()[2]
	c := talos(t, f)
	ctx, cancel := timeout()
	defer cancel()
	for _, tc := range []struct {
		req  *machine.ResetRequest
		want string
	}{
		{&machine.ResetRequest{Mode: machine.ResetRequest_SYSTEM_DISK, UserDisksToWipe: []string{"/dev/vdb"}}, "SYSTEM_DISK doesn't support UserDisksToWipe"},
		{&machine.ResetRequest{Mode: machine.ResetRequest_USER_DISKS, SystemPartitionsToWipe: []*machine.ResetPartitionSpec{{Label: "EPHEMERAL", Wipe: true}}}, "USER_DISKS doesn't support SystemPartitionsToWipe"},
		{&machine.ResetRequest{UserDisksToWipe: []string{"/dev/vda"}}, "is the system disk"},
		{&machine.ResetRequest{SystemPartitionsToWipe: []*machine.ResetPartitionSpec{{Label: "NOPE", Wipe: true}}}, `label "NOPE"`},
	} {
		err := c.ResetGeneric(client.WithNode(ctx, w1.Address()), tc.req)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("reset %v: got %v, want %q", tc.req, err, tc.want)
		}
	}
	if w1.Down() || len(f.Recorder().Actions("")) != 0 {
		t.Fatal("a refused reset changed something")
	}

	before := w1.BootID()
	if err := c.ResetGeneric(client.WithNode(ctx, w1.Address()), &machine.ResetRequest{
		Graceful: true, Reboot: true,
		SystemPartitionsToWipe: []*machine.ResetPartitionSpec{{Label: "EPHEMERAL", Wipe: true}},
	}); err != nil {
		t.Fatal(err)
	}
	waitRebooted(t, w1, before)

	if err := c.ResetGeneric(client.WithNode(ctx, w2.Address()), &machine.ResetRequest{Graceful: false, Reboot: false}); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 30*time.Second, "the reset machine off", func(context.Context) (bool, error) { return w2.Off(), nil })
}

// TestSequenceTakeOver: while a reset runs the machine answers in stage
// resetting; a second Reset is answered but starts nothing (a NOOP
// SequenceEvent with the LOCKED error), as Talos's sequencer drops it; a
// Reboot takes the reset over.
func TestSequenceTakeOver(t *testing.T) {
	spec := fleetSpec(t, 1, 1)
	// The machine stops for long enough to be asked again while it does.
	spec.Durations.Stop = 3 * time.Second
	f := start(t, spec)
	w := f.Machines()[1]
	c := talos(t, f)
	ctx, cancel := timeout()
	defer cancel()
	ch := make(chan client.EventResult, 100)
	if err := c.EventsWatchV2(on(w), ch, client.WithTailEvents(-1)); err != nil {
		t.Fatal(err)
	}
	before := w.BootID()
	reset := &machine.ResetRequest{Reboot: true, SystemPartitionsToWipe: []*machine.ResetPartitionSpec{{Label: "EPHEMERAL", Wipe: true}}}
	if err := c.ResetGeneric(on(w), reset); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 30*time.Second, "stage resetting", func(ctx context.Context) (bool, error) {
		ms, err := safe.StateGetByID[*runtime.MachineStatus](on(w), c.COSI, runtime.MachineStatusID)
		return err == nil && ms.TypedSpec().Stage == runtime.MachineStageResetting, nil
	})
	if err := c.ResetGeneric(on(w), reset); err != nil {
		t.Fatalf("a second reset while one runs: %v, want an answer", err)
	}
	for locked := false; !locked; {
		select {
		case ev := <-ch:
			if ev.Error != nil {
				t.Fatalf("event stream: %v", ev.Error)
			}
			if p, ok := ev.Event.Payload.(*machine.SequenceEvent); ok && p.Sequence == "reset" && p.Action == machine.SequenceEvent_NOOP {
				locked = p.Error.GetCode() == common.Code_LOCKED
			}
		case <-ctx.Done():
			t.Fatal("no NOOP SequenceEvent for the second reset")
		}
	}
	if err := c.Reboot(on(w)); err != nil {
		t.Fatal(err)
	}
	waitRebooted(t, w, before)
	var kinds []sim.ActionKind
	for _, a := range f.Recorder().Actions(w.Name()) {
		kinds = append(kinds, a.Kind)
	}
	if len(kinds) != 2 || kinds[0] != sim.ActionReset || kinds[1] != sim.ActionReboot {
		t.Errorf("actions %v, want one reset taken over by a reboot", kinds)
	}
}

const newSchematic = "b8e8fbbe1b520989e6c52c8dc8303070cb42095997e76e812fa8892393e1d176"

// TestLegacyUpgrade: a 1.12 host takes MachineService.Upgrade, installs,
// reboots by itself and comes back on the new version and schematic, on the
// Talos API, in COSI and on its Node.
func TestLegacyUpgrade(t *testing.T) {
	f := start(t, fleetSpec(t, 1, 2))
	w := f.Machines()[1]
	c := talos(t, f)
	ctx, cancel := timeout()
	defer cancel()

	_, err := c.UpgradeWithOptions(client.WithNode(ctx, w.Address()), client.WithUpgradeImage("factory.talos.dev/metal-installer/"+newSchematic+":latest"))
	if err == nil || !strings.Contains(err.Error(), "error validating installer image") {
		t.Fatalf("an installer without a version tag: got %v", err)
	}

	before := w.BootID()
	image := "factory.talos.dev/metal-installer/" + newSchematic + ":v1.13.0"
	resp, err := c.UpgradeWithOptions(client.WithNode(ctx, w.Address()), client.WithUpgradeImage(image))
	if err != nil {
		t.Fatal(err)
	}
	if resp.Messages[0].ActorId == "" || resp.Messages[0].Ack == "" {
		t.Fatalf("response %v", resp)
	}
	waitRebooted(t, w, before)
	if v, err := version(t, c, w); err != nil || v != "v1.13.0" {
		t.Fatalf("version after upgrade %q, %v", v, err)
	}
	if w.Schematic() != newSchematic || w.Image() != image {
		t.Fatalf("schematic %q image %q", w.Schematic(), w.Image())
	}
	exts, err := safe.StateListAll[*runtime.ExtensionStatus](client.WithNode(ctx, w.Address()), c.COSI)
	if err != nil || exts.Len() != 1 || exts.Get(0).TypedSpec().Metadata.Version != newSchematic {
		t.Fatalf("schematic extension after upgrade: %v, %v", exts, err)
	}
	testenv.Eventually(t, 30*time.Second, "the Node on v1.13.0", func(context.Context) (bool, error) {
		n := node(t, w)
		return n.Status.NodeInfo.OSImage == "Talos (v1.13.0)" && nodeReady(n) && !n.Spec.Unschedulable, nil
	})
	if got := f.Recorder().UpgradesApplied(w.Name()); got != 1 {
		t.Fatalf("upgrades applied %d, want 1", got)
	}
	acts := f.Recorder().Actions(w.Name())
	if len(acts) != 1 || acts[0].Kind != sim.ActionUpgrade {
		t.Fatalf("actions %+v", acts)
	}

	// A staged upgrade reboots and installs during the reboot.
	w2 := f.Machines()[2]
	before = w2.BootID()
	if _, err := c.UpgradeWithOptions(client.WithNode(ctx, w2.Address()), client.WithUpgradeImage(image), client.WithUpgradeStage(true)); err != nil {
		t.Fatal(err)
	}
	waitRebooted(t, w2, before)
	if v, err := version(t, c, w2); err != nil || v != "v1.13.0" {
		t.Fatalf("version after a staged upgrade %q, %v", v, err)
	}
}

// TestImageBasedUpgrade: on 1.13 the upgrade is Pull, LifecycleService
// Upgrade (exit code, EOF, no reboot: the version changes only at the next
// boot), then Reboot. Below 1.13 both services are Unimplemented.
func TestImageBasedUpgrade(t *testing.T) {
	spec := fleetSpec(t, 1, 2)
	spec.Machines[1].Talos = "v1.13.0"
	f := start(t, spec)
	w, old := f.Machines()[1], f.Machines()[2]
	c := talos(t, f)
	ctx, cancel := timeout()
	defer cancel()
	ci := &common.ContainerdInstance{Driver: common.ContainerDriver_CRI, Namespace: common.ContainerdNamespace_NS_SYSTEM}
	image := "factory.talos.dev/metal-installer/" + sim.EmptySchematic + ":v1.13.2"

	// Below 1.13: no such services.
	_, err := pull(client.WithNode(ctx, old.Address()), c, ci, image)
	wantCode(t, err, codes.Unimplemented, "unknown service machine.ImageService")
	_, err = lifecycleUpgrade(client.WithNode(ctx, old.Address()), c, ci, image)
	wantCode(t, err, codes.Unimplemented, "unknown service machine.LifecycleService")

	nctx := client.WithNode(ctx, w.Address())
	_, err = lifecycleUpgrade(nctx, c, ci, image)
	wantCode(t, err, codes.Internal, "not found in containerd store")
	_, err = pull(nctx, c, ci, "ghcr.io/siderolabs/installer:latest")
	wantCode(t, err, codes.NotFound, "")

	name, err := pull(nctx, c, ci, image)
	if err != nil || !strings.Contains(name, "@sha256:") {
		t.Fatalf("pull: %q, %v", name, err)
	}
	// Pulled into CRI/system, it is not in another containerd instance.
	_, err = lifecycleUpgrade(nctx, c, &common.ContainerdInstance{Driver: common.ContainerDriver_CONTAINERD, Namespace: common.ContainerdNamespace_NS_SYSTEM}, image)
	wantCode(t, err, codes.Internal, "not found in containerd store")

	before := w.BootID()
	code, err := lifecycleUpgrade(nctx, c, ci, name)
	if err != nil || code != 0 {
		t.Fatalf("upgrade: exit code %d, %v", code, err)
	}
	if w.Version() != "v1.13.0" || w.BootID() != before || w.Down() || w.NextVersion() != "v1.13.2" {
		t.Fatalf("after install: version %s (next %s), down %v, boot ID changed %v", w.Version(), w.NextVersion(), w.Down(), w.BootID() != before)
	}
	if v, _ := version(t, c, w); v != "v1.13.0" {
		t.Fatalf("the API reports %s before the reboot", v)
	}
	if err := c.Reboot(nctx); err != nil {
		t.Fatal(err)
	}
	waitRebooted(t, w, before)
	if v, err := version(t, c, w); err != nil || v != "v1.13.2" {
		t.Fatalf("version after reboot %q, %v", v, err)
	}
	testenv.Eventually(t, 30*time.Second, "the Node on v1.13.2", func(context.Context) (bool, error) {
		return node(t, w).Status.NodeInfo.OSImage == "Talos (v1.13.2)", nil
	})

	// The installer refuses a target that does not accept the host: exit code 1.
	old10 := "factory.talos.dev/metal-installer/" + sim.EmptySchematic + ":v1.10.0"
	if _, err := pull(nctx, c, ci, old10); err != nil {
		t.Fatal(err)
	}
	code, err = lifecycleUpgrade(nctx, c, ci, old10)
	if err != nil || code != 1 || w.NextVersion() != "v1.13.2" {
		t.Fatalf("a refused install: exit code %d, %v, next %s", code, err, w.NextVersion())
	}
	acts := f.Recorder().Actions(w.Name())
	kinds := []sim.ActionKind{}
	for _, a := range acts {
		kinds = append(kinds, a.Kind)
	}
	if len(kinds) != 3 || kinds[0] != sim.ActionInstall || kinds[1] != sim.ActionReboot || kinds[2] != sim.ActionInstall {
		t.Fatalf("actions %v, want install, reboot, install", kinds)
	}
}

// TestInstallInProgress: a second install while one runs is refused.
func TestInstallInProgress(t *testing.T) {
	spec := fleetSpec(t, 1, 1)
	spec.Machines[1].Talos = "v1.13.0"
	spec.Durations.Install = time.Hour // the first install runs until the test cancels it
	f := start(t, spec)
	w := f.Machines()[1]
	c := talos(t, f)
	ctx, cancel := timeout()
	defer cancel()
	ci := &common.ContainerdInstance{Driver: common.ContainerDriver_CRI, Namespace: common.ContainerdNamespace_NS_SYSTEM}
	image := "ghcr.io/siderolabs/installer:v1.13.2"
	nctx := client.WithNode(ctx, w.Address())
	if _, err := pull(nctx, c, ci, image); err != nil {
		t.Fatal(err)
	}
	first, stop := context.WithCancel(nctx)
	s, err := c.LifecycleClient.Upgrade(first, &machine.LifecycleServiceUpgradeRequest{Containerd: ci, Source: &machine.InstallArtifactsSource{ImageName: image}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Recv(); err != nil { // the installer has started
		t.Fatal(err)
	}
	_, err = lifecycleUpgrade(nctx, c, ci, image)
	wantCode(t, err, codes.FailedPrecondition, "already in progress")
	stop()
	if w.NextVersion() != "v1.13.0" {
		t.Fatal("a cancelled install changed the next version")
	}
}

func pull(ctx context.Context, c *client.Client, ci *common.ContainerdInstance, ref string) (string, error) {
	s, err := c.ImageClient.Pull(ctx, &machine.ImageServicePullRequest{Containerd: ci, ImageRef: ref})
	if err != nil {
		return "", err
	}
	name := ""
	for {
		msg, err := s.Recv()
		if err == io.EOF {
			return name, nil
		}
		if err != nil {
			return "", err
		}
		if n := msg.GetName(); n != "" {
			name = n
		}
	}
}

// lifecycleUpgrade runs LifecycleService.Upgrade to its end: the exit code
// message, then EOF.
func lifecycleUpgrade(ctx context.Context, c *client.Client, ci *common.ContainerdInstance, image string) (int32, error) {
	s, err := c.LifecycleClient.Upgrade(ctx, &machine.LifecycleServiceUpgradeRequest{Containerd: ci, Source: &machine.InstallArtifactsSource{ImageName: image}})
	if err != nil {
		return -1, err
	}
	code := int32(-1)
	for {
		msg, err := s.Recv()
		if err == io.EOF {
			if code < 0 {
				return code, errors.New("stream ended without an exit code")
			}
			return code, nil
		}
		if err != nil {
			return code, err
		}
		if code >= 0 {
			return code, errors.New("a message after the exit code")
		}
		if _, ok := msg.Progress.Response.(*machine.LifecycleServiceInstallProgress_ExitCode); ok {
			code = msg.Progress.GetExitCode()
		}
	}
}

// TestApplyConfiguration: every mode, the zero value (REBOOT), validation,
// and the kubelet restart that a kubelet image change brings.
func TestApplyConfiguration(t *testing.T) {
	f := start(t, fleetSpec(t, 1, 1))
	w := f.Machines()[1]
	c := talos(t, f)
	ctx, cancel := timeout()
	defer cancel()
	nctx := client.WithNode(ctx, w.Address())

	patch := func(fn func(*v1alpha1.Config)) []byte {
		t.Helper()
		mc, err := safe.StateGetByID[*configres.MachineConfig](nctx, c.COSI, configres.ActiveID)
		if err != nil {
			t.Fatal(err)
		}
		p, err := mc.Provider().PatchV1Alpha1(func(cfg *v1alpha1.Config) error { fn(cfg); return nil })
		if err != nil {
			t.Fatal(err)
		}
		b, err := p.EncodeBytes()
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	apply := func(data []byte, mode machine.ApplyConfigurationRequest_Mode, try time.Duration) (*machine.ApplyConfigurationResponse, error) {
		req := &machine.ApplyConfigurationRequest{Data: data, Mode: mode}
		if try > 0 {
			req.TryModeTimeout = durationpb.New(try)
		}
		return c.ApplyConfiguration(nctx, req)
	}
	kubelet := func(v string) func(*v1alpha1.Config) {
		return func(cfg *v1alpha1.Config) {
			cfg.MachineConfig.MachineKubelet.KubeletImage = "ghcr.io/siderolabs/kubelet:v" + v
		}
	}
	env := func(cfg *v1alpha1.Config) { cfg.MachineConfig.MachineEnv = map[string]string{"SIM": "1"} }

	// Refusals change nothing.
	_, err := apply([]byte("not: [a config"), machine.ApplyConfigurationRequest_NO_REBOOT, 0)
	wantCode(t, err, codes.InvalidArgument, "")
	_, err = apply(patch(kubelet("1.40.0")), machine.ApplyConfigurationRequest_NO_REBOOT, 0)
	wantCode(t, err, codes.InvalidArgument, "kubelet image is not valid")
	_, err = apply(patch(env), machine.ApplyConfigurationRequest_NO_REBOOT, 0)
	wantCode(t, err, codes.InvalidArgument, "can't be applied in immediate mode")
	reader := talos(t, f, role.Reader)
	_, err = reader.ApplyConfiguration(nctx, &machine.ApplyConfigurationRequest{Data: patch(kubelet("1.35.2")), Mode: machine.ApplyConfigurationRequest_NO_REBOOT})
	wantCode(t, err, codes.PermissionDenied, "")
	resp, err := c.ApplyConfiguration(nctx, &machine.ApplyConfigurationRequest{Data: patch(kubelet("1.35.2")), Mode: machine.ApplyConfigurationRequest_NO_REBOOT, DryRun: true})
	if err != nil || !strings.Contains(resp.Messages[0].ModeDetails, "Dry run") {
		t.Fatalf("dry run: %v, %v", resp, err)
	}
	// A mode Talos does not know: a dry run answers as for REBOOT, an apply is refused.
	unknown := machine.ApplyConfigurationRequest_Mode(7)
	resp, err = c.ApplyConfiguration(nctx, &machine.ApplyConfigurationRequest{Data: patch(env), Mode: unknown, DryRun: true})
	if err != nil || !strings.Contains(resp.Messages[0].ModeDetails, "Applied configuration with a reboot (skipped in dry-run)") {
		t.Fatalf("dry run in an unknown mode: %v, %v", resp, err)
	}
	_, err = apply(patch(env), unknown, 0)
	wantCode(t, err, codes.Unknown, "incorrect mode '7' specified for the apply config call")
	if w.KubeletVersion() != "1.35.0" || w.Config().Machine().Env()["SIM"] != "" {
		t.Fatal("a refused or dry-run apply changed the configuration")
	}

	// NO_REBOOT: live, the kubelet restarts and reports its new version.
	boot := w.BootID()
	resp, err = apply(patch(kubelet("1.35.2")), machine.ApplyConfigurationRequest_NO_REBOOT, 0)
	if err != nil || resp.Messages[0].Mode != machine.ApplyConfigurationRequest_NO_REBOOT {
		t.Fatalf("no-reboot apply: %v, %v", resp, err)
	}
	testenv.Eventually(t, 30*time.Second, "the Node's kubelet v1.35.2", func(context.Context) (bool, error) {
		return node(t, w).Status.NodeInfo.KubeletVersion == "v1.35.2", nil
	})
	if w.BootID() != boot {
		t.Fatal("a no-reboot apply rebooted")
	}

	// TRY: applied, then reverted after its timeout.
	if _, err := apply(patch(kubelet("1.35.3")), machine.ApplyConfigurationRequest_TRY, 50*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 30*time.Second, "the try config reverted", func(context.Context) (bool, error) {
		return w.KubeletVersion() == "1.35.2" && node(t, w).Status.NodeInfo.KubeletVersion == "v1.35.2", nil
	})

	// STAGED: nothing now, active after the next reboot.
	resp, err = apply(patch(env), machine.ApplyConfigurationRequest_STAGED, 0)
	if err != nil || resp.Messages[0].Mode != machine.ApplyConfigurationRequest_STAGED {
		t.Fatalf("staged apply: %v, %v", resp, err)
	}
	if w.Config().RawV1Alpha1().MachineConfig.MachineEnv["SIM"] != "" {
		t.Fatal("a staged config is active before the reboot")
	}
	if err := c.Reboot(nctx); err != nil {
		t.Fatal(err)
	}
	waitRebooted(t, w, boot)
	if w.Config().RawV1Alpha1().MachineConfig.MachineEnv["SIM"] != "1" {
		t.Fatal("the staged config is not active after the reboot")
	}

	// AUTO picks REBOOT for a change that needs one.
	boot = w.BootID()
	resp, err = apply(patch(func(cfg *v1alpha1.Config) { cfg.MachineConfig.MachineEnv = map[string]string{"SIM": "2"} }), machine.ApplyConfigurationRequest_AUTO, 0)
	if err != nil || resp.Messages[0].Mode != machine.ApplyConfigurationRequest_REBOOT {
		t.Fatalf("auto apply: %v, %v", resp, err)
	}
	waitRebooted(t, w, boot)

	// The zero value is REBOOT.
	boot = w.BootID()
	resp, err = c.ApplyConfiguration(nctx, &machine.ApplyConfigurationRequest{Data: patch(kubelet("1.35.4"))})
	if err != nil || resp.Messages[0].Mode != machine.ApplyConfigurationRequest_REBOOT {
		t.Fatalf("default-mode apply: %v, %v", resp, err)
	}
	waitRebooted(t, w, boot)
	if w.KubeletVersion() != "1.35.4" {
		t.Fatalf("kubelet %s after the reboot", w.KubeletVersion())
	}
}

// TestUnpublishedInstaller: the registry lacks Spec.Unpublished versions; a
// pull of their installer is NotFound through ImageService and through the
// deprecated ImagePull (as Talos answers containerd's not-found), while a
// published version pulls, and into the CRI containerd for ImagePull.
func TestUnpublishedInstaller(t *testing.T) {
	spec := fleetSpec(t, 1, 1)
	spec.Unpublished = []string{"v1.13.70"}
	spec.Machines[1].Talos = "v1.13.0"
	f := start(t, spec)
	w := f.Machines()[1]
	c := talos(t, f)
	ctx, cancel := timeout()
	defer cancel()
	nctx := client.WithNode(ctx, w.Address())
	ci := &common.ContainerdInstance{Driver: common.ContainerDriver_CRI, Namespace: common.ContainerdNamespace_NS_SYSTEM}
	installer := func(v string) string { return "factory.talos.dev/metal-installer/" + sim.EmptySchematic + ":" + v }
	tests := []struct {
		name    string
		pull    func(image string) error
		version string
		code    codes.Code
	}{
		{"ImageService unpublished", func(i string) error { _, err := pull(nctx, c, ci, i); return err }, "v1.13.70", codes.NotFound},
		{"ImageService published", func(i string) error { _, err := pull(nctx, c, ci, i); return err }, "v1.13.7", codes.OK},
		{"ImagePull unpublished", func(i string) error { return c.ImagePull(nctx, common.ContainerdNamespace_NS_SYSTEM, i) }, "v1.13.70", codes.NotFound},
		{"ImagePull published", func(i string) error { return c.ImagePull(nctx, common.ContainerdNamespace_NS_SYSTEM, i) }, "v1.13.6", codes.OK},
		{"ImagePull without a namespace", func(i string) error { return c.ImagePull(nctx, common.ContainerdNamespace_NS_UNKNOWN, i) }, "v1.13.6", codes.InvalidArgument},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.pull(installer(tt.version))
			if got := status.Code(err); got != tt.code {
				t.Fatalf("pull %s: %v, want %s", tt.version, err, tt.code)
			}
		})
	}
	// ImagePull pulls into the CRI containerd, where LifecycleService finds it.
	if code, err := lifecycleUpgrade(nctx, c, ci, installer("v1.13.6")); err != nil || code != 0 {
		t.Fatalf("install after ImagePull: exit code %d, %v", code, err)
	}
}

// TestAnswerBeforeGoingDown: a machine answers a Reboot, then goes down
// (Talos runs the sequence after the call returns); its answer reaches the
// caller even when the machine goes down at once, through its own endpoint,
// which closes with it.
func TestAnswerBeforeGoingDown(t *testing.T) {
	spec := fleetSpec(t, 1, 0)
	spec.Durations.Stop = time.Nanosecond
	f := start(t, spec)
	cp := f.ControlPlanes()[0]
	c := talos(t, f)
	for i := range 10 {
		before := cp.BootID()
		if _, err := c.RebootWithResponse(on(cp)); err != nil {
			t.Fatalf("reboot %d: %v", i+1, err)
		}
		waitRebooted(t, cp, before)
	}
}
