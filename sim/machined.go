package sim

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/siderolabs/talos/pkg/machinery/api/common"
	"github.com/siderolabs/talos/pkg/machinery/api/machine"
	clientconfig "github.com/siderolabs/talos/pkg/machinery/client/config"
	"github.com/siderolabs/talos/pkg/machinery/config/configdiff"
	"github.com/siderolabs/talos/pkg/machinery/config/configloader"
	"github.com/siderolabs/talos/pkg/machinery/config/generate/secrets"
	"github.com/siderolabs/talos/pkg/machinery/constants"
	"github.com/siderolabs/talos/pkg/machinery/resources/runtime"
	"github.com/siderolabs/talos/pkg/machinery/role"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/emptypb"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// machined is MachineService, answering for the machine a call was routed to.
type machined struct {
	machine.UnimplementedMachineServiceServer
	f *Fleet
}

func (s *machined) Version(ctx context.Context, _ *emptypb.Empty) (*machine.VersionResponse, error) {
	m := callee(ctx)
	return &machine.VersionResponse{Messages: []*machine.Version{{
		Version: &machine.VersionInfo{
			Tag:       m.Version(),
			Sha:       "simulated",
			Built:     "",
			GoVersion: "go1.26.5",
			Os:        "linux",
			Arch:      "amd64",
		},
		Platform: &machine.PlatformInfo{Name: m.spec.Platform, Mode: "metal"},
		Features: &machine.FeaturesInfo{Rbac: true},
	}}}, nil
}

func (s *machined) Hostname(ctx context.Context, _ *emptypb.Empty) (*machine.HostnameResponse, error) {
	return &machine.HostnameResponse{Messages: []*machine.Hostname{{Hostname: callee(ctx).Name()}}}, nil
}

// Read serves the one file Ichor reads, the boot ID.
func (s *machined) Read(in *machine.ReadRequest, srv grpc.ServerStreamingServer[common.Data]) error {
	m := callee(srv.Context())
	if in.Path != "/proc/sys/kernel/random/boot_id" {
		return status.Errorf(codes.NotFound, "stat %s: no such file or directory", in.Path)
	}
	return srv.Send(&common.Data{Bytes: []byte(m.BootID() + "\n")})
}

func (s *machined) Events(req *machine.EventsRequest, srv grpc.ServerStreamingServer[machine.Event]) error {
	m := callee(srv.Context())
	m.mu.Lock()
	log := m.events
	m.mu.Unlock()
	first, err := log.start(req)
	if err != nil {
		return err
	}
	// The hello event tells the client that streaming has started.
	if err := srv.Send(&machine.Event{ActorId: req.WithActorId}); err != nil {
		return err
	}
	err = log.watch(srv.Context(), first, req.WithActorId, srv.Send)
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return status.FromContextError(err).Err()
	}
	return err
}

func (s *machined) Reboot(ctx context.Context, in *machine.RebootRequest) (*machine.RebootResponse, error) {
	m := callee(ctx)
	actor := uuid.NewString()
	m.startSequence("reboot", false, func(c context.Context) { m.reboot(c, actor) })
	return &machine.RebootResponse{Messages: []*machine.Reboot{{ActorId: actor}}}, nil
}

func (s *machined) Shutdown(ctx context.Context, in *machine.ShutdownRequest) (*machine.ShutdownResponse, error) {
	m := callee(ctx)
	actor := uuid.NewString()
	m.startSequence("shutdown", true, func(c context.Context) { m.shutdown(c, actor, in.Force) })
	return &machine.ShutdownResponse{Messages: []*machine.Shutdown{{ActorId: actor}}}, nil
}

