package sim_test

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/siderolabs/talos/pkg/machinery/api/machine"
	"github.com/siderolabs/talos/pkg/machinery/client"
	"google.golang.org/grpc/codes"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"

	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

func TestParseFaults(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want []sim.Fault
		err  string
	}{
		{in: "", want: nil},
		{in: "error:Reboot", want: []sim.Fault{{Kind: sim.FaultError, Method: "Reboot"}}},
		{in: "error:LifecycleService/Upgrade:Internal:once", want: []sim.Fault{{Kind: sim.FaultError, Method: "LifecycleService/Upgrade", Code: codes.Internal, Once: true}}},
		{in: "error:*:once", want: []sim.Fault{{Kind: sim.FaultError, Method: "*", Once: true}}},
		{in: "lost:Bootstrap:DeadlineExceeded:once", want: []sim.Fault{{Kind: sim.FaultLost, Method: "Bootstrap", Code: codes.DeadlineExceeded, Once: true}}},
		{in: "lost", err: "name the method, e.g. lost:Reboot"},
		{in: " hang:Upgrade , no-return,etcd-unhealthy", want: []sim.Fault{{Kind: sim.FaultHang, Method: "Upgrade"}, {Kind: sim.FaultNoReturn}, {Kind: sim.FaultEtcdUnhealthy}}},
		{in: "rollback:once,alarm:corrupt,alarm", want: []sim.Fault{{Kind: sim.FaultRollback, Once: true}, {Kind: sim.FaultEtcdAlarm, Alarm: machine.EtcdMemberAlarm_CORRUPT}, {Kind: sim.FaultEtcdAlarm}}},
		{in: "error", err: "name the method"},
		{in: "error:Reboot:Nope", err: `unknown gRPC code "Nope"`},
		{in: "hang", err: "name the method"},
		{in: "alarm:NONE", err: "NOSPACE or CORRUPT"},
		{in: "reboot-loop", err: "unknown fault"},
		{in: "no-return:now", err: "unexpected now"},
	} {
		got, err := sim.ParseFaults(tc.in)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) || !strings.Contains(err.Error(), "faults are:") {
				t.Errorf("ParseFaults(%q) error %v, want one with %q and the syntax", tc.in, err, tc.err)
			}
			continue
		}
		if err != nil || len(got) != len(tc.want) {
			t.Errorf("ParseFaults(%q) = %v, %v; want %v", tc.in, got, err, tc.want)
			continue
		}
		for i := range got {
			if got[i] != tc.want[i] {
				t.Errorf("ParseFaults(%q)[%d] = %+v, want %+v", tc.in, i, got[i], tc.want[i])
			}
			back, err := sim.ParseFaults(got[i].String())
			if err != nil || len(back) != 1 || back[0].String() != got[i].String() {
				t.Errorf("%q does not round-trip: %v, %v", got[i].String(), back, err)
			}
		}
	}
}

// TestFaultErrors: an error fault fails its method once or always, and
// nothing else; clearing it lifts it.
func TestFaultErrors(t *testing.T) {
	f := start(t, fleetSpec(t, 1, 1))
	cp, w := f.Machines()[0], f.Machines()[1]
	c := talos(t, f)
	ctx, cancel := timeout()
	defer cancel()

	if _, err := w.InjectString("error:Version:ResourceExhausted:once"); err != nil {
		t.Fatal(err)
	}
	_, err := version(t, c, w)
	wantCode(t, err, codes.ResourceExhausted, "simulated fault")
	if _, err := version(t, c, w); err != nil {
		t.Fatalf("a once-fault fired twice: %v", err)
	}
	if _, err := version(t, c, cp); err != nil {
		t.Fatalf("a fault on %s failed %s: %v", w.Name(), cp.Name(), err)
	}

	clear, err := cp.InjectString("error:MachineService/EtcdStatus")
	if err != nil {
		t.Fatal(err)
	}
	for range 2 {
		_, err := c.EtcdStatus(client.WithNode(ctx, cp.Address()))
		wantCode(t, err, codes.Unavailable, "simulated fault")
	}
	if len(cp.Faults()) != 1 {
		t.Fatalf("faults %v", cp.Faults())
	}
	if _, err := c.EtcdMemberList(client.WithNode(ctx, cp.Address()), &machine.EtcdMemberListRequest{}); err != nil {
		t.Fatalf("a fault on EtcdStatus failed EtcdMemberList: %v", err)
	}
	clear()
	if _, err := c.EtcdStatus(client.WithNode(ctx, cp.Address())); err != nil || len(cp.Faults()) != 0 {
		t.Fatalf("after clear: %v, faults %v", err, cp.Faults())
	}
	if _, err := w.InjectString("hang:"); err == nil {
		t.Fatal("a bad fault string must be refused")
	}
}

// TestFaultLost: a call whose answer a lost fault takes away has taken
// effect all the same (the machine rebooted), and the caller got the
// fault's code; once fired, the next call answers.
func TestFaultLost(t *testing.T) {
	f := start(t, fleetSpec(t, 1, 1))
	w := f.Machines()[1]
	c := talos(t, f)
	ctx, cancel := timeout()
	defer cancel()
	if _, err := w.InjectString("lost:Reboot:once"); err != nil {
		t.Fatal(err)
	}
	before := w.BootID()
	err := c.Reboot(client.WithNode(ctx, w.Address()))
	wantCode(t, err, codes.Unavailable, "simulated fault lost:Reboot")
	waitRebooted(t, w, before)
	if _, err := version(t, c, w); err != nil {
		t.Fatalf("after its lost answer, %s does not answer: %v", w.Name(), err)
	}
}

