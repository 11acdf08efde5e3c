package sim

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/cosi-project/runtime/pkg/state"
	cosiserver "github.com/cosi-project/runtime/pkg/state/protobuf/server"
	"github.com/google/uuid"
	"github.com/siderolabs/talos/pkg/machinery/api/common"
	"github.com/siderolabs/talos/pkg/machinery/api/machine"
	"github.com/siderolabs/talos/pkg/machinery/config"
	"github.com/siderolabs/talos/pkg/machinery/resources/runtime"
)

// Machine is one simulated machine. Its methods are safe for concurrent use.
type Machine struct {
	f       *Fleet
	spec    MachineSpec
	addr    string
	cosi    state.State
	cosiAPI *cosiserver.State
	ep      *endpoint // control planes only
	// apiServer is a control plane's kube-apiserver under Spec.Hosted.
	apiServer *apiServer
	// components are its kube-controller-manager and kube-scheduler then.
	components components

	// applyMu serialises ApplyConfiguration as Talos does (TryLock).
	applyMu sync.Mutex
	// renderMu serialises rendering the resources Talos's controllers
	// derive from the configuration (static pods, manifests).
	renderMu sync.Mutex
	// secretsKey and secretsVer are the digest and version of the secrets
	// the static pods were last rendered with (renderMu).
	secretsKey string
	secretsVer int
	// trustCache is the Talos API trust of the active configuration.
	trustCache trustCache

	mu         sync.Mutex
	up         bool // answering the API
	off        bool // powered off after a shutdown or a reset without reboot
	powerOn    chan struct{}
	stage      runtime.MachineStage
	bootID     string
	bootCtx    context.Context
	bootCancel context.CancelFunc
	events     *eventLog

	version   string // running Talos version tag
	schematic string
	image     string     // installer the running system came from
	next      *installer // installed to the inactive slot: boots next

	cfg, persisted config.Provider
	tryTimer       *time.Timer
	applyRebooting bool

	seq        *sequence
	installing bool // a LifecycleService install runs
	images     map[string]string

	kubeletRunning bool
	// kubeletRestarts counts the kubelet's restarts while the machine ran
	// (ServiceRestart and configuration changes, not boots).
	kubeletRestarts int
	node            nodeSync // the labels, annotations and taints put on the Node

	memberID        uint64
	etcdRunning     bool
	etcdData        bool
	etcdStopped     bool // stopped by a leave: it joins again only after a boot
	etcdDBSize      int64
	etcdDBInUse     int64
	recoverSnapshot []byte

	meta metaPartition

	faults        []*activeFault
	annFaults     map[string]*activeFault
	faultsChanged chan struct{}

	openActions []int

	// pending: the spec's Joins, until Fleet.Join. joining: booted by Join,
	// its Node not Ready yet.
	pending, joining bool
}

type sequence struct {
	name   string
	cancel context.CancelFunc
	done   chan struct{}
}

func newMachine(f *Fleet, spec MachineSpec, addr string) *Machine {
	m := &Machine{
		f:             f,
		spec:          spec,
		addr:          addr,
		version:       spec.Talos,
		schematic:     spec.Schematic,
		image:         installerImage(spec.Platform, spec.SecureBoot, spec.Schematic, spec.Talos),
		images:        map[string]string{},
		annFaults:     map[string]*activeFault{},
		faultsChanged: make(chan struct{}),
		powerOn:       make(chan struct{}),
		events:        newEventLog(),
		etcdDBSize:    24 << 20,
		etcdDBInUse:   16 << 20,
		pending:       spec.Joins,
		joining:       spec.Joins,
	}
	m.cosi, m.cosiAPI = newCOSI()
	return m
}

// Name is the machine's hostname and Node name.
func (m *Machine) Name() string { return m.spec.Name }

// Role is the machine's role.
func (m *Machine) Role() Role { return m.spec.Role }

// Address is the machine's Talos node address (its Node's InternalIP).
func (m *Machine) Address() string { return m.addr }

// Endpoint is a control plane's Talos API listener ("ip:port"); empty on
// a worker.
func (m *Machine) Endpoint() string {
	if m.ep == nil {
		return ""
	}
	return m.ep.address()
}