// Reset checks its input as Talos does, then runs the reset sequence.
func (s *machined) Reset(ctx context.Context, in *machine.ResetRequest) (*machine.ResetResponse, error) {
	m := callee(ctx)
	if len(in.UserDisksToWipe) > 0 {
		if in.Mode == machine.ResetRequest_SYSTEM_DISK {
			return nil, errors.New("reset failed: invalid input, wipe mode SYSTEM_DISK doesn't support UserDisksToWipe parameter")
		}
		for _, d := range in.UserDisksToWipe {
			if d == "/dev/vda" {
				return nil, fmt.Errorf("reset user disk failed: device %s is the system disk", d)
			}
			if d != "/dev/vdb" {
				return nil, fmt.Errorf("reset user disk failed: device %s wasn't found", d)
			}
		}
	}
	plan := resetPlan{graceful: in.Graceful, reboot: in.Reboot}
	if len(in.SystemPartitionsToWipe) > 0 {
		if in.Mode == machine.ResetRequest_USER_DISKS {
			return nil, errors.New("reset failed: invalid input, wipe mode USER_DISKS doesn't support SystemPartitionsToWipe parameter")
		}
		for _, p := range in.SystemPartitionsToWipe {
			switch p.Label {
			case constants.EphemeralPartitionLabel, constants.StatePartitionLabel, constants.MetaPartitionLabel, constants.BootPartitionLabel, constants.EFIPartitionLabel:
			default:
				return nil, fmt.Errorf("failed to get volume status with label %q: resource VolumeStatuses.block.talos.dev(runtime/%s@undefined) doesn't exist", p.Label, p.Label)
			}
			plan.wipeEtcd = plan.wipeEtcd || p.Wipe && p.Label == constants.EphemeralPartitionLabel
			plan.wipeMeta = plan.wipeMeta || p.Wipe && p.Label == constants.MetaPartitionLabel
		}
	} else {
		plan.wipeEtcd = in.Mode != machine.ResetRequest_USER_DISKS
		plan.wipeMeta = plan.wipeEtcd
	}
	actor := uuid.NewString()
	m.startSequence("reset", false, func(c context.Context) { m.reset(c, actor, plan) })
	return &machine.ResetResponse{Messages: []*machine.Reset{{ActorId: actor}}}, nil
}

// Upgrade is the legacy unary upgrade: it pulls and checks the installer,
// on a control plane (unless force or preserve) takes the etcd upgrade
// mutex and validates etcd, then starts the upgrade sequence and returns.
func (s *machined) Upgrade(ctx context.Context, in *machine.UpgradeRequest) (*machine.UpgradeResponse, error) {
	m := callee(ctx)
	inst, err := s.f.resolve(in.Image)
	if err != nil {
		return nil, fmt.Errorf("error validating installer image %q: %w", in.Image, err)
	}
	if err := sleep(ctx, s.f.spec.Durations.ImagePull); err != nil {
		return nil, status.FromContextError(err).Err()
	}
	if m.spec.Role == ControlPlane && !in.Force && !in.Preserve {
		if err := s.f.etcd.validateForUpgrade(); err != nil {
			return nil, err
		}
	}
	actor := uuid.NewString()
	m.startSequence("upgrade", false, func(c context.Context) { m.legacyUpgrade(c, actor, inst, in.Stage) })
	return &machine.UpgradeResponse{Messages: []*machine.Upgrade{{Ack: "Upgrade request received", ActorId: actor}}}, nil
}

func (s *machined) ServiceList(ctx context.Context, _ *emptypb.Empty) (*machine.ServiceListResponse, error) {
	m := callee(ctx)
	m.mu.Lock()
	kubelet, etcd := m.kubeletRunning, m.etcdRunning
	m.mu.Unlock()
	var list []*machine.ServiceInfo
	for _, id := range m.services() {
		running := true
		switch id {
		case "kubelet":
			running = kubelet
		case "etcd":
			running = etcd
		}
		st := "Running"
		if !running {
			st = "Finished"
		}
		list = append(list, &machine.ServiceInfo{
			Id:     id,
			State:  st,
			Events: &machine.ServiceEvents{},
			Health: &machine.ServiceHealth{Healthy: running, LastChange: timestamppb.Now()},
		})
	}
	return &machine.ServiceListResponse{Messages: []*machine.ServiceList{{Services: list}}}, nil
}

// ServiceRestart restarts the kubelet or an extension service; Talos refuses
// every other service.
func (s *machined) ServiceRestart(ctx context.Context, in *machine.ServiceRestartRequest) (*machine.ServiceRestartResponse, error) {
	m := callee(ctx)
	if !m.hasService(in.Id) {
		return &machine.ServiceRestartResponse{}, fmt.Errorf("service %q not defined", in.Id)
	}
	if !restartable(in.Id) {
		return &machine.ServiceRestartResponse{}, fmt.Errorf("service %q doesn't support restart operation via API", in.Id)
	}
	m.restartService(in.Id)
	return &machine.ServiceRestartResponse{Messages: []*machine.ServiceRestart{{Resp: fmt.Sprintf("Service %q restarted", in.Id)}}}, nil
}

