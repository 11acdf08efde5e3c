package talos

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/blang/semver/v4"
	"github.com/cosi-project/runtime/pkg/safe"
	"github.com/siderolabs/talos/pkg/machinery/api/common"
	"github.com/siderolabs/talos/pkg/machinery/api/machine"
	talosclient "github.com/siderolabs/talos/pkg/machinery/client"
	"github.com/siderolabs/talos/pkg/machinery/resources/runtime"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// DefaultInstaller is the installer image of machines not booted from Image Factory.
const DefaultInstaller = "ghcr.io/siderolabs/installer"

// Facts is what a machine says of itself before it is disrupted.
type Facts struct {
	Version    string // the running Talos tag, like v1.12.4
	Platform   string // e.g. metal
	BootID     string
	Schematic  string // the Image Factory schematic ID, "" when not booted from Image Factory
	SecureBoot bool
}

// ReadFacts asks the machine at node for its version, platform, boot ID,
// schematic and secure-boot state.
func ReadFacts(ctx context.Context, c *talosclient.Client, node string) (Facts, error) {
	ctx = talosclient.WithNode(ctx, node)
	var f Facts
	var err error
	if f.Version, f.Platform, err = version(ctx, c); err != nil {
		return f, err
	}
	if f.BootID, err = BootID(ctx, c, node); err != nil {
		return f, err
	}
	exts, err := safe.StateListAll[*runtime.ExtensionStatus](ctx, c.COSI)
	if err != nil {
		return f, fmt.Errorf("list extensions: %w", err)
	}
	for ext := range exts.All() {
		if ext.TypedSpec().Metadata.Name == "schematic" {
			f.Schematic = ext.TypedSpec().Metadata.Version
		}
	}
	sec, err := safe.StateGetByID[*runtime.SecurityState](ctx, c.COSI, runtime.SecurityStateID)
	if err != nil {
		return f, fmt.Errorf("read security state: %w", err)
	}
	f.SecureBoot = sec.TypedSpec().SecureBoot
	return f, nil
}

// Version returns the Talos tag the machine at node runs.
func Version(ctx context.Context, c *talosclient.Client, node string) (string, error) {
	v, _, err := version(talosclient.WithNode(ctx, node), c)
	return v, err
}

func version(ctx context.Context, c *talosclient.Client) (tag, platform string, err error) {
	resp, err := c.Version(ctx)
	if err != nil {
		return "", "", fmt.Errorf("version: %w", err)
	}
	if len(resp.Messages) == 0 || resp.Messages[0].Version == nil {
		return "", "", errors.New("version: empty answer")
	}
	m := resp.Messages[0]
	if m.Platform != nil {
		platform = m.Platform.Name
	}
	return m.Version.Tag, platform, nil
}

// BootID reads the machine's boot ID, which changes at every boot.
func BootID(ctx context.Context, c *talosclient.Client, node string) (string, error) {
	r, err := c.Read(talosclient.WithNode(ctx, node), "/proc/sys/kernel/random/boot_id")
	if err != nil {
		return "", fmt.Errorf("read boot id: %w", err)
	}
	defer r.Close() //nolint:errcheck
	b, err := io.ReadAll(r)
	if err != nil {
		return "", fmt.Errorf("read boot id: %w", err)
	}
	return strings.TrimSpace(string(b)), nil
}

// InstallerImage is the installer to upgrade a machine with: the Image
// Factory image of its schematic, or the default installer without one.
func InstallerImage(repo string, f Facts, schematic, version string) string {
	if schematic == "" {
		schematic = f.Schematic
	}
	if schematic == "" {
		return DefaultInstaller + ":" + version
	}
	platform := f.Platform
	if platform == "" {
		platform = "metal"
	}
	sb := ""
	if f.SecureBoot {
		sb = "-secureboot"
	}
	return fmt.Sprintf("%s/%s-installer%s/%s:%s", repo, platform, sb, schematic, version)
}

// lifecycleSince is the first Talos with LifecycleService (ImageService
// came earlier, in 1.13.0-alpha.1): older nodes answer Unimplemented.
var lifecycleSince = semver.MustParse("1.13.0-beta.0")

// HasLifecycleAPI reports whether a machine on this version upgrades through
// ImageService and LifecycleService (1.13.0-beta.0 and later) rather than
// the legacy MachineService.Upgrade. The line is exact, pre-releases
// included: the upgrade plan is chosen from it, and the legacy call is an
// irreversible one that status must count before it is made.
func HasLifecycleAPI(version string) bool {
	v, err := semver.ParseTolerant(version)
	if err != nil {
		return false
	}
	return v.GTE(lifecycleSince)
}

// UpgradeLegacy installs image through the legacy MachineService.Upgrade,
// which also reboots the machine by itself (hosts below 1.13.0-beta.0).
func UpgradeLegacy(ctx context.Context, c *talosclient.Client, node, image string, powercycle bool) error {
	mode := machine.UpgradeRequest_DEFAULT
	if powercycle {
		mode = machine.UpgradeRequest_POWERCYCLE
	}
	_, err := c.UpgradeWithOptions(talosclient.WithNode(ctx, node),
		talosclient.WithUpgradeImage(image), talosclient.WithUpgradeRebootMode(mode))
	if err != nil {
		return fmt.Errorf("install %s (legacy MachineService.Upgrade): %w", image, err)
	}
	return nil
}

// systemContainerd is talosctl's default: the installer is pulled into and
// run from the system containerd.
var systemContainerd = &common.ContainerdInstance{Driver: common.ContainerDriver_CRI, Namespace: common.ContainerdNamespace_NS_SYSTEM}