// Version is the running Talos version, e.g. "v1.12.4".
func (m *Machine) Version() string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.version
}

// NextVersion is the version the next boot starts: an installed but not yet
// booted upgrade, else the running version.
func (m *Machine) NextVersion() string {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.next != nil {
		return m.next.version
	}
	return m.version
}

// BootID is the current boot's ID (/proc/sys/kernel/random/boot_id).
func (m *Machine) BootID() string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.bootID
}

// Schematic is the running Image Factory schematic ID ("" if none).
func (m *Machine) Schematic() string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.schematic
}

// Image is the installer image the running system was installed from.
func (m *Machine) Image() string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.image
}

// KubeletVersion is the kubelet version of the active configuration, e.g.
// "1.35.0".
func (m *Machine) KubeletVersion() string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return imageTag(m.cfg.RawV1Alpha1().Machine().Kubelet().Image())
}

// KubeletRestarts is how many times the kubelet restarted while the
// machine ran (a ServiceRestart, or a configuration change of its inputs:
// machine.kubelet, cluster.ca, cluster.acceptedCAs and the rest), boots
// not counted.
func (m *Machine) KubeletRestarts() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.kubeletRestarts
}

// Config is the active machine configuration.
func (m *Machine) Config() config.Provider {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.cfg
}

// Down reports whether the machine does not answer the Talos API (it is
// rebooting, shut down or held by a no-return fault).
func (m *Machine) Down() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return !m.up
}

// Off reports whether the machine is powered off (after a shutdown, or a
// reset without reboot) and waits for PowerOn.
func (m *Machine) Off() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.off
}

// Stage is the machine's stage as COSI MachineStatus reports it.
func (m *Machine) Stage() runtime.MachineStage {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.stage
}

// Pending reports whether the machine waits to join the cluster (the spec's
// Joins, before Fleet.Join).
func (m *Machine) Pending() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.pending
}

// PowerOn boots a machine that is powered off, as pressing its power button.
func (m *Machine) PowerOn() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.off {
		return fmt.Errorf("machine %s is not powered off", m.Name())
	}
	m.off = false
	close(m.powerOn)
	return nil
}

// takesOver mirrors Talos's sequencer priorities (runtime.sequenceTakeOver
// in machined): the running sequences a new one cancels. The boot and
// initialize sequences, which reboot, reset and upgrade take over in
// Talos, are instant here.
var takesOver = map[string][]string{
	"reboot": {"reboot", "reset"},
}

// startSequence runs run in the background as the machine's one sequence,
// as Talos's sequencer does: while one runs, a sequence that may not take
// it over is dropped (Talos answers the call, publishes a NOOP
// SequenceEvent with the LOCKED error and only logs it). force is Talos's
// WithTakeover (Shutdown, ApplyConfiguration's reboot): it cancels
// whatever runs. A second Reset during a reset is dropped; a Reboot takes
// a reset over.
func (m *Machine) startSequence(name string, force bool, run func(ctx context.Context)) {
	m.mu.Lock()
	old := m.seq
	if old != nil && !force && !slices.Contains(takesOver[name], old.name) {
		events := m.events
		m.mu.Unlock()
		m.f.logf("%s: %s not started: %s is in progress", m.Name(), name, old.name)
		events.emit("", &machine.SequenceEvent{Sequence: name, Action: machine.SequenceEvent_NOOP,
			Error: &common.Error{Code: common.Code_LOCKED, Message: "sequence not started: locked"}})
		return
	}
	ctx, cancel := context.WithCancel(m.f.ctx)
	s := &sequence{name: name, cancel: cancel, done: make(chan struct{})}
	m.seq = s
	m.mu.Unlock()
	if old != nil {
		m.f.logf("%s: %s takes over from %s", m.Name(), name, old.name)
		old.cancel()
	}
	m.f.wg.Add(1)
	go func() {
		defer m.f.wg.Done()
		defer close(s.done)
		defer cancel()
		if old != nil {
			<-old.done
		}
		m.f.logf("%s: %s started", m.Name(), name)
		// Talos answers the call, then its sequencer enters the stage.
		if sleep(ctx, m.f.spec.Durations.SequenceStart) == nil {
			run(ctx)
		}
		m.mu.Lock()
		if m.seq == s {
			m.seq = nil
		}
		m.mu.Unlock()
	}()
}

