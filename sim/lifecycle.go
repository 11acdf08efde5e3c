package sim

import (
	"fmt"
	"reflect"
	"time"

	"github.com/blang/semver/v4"
	"github.com/siderolabs/talos/pkg/machinery/api/common"
	"github.com/siderolabs/talos/pkg/machinery/api/machine"
	"github.com/siderolabs/talos/pkg/machinery/config"
	configres "github.com/siderolabs/talos/pkg/machinery/resources/config"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
)

// The first versions that have the image-based upgrade services; older
// nodes answer Unimplemented, as their gRPC server does not know them.
var (
	imageServiceSince     = semver.MustParse("1.13.0-alpha.1")
	lifecycleServiceSince = semver.MustParse("1.13.0-beta.0")
)

func requireService(m *Machine, service string, since semver.Version) error {
	v, err := semver.ParseTolerant(m.Version())
	if err == nil && v.LT(since) {
		return status.Errorf(codes.Unimplemented, "unknown service %s", service)
	}
	return nil
}

func instanceKey(inst *common.ContainerdInstance) string {
	return fmt.Sprintf("%s/%s", inst.Driver, inst.Namespace)
}

// pull puts ref into the machine's image store for the containerd instance
// and returns the pinned reference, as ImageService.Pull answers.
func (m *Machine) pull(inst *common.ContainerdInstance, ref string) (string, error) {
	if inst == nil {
		return "", status.Error(codes.InvalidArgument, "containerd instance is required")
	}
	if _, err := m.f.resolve(ref); err != nil {
		return "", status.Errorf(codes.NotFound, "error pulling image: %v", err)
	}
	p := pinned(ref)
	key := instanceKey(inst)
	m.mu.Lock()
	m.images[key+"|"+ref] = ref
	m.images[key+"|"+p] = ref
	m.mu.Unlock()
	return p, nil
}