func (s *machined) ServiceStart(ctx context.Context, in *machine.ServiceStartRequest) (*machine.ServiceStartResponse, error) {
	m := callee(ctx)
	if !m.hasService(in.Id) {
		return &machine.ServiceStartResponse{}, fmt.Errorf("service %q not defined", in.Id)
	}
	// Every service runs, so starting one is the no-op Talos makes of it.
	return &machine.ServiceStartResponse{Messages: []*machine.ServiceStart{{Resp: fmt.Sprintf("Service %q started", in.Id)}}}, nil
}

func (s *machined) ServiceStop(ctx context.Context, in *machine.ServiceStopRequest) (*machine.ServiceStopResponse, error) {
	m := callee(ctx)
	if !m.hasService(in.Id) {
		return &machine.ServiceStopResponse{}, fmt.Errorf("service %q not defined", in.Id)
	}
	return &machine.ServiceStopResponse{}, fmt.Errorf("service %q doesn't support stop operation via API", in.Id)
}

// checkControlPlane is Talos's machinehelper.CheckControlplane.
func checkControlPlane(m *Machine, api string) error {
	if m.spec.Role != ControlPlane {
		return status.Errorf(codes.Unimplemented, "%s is only available on control plane nodes", api)
	}
	return nil
}

func (s *machined) EtcdMemberList(ctx context.Context, in *machine.EtcdMemberListRequest) (*machine.EtcdMemberListResponse, error) {
	m := callee(ctx)
	if err := checkControlPlane(m, "member list"); err != nil {
		return nil, err
	}
	if in.QueryLocal {
		m.mu.Lock()
		running := m.etcdRunning
		m.mu.Unlock()
		if !running {
			return nil, status.Error(codes.Unavailable, "etcd is not running on this node")
		}
	}
	members, err := s.f.etcd.memberList()
	if err != nil {
		return nil, err
	}
	legacy := make([]string, len(members))
	for i, mem := range members {
		legacy[i] = mem.Hostname
	}
	return &machine.EtcdMemberListResponse{Messages: []*machine.EtcdMembers{{Members: members, LegacyMembers: legacy}}}, nil
}

func (s *machined) EtcdStatus(ctx context.Context, _ *emptypb.Empty) (*machine.EtcdStatusResponse, error) {
	m := callee(ctx)
	if err := checkControlPlane(m, "etcd status"); err != nil {
		return nil, err
	}
	st, err := s.f.etcd.status(m)
	if err != nil {
		return nil, err
	}
	return &machine.EtcdStatusResponse{Messages: []*machine.EtcdStatus{{MemberStatus: st}}}, nil
}

func (s *machined) EtcdAlarmList(ctx context.Context, _ *emptypb.Empty) (*machine.EtcdAlarmListResponse, error) {
	m := callee(ctx)
	if err := checkControlPlane(m, "etcd alarm list"); err != nil {
		return nil, err
	}
	if err := requireLocalEtcd(m); err != nil {
		return nil, err
	}
	alarms, err := s.f.etcd.alarmList()
	if err != nil {
		return nil, err
	}
	return &machine.EtcdAlarmListResponse{Messages: []*machine.EtcdAlarm{{MemberAlarms: alarms}}}, nil
}

func (s *machined) EtcdAlarmDisarm(ctx context.Context, _ *emptypb.Empty) (*machine.EtcdAlarmDisarmResponse, error) {
	m := callee(ctx)
	if err := checkControlPlane(m, "etcd alarm disarm"); err != nil {
		return nil, err
	}
	if err := requireLocalEtcd(m); err != nil {
		return nil, err
	}
	alarms, err := s.f.etcd.disarm()
	if err != nil {
		return nil, fmt.Errorf("failed to disarm etcd alarm: %w", err)
	}
	return &machine.EtcdAlarmDisarmResponse{Messages: []*machine.EtcdAlarmDisarm{{MemberAlarms: alarms}}}, nil
}

func requireLocalEtcd(m *Machine) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.etcdRunning {
		return errors.New("failed to create etcd client: dial tcp 127.0.0.1:2379: connect: connection refused")
	}
	return nil
}

// EtcdDefragment defragments the local member: its database shrinks to
// what is in use.
func (s *machined) EtcdDefragment(ctx context.Context, _ *emptypb.Empty) (*machine.EtcdDefragmentResponse, error) {
	m := callee(ctx)
	if err := checkControlPlane(m, "etcd defragment"); err != nil {
		return nil, err
	}
	if err := requireLocalEtcd(m); err != nil {
		return nil, err
	}
	m.mu.Lock()
	m.etcdDBSize = m.etcdDBInUse
	m.mu.Unlock()
	return &machine.EtcdDefragmentResponse{Messages: []*machine.EtcdDefragment{{}}}, nil
}

