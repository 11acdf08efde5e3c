package operation_test

import (
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/utils/ptr"

	ichorv1 "maesh.dev/ichor/api/v1alpha1"
	"maesh.dev/ichor/sim"
)

func nodeSpec(machine string, action ichorv1.NodeActionType) ichorv1.TalosOperationSpec {
	return ichorv1.TalosOperationSpec{Kind: ichorv1.KindNode, Node: &ichorv1.NodeAction{Machine: machine, Action: action}}
}

// TestNodeActions runs each node action against a fleet and checks the
// machine did what was asked, verified as the executor verifies it.
func TestNodeActions(t *testing.T) {
	cp := func(f *sim.Fleet, i int) *sim.Machine { return f.ControlPlanes()[i] }
	worker := func(f *sim.Fleet) *sim.Machine { return f.Machines()[len(f.Machines())-1] }
	tests := []struct {
		name  string
		spec  func(f *sim.Fleet) ichorv1.TalosOperationSpec
		check func(t *testing.T, c *cluster, before map[string]string)
	}{
		{"reboot a worker", func(f *sim.Fleet) ichorv1.TalosOperationSpec { return nodeSpec(worker(f).Name(), ichorv1.NodeReboot) },
			func(t *testing.T, c *cluster, before map[string]string) {
				w := worker(c.fleet)
				if w.BootID() == before[w.Name()] || c.fleet.Recorder().Calls(w.Name(), "Reboot") != 1 {
					t.Errorf("%s: boot ID %s (was %s), %d reboots", w.Name(), w.BootID(), before[w.Name()], c.fleet.Recorder().Calls(w.Name(), "Reboot"))
				}
			}},
		{"reboot a control plane after the etcd check", func(f *sim.Fleet) ichorv1.TalosOperationSpec { return nodeSpec(cp(f, 1).Name(), ichorv1.NodeReboot) },
			func(t *testing.T, c *cluster, before map[string]string) {
				m := cp(c.fleet, 1)
				if m.BootID() == before[m.Name()] || c.fleet.Recorder().Calls("", "EtcdMemberList") == 0 {
					t.Errorf("%s rebooted without the etcd check, or not at all", m.Name())
				}
			}},
		{"shutdown", func(f *sim.Fleet) ichorv1.TalosOperationSpec { return nodeSpec(worker(f).Name(), ichorv1.NodeShutdown) },
			func(t *testing.T, c *cluster, _ map[string]string) {
				if !worker(c.fleet).Off() {
					t.Errorf("%s is not off", worker(c.fleet).Name())
				}
			}},
		{"restart kubelet", func(f *sim.Fleet) ichorv1.TalosOperationSpec {
			s := nodeSpec(worker(f).Name(), ichorv1.NodeRestartService)
			s.Node.Service = "kubelet"
			return s
		}, func(t *testing.T, c *cluster, _ map[string]string) {
			if n := c.fleet.Recorder().Calls(worker(c.fleet).Name(), "ServiceRestart"); n != 1 {
				t.Errorf("%d ServiceRestart calls", n)
			}
		}},
		{"restart an extension service", func(f *sim.Fleet) ichorv1.TalosOperationSpec {
			s := nodeSpec(worker(f).Name(), ichorv1.NodeRestartService)
			s.Node.Service = "ext-iscsid"
			return s
		}, func(t *testing.T, c *cluster, _ map[string]string) {
			if n := c.fleet.Recorder().Calls(worker(c.fleet).Name(), "ServiceRestart"); n != 1 {
				t.Errorf("%d ServiceRestart calls", n)
			}
		}},
		{"etcd defragment", func(f *sim.Fleet) ichorv1.TalosOperationSpec {
			return nodeSpec(cp(f, 2).Name(), ichorv1.NodeEtcdDefrag)
		},
			func(t *testing.T, c *cluster, _ map[string]string) {
				if n := c.fleet.Recorder().Calls(cp(c.fleet, 2).Name(), "EtcdDefragment"); n != 1 {
					t.Errorf("%d EtcdDefragment calls", n)
				}
			}},
		{"etcd forfeit leadership", func(f *sim.Fleet) ichorv1.TalosOperationSpec {
			return nodeSpec(f.Etcd().Leader, ichorv1.NodeEtcdForfeitLeadership)
		}, func(t *testing.T, c *cluster, before map[string]string) {
			if l := c.fleet.Etcd().Leader; l == "" || l == before["leader"] {
				t.Errorf("etcd leader %q, was %q", l, before["leader"])
			}
		}},
		{"reset a worker", func(f *sim.Fleet) ichorv1.TalosOperationSpec {
			s := nodeSpec(worker(f).Name(), ichorv1.NodeReset)
			s.Node.Reset = &ichorv1.ResetOptions{Wipe: ichorv1.WipeEphemeral, Graceful: ptr.To(true)}
			return s
		}, func(t *testing.T, c *cluster, _ map[string]string) {
			if n := c.fleet.Recorder().Calls(worker(c.fleet).Name(), "Reset"); n != 1 || !worker(c.fleet).Off() {
				t.Errorf("%d Reset calls, off %v", n, worker(c.fleet).Off())
			}
		}},
		{"reset a control plane", func(f *sim.Fleet) ichorv1.TalosOperationSpec { return nodeSpec(cp(f, 2).Name(), ichorv1.NodeReset) },
			func(t *testing.T, c *cluster, _ map[string]string) {
				if n := len(c.fleet.Etcd().Members); n != 2 {
					t.Errorf("a graceful reset of a control plane leaves etcd; %d members remain", n)
				}
			}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			spec := sim.Cluster("", 3, 1)
			spec.Machines[3].ExtensionServices = []string{"ext-iscsid"}
			c := newCluster(t, spec)
			c.start()
			before := map[string]string{"leader": c.fleet.Etcd().Leader}
			for _, m := range c.fleet.Machines() {
				before[m.Name()] = m.BootID()
			}
			c.create("action", tt.spec(c.fleet))
			op := c.waitSucceeded("action", time.Minute)
			tt.check(t, c, before)
			if len(op.Status.Machines) != 1 || op.Status.Machines[0].Phase != ichorv1.MachineSucceeded {
				t.Errorf("machines: %+v", op.Status.Machines)
			}
		})
	}
}