// TestFaultHang: a hung call returns once the fault is cleared.
func TestFaultHang(t *testing.T) {
	f := start(t, fleetSpec(t, 1, 1))
	w := f.Machines()[1]
	c := talos(t, f)
	release := w.Inject(sim.Fault{Kind: sim.FaultHang, Method: "Reboot"})
	done := make(chan error, 1)
	before := w.BootID()
	go func() { done <- c.Reboot(on(w)) }()
	testenv.Eventually(t, 30*time.Second, "the Reboot call to arrive", func(context.Context) (bool, error) {
		return f.Recorder().Calls(w.Name(), "Reboot") == 1, nil
	})
	select {
	case err := <-done:
		t.Fatalf("the hung call returned: %v", err)
	default:
	}
	release()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	waitRebooted(t, w, before)
}

// TestFaultRollback: with a rollback fault the new version does not boot:
// the machine comes back (new boot ID) on the old one.
func TestFaultRollback(t *testing.T) {
	f := start(t, fleetSpec(t, 1, 1))
	w := f.Machines()[1]
	c := talos(t, f)
	w.Inject(sim.Fault{Kind: sim.FaultRollback, Once: true})
	for i, want := range []string{"v1.12.4", "v1.13.0"} {
		before := w.BootID()
		if _, err := c.UpgradeWithOptions(on(w), client.WithUpgradeImage("ghcr.io/siderolabs/installer:v1.13.0")); err != nil {
			t.Fatal(err)
		}
		waitRebooted(t, w, before)
		if v, err := version(t, c, w); err != nil || v != want || w.NextVersion() != want {
			t.Fatalf("upgrade %d: version %q (next %s), %v; want %s", i, v, w.NextVersion(), err, want)
		}
		if got := f.Recorder().UpgradesApplied(w.Name()); got != i {
			t.Fatalf("upgrade %d: %d applied", i, got)
		}
	}
	// Only the boot that took effect is an upgrade, on the version it booted.
	if ups := f.Recorder().Upgrades(""); len(ups) != 1 || ups[0].Machine != w.Name() || ups[0].Version != "v1.13.0" {
		t.Fatalf("upgrades %+v", ups)
	}
}

// TestFaultAnnotation: faults set on the Node from outside take effect and
// clear with the annotation; a bad one changes nothing and says why in an
// Event on the Node.
func TestFaultAnnotation(t *testing.T) {
	f := start(t, fleetSpec(t, 1, 1))
	cp, w := f.Machines()[0], f.Machines()[1]
	c := talos(t, f)
	ctx, cancel := timeout()
	defer cancel()
	annotate := func(m *sim.Machine, value *string) {
		t.Helper()
		patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": map[string]any{sim.FaultAnnotation: value}}})
		if _, err := env.Kube.CoreV1().Nodes().Patch(ctx, m.Name(), types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	str := func(s string) *string { return &s }

	annotate(w, str("error:Version:Unavailable"))
	testenv.Eventually(t, 30*time.Second, "the annotated fault", func(context.Context) (bool, error) {
		_, err := version(t, c, w)
		return client.StatusCode(err) == codes.Unavailable && strings.Contains(err.Error(), "simulated fault"), nil
	})
	annotate(w, str("error:Version:Bogus"))
	testenv.Eventually(t, 30*time.Second, "a Warning Event about the bad annotation", func(ctx context.Context) (bool, error) {
		evs, err := env.Kube.CoreV1().Events(metav1.NamespaceDefault).List(ctx, metav1.ListOptions{
			FieldSelector: fields.SelectorFromSet(fields.Set{"involvedObject.name": w.Name(), "reason": "InvalidFault"}).String(),
		})
		return err == nil && len(evs.Items) > 0 && evs.Items[0].Type == corev1.EventTypeWarning &&
			strings.Contains(evs.Items[0].Message, "Bogus"), err
	})
	if _, err := version(t, c, w); client.StatusCode(err) != codes.Unavailable {
		t.Fatalf("a bad annotation must leave the faults as they were; Version: %v", err)
	}
	annotate(w, nil)
	testenv.Eventually(t, 30*time.Second, "the fault gone with the annotation", func(context.Context) (bool, error) {
		_, err := version(t, c, w)
		return err == nil, nil
	})

	// no-return: the machine stays down until the annotation goes.
	annotate(w, str("no-return"))
	testenv.Eventually(t, 30*time.Second, "the fault set", func(context.Context) (bool, error) { return len(w.Faults()) == 1, nil })
	before := w.BootID()
	if err := c.Reboot(on(w)); err != nil {
		t.Fatal(err)
	}
	waitNodeReady(t, w, false)
	if !w.Down() {
		t.Fatal("not down")
	}
	annotate(w, nil)
	waitRebooted(t, w, before)
	waitNodeReady(t, w, true)

	// An etcd alarm raised and cleared from outside.
	annotate(cp, str("alarm:CORRUPT"))
	testenv.Eventually(t, 30*time.Second, "the CORRUPT alarm", func(context.Context) (bool, error) {
		resp, err := c.EtcdAlarmList(client.WithNode(ctx, cp.Address()))
		return err == nil && len(resp.Messages[0].MemberAlarms) == 1 && resp.Messages[0].MemberAlarms[0].Alarm == machine.EtcdMemberAlarm_CORRUPT, err
	})
	annotate(cp, nil)
	testenv.Eventually(t, 30*time.Second, "no alarm", func(context.Context) (bool, error) {
		resp, err := c.EtcdAlarmList(client.WithNode(ctx, cp.Address()))
		return err == nil && len(resp.Messages[0].MemberAlarms) == 0, err
	})
}