func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// begin marks the start of a disruptive sequence.
func (m *Machine) begin(kind ActionKind, stage runtime.MachineStage, sequenceName, actor string) {
	idx := m.f.rec.start(m.Name(), kind)
	m.mu.Lock()
	m.openActions = append(m.openActions, idx)
	m.stage = stage
	events := m.events
	m.mu.Unlock()
	m.f.rec.setDown(m.Name(), m.spec.Role, true)
	m.setMachineStatus(stage, false)
	events.emit(actor, &machine.SequenceEvent{Sequence: sequenceName, Action: machine.SequenceEvent_START})
	events.emit(actor, machineStatusEvent(stage, false))
}

// goDown stops the machine: its API stops answering (a control plane's
// listener closes), calls in flight fail, its Node turns NotReady and its
// etcd member drops out of quorum. It returns when the machine stopped
// answering: the reboot's time runs from then, not from when the API server
// has recorded it (a real machine's boot does not wait for those writes).
func (m *Machine) goDown(actor string) time.Time {
	m.mu.Lock()
	events := m.events
	m.mu.Unlock()
	events.emit(actor, &machine.TaskEvent{Task: "stopAllServices", Action: machine.TaskEvent_START})
	events.emit(actor, &machine.TaskEvent{Task: "stopAllServices", Action: machine.TaskEvent_STOP})
	m.mu.Lock()
	m.up = false
	m.kubeletRunning = false
	cancel := m.bootCancel
	open := append([]int(nil), m.openActions...)
	m.mu.Unlock()
	m.f.rec.wentDown(open)
	if cancel != nil {
		cancel()
	}
	if m.ep != nil {
		m.ep.close()
	}
	down := time.Now()
	m.f.etcd.update()
	m.f.kube.nodeDown(m)
	// Its kubelet's last word went through its own API server, which
	// stops with it (the last control plane's takes the API along).
	m.components.stop()
	m.apiServer.stop()
	m.f.logf("%s: down", m.Name())
	return down
}

// powerOff leaves the machine off until PowerOn (or the fleet stops).
func (m *Machine) powerOff(ctx context.Context) error {
	m.mu.Lock()
	m.off = true
	m.powerOn = make(chan struct{})
	ch := m.powerOn
	m.mu.Unlock()
	m.f.logf("%s: powered off", m.Name())
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-ch:
		return nil
	}
}

// waitReturn is the time a machine takes to come back, Durations.Reboot
// from since (when it went down or was powered on), held while a no-return
// fault is set.
func (m *Machine) waitReturn(ctx context.Context, since time.Time) error {
	if err := sleep(ctx, m.f.spec.Durations.Reboot-time.Since(since)); err != nil {
		return err
	}
	for {
		m.mu.Lock()
		held, changed := m.hasFaultLocked(FaultNoReturn, false), m.faultsChanged
		m.mu.Unlock()
		if !held {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-changed:
		}
	}
}