// TestNodeActionRefusals: actions that make no sense on the machine are
// Refused with a clear message, and the machine is not touched.
func TestNodeActionRefusals(t *testing.T) {
	tests := []struct {
		name          string
		controlPlanes int
		spec          func(f *sim.Fleet) ichorv1.TalosOperationSpec
		check, want   string
	}{
		{"etcd defragment on a worker", 1, func(f *sim.Fleet) ichorv1.TalosOperationSpec {
			return nodeSpec(f.Machines()[1].Name(), ichorv1.NodeEtcdDefrag)
		}, "ActionAllowed", "is a worker: etcd-defrag runs only on control planes"},
		{"forfeit with one member", 1, func(f *sim.Fleet) ichorv1.TalosOperationSpec {
			return nodeSpec(f.Machines()[0].Name(), ichorv1.NodeEtcdForfeitLeadership)
		}, "ActionAllowed", "etcd has 1 member(s): there is no other member to forfeit leadership to"},
		{"restart etcd", 1, func(f *sim.Fleet) ichorv1.TalosOperationSpec {
			s := nodeSpec(f.Machines()[0].Name(), ichorv1.NodeRestartService)
			s.Node.Service = "etcd"
			return s
		}, "ActionAllowed", `service "etcd" cannot be restarted through the Talos API`},
		{"a machine that does not exist", 1, func(*sim.Fleet) ichorv1.TalosOperationSpec {
			return nodeSpec("nope", ichorv1.NodeReboot)
		}, "MachinesInScope", "machine nope is not a Node of this cluster"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := newCluster(t, sim.Cluster("", tt.controlPlanes, 1))
			c.start()
			c.create("action", tt.spec(c.fleet))
			op := c.waitFor("action", "to be refused", time.Minute, (*ichorv1.TalosOperation).Refused)
			cond := meta.FindStatusCondition(op.Status.Conditions, tt.check)
			if cond == nil || !strings.Contains(cond.Message, tt.want) {
				t.Errorf("condition %s = %+v, want a message with %q", tt.check, cond, tt.want)
			}
			rec := c.fleet.Recorder()
			for _, method := range []string{"Reboot", "Shutdown", "Reset", "ServiceRestart", "EtcdDefragment", "EtcdForfeitLeadership"} {
				if n := rec.Calls("", method); n != 0 {
					t.Errorf("%s called %d times on a refused operation", method, n)
				}
			}
			if h := c.lockHolder(); !h.Free() {
				t.Errorf("a refused operation holds the lock: %s", h.Holder)
			}
		})
	}
}