func (s *machined) EtcdForfeitLeadership(ctx context.Context, _ *machine.EtcdForfeitLeadershipRequest) (*machine.EtcdForfeitLeadershipResponse, error) {
	m := callee(ctx)
	if err := checkControlPlane(m, "etcd forfeit leadership"); err != nil {
		return nil, err
	}
	leader, err := s.f.etcd.forfeit(m)
	if err != nil {
		return nil, err
	}
	return &machine.EtcdForfeitLeadershipResponse{Messages: []*machine.EtcdForfeitLeadership{{Member: leader}}}, nil
}

func (s *machined) EtcdLeaveCluster(ctx context.Context, _ *machine.EtcdLeaveClusterRequest) (*machine.EtcdLeaveClusterResponse, error) {
	m := callee(ctx)
	if err := checkControlPlane(m, "etcd leave"); err != nil {
		return nil, err
	}
	if err := s.f.etcd.leave(m); err != nil {
		return nil, err
	}
	return &machine.EtcdLeaveClusterResponse{Messages: []*machine.EtcdLeaveCluster{{}}}, nil
}

func (s *machined) EtcdRemoveMemberByID(ctx context.Context, in *machine.EtcdRemoveMemberByIDRequest) (*machine.EtcdRemoveMemberByIDResponse, error) {
	m := callee(ctx)
	if err := checkControlPlane(m, "etcd remove member"); err != nil {
		return nil, err
	}
	if err := s.f.etcd.remove(in.MemberId); err != nil {
		if status.Code(err) == codes.NotFound || status.Code(err) == codes.Unavailable {
			return nil, err
		}
		return nil, fmt.Errorf("failed to remove member: %w", err)
	}
	return &machine.EtcdRemoveMemberByIDResponse{Messages: []*machine.EtcdRemoveMemberByID{{}}}, nil
}

// EtcdSnapshot streams a snapshot of the simulated etcd.
func (s *machined) EtcdSnapshot(_ *machine.EtcdSnapshotRequest, srv grpc.ServerStreamingServer[common.Data]) error {
	m := callee(srv.Context())
	if err := checkControlPlane(m, "etcd snapshot"); err != nil {
		return err
	}
	if err := requireLocalEtcd(m); err != nil {
		return err
	}
	if s.f.hosting != nil {
		return s.f.hosting.etcd.snapshot(srv.Context(), srv)
	}
	data, err := s.f.etcd.snapshot()
	if err != nil {
		return err
	}
	for len(data) > 0 {
		n := min(len(data), 4096)
		if err := srv.Send(&common.Data{Bytes: data[:n]}); err != nil {
			return err
		}
		data = data[n:]
	}
	return nil
}

// EtcdRecover stores an uploaded snapshot for a Bootstrap with RecoverEtcd;
// as Talos, it refuses while /var/lib is not there (a reset has unmounted
// EPHEMERAL).
func (s *machined) EtcdRecover(srv grpc.ClientStreamingServer[common.Data, machine.EtcdRecoverResponse]) error {
	m := callee(srv.Context())
	m.mu.Lock()
	resetting := m.stage == runtime.MachineStageResetting
	m.mu.Unlock()
	if resetting {
		return status.Error(codes.FailedPrecondition, "etcd service is not ready for recovery yet")
	}
	if err := checkControlPlane(m, "etcd recover"); err != nil {
		return err
	}
	var buf bytes.Buffer
	for {
		msg, err := srv.Recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			return err
		}
		buf.Write(msg.Bytes)
	}
	m.mu.Lock()
	m.recoverSnapshot = buf.Bytes()
	m.mu.Unlock()
	return srv.SendAndClose(&machine.EtcdRecoverResponse{Messages: []*machine.EtcdRecover{{}}})
}