// hasImage reports whether ref was pulled into the containerd instance.
func (m *Machine) hasImage(inst *common.ContainerdInstance, ref string) bool {
	if inst == nil {
		return false
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	_, ok := m.images[instanceKey(inst)+"|"+ref]
	return ok
}

// imageService is ImageService (Talos 1.13 and later).
type imageService struct {
	machine.UnimplementedImageServiceServer
}

func (imageService) Pull(req *machine.ImageServicePullRequest, srv grpc.ServerStreamingServer[machine.ImageServicePullResponse]) error {
	m := callee(srv.Context())
	if err := requireService(m, "machine.ImageService", imageServiceSince); err != nil {
		return err
	}
	start := time.Now()
	// An image already in the store only resolves; a new one downloads.
	if !m.hasImage(req.Containerd, req.ImageRef) {
		if err := sleep(srv.Context(), m.f.spec.Durations.ImagePull); err != nil {
			return status.FromContextError(err).Err()
		}
	}
	p, err := m.pull(req.Containerd, req.ImageRef)
	if err != nil {
		return err
	}
	for _, st := range []machine.ImageServicePullLayerProgress_Status{
		machine.ImageServicePullLayerProgress_DOWNLOADING, machine.ImageServicePullLayerProgress_DOWNLOAD_COMPLETE,
		machine.ImageServicePullLayerProgress_EXTRACTING, machine.ImageServicePullLayerProgress_EXTRACT_COMPLETE,
	} {
		if err := srv.Send(&machine.ImageServicePullResponse{Response: &machine.ImageServicePullResponse_PullProgress{
			PullProgress: &machine.ImageServicePullProgress{
				LayerId: p[len(p)-12:],
				Progress: &machine.ImageServicePullLayerProgress{
					Status: st, Elapsed: durationpb.New(time.Since(start)), Offset: 1 << 20, Total: 1 << 20,
				},
			},
		}}); err != nil {
			return err
		}
	}
	return srv.Send(&machine.ImageServicePullResponse{Response: &machine.ImageServicePullResponse_Name{Name: p}})
}

func (imageService) List(req *machine.ImageServiceListRequest, srv grpc.ServerStreamingServer[machine.ImageServiceListResponse]) error {
	m := callee(srv.Context())
	if err := requireService(m, "machine.ImageService", imageServiceSince); err != nil {
		return err
	}
	if req.Containerd == nil {
		return status.Error(codes.InvalidArgument, "containerd instance is required")
	}
	prefix := instanceKey(req.Containerd) + "|"
	m.mu.Lock()
	var names []string
	for key, ref := range m.images {
		if len(key) > len(prefix) && key[:len(prefix)] == prefix && key[len(prefix):] == ref {
			names = append(names, ref)
		}
	}
	m.mu.Unlock()
	for _, n := range names {
		if err := srv.Send(&machine.ImageServiceListResponse{Name: n, Digest: pinned(n)[len(n):]}); err != nil {
			return err
		}
	}
	return nil
}

// lifecycleService is LifecycleService (Talos 1.13 and later).
type lifecycleService struct {
	machine.UnimplementedLifecycleServiceServer
}

// Upgrade runs the installer from an image pulled into the same containerd
// instance: the new version goes to the inactive slot and boots at the
// next reboot, which this call does not do. An installer that refuses the
// host version ends with a non-zero exit code, not an error.
func (lifecycleService) Upgrade(req *machine.LifecycleServiceUpgradeRequest, srv grpc.ServerStreamingServer[machine.LifecycleServiceUpgradeResponse]) error {
	m := callee(srv.Context())
	if err := requireService(m, "machine.LifecycleService", lifecycleServiceSince); err != nil {
		return err
	}
	m.mu.Lock()
	if m.installing {
		m.mu.Unlock()
		return status.Error(codes.FailedPrecondition, "another installation/upgrade is already in progress")
	}
	m.installing = true
	m.mu.Unlock()
	defer func() {
		m.mu.Lock()
		m.installing = false
		m.mu.Unlock()
	}()
	image := req.GetSource().GetImageName()
	if image == "" {
		return status.Error(codes.InvalidArgument, "installer image name is required")
	}
	if req.Containerd == nil {
		return status.Error(codes.InvalidArgument, "containerd instance is required")
	}
	m.mu.Lock()
	ref, pulled := m.images[instanceKey(req.Containerd)+"|"+image]
	m.mu.Unlock()
	if !pulled {
		return status.Errorf(codes.Internal, "upgrade failed: installer image %q not found in containerd store: image %q: not found", image, image)
	}
	in, err := parseInstaller(ref)
	if err != nil {
		return status.Errorf(codes.Internal, "upgrade failed: %v", err)
	}
	act := m.f.rec.start(m.Name(), ActionInstall)
	defer m.f.rec.finish(act)
	send := func(p *machine.LifecycleServiceInstallProgress) error {
		return srv.Send(&machine.LifecycleServiceUpgradeResponse{Progress: p})
	}
	msg := func(s string) *machine.LifecycleServiceInstallProgress {
		return &machine.LifecycleServiceInstallProgress{Response: &machine.LifecycleServiceInstallProgress_Message{Message: s}}
	}
	exit := func(code int32) *machine.LifecycleServiceInstallProgress {
		return &machine.LifecycleServiceInstallProgress{Response: &machine.LifecycleServiceInstallProgress_ExitCode{ExitCode: code}}
	}
	if err := send(msg(fmt.Sprintf("running installer %s", ref))); err != nil {
		return err
	}
	if err := sleep(srv.Context(), m.f.spec.Durations.Install); err != nil {
		return status.FromContextError(err).Err()
	}
	if err := m.install(in); err != nil {
		if err := send(msg("installer preflight failed: " + err.Error())); err != nil {
			return err
		}
		return send(exit(1))
	}
	if err := send(msg(fmt.Sprintf("installed %s to the inactive slot; it boots at the next reboot", in.version))); err != nil {
		return err
	}
	return send(exit(0))
}

// configResource is the COSI MachineConfig of cfg (active or persistent).
func configResource(cfg config.Provider, persistent bool) *configres.MachineConfig {
	if persistent {
		return configres.NewMachineConfigWithID(cfg, configres.PersistentID)
	}
	return configres.NewMachineConfigWithID(cfg, configres.ActiveID)
}

// applyLive makes cfg the active configuration (and the persisted one,
// unless it is a TRY that reverts after try), and Talos's controllers act on
// the change (liveChanged).
func (m *Machine) applyLive(cfg config.Provider, persist bool, try time.Duration) {
	m.mu.Lock()
	old := m.cfg
	m.cfg = cfg
	if persist {
		m.persisted = cfg
	}
	if m.tryTimer != nil {
		m.tryTimer.Stop()
		m.tryTimer = nil
	}
	if try > 0 {
		boot := m.bootID
		m.tryTimer = time.AfterFunc(try, func() { m.revertTry(boot, old) })
	}
	m.mu.Unlock()
	m.put(configResource(cfg, false))
	if persist {
		m.put(configResource(cfg, true))
	}
	m.liveChanged(old, cfg)
}

// revertTry goes back to the configuration that was active when the TRY
// apply came (Talos's RollbackToConfigAfter keeps that one, not the
// persisted one) once its timeout has passed.
func (m *Machine) revertTry(boot string, to config.Provider) {
	m.mu.Lock()
	if m.bootID != boot || m.tryTimer == nil {
		m.mu.Unlock()
		return
	}
	m.tryTimer = nil
	old, cfg := m.cfg, to
	m.cfg = cfg
	m.mu.Unlock()
	m.f.logf("%s: try configuration reverted", m.Name())
	m.put(configResource(cfg, false))
	m.liveChanged(old, cfg)
}

// liveChanged is what Talos's controllers do when the active configuration
// changes: the resources rendered from it follow (renderConfigured), the
// kubelet restarts when its inputs change, and the Node gets the
// configuration's labels, annotations and taints.
func (m *Machine) liveChanged(old, cfg config.Provider) {
	m.renderConfigured()
	m.apiServer.ensure()
	m.components.ensure()
	if !reflect.DeepEqual(kubeletInputsOf(old), kubeletInputsOf(cfg)) {
		m.restartService("kubelet")
	}
	m.f.kube.syncNodeConfigLater(m)
	m.f.kube.configChanged(m)
	m.f.kube.kubeProxyManifest(m)
}

// cancelTry drops a pending TRY revert, as any other apply mode does.
func (m *Machine) cancelTry() {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.tryTimer != nil {
		m.tryTimer.Stop()
		m.tryTimer = nil
	}
}