// boot brings the machine up: an installed upgrade takes effect (unless a
// rollback fault sends it back to the old slot), a staged configuration
// becomes active, the boot ID changes and everything starts again.
func (m *Machine) boot(actor string) {
	isMember := m.f.etcd.isMember(m)
	m.mu.Lock()
	applied := false
	if m.next != nil {
		if m.hasFaultLocked(FaultRollback, true) {
			m.f.logf("%s: booting %s failed, rolled back to %s (fault rollback)", m.Name(), m.next.version, m.version)
		} else {
			m.version, m.schematic, m.image = m.next.version, m.next.schematic, m.next.ref
			applied = true
		}
		m.next = nil
	}
	if m.tryTimer != nil {
		m.tryTimer.Stop()
		m.tryTimer = nil
	}
	m.cfg = m.persisted
	m.applyRebooting = false
	m.bootID = uuid.NewString()
	m.events = newEventLog()
	m.bootCtx, m.bootCancel = context.WithCancel(m.f.ctx)
	m.stage = runtime.MachineStageRunning
	m.off = false
	m.kubeletRunning = true
	m.etcdRunning = m.etcdData && isMember
	m.etcdStopped = false
	m.seq = nil // the sequence that rebooted the machine ended with the old boot
	joining := m.joining
	m.joining = false
	open := m.openActions
	m.openActions = nil
	events, version := m.events, m.version
	m.mu.Unlock()

	if applied {
		m.f.rec.upgradeApplied(m.Name(), version)
	}
	events.emit(actor, machineStatusEvent(runtime.MachineStageBooting, false))
	m.publish()
	m.setMachineStatus(runtime.MachineStageRunning, true)
	events.emit(actor, machineStatusEvent(runtime.MachineStageRunning, true))
	if m.ep != nil {
		if err := m.ep.open(); err != nil {
			m.f.logf("%s: %v", m.Name(), err)
		}
	}
	if joining {
		m.nodeReadyLater()
	} else {
		m.f.kube.nodeUp(m)
	}
	m.f.kube.syncNodeConfig(m)
	// Back in one step: from here on it answers, and the recorder counts it
	// as up, so a controller that sees it answer never sees it "down".
	m.mu.Lock()
	m.up = true
	m.f.rec.setDown(m.Name(), m.spec.Role, false)
	for _, i := range open {
		m.f.rec.finish(i)
	}
	m.mu.Unlock()
	m.f.etcd.update()
	m.apiServer.ensure()
	m.components.ensure()
	m.f.kube.resumePods(m)
	if actor != "" || applied {
		m.f.logf("%s: up on %s", m.Name(), version)
	}
}

// nodeReadyLater turns a joining machine's Node Ready once its network is
// up, Durations.NodeReady after it registered.
func (m *Machine) nodeReadyLater() {
	m.mu.Lock()
	ctx := m.bootCtx
	m.mu.Unlock()
	m.f.wg.Add(1)
	go func() {
		defer m.f.wg.Done()
		if sleep(ctx, m.f.spec.Durations.NodeReady) == nil {
			m.f.kube.nodeUp(m)
		}
	}()
}

func machineStatusEvent(stage runtime.MachineStage, ready bool) *machine.MachineStatusEvent {
	return &machine.MachineStatusEvent{
		Stage:  machine.MachineStatusEvent_MachineStage(stage),
		Status: &machine.MachineStatusEvent_MachineStatus{Ready: ready},
	}
}

// reboot is the reboot sequence (also the one an ApplyConfiguration in
// REBOOT mode runs).
func (m *Machine) reboot(ctx context.Context, actor string) {
	m.begin(ActionReboot, runtime.MachineStageRebooting, "reboot", actor)
	if sleep(ctx, m.f.spec.Durations.Stop) != nil {
		return
	}
	if m.waitReturn(ctx, m.goDown(actor)) != nil {
		return
	}
	m.boot(actor)
}

// legacyUpgrade is the sequence MachineService.Upgrade starts: cordon and
// drain, stop, install to the inactive slot, reboot. With stage, the
// install happens during the reboot instead (Talos reboots twice).
func (m *Machine) legacyUpgrade(ctx context.Context, actor string, in installer, stage bool) {
	if stage {
		m.begin(ActionUpgrade, runtime.MachineStageUpgrading, "stageUpgrade", actor)
	} else {
		m.begin(ActionUpgrade, runtime.MachineStageUpgrading, "upgrade", actor)
		m.f.kube.talosDrain(ctx, m)
	}
	if sleep(ctx, m.f.spec.Durations.Stop) != nil {
		return
	}
	if stage {
		m.goDown(actor)
	}
	if sleep(ctx, m.f.spec.Durations.Install) != nil {
		return
	}
	m.install(in)
	since := time.Now() // staged: the second reboot, after the install
	if !stage {
		since = m.goDown(actor)
	}
	if m.waitReturn(ctx, since) != nil {
		return
	}
	m.boot(actor)
}