// Bootstrap starts etcd as a new cluster on this control plane (from the
// uploaded snapshot with RecoverEtcd); it needs empty etcd data and, as
// Talos's IsBootstrapAllowed, a running machine with no reboot pending.
func (s *machined) Bootstrap(ctx context.Context, in *machine.BootstrapRequest) (*machine.BootstrapResponse, error) {
	m := callee(ctx)
	m.mu.Lock()
	allowed := m.stage == runtime.MachineStageRunning && !m.applyRebooting
	m.mu.Unlock()
	if !allowed {
		return nil, status.Error(codes.FailedPrecondition, "bootstrap is not available yet")
	}
	if err := checkControlPlane(m, "bootstrap"); err != nil {
		return nil, err
	}
	m.mu.Lock()
	hasData, snap := m.etcdData, m.recoverSnapshot
	m.mu.Unlock()
	if hasData {
		return nil, status.Error(codes.AlreadyExists, "etcd data directory is not empty")
	}
	if in.RecoverEtcd && snap == nil {
		return nil, status.Error(codes.FailedPrecondition, "etcd recovery snapshot was not uploaded: call EtcdRecover first")
	}
	if !in.RecoverEtcd {
		snap = nil
	}
	from, err := s.bootstrapData(ctx, snap, in.RecoverSkipHashCheck)
	if err != nil {
		return nil, err
	}
	m.mu.Lock()
	m.recoverSnapshot = nil
	m.mu.Unlock()
	s.f.etcd.bootstrap(m, from)
	if s.f.hosting != nil {
		s.f.restartAPIServers()
	}
	return &machine.BootstrapResponse{Messages: []*machine.Bootstrap{{}}}, nil
}

// bootstrapData is the data a bootstrap starts the new cluster with: none,
// or what the snapshot holds (under Spec.Hosted restored into the real
// etcd's new data directory).
func (s *machined) bootstrapData(ctx context.Context, snap []byte, skipHash bool) (*snapshotData, error) {
	if s.f.hosting != nil {
		rev, err := s.f.hosting.etcd.bootstrap(ctx, snap, skipHash)
		if err != nil || snap == nil {
			return nil, err
		}
		return &snapshotData{Revision: rev}, nil
	}
	if snap == nil {
		return nil, nil
	}
	d, err := parseSnapshot(snap, skipHash)
	if err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "etcd recovery snapshot: %v", err)
	}
	return &d, nil
}

// ApplyConfiguration validates the configuration and applies it in the
// requested mode (the zero value is REBOOT): NO_REBOOT and TRY only for
// changes Talos applies live, STAGED at the next boot, AUTO as it can.
func (s *machined) ApplyConfiguration(ctx context.Context, in *machine.ApplyConfigurationRequest) (*machine.ApplyConfigurationResponse, error) {
	m := callee(ctx)
	if !m.applyMu.TryLock() {
		return nil, status.Error(codes.FailedPrecondition, "another apply configuration is already in progress")
	}
	defer m.applyMu.Unlock()
	m.mu.Lock()
	rebooting, current, version := m.applyRebooting, m.cfg, m.version
	m.mu.Unlock()
	if rebooting {
		return nil, status.Error(codes.FailedPrecondition, "configuration was already applied and node is rebooting, cannot apply more configuration changes until next reboot")
	}
	if !rolesFrom(ctx).Includes(role.Admin) {
		return nil, status.Error(codes.PermissionDenied, "not authorized")
	}
	if in.Mode != machine.ApplyConfigurationRequest_TRY {
		// As Talos: any other request, even one refused below or a dry
		// run, ends a pending TRY (it is then never reverted).
		m.cancelTry()
	}
	cfg, err := configloader.NewFromBytes(in.Data)
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	warnings, err := validateConfig(cfg, version)
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	mode, details, modeErr := in.Mode, "Applied configuration with a reboot", ""
	switch in.Mode {
	case machine.ApplyConfigurationRequest_TRY, machine.ApplyConfigurationRequest_NO_REBOOT:
		if err := canApplyImmediate(current, cfg); err != nil {
			return nil, status.Error(codes.InvalidArgument, err.Error())
		}
		details = "Applied configuration without a reboot"
	case machine.ApplyConfigurationRequest_STAGED:
		details = "Staged configuration to be applied after the next reboot"
	case machine.ApplyConfigurationRequest_AUTO:
		if err := canApplyImmediate(current, cfg); err != nil {
			mode, modeErr = machine.ApplyConfigurationRequest_REBOOT, ": "+err.Error()
		} else {
			mode, details = machine.ApplyConfigurationRequest_NO_REBOOT, "Applied configuration without a reboot"
		}
	}
	// As Talos, a mode it does not know is refused only once a dry run is
	// over: a dry run answers for it like for REBOOT.
	if in.DryRun {
		diff, err := configdiff.DiffConfigs(current, cfg)
		if err != nil {
			return nil, fmt.Errorf("failed to generate diff: %w", err)
		}
		if diff == "" {
			diff = "No changes."
		}
		return &machine.ApplyConfigurationResponse{Messages: []*machine.ApplyConfiguration{{
			Mode:        mode,
			ModeDetails: fmt.Sprintf("Dry run summary:\n%s (skipped in dry-run).\nConfig diff:\n\n%s", details, diff),
		}}}, nil
	}
	switch mode {
	case machine.ApplyConfigurationRequest_TRY:
		timeout := constants.ConfigTryTimeout
		if in.TryModeTimeout != nil {
			timeout = in.TryModeTimeout.AsDuration()
		}
		details += fmt.Sprintf("\nThe config is applied in 'try' mode and will be automatically reverted back in %s", timeout)
		m.applyLive(cfg, false, timeout)
	case machine.ApplyConfigurationRequest_NO_REBOOT:
		m.applyLive(cfg, true, 0)
	case machine.ApplyConfigurationRequest_STAGED:
		m.mu.Lock()
		m.persisted = cfg
		m.mu.Unlock()
		m.put(configResource(cfg, true))
	case machine.ApplyConfigurationRequest_REBOOT:
		m.mu.Lock()
		m.persisted, m.applyRebooting = cfg, true
		m.mu.Unlock()
		m.put(configResource(cfg, true))
		actor := uuid.NewString()
		m.startSequence("reboot", true, func(c context.Context) { m.reboot(c, actor) })
	default:
		return nil, fmt.Errorf("incorrect mode '%s' specified for the apply config call", in.Mode)
	}
	return &machine.ApplyConfigurationResponse{Messages: []*machine.ApplyConfiguration{{
		Mode:        mode,
		Warnings:    warnings,
		ModeDetails: details + modeErr,
	}}}, nil
}