// Pull pulls image into the machine's system containerd.
func Pull(ctx context.Context, c *talosclient.Client, node, image string) error {
	stream, err := c.ImageClient.Pull(talosclient.WithNode(ctx, node), &machine.ImageServicePullRequest{Containerd: systemContainerd, ImageRef: image})
	if err != nil {
		return fmt.Errorf("pull %s: %w", image, err)
	}
	for {
		_, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("pull %s: %w", image, err)
		}
	}
}

// PullLegacy pulls image into the containerd namespace ns (NS_SYSTEM for
// what Talos runs itself, NS_CRI for the Kubernetes pods) through the
// deprecated MachineService.ImagePull: the pull hosts without ImageService
// (below 1.13) have, and the one talosctl upgrade-k8s pre-pulls with.
func PullLegacy(ctx context.Context, c *talosclient.Client, node string, ns common.ContainerdNamespace, image string) error {
	//nolint:staticcheck // the only pull older hosts have, and talosctl's
	if err := c.ImagePull(talosclient.WithNode(ctx, node), ns, image); err != nil {
		return fmt.Errorf("pull %s (legacy MachineService.ImagePull): %w", image, err)
	}
	return nil
}

// Install runs the installer of image into the machine's inactive boot slot
// (LifecycleService.Upgrade). It does not reboot.
func Install(ctx context.Context, c *talosclient.Client, node, image string) error {
	stream, err := c.LifecycleClient.Upgrade(talosclient.WithNode(ctx, node), &machine.LifecycleServiceUpgradeRequest{
		Containerd: systemContainerd, Source: &machine.InstallArtifactsSource{ImageName: image}})
	if err != nil {
		return fmt.Errorf("install %s: %w", image, err)
	}
	var last string
	for {
		resp, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return fmt.Errorf("install %s: the installer ended without an exit code (last output: %q)", image, last)
		}
		if err != nil {
			return fmt.Errorf("install %s: %w", image, err)
		}
		p := resp.GetProgress()
		if p == nil {
			continue
		}
		if msg := p.GetMessage(); msg != "" {
			last = msg
			continue
		}
		if code := p.GetExitCode(); code != 0 {
			return fmt.Errorf("install %s: installer exited with code %d (last output: %q)", image, code, last)
		}
		return drain(stream)
	}
}

// drain reads the stream to its end after the exit code.
func drain(stream interface {
	Recv() (*machine.LifecycleServiceUpgradeResponse, error)
}) error {
	for {
		if _, err := stream.Recv(); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
	}
}

// Reboot reboots the machine; it answers before the machine goes down.
func Reboot(ctx context.Context, c *talosclient.Client, node string, powercycle bool) error {
	mode := machine.RebootRequest_DEFAULT
	if powercycle {
		mode = machine.RebootRequest_POWERCYCLE
	}
	if err := c.Reboot(talosclient.WithNode(ctx, node), talosclient.WithRebootMode(mode)); err != nil {
		return fmt.Errorf("reboot: %w", err)
	}
	return nil
}

// Unreachable reports whether err means the machine does not answer (it is
// rebooting or down), as opposed to answering with an error.
func Unreachable(err error) bool {
	if err == nil {
		return false
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return true
	}
	return anyStatus(err, func(s *status.Status) bool {
		return s.Code() == codes.Unavailable || s.Code() == codes.DeadlineExceeded
	})
}

// anyStatus reports whether err, or an error it wraps, is a gRPC status
// that match accepts.
func anyStatus(err error, match func(*status.Status) bool) bool {
	for e := err; e != nil; e = errors.Unwrap(e) {
		if s, ok := status.FromError(e); ok && match(s) {
			return true
		}
	}
	return false
}

// NotSent reports whether err says that the call never reached the machine:
// the connection to it could not be made ("Error while dialing", as gRPC
// reports a refused or unknown address, and apid for the machine it
// proxies to). Such a call cannot have been acted on, unlike one whose
// answer did not come. gRPC sends a call again by itself only when the
// first try provably did not reach the server, so a dial error is the
// error of a call that never got there.
func NotSent(err error) bool {
	return anyStatus(err, func(s *status.Status) bool {
		return s.Code() == codes.Unavailable && strings.Contains(s.Message(), "Error while dialing")
	})
}

// Refused reports whether err is a TLS handshake that failed on the
// credentials (the machine does not accept the client certificate, or the
// client does not trust the machine's server certificate): Unavailable,
// like a machine that is down, but waiting will not change it. In TLS 1.3
// a refused client certificate may also surface as a connection the
// server closed ("broken pipe"), which this cannot tell from a machine
// going down.
func Refused(err error) bool {
	if !Unreachable(err) {
		return false
	}
	msg := err.Error()
	for _, s := range []string{"authentication handshake failed", "tls: ", "x509: "} {
		if strings.Contains(msg, s) {
			return true
		}
	}
	return false
}

// Stage reads the machine's stage from its COSI MachineStatus: running,
// or rebooting, upgrading, shutting down, resetting while Talos runs that
// sequence (it keeps answering until the machine stops).
func Stage(ctx context.Context, c *talosclient.Client, node string) (runtime.MachineStage, error) {
	ms, err := safe.StateGetByID[*runtime.MachineStatus](talosclient.WithNode(ctx, node), c.COSI, runtime.MachineStatusID)
	if err != nil {
		return 0, fmt.Errorf("read machine status: %w", err)
	}
	return ms.TypedSpec().Stage, nil
}
