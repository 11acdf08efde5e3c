package sim_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"maesh.dev/ichor/internal/testenv"
	"maesh.dev/ichor/sim"
)

// TestRecorder: calls per machine and method, machines down at once, and
// overlapping disruptive actions — what tests of the controller assert.
func TestRecorder(t *testing.T) {
	f := start(t, fleetSpec(t, 1, 2))
	cp, w1, w2 := f.Machines()[0], f.Machines()[1], f.Machines()[2]
	c := talos(t, f)
	rec := f.Recorder()

	for range 3 {
		if _, err := version(t, c, w1); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := version(t, c, w2); err != nil {
		t.Fatal(err)
	}
	if rec.Calls(w1.Name(), "Version") != 3 || rec.Calls(w2.Name(), "MachineService/Version") != 1 || rec.Calls("", "Version") != 4 || rec.Calls(w1.Name(), "Reboot") != 0 {
		t.Fatalf("calls %v", rec.CallCounts())
	}
	if got := rec.CallCounts()[w1.Name()]["MachineService/Version"]; got != 3 {
		t.Fatalf("CallCounts[%s] = %v", w1.Name(), rec.CallCounts()[w1.Name()])
	}

	// A call that a fault fails is routed (Calls) but never handled.
	clearErr := w1.Inject(sim.Fault{Kind: sim.FaultError, Method: "Version", Once: true})
	if _, err := version(t, c, w1); err == nil {
		t.Fatal("the error fault did not fire")
	}
	clearErr()
	if h := rec.Handled(w1.Name(), "Version"); len(h) != 3 || h[0].Method != "MachineService/Version" || h[0].At.IsZero() || !h[0].Accepted() || rec.Calls(w1.Name(), "Version") != 4 {
		t.Fatalf("handled %+v of %d calls; want the 3 that got through", h, rec.Calls(w1.Name(), "Version"))
	}
	if h := rec.Handled("", "Version"); len(h) != 4 {
		t.Fatalf("handled on every machine %+v", h)
	}
	// A call the machine refuses on its own terms reached it, not accepted.
	if _, err := c.ServiceRestart(on(w1), "nope"); err == nil {
		t.Fatal("an unknown service restarted")
	}
	if h := rec.Handled(w1.Name(), "ServiceRestart"); len(h) != 1 || h[0].Accepted() {
		t.Fatalf("handled %+v; want one refused ServiceRestart", h)
	}

	// Two workers down at once: seen, and their reboots overlap.
	clear1 := w1.Inject(sim.Fault{Kind: sim.FaultNoReturn})
	clear2 := w2.Inject(sim.Fault{Kind: sim.FaultNoReturn})
	b1, b2 := w1.BootID(), w2.BootID()
	for _, m := range []*sim.Machine{w1, w2} {
		if err := c.Reboot(on(m)); err != nil {
			t.Fatal(err)
		}
	}
	testenv.Eventually(t, 30*time.Second, "both workers down", func(context.Context) (bool, error) { return w1.Down() && w2.Down(), nil })
	clear1()
	clear2()
	waitRebooted(t, w1, b1)
	waitRebooted(t, w2, b2)
	if cps, ws := rec.MaxDown(); cps != 0 || ws != 2 {
		t.Fatalf("MaxDown = %d control planes, %d workers; want 0, 2", cps, ws)
	}
	if o := rec.Overlaps(); len(o) != 1 || o[0].A.Kind != sim.ActionReboot || o[0].A.Machine == o[0].B.Machine {
		t.Fatalf("overlaps %+v", o)
	}
	if o := rec.Overlaps(sim.ActionShutdown); len(o) != 0 {
		t.Fatalf("no shutdowns, yet overlaps %+v", o)
	}

	// One at a time: no overlap, one down at most.
	rec.Reset()
	if rec.Calls("", "*") != 0 || len(rec.Actions("")) != 0 || len(rec.Handled("", "*")) != 0 {
		t.Fatal("Reset kept records")
	}
	for _, m := range []*sim.Machine{cp, w1, w2} {
		before := m.BootID()
		if err := c.Reboot(on(m)); err != nil {
			t.Fatal(err)
		}
		waitRebooted(t, m, before)
	}
	if cps, ws := rec.MaxDown(); cps != 1 || ws != 1 {
		t.Fatalf("MaxDown = %d, %d; want 1, 1", cps, ws)
	}
	if o := rec.Overlaps(); len(o) != 0 {
		t.Fatalf("sequential reboots overlap: %+v", o)
	}
	acts := rec.Actions("")
	if len(acts) != 3 {
		t.Fatalf("actions %+v", acts)
	}
	for i := 1; i < len(acts); i++ {
		if acts[i].Start.Before(acts[i-1].End) {
			t.Fatalf("action %d starts before %d ends", i, i-1)
		}
	}
}

// TestSpec: bad specs are refused with every problem named; the helper
// builds what it says.
func TestSpec(t *testing.T) {
	good := sim.Cluster("prod", 3, 2)
	if len(good.Machines) != 5 || good.Machines[0].Name != "prod-cp-1" || good.Machines[3].Role != sim.Worker || good.Machines[4].Name != "prod-w-2" {
		t.Fatalf("Cluster = %+v", good.Machines)
	}
	bad := sim.Cluster("bad", 0, 2)
	bad.Machines[1].Name = bad.Machines[0].Name
	bad.Machines = append(bad.Machines,
		sim.MachineSpec{Name: "x", Role: "boss"},
		sim.MachineSpec{Name: "y", Role: sim.Worker, Talos: "one", Kubernetes: "two", ExtensionServices: []string{"iscsid"}},
	)
	_, err := sim.Start(context.Background(), bad, nil)
	if err == nil {
		t.Fatal("a bad spec started")
	}
	for _, want := range []string{"at least one control plane", "used twice", `role "boss"`, `Talos version "vone"`, `Kubernetes version "two"`, "ext-<name>"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
}

// TestTwoFleets: two fleets at once have their own addresses, listeners
// and CAs; a client of one is a stranger to the other.
func TestTwoFleets(t *testing.T) {
	a := start(t, fleetSpec(t, 1, 1))
	b := start(t, fleetSpec(t, 1, 1))
	if a.Machines()[0].Address() == b.Machines()[0].Address() || a.Endpoints()[0] == b.Endpoints()[0] {
		t.Fatalf("fleets share %s / %s", a.Machines()[0].Address(), a.Endpoints()[0])
	}
	for _, m := range append(a.Machines(), b.Machines()...) {
		if !strings.HasPrefix(m.Address(), "127.") {
			t.Fatalf("address %s outside 127.0.0.0/8", m.Address())
		}
	}
	ca := talos(t, a)
	if _, err := version(t, ca, a.Machines()[1]); err != nil {
		t.Fatal(err)
	}
	cfg := a.Talosconfig()
	cfg.Contexts[cfg.Context].Endpoints = b.Endpoints()
	cross, err := clientFor(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer cross.Close()
	if _, err := version(t, cross, b.Machines()[1]); err == nil {
		t.Fatal("fleet b accepted fleet a's client certificate")
	}
}