// ImagePull is the deprecated MachineService.ImagePull.
func (s *machined) ImagePull(ctx context.Context, in *machine.ImagePullRequest) (*machine.ImagePullResponse, error) {
	m := callee(ctx)
	// Talos pulls into the CRI containerd, in the namespace asked for.
	if in.Namespace != common.ContainerdNamespace_NS_CRI && in.Namespace != common.ContainerdNamespace_NS_SYSTEM {
		return nil, status.Errorf(codes.InvalidArgument, "invalid namespace %s", in.Namespace)
	}
	inst := &common.ContainerdInstance{Driver: common.ContainerDriver_CRI, Namespace: in.Namespace}
	if !m.hasImage(inst, in.Reference) {
		if err := sleep(ctx, s.f.spec.Durations.ImagePull); err != nil {
			return nil, status.FromContextError(err).Err()
		}
	}
	if _, err := m.pull(inst, in.Reference); err != nil {
		return nil, err
	}
	return &machine.ImagePullResponse{Messages: []*machine.ImagePull{{}}}, nil
}

// GenerateClientConfiguration mints a talosconfig for roles, as Talos does.
func (s *machined) GenerateClientConfiguration(ctx context.Context, in *machine.GenerateClientConfigurationRequest) (*machine.GenerateClientConfigurationResponse, error) {
	roles, unknown := role.Parse(in.Roles)
	if len(unknown) > 0 {
		return nil, status.Errorf(codes.InvalidArgument, "unknown roles: %s", strings.Join(unknown, ", "))
	}
	ttl := 365 * 24 * time.Hour
	if in.CrtTtl != nil {
		ttl = in.CrtTtl.AsDuration()
	}
	// As Talos, from the secrets of the machine's own configuration: after
	// a CA rotation, its new machine.ca.
	m := callee(ctx)
	if m.spec.Role != ControlPlane {
		return nil, status.Error(codes.Unimplemented, "generate client configuration is only available on control plane nodes")
	}
	ca := m.Config().Machine().Security().IssuingCA()
	bundle := &secrets.Bundle{Clock: secrets.NewFixedClock(time.Now()), Certs: &secrets.Certs{OS: ca}}
	crt, err := bundle.GenerateTalosAPIClientCertificateWithTTL(roles, ttl)
	if err != nil {
		return nil, err
	}
	cfg, err := clientconfig.NewConfig(s.f.spec.Name, s.f.Endpoints(), ca.Crt, crt).Bytes()
	if err != nil {
		return nil, err
	}
	return &machine.GenerateClientConfigurationResponse{Messages: []*machine.GenerateClientConfiguration{{
		Ca: ca.Crt, Crt: crt.Crt, Key: crt.Key, Talosconfig: cfg,
	}}}, nil
}