// install writes in to the inactive slot, after the installer's preflight.
func (m *Machine) install(in installer) error {
	m.mu.Lock()
	host := m.version
	m.mu.Unlock()
	if err := checkUpgradeable(host, in.version); err != nil {
		m.f.logf("%s: upgrade to %s failed: %v", m.Name(), in.version, err)
		return err
	}
	m.mu.Lock()
	m.next = &in
	m.mu.Unlock()
	m.f.logf("%s: installed %s, active at next boot", m.Name(), in.version)
	return nil
}

func (m *Machine) shutdown(ctx context.Context, actor string, force bool) {
	m.begin(ActionShutdown, runtime.MachineStageShuttingDown, "shutdown", actor)
	if !force {
		m.f.kube.talosDrain(ctx, m)
	}
	if sleep(ctx, m.f.spec.Durations.Stop) != nil {
		return
	}
	m.goDown(actor)
	if m.powerOff(ctx) != nil || m.waitReturn(ctx, time.Now()) != nil {
		return
	}
	m.boot(actor)
}

// resetPlan is what a Reset wipes.
type resetPlan struct {
	graceful, reboot bool
	wipeEtcd         bool // EPHEMERAL (which holds /var/lib/etcd) goes
	wipeMeta         bool // META goes (the whole system disk, or META by label)
}

func (m *Machine) reset(ctx context.Context, actor string, p resetPlan) {
	m.begin(ActionReset, runtime.MachineStageResetting, "reset", actor)
	if p.graceful {
		m.f.kube.talosDrain(ctx, m)
		if m.spec.Role == ControlPlane {
			if err := m.f.etcd.leave(m); err != nil {
				m.f.logf("%s: reset: leave etcd: %v", m.Name(), err)
			}
		}
	}
	if sleep(ctx, m.f.spec.Durations.Stop) != nil {
		return
	}
	// Its pods go first, then etcd and EPHEMERAL with it (under
	// Spec.Hosted the pods' removal needs the etcd that the wipe may stop).
	m.f.kube.resetPods(ctx, m)
	if p.wipeEtcd && m.spec.Role == ControlPlane {
		m.f.etcd.wipe(m)
	}
	if p.wipeMeta {
		m.wipeMeta()
	}
	since := m.goDown(actor)
	if !p.reboot {
		if m.powerOff(ctx) != nil {
			return
		}
		since = time.Now()
	}
	if m.waitReturn(ctx, since) != nil {
		return
	}
	m.boot(actor)
}

// restartKubelet stops the kubelet (its Service resource is destroyed) and
// starts it again after Durations.KubeletRestart, as ServiceRestart and a
// kubelet config change do.
func (m *Machine) restartService(id string) {
	m.mu.Lock()
	ctx := m.bootCtx
	if id == "kubelet" {
		m.kubeletRunning = false
		m.kubeletRestarts++
	}
	m.mu.Unlock()
	m.destroy(serviceMetadata(id))
	m.f.wg.Add(1)
	go func() {
		defer m.f.wg.Done()
		if sleep(ctx, m.f.spec.Durations.KubeletRestart) != nil {
			return
		}
		m.mu.Lock()
		if id == "kubelet" {
			m.kubeletRunning = true
		}
		m.mu.Unlock()
		m.putService(id, true)
		if id == "kubelet" {
			m.f.kube.nodeUp(m)
		}
	}()
}

// services lists the services a machine runs.
func (m *Machine) services() []string {
	s := []string{"apid", "containerd", "cri", "machined", "udevd", "kubelet"}
	if m.spec.Role == ControlPlane {
		s = append(s, "etcd", "trustd")
	}
	return append(s, m.spec.ExtensionServices...)
}

func (m *Machine) hasService(id string) bool {
	for _, s := range m.services() {
		if s == id {
			return true
		}
	}
	return false
}

// restartable reports whether Talos restarts the service through the API:
// only the kubelet and extension services implement APIRestartAllowed.
func restartable(id string) bool { return id == "kubelet" || strings.HasPrefix(id, "ext-") }

// osImage is what the Node reports as its OS.
func (m *Machine) osImage() string {
	return fmt.Sprintf("Talos (%s)", m.Version())
}
